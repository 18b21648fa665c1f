//! `wasmcsi volume backup|backups|restore` through the real binary against two real replica
//! servers (child processes) and a filesystem target: a full backup, an incremental one that
//! reads and uploads only the chunks the replicas' layers say changed, restores compared byte for
//! byte with the snapshot's view, and the fall back to a full read when the parent's snapshot is
//! gone from the replicas. No root needed: the volume is written through replica sessions, as an
//! engine writes it.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use wasmcsi_backup::{BackupStore, FsTarget, Manifest, StoreOptions};
use wasmcsi_block::control::{ReplicaSession, ReplicaSet};

use crate::support::process::{BIN, Proc};

const VOLUME: &str = "pvc-backup";
const SIZE: u64 = 128 << 20;
/// The backup crate's default chunk size, which the CLI uses.
const CHUNK: u64 = wasmcsi_backup::manifest::DEFAULT_CHUNK;
const TIMEOUT: Duration = Duration::from_secs(20);

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// `wasmcsi ARGS`, which must succeed; its stdout and stderr.
fn wasmcsi(args: &[&str]) -> (String, String) {
    let out = Command::new(BIN).env("NO_COLOR", "1").args(args).output().unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "wasmcsi {args:?}:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

/// Compressible bytes (half of each 4 KiB block random, half one repeated byte), distinct per
/// `seed`: a chunk of them is stored compressed, below its size.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|i| {
            if i % 4096 < 2048 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8 | 1
            } else {
                seed as u8 | 0x80
            }
        })
        .collect()
}

/// Writes `data` at `offset` on every replica, as the engine would.
async fn write_all(set: &ReplicaSet, offset: u64, data: &[u8]) {
    let mut sessions = set.open().await.unwrap();
    for s in &mut sessions {
        for (i, piece) in data.chunks(1 << 20).enumerate() {
            s.write(offset + (i as u64) * (1 << 20), piece.to_vec()).await.unwrap();
        }
    }
    for s in sessions {
        s.close().await.unwrap();
    }
}

/// The volume as of `snapshot`, read from replica `addr`.
async fn snapshot_view(addr: SocketAddr, snapshot: &str) -> Vec<u8> {
    let mut s = ReplicaSession::open(addr, VOLUME, TIMEOUT).await.unwrap();
    let mut out = Vec::with_capacity(SIZE as usize);
    let mut at = 0;
    while at < SIZE {
        out.extend(s.read_snapshot(snapshot, at, 1 << 20).await.unwrap());
        at += 1 << 20;
    }
    s.close().await.unwrap();
    out
}

/// `wasmcsi volume restore BACKUP` of the volume from `target` into the file `to`; returns `to`.
fn restore(target: &str, backup: &str, to: &Path) -> PathBuf {
    wasmcsi(&["volume", "restore", backup, "--volume-id", VOLUME, "--target", target, "--to", to.to_str().unwrap()]);
    to.to_owned()
}

async fn manifest(target: &Path, backup: &str) -> Manifest {
    let store = BackupStore::new(Arc::new(FsTarget::new(target.to_owned())), StoreOptions::default());
    store.manifest(VOLUME, backup).await.unwrap()
}

/// The chunks a set of written ranges touches.
fn chunks_touched(writes: &[(u64, usize)]) -> u64 {
    let mut touched: Vec<u64> =
        writes.iter().flat_map(|&(off, len)| off / CHUNK..=(off + len as u64 - 1) / CHUNK).collect();
    touched.sort_unstable();
    touched.dedup();
    touched.len() as u64
}

#[test]
fn an_incremental_backup_reads_only_changed_chunks_and_restores_byte_exact() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let work = tempfile::tempdir().unwrap();
    let target = work.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let target_s = target.to_str().unwrap();
    let addrs = [free_addr(), free_addr()];
    let _servers: Vec<Proc> = addrs
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let root = work.path().join(format!("replicas-{i}"));
            let args = ["replica", "serve", "--root", root.to_str().unwrap(), "--listen", &addr.to_string()];
            let mut p = Proc::spawn(&format!("replica-{i}"), None, &args.map(str::to_owned));
            p.wait_line("serving", |l| l.contains("serving replicas"));
            p
        })
        .collect();
    let (a0, a1) = (addrs[0].to_string(), addrs[1].to_string());
    let replicas = ["--replica", a0.as_str(), "--replica", a1.as_str()];
    let volume_args = |cmd: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["volume"].iter().chain(cmd).map(|s| (*s).to_owned()).collect();
        v.extend(["--volume-id", VOLUME].map(str::to_owned));
        v.extend(replicas.map(str::to_owned));
        v
    };
    let run = |cmd: &[&str]| {
        let args = volume_args(cmd);
        wasmcsi(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    run(&["create", "--size", "128M"]);
    let set = ReplicaSet::new(VOLUME, addrs.to_vec(), TIMEOUT);

    // Three quarters of the volume written, the last quarter a hole.
    let mut model = vec![0u8; SIZE as usize];
    let base = pattern(1, (SIZE / 4 * 3) as usize);
    model[..base.len()].copy_from_slice(&base);
    rt.block_on(write_all(&set, 0, &base));
    run(&["snapshot", "--name", "s1"]);
    let (out, _) = run(&["backup", "--snapshot", "s1", "--target", target_s]);
    assert!(out.contains("backup s1 of pvc-backup@s1 complete"), "{out}");
    let full = rt.block_on(manifest(&target, "s1"));
    assert_eq!(full.stats.read_bytes, SIZE / 4 * 3, "a full backup reads what the snapshot holds, not its holes");
    assert!(full.stats.uploaded_bytes < full.stats.read_bytes, "compressed");

    // 1 % of the volume changed, in five places (one across a chunk boundary).
    let writes: Vec<(u64, usize)> = vec![
        (4096, 256 << 10),
        (10 * CHUNK + 8192, 200 << 10),
        (31 * CHUNK - (64 << 10), 128 << 10),
        (50 * CHUNK, 450 << 10),
        (63 * CHUNK + 12_288, 300 << 10),
    ];
    let changed: usize = writes.iter().map(|w| w.1).sum();
    assert!(changed as u64 >= SIZE / 100 && (changed as u64) < SIZE / 50);
    for (i, &(off, len)) in writes.iter().enumerate() {
        let data = pattern(10 + i as u64, len);
        model[off as usize..off as usize + len].copy_from_slice(&data);
        rt.block_on(write_all(&set, off, &data));
    }
    run(&["snapshot", "--name", "s2"]);
    let (out, _) = run(&["backup", "--snapshot", "s2", "--target", target_s, "--parent", "s1"]);
    println!("{out}");
    let incr = rt.block_on(manifest(&target, "s2"));
    let touched = chunks_touched(&writes);
    assert_eq!(touched, 6, "five writes, one across a boundary");
    assert!(
        incr.stats.read_bytes <= touched * CHUNK,
        "read {} bytes for {touched} changed chunks",
        incr.stats.read_bytes
    );
    assert!(incr.stats.read_bytes >= changed as u64);
    assert!(incr.stats.uploaded_bytes <= touched * CHUNK, "uploaded {}", incr.stats.uploaded_bytes);
    assert_eq!(incr.stats.uploaded_chunks, touched);
    assert!(out.contains(&format!("read {} bytes", incr.stats.read_bytes)), "{out}");

    // The restore of the incremental is the volume as of s2, byte for byte.
    let restored = restore(target_s, "s2", &work.path().join("restored-s2.img"));
    let bytes = std::fs::read(&restored).unwrap();
    let view = rt.block_on(snapshot_view(addrs[1], "s2"));
    assert!(view == model, "the replica's s2 is what was written");
    assert!(bytes == view, "restored s2 differs from the volume's s2");
    let (listed, _) = wasmcsi(&["volume", "backups", "--volume-id", VOLUME, "--target", target_s]);
    assert_eq!(listed.lines().count(), 2, "{listed}");

    // s1 deleted from the replicas (its layer folded into s2's): a backup against the backup of
    // s1 cannot know what changed, so it reads all of s3 and still uploads only what differs.
    run(&["delete-snapshot", "--name", "s1"]);
    let late = pattern(99, 64 << 10);
    model[(20 * CHUNK) as usize..(20 * CHUNK) as usize + late.len()].copy_from_slice(&late);
    rt.block_on(write_all(&set, 20 * CHUNK, &late));
    run(&["snapshot", "--name", "s3"]);
    let (out, err) = run(&["backup", "--snapshot", "s3", "--target", target_s, "--parent", "s1"]);
    println!("{out}");
    assert!(err.contains("reading the whole snapshot"), "the fall back is logged: {err}");
    let fallback = rt.block_on(manifest(&target, "s3"));
    assert_eq!(fallback.stats.read_bytes, SIZE, "a full read of s3");
    // Of the chunks that differ from s1's backup, those s2's backup stored are found on the
    // target: only the chunk written since s2 is new.
    assert_eq!(fallback.stats.uploaded_chunks, 1);
    let restored = restore(target_s, "s3", &work.path().join("restored-s3.img"));
    assert!(std::fs::read(&restored).unwrap() == model, "restored s3 differs from what was written");
    assert!(rt.block_on(snapshot_view(addrs[0], "s3")) == model);
}
