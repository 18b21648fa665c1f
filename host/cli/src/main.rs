//! `wasmcsi`: one binary for the CSI host and its tools. See `wasmcsi --help`.
use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use wasmcsi::datapath_cmd::parse_label;
use wasmcsi::host::{Host, HostOptions};

/// wasmcsi — a Kubernetes CSI driver whose storage backends are sandboxed WebAssembly
/// components.
///
/// The host speaks CSI to kubelet and the sidecars and owns every privileged mechanism;
/// each backend (`NAME.wasm` in the backends directory) decides provisioning policy and is
/// selected by the StorageClass parameter `backend: NAME`. Backends are hot-reloaded.
///
/// Start here:  wasmcsi demo            (a local host driving a real volume end to end)
///              wasmcsi backend new my-backend  (a backend crate to edit, build and check)
///              wasmcsi backend check my-backend.wasm
#[derive(Parser)]
#[command(name = "wasmcsi", version, propagate_version = true)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info`, `wasmcsi=debug`.
    // wasm-compose (`backend compose`) narrates every step at info.
    #[arg(long, env = "RUST_LOG", default_value = "info,wasm_compose=warn", global = true)]
    log: String,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    /// One readable line per event (coloured at a terminal).
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

#[derive(Subcommand)]
enum UpgradeCommand {
    /// Hand every volume of a running data path (`wasmcsi datapath`) to a new wasmcsi binary
    /// without unmounting and without an I/O error: I/O pauses while the volumes move, and the
    /// data path keeps its pid. Prints the longest pause. If the new binary cannot take over,
    /// the running one serves on and this fails with its reason.
    ///
    /// Example (in the data path's container, the new binary copied beside the old one):
    ///   wasmcsi upgrade datapath --socket /var/lib/wasmcsi/datapath/datapath.sock \
    ///     --binary /var/lib/wasmcsi/bin/wasmcsi-0.2.0
    Datapath(wasmcsi::datapath_upgrade::UpgradeArgs),
}

#[derive(Subcommand)]
enum Command {
    /// Serve CSI on a unix socket (controller, node, or both).
    ///
    /// Example (a node plugin):
    ///   wasmcsi serve --mode node --socket /csi/csi.sock --node-id $NODE_NAME \
    ///     --config /etc/wasmcsi/config.toml --backends-dir /var/lib/wasmcsi/backends
    Serve(Box<ServeArgs>),
    /// Inspect and test backend components.
    #[command(subcommand)]
    Backend(BackendCommand),
    /// Start a local host (controller + node) with the bundled backends and drive a real
    /// volume through the CSI socket: create, stage, publish, write, snapshot, restore,
    /// expand, unpublish, unstage, delete. Needs root for the mounts.
    Demo(wasmcsi::demo::DemoArgs),
    /// This node's data path in a process of its own: the replica server and every attached
    /// volume's engine, FUSE session and loop device, served to the node plugin on a unix
    /// socket, so the plugin can restart or be upgraded without an I/O error.
    ///
    /// Example (its own container, beside `serve --datapath-socket`):
    ///   wasmcsi datapath --socket /var/lib/wasmcsi/datapath/datapath.sock --node-id $NODE_NAME \
    ///     --replica-listen $POD_IP:9501 --state-dir /var/lib/wasmcsi/state
    Datapath(wasmcsi::datapath_cmd::DataPathArgs),
    /// Upgrade a running part of wasmcsi live.
    #[command(subcommand)]
    Upgrade(UpgradeCommand),
    /// Replica servers of the replicated block data path (serve, nodes).
    #[command(subcommand)]
    Replica(wasmcsi::block_cmd::ReplicaCommand),
    /// Replicated volumes by hand: create, attach, snapshot, expand, rebuild, clone, delete.
    #[command(subcommand)]
    Volume(wasmcsi::block_cmd::VolumeCommand),
    /// The built-in CA by hand: make one, issue node and controller credentials, show what a
    /// credentials directory holds.
    #[command(subcommand)]
    Pki(wasmcsi::pki_cmd::PkiCommand),
}

#[derive(Subcommand)]
enum BackendCommand {
    /// Load a component, print its imports, exports and the grants it needs, and run the
    /// CSI conformance suite against it with real capabilities on a scratch directory.
    /// Exits non-zero, with a readable report, when any check fails.
    Check(wasmcsi::check::CheckArgs),
    /// List the backends a directory holds, whether each loads, and what it offers (with the
    /// configuration `serve` reads: same flags, same environment variables). Exits 1 when any
    /// file is rejected.
    Ls(wasmcsi::backend_dir::LsArgs),
    /// Write the backends bundled in this binary into a directory as `NAME.wasm`, the names
    /// the host loads them by (how the image's backends directory is filled).
    Export(wasmcsi::backend_dir::ExportArgs),
    /// Write a new backend crate on the guest SDK: a working template for one capability
    /// (dir, nfs, rbd or block) with unit tests against the SDK's in-memory host, that builds
    /// with `cargo build --release --target wasm32-wasip2` and passes `backend check` as it is.
    New(wasmcsi::scaffold::NewArgs),
    /// Wrap a backend into one test component for the plain `wasmtime` CLI, no wasmcsi host:
    /// in-memory capabilities (`dir` over the directory given as `--dir ROOT::/`) and the
    /// controller checks, which `wasmtime run --dir ROOT::/ FILE-test.wasm` runs, printing the
    /// PASS/FAIL report and exiting non-zero when a check fails.
    Compose(wasmcsi::compose::ComposeArgs),
    /// Push a component to an OCI registry as a Wasm artifact (CNCF layout; its info() and
    /// contract in annotations) and print the digest to pin in `[backends.NAME] source`.
    ///
    /// Example:  wasmcsi backend push nfs.wasm oci://registry.example/backends/nfs:1.2.0
    Push(wasmcsi::oci_cmd::PushArgs),
    /// Pull a backend from an OCI registry, verified as the host pulls it (digests, the Wasm
    /// layout, size, signatures with --public-key), into a file.
    Pull(wasmcsi::oci_cmd::PullArgs),
    /// Sign an artifact's digest with a key, cosign-compatibly (`cosign verify --key` accepts
    /// it; the host verifies it with `public_keys`).
    Sign(wasmcsi::oci_cmd::SignArgs),
    /// Make an ECDSA P-256 key pair for `backend sign` and `public_keys`.
    Keygen(wasmcsi::oci_cmd::KeygenArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    /// Identity + Controller: provisioning, snapshots, expansion, capacity (one per cluster).
    Controller,
    /// Identity + Node: stage and publish volumes on this node (one per node).
    Node,
    /// Both, in one process (a single-node cluster, the demo, tests).
    All,
}

#[derive(Args)]
struct ServeArgs {
    /// Which CSI services to serve (Identity is always served).
    #[arg(long, value_enum, default_value_t = ModeArg::All)]
    mode: ModeArg,
    /// The CSI unix socket.
    #[arg(long, default_value = "/csi/csi.sock")]
    socket: PathBuf,
    /// Host configuration: limits and per-backend capability grants (TOML).
    #[arg(long, env = wasmcsi::backend_dir::CONFIG_ENV)]
    config: Option<PathBuf>,
    /// Directory of backend components (`NAME.wasm`), watched for changes.
    #[arg(long, env = wasmcsi::backend_dir::BACKENDS_DIR_ENV, default_value = "/var/lib/wasmcsi/backends")]
    backends_dir: PathBuf,
    /// Where the metadata store and compiled-component cache live.
    #[arg(long, default_value = "/var/lib/wasmcsi/state")]
    state_dir: PathBuf,
    /// This node's id (node mode): usually the Kubernetes node name.
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node_id: String,
    /// The CSI driver name (the CSIDriver object's name).
    #[arg(long, default_value = "wasmcsi.io")]
    driver_name: String,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// How often the backends directory is checked for new or changed components.
    #[arg(long, default_value_t = 2000)]
    reload_interval_ms: u64,
    /// Serve this node's replicas of replicated block volumes on ADDR (node mode); other nodes'
    /// engines connect here. Without it this node holds no replicas and stages none.
    #[arg(long)]
    replica_listen: Option<SocketAddr>,
    /// Where this node's replicas live (one directory each).
    #[arg(long, default_value = "/var/lib/wasmcsi/replicas")]
    replica_root: PathBuf,
    /// A label this node reports to backends (KEY=VALUE, repeatable): replica node selectors
    /// and spreading (e.g. topology.kubernetes.io/zone=a).
    #[arg(long = "node-label", value_parser = parse_label)]
    node_labels: Vec<(String, String)>,
    /// How often the controller reconciles the volumes of self-healing backends (replaces
    /// replicas lost longer than their timeout): a duration such as 30s, 5m or 1h; 0 turns it
    /// off.
    #[arg(long, default_value = "30s", value_parser = parse_interval)]
    reconcile_interval: Duration,
    /// A clone being filled from a snapshot or volume (CreateVolume answers ABORTED until it is
    /// whole) that no call names for this long is deleted with its fill, releasing its source:
    /// the CO gave up on it. Checked at each reconcile round.
    #[arg(long, default_value = "10m", value_parser = parse_interval)]
    abandoned_clone_timeout: Duration,
    /// kubelet's directory as this process sees it (node mode). Checked at start: it must be
    /// on a shared mount (Bidirectional in a pod), or the volumes mounted beneath it would
    /// never reach kubelet and the pods; the plugin then refuses to start, saying so. Unset:
    /// not checked.
    #[arg(long)]
    kubelet_dir: Option<PathBuf>,
    /// Node plugin in a multi-node cluster: serve the calls of node-local backends (hostpath)
    /// that the controller forwards on ADDR (TCP), over mutual TLS with --tls-dir (this node's
    /// certificate) to the controller's certificate only; plaintext only with --tls-mode off.
    #[arg(long)]
    peer_listen: Option<SocketAddr>,
    /// Controller in a multi-node cluster: a node plugin's peer endpoint, NODE=HOST:PORT
    /// (repeatable), reached over mutual TLS with --tls-dir (the controller's certificate); the
    /// server must present NODE's certificate.
    #[arg(long = "peer", value_parser = parse_label)]
    peers: Vec<(String, String)>,
    /// A DNS name HOST:PORT resolving to every node plugin's peer endpoint (a headless
    /// Service), each asked which node it serves (repeatable).
    #[arg(long = "peer-service")]
    peer_services: Vec<String>,
    /// Controller: a node id of the cluster (repeatable). With it, ControllerPublishVolume to a
    /// node id that neither these, nor the cluster's CSINode objects (in a pod, or with
    /// --kube-api), nor a node plugin or replica server that answers know is NOT_FOUND. A
    /// controller with no such source (and not a standalone --mode all) lets every node id
    /// through. See docs/operating.md, "Which nodes exist".
    #[arg(long = "known-node")]
    known_nodes: Vec<String>,
    /// Reach this node's data path (replica server and engines) at this unix socket instead of
    /// running it in this process: volumes then outlive this process (node mode). See
    /// `wasmcsi datapath`.
    #[arg(long)]
    datapath_socket: Option<PathBuf>,
    /// With --datapath-socket: start `wasmcsi datapath` (detached, serving --replica-listen and
    /// --replica-root) when none answers there.
    #[arg(long, requires = "datapath_socket")]
    datapath_start: bool,
    #[command(flatten)]
    trust: TrustArgs,
}

/// This process's identity (TLS credentials) and the controller's authority endpoint.
#[derive(Args)]
struct TrustArgs {
    /// This process's credentials directory, in the layout of a Kubernetes TLS Secret (`ca.crt`,
    /// `tls.crt`, `tls.key`; cert-manager's, or `wasmcsi pki issue`'s). Re-read when it changes.
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// How this process's network channels travel (the replica port, the peer endpoint and
    /// the controller's calls to it): `required` (mutual TLS only; the default with --tls-dir),
    /// `permissive` (TLS, and plaintext peers of the version before TLS still served: for the
    /// upgrade), `off` (plaintext: only by this explicit choice).
    #[arg(long, value_name = "off|permissive|required")]
    tls_mode: Option<wasmcsi_trust::TlsMode>,
    /// Controller: serve the authority endpoint (grants of volumes to the nodes they are
    /// published to; node certificates with --ca-dir) on ADDR, over TLS with --tls-dir.
    #[arg(long, requires = "tls_dir")]
    authority_listen: Option<SocketAddr>,
    /// Controller: the built-in CA (`wasmcsi pki init`) that issues and renews node
    /// certificates at the authority endpoint.
    #[arg(long, requires = "authority_listen")]
    ca_dir: Option<PathBuf>,
    /// Controller: keep the built-in CA in this Secret (NAMESPACE/NAME) of the Kubernetes API:
    /// read into --ca-dir at start, created with a new CA when absent; the CA's certificate is
    /// published in the ConfigMap of the same name, for the nodes to trust the authority
    /// endpoint by. Needs get/create on that Secret and get/create/update on that ConfigMap.
    #[arg(long, requires = "ca_dir")]
    ca_secret: Option<String>,
    /// Controller: how long the certificates the built-in CA issues are valid (e.g. 24h): the
    /// nodes', and the controller's own (issued into --tls-dir when it has none).
    #[arg(long, value_parser = wasmcsi::pki_cmd::parse_validity, requires = "ca_dir")]
    certificate_validity: Option<Duration>,
    /// Controller: how long the grants the authority endpoint signs are valid (e.g. 24h, the
    /// default). A node renews a grant when half of its life is left, so a shorter life bounds
    /// how long a replica that missed a republish accepts the old owner, at more renewals.
    #[arg(long, value_parser = wasmcsi::pki_cmd::parse_validity, requires = "authority_listen")]
    grant_validity: Option<Duration>,
    /// Controller: the node plugin's ServiceAccount (NAMESPACE:NAME). A node without a
    /// certificate proves itself with a projected token of it bound to a pod on that node,
    /// checked with the TokenReview API.
    #[arg(long, requires = "ca_dir")]
    node_service_account: Option<String>,
    /// Controller: the Kubernetes API server (https://HOST:PORT) that reviews node tokens and
    /// whose CSINode objects say which nodes exist, with --kube-api-ca and --kube-api-token.
    /// Default: the API server of the pod this runs in.
    #[arg(long, requires_all = ["kube_api_ca", "kube_api_token"])]
    kube_api: Option<String>,
    /// The API server's CA bundle (with --kube-api).
    #[arg(long, requires = "kube_api")]
    kube_api_ca: Option<PathBuf>,
    /// The controller's own ServiceAccount token for the API server (with --kube-api).
    #[arg(long, requires = "kube_api")]
    kube_api_token: Option<PathBuf>,
    /// Node: the controller's authority endpoint (https://HOST:PORT). This node's certificate in
    /// --tls-dir is asked for there when it has none, and renewed at 2/3 of its life.
    #[arg(long, requires = "tls_dir")]
    authority: Option<String>,
    /// Node: the CA bundle to trust the authority endpoint by before this node has a
    /// certificate (default: ca.crt in --tls-dir).
    #[arg(long, requires = "authority")]
    authority_ca: Option<PathBuf>,
    /// Node: the node plugin's projected ServiceAccount token (audience `wasmcsi`): its proof
    /// when it asks for its first certificate.
    #[arg(long, requires = "authority")]
    authority_token: Option<PathBuf>,
}

impl TrustArgs {
    fn options(self) -> wasmcsi::trust::TrustOptions {
        let kube_api = match (self.kube_api, self.kube_api_ca, self.kube_api_token) {
            (Some(url), Some(ca_file), Some(token_file)) => {
                Some(wasmcsi_csi::authority_endpoint::token_review::KubeApi { url, ca_file, token_file })
            }
            _ => None,
        };
        wasmcsi::trust::TrustOptions {
            tls_mode: self.tls_mode,
            tls_dir: self.tls_dir,
            authority_listen: self.authority_listen,
            ca_dir: self.ca_dir,
            ca_secret: self.ca_secret,
            certificate_validity: self.certificate_validity,
            grant_validity: self.grant_validity,
            node_service_account: self.node_service_account,
            kube_api,
            authority: self.authority,
            authority_ca: self.authority_ca,
            authority_token: self.authority_token,
        }
    }
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a duration such as 30s, 5m or 1h"))?;
    let seconds = match unit {
        "" | "s" => Some(n),
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        _ => None,
    };
    seconds.map(Duration::from_secs).ok_or_else(|| format!("{s:?} is not a duration such as 30s, 5m or 1h"))
}

fn init_logging(filter: &str, format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person at a terminal: escape codes in a pod's log or a file are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mode = match args.mode {
        ModeArg::Controller => wasmcsi_csi::Mode::Controller,
        ModeArg::Node => wasmcsi_csi::Mode::Node,
        ModeArg::All => wasmcsi_csi::Mode::All,
    };
    if let (Some(dir), true) = (&args.kubelet_dir, mode.node()) {
        check_kubelet_dir(dir)?;
    }
    let node_id = if args.node_id.is_empty() {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("no --node-id, and the hostname is unreadable")?
            .trim()
            .to_string()
    } else {
        args.node_id
    };
    let options = HostOptions {
        driver_name: args.driver_name,
        mode,
        node_id,
        socket: args.socket.clone(),
        config: wasmcsi::load_config_file(args.config.as_deref())?,
        config_file: args.config.clone(),
        backends_dir: Some(args.backends_dir),
        state_dir: args.state_dir,
        reload_interval: Duration::from_millis(args.reload_interval_ms.max(100)),
        metrics_addr: args.metrics_addr,
        replicas: args.replica_listen.map(|listen| wasmcsi::host::ReplicaOptions {
            listen,
            root: args.replica_root,
            disks: Vec::new(),
            labels: args.node_labels,
        }),
        reconcile: (!args.reconcile_interval.is_zero()).then_some(wasmcsi_csi::reconcile::Rounds {
            interval: args.reconcile_interval,
            abandoned_clone_after: args.abandoned_clone_timeout,
        }),
    };
    let peer = wasmcsi::host::PeerOptions {
        listen: args.peer_listen,
        sources: wasmcsi_csi::peer::PeerSources {
            nodes: args.peers.into_iter().collect(),
            services: args.peer_services,
        },
        known_nodes: args.known_nodes,
    };
    let place = match args.datapath_socket {
        Some(socket) => wasmcsi::host::DataPathPlace::Socket { socket, start: args.datapath_start },
        None => wasmcsi::host::DataPathPlace::InProcess,
    };
    let trust = args.trust.options();
    if options.replicas.is_some() && options.mode.node() {
        wasmcsi::trust::check_replica_mode(trust.tls_dir.as_deref(), trust.tls_mode)?;
    }
    let host = Host::start_with_trust(options, place, peer, trust).await?;
    tracing::info!(socket = %args.socket.display(), backends = ?host.registry.names(), metrics = ?host.metrics_addr, peer = ?host.peer_addr, authority = ?host.trust.authority_addr, "serving CSI");
    tokio::select! {
        r = tokio::signal::ctrl_c() => { r.context("waiting for a signal")?; tracing::info!("interrupted; shutting down"); host.shutdown().await }
        r = sigterm() => { r?; tracing::info!("terminated; shutting down"); host.shutdown().await }
    }
}

/// Refuse to serve a node whose mounts would not reach kubelet (see `node::propagation`).
fn check_kubelet_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    wasmcsi::check_shared_mount(
        "--kubelet-dir",
        dir,
        "kubelet's directory",
        "the volumes staged and published beneath it must reach kubelet and the pods",
    )
}

async fn sigterm() -> anyhow::Result<()> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?.recv().await;
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_format);
    // Every process, whatever it runs: see `descriptors`.
    wasmcsi::descriptors::raise_soft_limit();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("wasmcsi: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(*args).await.map(|()| true),
            Command::Backend(BackendCommand::Check(args)) => wasmcsi::check::run(args).await,
            Command::Backend(BackendCommand::Ls(args)) => {
                wasmcsi::backend_dir::list(args).await.map(|rejected| rejected == 0)
            }
            Command::Backend(BackendCommand::Export(args)) => wasmcsi::backend_dir::export(args).map(|()| true),
            Command::Backend(BackendCommand::New(args)) => wasmcsi::scaffold::run(args).map(|()| true),
            Command::Backend(BackendCommand::Compose(args)) => wasmcsi::compose::run(args).map(|()| true),
            Command::Backend(BackendCommand::Push(args)) => wasmcsi::oci_cmd::push(args).await.map(|()| true),
            Command::Backend(BackendCommand::Pull(args)) => wasmcsi::oci_cmd::pull(args).await.map(|()| true),
            Command::Backend(BackendCommand::Sign(args)) => wasmcsi::oci_cmd::sign(args).await.map(|()| true),
            Command::Backend(BackendCommand::Keygen(args)) => wasmcsi::oci_cmd::keygen(args).map(|()| true),
            Command::Demo(args) => wasmcsi::demo::run(args).await.map(|()| true),
            Command::Datapath(args) => wasmcsi::datapath_cmd::run(args).await.map(|()| true),
            Command::Upgrade(UpgradeCommand::Datapath(args)) => {
                wasmcsi::datapath_upgrade::run_upgrade(args).await.map(|()| true)
            }
            Command::Replica(cmd) => wasmcsi::block_cmd::replica(cmd).await.map(|()| true),
            Command::Volume(cmd) => wasmcsi::block_cmd::volume(cmd).await.map(|()| true),
            Command::Pki(cmd) => wasmcsi::pki_cmd::run(cmd),
        }
    });
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("wasmcsi: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// What of `cmd` and its subcommands (their path from `wasmcsi`) has no help text: a
    /// subcommand without an about, an argument without help, a value of an enum argument
    /// without its own line.
    fn without_help(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                missing.push(format!("{path}: argument {id}"));
            }
            if arg.get_action().takes_values() {
                for value in arg.get_possible_values() {
                    if value.get_help().is_none() && !value.is_hide_set() {
                        missing.push(format!("{path}: argument {id}: value {}", value.get_name()));
                    }
                }
            }
        }
        for sub in cmd.get_subcommands() {
            let sub_path = format!("{path} {}", sub.get_name());
            if sub.get_about().is_none() && sub.get_long_about().is_none() {
                missing.push(format!("{sub_path}: subcommand"));
            }
            without_help(sub, &sub_path, missing);
        }
    }

    /// Every subcommand, every argument of every subcommand and every value of an enum argument
    /// says what it is in `--help`.
    #[test]
    fn every_subcommand_argument_and_value_has_help() {
        let mut cli = Cli::command();
        cli.build();
        let mut missing = Vec::new();
        without_help(&cli, "wasmcsi", &mut missing);
        assert!(missing.is_empty(), "without help text:\n{}", missing.join("\n"));
    }

    /// The walker sees what it must: a command with an undocumented argument, value and
    /// subcommand is reported on all three.
    #[test]
    fn the_help_walker_reports_what_has_none() {
        let bare = clap::Command::new("t")
            .arg(clap::Arg::new("flag").long("flag").value_parser(["a", "b"]))
            .subcommand(clap::Command::new("sub"));
        let mut missing = Vec::new();
        without_help(&bare, "t", &mut missing);
        assert_eq!(
            missing,
            ["t: argument flag", "t: argument flag: value a", "t: argument flag: value b", "t sub: subcommand"]
        );
    }

    #[test]
    fn the_command_tree_is_consistent() {
        Cli::command().debug_assert();
    }
}
