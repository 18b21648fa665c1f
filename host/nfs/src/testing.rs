//! A real nfs-ganesha for tests and benches: NFSv3 + v4, one export of a fresh temporary
//! directory, `Graceless`, squash none, with its own rpcbind.
//!
//! Isolation: each instance runs in a private network + mount + pid namespace
//! (`unshare --net --mount --pid --fork --mount-proc --kill-child`), so instances in parallel
//! tests each have their own port 2049 and 111 and their own rpcbind registrations. The test
//! process stays in the root namespace and reaches the server through a veth pair on a private
//! /30 from 10.201.0.0/16 (the block tests use 10.200/16). The pair is allocated machine-wide
//! without a lock: creating the host end fails if its name (`wnfs<N>`) is taken, and the next
//! index is tried. The namespace's first process is a small shell that reads commands on its
//! stdin; when the test process drops the harness, panics or dies, that stdin closes, the shell
//! (pid 1 of the namespace) exits, and the kernel kills ganesha and rpcbind with it and
//! destroys the veth pair. Nothing is left behind.
//!
//! Needs root and the packages `scripts/nfs-setup` installs (nfs-ganesha, nfs-ganesha-vfs,
//! rpcbind, iproute2); installs nothing itself.
//!
//! ```no_run
//! let g = wasmcsi_nfs::testing::Ganesha::start().expect("ganesha");
//! let client = wasmcsi_nfs::NfsClient::new(g.config());
//! // ... client.mkdir(&g.export(), "vol", 0o755, 0, 0) ...; check g.export_dir() directly
//! ```
use crate::{NfsConfig, NfsExport};
use std::io::{self, BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The pseudo path of the one export (`mount_path_pseudo = true`: v3 mounts use it too).
pub const SHARE: &str = "/export";

/// Runs as pid 1 of the namespace. Protocol on stdin/stdout, one line each:
/// parent waits for `ns`, sets up the veth, sends `go`; the shell answers `ready`/`failed`; then
/// `pause`/`resume`/`stop`/`start` each answer `ok` or `failed`. EOF on stdin ends everything.
const SCRIPT: &str = r#"
set -u
echo ns
read -r go NS_ADDR || exit 1
ip link set lo up
ip addr add "$NS_ADDR/30" dev "$PEER_IF" && ip link set "$PEER_IF" up || { echo failed; exit 1; }
mount -t tmpfs tmpfs /run && mkdir -p /run/rpcbind
rpcbind -f -w >>"$DIR/rpcbind.log" 2>&1 &
# ganesha registers with rpcbind once, at startup: rpcbind must answer first.
for _ in $(seq 200); do rpcinfo -p 127.0.0.1 >/dev/null 2>&1 && break; sleep 0.01; done
GPID=
start() {
  ganesha.nfsd -F -f "$DIR/ganesha.conf" -L "$DIR/ganesha.log" -p /run/ganesha.pid -N NIV_EVENT \
    >>"$DIR/ganesha.out" 2>&1 &
  GPID=$!
  for _ in $(seq 200); do
    if rpcinfo -T tcp 127.0.0.1 100005 3 >/dev/null 2>&1 && rpcinfo -T tcp 127.0.0.1 100003 3 >/dev/null 2>&1; then
      echo ready; return 0
    fi
    kill -0 "$GPID" 2>/dev/null || break
    sleep 0.025
  done
  echo failed
}
start
while read -r cmd; do
  case "$cmd" in
    # kill returns once the signal is queued; a busy thread may still answer a call after
    # that. `ok` only when every thread of ganesha is stopped.
    pause) kill -STOP "$GPID"
      for _ in $(seq 500); do
        grep -L '^State:[[:space:]]*T' /proc/"$GPID"/task/*/status 2>/dev/null | grep -q . || break
        sleep 0.01
      done
      echo ok ;;
    resume) kill -CONT "$GPID" && echo ok || echo failed ;;
    stop) kill -KILL "$GPID"; wait "$GPID" 2>/dev/null; echo ok ;;
    start) start ;;
    *) echo failed ;;
  esac
done
"#;

fn config_text(export: &Path, recovery: &Path) -> String {
    format!(
        r#"NFS_CORE_PARAM {{
    Protocols = 3, 4;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    mount_path_pseudo = true;
}}
NFSv4 {{
    Graceless = true;
    RecoveryBackend = fs;
    RecoveryRoot = "{recovery}";
}}
EXPORT {{
    Export_Id = 1;
    Path = "{export}";
    Pseudo = {SHARE};
    Access_Type = RW;
    Squash = No_Root_Squash;
    Protocols = 3, 4;
    Transports = TCP;
    SecType = sys;
    # Tests change the exported directory behind ganesha's back and check it directly.
    Attr_Expiration_Time = 0;
    FSAL {{ Name = VFS; }}
}}
"#,
        recovery = recovery.display(),
        export = export.display(),
    )
}

struct Control {
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

/// One running ganesha (+ rpcbind) in its own namespaces; stopped and cleaned on drop.
pub struct Ganesha {
    dir: tempfile::TempDir,
    child: Child,
    control: Mutex<Control>,
    host_if: String,
    addr: Ipv4Addr,
}

static SEQ: AtomicU32 = AtomicU32::new(0);
const SLOTS: u32 = 16384;

fn slot_addrs(slot: u32) -> (Ipv4Addr, Ipv4Addr) {
    let base = u32::from(Ipv4Addr::new(10, 201, 0, 0)) + slot * 4;
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

fn ip(args: &[&str]) -> io::Result<std::process::Output> {
    Command::new("ip").args(args).stdin(Stdio::null()).output()
}

impl Ganesha {
    /// Start one instance; returns once MOUNT and NFSv3 answer (typically well under a second).
    pub fn start() -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("wasmcsi-ganesha-").tempdir()?;
        let export = dir.path().join("export");
        let recovery = dir.path().join("recovery");
        std::fs::create_dir(&export)?;
        std::fs::create_dir(&recovery)?;
        std::fs::write(dir.path().join("ganesha.conf"), config_text(&export, &recovery))?;

        let peer_if = "wnfs0".to_owned();
        let mut child = Command::new("unshare")
            .args(["--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", "-c", SCRIPT])
            .env("DIR", dir.path())
            .env("PEER_IF", &peer_if)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other("unshare: no stdio pipes"));
        };
        let mut control = Control { stdin: Some(stdin), stdout: BufReader::new(stdout) };
        // From here on, an early return drops `child` unkilled: kill it on every error path.
        let fail = |mut child: Child, e: io::Error| -> io::Error {
            let _ = child.kill();
            let _ = child.wait();
            e
        };
        // `ns`: unshare has created the namespaces (its own process is in the new net ns).
        match read_line(&mut control) {
            Ok(l) if l == "ns" => {}
            Ok(l) => return Err(fail(child, io::Error::other(format!("namespace shell said {l:?}")))),
            Err(e) => return Err(fail(child, e)),
        }
        let (host_if, addr) = match Self::veth(child.id(), &peer_if) {
            Ok(v) => v,
            Err(e) => return Err(fail(child, e)),
        };
        let g = Self { dir, child, control: Mutex::new(control), host_if, addr };
        // The address is only known now: it comes with `go`.
        g.command(&format!("go {addr}"), "ready")?;
        Ok(g)
    }

    /// Create the veth pair: host end `wnfs<N>` in the root namespace, the other end inside the
    /// namespace of `pid`. Returns the host interface and the namespace's address.
    fn veth(pid: u32, peer_if: &str) -> io::Result<(String, Ipv4Addr)> {
        let first = (std::process::id().wrapping_mul(131) + SEQ.fetch_add(1, Ordering::Relaxed) * 7) % SLOTS;
        let pid = pid.to_string();
        let mut last_err = String::new();
        for k in 0..256 {
            let slot = (first + k) % SLOTS;
            let host_if = format!("wnfs{slot}");
            let out = ip(&["link", "add", &host_if, "type", "veth", "peer", "name", peer_if, "netns", &pid])?;
            if !out.status.success() {
                last_err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
                if last_err.contains("File exists") {
                    continue;
                }
                return Err(io::Error::other(format!("ip link add {host_if}: {last_err}")));
            }
            let (host_addr, ns_addr) = slot_addrs(slot);
            for args in [
                &["addr", "add", &format!("{host_addr}/30"), "dev", &host_if][..],
                &["link", "set", &host_if, "up"][..],
            ] {
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

    fn with_log(&self, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("{e}; ganesha log tail:\n{}", self.log_tail(20)))
    }

    /// Send one command line and wait for its answer (`want`), bounded by the shell itself.
    fn command_raw(&self, line: &str, want: &str) -> io::Result<()> {
        let mut c = self.control.lock().unwrap_or_else(PoisonError::into_inner);
        let stdin = c.stdin.as_mut().ok_or_else(|| io::Error::other("ganesha harness already stopped"))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        let got = read_line(&mut c)?;
        if got == want { Ok(()) } else { Err(io::Error::other(format!("{line}: namespace shell said {got:?}"))) }
    }

    fn command(&self, line: &str, want: &str) -> io::Result<()> {
        self.command_raw(line, want).map_err(|e| self.with_log(e))
    }

    /// The server's address, as the client names it.
    pub fn server(&self) -> String {
        self.addr.to_string()
    }

    /// The export, as granted to and named by the client.
    pub fn export(&self) -> NfsExport {
        NfsExport::new(self.server(), SHARE)
    }

    /// A client config granting this export, with short timeouts fit for tests.
    pub fn config(&self) -> NfsConfig {
        let mut c = NfsConfig::new(vec![self.export()]);
        c.connect_timeout = Duration::from_secs(2);
        c.op_timeout = Duration::from_secs(2);
        c
    }

    /// The exported directory on the server's side: check results here, behind the protocol.
    pub fn export_dir(&self) -> PathBuf {
        self.dir.path().join("export")
    }

    /// The host end of the veth pair (for tests that cut the link).
    pub fn host_interface(&self) -> &str {
        &self.host_if
    }

    /// Freeze ganesha (SIGSTOP): connections are accepted by the kernel but never answered,
    /// the "server hangs" case.
    pub fn pause(&self) -> io::Result<()> {
        self.command("pause", "ok")
    }

    pub fn resume(&self) -> io::Result<()> {
        self.command("resume", "ok")
    }

    /// Kill ganesha (rpcbind stays, with stale registrations): connections are refused.
    pub fn stop_server(&self) -> io::Result<()> {
        self.command("stop", "ok")
    }

    /// Start ganesha again on the same export; returns once it answers.
    pub fn start_server(&self) -> io::Result<()> {
        self.command("start", "ready")
    }

    /// The last `lines` lines of ganesha's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("ganesha.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

fn read_line(c: &mut Control) -> io::Result<String> {
    let mut line = String::new();
    if c.stdout.read_line(&mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "namespace shell exited"));
    }
    Ok(line.trim().to_owned())
}

impl Drop for Ganesha {
    fn drop(&mut self) {
        // Closing stdin ends the shell, pid 1 of the namespace: the kernel kills the rest.
        if let Ok(mut c) = self.control.lock() {
            c.stdin = None;
        }
        let deadline = Instant::now() + Duration::from_secs(3);
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
