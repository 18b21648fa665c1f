//! `wasmcsi`: one binary for the CSI host and its tools. See `wasmcsi --help`.
use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
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
    #[arg(long, env = "RUST_LOG", default_value = "info", global = true)]
    log: String,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve CSI on a unix socket (controller, node, or both).
    ///
    /// Example (a node plugin):
    ///   wasmcsi serve --mode node --socket /csi/csi.sock --node-id $NODE_NAME \
    ///     --config /etc/wasmcsi/config.toml --backends-dir /var/lib/wasmcsi/backends
    Serve(ServeArgs),
    /// Inspect and test backend components.
    #[command(subcommand)]
    Backend(BackendCommand),
    /// Start a local host (controller + node) with the bundled backends and drive a real
    /// volume through the CSI socket: create, stage, publish, write, snapshot, restore,
    /// expand, unpublish, unstage, delete. Needs root for the mounts.
    Demo(wasmcsi::demo::DemoArgs),
    /// Replica servers of the replicated block data path (serve, nodes).
    #[command(subcommand)]
    Replica(wasmcsi::block_cmd::ReplicaCommand),
    /// Replicated volumes by hand: create, attach, snapshot, expand, rebuild, clone, delete.
    #[command(subcommand)]
    Volume(wasmcsi::block_cmd::VolumeCommand),
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
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Controller,
    Node,
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

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
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
    let node_id = if args.node_id.is_empty() {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("no --node-id, and the hostname is unreadable")?
            .trim()
            .to_string()
    } else {
        args.node_id
    };
    let host = Host::start(HostOptions {
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
            labels: args.node_labels,
        }),
        reconcile_interval: (!args.reconcile_interval.is_zero()).then_some(args.reconcile_interval),
    })
    .await?;
    tracing::info!(socket = %args.socket.display(), backends = ?host.registry.names(), metrics = ?host.metrics_addr, "serving CSI");
    tokio::select! {
        r = tokio::signal::ctrl_c() => { r.context("waiting for a signal")?; tracing::info!("interrupted; shutting down"); host.shutdown().await }
        r = sigterm() => { r?; tracing::info!("terminated; shutting down"); host.shutdown().await }
    }
}

async fn sigterm() -> anyhow::Result<()> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?.recv().await;
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("wasmcsi: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args).await.map(|()| true),
            Command::Backend(BackendCommand::Check(args)) => wasmcsi::check::run(args).await,
            Command::Backend(BackendCommand::Ls(args)) => {
                wasmcsi::backend_dir::list(args).await.map(|rejected| rejected == 0)
            }
            Command::Backend(BackendCommand::Export(args)) => wasmcsi::backend_dir::export(args).map(|()| true),
            Command::Backend(BackendCommand::New(args)) => wasmcsi::scaffold::run(args).map(|()| true),
            Command::Demo(args) => wasmcsi::demo::run(args).await.map(|()| true),
            Command::Replica(cmd) => wasmcsi::block_cmd::replica(cmd).await.map(|()| true),
            Command::Volume(cmd) => wasmcsi::block_cmd::volume(cmd).await.map(|()| true),
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
