//! `wasmcsi replica …` and `wasmcsi volume …`: the replicated block data path by hand. A replica
//! server per node (`replica create`, `replica serve`), and an engine attached to the kernel
//! through FUSE + loop (`volume attach`) that stays in the foreground until interrupted.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use wasmcsi_block::driver::{DriverConfig, ReplicatedVolume, VolumeStatus};
use wasmcsi_block::replica::{ReplicaServer, ReplicaStore};
use wasmcsi_block::replication::{EngineConfig, ReplicaConfig};
use wasmcsi_frontend::{Frontend, FuseLoopFrontend};

/// Replica servers: the per-node storage of a replicated volume.
#[derive(Subcommand)]
pub enum ReplicaCommand {
    /// Create an empty replica (sparse data file plus metadata header) in a directory.
    ///
    /// Example:
    ///   wasmcsi replica create --dir /var/lib/wasmcsi/replicas/pvc-1 --volume-id pvc-1 --size 1G
    #[command(verbatim_doc_comment)]
    Create(ReplicaCreateArgs),
    /// Serve an existing replica over TCP until SIGINT/SIGTERM, then shut down gracefully
    /// (requests already read are answered before connections close).
    ///
    /// Example:
    ///   wasmcsi replica serve --dir /var/lib/wasmcsi/replicas/pvc-1 --listen 0.0.0.0:9501
    #[command(verbatim_doc_comment)]
    Serve(ReplicaServeArgs),
}

#[derive(Args)]
pub struct ReplicaCreateArgs {
    /// Directory for the replica's files (created if missing; must not hold a replica yet).
    #[arg(long)]
    pub dir: PathBuf,
    /// The volume this replica belongs to; the engine checks it on connect.
    #[arg(long)]
    pub volume_id: String,
    /// Volume size: bytes, or with a K/M/G/T suffix (powers of 1024), e.g. 512M, 1G.
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
}

#[derive(Args)]
pub struct ReplicaServeArgs {
    /// Directory of a replica made by `wasmcsi replica create`.
    #[arg(long)]
    pub dir: PathBuf,
    /// Address to listen on, e.g. 0.0.0.0:9501.
    #[arg(long)]
    pub listen: SocketAddr,
}

/// Replicated volumes: an engine on this node over replica servers.
#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Start the engine against the replicas, expose the volume as a loop device (FUSE + loop),
    /// print the device path and replica health, and stay in the foreground. SIGINT/SIGTERM
    /// detaches cleanly; that is refused, with the mounts named, while the device is mounted.
    ///
    /// Rebuild progress is printed as a line whenever the healthy replica count or the number of
    /// finished rebuilds changes (a progress bar is a later step). Needs root and /dev/fuse.
    ///
    /// Example (two replicas, the first on this node):
    ///   wasmcsi volume attach --volume-id pvc-1 --size 1G \
    ///     --replica 127.0.0.1:9501 --replica 10.0.0.2:9501 --local 0 \
    ///     --state-dir /var/lib/wasmcsi/engine/pvc-1 --runtime-dir /run/wasmcsi
    #[command(verbatim_doc_comment)]
    Attach(VolumeAttachArgs),
}

#[derive(Args)]
pub struct VolumeAttachArgs {
    /// The volume id; every replica must have been created with it.
    #[arg(long)]
    pub volume_id: String,
    /// Volume size (as the replicas were created), e.g. 1G.
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
    /// A replica server address; repeat once per replica.
    #[arg(long = "replica", required = true)]
    pub replicas: Vec<SocketAddr>,
    /// Where the engine persists its state (revision, out-of-sync replicas, dirty map).
    #[arg(long)]
    pub state_dir: PathBuf,
    /// Where the FUSE mount backing the loop device lives, e.g. /run/wasmcsi.
    #[arg(long)]
    pub runtime_dir: PathBuf,
    /// Index (0-based, in --replica order) of the replica on this node: preferred for reads.
    #[arg(long)]
    pub local: Option<usize>,
}

/// Parses `1G`, `512M`, `4096`, `64k` (powers of 1024; a trailing `B`/`iB` is accepted).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = num.trim().parse().map_err(|_| format!("{s:?} is not a size like 1G, 512M or 4096"))?;
    let v = n.checked_mul(1u64 << shift).ok_or_else(|| format!("{s:?} is too large"))?;
    if v == 0 || !v.is_multiple_of(4096) {
        return Err(format!("{s:?}: the size must be a positive multiple of 4096 bytes"));
    }
    Ok(v)
}

pub async fn replica(cmd: ReplicaCommand) -> anyhow::Result<()> {
    match cmd {
        ReplicaCommand::Create(a) => {
            std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
            let store = ReplicaStore::create(&a.dir, &a.volume_id, a.size)
                .with_context(|| format!("creating the replica in {}", a.dir.display()))?;
            drop(store);
            println!("created replica of volume {} ({} bytes) in {}", a.volume_id, a.size, a.dir.display());
            Ok(())
        }
        ReplicaCommand::Serve(a) => {
            let server = ReplicaServer::bind(a.listen, &a.dir)
                .await
                .with_context(|| format!("serving the replica in {} on {}", a.dir.display(), a.listen))?;
            println!("serving replica {} on {}", a.dir.display(), server.local_addr());
            wait_for_signal().await?;
            tracing::info!("shutting down the replica server");
            server.shutdown().await.context("shutting down the replica server")?;
            println!("replica server stopped");
            Ok(())
        }
    }
}

pub async fn volume(cmd: VolumeCommand) -> anyhow::Result<()> {
    match cmd {
        VolumeCommand::Attach(a) => attach(a).await,
    }
}

async fn attach(a: VolumeAttachArgs) -> anyhow::Result<()> {
    let n = a.replicas.len();
    if let Some(l) = a.local
        && l >= n
    {
        bail!("--local {l} is out of range: there are {n} replicas (indices 0..{n})");
    }
    let engine = EngineConfig {
        volume_id: a.volume_id.clone(),
        size: a.size,
        replicas: (0..n).map(|i| ReplicaConfig { local: a.local == Some(i) }).collect(),
        region_size: 1 << 20,
        request_timeout: 5_000,
        attach_timeout: 10_000,
        rebuild_parallelism: 4,
    };
    let vol = Arc::new(
        ReplicatedVolume::start(
            DriverConfig::new(engine, a.replicas.clone(), &a.state_dir),
            &tokio::runtime::Handle::current(),
        )
        .context("starting the engine")?,
    );
    // The engine and the frontend block; this runtime is multi-threaded, so block in place.
    let attached_ok =
        tokio::task::block_in_place(|| vol.wait_for(Duration::from_secs(30), |s| s.attached && s.healthy >= 1));
    if !attached_ok {
        vol.shutdown();
        bail!("the engine did not attach to any replica within 30s: {}", describe(&vol.status(), n));
    }
    let dev = vol.clone();
    let mut attached = tokio::task::block_in_place(|| FuseLoopFrontend::new(&a.runtime_dir).attach(dev, &a.volume_id))
        .context("attaching the volume through FUSE + loop")?;
    let device = attached.device().to_path_buf();
    println!("{}", device.display());
    let mut last = vol.status();
    println!("replicas: {}", describe(&last, n));

    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let signalled = tokio::select! {
            _ = tick.tick() => false,
            _ = sigint.recv() => true,
            _ = sigterm.recv() => true,
        };
        let s = vol.status();
        if s.healthy != last.healthy || s.rebuilds_finished != last.rebuilds_finished {
            println!("replicas: {}", describe(&s, n));
            last = s;
        }
        if !signalled {
            continue;
        }
        match tokio::task::block_in_place(|| attached.detach()) {
            Ok(()) => break,
            Err(e @ wasmcsi_frontend::FrontendError::InUse { .. }) => {
                eprintln!(
                    "wasmcsi: refusing to detach {}: {e}; the volume stays attached, interrupt again after unmounting",
                    device.display()
                );
            }
            Err(e) => return Err(anyhow::Error::new(e).context(format!("detaching {}", device.display()))),
        }
    }
    drop(attached);
    vol.shutdown();
    println!("detached {}", device.display());
    Ok(())
}

fn describe(s: &VolumeStatus, replicas: usize) -> String {
    format!(
        "{}/{replicas} healthy, {} connected, {} rebuilds finished, revision {}{}",
        s.healthy,
        s.connected,
        s.rebuilds_finished,
        s.revision,
        if s.healthy < replicas { " (degraded)" } else { "" }
    )
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = sigint.recv() => {}
        _ = sigterm.recv() => {}
    }
    Ok(())
}
