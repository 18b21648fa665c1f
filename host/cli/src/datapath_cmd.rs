//! `wasmcsi datapath`: its arguments, and how a node plugin starts one. The process itself
//! (this node's replica server, every attached volume's engine with its FUSE session and loop
//! device, the rbd-fuse daemons of RBD volumes staged here, served to the node plugin on a unix
//! socket, and its live upgrade) is `wasmcsi_datapath::process`'s; this command adds the
//! metrics endpoint. The plugin (`serve --datapath-socket`) starts this process itself when
//! asked (`--datapath-start`, [`spawn_detached`]), or Kubernetes runs it as its own DaemonSet.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use wasmcsi_block::replica::disks::is_disk_name;
use wasmcsi_block::replica::{DEFAULT_DISK, NodeIdentity};
use wasmcsi_datapath::DataPathConfig;
use wasmcsi_datapath::client::DataPathClient;
use wasmcsi_datapath::process::{DataPathProcess, ProcessConfig};

/// How long a plugin waits for the data path it started to answer.
const START_WAIT: Duration = Duration::from_secs(30);

#[derive(Args, Debug, Clone)]
pub struct DataPathArgs {
    /// The unix socket the node plugin reaches this data path on.
    #[arg(long, default_value = "/var/lib/wasmcsi/datapath/datapath.sock")]
    pub socket: PathBuf,
    /// Where engine state (`engines/`), the frontends' FUSE mounts (`run/`) and this process's
    /// pid file live: the node plugin's `--state-dir`, so either process finds what the other
    /// left.
    #[arg(long, default_value = "/var/lib/wasmcsi/state")]
    pub state_dir: PathBuf,
    /// Refuse to start unless --state-dir is a shared mount (in a pod: mountPropagation:
    /// Bidirectional over a host directory on a shared mount). The FUSE and rbd-fuse mounts
    /// this process makes beneath it must reach the host, where the node plugin puts loop
    /// devices and filesystems on them; on a private mount they would stay in this container.
    /// Unset: not checked (a data path in the node plugin's own mount namespace).
    #[arg(long)]
    pub shared_state_dir: bool,
    /// This node's id: usually the Kubernetes node name.
    #[arg(long, env = "NODE_NAME")]
    pub node_id: String,
    /// Serve this node's replicas on ADDR; other nodes' engines connect here.
    #[arg(long)]
    pub replica_listen: SocketAddr,
    /// Where this node's replicas live (one directory each): PATH for the disk `default`
    /// (/var/lib/wasmcsi/replicas when not given), NAME=PATH for another disk (repeatable; NAME
    /// a DNS label). Backends place replicas on distinct nodes first, then on distinct disks.
    #[arg(long = "replica-root", value_name = "[NAME=]PATH", value_parser = parse_replica_root)]
    pub replica_roots: Vec<ReplicaRoot>,
    /// A label this node reports to backends (KEY=VALUE, repeatable).
    #[arg(long = "node-label", value_parser = parse_label)]
    pub node_labels: Vec<(String, String)>,
    /// Serve Prometheus metrics of the volumes this process serves at http://ADDR/metrics.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Take over the volumes the previous image of this data path handed over in a live upgrade
    /// (`wasmcsi upgrade datapath`), described in FILE, with the fds it kept open. Set by the
    /// upgrade itself, not by hand.
    #[arg(long, value_name = "FILE")]
    pub adopt: Option<PathBuf>,
    /// This node's credentials directory (`ca.crt`, `tls.crt`, `tls.key`, the node's
    /// certificate), re-read when it changes: the replica server and the engines' connections
    /// use it.
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// How the replica port travels: `required` (the default with --tls-dir), `permissive`
    /// (also serves, and falls back to, plaintext peers of the version before TLS), `off`
    /// (plaintext: without --tls-dir it must be given explicitly).
    #[arg(long, value_name = "off|permissive|required")]
    pub tls_mode: Option<wasmcsi_trust::TlsMode>,
    /// The controller's authority endpoint (https://HOST:PORT), where the grants of the
    /// volumes attached here are renewed (with --tls-dir). The node plugin hands each volume's
    /// grant over at its attach; without this the grants are not renewed.
    #[arg(long, requires = "tls_dir")]
    pub authority: Option<String>,
    #[command(flatten)]
    pub limits: ListenerArgs,
    #[command(flatten)]
    pub socket_limits: SocketArgs,
}

/// The bounds of the data-path socket's connections.
#[derive(Args, Debug, Clone)]
pub struct SocketArgs {
    /// Connections the data-path socket serves at once, from every process together.
    #[arg(long, default_value_t = wasmcsi_datapath::socket::slots::DEFAULT_MAX_CONNECTIONS)]
    pub socket_max_connections: usize,
    /// Connections the data-path socket serves at once from one process (by its pid): the
    /// rest stay free for the others. More are answered `busy`.
    #[arg(long, default_value_t = wasmcsi_datapath::socket::slots::DEFAULT_MAX_PER_CLIENT)]
    pub socket_max_per_client: usize,
    /// Seconds a data-path socket connection may wait before it sends a whole request.
    #[arg(long, value_name = "SECONDS", default_value_t = wasmcsi_datapath::socket::slots::DEFAULT_IDLE_TIMEOUT.as_secs())]
    pub socket_idle_timeout: u64,
}

impl Default for SocketArgs {
    fn default() -> Self {
        let limits = wasmcsi_datapath::socket::SocketLimits::default();
        Self {
            socket_max_connections: limits.max_connections,
            socket_max_per_client: limits.max_per_client,
            socket_idle_timeout: limits.idle_timeout.as_secs(),
        }
    }
}

impl SocketArgs {
    fn limits(&self) -> wasmcsi_datapath::socket::SocketLimits {
        wasmcsi_datapath::socket::SocketLimits {
            max_connections: self.socket_max_connections,
            max_per_client: self.socket_max_per_client,
            idle_timeout: Duration::from_secs(self.socket_idle_timeout),
        }
    }
}

/// The replica listener's bounds (the trust crate's defaults).
#[derive(Args, Debug, Clone)]
pub struct ListenerArgs {
    /// Connections the replica server holds at once.
    #[arg(long, default_value_t = wasmcsi_trust::listener::DEFAULT_MAX_CONNECTIONS)]
    pub replica_max_connections: usize,
    /// Connections the replica server holds at once from one source address (an IPv6 /64).
    #[arg(long, default_value_t = wasmcsi_trust::listener::DEFAULT_MAX_PER_SOURCE)]
    pub replica_max_per_source: usize,
}

impl Default for ListenerArgs {
    fn default() -> Self {
        Self {
            replica_max_connections: wasmcsi_trust::listener::DEFAULT_MAX_CONNECTIONS,
            replica_max_per_source: wasmcsi_trust::listener::DEFAULT_MAX_PER_SOURCE,
        }
    }
}

impl ListenerArgs {
    fn limits(&self) -> wasmcsi_trust::Limits {
        wasmcsi_trust::Limits {
            max_connections: self.replica_max_connections,
            max_per_source: self.replica_max_per_source,
            ..wasmcsi_trust::Limits::default()
        }
    }
}

/// A `KEY=VALUE` argument (node labels, `--peer NODE=ADDR`): the key must not be empty.
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// The disk `default`'s root when no `--replica-root` names it.
const DEFAULT_REPLICA_ROOT: &str = "/var/lib/wasmcsi/replicas";

/// One `--replica-root`: a disk's name and the directory its replicas live in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRoot {
    pub disk: String,
    pub path: PathBuf,
}

impl ReplicaRoot {
    /// The disk `default` at `path`.
    pub fn default_at(path: PathBuf) -> Self {
        Self { disk: DEFAULT_DISK.to_owned(), path }
    }

    fn arg(&self) -> std::ffi::OsString {
        let mut arg = std::ffi::OsString::from(format!("{}=", self.disk));
        arg.push(&self.path);
        arg
    }
}

/// `NAME=PATH` when the text before the first `=` is a disk name (`default` included), else
/// all of it is the path of the disk `default`.
pub fn parse_replica_root(s: &str) -> Result<ReplicaRoot, String> {
    let root = match s.split_once('=') {
        Some((name, path)) if is_disk_name(name) => ReplicaRoot { disk: name.to_owned(), path: path.into() },
        _ => ReplicaRoot::default_at(s.into()),
    };
    if root.path.as_os_str().is_empty() {
        return Err(format!("{s:?} names no directory"));
    }
    Ok(root)
}

impl DataPathArgs {
    /// The disk `default`'s root, and every other disk's, by name: each disk once.
    pub fn replica_disks(&self) -> anyhow::Result<(PathBuf, Vec<(String, PathBuf)>)> {
        let mut default = None;
        let mut more: Vec<(String, PathBuf)> = Vec::new();
        for r in &self.replica_roots {
            if r.disk == DEFAULT_DISK {
                anyhow::ensure!(default.is_none(), "--replica-root names the disk default twice");
                default = Some(r.path.clone());
            } else {
                anyhow::ensure!(!more.iter().any(|(d, _)| *d == r.disk), "--replica-root names disk {} twice", r.disk);
                more.push((r.disk.clone(), r.path.clone()));
            }
        }
        Ok((default.unwrap_or_else(|| DEFAULT_REPLICA_ROOT.into()), more))
    }
}

/// Runs the data path until SIGINT or SIGTERM.
pub async fn run(args: DataPathArgs) -> anyhow::Result<()> {
    // Not again in a live upgrade (`--adopt`): the same container, checked at its first start,
    // and the inherited fds are taken before this process opens any file.
    if args.shared_state_dir && args.adopt.is_none() {
        std::fs::create_dir_all(&args.state_dir).with_context(|| format!("creating {}", args.state_dir.display()))?;
        crate::check_shared_mount(
            "--state-dir",
            &args.state_dir,
            "the data path's state directory",
            "the FUSE and rbd-fuse mounts made beneath it must reach the host and the node plugin",
        )?;
    }
    crate::trust::check_replica_mode(args.tls_dir.as_deref(), args.tls_mode)?;
    let (replica_root, replica_disks) = args.replica_disks()?;
    let (credentials, _watcher) = match &args.tls_dir {
        Some(dir) => {
            let (live, watcher) = wasmcsi_trust::watch(dir, wasmcsi_trust::reload::DEFAULT_POLL_INTERVAL)
                .with_context(|| format!("this node's credentials in {}", dir.display()))?;
            tracing::info!(dir = %dir.display(), role = %live.current().role(), expires_in = live.seconds_to_expiry(), "loaded TLS credentials");
            (Some(live), Some(watcher))
        }
        None => (None, None),
    };
    let transport = crate::trust::replica_transport(args.tls_mode, credentials.as_ref())?;
    let grants: Option<Arc<dyn wasmcsi_trust::GrantSource>> = match (&args.authority, &credentials) {
        (Some(url), Some(live)) => Some(Arc::new(wasmcsi_csi::authority_endpoint::AuthorityClient::new(
            url,
            wasmcsi_csi::authority_endpoint::client::ClientIdentity::Credentials(live.clone()),
        )?)),
        _ => None,
    };
    let config = ProcessConfig {
        socket: args.socket.clone(),
        state_dir: args.state_dir.clone(),
        datapath: DataPathConfig {
            identity: NodeIdentity { node: args.node_id.clone(), labels: args.node_labels.clone() },
            replica_root,
            replica_disks,
            listen: args.replica_listen,
            engine_root: args.state_dir.join("engines"),
            runtime_root: args.state_dir.join("run"),
            request_timeout: Duration::from_secs(10),
            attach_timeout: Duration::from_secs(30),
            transport,
            limits: args.limits.limits(),
        },
        socket_limits: args.socket_limits.limits(),
        adopt: args.adopt.clone(),
        grants,
    };
    let process = DataPathProcess::start(config).await?;
    let datapath = process.datapath();
    let metrics = match args.metrics_addr {
        Some(addr) => Some(
            crate::metrics_http::serve(
                addr,
                Arc::new(wasmcsi_runtime::metrics::Metrics::new()),
                Some(datapath.clone()),
                crate::metrics_http::TrustSeries {
                    credentials: credentials.clone(),
                    listeners: vec![("replica", datapath.replica_stats().clone())],
                },
            )
            .await?,
        ),
        None => None,
    };
    tracing::info!(
        socket = %args.socket.display(),
        replicas = %datapath.local_addr(),
        metrics = ?metrics,
        pid = std::process::id(),
        handovers = datapath.handover_report().handovers,
        "serving the data path"
    );
    Ok(process.run().await?)
}

/// Starts `wasmcsi datapath` (this executable) detached from the calling plugin: its own
/// process group, stdin closed, its log appended to `<state_dir>/datapath.log`, so neither a
/// kill of the plugin nor a signal to the plugin's process group reaches it. Returns once it
/// answers on its socket, with its pid.
pub async fn spawn_detached(args: &DataPathArgs) -> anyhow::Result<u32> {
    std::fs::create_dir_all(&args.state_dir).with_context(|| format!("creating {}", args.state_dir.display()))?;
    let log_path = args.state_dir.join("datapath.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("datapath")
        .arg("--socket")
        .arg(&args.socket)
        .arg("--state-dir")
        .arg(&args.state_dir)
        .arg("--node-id")
        .arg(&args.node_id)
        .arg("--replica-listen")
        .arg(args.replica_listen.to_string());
    for root in &args.replica_roots {
        cmd.arg("--replica-root").arg(root.arg());
    }
    for (k, v) in &args.node_labels {
        cmd.arg("--node-label").arg(format!("{k}={v}"));
    }
    if let Some(addr) = args.metrics_addr {
        cmd.arg("--metrics-addr").arg(addr.to_string());
    }
    if let Some(dir) = &args.tls_dir {
        cmd.arg("--tls-dir").arg(dir);
    }
    if let Some(mode) = args.tls_mode {
        cmd.arg("--tls-mode").arg(mode.to_string());
    }
    if let Some(url) = &args.authority {
        cmd.arg("--authority").arg(url);
    }
    cmd.arg("--replica-max-connections")
        .arg(args.limits.replica_max_connections.to_string())
        .arg("--replica-max-per-source")
        .arg(args.limits.replica_max_per_source.to_string())
        .arg("--socket-max-connections")
        .arg(args.socket_limits.socket_max_connections.to_string())
        .arg("--socket-max-per-client")
        .arg(args.socket_limits.socket_max_per_client.to_string())
        .arg("--socket-idle-timeout")
        .arg(args.socket_limits.socket_idle_timeout.to_string());
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("duplicating the log file")?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting wasmcsi datapath")?;
    let pid = child.id();
    let client = DataPathClient::new(&args.socket);
    let deadline = tokio::time::Instant::now() + START_WAIT;
    let answered = loop {
        if let Ok(answered) = client.hello().await {
            break answered;
        }
        if let Some(status) = child.try_wait().context("waiting for the data path")? {
            anyhow::bail!("the data path exited with {status} at its start; see {}", log_path.display());
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("the data path started (pid {pid}) did not answer; see {}", log_path.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Reaped while this process lives; after that, by whoever inherits it.
    std::thread::spawn(move || child.wait());
    tracing::info!(pid = answered, socket = %args.socket.display(), "started the data path");
    Ok(answered)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_label_is_key_equals_value() {
        assert_eq!(super::parse_label("zone=a"), Ok(("zone".into(), "a".into())));
        assert!(super::parse_label("=a").is_err());
        assert!(super::parse_label("zone").is_err());
    }

    #[test]
    fn a_replica_root_is_a_path_or_a_disk_name_and_a_path() {
        use super::{ReplicaRoot, parse_replica_root};
        let root = |disk: &str, path: &str| ReplicaRoot { disk: disk.into(), path: path.into() };
        assert_eq!(parse_replica_root("/var/lib/r"), Ok(root("default", "/var/lib/r")));
        assert_eq!(parse_replica_root("ssd=/mnt/ssd/r"), Ok(root("ssd", "/mnt/ssd/r")));
        assert_eq!(parse_replica_root("default=/r"), Ok(root("default", "/r")));
        assert_eq!(parse_replica_root("/mnt/a=b"), Ok(root("default", "/mnt/a=b")), "not a disk name: a path");
        assert!(parse_replica_root("ssd=").is_err());
        // The same flag passed on by a plugin that starts the data path parses back.
        let arg = root("nvme-1", "/mnt/n").arg();
        assert_eq!(parse_replica_root(arg.to_str().expect("utf-8")), Ok(root("nvme-1", "/mnt/n")));
    }
}
