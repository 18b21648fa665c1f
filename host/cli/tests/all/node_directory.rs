//! The controller's node directory over the CSI socket: ControllerPublishVolume to a node id no
//! node has is NOT_FOUND, to a real one is OK, and UNAVAILABLE when the source that would know
//! could not be asked; a controller with no complete source lets it through. Whole hosts in
//! this process with the hostpath example; the Kubernetes API is `wasmcsi-kube-stub` (no
//! kube-apiserver can run on the test machines), serving CSINode objects as kubelet writes them.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::Path;
use std::time::Duration;

use tonic::Code;
use wasmcsi::host::{DataPathPlace, Host, HostOptions, PeerOptions, connect};
use wasmcsi::trust::TrustOptions;
use wasmcsi_csi::Mode;
use wasmcsi_csi::authority_endpoint::token_review::KubeApi;
use wasmcsi_kube_stub::KubeStub;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_runtime::config::HostConfig;

const DRIVER: &str = "nodes.test.wasmcsi.io";

async fn start_host(dir: &Path, mode: Mode, known_nodes: &[&str], kube_api: Option<KubeApi>) -> Host {
    for sub in ["hostpath", "backends", "state"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    std::fs::write(dir.join("backends/hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    let config = format!("[backends.hostpath.grants]\ndir = {{ default = \"{}/hostpath\" }}\n", dir.display());
    Host::start_with_trust(
        HostOptions {
            driver_name: DRIVER.into(),
            mode,
            node_id: "node-a".into(),
            socket: dir.join("csi.sock"),
            config: HostConfig::parse(&config, Path::new("nodes-test")).unwrap(),
            config_file: None,
            backends_dir: Some(dir.join("backends")),
            state_dir: dir.join("state"),
            reload_interval: Duration::from_secs(3600),
            metrics_addr: None,
            replicas: None,
            reconcile: None,
        },
        DataPathPlace::InProcess,
        PeerOptions { known_nodes: known_nodes.iter().map(ToString::to_string).collect(), ..Default::default() },
        TrustOptions { kube_api, ..Default::default() },
    )
    .await
    .unwrap()
}

fn capability() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode as AM};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: AM::SingleNodeWriter as i32 }),
    }
}

async fn volume(ctl: &mut ControllerClient<tonic::transport::Channel>) -> csi::Volume {
    ctl.create_volume(csi::CreateVolumeRequest {
        name: "pvc-nodes".into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![capability()],
        parameters: [("backend".to_string(), "hostpath".to_string())].into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .volume
    .unwrap()
}

/// ControllerPublishVolume of `v` to `node`: OK or the code.
async fn publish(ctl: &mut ControllerClient<tonic::transport::Channel>, v: &csi::Volume, node: &str) -> Code {
    let answer = ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: node.into(),
            volume_capability: Some(capability()),
            volume_context: v.volume_context.clone(),
            ..Default::default()
        })
        .await;
    match answer {
        Ok(_) => Code::Ok,
        Err(s) => {
            eprintln!("publish to {node}: {:?} {}", s.code(), s.message());
            s.code()
        }
    }
}

/// A controller in a cluster: the nodes are the CSINodes listing this driver (whatever their
/// Kubernetes names), found by name or in the paged list; a node id no CSINode lists is
/// NOT_FOUND; with the API server down, a node not seen before is UNAVAILABLE (it may exist),
/// one seen within a minute still publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_controller_knows_the_nodes_from_the_cluster_s_csinodes() {
    let d = tempfile::tempdir().unwrap();
    let stub = KubeStub::start("controller-sa-token").await;
    let sa = d.path().join("sa");
    std::fs::create_dir_all(&sa).unwrap();
    stub.write_client_files(&sa);
    // More CSINodes than one page holds; node-b's id is its Kubernetes name, node-c's is not.
    for i in 0..40 {
        stub.add_csi_node(&format!("filler-{i:02}"), "other.csi.io", &format!("filler-{i:02}"));
    }
    stub.add_csi_node("node-b", DRIVER, "node-b");
    stub.add_csi_node("zz-kube-name", DRIVER, "node-c");
    stub.add_csi_node("node-d", "other.csi.io", "node-d");
    let api = KubeApi { url: stub.url(), ca_file: sa.join("ca.crt"), token_file: sa.join("token") };
    let host = start_host(&d.path().join("host"), Mode::Controller, &[], Some(api)).await;
    let mut ctl = ControllerClient::new(connect(&host.socket).await.unwrap());
    let v = volume(&mut ctl).await;

    assert_eq!(publish(&mut ctl, &v, "node-b").await, Code::Ok);
    assert_eq!(publish(&mut ctl, &v, "node-c").await, Code::Ok, "found in the list, past the first page");
    assert_eq!(publish(&mut ctl, &v, "node-d").await, Code::NotFound, "a CSINode of another driver only");
    assert_eq!(publish(&mut ctl, &v, "ghost").await, Code::NotFound);
    assert_eq!(publish(&mut ctl, &v, "Not/A Name").await, Code::NotFound);

    stub.set_down(true);
    assert_eq!(publish(&mut ctl, &v, "ghost").await, Code::Unavailable, "the API server could not be asked");
    assert_eq!(publish(&mut ctl, &v, "node-b").await, Code::Ok, "seen a moment ago");
    stub.set_down(false);
    host.shutdown().await.unwrap();
}

/// The nodes an operator names are complete; a standalone host (controller and node in one
/// process) is its own only node; a controller with no complete source cannot tell and lets
/// every node id through, as it did before it had a directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn configured_nodes_and_a_standalone_host_are_complete_and_no_source_refuses_nothing() {
    let d = tempfile::tempdir().unwrap();

    let host = start_host(&d.path().join("known"), Mode::Controller, &["node-b", "node-c"], None).await;
    let mut ctl = ControllerClient::new(connect(&host.socket).await.unwrap());
    let v = volume(&mut ctl).await;
    assert_eq!(publish(&mut ctl, &v, "node-c").await, Code::Ok);
    assert_eq!(publish(&mut ctl, &v, "ghost").await, Code::NotFound);
    assert_eq!(publish(&mut ctl, &v, "node-a").await, Code::NotFound, "a controller only is no node");
    host.shutdown().await.unwrap();

    let host = start_host(&d.path().join("standalone"), Mode::All, &[], None).await;
    let mut ctl = ControllerClient::new(connect(&host.socket).await.unwrap());
    let v = volume(&mut ctl).await;
    assert_eq!(publish(&mut ctl, &v, "node-a").await, Code::Ok);
    assert_eq!(publish(&mut ctl, &v, "ghost").await, Code::NotFound);
    host.shutdown().await.unwrap();

    let host = start_host(&d.path().join("blind"), Mode::Controller, &[], None).await;
    let mut ctl = ControllerClient::new(connect(&host.socket).await.unwrap());
    let v = volume(&mut ctl).await;
    assert_eq!(publish(&mut ctl, &v, "ghost").await, Code::Ok, "no source: not checked");
    host.shutdown().await.unwrap();
}
