//! Child `wasmcsi` processes for the multi-process tests: spawned (optionally inside a network
//! namespace), their log lines collected and echoed, killed with -9 or interrupted, and always
//! reaped (a dropped [`Proc`] is SIGKILLed), so a failing test leaves no process behind.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

pub const BIN: &str = env!("CARGO_BIN_EXE_wasmcsi");

/// Strips ANSI colour sequences from log lines.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A child `wasmcsi` process whose stdout and stderr lines arrive on one channel (and are echoed
/// for debugging). Dropping it SIGKILLs and reaps it.
pub struct Proc {
    pub name: String,
    pub child: Child,
    lines: mpsc::Receiver<String>,
    /// Every line seen so far, for assertions on the log.
    pub seen: Vec<String>,
}

impl Proc {
    pub fn spawn(name: &str, netns: Option<&str>, args: &[String]) -> Self {
        let mut cmd = match netns {
            // nsenter --net, not `ip netns exec`: the latter also unshares the mount namespace,
            // and a copy of the engine's FUSE mount in another mount namespace keeps the FUSE
            // connection alive after the engine unmounts it, so its detach never finishes.
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).args(["--", BIN]);
                c
            }
            None => Command::new(BIN),
        };
        // nsenter execs the binary: the child's pid is the server's.
        cmd.args(args);
        Self::spawn_command(name, cmd)
    }

    /// `program` with `args` (a wrapper that runs the binary itself, e.g. `unshare`).
    pub fn spawn_program(name: &str, program: &str, args: &[String]) -> Self {
        let mut cmd = Command::new(program);
        cmd.args(args);
        Self::spawn_command(name, cmd)
    }

    fn spawn_command(name: &str, mut cmd: Command) -> Self {
        let mut child = cmd.env("NO_COLOR", "1").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let (tx, lines) = mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let (tx, name) = (tx.clone(), name.to_string());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let line = strip_ansi(&line);
                    println!("[{name}] {line}");
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Self { name: name.into(), child, lines, seen: Vec::new() }
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).unwrap())
    }

    /// Waits for a line matching `pred` (lines already seen are not considered again).
    pub fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if pred(&l) {
                        return l;
                    }
                }
                Err(e) => panic!("{}: no line {what} ({e}); exited: {:?}", self.name, self.child.try_wait()),
            }
        }
    }

    /// Collects the lines that arrived so far without waiting.
    pub fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
    }

    pub fn kill9(&mut self) {
        kill(self.pid(), Signal::SIGKILL).unwrap();
        self.child.wait().unwrap();
    }

    /// SIGINT and wait for a clean exit.
    pub fn interrupt(&mut self) {
        kill(self.pid(), Signal::SIGINT).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "{} exited with {status} after SIGINT", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{} did not exit after SIGINT", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
