//! The `tls` part: the same 2-replica engine over loopback TCP, once with plaintext replica
//! servers and once over mutual TLS (`required` servers, the engine with a node's credentials
//! and the volume's grant signed by a controller key), both alive at once and run alternately
//! (plaintext, TLS, plaintext, …) so each median pair saw the same machine. Also the engine's
//! attach time (connect, handshake, `Hello` with the grant, replica open) of each, which is what
//! a reconnect costs.
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use wasmcsi_benchkit::fio::{Res, Runs, SHAPES};
use wasmcsi_block::protocol::RecordInfo;
use wasmcsi_block::replica::{NodeIdentity, ReplicaNode, ReplicaServer, ServerConfig};
use wasmcsi_block::transport::Transport;
use wasmcsi_block::volume::{ReplicaEndpoint, ReplicatedVolume, VolumeConfig, VolumeGrant};
use wasmcsi_frontend::BlockDevice;
use wasmcsi_trust::credentials::Credentials;
use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
use wasmcsi_trust::{Grant, LiveCredentials, Role};

use super::{Device, create_replicas, engine_config, prefill, run_job, runtime};

const NODE: &str = "bench-node";
const SERVERS: [&str; 2] = ["bench-s0", "bench-s1"];

/// A CA of its own and credentials it issued, each in a directory under `root`.
struct Pki {
    ca: Authority,
    root: std::path::PathBuf,
}

impl Pki {
    fn credentials(&self, role: &Role, name: &str) -> LiveCredentials {
        let dir = self.root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let issued = self.ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap();
        issued.write(&dir, &[self.ca.certificate().clone()]).unwrap();
        LiveCredentials::new(Credentials::load(&dir).unwrap())
    }
}

/// Two replica servers and an engine of one volume, plaintext or TLS.
struct Pair {
    volume: Arc<ReplicatedVolume>,
    servers: Vec<ReplicaServer>,
    server_rt: tokio::runtime::Runtime,
    _engine_rt: tokio::runtime::Runtime,
    /// Engine start until both replicas are healthy.
    attach: Duration,
}

impl Pair {
    fn start(root: &Path, id: &str, size: u64, pki: Option<&Pki>) -> Pair {
        let nodes = create_replicas(root, id, size);
        let server_rt = runtime("replica");
        let servers: Vec<ReplicaServer> = nodes
            .iter()
            .zip(SERVERS)
            .map(|(dir, name)| {
                let node = Arc::new(ReplicaNode::open(dir).unwrap());
                let config = match pki {
                    None => ServerConfig::plaintext(),
                    Some(pki) => {
                        // A TLS server authorizes a session against the volume's record.
                        node.set_record(id, RecordInfo { version: 1, epoch: 0, data: b"{}".to_vec() }).unwrap();
                        ServerConfig {
                            identity: NodeIdentity { node: name.into(), labels: Vec::new() },
                            transport: Transport::Required(pki.credentials(&Role::Node(name.into()), name)),
                            ..ServerConfig::plaintext()
                        }
                    }
                };
                let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
                server_rt.block_on(ReplicaServer::serve(any, node, config)).unwrap()
            })
            .collect();
        let replicas = servers.iter().map(|s| ReplicaEndpoint::Remote(s.local_addr())).collect();
        let engine_rt = runtime("engine");
        let mut config = VolumeConfig::new(engine_config(id, size), replicas, root.join(format!("{id}-state")));
        if let Some(pki) = pki {
            let controller = pki.credentials(&Role::Controller, &format!("{id}-controller"));
            let now = SystemTime::now();
            let grant = Grant {
                volume: id.into(),
                node: NODE.into(),
                epoch: 0,
                not_before: now,
                not_after: now + Duration::from_secs(24 * 3600),
            };
            let signed = grant.sign(&controller.current()).unwrap().encoded;
            config.transport = Transport::Required(pki.credentials(&Role::Node(NODE.into()), &format!("{id}-node")));
            config.nodes = SERVERS.iter().map(|n| Some((*n).to_owned())).collect();
            config.grant = Some(Arc::new(VolumeGrant::new(Some(signed))));
        }
        let started = Instant::now();
        let volume = Arc::new(ReplicatedVolume::start(config, engine_rt.handle()).unwrap());
        let healthy = volume.wait_for(Duration::from_secs(60), |s| s.attached && s.healthy == 2);
        assert!(healthy, "{id} never became healthy: {:?}", volume.status());
        let attach = started.elapsed();
        Pair { volume, servers, server_rt, _engine_rt: engine_rt, attach }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.volume.shutdown();
        for s in self.servers.drain(..) {
            let _ = self.server_rt.block_on(s.shutdown());
        }
    }
}

/// One row per shape: (plaintext, TLS) runs; and the attach times.
pub struct TlsRows {
    pub rows: Vec<(Runs, Runs)>,
    /// Context switches per I/O of each run, (plaintext, TLS), per shape.
    pub switches: Vec<(Vec<f64>, Vec<f64>)>,
    pub attach_plain: Vec<Duration>,
    pub attach_tls: Vec<Duration>,
}

pub fn run(root: &Path, ws: u64, secs: f64, runs: usize) -> TlsRows {
    let pki = Pki {
        ca: Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap(),
        root: root.join("tls-pki"),
    };
    // Attach times: a fresh engine each time, alternating.
    let (mut attach_plain, mut attach_tls) = (Vec::new(), Vec::new());
    for i in 0..runs.max(3) {
        attach_plain.push(Pair::start(root, &format!("bench-attach-p{i}"), 16 << 20, None).attach);
        attach_tls.push(Pair::start(root, &format!("bench-attach-t{i}"), 16 << 20, Some(&pki)).attach);
    }
    let plain = Pair::start(root, "bench-tls-off", ws, None);
    let tls = Pair::start(root, "bench-tls-on", ws, Some(&pki));
    for p in [&plain, &tls] {
        prefill(&Device(p.volume.as_ref()), ws);
        p.volume.flush().unwrap();
    }
    let mut switches = Vec::new();
    let rows = SHAPES
        .iter()
        .map(|shape| {
            eprintln!("tls: {}", shape.name);
            let (mut off, mut on): (Vec<Res>, Vec<Res>) = (Vec::new(), Vec::new());
            let (mut sw_off, mut sw_on) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                for (pair, res, sw) in [(&plain, &mut off, &mut sw_off), (&tls, &mut on, &mut sw_on)] {
                    let before = context_switches();
                    let got = run_job(&Device(pair.volume.as_ref()), shape, ws, secs, 1).0;
                    let ios: f64 = got.iter().map(|r| r.iops * secs).sum();
                    sw.push(context_switches().saturating_sub(before) as f64 / ios.max(1.0));
                    res.extend(got);
                }
            }
            switches.push((sw_off, sw_on));
            (Runs(off), Runs(on))
        })
        .collect();
    TlsRows { rows, switches, attach_plain, attach_tls }
}

/// Context switches (voluntary and not) of every thread of this process so far, those that
/// ended included: the engine, the replica servers and the job's threads all run here, so a
/// wakeup more per I/O in one transport shows as a difference of the two.
fn context_switches() -> u64 {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_SELF)
        .map(|u| (u.voluntary_context_switches() + u.involuntary_context_switches()) as u64)
        .unwrap_or(0)
}

/// The table, and the issue's goals judged on medians.
pub fn print(t: &TlsRows) {
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    println!();
    println!("TLS: the 2-replica engine over loopback TCP, plaintext vs mutual TLS, run alternately; medians");
    println!(
        "{:<18} {:>12} {:>12} {:>7} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "job", "plain IOPS", "TLS IOPS", "TLS/pl", "plain µs", "TLS µs", "cpu pl", "cpu TLS", "csw/IO pl", "csw/IO TLS"
    );
    let median_of = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    for ((shape, (off, on)), (sw_off, sw_on)) in SHAPES.iter().zip(&t.rows).zip(&t.switches) {
        let (a, b) = (off.median(), on.median());
        println!(
            "{:<18} {:>12.0} {:>12.0} {:>7.2} {:>10.1} {:>10.1} {:>9.1} {:>9.1} {:>9.2} {:>9.2}",
            shape.name,
            a.iops,
            b.iops,
            b.iops / a.iops.max(1.0),
            a.lat_us,
            b.lat_us,
            a.cpu_us,
            b.cpu_us,
            median_of(sw_off),
            median_of(sw_on)
        );
    }
    let (pa, ta) = (median(t.attach_plain.clone()), median(t.attach_tls.clone()));
    println!("attach (connect + handshake + Hello + open, both replicas): plain {pa:.2?}, TLS {ta:.2?}");
    let ratio = |i: usize| t.rows[i].1.median().iops / t.rows[i].0.median().iops.max(1.0);
    let qd1 = t.rows[0].1.median().lat_us - t.rows[0].0.median().lat_us;
    println!(
        "goals: 4k randwrite QD32 {:.2}x (>= 0.9) {}; 4k randread QD32 {:.2}x (>= 0.9) {}; QD1 write +{qd1:.1} µs (<= 15) {}",
        ratio(1),
        if ratio(1) >= 0.9 { "met" } else { "NOT met" },
        ratio(2),
        if ratio(2) >= 0.9 { "met" } else { "NOT met" },
        if qd1 <= 15.0 { "met" } else { "NOT met" },
    );
}
