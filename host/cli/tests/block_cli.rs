//! `wasmcsi replica create|serve` and `wasmcsi volume attach` through the real binary: two replica
//! servers as child processes, a volume attached over them as a loop device (root with /dev/fuse
//! only; skipped with a message otherwise), 1 MiB written and read back through the loop device,
//! then SIGINT detaches cleanly (exit 0, no loop device left) and SIGINT stops the servers.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
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
    fn get(&mut self, i: usize) -> &mut Child {
        self.0[i].as_mut().unwrap()
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

fn skip_reason() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse missing".into());
    }
    None
}

#[test]
fn replica_serve_and_volume_attach_write_read_detach() {
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    for d in &dirs {
        run_ok(&["replica", "create", "--dir", d.path().to_str().unwrap(), "--volume-id", "pvc-cli", "--size", "16M"]);
    }
    let mut children = Children::default();
    let mut addrs = Vec::new();
    let mut servers = Vec::new();
    for d in &dirs {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut child = Command::new(BIN)
            .args(["replica", "serve", "--dir", d.path().to_str().unwrap(), "--listen", &addr])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let rx = lines(&mut child);
        let i = children.add(child);
        wait_line(&rx, Duration::from_secs(10), |l| l.starts_with("serving replica"));
        addrs.push(addr);
        servers.push(i);
    }

    let mut written = None;
    if let Some(why) = skip_reason() {
        eprintln!("skipping volume attach: {why}");
    } else {
        let state = tempfile::tempdir().unwrap();
        let runtime = tempfile::tempdir().unwrap();
        let mut child = Command::new(BIN)
            .args(["volume", "attach", "--volume-id", "pvc-cli", "--size", "16M", "--local", "0"])
            .args(["--replica", &addrs[0], "--replica", &addrs[1]])
            .args(["--state-dir", state.path().to_str().unwrap(), "--runtime-dir", runtime.path().to_str().unwrap()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let rx = lines(&mut child);
        let attach = children.add(child);
        let device = wait_line(&rx, Duration::from_secs(60), |l| l.starts_with("/dev/loop"));
        assert!(children.get(attach).try_wait().unwrap().is_none());

        let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        {
            let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&device).unwrap();
            f.write_all(&pattern).unwrap();
            f.sync_all().unwrap();
            f.seek(SeekFrom::Start(0)).unwrap();
            let mut back = vec![0u8; pattern.len()];
            f.read_exact(&mut back).unwrap();
            assert!(back == pattern, "read back differs from what was written");
            // And a block beyond the pattern is still zero.
            let mut z = vec![0xffu8; 4096];
            f.read_exact_at(&mut z, 8 << 20).unwrap();
            assert!(z.iter().all(|&b| b == 0));
        }

        assert!(children.interrupt(attach, Duration::from_secs(30)), "volume attach did not exit 0");
        let out = Command::new("losetup").arg("-a").output().unwrap();
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(!listing.lines().any(|l| l.starts_with(&format!("{device}:"))), "{device} still attached:\n{listing}");
        written = Some(pattern);
    }

    for i in servers {
        assert!(children.interrupt(i, Duration::from_secs(15)), "replica server {i} did not exit 0");
    }
    // The flushed write reached both replicas' data files (not just the page cache).
    if let Some(pattern) = written {
        for d in &dirs {
            let data = std::fs::read(d.path().join("data.img")).unwrap();
            assert!(data[..pattern.len()] == pattern[..], "replica {} lacks the write", d.path().display());
        }
    }
}
