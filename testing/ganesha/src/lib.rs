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
//! let g = wasmcsi_ganesha::Ganesha::start().expect("ganesha");
//! let client = wasmcsi_nfs::NfsClient::new(g.config());
//! // ... client.mkdir(&g.export(), "vol", 0o755, 0, 0) ...; check g.export_dir() directly
//! ```
use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use wasmcsi_netns::{NsOptions, NsShell};
use wasmcsi_nfs::{NfsConfig, NfsExport};

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

/// One running ganesha (+ rpcbind) in its own namespaces; stopped and cleaned on drop.
pub struct Ganesha {
    // Declared first: dropped (the namespace ended) before the directory it uses goes.
    ns: NsShell,
    dir: tempfile::TempDir,
    addr: Ipv4Addr,
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

        let ns = NsShell::spawn(&NsOptions {
            script: SCRIPT.into(),
            env: vec![("DIR".into(), dir.path().into())],
            env_remove: vec![],
            subnet: [10, 201],
            if_prefix: "wnfs".into(),
            stop_patience: Duration::from_secs(3),
        })?;
        let g = Self { addr: ns.addr(), ns, dir };
        // The address is only known now: it comes with `go`.
        g.command(&format!("go {}", g.addr), "ready")?;
        Ok(g)
    }

    fn with_log(&self, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("{e}; ganesha log tail:\n{}", self.log_tail(20)))
    }

    fn command(&self, line: &str, want: &str) -> io::Result<()> {
        self.ns.command(line, want).map_err(|e| self.with_log(e))
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
        self.ns.host_interface()
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
