//! `wasmcsi replica …` and `wasmcsi volume …`: the replicated block data path by hand. A replica
//! server per node (`replica serve`, `replica nodes`); volumes created, deleted, reverted,
//! cloned and (when detached) snapshotted or expanded through the servers' control requests
//! (`wasmcsi_block::control`); and a volume attached to the kernel (`volume attach`, through
//! `wasmcsi_datapath::attach`: engine + FUSE + loop) that stays in the foreground and serves the same
//! operations online on its control socket (`block_ctl`).
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use wasmcsi_block::control::{self, ReplicaServerClient, ReplicaSet};
use wasmcsi_block::replica::{DEFAULT_DISK, ReplicaServer};
use wasmcsi_block::volume::ReplicaEndpoint;
use wasmcsi_datapath::attach::{AttachConfig, AttachError, AttachedVolume};

use crate::block_ctl as ctl;

/// Replica servers: the per-node storage of replicated volumes.
#[derive(Subcommand)]
pub enum ReplicaCommand {
    /// Serve every replica under a root directory over TCP until SIGINT/SIGTERM, then shut down
    /// gracefully (requests already read are answered before connections close). Replicas are
    /// created and deleted by control requests (`wasmcsi volume create|delete`).
    ///
    /// Example:
    ///   wasmcsi replica serve --root /var/lib/wasmcsi/replicas --listen 0.0.0.0:9501
    #[command(verbatim_doc_comment)]
    Serve(ReplicaServeArgs),
    /// List replica servers: capacity, free space and the replicas each holds.
    ///
    /// Example:
    ///   wasmcsi replica nodes --replica 10.0.0.1:9501 --replica 10.0.0.2:9501
    #[command(verbatim_doc_comment)]
    Nodes(NodesArgs),
}

#[derive(Args)]
pub struct ReplicaServeArgs {
    /// Directory holding one subdirectory per replica (created if missing).
    #[arg(long)]
    pub root: PathBuf,
    /// Address to listen on, e.g. 0.0.0.0:9501.
    #[arg(long)]
    pub listen: SocketAddr,
}

#[derive(Args)]
pub struct NodesArgs {
    /// A replica server address; repeat once per server.
    #[arg(long = "replica", required = true)]
    pub replicas: Vec<SocketAddr>,
    #[command(flatten)]
    pub timeout: TimeoutArg,
}

#[derive(Args, Clone, Copy)]
pub struct TimeoutArg {
    /// Deadline of each request to a replica server, in seconds.
    #[arg(long = "timeout", default_value_t = 10)]
    pub secs: u64,
}

impl TimeoutArg {
    pub(crate) fn get(self) -> Duration {
        Duration::from_secs(self.secs.max(1))
    }
}

/// Replicated volumes by hand: create, attach, snapshot, expand, rebuild, clone, delete.
#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Create a volume: an empty replica on each replica server (idempotent).
    ///
    /// Example:
    ///   wasmcsi volume create --volume-id pvc-1 --size 1G --replica 10.0.0.1:9501 --replica 10.0.0.2:9501
    #[command(verbatim_doc_comment)]
    Create(CreateArgs),
    /// Delete a volume's replicas (idempotent; refused by a server while the volume is attached).
    Delete(ReplicasArgs),
    /// Start the engine against the replicas, expose the volume as a loop device (FUSE + loop),
    /// print the device path and replica health, and stay in the foreground, serving the other
    /// `volume` commands on RUNTIME_DIR/VOLUME_ID.ctl. SIGINT/SIGTERM or `volume detach`
    /// detaches cleanly; that is refused, with the mounts named, while the device is mounted.
    ///
    /// Example (two replicas, the first on this node):
    ///   wasmcsi volume attach --volume-id pvc-1 \
    ///     --replica 127.0.0.1:9501 --replica 10.0.0.2:9501 --local 0 \
    ///     --state-dir /var/lib/wasmcsi/engine/pvc-1
    #[command(verbatim_doc_comment)]
    Attach(VolumeAttachArgs),
    /// Detach an attached volume (as SIGINT to its `volume attach` does).
    Detach(OnlineArgs),
    /// Show a volume's replicas and rebuild progress: of the volume attached on this node by
    /// `volume attach`, or, with --replica, as the replica nodes and the engine running it
    /// (wherever that is) say — the way to look at a volume staged through CSI.
    ///
    /// Example (a volume staged by the node plugins; name every replica node):
    ///   wasmcsi volume status --volume-id pvc-1 --replica 10.0.0.1:9501 --replica 10.0.0.2:9501
    #[command(verbatim_doc_comment)]
    Status(StatusArgs),
    /// Take a crash-consistent snapshot on every replica (through the engine when attached).
    Snapshot(SnapshotArgs),
    /// List a volume's snapshots.
    Snapshots(TargetArgs),
    /// Delete a snapshot (its data folds into its successor).
    DeleteSnapshot(SnapshotArgs),
    /// Revert a detached volume to a snapshot; newer snapshots are dropped.
    Revert(RevertArgs),
    /// Grow a volume; online when attached (the loop device grows; grow the filesystem after).
    Expand(ExpandArgs),
    /// Create a volume as a copy of another volume's snapshot, with a progress bar.
    Clone(CloneArgs),
    /// Follow an attached volume's rebuild with a progress bar until every replica is healthy;
    /// with --replace, first swap a lost replica for a new one on another server (full rebuild).
    Rebuild(RebuildArgs),
    /// Back a snapshot up to a backup target, incrementally to --parent: only the blocks the
    /// replica's layers changed since the parent's snapshot are read.
    ///
    /// Example:
    ///   wasmcsi volume backup --volume-id pvc-1 --replica 10.0.0.1:9501 --replica 10.0.0.2:9501 \
    ///     --snapshot s2 --target /mnt/backups --parent s1
    #[command(verbatim_doc_comment)]
    Backup(crate::backup_cmd::BackupArgs),
    /// List a volume's complete backups on a target, oldest first.
    Backups(crate::backup_cmd::BackupsArgs),
    /// Restore a backup into a file or block device, every chunk checked against its hash.
    ///
    /// Example:
    ///   wasmcsi volume restore s2 --volume-id pvc-1 --target /mnt/backups --to /dev/sdx
    #[command(verbatim_doc_comment)]
    Restore(crate::backup_cmd::RestoreArgs),
}

#[derive(Args)]
pub struct ReplicasArgs {
    /// The volume's id.
    #[arg(long)]
    pub volume_id: String,
    /// A replica server holding the volume; repeat once per replica.
    #[arg(long = "replica", required = true)]
    pub replicas: Vec<SocketAddr>,
    #[command(flatten)]
    pub timeout: TimeoutArg,
}

#[derive(Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub set: ReplicasArgs,
    /// Volume size: bytes, or with a K/M/G/T suffix (powers of 1024), e.g. 512M, 1G.
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub online: OnlineArgs,
    /// Ask these replica nodes instead of this node's control socket; repeat once per node.
    #[arg(long = "replica")]
    pub replicas: Vec<SocketAddr>,
    #[command(flatten)]
    pub timeout: TimeoutArg,
}

#[derive(Args)]
pub struct OnlineArgs {
    /// The attached volume's id.
    #[arg(long)]
    pub volume_id: String,
    /// The runtime directory the volume was attached with.
    #[arg(long, default_value = DEFAULT_RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
}

/// A volume addressed either through its attached engine or, when detached, its replicas.
#[derive(Args)]
pub struct TargetArgs {
    /// The volume's id.
    #[arg(long)]
    pub volume_id: String,
    /// The runtime directory the volume was attached with (when it is attached here).
    #[arg(long, default_value = DEFAULT_RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
    /// The volume's replica servers, used when it is not attached on this node.
    #[arg(long = "replica")]
    pub replicas: Vec<SocketAddr>,
    #[command(flatten)]
    pub timeout: TimeoutArg,
}

#[derive(Args)]
pub struct SnapshotArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Snapshot name.
    #[arg(long)]
    pub name: String,
}

#[derive(Args)]
pub struct RevertArgs {
    #[command(flatten)]
    pub set: ReplicasArgs,
    /// The snapshot to revert to.
    #[arg(long)]
    pub name: String,
    /// The runtime directory the volume would be attached with: a volume attached here is
    /// refused (detach it first).
    #[arg(long, default_value = DEFAULT_RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
}

#[derive(Args)]
pub struct ExpandArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// New size (grow only), e.g. 2G.
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
}

#[derive(Args)]
pub struct CloneArgs {
    /// The new volume.
    #[command(flatten)]
    pub set: ReplicasArgs,
    /// The source volume's id.
    #[arg(long)]
    pub source_volume_id: String,
    /// A replica server of the source volume; repeat once per replica.
    #[arg(long = "source-replica", required = true)]
    pub source_replicas: Vec<SocketAddr>,
    /// The source snapshot.
    #[arg(long)]
    pub snapshot: String,
    /// Size of the new volume (default: the source's).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
}

#[derive(Args)]
pub struct RebuildArgs {
    #[command(flatten)]
    pub online: OnlineArgs,
    /// Index (in the attach's --replica order) of the replica to replace…
    #[arg(long, requires = "with")]
    pub replace: Option<usize>,
    /// …by a new replica on this server (created here if missing).
    #[arg(long)]
    pub with: Option<SocketAddr>,
    /// Give up waiting after this many seconds (the rebuild itself goes on).
    #[arg(long, default_value_t = 3600)]
    pub wait_secs: u64,
}

#[derive(Args)]
pub struct VolumeAttachArgs {
    /// The volume id; every replica must have been created with it.
    #[arg(long)]
    pub volume_id: String,
    /// A replica server address; repeat once per replica.
    #[arg(long = "replica", required = true)]
    pub replicas: Vec<SocketAddr>,
    /// Where the engine persists its state (revision, out-of-sync replicas, dirty maps).
    #[arg(long)]
    pub state_dir: PathBuf,
    /// Where the FUSE mount backing the loop device and the control socket live.
    #[arg(long, default_value = DEFAULT_RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
    /// Index (0-based, in --replica order) of the replica on this node: preferred for reads.
    #[arg(long)]
    pub local: Option<usize>,
    #[command(flatten)]
    pub timeout: TimeoutArg,
}

/// Default home of FUSE mounts and control sockets of attached volumes.
pub const DEFAULT_RUNTIME_DIR: &str = "/run/wasmcsi";

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
        ReplicaCommand::Serve(a) => {
            std::fs::create_dir_all(&a.root).with_context(|| format!("creating {}", a.root.display()))?;
            let server = ReplicaServer::bind_plaintext(a.listen, &a.root)
                .await
                .with_context(|| format!("serving the replicas in {} on {}", a.root.display(), a.listen))?;
            println!("serving replicas in {} on {}", a.root.display(), server.local_addr());
            wait_for_signal().await?;
            tracing::info!("shutting down the replica server");
            server.shutdown().await.context("shutting down the replica server")?;
            println!("replica server stopped");
            Ok(())
        }
        ReplicaCommand::Nodes(a) => {
            let mut failed = 0;
            for (addr, info) in a.replicas.iter().zip(control::list_nodes(&a.replicas, a.timeout.get()).await) {
                match info {
                    Ok(n) => {
                        println!(
                            "{addr}  capacity {} MiB  available {} MiB  replicas {}",
                            n.capacity >> 20,
                            n.available >> 20,
                            n.replicas.len()
                        );
                        for r in n.replicas {
                            println!(
                                "  {}  {} MiB  revision {}  allocated {} MiB{}",
                                r.volume_id,
                                r.size >> 20,
                                r.revision,
                                r.allocated >> 20,
                                if r.dirty { "  (dirty)" } else { "" }
                            );
                        }
                    }
                    Err(e) => {
                        failed += 1;
                        println!("{addr}  unavailable: {e}");
                    }
                }
            }
            if failed > 0 {
                bail!("{failed} replica server(s) did not answer");
            }
            Ok(())
        }
    }
}

pub async fn volume(cmd: VolumeCommand) -> anyhow::Result<()> {
    match cmd {
        VolumeCommand::Create(a) => {
            replica_set(&a.set).create(a.size).await?;
            println!(
                "created volume {} ({} bytes) on {} replica server(s)",
                a.set.volume_id,
                a.size,
                a.set.replicas.len()
            );
            Ok(())
        }
        VolumeCommand::Delete(a) => {
            replica_set(&a).delete().await?;
            println!("deleted volume {}", a.volume_id);
            Ok(())
        }
        VolumeCommand::Attach(a) => attach(a).await,
        VolumeCommand::Detach(a) => {
            online_only(&a, &ctl::Request::Detach).await?;
            println!("detached {}", a.volume_id);
            Ok(())
        }
        VolumeCommand::Status(a) if !a.replicas.is_empty() => set_status(&a).await,
        VolumeCommand::Status(a) => {
            let reply = online_only(&a.online, &ctl::Request::Status).await?;
            let s = reply.status.context("the attached volume sent no status")?;
            println!("{}  {} bytes  {}", s.device.display(), s.size, s);
            if let Some(r) = &s.rebuild {
                println!("rebuilding replica {} ({}): {}/{} bytes", r.replica, r.kind, r.done, r.total);
            }
            Ok(())
        }
        VolumeCommand::Snapshot(a) => {
            let request = ctl::Request::Snapshot { name: a.name.clone() };
            match online(&a.target, &request).await? {
                Some(_) => {}
                None => offline_set(&a.target)?.snapshot(&a.name).await?,
            }
            println!("snapshot {} of {} taken", a.name, a.target.volume_id);
            Ok(())
        }
        VolumeCommand::DeleteSnapshot(a) => {
            let request = ctl::Request::DeleteSnapshot { name: a.name.clone() };
            match online(&a.target, &request).await? {
                Some(_) => {}
                None => offline_set(&a.target)?.delete_snapshot(&a.name).await?,
            }
            println!("snapshot {} of {} deleted", a.name, a.target.volume_id);
            Ok(())
        }
        VolumeCommand::Snapshots(a) => {
            let snapshots: Vec<(String, u64)> = match online(&a, &ctl::Request::Snapshots).await? {
                Some(reply) => reply.snapshots.into_iter().map(|s| (s.name, s.created_ns)).collect(),
                None => offline_set(&a)?.describe().await?.1.into_iter().map(|s| (s.name, s.created_ns)).collect(),
            };
            for (name, created_ns) in snapshots {
                println!("{name}  created {}", format_time(created_ns));
            }
            Ok(())
        }
        VolumeCommand::Revert(a) => {
            if ctl::call(&a.runtime_dir, &a.set.volume_id, &ctl::Request::Status).await?.is_some() {
                bail!("volume {} is attached on this node: detach it before reverting", a.set.volume_id);
            }
            replica_set(&a.set).revert(&a.name).await?;
            println!("volume {} reverted to snapshot {}", a.set.volume_id, a.name);
            Ok(())
        }
        VolumeCommand::Expand(a) => {
            match online(&a.target, &ctl::Request::Expand { size: a.size }).await? {
                Some(reply) => println!(
                    "volume {} expanded online to {} bytes; grow the filesystem on it next",
                    a.target.volume_id,
                    reply.size.unwrap_or(a.size)
                ),
                None => {
                    offline_set(&a.target)?.expand(a.size).await?;
                    println!("volume {} expanded to {} bytes", a.target.volume_id, a.size);
                }
            }
            Ok(())
        }
        VolumeCommand::Clone(a) => clone(a).await,
        VolumeCommand::Rebuild(a) => rebuild(a).await,
        VolumeCommand::Backup(a) => crate::backup_cmd::backup(a).await,
        VolumeCommand::Backups(a) => crate::backup_cmd::list(a).await,
        VolumeCommand::Restore(a) => crate::backup_cmd::restore(a).await,
    }
}

fn replica_set(a: &ReplicasArgs) -> ReplicaSet {
    ReplicaSet::new(a.volume_id.clone(), a.replicas.clone(), a.timeout.get())
}

fn offline_set(a: &TargetArgs) -> anyhow::Result<ReplicaSet> {
    if a.replicas.is_empty() {
        bail!(
            "volume {} is not attached on this node (no {}): name its replica servers with --replica",
            a.volume_id,
            ctl::socket_path(&a.runtime_dir, &a.volume_id).display()
        );
    }
    Ok(ReplicaSet::new(a.volume_id.clone(), a.replicas.clone(), a.timeout.get()))
}

/// Sends `request` to the attached volume, if it is attached here; an error reply is an error.
async fn online(a: &TargetArgs, request: &ctl::Request) -> anyhow::Result<Option<ctl::Reply>> {
    attached_call(&a.runtime_dir, &a.volume_id, request).await
}

async fn online_only(a: &OnlineArgs, request: &ctl::Request) -> anyhow::Result<ctl::Reply> {
    attached_call(&a.runtime_dir, &a.volume_id, request).await?.with_context(|| {
        format!(
            "volume {} is not attached on this node (no {})",
            a.volume_id,
            ctl::socket_path(&a.runtime_dir, &a.volume_id).display()
        )
    })
}

/// One request to the attached volume: `None` when it is not attached here, an error for a
/// refusal.
async fn attached_call(
    runtime_dir: &std::path::Path,
    volume_id: &str,
    request: &ctl::Request,
) -> anyhow::Result<Option<ctl::Reply>> {
    match ctl::call(runtime_dir, volume_id, request).await? {
        Some(reply) if reply.ok => Ok(Some(reply)),
        Some(reply) => bail!("{}", reply.error.unwrap_or_else(|| "the attached volume refused".into())),
        None => Ok(None),
    }
}

async fn clone(a: CloneArgs) -> anyhow::Result<()> {
    let source = ReplicaSet::new(a.source_volume_id.clone(), a.source_replicas.clone(), a.set.timeout.get());
    let size = match a.size {
        Some(s) => s,
        None => source.describe().await.context("reading the source volume")?.0,
    };
    let target = replica_set(&a.set);
    target.create(size).await.context("creating the new volume")?;
    let bar = ctl::Progress::new(&format!("clone {}@{} -> {}", a.source_volume_id, a.snapshot, a.set.volume_id));
    target.clone_from(&source, &a.snapshot, |done, total| bar.update(done, total)).await?;
    bar.finish();
    println!("volume {} ({size} bytes) cloned from {}@{}", a.set.volume_id, a.source_volume_id, a.snapshot);
    Ok(())
}

async fn rebuild(a: RebuildArgs) -> anyhow::Result<()> {
    if let (Some(index), Some(addr)) = (a.replace, a.with) {
        let status = online_only(&a.online, &ctl::Request::Status).await?.status.context("no status")?;
        ReplicaServerClient::new(addr, Duration::from_secs(10))
            .create_replica(&a.online.volume_id, status.size)
            .await
            .with_context(|| format!("creating the new replica on {addr}"))?;
        online_only(&a.online, &ctl::Request::ReplaceReplica { index, addr }).await?;
        println!("replica {index} of {} is now on {addr}; rebuilding", a.online.volume_id);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(a.wait_secs);
    // Drawn from the first rebuild seen: a volume already healthy gets no bar.
    let mut bar: Option<ctl::Progress> = None;
    loop {
        let s = online_only(&a.online, &ctl::Request::Status).await?.status.context("no status")?;
        if let Some(r) = &s.rebuild {
            let label = format!("{} rebuild of replica {}", r.kind, r.replica);
            let bar = bar.get_or_insert_with(|| ctl::Progress::new(&label));
            bar.relabel(&label);
            bar.update(r.done, r.total);
        }
        if s.healthy == s.replicas && s.rebuild.is_none() {
            bar.as_ref().map(ctl::Progress::finish);
            println!("{}: {}", a.online.volume_id, s);
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bar.as_ref().map(ctl::Progress::finish);
            bail!("still rebuilding after {}s: {}", a.wait_secs, s);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `volume status --replica …`: the set as the catalog assembles it from the replica nodes and
/// the engine's own status (which carries the rebuild's progress).
async fn set_status(a: &StatusArgs) -> anyhow::Result<()> {
    use wasmcsi_block::catalog::{Catalog, MemberState, NodeSources};
    let sources = NodeSources { nodes: a.replicas.iter().map(ToString::to_string).collect(), ..Default::default() };
    let id = &a.online.volume_id;
    let view = Catalog::new(sources, a.timeout.get())
        .get(id)
        .await?
        .with_context(|| format!("no replica node of those named holds volume {id}"))?;
    let healthy = view.members.iter().filter(|m| m.state == MemberState::Healthy).count();
    println!(
        "{}  {} bytes  revision {}  {}  {healthy}/{} healthy{}",
        view.id,
        view.size,
        view.revision,
        view.attached_to.as_deref().map_or_else(|| "detached".to_owned(), |n| format!("attached to {n}")),
        view.members.len(),
        if healthy < view.members.len() { " (degraded)" } else { "" }
    );
    for m in &view.members {
        let state = match m.state {
            MemberState::Healthy => "healthy".to_owned(),
            MemberState::Rebuilding => format!("rebuilding: {}/{} bytes", m.rebuilt, m.rebuild_total),
            MemberState::Stale => "stale (waits for a rebuild)".to_owned(),
            MemberState::Unreachable => "unreachable".to_owned(),
        };
        let since = m.down_since_ns.map(|ns| format!(", not healthy since {}", format_time(ns))).unwrap_or_default();
        // A replica is its node and disk: a node may hold several of the set.
        println!("  {}/{}  {state}{since}", m.node, m.disk);
    }
    if let Some((done, total)) = view.filling {
        println!("filling from its source: {done}/{total} bytes");
    }
    Ok(())
}

fn format_time(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    format!("{secs}.{:09}s since the epoch", ns % 1_000_000_000)
}

async fn attach(a: VolumeAttachArgs) -> anyhow::Result<()> {
    let n = a.replicas.len();
    if let Some(l) = a.local
        && l >= n
    {
        bail!("--local {l} is out of range: there are {n} replicas (indices 0..{n})");
    }
    std::fs::create_dir_all(&a.runtime_dir).with_context(|| format!("creating {}", a.runtime_dir.display()))?;
    let (ctl_tx, mut ctl_rx) = tokio::sync::mpsc::channel(16);
    let socket = ctl::socket_path(&a.runtime_dir, &a.volume_id);
    let ctl_server = ctl::serve(socket.clone(), ctl_tx).await?;
    let _socket_guard = RemoveOnDrop(socket);

    // The replica on this node is served by another process (`replica serve`): over TCP.
    let replicas = (a.replicas.iter().enumerate())
        .map(
            |(i, addr)| if a.local == Some(i) { ReplicaEndpoint::Local(*addr) } else { ReplicaEndpoint::Remote(*addr) },
        )
        .collect();
    let mut config = AttachConfig::new(a.volume_id.clone(), replicas, &a.state_dir, &a.runtime_dir);
    config.request_timeout = a.timeout.get();
    let vol = match AttachedVolume::start(config).await {
        Ok(vol) => vol,
        Err(e @ AttachError::NoReplica { .. }) => bail!("{e} (create it with `wasmcsi volume create`)"),
        Err(e) => return Err(e.into()),
    };
    let device = vol.device().to_path_buf();
    println!("{}", device.display());
    let mut last = vol.status();
    println!("replicas: {last}");

    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let (detach, reply_to) = tokio::select! {
            _ = tick.tick() => (false, None),
            _ = sigint.recv() => (true, None),
            _ = sigterm.recv() => (true, None),
            Some((request, reply)) = ctl_rx.recv() => match request {
                ctl::Request::Detach => (true, Some(reply)),
                request => {
                    let _ = reply.send(online_request(&vol, request).await);
                    (false, None)
                }
            },
        };
        let s = vol.status();
        if s.healthy != last.healthy || s.rebuilds_finished != last.rebuilds_finished {
            println!("replicas: {s}");
            last = s;
        }
        if !detach {
            continue;
        }
        // Detached in order: loop device, FUSE server, then the engine flushes and stops.
        match vol.stop().await {
            Ok(()) => {}
            Err(AttachError::InUse(e)) => {
                eprintln!(
                    "wasmcsi: refusing to detach {}: {e}; the volume stays attached, interrupt again after unmounting",
                    device.display()
                );
                if let Some(reply) = reply_to {
                    let _ = reply.send(ctl::Reply::error(format!("refusing to detach: {e}")));
                }
                continue;
            }
            // Torn down all the same; the replicas resync what was in flight at the next attach.
            Err(e @ AttachError::Flush { .. }) => eprintln!("wasmcsi: {e}"),
            Err(e) => return Err(anyhow::Error::new(e).context(format!("detaching {}", device.display()))),
        }
        if let Some(reply) = reply_to {
            let _ = reply.send(ctl::Reply::ok());
        }
        break;
    }
    ctl_server.stop().await;
    println!("detached {}", device.display());
    Ok(())
}

/// Answers a control request of an attached volume (never Detach, which the loop handles).
async fn online_request(vol: &AttachedVolume, request: ctl::Request) -> ctl::Reply {
    let result: Result<ctl::Reply, AttachError> = match request {
        ctl::Request::Status => Ok(ctl::Reply { status: Some(vol.status()), ..ctl::Reply::ok() }),
        ctl::Request::Snapshot { name } => vol.snapshot(&name).await.map(|()| ctl::Reply::ok()),
        ctl::Request::DeleteSnapshot { name } => vol.delete_snapshot(&name).await.map(|()| ctl::Reply::ok()),
        ctl::Request::Snapshots => Ok(ctl::Reply {
            snapshots: vol
                .snapshots()
                .into_iter()
                .map(|s| ctl::SnapshotView { name: s.name, created_ns: s.created_ns })
                .collect(),
            ..ctl::Reply::ok()
        }),
        ctl::Request::Expand { size } => {
            vol.expand(size).await.map(|size| ctl::Reply { size: Some(size), ..ctl::Reply::ok() })
        }
        ctl::Request::ReplaceReplica { index, addr } => {
            vol.replace_replica(index, addr, DEFAULT_DISK).await.map(|()| ctl::Reply::ok())
        }
        ctl::Request::Detach => return ctl::Reply::error("detach is handled by the attach loop"),
    };
    result.unwrap_or_else(|e| ctl::Reply::error(online_error(e)))
}

/// What the control socket answers for a failed operation: the engine's or frontend's own
/// words, as before the attach moved into `wasmcsi_datapath::attach`.
fn online_error(e: AttachError) -> String {
    match e {
        AttachError::Io { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
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
