//! A real Ceph cluster for tests and benches: one monitor, one manager and two OSDs (memstore by
//! default, bluestore on a sparse file for benchmarks), bootstrapped the way `vstart.sh` does it
//! (ceph-authtool, monmaptool, `ceph-mon --mkfs`, `ceph osd new`, `ceph-osd --mkfs`), no systemd,
//! no /etc/ceph: everything lives in a temporary directory.
//!
//! Isolation, as for the ganesha harness (`wasmcsi-ganesha`): the daemons run in a private
//! network + mount + pid namespace whose pid 1 is a small shell reading commands on its stdin.
//! The test process stays in the root namespace and reaches the monitor *and the OSDs* (RADOS
//! clients talk to OSDs directly) through a veth pair on a private /30 from 10.202.0.0/16
//! (ganesha uses 10.201/16, the block tests 10.200/16). When the harness is dropped, or the test
//! process exits or dies (a cluster in a `static` is never dropped), the shell's stdin closes,
//! it exits, and the kernel kills every daemon of the namespace with it.
//!
//! The manager runs with an empty module directory: no Python module is loaded (start-up stays
//! fast), but it still aggregates PG and pool statistics, which `ceph df`, `ceph pg ...` and
//! the client's pool stats need. The health check complaining about the missing modules is muted.
//!
//! [`Ceph::rgw`] adds the RADOS Gateway (the S3 server of the backup tests) to a running
//! cluster, in the same namespace, on first use.
//!
//! Needs root and the packages `scripts/ceph-setup` installs. [`Ceph::shared`] and
//! [`Ceph::start_or_skip`] run that script when a tool is missing, and skip (saying why on
//! stderr) only if it cannot install them; `WASMCSI_CEPH_TESTS=require` (CI) turns that skip into
//! a failure.
//!
//! ```no_run
//! let Some(ceph) = wasmcsi_ceph::Ceph::shared() else { return };
//! ceph.create_pool("p1").expect("pool");
//! let client = wasmcsi_rbd::RbdClient::new(ceph.config(&["p1"]));
//! let pool = client.pool(wasmcsi_ceph::CLUSTER, "p1", &ceph.admin()).expect("granted");
//! ```
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use wasmcsi_netns::{NsOptions, NsShell};
use wasmcsi_rbd::{RbdCluster, RbdConfig, RbdCredentials};

/// The cluster name [`Ceph::config`] grants (a name of the operator's choosing, not Ceph's).
pub const CLUSTER: &str = "test";
/// `WASMCSI_CEPH_TESTS=require`: a missing Ceph fails the test instead of skipping it.
pub const MODE_ENV: &str = "WASMCSI_CEPH_TESTS";
/// Tools the harness runs.
const TOOLS: &[&str] = &[
    "ceph-mon",
    "ceph-osd",
    "ceph-mgr",
    "ceph",
    "ceph-authtool",
    "monmaptool",
    "rbd",
    "rbd-fuse",
    "radosgw",
    "radosgw-admin",
];
/// The port of the RADOS Gateway ([`Ceph::rgw`]) on the cluster's address.
pub const RGW_PORT: u16 = 7480;

/// Where the OSDs keep data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// In RAM (~1 GiB per OSD at most; keep test images small). Fastest start.
    Memstore,
    /// BlueStore on a sparse file of this many bytes per OSD: real on-disk behaviour.
    Bluestore { file_bytes: u64 },
}

/// Runs as pid 1 of the namespace. Protocol on stdin/stdout, one line each: the parent waits
/// for `ns`, sets up the veth and writes ceph.conf, sends `go ADDR`; the shell answers `ready`
/// or `failed <step>`; then `pause`/`resume`/`stop` each answer `ok` or `failed`. EOF on stdin
/// ends everything.
const SCRIPT: &str = r#"
set -u
echo ns
read -r go NS_ADDR || exit 1
ip link set lo up
ip addr add "$NS_ADDR/30" dev "$PEER_IF" && ip link set "$PEER_IF" up || { echo "failed veth"; exit 1; }
mount -t tmpfs tmpfs /run
C=(-c "$DIR/ceph.conf")
fail() { echo "failed $*"; exit 1; }
auth() { ceph-authtool "$@" >/dev/null 2>>"$DIR/boot.err" || fail ceph-authtool; }
auth --create-keyring "$DIR/mon.keyring" --gen-key -n mon. --cap mon 'allow *'
auth --create-keyring "$DIR/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *'
auth "$DIR/mon.keyring" --import-keyring "$DIR/keyring"
# Daemon keys go into the monitor's initial auth database: no `ceph auth add` round trips.
mkdir -p "$DIR/mgr.x" "$DIR/mgr-modules"
auth --create-keyring "$DIR/mgr.x/keyring" --gen-key -n mgr.x --cap mon 'allow profile mgr' --cap osd 'allow *'
auth "$DIR/mon.keyring" --import-keyring "$DIR/mgr.x/keyring"
for i in 0 1; do
  mkdir -p "$DIR/osd$i"
  auth --create-keyring "$DIR/osd$i/keyring" --gen-key -n osd.$i --cap mon 'allow profile osd' --cap osd 'allow *' --cap mgr 'allow profile osd'
  auth "$DIR/mon.keyring" --import-keyring "$DIR/osd$i/keyring"
done
monmaptool --create --fsid "$FSID" --addv a "[v2:$NS_ADDR:3300,v1:$NS_ADDR:6789]" "$DIR/monmap" >/dev/null 2>>"$DIR/boot.err" || fail monmaptool
timeout 60 ceph-mon "${C[@]}" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/mon.keyring" 2>>"$DIR/boot.err" || fail ceph-mon --mkfs
ceph-mon "${C[@]}" -i a -f 2>>"$DIR/mon.err" &
MON=$!
ceph-mgr "${C[@]}" -i x -f 2>>"$DIR/mgr.err" &
# mkfs is local (--no-mon-config): both OSDs in parallel, while the monitor starts. Waited for
# by pid: `wait -n` also counts the monitor and manager jobs, and an mkfs that ended before it
# was called could leave it waiting for the daemons forever. Every step is bounded, so a stuck
# bootstrap fails the test instead of hanging it.
MKFS=()
for i in 0 1; do
  timeout 120 ceph-osd "${C[@]}" -i $i --mkfs --no-mon-config --osd-uuid "$(cat /proc/sys/kernel/random/uuid)" 2>>"$DIR/osd$i.err" &
  MKFS+=($!)
done
for p in "${MKFS[@]}"; do wait "$p" || fail ceph-osd --mkfs; done
# `osd new` hands out ids in order: 0, then 1.
for i in 0 1; do
  timeout 60 ceph "${C[@]}" --connect-timeout 20 osd new "$(cat "$DIR/osd$i/fsid")" >/dev/null 2>>"$DIR/boot.err" || fail ceph osd new
done
for i in 0 1; do ceph-osd "${C[@]}" -i $i -f 2>>"$DIR/osd$i.err" & done
echo ready
while read -r cmd; do
  case "$cmd" in
    # kill returns once the signal is queued; `ok` only when every thread is stopped.
    pause) kill -STOP "$MON"
      for _ in $(seq 500); do
        grep -L '^State:[[:space:]]*T' /proc/"$MON"/task/*/status 2>/dev/null | grep -q . || break
        sleep 0.01
      done
      echo ok ;;
    resume) kill -CONT "$MON" && echo ok || echo failed ;;
    # The RADOS Gateway (S3) on $NS_ADDR:7480, with a key of its own.
    rgw) mkdir -p "$DIR/rgw"
      if timeout 60 ceph "${C[@]}" --connect-timeout 20 auth get-or-create client.rgw.x mon 'allow rw' osd 'allow rwx' \
           -o "$DIR/rgw.keyring" >/dev/null 2>>"$DIR/boot.err"; then
        radosgw "${C[@]}" -n client.rgw.x -f 2>>"$DIR/rgw.err" &
        echo ok
      else
        echo failed
      fi ;;
    stop) pkill -KILL -P $$ ; wait; echo ok ;;
    *) echo failed ;;
  esac
done
# stdin closed: the harness was dropped or the test process ended. A cluster kept in a `static`
# is never dropped, so its directory is removed here, once no daemon writes to it any more.
pkill -KILL -P $$
wait
[ -n "${KEEP_DIR:-}" ] || rm -rf "$DIR"
"#;

fn config_text(dir: &Path, addr: Ipv4Addr, fsid: &str, store: Store) -> String {
    let d = dir.display();
    let store = match store {
        Store::Memstore => "osd objectstore = memstore\nmemstore device bytes = 1073741824\n".to_owned(),
        // `bluestore block path` stays unset: the default ($osd_data/block) is what
        // `bluestore block create` creates as a sparse file.
        Store::Bluestore { file_bytes } => format!(
            "osd objectstore = bluestore\nbluestore block create = true\nbluestore block size = {file_bytes}\n\
             bluestore fsck on mount = false\n"
        ),
    };
    format!(
        r#"[global]
fsid = {fsid}
mon host = [v2:{addr}:3300,v1:{addr}:6789]
public network = {addr}/30
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
ms bind ipv6 = false
run dir = {d}/run
admin socket = {d}/run/$name.asok
log file = {d}/$name.log
mon allow pool delete = true
mon allow pool size one = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
# The tmp file system may be nearly full on a CI machine: never let that stop the cluster.
mon data avail warn = 1
mon data avail crit = 0
mon osd full ratio = .97
mon osd backfillfull ratio = .96
mon osd nearfull ratio = .95
osd pool default size = 2
osd pool default min size = 1
osd pool default pg autoscale mode = off
# Pools made without a PG count (the RADOS Gateway's seven) get 8, not 32: 32 × 7 × 2 copies on
# two OSDs would pass their PG limit.
osd pool default pg num = 8
osd pool default pgp num = 8
# Both OSDs are on one host: replicate across OSDs, not hosts.
osd crush chooseleaf type = 0
# PG states and pool stats reach the monitors through the manager: report every second, not 5.
mgr stats period = 1
mon mgr digest period = 1
osd mon report interval = 1
[client]
keyring = {d}/keyring
[mon]
mon data = {d}/mon.$id
mon cluster log file = {d}/cluster.log
# Every map change (pool create, snapshot id allocation) waits for the next Paxos proposal:
# 1 s by default, which made each snapshot-create take a second.
paxos propose interval = 0.05
[mgr]
mgr data = {d}/mgr.$id
keyring = {d}/mgr.$id/keyring
mgr module path = {d}/mgr-modules
[client.rgw.x]
keyring = {d}/rgw.keyring
rgw data = {d}/rgw
rgw frontends = beast endpoint={addr}:{RGW_PORT}
log file = {d}/rgw.log
admin socket = {d}/run/rgw.asok
rgw init timeout = 60
# Quotas checked against fresh bucket statistics, not ones cached for 10 minutes (the backup
# tests fill a bucket's quota and expect the next put refused).
rgw bucket quota ttl = 0
[osd]
osd data = {d}/osd$id
keyring = {d}/osd$id/keyring
{store}"#
    )
}

/// One running cluster in its own namespaces; stopped and cleaned on drop.
pub struct Ceph {
    // Declared first: dropped (the namespace ended) before the directory it uses goes.
    ns: NsShell,
    dir: tempfile::TempDir,
    addr: Ipv4Addr,
    fsid: String,
    admin_key: String,
    started_in: Duration,
    rgw: std::sync::Mutex<Option<Rgw>>,
}

/// The S3 endpoint of a cluster's RADOS Gateway and the keys of a user of it.
#[derive(Clone)]
pub struct Rgw {
    /// `http://ADDR:7480`, reachable from the test process.
    pub endpoint: String,
    pub access_key: String,
    pub secret_key: String,
    pub started_in: Duration,
}

impl std::fmt::Debug for Rgw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rgw")
            .field("endpoint", &self.endpoint)
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Ceph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ceph")
            .field("dir", &self.dir.path())
            .field("addr", &self.addr)
            .field("fsid", &self.fsid)
            .finish()
    }
}

/// Why Ceph tests cannot run here, if they cannot: not root, or tools missing even after
/// `scripts/ceph-setup`. Checked once per process.
pub fn unavailable() -> Option<String> {
    static WHY: OnceLock<Option<String>> = OnceLock::new();
    WHY.get_or_init(|| {
        if !nix::unistd::geteuid().is_root() {
            return Some("the Ceph harness needs root (namespaces, veth pairs)".into());
        }
        let missing = || TOOLS.iter().copied().filter(|t| !on_path(t)).collect::<Vec<_>>();
        if missing().is_empty() {
            return None;
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-setup");
        let out = Command::new("bash").arg(&script).stdin(Stdio::null()).output();
        let still = missing();
        if still.is_empty() {
            return None;
        }
        let how = match out {
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        };
        Some(format!("{} missing and {} could not install them: {how}", still.join(", "), script.display()))
    })
    .clone()
}

/// True when an HTTP server answers a `GET /` at `addr` (any status).
fn http_answers(addr: std::net::SocketAddr) -> bool {
    use std::io::Read as _;
    let Ok(mut c) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { return false };
    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
    if c.write_all(b"GET / HTTP/1.0\r\n\r\n").is_err() {
        return false;
    }
    let mut head = [0u8; 5];
    c.read_exact(&mut head).is_ok() && &head == b"HTTP/"
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p)
            .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
            .any(|d| d.join(tool).is_file())
    })
}

/// True when `WASMCSI_CEPH_TESTS=require`.
pub fn required() -> bool {
    std::env::var_os(MODE_ENV).is_some_and(|v| v == "require")
}

/// `None` (after saying why on stderr) when Ceph cannot run here and that is allowed; panics
/// under `WASMCSI_CEPH_TESTS=require`.
fn may_run(test: &str) -> bool {
    match unavailable() {
        None => true,
        Some(why) if required() => panic!("{MODE_ENV}=require but Ceph cannot run here: {why}"),
        Some(why) => {
            let _ = writeln!(io::stderr(), "skipped {test}: {why}");
            false
        }
    }
}

impl Ceph {
    /// A cluster shared by every test of this process (memstore), started on first use; `None`
    /// if Ceph cannot run here (see the module docs). Tests sharing it must use their own pools
    /// and images, and must not stop or pause it.
    pub fn shared() -> Option<&'static Ceph> {
        static SHARED: OnceLock<Ceph> = OnceLock::new();
        if !may_run("(shared ceph cluster)") {
            return None;
        }
        Some(SHARED.get_or_init(|| Ceph::start().expect("start the shared ceph cluster")))
    }

    /// A cluster of one's own (to stop or pause it), or `None` as for [`Ceph::shared`].
    pub fn start_or_skip(test: &str) -> Option<Ceph> {
        may_run(test).then(|| Ceph::start().expect("start a ceph cluster"))
    }

    /// Start a memstore cluster; returns once the monitor answers, both OSDs are up and the
    /// manager reports.
    pub fn start() -> io::Result<Self> {
        Self::start_with(Store::Memstore)
    }

    pub fn start_with(store: Store) -> io::Result<Self> {
        let t0 = Instant::now();
        let dir = tempfile::Builder::new().prefix("wasmcsi-ceph-").tempdir()?;
        let fsid = std::fs::read_to_string("/proc/sys/kernel/random/uuid")?.trim().to_owned();
        let ns = NsShell::spawn(&NsOptions {
            script: SCRIPT.into(),
            env: vec![
                ("DIR".into(), dir.path().into()),
                ("FSID".into(), fsid.clone().into()),
                // WASMCSI_CEPH_KEEP=1 keeps the cluster's directory (logs) after the test.
                ("KEEP_DIR".into(), std::env::var_os("WASMCSI_CEPH_KEEP").unwrap_or_default()),
            ],
            // The shell's `ceph` must not pick up a developer's CEPH_ARGS / CEPH_CONF.
            env_remove: vec!["CEPH_ARGS".into(), "CEPH_CONF".into()],
            subnet: [10, 202],
            if_prefix: "wceph".into(),
            stop_patience: Duration::from_secs(5),
        })?;
        let addr = ns.addr();
        let mut ceph =
            Self { ns, dir, addr, fsid, admin_key: String::new(), started_in: Duration::ZERO, rgw: Default::default() };
        std::fs::write(ceph.conf_path(), config_text(ceph.dir.path(), addr, &ceph.fsid, store))?;
        ceph.command(&format!("go {addr}"), "ready")?;
        ceph.admin_key = ceph.ceph(&["auth", "print-key", "client.admin"])?.trim().to_owned();
        // Clones without protect (clone v2) need every client to be at least mimic.
        ceph.ceph(&["osd", "set-require-min-compat-client", "mimic"])?;
        ceph.ceph(&["health", "mute", "MGR_MODULE_ERROR", "--sticky"])?;
        ceph.wait_for("both OSDs up and the manager active", Duration::from_secs(60), |c| {
            let osd: serde_json::Value = serde_json::from_str(&c.ceph(&["osd", "stat", "-f", "json"])?)?;
            let mgr: serde_json::Value = serde_json::from_str(&c.ceph(&["mgr", "stat", "-f", "json"])?)?;
            Ok(osd["num_up_osds"] == 2 && mgr["available"] == true)
        })?;
        ceph.started_in = t0.elapsed();
        Ok(ceph)
    }

    fn wait_for(&self, what: &str, limit: Duration, mut done: impl FnMut(&Self) -> io::Result<bool>) -> io::Result<()> {
        let deadline = Instant::now() + limit;
        let mut last = None;
        loop {
            match done(self) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => last = Some(e),
            }
            if Instant::now() > deadline {
                let e = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("ceph: not {what} within {limit:?} (last error: {last:?})\n{}", self.log_tail(20)),
                );
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Run the `ceph` CLI as client.admin (bounded: `--connect-timeout`, and a monitor that
    /// accepted the connection answers or the CLI's own timeout fires); returns stdout.
    pub fn ceph(&self, args: &[&str]) -> io::Result<String> {
        self.tool("ceph", args)
    }

    /// The cluster's RADOS Gateway (S3), started on first use (its pools, zone and a user
    /// `wasmcsi` with fresh keys: ~10 s), then the same for every caller. Buckets are made
    /// through S3 by the caller.
    pub fn rgw(&self) -> io::Result<Rgw> {
        let mut held = self.rgw.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(rgw) = &*held {
            return Ok(rgw.clone());
        }
        let t0 = Instant::now();
        self.command("rgw", "ok")?;
        let addr = std::net::SocketAddr::from((self.addr, RGW_PORT));
        self.wait_for("the RADOS Gateway answering", Duration::from_secs(90), |_| Ok(http_answers(addr)))?;
        let key = |n: usize| {
            let raw = std::fs::read("/proc/sys/kernel/random/uuid").unwrap_or_default();
            String::from_utf8_lossy(&raw).chars().filter(char::is_ascii_alphanumeric).take(n).collect::<String>()
        };
        let (access_key, secret_key) =
            (format!("WASMCSI{}", key(13).to_uppercase()), format!("{}{}", key(20), key(20)));
        self.tool(
            "radosgw-admin",
            &[
                "user",
                "create",
                "--uid=wasmcsi",
                "--display-name=wasmcsi",
                &format!("--access-key={access_key}"),
                &format!("--secret-key={secret_key}"),
            ],
        )?;
        let rgw = Rgw { endpoint: format!("http://{addr}"), access_key, secret_key, started_in: t0.elapsed() };
        *held = Some(rgw.clone());
        Ok(rgw)
    }

    /// Run `radosgw-admin` as client.admin (users, quotas, bucket statistics); returns stdout.
    pub fn radosgw_admin(&self, args: &[&str]) -> io::Result<String> {
        self.tool("radosgw-admin", args)
    }

    /// Run the `rbd` CLI as client.admin; returns stdout.
    pub fn rbd(&self, args: &[&str]) -> io::Result<String> {
        self.tool("rbd", args)
    }

    fn tool(&self, tool: &str, args: &[&str]) -> io::Result<String> {
        let conf = self.conf_path();
        let mut cmd = Command::new("timeout");
        cmd.args(["-k", "2", "60", tool, "-c"]).arg(&conf);
        if tool == "ceph" {
            cmd.args(["--connect-timeout", "20"]);
        }
        let out = cmd.args(args).env_remove("CEPH_ARGS").stdin(Stdio::null()).output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "{tool} {}: {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Create a replicated pool (size 2, min_size 1, 8 PGs) for RBD and wait until all its PGs
    /// are active+clean.
    pub fn create_pool(&self, name: &str) -> io::Result<()> {
        self.ceph(&["osd", "pool", "create", name, "8", "8", "replicated"])?;
        self.ceph(&["osd", "pool", "set", name, "size", "2"])?;
        self.ceph(&["osd", "pool", "set", name, "min_size", "1"])?;
        self.ceph(&["osd", "pool", "application", "enable", name, "rbd"])?;
        self.wait_for(&format!("pool {name} active+clean"), Duration::from_secs(60), |c| {
            let pgs: serde_json::Value = serde_json::from_str(&c.ceph(&["pg", "ls-by-pool", name, "-f", "json"])?)?;
            let states: Vec<&str> = pgs["pg_stats"]
                .as_array()
                .map(|a| a.iter().filter_map(|p| p["state"].as_str()).collect())
                .unwrap_or_default();
            if states.len() != 8 || states.iter().any(|s| *s != "active+clean") {
                return Ok(false);
            }
            // Pool statistics (`ceph df`) come from the manager, a report later.
            let df: serde_json::Value = serde_json::from_str(&c.ceph(&["df", "-f", "json"])?)?;
            Ok(df["pools"].as_array().is_some_and(|p| p.iter().any(|p| p["name"] == name)))
        })
    }

    /// A cephx user limited to RBD on `pool`, as ceph-csi's docs create one; returns its key.
    pub fn create_user(&self, user: &str, pool: &str) -> io::Result<String> {
        let caps = format!("profile rbd pool={pool}");
        let key =
            self.ceph(&["auth", "get-or-create-key", &format!("client.{user}"), "mon", "profile rbd", "osd", &caps])?;
        Ok(key.trim().to_owned())
    }

    /// The monitor's address as clients in the root namespace name it (v2 on 3300, v1 on 6789).
    pub fn mon_addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// Monitors for [`RbdCluster::monitors`].
    pub fn monitors(&self) -> Vec<String> {
        vec![format!("[v2:{a}:3300,v1:{a}:6789]", a = self.addr)]
    }

    pub fn fsid(&self) -> &str {
        &self.fsid
    }

    pub fn admin_key(&self) -> &str {
        &self.admin_key
    }

    pub fn admin(&self) -> RbdCredentials {
        RbdCredentials::new("admin", self.admin_key.clone())
    }

    /// A client config granting `pools` of this cluster (as [`CLUSTER`]), with short timeouts
    /// fit for tests.
    pub fn config(&self, pools: &[&str]) -> RbdConfig {
        let cluster = RbdCluster {
            name: CLUSTER.into(),
            monitors: self.monitors(),
            pools: pools.iter().map(|p| (*p).to_owned()).collect(),
        };
        let mut c = RbdConfig::new(vec![cluster]);
        c.connect_timeout = Duration::from_secs(3);
        c.op_timeout = Duration::from_secs(3);
        c
    }

    /// ceph.conf for clients in the root namespace (`-c`); it names the admin keyring.
    pub fn conf_path(&self) -> PathBuf {
        self.dir.path().join("ceph.conf")
    }

    pub fn keyring_path(&self) -> PathBuf {
        self.dir.path().join("keyring")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// How long [`Ceph::start`] took.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// The host end of the veth pair (for tests that cut the link).
    pub fn host_interface(&self) -> &str {
        self.ns.host_interface()
    }

    /// Freeze the monitor (SIGSTOP): connections are accepted by the kernel, never answered.
    pub fn pause_mon(&self) -> io::Result<()> {
        self.command("pause", "ok")
    }

    pub fn resume_mon(&self) -> io::Result<()> {
        self.command("resume", "ok")
    }

    /// Kill every daemon (the namespace and its address stay): connections are refused.
    pub fn stop(&self) -> io::Result<()> {
        self.command("stop", "ok")
    }

    fn command(&self, line: &str, want: &str) -> io::Result<()> {
        self.ns.command(line, want).map_err(|e| io::Error::new(e.kind(), format!("{e}\n{}", self.log_tail(20))))
    }

    /// The tails of the bootstrap errors and the daemons' stderr, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let mut out = String::new();
        for f in ["boot.err", "mon.err", "mgr.err", "osd0.err", "osd1.err", "rgw.err"] {
            let text = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
            let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            if !all.is_empty() {
                out += &format!("--- {f}\n{}\n", all[all.len().saturating_sub(lines)..].join("\n"));
            }
        }
        out
    }
}
