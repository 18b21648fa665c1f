//! The sandbox end to end: a whole host in this process, the hostile fixture and the hostpath
//! example side by side in its backends directory, and a real gRPC client on the CSI socket.
//! Each way the hostile guest misbehaves must come back as one clean gRPC error for that
//! call, within its deadline, while hostpath keeps serving; an ungranted import keeps the
//! component out and shows in the metrics endpoint. (`host/runtime/tests/all/sandbox.rs` pins
//! the same limits one layer down, without gRPC.)
#![allow(clippy::unwrap_used, reason = "tests")]
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic::transport::Channel;
use wasmcsi::host::{Host, HostOptions, connect};
use wasmcsi_csi::Mode;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_proto::csi::v1::identity_client::IdentityClient;
use wasmcsi_runtime::config::HostConfig;

const DEADLINE: Duration = Duration::from_millis(500);
/// What a loaded 2-core machine may add between a guest's deadline and the caller getting its
/// answer. The bound only has to tell a call stopped at its deadline from one that is not (a
/// spinning guest never ends); how late the answers come is measured by
/// `cargo bench --workspace --bench backend_call -- neighbour`.
const SLACK: Duration = Duration::from_secs(1);

/// The timing asserts measure the host, not a neighbour test compiling components on the
/// same (2-CPU) machine: the tests of this file run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// hostpath granted `ROOT/hostpath`; hostile limited to 500 ms / 32 MiB and granted
/// `ROOT/hostile` only when `hostile_gets_dir`.
fn config(root: &Path, hostile_gets_dir: bool) -> HostConfig {
    let grant = if hostile_gets_dir {
        format!("[backends.hostile.grants]\ndir = {{ default = \"{}/hostile\" }}\n", root.display())
    } else {
        String::new()
    };
    let text = format!(
        "[backends.hostpath.grants]\ndir = {{ default = \"{root}/hostpath\" }}\n\
         [backends.hostile]\ncall_deadline_ms = {deadline}\nmemory_limit_mib = 32\nimport_timeout_ms = 400\n{grant}",
        root = root.display(),
        deadline = DEADLINE.as_millis(),
    );
    HostConfig::parse(&text, Path::new("hostile-test")).unwrap()
}

/// Start a controller host over `dir` with both components in its backends directory.
async fn start_host(dir: &Path, hostile_gets_dir: bool) -> Host {
    for sub in ["hostpath", "hostile", "backends", "state"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    std::fs::write(dir.join("backends/hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    std::fs::write(dir.join("backends/hostile.wasm"), wasmcsi_artifacts::HOSTILE).unwrap();
    Host::start(HostOptions {
        driver_name: "hostile.test.wasmcsi.io".into(),
        mode: Mode::Controller,
        node_id: "node-1".into(),
        socket: dir.join("csi.sock"),
        config: config(dir, hostile_gets_dir),
        config_file: None,
        backends_dir: Some(dir.join("backends")),
        state_dir: dir.join("state"),
        reload_interval: Duration::from_secs(1),
        metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
        replicas: None,
        reconcile: None,
    })
    .await
    .unwrap()
}

fn create_request(name: &str, params: &[(&str, &str)], capacity: Option<i64>) -> csi::CreateVolumeRequest {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode as AM};
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: capacity.map(|required_bytes| csi::CapacityRange { required_bytes, limit_bytes: 0 }),
        volume_capabilities: vec![csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: AM::SingleNodeWriter as i32 }),
        }],
        parameters: params.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect(),
        ..Default::default()
    }
}

/// One hostile CreateVolume; the error it must end in and how long the RPC took.
async fn hostile_call(channel: Channel, name: &str, params: &[(&str, &str)]) -> (tonic::Status, Duration) {
    let mut params = params.to_vec();
    params.push(("backend", "hostile"));
    let request = create_request(name, &params, None);
    let started = Instant::now();
    let result = ControllerClient::new(channel).create_volume(request).await;
    let took = started.elapsed();
    match result {
        Ok(r) => {
            let v = r.into_inner().volume.unwrap_or_default();
            panic!(
                "hostile {params:?} unexpectedly created {} ({} topologies)",
                v.volume_id,
                v.accessible_topology.len()
            )
        }
        Err(status) => (status, took),
    }
}

/// The guest's own words in a WIT error the host passed on (`backend NAME: OP: MESSAGE`).
fn guest_message(status: &tonic::Status) -> &str {
    status
        .message()
        .strip_prefix("backend hostile: create_volume: ")
        .unwrap_or_else(|| panic!("not a hostile error: {status:?}"))
}

fn assert_within_deadline(what: &str, took: Duration) {
    assert!(took <= DEADLINE + SLACK, "{what}: answered after {took:?}, deadline {DEADLINE:?} + {SLACK:?}");
}

/// GET /metrics over a plain TCP connection, as Prometheus would; returns the body.
async fn scrape(addr: SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let (_, body) = response.split_once("\r\n\r\n").unwrap();
    body.to_string()
}

/// The value of one series (`name{labels}` exactly as exposed), if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.split_whitespace().next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_hostile_behaviour_is_one_clean_grpc_error_and_hostpath_keeps_serving() {
    let _serial = SERIAL.lock().await;
    let d = tempfile::tempdir().unwrap();
    let host = start_host(d.path(), true).await;
    let channel = connect(&host.socket).await.unwrap();
    let mut controller = ControllerClient::new(channel.clone());
    let ready = IdentityClient::new(channel.clone()).probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready;
    assert_eq!(ready, Some(true));
    let names = IdentityClient::new(channel.clone()).get_plugin_info(csi::GetPluginInfoRequest {}).await.unwrap();
    let manifest = &names.get_ref().manifest["backends"];
    assert!(manifest.contains("hostile@") && manifest.contains("hostpath@"), "{manifest}");

    // loop: stopped at the deadline; meanwhile hostpath answers on the same host. How many of
    // its calls fit in the spinner's deadline depends on the machine's load; one answered while
    // the spinner still ran proves hostpath is not held up by it.
    let spinning = tokio::spawn(hostile_call(channel.clone(), "spin", &[("mode", "loop")]));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut answered_while_spinning = 0;
    for i in 0..5 {
        let name = format!("pvc-{i}");
        let v =
            controller.create_volume(create_request(&name, &[("backend", "hostpath")], Some(1 << 20))).await.unwrap();
        assert_eq!(v.into_inner().volume.unwrap().volume_id, format!("hostpath:default.{name}"));
        assert!(d.path().join("hostpath/volumes").join(&name).is_dir());
        if !spinning.is_finished() {
            answered_while_spinning += 1;
        }
    }
    assert!(answered_while_spinning >= 1, "hostpath answered nothing while the hostile call spun");
    let (status, took) = spinning.await.unwrap();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(took >= DEADLINE, "loop: stopped early, after {took:?}");
    assert_within_deadline("loop", took);

    // oom: stopped at the memory cap, named in the message.
    let (status, took) = hostile_call(channel.clone(), "oom", &[("mode", "oom")]).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("memory limit of 32 MiB"), "{status:?}");
    assert_within_deadline("oom", took);

    // trap: INTERNAL for that call; the next call gets a fresh instance and runs to its end.
    let (status, took) = hostile_call(channel.clone(), "trap", &[("mode", "trap")]).await;
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(status.message().contains("trapped"), "{status:?}");
    assert_within_deadline("trap", took);
    let (status, _) = hostile_call(channel.clone(), "after-trap", &[("mode", "no-such-mode")]).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("unknown mode"), "{status:?}");

    // garbage: the host checks the answer; the invalid id is never handed out nor recorded.
    // (No capacity range, so the id check, not the 1-byte capacity, is what rejects it.)
    let (status, _) = hostile_call(channel.clone(), "garbage", &[("mode", "garbage")]).await;
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(status.message().contains("invalid volume id"), "{status:?}");
    let garbage_id = format!("hostile:../{}\0", "x".repeat(4096));
    assert!(host.registry.runtime().metadata.volume(&garbage_id).unwrap().is_none());
    // Bytes that are not UTF-8 where the ABI wants a string: the lift fails, the call is INTERNAL.
    let (status, _) = hostile_call(channel.clone(), "bad-utf8", &[("mode", "bad-utf8")]).await;
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(status.message().contains("invalid output"), "{status:?}");

    // files, sockets, env: WASI is deny-by-default; the guest reports what happened to it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    for params in [vec![("mode", "files")], vec![("mode", "sockets"), ("port", port.as_str())], vec![("mode", "env")]] {
        let (status, _) = hostile_call(channel.clone(), "wasi", &params).await;
        assert_eq!(status.code(), Code::PermissionDenied, "{params:?}: {status:?}");
        assert!(guest_message(&status).starts_with("denied"), "{params:?}: {status:?}");
    }
    listener.set_nonblocking(true).unwrap();
    let accepted = listener.accept().map(|(_, peer)| peer);
    assert!(
        matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the guest connected: {accepted:?}"
    );
    assert!(!Path::new("/tmp/hostile").exists());

    // escape: `..` under the granted root is refused before it reaches the filesystem.
    let (status, _) = hostile_call(channel.clone(), "escape", &[("mode", "escape")]).await;
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(guest_message(&status).starts_with("denied"), "{status:?}");
    assert!(!d.path().join("escape").exists());

    // Through all of that, hostpath still serves.
    controller.create_volume(create_request("pvc-after", &[("backend", "hostpath")], Some(1 << 20))).await.unwrap();

    let metrics = scrape(host.metrics_addr.unwrap()).await;
    let timeouts = sample(&metrics, r#"wasmcsi_backend_timeouts_total{backend="hostile"}"#);
    assert_eq!(timeouts, Some(1.0), "{metrics}");
    let traps = sample(&metrics, r#"wasmcsi_backend_traps_total{backend="hostile"}"#);
    assert_eq!(traps, Some(2.0), "oom + trap: {metrics}");
    let deadline_exceeded =
        sample(&metrics, r#"wasmcsi_csi_requests_total{method="CreateVolume",code="DeadlineExceeded"}"#);
    assert_eq!(deadline_exceeded, Some(1.0), "{metrics}");
    assert_eq!(sample(&metrics, r#"wasmcsi_backend_traps_total{backend="hostpath"}"#), None, "{metrics}");
    assert_eq!(
        sample(&metrics, r#"wasmcsi_csi_requests_total{method="CreateVolume",code="OK"}"#),
        Some(6.0),
        "{metrics}"
    );

    drop((controller, channel));
    host.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungranted_import_keeps_the_component_out_and_is_counted() {
    let _serial = SERIAL.lock().await;
    let d = tempfile::tempdir().unwrap();
    let host = start_host(d.path(), false).await;
    let channel = connect(&host.socket).await.unwrap();

    // hostpath loaded, so the plugin is ready although hostile was refused.
    let ready = IdentityClient::new(channel.clone()).probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready;
    assert_eq!(ready, Some(true));
    let mut controller = ControllerClient::new(channel.clone());
    let status = controller
        .create_volume(create_request("pvc-1", &[("backend", "hostile"), ("mode", "files")], None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().ends_with("available: hostpath"), "{status:?}");
    controller.create_volume(create_request("pvc-2", &[("backend", "hostpath")], Some(1 << 20))).await.unwrap();

    let metrics = scrape(host.metrics_addr.unwrap()).await;
    let rejected = sample(&metrics, r#"wasmcsi_backend_rejected_total{backend="hostile"}"#);
    assert!(rejected.is_some_and(|n| n >= 1.0), "{metrics}");
    assert_eq!(sample(&metrics, r#"wasmcsi_backend_rejected_total{backend="hostpath"}"#), None, "{metrics}");
    assert_eq!(sample(&metrics, r#"wasmcsi_backend_loads_total{backend="hostpath"}"#), Some(1.0), "{metrics}");

    drop((controller, channel));
    host.shutdown().await.unwrap();
}

/// Whether an answer is one the host refused as the backend's fault.
fn refused(what: &str, status: &tonic::Status) {
    assert_eq!(status.code(), Code::Internal, "{what}: {status:?}");
    assert!(status.message().contains("invalid output"), "{what}: {status:?}");
    assert!(status.message().len() <= 2048, "{what}: a {} byte message", status.message().len());
}

/// What a backend returns is checked and bounded before the CO sees any of it: megabytes of
/// text are clipped, lists and tokens no CO could read and values outside CSI's contract are
/// INTERNAL; each answer is one small gRPC message a default client takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_answer_outside_the_contract_is_refused_or_clipped_before_the_co_sees_it() {
    let _serial = SERIAL.lock().await;
    let d = tempfile::tempdir().unwrap();
    let host = start_host(d.path(), true).await;
    let channel = connect(&host.socket).await.unwrap();
    // A client with gRPC's default 4 MiB receive limit, like the sidecars.
    let mut controller = ControllerClient::new(channel.clone());
    // The documented limit of condition and validation messages (`answer::MAX_MESSAGE`,
    // docs/operating.md).
    let limit = 1024;

    // An 8 MiB error keeps its code; its message is clipped.
    let (status, _) = hostile_call(channel.clone(), "long-error", &[("mode", "long-error")]).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().len() <= 2 * limit, "{} bytes", status.message().len());

    for mode in
        ["huge-topology", "wide-topology", "bad-topology-key", "nul-topology-value", "big-context", "max-capacity"]
    {
        let (status, _) = hostile_call(channel.clone(), mode, &[("mode", mode)]).await;
        refused(mode, &status);
        assert!(
            host.registry.runtime().metadata.volume(&format!("hostile:{mode}")).unwrap().is_none(),
            "{mode} recorded"
        );
    }

    for mode in ["min-above-max", "max-capacity"] {
        let request = csi::GetCapacityRequest {
            parameters: [("backend".into(), "hostile".into()), ("mode".into(), mode.into())].into(),
            ..Default::default()
        };
        refused(mode, &controller.get_capacity(request).await.unwrap_err());
    }

    let get = |id: &str| csi::ControllerGetVolumeRequest { volume_id: format!("hostile:{id}") };
    refused("another volume's id", &controller.controller_get_volume(get("other")).await.unwrap_err());
    let v = controller.controller_get_volume(get("long-condition")).await.unwrap().into_inner();
    let message = v.status.unwrap().volume_condition.unwrap().message;
    assert!(message.len() <= limit && message.ends_with("[clipped]"), "{} bytes", message.len());

    let list = |token: &str| csi::ListVolumesRequest { max_entries: 0, starting_token: format!("hostile:{token}") };
    refused("8 MiB page token", &controller.list_volumes(list("long-token")).await.unwrap_err());
    refused("more entries than asked", &controller.list_volumes(list("too-many")).await.unwrap_err());
    let page = controller.list_volumes(list("long-condition")).await.unwrap().into_inner();
    let message = &page.entries[0].status.as_ref().unwrap().volume_condition.as_ref().unwrap().message;
    assert!(message.len() <= limit, "{} bytes", message.len());

    let expand = csi::ControllerExpandVolumeRequest {
        volume_id: "hostile:v".into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 2 << 20 }),
        ..Default::default()
    };
    refused("expanded above the limit", &controller.controller_expand_volume(expand).await.unwrap_err());

    for name in ["time-out-of-range", "nanos-out-of-range", "huge-size"] {
        let request = csi::CreateSnapshotRequest {
            name: name.into(),
            source_volume_id: "hostile:v".into(),
            ..Default::default()
        };
        refused(name, &controller.create_snapshot(request).await.unwrap_err());
    }
    let snapshots = csi::ListSnapshotsRequest { starting_token: "hostile:long-token".into(), ..Default::default() };
    refused("8 MiB snapshot page token", &controller.list_snapshots(snapshots).await.unwrap_err());

    let validate = csi::ValidateVolumeCapabilitiesRequest {
        volume_id: "hostile:v".into(),
        volume_capabilities: create_request("x", &[], None).volume_capabilities,
        ..Default::default()
    };
    let verdict = controller.validate_volume_capabilities(validate).await.unwrap().into_inner();
    assert!(verdict.confirmed.is_none() && verdict.message.len() <= limit, "{} bytes", verdict.message.len());

    let metrics = host.registry.runtime().metrics.encode();
    let bad = r#"wasmcsi_backend_errors_total{backend="hostile",op="create_volume",code="Internal",kind="bad-output"}"#;
    assert_eq!(sample(&metrics, bad), Some(6.0), "{metrics}");
    drop((controller, channel));
    host.shutdown().await.unwrap();
}
