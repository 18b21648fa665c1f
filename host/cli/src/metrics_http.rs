//! The Prometheus `/metrics` endpoint: a plain HTTP/1 server that answers GET /metrics
//! with the text exposition and 404 otherwise. The exposition is the runtime's series, the
//! CSI layer's, those of the replicated volumes whose engines this node runs, this process's
//! certificate and listeners ([`TrustSeries`]) and `wasmcsi_build_info`, closed by one `# EOF`.
//!
//! It is reachable from the network (Prometheus scrapes it), so nothing it suffers may reach the
//! CSI socket: it runs on a thread of its own with a single-threaded runtime of its own, behind
//! the product's bounded accept loop (`wasmcsi_trust::Listener` in plaintext mode: [`LIMITS`],
//! back-off when descriptors run out), and every connection has read and write timeouts
//! ([`READ_TIMEOUT`], [`WRITE_TIMEOUT`]), so a client that connects and sends nothing, or reads
//! nothing, holds its slot for seconds, not forever.
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use wasmcsi_datapath::DataPath;
use wasmcsi_runtime::metrics::Metrics;
use wasmcsi_trust::LiveCredentials;
use wasmcsi_trust::listener::{Limits, Listener, PlainConnection, Stats, Timeouts};

/// Connections at once: Prometheus keeps one per target and scraper; a few scrapers, a person
/// with curl and some slack fit.
pub const LIMITS: Limits = Limits {
    max_connections: 64,
    max_per_source: 16,
    // Plaintext: no handshake; these two bound nothing here.
    handshake_timeout: Duration::from_secs(5),
    handshake_budget: 16 * 1024,
};
/// A request (or the next one on a kept-alive connection) must arrive within this.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The scraper must take the answer's bytes within this.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bind `addr` and serve on a thread of its own (see the module doc); returns the bound address
/// (port 0 picks one). `datapath`: this node's engines, when it runs them. The server stops when
/// the runtime this is called on shuts down (a host in a test), or with the process.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    datapath: Option<Arc<DataPath>>,
    mut trust: TrustSeries,
) -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Dropped with the caller's runtime (its task is dropped then): the metrics thread ends.
    let (keep, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _keep = keep;
        std::future::pending::<()>().await
    });
    std::thread::Builder::new().name("metrics-http".into()).spawn(move || {
        runtime.block_on(async move {
            let tcp = match tokio::net::TcpListener::from_std(listener) {
                Ok(tcp) => tcp,
                Err(e) => return tracing::error!(addr = %bound, error = %e, "serving /metrics"),
            };
            let listener = Listener::new(tcp, LIMITS);
            trust.listeners.push(("metrics", listener.stats()));
            let trust = Arc::new(trust);
            let served = listener.serve_plain(move |connection| {
                serve_connection(connection, metrics.clone(), datapath.clone(), trust.clone())
            });
            tokio::select! {
                _ = stopped => {}
                result = served => if let Err(e) = result {
                    tracing::error!(addr = %bound, error = %e, "the /metrics listener failed");
                },
            }
        })
    })?;
    Ok(bound)
}

async fn serve_connection(
    connection: PlainConnection,
    metrics: Arc<Metrics>,
    datapath: Option<Arc<DataPath>>,
    trust: Arc<TrustSeries>,
) {
    let PlainConnection { stream, permit, .. } = connection;
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let (metrics, datapath, trust) = (metrics.clone(), datapath.clone(), trust.clone());
        async move {
            if req.uri().path() == "/metrics" {
                Response::builder()
                    .header("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
                    .body(Full::new(Bytes::from(exposition(&metrics, datapath.as_deref(), &trust))))
            } else {
                Response::builder().status(StatusCode::NOT_FOUND).body(Full::new(Bytes::from_static(b"not found\n")))
            }
        }
    });
    let io = TokioIo::new(Timeouts::new(stream, READ_TIMEOUT, WRITE_TIMEOUT));
    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
    drop(permit);
}

/// What a process shows of its trust: its certificate's remaining life (read at every scrape,
/// so a reload shows at once) and the counters of its bounded listeners, by name (`peer`,
/// `authority`, `metrics`, …).
#[derive(Clone, Default)]
pub struct TrustSeries {
    pub credentials: Option<LiveCredentials>,
    pub listeners: Vec<(&'static str, Arc<Stats>)>,
}

impl TrustSeries {
    fn encode(&self, out: &mut String) -> std::fmt::Result {
        use prometheus_client::metrics::counter::Counter;
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        use std::sync::atomic::Ordering::Relaxed;
        type Labels = Vec<(&'static str, &'static str)>;
        let mut registry = prometheus_client::registry::Registry::with_prefix("wasmcsi");
        if let Some(credentials) = &self.credentials {
            let role = match credentials.current().role() {
                wasmcsi_trust::Role::Controller => "controller",
                wasmcsi_trust::Role::Node(_) => "node",
            };
            let expiry = Family::<Labels, Gauge<i64>>::default();
            expiry.get_or_create(&vec![("role", role)]).set(credentials.seconds_to_expiry());
            registry.register(
                "tls_certificate_expiry_seconds",
                "Seconds until this process's certificate expires (negative once it has), as loaded now",
                expiry,
            );
        }
        let open = Family::<Labels, Gauge<i64>>::default();
        let accepted = Family::<Labels, Counter<u64>>::default();
        let refused = Family::<Labels, Counter<u64>>::default();
        for (name, stats) in &self.listeners {
            let name = *name;
            open.get_or_create(&vec![("listener", name)])
                .set(i64::try_from(stats.open.load(Relaxed)).unwrap_or(i64::MAX));
            accepted.get_or_create(&vec![("listener", name)]).inc_by(stats.accepted.load(Relaxed));
            for (reason, counter) in [
                ("total_cap", &stats.refused_total_cap),
                ("per_source_cap", &stats.refused_per_source_cap),
                ("handshake_failed", &stats.handshakes_failed),
                ("handshake_timed_out", &stats.handshakes_timed_out),
                ("handshake_over_budget", &stats.handshakes_over_budget),
                ("accept_error", &stats.accept_errors),
            ] {
                refused.get_or_create(&vec![("listener", name), ("reason", reason)]).inc_by(counter.load(Relaxed));
            }
        }
        if !self.listeners.is_empty() {
            registry.register("listener_connections", "Connections a listener holds open now", open);
            registry.register("listener_accepted", "Connections a listener accepted from the kernel", accepted);
            registry.register(
                "listener_refusals",
                "Connections a listener closed before serving them, by reason (a cap, a failed, late or oversized TLS handshake, a failed accept)",
                refused,
            );
        }
        prometheus_client::encoding::text::encode_registry(out, &registry)
    }
}

/// Everything `/metrics` answers, as one OpenMetrics text.
pub fn exposition(metrics: &Metrics, datapath: Option<&DataPath>, trust: &TrustSeries) -> String {
    const EOF: &str = "# EOF\n";
    let mut out = metrics.encode();
    if out.ends_with(EOF) {
        out.truncate(out.len() - EOF.len());
    }
    // Writing into a String cannot fail; an error would only cut the text short.
    let _ = wasmcsi_csi::metrics::global().encode_without_eof(&mut out);
    if let Some(d) = datapath {
        let _ = wasmcsi_csi::metrics::encode_replicated(&d.statuses(), &mut out);
        let rbd_fuse = d.rbd_fuse_list();
        let alive = rbd_fuse.iter().filter(|v| v.alive).count();
        let _ = encode_handovers(&d.handover_report(), d.attached().len(), (alive, rbd_fuse.len() - alive), &mut out);
        let _ = encode_grant_renewal_failures(d.grant_renewal_failures(), &mut out);
    }
    let _ = trust.encode(&mut out);
    let mut build = prometheus_client::registry::Registry::with_prefix("wasmcsi");
    build.register(
        "build",
        "The running wasmcsi: its version",
        prometheus_client::metrics::info::Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
    );
    let _ = prometheus_client::encoding::text::encode(&mut out, &build);
    out
}

/// Renewals of attached volumes' grants that failed (each retried with back-off).
fn encode_grant_renewal_failures(failures: u64, out: &mut String) -> std::fmt::Result {
    let mut registry = prometheus_client::registry::Registry::with_prefix("wasmcsi");
    let counter = prometheus_client::metrics::counter::Counter::<u64>::default();
    counter.inc_by(failures);
    registry.register(
        "grant_renewal_failures",
        "Renewals of an attached volume's grant that failed (retried with back-off; open sessions keep running)",
        counter,
    );
    prometheus_client::encoding::text::encode_registry(out, &registry)
}

/// The data path's own series: volumes it serves, the rbd-fuse daemons it runs (alive, dead),
/// live upgrades it went through, and the longest I/O pause of a volume in the last one.
fn encode_handovers(
    report: &wasmcsi_datapath::handover::HandoverReport,
    volumes: usize,
    (alive, dead): (usize, usize),
    out: &mut String,
) -> std::fmt::Result {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    let mut registry = prometheus_client::registry::Registry::with_prefix("wasmcsi_datapath");
    let served = Gauge::<i64>::default();
    served.set(i64::try_from(volumes).unwrap_or(i64::MAX));
    registry.register("volumes", "Replicated volumes this data path serves", served);
    let daemons =
        prometheus_client::metrics::family::Family::<Vec<(&'static str, &'static str)>, Gauge<i64>>::default();
    daemons.get_or_create(&vec![("state", "alive")]).set(i64::try_from(alive).unwrap_or(i64::MAX));
    daemons.get_or_create(&vec![("state", "dead")]).set(i64::try_from(dead).unwrap_or(i64::MAX));
    registry.register(
        "rbd_fuse_attachments",
        "rbd-fuse daemons this data path runs for RBD volumes staged here (dead: exited, not yet detached)",
        daemons,
    );
    let handovers = Counter::<u64>::default();
    handovers.inc_by(report.handovers);
    registry.register(
        "handovers",
        "Live upgrades this data path went through (wasmcsi upgrade datapath), its pid unchanged",
        handovers,
    );
    let pause = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    pause.set(report.last_pause_us.unwrap_or(0) as f64 / 1e6);
    registry.register(
        "last_handover_pause_seconds",
        "The longest I/O pause of a volume in the last live upgrade (0 before the first)",
        pause,
    );
    prometheus_client::encoding::text::encode_registry(out, &registry)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use std::collections::BTreeSet;
    use wasmcsi_trust::listener::Stats;

    /// Every `wasmcsi_*` series a file names, as the metric family it belongs to.
    fn families_named_in(text: &str) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for (i, _) in text.match_indices("wasmcsi_") {
            let name: String =
                text[i..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit()).collect();
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name)
                .to_string();
            names.insert(family);
        }
        names
    }

    /// Every family the host exports, each with one sample: prometheus-client writes nothing,
    /// not even `# TYPE`, for a family without one.
    fn exported() -> String {
        use wasmcsi_runtime::metrics::{
            BackendInfoLabels, BackendLabels, CallLabels, ErrorLabels, Metrics, SourceLabels,
        };
        let m = Metrics::new();
        let call = CallLabels { backend: "b".into(), op: "create".into() };
        let backend = BackendLabels { backend: "b".into() };
        m.calls.get_or_create(&call).inc();
        m.errors
            .get_or_create(&ErrorLabels {
                backend: "b".into(),
                op: "create".into(),
                code: "Internal".into(),
                kind: "trap".into(),
            })
            .inc();
        m.latency.get_or_create(&call).observe(0.1);
        for counter in [&m.traps, &m.timeouts, &m.reloads, &m.rejected] {
            counter.get_or_create(&backend).inc();
        }
        for gauge in [&m.memory_peak, &m.kv_bytes, &m.kv_keys] {
            gauge.get_or_create(&backend).set(1);
        }
        // Which build serves, and a source that cannot be pulled (the rollout panel and alerts).
        let source = "oci://registry.example/b@sha256:00";
        let info = BackendInfoLabels {
            backend: "b".into(),
            digest: "sha256:00".into(),
            source: source.into(),
            contract: "wasmcsi:backend@0.3.0".into(),
        };
        m.backend_info.get_or_create(&info).set(1);
        m.source_failing.get_or_create(&SourceLabels { backend: "b".into(), source: source.into() }).set(1);
        m.rpc("Probe", "OK");
        wasmcsi_csi::metrics::global().observe("Probe", "OK", 0.001);
        let mut out = super::exposition(&m, None, &Default::default());
        // A node's replicated volumes (their families are written only where engines run).
        let volume = wasmcsi_block::volume::VolumeStatus { healthy: 1, ..Default::default() };
        wasmcsi_csi::metrics::encode_replicated(&[("v".into(), volume)], &mut out).unwrap();
        let report = wasmcsi_datapath::handover::HandoverReport {
            handovers: 2,
            last_pause_us: Some(40_000),
            ..Default::default()
        };
        super::encode_handovers(&report, 3, (2, 1), &mut out).unwrap();
        out.push_str(&trust_exposition());
        out
    }

    /// A controller's certificate and two listeners' counters, as a process shows them.
    fn trust_exposition() -> String {
        use std::sync::Arc;
        use std::sync::atomic::Ordering::Relaxed;
        use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
        use wasmcsi_trust::{Credentials, LiveCredentials, Role};
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let issued = ca.issue(&Role::Controller, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap();
        issued.write(dir.path(), ca.bundle()).unwrap();
        let credentials = LiveCredentials::new(Credentials::load(dir.path()).unwrap());
        let (peer, metrics) = (Arc::new(Stats::default()), Arc::new(Stats::default()));
        peer.open.store(2, Relaxed);
        peer.accepted.store(7, Relaxed);
        peer.handshakes_failed.store(3, Relaxed);
        metrics.refused_per_source_cap.store(1, Relaxed);
        let series = super::TrustSeries {
            credentials: Some(credentials),
            listeners: vec![("peer", peer), ("metrics", metrics)],
        };
        let mut out = String::new();
        series.encode(&mut out).unwrap();
        out
    }

    #[test]
    fn a_process_shows_its_certificate_s_life_and_its_listeners_counters() {
        let text = trust_exposition();
        let expiry: i64 = text
            .lines()
            .find_map(|l| l.strip_prefix("wasmcsi_tls_certificate_expiry_seconds{role=\"controller\"} "))
            .unwrap_or_else(|| panic!("{text}"))
            .parse()
            .unwrap();
        // Issued now for 24 h (the CA backdates the start, not the end).
        assert!((23 * 3600..=24 * 3600).contains(&expiry), "{expiry}");
        for line in [
            "wasmcsi_listener_connections{listener=\"peer\"} 2",
            "wasmcsi_listener_accepted_total{listener=\"peer\"} 7",
            "wasmcsi_listener_refusals_total{listener=\"peer\",reason=\"handshake_failed\"} 3",
            "wasmcsi_listener_refusals_total{listener=\"metrics\",reason=\"per_source_cap\"} 1",
            "wasmcsi_listener_refusals_total{listener=\"metrics\",reason=\"handshake_failed\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
    }

    #[test]
    fn the_data_path_reports_its_handovers_and_the_last_pause() {
        let text = exported();
        assert!(text.contains("wasmcsi_datapath_handovers_total 2"), "{text}");
        assert!(text.contains("wasmcsi_datapath_last_handover_pause_seconds 0.04"), "{text}");
        assert!(text.contains("wasmcsi_datapath_volumes 3"), "{text}");
        assert!(text.contains("wasmcsi_datapath_rbd_fuse_attachments{state=\"alive\"} 2"), "{text}");
        assert!(text.contains("wasmcsi_datapath_rbd_fuse_attachments{state=\"dead\"} 1"), "{text}");
    }

    #[test]
    fn the_exposition_holds_every_registry_build_info_and_one_eof() {
        wasmcsi_csi::metrics::global().observe("Probe", "OK", 0.001);
        let text = super::exposition(&wasmcsi_runtime::metrics::Metrics::new(), None, &Default::default());
        let want = format!("wasmcsi_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
        assert!(text.lines().any(|l| l == want), "no `{want}`:\n{text}");
        assert!(text.contains("wasmcsi_csi_request_duration_seconds_count{method=\"Probe\",code=\"OK\"}"), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn the_dashboard_and_the_alerts_read_only_metrics_the_host_exports() {
        let exported = exported();
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/chart");
        for file in ["dashboards/wasmcsi.json", "templates/monitoring.yaml"] {
            let text = std::fs::read_to_string(deploy.join(file)).unwrap();
            let used = families_named_in(&text);
            assert!(used.len() >= 5, "{file} names too few metrics: {used:?}");
            for family in used {
                assert!(
                    exported.contains(&format!("# TYPE {family} ")),
                    "{file} reads {family}, which is not exported"
                );
            }
        }
    }
}
