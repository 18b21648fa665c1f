//! Replicated block volumes through the CSI socket with every node a real `wasmcsi serve`
//! process in its own network namespace, on a private LAN ([`support::cluster`]): a controller
//! (`--mode controller`) and node plugins (`--mode node`, each serving its replicas on
//! 10.201.0.N:9501), called as kubelet and the sidecars call them. Faults are real: `kill -9` of
//! a node's process, a node cut off the LAN.
//!
//! - A replica node killed under a checksummed workload (fio `--verify` through the staged ext4):
//!   no verify error, the volume reports itself degraded, writes go on, the node comes back and is
//!   rebuilt, the volume is healthy again, and the replicas are byte-identical at the end.
//! - The node plugin that runs the engine killed with -9: after its restart, unstage and re-stage
//!   work and every flushed write is there.
//! - Split brain: the volume's node is cut off, the CO moves the volume to another node; the old
//!   node's late writes never reach what the new node (or any later one) reads.
//! - With the data path in a process of its own (`serve --datapath-socket … --datapath-start`):
//!   three volumes under fio `--verify` keep their I/O through a `kill -9` of the node plugin,
//!   and the restarted plugin reports, publishes and unstages all three; a `kill -9` of the data
//!   path itself loses no flushed write and leaves no replica diverged.
//!
//! Root only, with /dev/fuse, `ip` and fio; skipped with a message otherwise. Namespaces,
//! processes, mounts and loop devices are taken down by drop guards, also when a test panics. No
//! assertion depends on timing; waits only bound how long a broken build can hang.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::cluster::{
    Cluster, MIB, REPLICA_PORT, SIZE, condition, create, fio, fio_ok, fio_until, mount_cap, publish, runtime,
    skip_reason, wait_condition,
};
use crate::support::csi::{
    Paths, controller_unpublish as unpublish, mounts_under, publish_at, stage_and_publish, stats,
    unpublish_and_unstage, unpublish_at,
};

use support::direct::Aligned;

const O_DIRECT: i32 = nix::fcntl::OFlag::O_DIRECT.bits();

// ----- tests --------------------------------------------------------------------------------------

#[test]
fn a_replica_node_killed_under_a_verified_workload_is_rebuilt_and_the_replicas_agree() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut cluster = Cluster::start(3).await;
        let mut ctl = cluster.controller().await;
        let cap = mount_cap(Some("ext4"));
        let v = create(&mut ctl, "pvc-verified", 3, &cap).await;
        let ctx = publish(&mut ctl, &v, "node-a", &cap).await;
        let p = cluster.paths(0, "pod-1");
        let mut node_a = cluster.nodes[0].node().await;
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;
        assert!(!condition(&mut node_a, &v, &p).await.abnormal, "healthy once staged");

        // fio writes and verifies while node-c dies mid-run.
        let first = p.target.join("first.dat");
        let mut writer = fio(&first, false).stdout(std::process::Stdio::null()).spawn().unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        cluster.nodes[2].kill9();
        let killed = Instant::now();
        let status = writer.wait().unwrap();
        assert!(status.success(), "fio through the replica node's death: {status}");
        fio_ok(&mut fio(&first, true), "verify what was written while node-c died");
        let noticed = wait_condition(&mut node_a, &v, &p, "degraded", |c| c.abnormal).await;
        let c = condition(&mut node_a, &v, &p).await;
        assert!(c.message.contains("degraded"), "the condition says why: {c:?}");

        // Writes go on while degraded.
        let second = p.target.join("second.dat");
        fio_ok(&mut fio(&second, false), "write and verify while degraded");

        // node-c comes back (same root): its replica is rebuilt and the volume is healthy again.
        cluster.restart(2);
        cluster.nodes[2].channel().await;
        let healed = wait_condition(&mut node_a, &v, &p, "healthy again", |c| !c.abnormal).await;
        eprintln!(
            "degraded noticed {noticed:?} after the kill (at most), healthy {healed:?} after node-c's restart, \
             {:?} since the kill",
            killed.elapsed()
        );
        fio_ok(&mut fio(&first, true), "verify the first file after the rebuild");
        fio_ok(&mut fio(&second, true), "verify the second file after the rebuild");

        unpublish_and_unstage(&mut node_a, &v, &p).await;
        unpublish(&mut ctl, &v, "node-a").await;
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
        cluster.assert_replicas_identical(3);
    });
}

#[test]
fn the_node_plugin_killed_while_staged_restages_with_every_flushed_write() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut cluster = Cluster::start(2).await;
        let mut ctl = cluster.controller().await;
        let cap = mount_cap(Some("ext4"));
        let v = create(&mut ctl, "pvc-restaged", 2, &cap).await;
        let ctx = publish(&mut ctl, &v, "node-a", &cap).await;
        let p = cluster.paths(0, "pod-1");
        let mut node_a = cluster.nodes[0].node().await;
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;

        let payload = write_flushed(&p.target);

        // The plugin that runs the engine dies; kubelet restarts it and goes on.
        cluster.nodes[0].kill9();
        cluster.restart(0);
        let mut node_a = cluster.nodes[0].node().await;
        unpublish_and_unstage(&mut node_a, &v, &p).await;
        assert_eq!(mounts_under(&cluster.nodes[0].home), Vec::<String>::new(), "unstage leaves nothing mounted");
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;
        assert_flushed(&p.target, &payload, "the plugin's kill -9");
        unpublish_and_unstage(&mut node_a, &v, &p).await;
        unpublish(&mut ctl, &v, "node-a").await;
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() })
            .await
            .unwrap();
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
    });
}

/// Flushed writes under `dir`: four files of 4 MiB, each fsync'd, then a sync of the
/// filesystem. What a kill -9 must not lose; the payload each file holds.
fn write_flushed(dir: &Path) -> Vec<u8> {
    let payload: Vec<u8> = (0..4 * MIB).map(|i| (i * 13 % 251) as u8).collect();
    for i in 0..4 {
        let f = std::fs::File::create(dir.join(format!("flushed-{i}.bin"))).unwrap();
        f.write_all_at(&payload, 0).unwrap();
        f.sync_all().unwrap();
    }
    nix::unistd::sync();
    payload
}

/// Every file [`write_flushed`] wrote under `dir` is whole after `what`.
fn assert_flushed(dir: &Path, payload: &[u8], what: &str) {
    for i in 0..4 {
        let back = std::fs::read(dir.join(format!("flushed-{i}.bin"))).unwrap();
        assert!(back == payload, "flushed-{i}.bin is whole after {what}");
    }
}

/// One MiB of `tag` repeated, for the raw block split-brain test.
fn pattern(tag: u8) -> Vec<u8> {
    vec![tag; 1 << 20]
}

fn write_direct(device: &Path, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new().write(true).custom_flags(O_DIRECT).open(device)?;
    let mut buf = Aligned::new(data.len());
    buf.get().copy_from_slice(data);
    f.write_all_at(buf.get(), offset)?;
    f.sync_all()
}

fn read_direct(device: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = std::fs::OpenOptions::new().read(true).custom_flags(O_DIRECT).open(device).unwrap();
    let mut buf = Aligned::new(len);
    f.read_exact_at(buf.get(), offset).unwrap();
    buf.get().to_vec()
}

#[test]
fn split_brain_the_cut_off_node_s_late_writes_never_reach_the_volume() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut cluster = Cluster::start(3).await;
        let mut ctl = cluster.controller().await;
        let cap = mount_cap(None);
        let v = create(&mut ctl, "pvc-split", 3, &cap).await;
        let (before, late, from_b) = (pattern(0xa1), pattern(0xa2), pattern(0xb1));

        // node-a has it and writes.
        let ctx = publish(&mut ctl, &v, "node-a", &cap).await;
        let staged = cluster.paths(0, "pod-a");
        let pa = Paths { staging: staged.staging, target: staged.target.join("dev") };
        let mut node_a = cluster.nodes[0].node().await;
        stage_and_publish(&mut node_a, &v, &ctx, &pa, &cap).await;
        write_direct(&pa.target, 0, &before).unwrap();

        // node-a is cut off; the CO declares it gone and moves the volume to node-b.
        cluster.lan.partition(&cluster.nodes[0].member);
        unpublish(&mut ctl, &v, "node-a").await;
        let ctx = publish(&mut ctl, &v, "node-b", &cap).await;
        let staged = cluster.paths(1, "pod-b");
        let pb = Paths { staging: staged.staging, target: staged.target.join("dev") };
        let mut node_b = cluster.nodes[1].node().await;
        stage_and_publish(&mut node_b, &v, &ctx, &pb, &cap).await;
        assert!(read_direct(&pb.target, 0, before.len()) == before, "node-b reads what node-a wrote before");

        // node-a, still running and cut off, writes on (its engine may or may not still
        // acknowledge it, with its own replica only); node-b writes elsewhere.
        let device_a = pa.target.clone();
        let late_a = late.clone();
        let late_write = std::thread::spawn(move || write_direct(&device_a, 1 << 20, &late_a));
        write_direct(&pb.target, 2 << 20, &from_b).unwrap();
        let late_result = late_write.join().unwrap();
        eprintln!("node-a's write while cut off: {late_result:?}");

        // node-a comes back: every replica refuses its engine from now on.
        cluster.lan.heal(&cluster.nodes[0].member);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (device, late) = (pa.target.clone(), late.clone());
            let r = tokio::task::spawn_blocking(move || write_direct(&device, 1 << 20, &late)).await.unwrap();
            if r.is_err() {
                break;
            }
            assert!(Instant::now() < deadline, "node-a's engine still writes after the partition healed");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let read = |p: &Paths, at: u64| read_direct(&p.target, at, 1 << 20);
        assert!(read(&pb, 0) == before && read(&pb, 2 << 20) == from_b, "node-b reads its own data");
        assert!(read(&pb, 1 << 20) == vec![0; 1 << 20], "node-a's late write is not on node-b's volume");

        // node-a's pod goes (kubelet tears down what it had), node-b's too.
        unpublish_and_unstage(&mut node_a, &v, &pa).await;
        let mut node_b = cluster.nodes[1].node().await;
        wait_condition(&mut node_b, &v, &pb, "healthy (node-a's replica rebuilt)", |c| !c.abnormal).await;
        unpublish_and_unstage(&mut node_b, &v, &pb).await;
        unpublish(&mut ctl, &v, "node-b").await;

        // Any later engine (here on node-c, with every replica reachable) reads node-b's data.
        let ctx = publish(&mut ctl, &v, "node-c", &cap).await;
        let staged = cluster.paths(2, "pod-c");
        let pc = Paths { staging: staged.staging, target: staged.target.join("dev") };
        let mut node_c = cluster.nodes[2].node().await;
        stage_and_publish(&mut node_c, &v, &ctx, &pc, &cap).await;
        assert!(read(&pc, 0) == before && read(&pc, 2 << 20) == from_b, "node-c reads node-b's data");
        assert!(read(&pc, 1 << 20) == vec![0; 1 << 20], "node-a's late write is on no replica node-c reads");
        unpublish_and_unstage(&mut node_c, &v, &pc).await;
        unpublish(&mut ctl, &v, "node-c").await;
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
        cluster.assert_replicas_identical(3);
    });
}

// ----- the data path in a process of its own ------------------------------------------------------

#[test]
fn three_volumes_under_verified_io_outlive_a_kill_9_of_the_node_plugin() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut cluster = Cluster::start_with(2, true).await;
        let datapath = cluster.nodes[0].datapath_pid().expect("node-a's plugin started its data path");
        let mut ctl = cluster.controller().await;
        // Two ext4 volumes and a raw block one (which NodeExpandVolume grows below: ext4 cannot
        // grow while mounted on this kernel).
        let caps = [mount_cap(Some("ext4")), mount_cap(Some("ext4")), mount_cap(None)];
        let raw =
            |i: usize, p: Paths| if i == 2 { Paths { staging: p.staging, target: p.target.join("dev") } } else { p };
        let mut node_a = cluster.nodes[0].node().await;
        let mut volumes = Vec::new();
        for (i, cap) in caps.iter().enumerate() {
            let v = create(&mut ctl, &format!("pvc-outlives-{i}"), 2, cap).await;
            let ctx = publish(&mut ctl, &v, "node-a", cap).await;
            let p = raw(i, cluster.paths(0, &format!("pod-{i}")));
            stage_and_publish(&mut node_a, &v, &ctx, &p, cap).await;
            volumes.push((v, ctx, p));
        }
        // What fio writes: a file on each filesystem, the raw device itself.
        let file = |i: usize, p: &Paths| if i == 2 { p.target.clone() } else { p.target.join("verified.dat") };

        // fio writes and verifies on all three while the plugin dies and comes back.
        let mut writers: Vec<_> = volumes
            .iter()
            .enumerate()
            .map(|(i, (_, _, p))| fio(&file(i, p), false).stdout(std::process::Stdio::null()).spawn().unwrap())
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        cluster.nodes[0].kill9();
        let killed = Instant::now();
        let running_at_kill = writers.iter_mut().map(|w| w.try_wait().unwrap()).filter(Option::is_none).count();
        cluster.restart(0);
        let mut node_a = cluster.nodes[0].node().await;
        let ready = killed.elapsed();
        let running_at_ready = writers.iter_mut().map(|w| w.try_wait().unwrap()).filter(Option::is_none).count();
        for (i, w) in writers.iter_mut().enumerate() {
            let status = w.wait().unwrap();
            assert!(status.success(), "fio on volume {i} through the plugin's kill -9: {status}");
        }
        eprintln!(
            "plugin restart-to-ready {ready:?} (kill to Probe ready); fio runs going on at the kill: \
             {running_at_kill}/3, when the new plugin was ready: {running_at_ready}/3"
        );
        assert_eq!(cluster.nodes[0].datapath_pid(), Some(datapath), "the same data path serves on");
        for (i, (_, _, p)) in volumes.iter().enumerate() {
            fio_ok(&mut fio(&file(i, p), true), "verify after the plugin's restart");
        }

        // `wasmcsi volume status` sees the volume through the replica servers, and its engine's
        // status through the one that runs in the data path.
        let set = volumes[0].0.volume_id.strip_prefix("replicated-block:").unwrap().to_owned();
        let replicas =
            cluster.nodes.iter().flat_map(|n| ["--replica".to_owned(), format!("{}:{REPLICA_PORT}", n.member.addr)]);
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", cluster.nodes[0].member.netns))
            .args(["--", support::process::BIN, "volume", "status", "--volume-id", &set])
            .args(replicas)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "volume status: {text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("attached to node-a") && text.contains("2/2 healthy"), "volume status: {text}");

        // The new plugin knows every volume the old one staged: it grows the raw one (the
        // controller through the engine in the data path, then the node)...
        let (v, _, p) = &volumes[2];
        let grown = SIZE + 64 * MIB;
        ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange { required_bytes: grown, limit_bytes: 0 }),
            volume_capability: Some(caps[2].clone()),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|s| panic!("ControllerExpandVolume: {s:?}"));
        let expanded = node_a
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: v.volume_id.clone(),
                volume_path: p.target.to_string_lossy().into(),
                capacity_range: Some(csi::CapacityRange { required_bytes: grown, limit_bytes: 0 }),
                volume_capability: Some(caps[2].clone()),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|s| panic!("NodeExpandVolume after the plugin's restart: {s:?}"))
            .into_inner();
        assert!(expanded.capacity_bytes >= grown, "the device grew: {expanded:?}");
        // ... and reports, publishes at a new target and unstages each.
        for (i, (v, ctx, p)) in volumes.iter().enumerate() {
            let s = stats(&mut node_a, v, &p.target).await;
            let c = s.volume_condition.expect("a volume condition");
            assert!(!c.abnormal, "volume {i} is healthy after the plugin's restart: {c:?}");
            if i == 2 {
                assert!(s.usage.iter().any(|u| u.total >= grown), "the raw volume's size: {:?}", s.usage);
            } else {
                assert!(s.usage.iter().any(|u| u.used > 0), "volume {i} reports what fio wrote: {:?}", s.usage);
            }
            let second = raw(i, cluster.paths(0, &format!("pod-{i}-b")));
            let second = Paths { staging: p.staging.clone(), target: second.target };
            publish_at(&mut node_a, v, ctx, &second, &caps[i]).await;
            assert!(file(i, &second).exists(), "volume {i} shows at the new target");
            unpublish_at(&mut node_a, v, &second.target).await;
            unpublish_and_unstage(&mut node_a, v, p).await;
            unpublish(&mut ctl, v, "node-a").await;
        }
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        let listed = wasmcsi_datapath::client::Engines::Remote(wasmcsi_datapath::client::DataPathClient::new(
            cluster.nodes[0].home.join("datapath.sock"),
        ))
        .list()
        .await
        .unwrap();
        assert_eq!(listed, Vec::new(), "the data path serves no volume once all are unstaged");
        cluster.stop();
        assert_eq!(cluster.nodes[0].datapath_pid(), None, "the data path stopped on SIGTERM");
    });
}

#[test]
fn the_data_path_killed_while_staged_restages_with_every_flushed_write_and_agreeing_replicas() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut cluster = Cluster::start_with(2, true).await;
        let mut ctl = cluster.controller().await;
        let cap = mount_cap(Some("ext4"));
        let v = create(&mut ctl, "pvc-datapath-killed", 2, &cap).await;
        let ctx = publish(&mut ctl, &v, "node-a", &cap).await;
        let p = cluster.paths(0, "pod-1");
        let mut node_a = cluster.nodes[0].node().await;
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;

        let payload = write_flushed(&p.target);

        // The data path dies; the plugin (which started it) starts another.
        let old = cluster.nodes[0].kill_datapath().expect("a data path ran");
        let deadline = Instant::now() + Duration::from_secs(60);
        let new = loop {
            if let Some(pid) = cluster.nodes[0].datapath_pid().filter(|pid| *pid != old) {
                break pid;
            }
            assert!(Instant::now() < deadline, "the plugin never started its data path again");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let c = condition(&mut node_a, &v, &p).await;
        assert!(c.abnormal && c.message.contains("no longer runs"), "the volume says it lost its engine: {c:?}");
        unpublish_and_unstage(&mut node_a, &v, &p).await;
        assert_eq!(mounts_under(&cluster.nodes[0].home), Vec::<String>::new(), "unstage leaves nothing mounted");
        stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;
        assert_eq!(cluster.nodes[0].datapath_pid(), Some(new), "the new data path serves the volume");
        assert_flushed(&p.target, &payload, "the data path's kill -9");
        // Let the new engine finish resyncing the replicas before they are compared.
        wait_condition(&mut node_a, &v, &p, "healthy", |c| !c.abnormal).await;
        unpublish_and_unstage(&mut node_a, &v, &p).await;
        unpublish(&mut ctl, &v, "node-a").await;
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
        cluster.assert_replicas_identical(2);
    });
}

#[test]
fn three_volumes_under_verified_io_survive_ten_live_upgrades_of_the_data_path() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut cluster = Cluster::start_with(2, true).await;
        let datapath = cluster.nodes[0].datapath_pid().expect("node-a's plugin started its data path");
        let mut ctl = cluster.controller().await;
        let cap = mount_cap(Some("ext4"));
        let mut node_a = cluster.nodes[0].node().await;
        let mut volumes = Vec::new();
        for i in 0..3 {
            let v = create(&mut ctl, &format!("pvc-upgraded-{i}"), 2, &cap).await;
            let ctx = publish(&mut ctl, &v, "node-a", &cap).await;
            let p = cluster.paths(0, &format!("pod-{i}"));
            stage_and_publish(&mut node_a, &v, &ctx, &p, &cap).await;
            volumes.push((v, ctx, p));
        }
        let mounted_before = mounts_under(&cluster.nodes[0].home);

        // A second copy of the binary: the handovers alternate between the two.
        let copy = cluster.dir.path().join("wasmcsi-next");
        std::fs::copy(support::process::BIN, &copy).unwrap();
        let binaries = [copy.clone(), PathBuf::from(support::process::BIN)];

        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writers: Vec<_> = volumes
            .iter()
            .map(|(_, _, p)| {
                let (file, stop) = (p.target.join("verified.dat"), stop.clone());
                std::thread::spawn(move || fio_until(file, stop))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;

        let socket = cluster.nodes[0].home.join("datapath.sock");
        let mut pauses = Vec::new();
        let mut took = Vec::new();
        for n in 0..10 {
            let binary = &binaries[n % 2];
            let started = Instant::now();
            let out = Command::new(support::process::BIN)
                .args(["upgrade", "datapath", "--socket"])
                .arg(&socket)
                .arg("--binary")
                .arg(binary)
                .output()
                .unwrap();
            took.push(started.elapsed());
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "upgrade {n}: {text}{}", String::from_utf8_lossy(&out.stderr));
            let pause = support::cluster::upgrade_pause(&text);
            assert!(text.contains(&format!("(handover {})", n + 1)) && text.contains("3 volumes"), "{text}");
            pauses.push(pause);
            assert_eq!(cluster.nodes[0].datapath_pid(), Some(datapath), "the data path keeps its pid");
            assert_eq!(std::fs::read_link(format!("/proc/{datapath}/exe")).unwrap(), *binary, "it runs the new binary");
            assert_eq!(mounts_under(&cluster.nodes[0].home), mounted_before, "nothing was unmounted or mounted");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut fio_longest = Duration::ZERO;
        for (i, w) in writers.into_iter().enumerate() {
            let (runs, failed, longest) = w.join().unwrap();
            assert!(runs >= 1, "fio ran on volume {i}");
            assert_eq!(failed, 0, "fio runs with an error on volume {i} (of {runs})");
            fio_longest = fio_longest.max(longest);
        }
        for (i, (_, _, p)) in volumes.iter().enumerate() {
            fio_ok(&mut fio(&p.target.join("verified.dat"), true), &format!("verify volume {i} after the upgrades"));
        }
        let mut sorted = pauses.clone();
        sorted.sort();
        let mut took_sorted = took.clone();
        took_sorted.sort();
        eprintln!(
            "live upgrades under load: longest I/O pause per handover p50 {:?}, max {:?} (data path's measure); \
             upgrade command p50 {:?}, max {:?}; fio's longest write latency {fio_longest:?}; all pauses {pauses:?}",
            sorted[sorted.len() / 2],
            sorted[sorted.len() - 1],
            took_sorted[took_sorted.len() / 2],
            took_sorted[took_sorted.len() - 1],
        );
        // The goal is 1 s; the bound only catches a handover that stalls.
        assert!(sorted[sorted.len() - 1] < Duration::from_secs(10), "a handover paused I/O for {pauses:?}");

        // The upgraded data path serves the control plane and the plugin as before; a replica
        // that joined an adopting engine late is caught up (the wait says how long it took).
        for (i, (v, _, p)) in volumes.iter().enumerate() {
            let waited = wait_condition(&mut node_a, v, p, "healthy after the upgrades", |c| !c.abnormal).await;
            eprintln!("volume {i} healthy {waited:?} after the last upgrade's end");
        }
        for (v, _, p) in &volumes {
            unpublish_and_unstage(&mut node_a, v, p).await;
            unpublish(&mut ctl, v, "node-a").await;
        }
        assert_eq!(mounts_under(cluster.dir.path()), Vec::<String>::new(), "nothing left mounted");
        cluster.stop();
        assert_eq!(cluster.nodes[0].datapath_pid(), None, "the upgraded data path stopped on SIGTERM");
    });
}
