//! What the CSI layer measures itself: how long each CSI call took, by method and gRPC code
//! (`wasmcsi_csi_request_duration_seconds`), and, on a node that runs engines, the state of
//! every replicated volume attached there (`wasmcsi_replicated_volume_*`, read from the engines
//! at each scrape). The runtime's `Metrics` owns the backend series and the request counter;
//! this registry is the CSI layer's, so neither crate reaches into the other's, and the
//! `/metrics` endpoint in the binary writes both. One registry per process, like the CSI
//! socket it measures.
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::OnceLock;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    /// The gRPC code as `wasmcsi_csi_requests_total` spells it (`NotFound`).
    pub code: String,
}

fn request_histogram() -> Histogram {
    // 100 µs .. ~52 s: an Identity call is well under a millisecond, a NodeStage that runs
    // mkfs or waits on an rbd-fuse mount is seconds.
    Histogram::new(exponential_buckets(1e-4, 2.0, 20))
}

pub struct CsiMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Histogram, fn() -> Histogram>,
}

impl CsiMetrics {
    fn new() -> Self {
        let requests: Family<RequestLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(request_histogram);
        let mut registry = Registry::with_prefix("wasmcsi");
        registry.register(
            "csi_request_duration_seconds",
            "CSI request latency by method and gRPC code",
            requests.clone(),
        );
        Self { registry, requests }
    }

    /// Record one finished CSI call.
    pub fn observe(&self, method: &str, code: &str, seconds: f64) {
        self.requests.get_or_create(&RequestLabels { method: method.into(), code: code.into() }).observe(seconds);
    }

    /// The text exposition of these series, without the closing `# EOF` (the endpoint
    /// writes it once, after every registry).
    pub fn encode_without_eof(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode_registry(out, &self.registry)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeLabels {
    /// The replica set's id (the CSI id without its backend prefix): one series per volume
    /// attached on this node, so the label is bounded by what the node runs.
    pub volume: String,
}

/// The replicated volumes whose engines run in this process, as of `statuses` (one entry per
/// attached volume; see `DataPath::statuses`), in the text exposition without `# EOF`.
/// Built at every scrape from the engines' own status, so a volume detached from this node
/// leaves no stale series; the counters restart with the engine (a new attach), which
/// Prometheus' `rate` and `increase` read as a counter reset.
pub fn encode_replicated(
    statuses: &[(String, wasmcsi_block::volume::VolumeStatus)],
    out: &mut String,
) -> std::fmt::Result {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use std::sync::atomic::AtomicU64;
    type Bytes = Family<VolumeLabels, Gauge<u64, AtomicU64>>;
    let (replicas, healthy, rebuilding, done, size): (Bytes, Bytes, Bytes, Bytes, Bytes) = Default::default();
    let (rebuilt, rebuilds): (Family<VolumeLabels, Counter>, Family<VolumeLabels, Counter>) = Default::default();
    let seconds: Family<VolumeLabels, Counter<f64, AtomicU64>> = Family::default();
    for (id, s) in statuses {
        let labels = VolumeLabels { volume: id.clone() };
        replicas.get_or_create(&labels).set(s.replicas.len() as u64);
        healthy.get_or_create(&labels).set(s.healthy as u64);
        let (d, t) = s
            .rebuild
            .as_ref()
            .map_or((0, 0), |r| (r.done.saturating_mul(r.region_size), r.total.saturating_mul(r.region_size)));
        rebuilding.get_or_create(&labels).set(u64::from(s.rebuild.is_some()));
        done.get_or_create(&labels).set(d);
        size.get_or_create(&labels).set(t);
        rebuilt.get_or_create(&labels).inc_by(s.rebuilt_bytes);
        rebuilds.get_or_create(&labels).inc_by(s.rebuilds_finished);
        seconds.get_or_create(&labels).inc_by(s.rebuild_time.as_secs_f64());
    }
    let mut registry = Registry::with_prefix("wasmcsi_replicated_volume");
    registry.register("replicas", "Replicas of the volume attached on this node", replicas);
    registry.register("replicas_healthy", "Replicas that serve reads and acknowledge writes", healthy);
    registry.register("rebuilding", "1 while a replica of the volume is being rebuilt", rebuilding);
    registry.register("rebuild_done_bytes", "Bytes the running rebuild copied in its current phase", done);
    registry.register("rebuild_size_bytes", "Bytes the running rebuild copies in its current phase", size);
    registry.register("rebuilt_bytes", "Bytes rebuilds copied to their replicas since the engine started", rebuilt);
    registry.register("rebuild_seconds", "Time a rebuild was running since the engine started", seconds);
    registry.register("rebuilds", "Rebuilds that finished (a replica healthy again)", rebuilds);
    prometheus_client::encoding::text::encode_registry(out, &registry)
}

/// The process's CSI metrics.
pub fn global() -> &'static CsiMetrics {
    static METRICS: OnceLock<CsiMetrics> = OnceLock::new();
    METRICS.get_or_init(CsiMetrics::new)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn a_call_lands_in_its_method_and_code_bucket() {
        let m = CsiMetrics::new();
        m.observe("NodeStageVolume", "NotFound", 0.003);
        m.observe("NodeStageVolume", "NotFound", 0.5);
        let mut out = String::new();
        m.encode_without_eof(&mut out).unwrap();
        assert!(out.contains("# TYPE wasmcsi_csi_request_duration_seconds histogram"), "{out}");
        let count = out
            .lines()
            .find(|l| {
                l.starts_with("wasmcsi_csi_request_duration_seconds_count")
                    && l.contains(r#"method="NodeStageVolume""#)
                    && l.contains(r#"code="NotFound""#)
            })
            .unwrap_or_else(|| panic!("no count line: {out}"));
        assert!(count.ends_with(" 2"), "{count}");
        assert!(!out.contains("# EOF"), "{out}");
    }

    #[test]
    fn a_degraded_volume_shows_its_replicas_and_its_running_rebuild() {
        use wasmcsi_block::engine::{RebuildKind, RebuildPhase, RebuildStatus, ReplicaHealth};
        use wasmcsi_block::volume::VolumeStatus;
        let healthy = (ReplicaHealth::Healthy, None);
        let rebuilding = VolumeStatus {
            healthy: 2,
            replicas: vec![healthy, healthy, (ReplicaHealth::Rebuilding, Some(std::time::SystemTime::now()))],
            rebuild: Some(RebuildStatus {
                replica: 2,
                source: 0,
                kind: RebuildKind::Delta,
                phase: RebuildPhase::Head,
                done: 3,
                total: 10,
                region_size: 1 << 20,
            }),
            rebuilt_bytes: 3 << 20,
            rebuilds_finished: 1,
            rebuild_time: std::time::Duration::from_millis(1500),
            ..Default::default()
        };
        let idle = VolumeStatus { healthy: 2, replicas: vec![healthy; 2], ..Default::default() };
        let mut out = String::new();
        encode_replicated(&[("pvc-a".into(), rebuilding), ("pvc-b".into(), idle)], &mut out).unwrap();
        let value = |series: &str| -> String {
            let line = out.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series}:\n{out}"));
            line.rsplit(' ').next().unwrap().to_owned()
        };
        let a = r#"{volume="pvc-a"}"#;
        assert_eq!(value(&format!("wasmcsi_replicated_volume_replicas{a}")), "3");
        assert_eq!(value(&format!("wasmcsi_replicated_volume_replicas_healthy{a}")), "2");
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuilding{a}")), "1");
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuild_done_bytes{a}")), (3u64 << 20).to_string());
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuild_size_bytes{a}")), (10u64 << 20).to_string());
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuilt_bytes_total{a}")), (3u64 << 20).to_string());
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuilds_total{a}")), "1");
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuild_seconds_total{a}")), "1.5");
        let b = r#"{volume="pvc-b"}"#;
        assert_eq!(value(&format!("wasmcsi_replicated_volume_replicas_healthy{b}")), "2");
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuilding{b}")), "0");
        assert_eq!(value(&format!("wasmcsi_replicated_volume_rebuild_size_bytes{b}")), "0");
        assert!(out.contains("# TYPE wasmcsi_replicated_volume_rebuilt_bytes counter"), "{out}");
        assert!(!out.contains("# EOF"), "{out}");
    }
}
