//! A replicated volume through the CSI socket with every replica port in `--tls-mode required`:
//! a controller host with the controller's credentials serving the authority endpoint, and
//! three node hosts with their nodes' certificates (issued by a CA made for the test), each with
//! its data path in this process. The volume is created and published by the controller
//! (reaching the replica servers as the controller), staged on node-a as a raw block device: the
//! node's catalog reads the record over TLS with node-a's certificate, and the engine, which
//! holds no grant from the publish, gets one from the authority endpoint and presents it to
//! node-b's and node-c's replica servers. Checksummed blocks are written and read back through
//! the device, then everything is taken apart.
//!
//! Skipped (saying why) when not root or without /dev/fuse.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use wasmcsi::host::Host;
use wasmcsi::trust::TrustOptions;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
use wasmcsi_trust::{Role, TlsMode};

use crate::support;
use crate::support::csi::{
    Paths, clients, controller_publish, controller_unpublish, stage_and_publish, unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options};

const SIZE: i64 = 32 << 20;
const BLOCK: usize = 4096;

/// Writes credentials of `role` issued by `ca` into `dir`.
fn credentials(ca: &Authority, role: &Role, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let issued = ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap();
    issued.write(dir, &[ca.certificate().clone()]).unwrap();
}

/// Block `b` in round `round`: its number and round in every 8 bytes.
fn pattern(b: u64, round: u64) -> Vec<u8> {
    (0..BLOCK as u64 / 8).flat_map(|i| (b << 40 | round << 20 | i).to_le_bytes()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replicated_volume_serves_verified_io_with_every_replica_port_in_required_mode() {
    if let Some(why) = crate::support::needs_root_and_fuse() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let _sweep = support::replicated::Sweep(dir.path().to_owned());
    let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
    let nodes_file = dir.path().join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();

    let tls_dir = dir.path().join("controller-tls");
    credentials(&ca, &Role::Controller, &tls_dir);
    let trust = TrustOptions {
        tls_dir: Some(tls_dir),
        tls_mode: Some(TlsMode::Required),
        authority_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let home = dir.path().join("controller");
    let controller = support::replicated::host(
        &home,
        "controller",
        wasmcsi_csi::Mode::Controller,
        &nodes_file,
        Options { trust, ..Default::default() },
    )
    .await;
    let authority = format!("https://{}", controller.trust.authority_addr.expect("the authority endpoint"));

    let mut nodes: Vec<Host> = Vec::new();
    for name in ["node-a", "node-b", "node-c"] {
        let tls_dir = dir.path().join(format!("{name}-tls"));
        credentials(&ca, &Role::Node(name.into()), &tls_dir);
        let trust = TrustOptions {
            tls_dir: Some(tls_dir),
            tls_mode: Some(TlsMode::Required),
            authority: Some(authority.clone()),
            ..Default::default()
        };
        let home = dir.path().join(name);
        nodes.push(
            support::replicated::host(
                &home,
                name,
                wasmcsi_csi::Mode::Node,
                &nodes_file,
                Options { trust, ..Default::default() },
            )
            .await,
        );
    }
    support::replicated::list_replica_nodes(&nodes_file, &nodes.iter().collect::<Vec<_>>());

    let (mut ctl, _) = clients(&controller.socket).await;
    let (_, mut node_a) = clients(&nodes[0].socket).await;
    let cap = support::single_node_writer(None);
    let params: HashMap<String, String> =
        [("backend", BACKEND), ("numberOfReplicas", "3")].iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-tls".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: SIZE, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: params,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let ctx = controller_publish(&mut ctl, &v, "node-a", &cap).await.unwrap();
    let staged = Paths { staging: dir.path().join("node-a/staging"), target: dir.path().join("node-a/pod/dev") };
    stage_and_publish(&mut node_a, &v, &ctx, &staged, &cap).await;
    let datapath = nodes[0].datapath.as_ref().unwrap();
    let set = datapath.attached().into_iter().next().expect("an engine runs on node-a");
    assert!(datapath.grant(&set).is_some(), "the engine holds a grant");

    let device = staged.target.clone();
    tokio::task::spawn_blocking(move || {
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&device).unwrap();
        for round in 1..=2u64 {
            for b in 0..256u64 {
                f.seek(SeekFrom::Start(b * BLOCK as u64)).unwrap();
                f.write_all(&pattern(b, round)).unwrap();
            }
            f.sync_all().unwrap();
            for b in 0..256u64 {
                let mut back = vec![0; BLOCK];
                f.seek(SeekFrom::Start(b * BLOCK as u64)).unwrap();
                f.read_exact(&mut back).unwrap();
                assert!(back == pattern(b, round), "block {b} of round {round} read back differently");
            }
        }
    })
    .await
    .unwrap();
    let status = datapath.volume(&set).unwrap().engine_status();
    assert_eq!((status.healthy, status.replicas.len()), (3, 3), "{status:?}");

    unpublish_and_unstage(&mut node_a, &v, &staged).await;
    controller_unpublish(&mut ctl, &v, "node-a").await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await.unwrap();
    assert!(support::csi::mounts_under(dir.path()).is_empty(), "{:?}", support::csi::mounts_under(dir.path()));
    for host in nodes {
        host.shutdown().await.unwrap();
    }
    controller.shutdown().await.unwrap();
}
