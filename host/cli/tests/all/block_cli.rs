//! `wasmcsi replica …` and `wasmcsi volume …` through the real binary: replica servers as child
//! processes, a volume created, attached as a loop device (root with /dev/fuse only; skipped with
//! a message otherwise), snapshotted, grown and rebuilt online, detached, cloned and reverted,
//! with the replicas checked offline afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_wasmcsi");

/// Kills (SIGKILL) and reaps every child still registered when dropped.
#[derive(Default)]
struct Children(Vec<Option<Child>>);

impl Children {
    fn add(&mut self, c: Child) -> usize {
        self.0.push(Some(c));
        self.0.len() - 1
    }
    /// SIGINT, then waits up to `timeout` for the exit; returns its success.
    fn interrupt(&mut self, i: usize, timeout: Duration) -> bool {
        let mut child = self.0[i].take().unwrap();
        kill(Pid::from_raw(i32::try_from(child.id()).unwrap()), Signal::SIGINT).unwrap();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.success();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("child {i} did not exit within {timeout:?} of SIGINT");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in self.0.iter_mut().rev().filter_map(Option::take) {
            let mut c = c;
            // SIGINT first so an attached volume gets a chance to detach, then SIGKILL.
            let _ = kill(Pid::from_raw(i32::try_from(c.id()).unwrap()), Signal::SIGINT);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn run_ok(args: &[&str]) {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(out.status.success(), "wasmcsi {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Forwards the child's stdout lines to a channel (and to our stdout, for debugging).
fn lines(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("child: {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_line(rx: &mpsc::Receiver<String>, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if pred(&l) => return l,
            Ok(_) => {}
            Err(e) => panic!("no expected line within {timeout:?}: {e}"),
        }
    }
}

fn run_out(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(out.status.success(), "wasmcsi {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run_fails(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(!out.status.success(), "wasmcsi {args:?} should have failed");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn loop_size(device: &str) -> u64 {
    let name = device.trim_start_matches("/dev/");
    let sectors = std::fs::read_to_string(format!("/sys/block/{name}/size")).unwrap();
    sectors.trim().parse::<u64>().unwrap() * 512
}

/// Starts `wasmcsi replica serve` on a fresh root; returns (child index, address, root).
fn serve(children: &mut Children) -> (usize, String, tempfile::TempDir) {
    let root = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(BIN)
        .args(["replica", "serve", "--root", root.path().to_str().unwrap(), "--listen", &addr])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = lines(&mut child);
    let i = children.add(child);
    wait_line(&rx, Duration::from_secs(10), |l| l.starts_with("serving replicas"));
    (i, addr, root)
}

fn read_replica(root: &Path, volume: &str, snapshot: Option<&str>, offset: u64, len: u32) -> Vec<u8> {
    let store = wasmcsi_block::replica::ReplicaStore::open(&root.join(volume)).unwrap();
    match snapshot {
        Some(name) => store.read_snapshot(name, offset, len).unwrap(),
        None => store.read(offset, len).unwrap(),
    }
}

/// The whole by-hand lifecycle through the real binary: three replica servers; a volume created
/// on two, attached as a loop device, written, snapshotted and grown online; one server killed
/// and its replica replaced by a new one on the third server (full rebuild followed with
/// `volume rebuild`); detached with `volume detach`; cloned from the snapshot and reverted
/// offline; every replica checked offline against what was written.
#[test]
fn replicated_volume_by_hand_create_attach_snapshot_expand_replace_detach_clone_revert_delete() {
    let mut children = Children::default();
    let servers: Vec<_> = (0..3).map(|_| serve(&mut children)).collect();
    let addr = |i: usize| servers[i].1.clone();
    let (a0, a1) = (addr(0), addr(1));
    let create = ["volume", "create", "--volume-id", "pvc-cli", "--size", "16M", "--replica", &a0, "--replica", &a1];
    run_ok(&create);
    run_ok(&create); // a retry of the same create succeeds
    let err = run_fails(&["volume", "create", "--volume-id", "pvc-cli", "--size", "32M", "--replica", &addr(0)]);
    assert!(err.contains("AlreadyExists"), "{err}");
    let nodes = run_out(&["replica", "nodes", "--replica", &addr(0), "--replica", &addr(2)]);
    assert!(nodes.contains("pvc-cli  16 MiB"), "{nodes}");

    let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let later: Vec<u8> = pattern.iter().map(|b| !b).collect();
    if let Some(why) = crate::support::needs_root_and_fuse() {
        eprintln!("skipping the attached part: {why}");
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let runtime = tempfile::tempdir().unwrap();
    let rt = runtime.path().to_str().unwrap().to_owned();
    let mut child = Command::new(BIN)
        .args(["volume", "attach", "--volume-id", "pvc-cli", "--local", "0"])
        .args(["--replica", &addr(0), "--replica", &addr(1)])
        .args(["--state-dir", state.path().to_str().unwrap(), "--runtime-dir", &rt])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = lines(&mut child);
    let attach = children.add(child);
    let device = wait_line(&rx, Duration::from_secs(60), |l| l.starts_with("/dev/loop"));
    assert_eq!(loop_size(&device), 16 << 20);
    let online = ["--volume-id", "pvc-cli", "--runtime-dir", rt.as_str()];
    {
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&device).unwrap();
        f.write_all(&pattern).unwrap();
        f.sync_all().unwrap();
    }
    run_ok(&[&["volume", "snapshot", "--name", "snap1"][..], &online].concat());
    {
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&device).unwrap();
        f.write_all(&later).unwrap();
        f.sync_all().unwrap();
    }
    let listed = run_out(&[&["volume", "snapshots"][..], &online].concat());
    assert!(listed.starts_with("snap1  created "), "{listed}");
    run_ok(&[&["volume", "expand", "--size", "32M"][..], &online].concat());
    assert_eq!(loop_size(&device), 32 << 20, "the loop device grew online");
    {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&device).unwrap();
        f.write_all_at(&pattern, 24 << 20).unwrap();
        f.sync_all().unwrap();
    }

    // Server 1 dies; its replica moves to server 2 and is rebuilt while attached.
    assert!(children.interrupt(servers[1].0, Duration::from_secs(15)));
    let status = loop {
        let s = run_out(&[&["volume", "status"][..], &online].concat());
        if s.contains("1/2 healthy") {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.contains("(degraded)"), "{status}");
    let err = run_fails(&[&["volume", "snapshot", "--name", "refused"][..], &online].concat());
    assert!(err.contains("degraded") || err.contains("healthy"), "{err}");
    let rebuilt = run_out(
        &[&["volume", "rebuild", "--replace", "1", "--with", &addr(2), "--wait-secs", "60"][..], &online].concat(),
    );
    assert!(rebuilt.contains("2/2 healthy"), "{rebuilt}");
    {
        let mut f = std::fs::File::open(&device).unwrap();
        let mut back = vec![0u8; later.len()];
        f.read_exact(&mut back).unwrap();
        assert!(back == later, "the volume reads what was written last");
    }
    let err = run_fails(&[
        "volume",
        "revert",
        "--volume-id",
        "pvc-cli",
        "--name",
        "snap1",
        "--replica",
        &addr(0),
        "--replica",
        &addr(2),
        "--runtime-dir",
        &rt,
    ]);
    assert!(err.contains("attached"), "{err}");
    run_ok(&[&["volume", "detach"][..], &online].concat());
    assert!(children.interrupt(attach, Duration::from_secs(30)), "volume attach did not exit 0 after detach");
    let out = Command::new("losetup").arg("-a").output().unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(!listing.lines().any(|l| l.starts_with(&format!("{device}:"))), "{device} still attached:\n{listing}");

    // Detached: clone the snapshot, revert the volume, and check every replica offline.
    let set = ["--volume-id", "pvc-cli", "--replica", &addr(0), "--replica", &addr(2)];
    let snaps = run_out(&[&["volume", "snapshots"][..], &set, &["--runtime-dir", &rt]].concat());
    assert!(snaps.contains("snap1"), "{snaps}");
    run_ok(&[
        "volume",
        "clone",
        "--volume-id",
        "pvc-clone",
        "--replica",
        &addr(2),
        "--source-volume-id",
        "pvc-cli",
        "--source-replica",
        &addr(0),
        "--snapshot",
        "snap1",
    ]);
    run_ok(&[&["volume", "revert", "--name", "snap1", "--runtime-dir", &rt][..], &set].concat());
    for i in [0, 2] {
        assert!(children.interrupt(servers[i].0, Duration::from_secs(15)), "replica server {i} did not exit 0");
    }
    let head = |i: usize| read_replica(servers[i].2.path(), "pvc-cli", None, 0, 1 << 20);
    assert!(head(0) == pattern && head(2) == pattern, "reverted to snap1 on both replicas");
    assert!(read_replica(servers[2].2.path(), "pvc-cli", Some("snap1"), 0, 1 << 20) == pattern);
    assert!(read_replica(servers[2].2.path(), "pvc-clone", None, 0, 1 << 20) == pattern, "the clone holds snap1");
}
