//! A shell running as pid 1 of its own network, mount and pid namespaces (`unshare --net
//! --mount --pid --fork --mount-proc --kill-child`), reachable from the root namespace through a
//! veth pair on a private /30: the place test servers (nfs-ganesha, a Ceph cluster) run, so
//! several can run at once, none binds a port of the machine, and a test can cut, freeze or
//! kill one. Dropping it ends the shell, which takes every process of the namespace with it,
//! and deletes the veth pair: nothing is left behind.
//!
//! Protocol with the script, one line each way: the shell prints `ns` once the namespaces
//! exist; the parent then creates the veth pair (the namespace end is `$PEER_IF`) and the
//! caller sends `go ADDR` (the namespace's address) with [`NsShell::command`], to which the
//! script answers as it likes (e.g. `ready`). Every later command is the script's own. EOF on
//! stdin must end the script.
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How to start one namespace shell.
#[derive(Clone, Debug)]
pub struct NsOptions {
    /// The bash script (see the module docs for the protocol).
    pub script: String,
    /// Environment for the script (`PEER_IF` is set by [`NsShell::spawn`]).
    pub env: Vec<(String, OsString)>,
    /// Variables the script must not inherit.
    pub env_remove: Vec<String>,
    /// The /16 the veth pairs of this kind of server take addresses from: `[10, 201]` gives
    /// 10.201.x.y/30 pairs. Kinds use distinct /16s, so they never compete for slots.
    pub subnet: [u8; 2],
    /// Host-side interface names are `<prefix><slot>` (≤ 9 bytes, so names fit IFNAMSIZ).
    pub if_prefix: String,
    /// How long the shell may take to exit after stdin closes before it is killed.
    pub stop_patience: Duration,
}

struct Control {
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

/// One running namespace shell; stopped (with everything in it) on drop.
pub struct NsShell {
    child: Child,
    control: Mutex<Control>,
    host_if: String,
    addr: Ipv4Addr,
    stop_patience: Duration,
}

impl std::fmt::Debug for NsShell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NsShell").field("pid", &self.child.id()).field("addr", &self.addr).finish_non_exhaustive()
    }
}

/// The namespace end's name inside the namespace.
const PEER_IF: &str = "wpeer0";
/// /30 slots per /16.
const SLOTS: u32 = 16384;
static SEQ: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) -> io::Result<std::process::Output> {
    Command::new("ip").args(args).stdin(Stdio::null()).output()
}

fn read_line(c: &mut Control) -> io::Result<String> {
    let mut line = String::new();
    if c.stdout.read_line(&mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "namespace shell exited"));
    }
    Ok(line.trim().to_owned())
}

impl NsShell {
    /// Start the shell, wait for its `ns`, join it to the root namespace by a veth pair.
    pub fn spawn(opts: &NsOptions) -> io::Result<Self> {
        let mut cmd = Command::new("unshare");
        cmd.args(["--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", "-c", &opts.script])
            .env("PEER_IF", PEER_IF);
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        for k in &opts.env_remove {
            cmd.env_remove(k);
        }
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
        // From here on, an early return must not leave `child` running.
        let fail = |mut child: Child, e: io::Error| -> io::Error {
            let _ = child.kill();
            let _ = child.wait();
            e
        };
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(fail(child, io::Error::other("unshare: no stdio pipes")));
        };
        let mut control = Control { stdin: Some(stdin), stdout: BufReader::new(stdout) };
        // `ns`: unshare has created the namespaces (its own process is in the new net ns).
        match read_line(&mut control) {
            Ok(l) if l == "ns" => {}
            Ok(l) => return Err(fail(child, io::Error::other(format!("namespace shell said {l:?}")))),
            Err(e) => return Err(fail(child, e)),
        }
        let (host_if, addr) = match veth(child.id(), opts) {
            Ok(v) => v,
            Err(e) => return Err(fail(child, e)),
        };
        Ok(Self { child, control: Mutex::new(control), host_if, addr, stop_patience: opts.stop_patience })
    }

    /// Send one line and wait for the script's answer; an answer other than `want` is an error.
    /// Bounded by the script (each of its commands must answer).
    pub fn command(&self, line: &str, want: &str) -> io::Result<()> {
        let mut c = self.control.lock().unwrap_or_else(PoisonError::into_inner);
        let stdin = c.stdin.as_mut().ok_or_else(|| io::Error::other("the namespace shell is stopped"))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        let got = read_line(&mut c)?;
        if got == want { Ok(()) } else { Err(io::Error::other(format!("{line}: namespace shell said {got:?}"))) }
    }

    /// The namespace's address (its veth end), as clients in the root namespace reach it.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The host end of the veth pair (for tests that cut the link).
    pub fn host_interface(&self) -> &str {
        &self.host_if
    }
}

/// Create the veth pair: host end `<prefix><slot>` in the root namespace, the other end inside
/// the namespace of `pid`. Slots are taken machine-wide without a lock: a taken name fails
/// `ip link add`, and the next one is tried. Returns the host interface and the namespace's
/// address.
fn veth(pid: u32, opts: &NsOptions) -> io::Result<(String, Ipv4Addr)> {
    let first = (std::process::id().wrapping_mul(131) + SEQ.fetch_add(1, Ordering::Relaxed) * 7) % SLOTS;
    let pid = pid.to_string();
    let base = u32::from(Ipv4Addr::new(opts.subnet[0], opts.subnet[1], 0, 0));
    let mut last_err = String::new();
    for k in 0..256 {
        let slot = (first + k) % SLOTS;
        let host_if = format!("{}{slot}", opts.if_prefix);
        let out = ip(&["link", "add", &host_if, "type", "veth", "peer", "name", PEER_IF, "netns", &pid])?;
        if !out.status.success() {
            last_err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
            if last_err.contains("File exists") {
                continue;
            }
            return Err(io::Error::other(format!("ip link add {host_if}: {last_err}")));
        }
        let (host_addr, ns_addr) = (Ipv4Addr::from(base + slot * 4 + 1), Ipv4Addr::from(base + slot * 4 + 2));
        for args in
            [&["addr", "add", &format!("{host_addr}/30"), "dev", &host_if][..], &["link", "set", &host_if, "up"][..]]
        {
            let out = ip(args)?;
            if !out.status.success() {
                let _ = ip(&["link", "del", &host_if]);
                return Err(io::Error::other(format!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
        }
        return Ok((host_if, ns_addr));
    }
    Err(io::Error::other(format!("no free veth slot: {last_err}")))
}

impl Drop for NsShell {
    fn drop(&mut self) {
        // Closing stdin ends the shell, pid 1 of the namespace: the kernel kills the rest.
        if let Ok(mut c) = self.control.lock() {
            c.stdin = None;
        }
        let deadline = Instant::now() + self.stop_patience;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                // Stuck or unknown: SIGKILL unshare; --kill-child takes the namespace down too.
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        // The namespace took its veth end, and with it the pair; delete ours in case it lingers.
        let _ = ip(&["link", "del", &self.host_if]);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    /// A real namespace: the shell answers over the veth pair's address, and nothing is left
    /// after the drop. Skipped (saying why) when not root.
    #[test]
    fn the_namespace_is_reachable_and_gone_after_drop() {
        if !nix_is_root() {
            eprintln!("SKIPPED: creating namespaces and veth pairs needs root");
            return;
        }
        let script = r#"
echo ns
read -r go ADDR || exit 1
ip link set lo up
ip addr add "$ADDR/30" dev "$PEER_IF" && ip link set "$PEER_IF" up || { echo failed; exit 1; }
echo ready
while read -r cmd; do
  case "$cmd" in
    whoami) echo "pid$$" ;;
    *) echo failed ;;
  esac
done
"#;
        let opts = NsOptions {
            script: script.into(),
            env: vec![],
            env_remove: vec![],
            subnet: [10, 203],
            if_prefix: "wtest".into(),
            stop_patience: Duration::from_secs(3),
        };
        let ns = NsShell::spawn(&opts).expect("namespace");
        ns.command(&format!("go {}", ns.addr()), "ready").expect("go");
        // pid 1 of its own pid namespace
        ns.command("whoami", "pid1").expect("whoami");
        assert!(ns.command("nonsense", "ok").is_err(), "a wrong answer is an error");
        let ping = Command::new("ping").args(["-c1", "-W2", &ns.addr().to_string()]).output();
        if let Ok(out) = ping {
            assert!(out.status.success(), "ping {}: {}", ns.addr(), String::from_utf8_lossy(&out.stdout));
        }
        let host_if = ns.host_interface().to_owned();
        drop(ns);
        let links = ip(&["-o", "link", "show"]).unwrap();
        assert!(!String::from_utf8_lossy(&links.stdout).contains(&format!("{host_if}@")), "veth {host_if} left");
    }

    fn nix_is_root() -> bool {
        // The effective uid from /proc: no dependency for one number.
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(2) == Some("0")))
            .unwrap_or(false)
    }
}
