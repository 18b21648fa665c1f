//! The controller's authority endpoint with its real parts: grants decided by the block catalog
//! of two replica nodes (a replicated volume created and published through the CSI socket, then
//! republished to the other node), and a node plugin (the real binary) that starts without a
//! certificate and gets its own from a controller (the real binary) serving the built-in CA.
//!
//! The node's token is checked against a stub Kubernetes API server (`wasmcsi-kube-stub`,
//! serving in this test process): no kube-apiserver can run on this machine.
//!
//! Skipped (saying why) when not root: the replica servers' data path needs it.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tonic::Code;
use wasmcsi_csi::authority_endpoint::client::ClientIdentity;
use wasmcsi_csi::authority_endpoint::token_review::AUDIENCE;
use wasmcsi_csi::authority_endpoint::{AuthorityClient, AuthorityService, CatalogPublications};
use wasmcsi_kube_stub::{KubeStub, Token};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_trust::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};
use wasmcsi_trust::{Authority, Credentials, Limits, Listener, LiveCredentials, Role, TrustAnchors, Validity};

use crate::support;
use crate::support::csi::{clients, controller_publish, controller_unpublish};
use crate::support::process::Proc;
use crate::support::replicated::{BACKEND, Options};

/// A CA and the credentials directories it issued, under one temporary directory.
struct Pki {
    ca: Authority,
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        ca.save(&dir.path().join("ca")).unwrap();
        Pki { ca, dir }
    }

    fn issue(&self, role: &Role, name: &str) -> std::path::PathBuf {
        let out = self.dir.path().join(name);
        self.ca
            .issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .unwrap()
            .write(&out, self.ca.bundle())
            .unwrap();
        out
    }

    fn live(&self, role: &Role, name: &str) -> LiveCredentials {
        LiveCredentials::new(Credentials::load(&self.issue(role, name)).unwrap())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grants_follow_the_catalog_s_owner_and_epoch_through_a_republish() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: not root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let nodes_file = dir.path().join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let a = support::replicated::host(
        &dir.path().join("node-a"),
        "node-a",
        wasmcsi_csi::Mode::All,
        &nodes_file,
        Options::default(),
    )
    .await;
    let b = support::replicated::host(
        &dir.path().join("node-b"),
        "node-b",
        wasmcsi_csi::Mode::Node,
        &nodes_file,
        Options::default(),
    )
    .await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b]);

    let (mut ctl, _) = clients(&a.socket).await;
    let params: HashMap<String, String> =
        [("backend", BACKEND), ("numberOfReplicas", "2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let cap = support::single_node_writer(Some("ext4"));
    let volume = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "granted".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 16 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: params,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let catalog = a.registry.get(BACKEND).unwrap().block_catalog().unwrap().clone();
    let set = catalog.list(None, 10).await.unwrap().pop().unwrap().id;

    // The controller's authority endpoint over node-a's catalog.
    let pki = Pki::new();
    let controller = pki.live(&Role::Controller, "controller");
    let service = AuthorityService::new(controller.clone(), Arc::new(CatalogPublications::new(a.registry.clone())));
    let listener = Listener::bind("127.0.0.1:0", Limits::default()).await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(wasmcsi_csi::authority_endpoint::serve(listener, controller, service));
    let as_node = |id: &str| {
        AuthorityClient::new(&url, ClientIdentity::Credentials(pki.live(&Role::Node(id.into()), id))).unwrap()
    };
    let (node_a, node_b) = (as_node("node-a"), as_node("node-b"));
    let anchors = TrustAnchors::new(pki.ca.bundle().to_vec()).unwrap();
    let granted = |encoded: Vec<u8>| wasmcsi_trust::grant::verify(&encoded, &anchors, SystemTime::now()).unwrap();

    // Created, published nowhere: no grant for anyone.
    let err = node_a.grant_volume(&set).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("not published"), "{err:?}");

    controller_publish(&mut ctl, &volume, "node-a", &cap).await.unwrap();
    let epoch_a = catalog.get(&set).await.unwrap().unwrap().epoch;
    let grant = granted(node_a.grant_volume(&set).await.unwrap());
    assert_eq!((grant.volume.as_str(), grant.node.as_str(), grant.epoch), (set.as_str(), "node-a", epoch_a));
    // Node B is a replica node of the volume, with a valid certificate: still no grant.
    let err = node_b.grant_volume(&set).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("attached to node node-a"), "{err:?}");

    // Republished to B: B's grant is at the raised epoch, A gets none any more.
    controller_unpublish(&mut ctl, &volume, "node-a").await;
    controller_publish(&mut ctl, &volume, "node-b", &cap).await.unwrap();
    let grant = granted(node_b.grant_volume(&set).await.unwrap());
    assert_eq!(grant.node, "node-b");
    assert!(grant.epoch > epoch_a, "the republish raised the epoch: {} then {}", epoch_a, grant.epoch);
    assert_eq!(node_a.grant_volume(&set).await.unwrap_err().code(), Code::PermissionDenied);

    controller_unpublish(&mut ctl, &volume, "node-b").await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: volume.volume_id.clone(), ..Default::default() })
        .await
        .unwrap();
    server.abort();
    for host in [a, b] {
        host.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controller_publish_returns_the_node_s_grant_at_the_epoch_it_claimed() {
    use base64::Engine as _;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: not root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let nodes_file = dir.path().join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let pki = Pki::new();
    // The controller (node-a, a controller and node in one process) signs with the controller's
    // credentials; over TLS a process has one role, so its replica port (which would need
    // node-a's certificate) runs plaintext here: what this test checks is the grant.
    let trust = wasmcsi::trust::TrustOptions {
        tls_dir: Some(pki.issue(&Role::Controller, "controller")),
        tls_mode: Some(wasmcsi_trust::TlsMode::Off),
        ..Default::default()
    };
    let a = support::replicated::host(
        &dir.path().join("node-a"),
        "node-a",
        wasmcsi_csi::Mode::All,
        &nodes_file,
        Options { trust, ..Default::default() },
    )
    .await;
    let b = support::replicated::host(
        &dir.path().join("node-b"),
        "node-b",
        wasmcsi_csi::Mode::Node,
        &nodes_file,
        Options::default(),
    )
    .await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b]);

    let (mut ctl, _) = clients(&a.socket).await;
    let params: HashMap<String, String> =
        [("backend", BACKEND), ("numberOfReplicas", "2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let cap = support::single_node_writer(Some("ext4"));
    let volume = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "published-with-grant".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 16 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: params,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let catalog = a.registry.get(BACKEND).unwrap().block_catalog().unwrap().clone();
    let set = catalog.list(None, 10).await.unwrap().pop().unwrap().id;
    let anchors = TrustAnchors::new(pki.ca.bundle().to_vec()).unwrap();
    let grant_of = |context: &HashMap<String, String>| {
        // The spec's general limit for a map<string, string>: 4 KiB of keys and values.
        let size: usize = context.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(size <= 4096, "publish_context is {size} bytes");
        let value = context.get(wasmcsi_csi::controller::grant::GRANT_CONTEXT_KEY).expect("a grant in the context");
        let bytes = base64::engine::general_purpose::STANDARD.decode(value).expect("standard base64");
        wasmcsi_trust::grant::verify(&bytes, &anchors, SystemTime::now()).unwrap()
    };

    let first = grant_of(&controller_publish(&mut ctl, &volume, "node-a", &cap).await.unwrap());
    let epoch_a = catalog.get(&set).await.unwrap().unwrap().epoch;
    assert_eq!((first.volume.as_str(), first.node.as_str(), first.epoch), (set.as_str(), "node-a", epoch_a));
    // A retry (the CO lost the answer): a valid grant at the same epoch, nothing raised.
    let retry = grant_of(&controller_publish(&mut ctl, &volume, "node-a", &cap).await.unwrap());
    assert_eq!((retry.node.as_str(), retry.epoch), ("node-a", epoch_a));
    assert_eq!(catalog.get(&set).await.unwrap().unwrap().epoch, epoch_a);

    // Republished to B: B's grant names B at a higher epoch, the one the replicas hold.
    controller_unpublish(&mut ctl, &volume, "node-a").await;
    let moved = grant_of(&controller_publish(&mut ctl, &volume, "node-b", &cap).await.unwrap());
    assert_eq!(moved.node, "node-b");
    assert!(moved.epoch > epoch_a, "the republish raised the epoch: {epoch_a} then {}", moved.epoch);
    assert_eq!(moved.epoch, catalog.get(&set).await.unwrap().unwrap().epoch);

    controller_unpublish(&mut ctl, &volume, "node-b").await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: volume.volume_id.clone(), ..Default::default() })
        .await
        .unwrap();
    for host in [a, b] {
        host.shutdown().await.unwrap();
    }
}

/// `wasmcsi serve` arguments: a process of `mode` over `home`, no backends.
fn serve_args(mode: &str, node: &str, home: &Path, extra: &[String]) -> Vec<String> {
    let path = |p: std::path::PathBuf| p.display().to_string();
    std::fs::create_dir_all(home.join("backends")).unwrap();
    let mut args: Vec<String> =
        ["--log", "info", "serve", "--mode", mode, "--node-id", node, "--reload-interval-ms", "3600000"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    args.extend(["--socket".into(), path(home.join("csi.sock"))]);
    args.extend(["--state-dir".into(), path(home.join("state"))]);
    args.extend(["--backends-dir".into(), path(home.join("backends"))]);
    args.extend(extra.iter().cloned());
    args
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_plugin_gets_its_first_certificate_from_the_controller_with_its_token() {
    let pki = Pki::new();
    let home = pki.dir.path();
    let stub = KubeStub::start("controller-sa-token").await;
    let sa = home.join("controller-sa");
    std::fs::create_dir(&sa).unwrap();
    stub.write_client_files(&sa);
    for (token, node) in [("token-a", "node-a"), ("token-b", "node-b")] {
        stub.add(
            token,
            Token {
                username: "system:serviceaccount:wasmcsi:wasmcsi-node".into(),
                node: Some(node.into()),
                audiences: vec![AUDIENCE.into()],
            },
        );
    }
    let controller_dir = pki.issue(&Role::Controller, "controller-tls");
    let p = |path: std::path::PathBuf| path.display().to_string();
    let controller_flags: Vec<String> = vec![
        "--tls-dir".into(),
        p(controller_dir),
        "--authority-listen".into(),
        "127.0.0.1:0".into(),
        "--ca-dir".into(),
        p(home.join("ca")),
        "--certificate-validity".into(),
        "1h".into(),
        "--node-service-account".into(),
        "wasmcsi:wasmcsi-node".into(),
        "--kube-api".into(),
        stub.url(),
        "--kube-api-ca".into(),
        p(sa.join("ca.crt")),
        "--kube-api-token".into(),
        p(sa.join("token")),
    ];
    let mut controller = Proc::spawn(
        "controller",
        None,
        &serve_args("controller", "controller", &home.join("controller"), &controller_flags),
    );
    let line = controller.wait_line("the authority endpoint", |l| l.contains("serving the authority endpoint"));
    let addr = line.split("addr=").nth(1).unwrap().split_whitespace().next().unwrap().to_owned();

    // Node A's plugin: no certificate yet, the CA bundle (public) and its own token.
    let token_a = home.join("token-a");
    std::fs::write(&token_a, "token-a\n").unwrap();
    let node_dir = home.join("node-a-tls");
    let node_flags = |token: &Path| -> Vec<String> {
        vec![
            "--tls-dir".into(),
            p(node_dir.clone()),
            "--authority".into(),
            format!("https://{addr}"),
            "--authority-ca".into(),
            p(home.join("ca/ca.crt")),
            "--authority-token".into(),
            p(token.to_owned()),
        ]
    };
    let mut node =
        Proc::spawn("node-a", None, &serve_args("node", "node-a", &home.join("node-a"), &node_flags(&token_a)));
    node.wait_line("serving CSI", |l| l.contains("serving CSI"));
    let credentials = Credentials::load(&node_dir).unwrap();
    assert_eq!(credentials.role(), &Role::Node("node-a".into()));
    let life = credentials.not_after().duration_since(credentials.not_before()).unwrap();
    assert!(
        life >= Duration::from_secs(3600) && life <= Duration::from_secs(3700),
        "--certificate-validity 1h: {life:?}"
    );
    drop(node);

    // Node A's plugin with node B's token: it does not start, and says why.
    std::fs::remove_dir_all(&node_dir).unwrap();
    let token_b = home.join("token-b");
    std::fs::write(&token_b, "token-b\n").unwrap();
    let out = std::process::Command::new(crate::support::process::BIN)
        .args(serve_args("node", "node-a", &home.join("node-a-again"), &node_flags(&token_b)))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with another node's token:\n{stderr}");
    assert!(stderr.contains("PermissionDenied") || stderr.contains("permission"), "{stderr}");
    assert!(stderr.contains("node-b"), "names the node the token belongs to:\n{stderr}");
    assert!(!node_dir.join("tls.crt").exists(), "no certificate written");
    controller.wait_line("the refusal, logged once", |l| l.contains("authority call refused") && l.contains("node-b"));
    assert_eq!(stub.reviews(), 2, "each token reviewed by the API server");
}
