//! A node's `/metrics` shows the replicated volumes its engines run, as an operator scrapes it:
//! a volume of two replicas staged on node-a (controller + node, its replica reached
//! in-process) with node-b's replica server in the same process; node-b's replica server
//! stops, writes go on, it comes back on the same address and root, and the scrape shows
//! healthy → degraded → rebuilding or rebuilt → healthy, with the rebuild's bytes, duration
//! and count; `wasmcsi volume status --replica …` (the real binary) says the same. The backend
//! is the bundled component loaded from disk.
//!
//! Skipped (saying why) when not root or without /dev/fuse.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use wasmcsi_block::replica::NodeIdentity;
use wasmcsi_datapath::{DataPath, DataPathConfig};
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::csi::{
    Paths, clients, controller_publish, controller_unpublish, stage_and_publish, unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options, Sweep, volume_status};

const MIB: u64 = 1 << 20;

/// node-b: only a replica server (no CSI socket: nothing is staged there).
async fn replica_node(home: &Path, listen: SocketAddr) -> DataPath {
    DataPath::start(DataPathConfig {
        identity: NodeIdentity { node: "node-b".into(), labels: vec![] },
        replica_root: home.join("replicas"),
        replica_disks: Vec::new(),
        listen,
        engine_root: home.join("engines"),
        runtime_root: home.join("run"),
        request_timeout: Duration::from_secs(10),
        attach_timeout: Duration::from_secs(30),
        transport: wasmcsi_block::transport::Transport::Plain,
        limits: wasmcsi_trust::Limits::default(),
    })
    .await
    .expect("node-b's replica server")
}

async fn scrape(addr: SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}

/// The value of the series `name{volume="…"}`, if the scrape has it.
fn value(text: &str, name: &str, volume: &str) -> Option<f64> {
    let series = format!("{name}{{volume=\"{volume}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&series)).map(|v| v.trim().parse().unwrap())
}

/// Scrapes until `pred` holds (30 s at most); the last scrape.
async fn scrape_until(addr: SocketAddr, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(addr).await;
        if pred(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "{what}: never seen in /metrics:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The demo's and the benchmark's replica node (`wasmcsi serve --mode node` as a child
/// process): killed with SIGKILL, it is gone at once; restarted, it serves the replica it held,
/// written and flushed before the kill, on the same address.
#[test]
fn a_replica_node_process_killed_and_restarted_serves_its_replicas_again() {
    use wasmcsi::replica_process::ReplicaProcess;
    use wasmcsi_block::control::{ReplicaServerClient, ReplicaSession};
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let exe = Path::new(env!("CARGO_BIN_EXE_wasmcsi"));
        let mut node = ReplicaProcess::start(exe, &dir.path().join("n"), "node-n").await.unwrap();
        let (addr, pid) = (node.addr(), node.pid().unwrap());
        let timeout = Duration::from_secs(5);
        assert_eq!(ReplicaServerClient::new(addr, timeout).identify().await.unwrap().node, "node-n");
        ReplicaServerClient::new(addr, timeout).create_replica("vol-k", 8 * MIB).await.unwrap();
        let mut session = ReplicaSession::open(addr, "vol-k", timeout).await.unwrap();
        session.write(MIB, vec![0x7e; 4096]).await.unwrap();
        session.flush().await.unwrap();
        drop(session);

        node.kill();
        assert!(node.pid().is_none());
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "pid {pid} is reaped");
        assert!(ReplicaServerClient::new(addr, timeout).identify().await.is_err(), "nothing answers on {addr}");

        node.restart().await.unwrap();
        assert_eq!(node.addr(), addr);
        let mut session = ReplicaSession::open(addr, "vol-k", timeout).await.unwrap();
        assert_eq!(session.read(MIB, 4096).await.unwrap(), vec![0x7e; 4096]);
    });
}

#[test]
fn metrics_show_a_staged_volume_degraded_then_rebuilt() {
    support::run_with_fuse(flow());
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let _sweep = Sweep(dir.path().to_owned());
    let nodes_file = dir.path().join("replica-nodes");
    let home_a = dir.path().join("node-a");
    let options = Options { metrics: true, ..Default::default() };
    let a = support::replicated::host(&home_a, "node-a", wasmcsi_csi::Mode::All, &nodes_file, options).await;
    let home_b = dir.path().join("node-b");
    let b = replica_node(&home_b, "127.0.0.1:0".parse().unwrap()).await;
    let b_addr = b.local_addr();
    let a_addr = a.datapath.as_ref().expect("node-a's data path").local_addr();
    std::fs::write(&nodes_file, format!("{a_addr}\n{b_addr}\n")).unwrap();
    let metrics = a.metrics_addr.expect("node-a serves /metrics");

    let (mut ctl, mut node) = clients(&a.socket).await;
    let cap = support::single_node_writer(None);
    let params: HashMap<String, String> = [("backend", BACKEND), ("numberOfReplicas", "2")]
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect();
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-metrics".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 64 * MIB as i64, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: params,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    // The metrics' label is the replica set's id: the CSI id without its backend.
    let set = v.volume_id.split_once(':').map(|(_, s)| s.to_owned()).unwrap();
    let publish_context = controller_publish(&mut ctl, &v, "node-a", &cap).await.unwrap();
    let p = Paths {
        staging: dir.path().join("kubelet/staging/pvc-metrics"),
        target: dir.path().join("kubelet/pods/pod/dev"),
    };
    stage_and_publish(&mut node, &v, &publish_context, &p, &cap).await;

    let healthy = |n: f64| {
        let set = set.clone();
        move |t: &str| value(t, "wasmcsi_replicated_volume_replicas_healthy", &set) == Some(n)
    };
    let text = scrape_until(metrics, "2 healthy replicas", healthy(2.0)).await;
    assert_eq!(value(&text, "wasmcsi_replicated_volume_replicas", &set), Some(2.0), "{text}");
    assert_eq!(value(&text, "wasmcsi_replicated_volume_rebuilding", &set), Some(0.0), "{text}");
    assert_eq!(value(&text, "wasmcsi_replicated_volume_rebuilds_total", &set), Some(0.0), "{text}");
    assert!(text.contains("# TYPE wasmcsi_replicated_volume_rebuild_seconds counter"), "{text}");
    assert!(text.trim_end().ends_with("# EOF"), "{text}");

    // node-b's replica server goes away; writes go on on node-a's replica alone.
    b.shutdown().await.unwrap();
    drop(b);
    let written = 4 * MIB;
    let device = p.target.clone();
    tokio::task::spawn_blocking(move || {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&device).unwrap();
        f.seek(SeekFrom::Start(16 * MIB)).unwrap();
        f.write_all(&vec![0x5a; written as usize]).unwrap();
        f.sync_all().unwrap();
    })
    .await
    .unwrap();
    let text = scrape_until(metrics, "1 healthy replica", healthy(1.0)).await;
    assert_eq!(value(&text, "wasmcsi_replicated_volume_replicas", &set), Some(2.0), "{text}");
    let status = volume_status(&set, &[a_addr, b_addr]).await;
    assert!(status.contains("attached to node-a") && status.contains("1/2 healthy (degraded)"), "{status}");
    assert!(status.lines().any(|l| l.trim_start().starts_with("node-b/default  unreachable")), "{status}");

    // It comes back with its replica: a delta rebuild copies what it missed.
    let b = replica_node(&home_b, b_addr).await;
    let text = scrape_until(metrics, "the rebuild finished", |t| {
        healthy(2.0)(t) && value(t, "wasmcsi_replicated_volume_rebuilds_total", &set) == Some(1.0)
    })
    .await;
    let rebuilt = value(&text, "wasmcsi_replicated_volume_rebuilt_bytes_total", &set).unwrap();
    assert!(rebuilt >= written as f64, "{rebuilt} bytes rebuilt, {written} were missed:\n{text}");
    assert!(rebuilt < (64 * MIB) as f64, "a delta rebuild, not a full one: {rebuilt} bytes:\n{text}");
    let seconds = value(&text, "wasmcsi_replicated_volume_rebuild_seconds_total", &set).unwrap();
    assert!(seconds > 0.0 && seconds < 30.0, "{seconds} s of rebuilding:\n{text}");
    assert_eq!(value(&text, "wasmcsi_replicated_volume_rebuilding", &set), Some(0.0), "{text}");
    assert_eq!(value(&text, "wasmcsi_replicated_volume_rebuild_size_bytes", &set), Some(0.0), "{text}");
    let status = volume_status(&set, &[a_addr, b_addr]).await;
    assert!(status.contains("2/2 healthy") && !status.contains("degraded"), "{status}");

    // Unstaged: the engine stops and its series go with it.
    unpublish_and_unstage(&mut node, &v, &p).await;
    let text = scrape(metrics).await;
    assert_eq!(value(&text, "wasmcsi_replicated_volume_replicas", &set), None, "{text}");
    controller_unpublish(&mut ctl, &v, "node-a").await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await.unwrap();
    drop((ctl, node));
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
