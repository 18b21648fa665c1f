//! `scripts/bench-nfs` (= `cargo bench --workspace --bench nfs_backend`): the nfs backend through
//! the CSI socket against a real nfs-ganesha (private namespace; needs root and the packages
//! `scripts/nfs-setup` installs). One run, one table:
//!
//! 1. CreateVolume + DeleteVolume: p50/p99 of each call, sequential pairs/s, and ops/s with 8
//!    clients at once (what a burst of PVCs sees).
//! 2. CreateSnapshot, repeated until ready_to_use as the external-snapshotter does (a copy of
//!    the volume's tree through the host's NFS client, in the host's background) of
//!    a tree of many small files and of one big file, vs a server-side `cp -a` of the same tree
//!    on the exported directory + `sync -f` (the client COMMITs), caches dropped before each.
//!
//! Knobs: NFS_BENCH_PAIRS (200), NFS_BENCH_BIG_MIB (1024), NFS_BENCH_FILES (2000).
//! Prints numbers; asserts only that the copies are whole.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark harness")]
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use wasmcsi::host::{Host, HostOptions, connect};
use wasmcsi_benchkit::{knob, ms, pct};
use wasmcsi_ganesha::{Ganesha, SHARE};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::config::HostConfig;

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;

fn request(name: &str, params: &HashMap<String, String>) -> csi::CreateVolumeRequest {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 30, limit_bytes: 0 }),
        volume_capabilities: vec![csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: Mode::MultiNodeMultiWriter as i32 }),
        }],
        parameters: params.clone(),
        ..Default::default()
    }
}

async fn pair(ctl: &mut Controller, name: &str, params: &HashMap<String, String>) -> (Duration, Duration) {
    let t = Instant::now();
    let v = ctl.create_volume(request(name, params)).await.expect("create").into_inner().volume.unwrap();
    let created = t.elapsed();
    let t = Instant::now();
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id, ..Default::default() }).await.expect("delete");
    (created, t.elapsed())
}

fn drop_caches() {
    let _ = std::process::Command::new("sync").status();
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
}

/// `files` files of 4 KiB in directories of 100, or one file of `big_mib` MiB of
/// incompressible data, under `dir`.
fn fill(dir: &Path, files: u64, big_mib: u64) {
    if big_mib == 0 {
        let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        for i in 0..files {
            let d = dir.join(format!("d{:03}", i / 100));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join(format!("f{:03}", i % 100)), &block).unwrap();
        }
        return;
    }
    let mut f = fs::File::create(dir.join("blob")).unwrap();
    let mut chunk = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..big_mib {
        for b in chunk.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
        }
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
}

fn du(path: &Path) -> u64 {
    let out = std::process::Command::new("du").args(["-sb"]).arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("nfs_backend bench: needs root (ganesha runs in a private namespace)");
        return;
    }
    let (pairs, big_mib, files) =
        (knob("NFS_BENCH_PAIRS", 200), knob("NFS_BENCH_BIG_MIB", 1024), knob("NFS_BENCH_FILES", 2000));
    let g = Ganesha::start().expect("ganesha");
    let dir = tempfile::tempdir().unwrap();
    let backends = dir.path().join("backends");
    fs::create_dir_all(&backends).unwrap();
    fs::write(backends.join("nfs.wasm"), wasmcsi_artifacts::NFS).unwrap();
    let config = format!(
        "[backends.nfs]\ncall_deadline_ms = 600000\nimport_timeout_ms = 600000\n\
         [backends.nfs.grants]\nnfs = [{{ server = {:?}, share = {SHARE:?} }}]\n",
        g.server()
    );
    let host = Host::start(HostOptions {
        driver_name: "bench.wasmcsi.io".into(),
        mode: wasmcsi_csi::Mode::Controller,
        node_id: "bench".into(),
        socket: dir.path().join("csi.sock"),
        config: HostConfig::parse(&config, Path::new("bench")).unwrap(),
        config_file: None,
        backends_dir: Some(backends),
        state_dir: dir.path().join("state"),
        reload_interval: Duration::from_secs(3600),
        metrics_addr: None,
        replicas: None,
        reconcile: None,
    })
    .await
    .unwrap();
    let channel = connect(&host.socket).await.unwrap();
    let mut ctl = Controller::new(channel.clone());
    let params: HashMap<String, String> = [("backend", "nfs"), ("server", g.server().as_str()), ("share", SHARE)]
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect();

    println!("nfs backend through the CSI socket, nfs-ganesha (NFSv3 via the host's client) in a private namespace");
    for i in 0..10 {
        pair(&mut ctl, &format!("warm-{i}"), &params).await;
    }
    let (mut creates, mut deletes) = (vec![], vec![]);
    let t = Instant::now();
    for i in 0..pairs {
        let (c, d) = pair(&mut ctl, &format!("seq-{i}"), &params).await;
        creates.push(c);
        deletes.push(d);
    }
    let seq = t.elapsed();
    let clients = 8u64;
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..clients {
        let (mut ctl, params) = (Controller::new(channel.clone()), params.clone());
        tasks.spawn(async move {
            for i in 0..pairs / clients {
                pair(&mut ctl, &format!("par-{w}-{i}"), &params).await;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let par = t.elapsed();
    println!("{:<34} {:>10} {:>10}", "", "p50", "p99");
    println!("{:<34} {:>10} {:>10}", "CreateVolume", ms(pct(&mut creates, 0.5)), ms(pct(&mut creates, 0.99)));
    println!("{:<34} {:>10} {:>10}", "DeleteVolume", ms(pct(&mut deletes, 0.5)), ms(pct(&mut deletes, 0.99)));
    println!(
        "create+delete: {pairs} pairs in sequence {:.1} pairs/s ({:.1} ops/s); {clients} clients at once {:.1} ops/s",
        pairs as f64 / seq.as_secs_f64(),
        2.0 * pairs as f64 / seq.as_secs_f64(),
        2.0 * (pairs / clients * clients) as f64 / par.as_secs_f64()
    );

    println!("\nCreateSnapshot (server-side copy through the host's NFS client) vs server-side cp -a + sync");
    println!("{:<22} {:>10} {:>11} {:>10} {:>11} {:>8}", "tree", "snapshot", "MB/s", "cp -a", "MB/s", "ratio");
    for (label, n, mib) in
        [(format!("{files} files of 4 KiB"), files, 0), (format!("one {big_mib} MiB file"), 0, big_mib)]
    {
        let name = if mib == 0 { "small" } else { "big" };
        let v = ctl.create_volume(request(name, &params)).await.unwrap().into_inner().volume.unwrap();
        let sub_dir = v.volume_context.get("subDir").cloned().unwrap_or_else(|| name.into());
        let vol_dir = g.export_dir().join(&sub_dir);
        fill(&vol_dir, n, mib);
        let bytes = du(&vol_dir) as f64;
        drop_caches();
        let t = Instant::now();
        // As the external-snapshotter does: CreateSnapshot again until ready_to_use.
        let snap = loop {
            let s = ctl
                .create_snapshot(csi::CreateSnapshotRequest {
                    source_volume_id: v.volume_id.clone(),
                    name: format!("{name}-snap"),
                    ..Default::default()
                })
                .await
                .expect("snapshot")
                .into_inner()
                .snapshot
                .unwrap();
            if s.ready_to_use {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let snap_time = t.elapsed();
        drop_caches();
        let t = Instant::now();
        let cp = format!("{name}-cp");
        let st =
            std::process::Command::new("cp").args(["-a", &sub_dir, &cp]).current_dir(g.export_dir()).status().unwrap();
        assert!(st.success());
        let _ = std::process::Command::new("sync").arg("-f").arg(g.export_dir().join(&cp)).status();
        let cp_time = t.elapsed();
        let copied = g.export_dir().join(".snapshots").join(format!("{name}-snap")).join("data");
        assert_eq!(du(&copied), du(&g.export_dir().join(&cp)), "the snapshot is whole");
        let mb = |d: Duration| bytes / 1e6 / d.as_secs_f64();
        println!(
            "{label:<22} {:>8.2} s {:>7.1} MB/s {:>8.2} s {:>7.1} MB/s {:>7.2}x",
            snap_time.as_secs_f64(),
            mb(snap_time),
            cp_time.as_secs_f64(),
            mb(cp_time),
            cp_time.as_secs_f64() / snap_time.as_secs_f64()
        );
        ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id, ..Default::default() })
            .await
            .unwrap();
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id, ..Default::default() }).await.unwrap();
        fs::remove_dir_all(g.export_dir().join(&cp)).unwrap();
    }
    host.shutdown().await.unwrap();
}
