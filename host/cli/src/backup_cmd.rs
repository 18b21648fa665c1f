//! `wasmcsi volume backup|backups|restore`: a replicated volume's snapshot backed up by hand to a
//! backup target (`wasmcsi_backup`), incrementally from the replicas' layer chain
//! ([`wasmcsi_runtime::backups::ReplicaSnapshot`]), and a backup restored into a file or block device.
//!
//! A target is named by a path: a directory is a filesystem target; a file is one target's TOML
//! table (`kind = "filesystem"` with `path`, or `kind = "s3"` with `endpoint`, `bucket`, and
//! the credentials), as in the host configuration's `[backup_targets.NAME]`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Args;
use wasmcsi_backup::{
    BackupOptions, BackupRequest, BackupStore, CancellationToken, FileSink, Progress, RestoreOptions, StoreOptions,
    TargetConfig,
};
use wasmcsi_block::control::Reach;

use crate::block_cmd::TimeoutArg;
use wasmcsi_runtime::backups::ReplicaSnapshot;

#[derive(Args)]
pub struct TargetPath {
    /// The backup target: a directory, or a file holding one target's TOML (`kind = "s3"`, …).
    #[arg(long = "target")]
    pub target: PathBuf,
}

#[derive(Args)]
pub struct BackupArgs {
    /// The volume's id.
    #[arg(long)]
    pub volume_id: String,
    /// A replica server holding the volume; repeat once per replica (one that holds the
    /// snapshot, at the highest revision, is read).
    #[arg(long = "replica", required = true)]
    pub replicas: Vec<SocketAddr>,
    /// The snapshot to back up (take it first with `volume snapshot`).
    #[arg(long)]
    pub snapshot: String,
    #[command(flatten)]
    pub target: TargetPath,
    /// The backup this one is incremental to: only what changed since its snapshot is read.
    #[arg(long)]
    pub parent: Option<String>,
    /// The new backup's id (default: the snapshot's name). Retrying with the same id resumes.
    #[arg(long)]
    pub backup_id: Option<String>,
    /// Chunks read, compressed and uploaded at once (and requests to the replica at once).
    #[arg(long, default_value_t = 8)]
    pub in_flight: usize,
    #[command(flatten)]
    pub timeout: TimeoutArg,
}

#[derive(Args)]
pub struct BackupsArgs {
    /// The volume's id.
    #[arg(long)]
    pub volume_id: String,
    #[command(flatten)]
    pub target: TargetPath,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// The backup's id.
    pub backup: String,
    /// The volume it is a backup of.
    #[arg(long)]
    pub volume_id: String,
    #[command(flatten)]
    pub target: TargetPath,
    /// Where to restore: a file (created or replaced, sparse) or a block device at least the
    /// backup's size.
    #[arg(long)]
    pub to: PathBuf,
    /// Chunks downloaded, checked and written at once.
    #[arg(long, default_value_t = 8)]
    pub in_flight: usize,
}

fn open_store(path: &Path) -> anyhow::Result<BackupStore> {
    let meta = std::fs::metadata(path).with_context(|| format!("backup target {}", path.display()))?;
    let config = if meta.is_dir() {
        TargetConfig::Filesystem(wasmcsi_backup::FsConfig { path: path.to_owned() })
    } else {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("backup target {}", path.display()))?
    };
    let target = config.open(&path.display().to_string(), None)?;
    Ok(BackupStore::new(target, StoreOptions::default()))
}

pub async fn backup(a: BackupArgs) -> anyhow::Result<()> {
    let id = a.backup_id.clone().unwrap_or_else(|| a.snapshot.clone());
    let store = open_store(&a.target.target)?;
    let in_flight = a.in_flight.max(1);
    // By hand, a replica is on its server's default disk.
    let replicas: Vec<(SocketAddr, String)> =
        a.replicas.iter().map(|r| (*r, wasmcsi_block::protocol::DEFAULT_DISK.to_owned())).collect();
    let source =
        ReplicaSnapshot::open(&a.volume_id, &a.snapshot, &replicas, a.timeout.get(), Reach::plaintext(), in_flight)
            .await?;
    let source = Arc::new(source);
    let replica = source.replica();
    let progress = Arc::new(Progress::default());
    let bar = Arc::new(crate::block_ctl::Progress::new(&format!("backup {}@{} -> {id}", a.volume_id, a.snapshot)));
    let ticker = {
        let progress = Arc::clone(&progress);
        let bar = Arc::clone(&bar);
        tokio::spawn(async move {
            loop {
                let p = progress.snapshot();
                bar.update(p.read_bytes + p.skipped_bytes, p.total_bytes);
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        })
    };
    let request =
        BackupRequest { volume: &a.volume_id, backup: &id, parent: a.parent.as_deref(), snapshot: Some(&a.snapshot) };
    let options = BackupOptions { uploads_in_flight: in_flight, ..BackupOptions::default() };
    let result = store
        .backup(
            request,
            Arc::clone(&source) as Arc<dyn wasmcsi_backup::Source>,
            &options,
            Arc::clone(&progress),
            &CancellationToken::new(),
        )
        .await;
    ticker.abort();
    source.close().await;
    let manifest = result?;
    bar.finish();
    let p = progress.snapshot();
    println!(
        "backup {id} of {}@{} complete ({} bytes, parent {}, read from {replica})",
        a.volume_id,
        a.snapshot,
        manifest.size,
        a.parent.as_deref().unwrap_or("none")
    );
    println!(
        "read {} bytes, uploaded {} bytes in {} chunks, skipped {} bytes",
        manifest.stats.read_bytes, manifest.stats.uploaded_bytes, manifest.stats.uploaded_chunks, p.skipped_bytes
    );
    Ok(())
}

pub async fn list(a: BackupsArgs) -> anyhow::Result<()> {
    let store = open_store(&a.target.target)?;
    for b in store.list_backups(&a.volume_id).await? {
        println!(
            "{}  snapshot {}  parent {}  {} bytes  {} data chunks",
            b.backup,
            b.snapshot.as_deref().unwrap_or("-"),
            b.parent.as_deref().unwrap_or("-"),
            b.size,
            b.data_chunks
        );
    }
    Ok(())
}

pub async fn restore(a: RestoreArgs) -> anyhow::Result<()> {
    let store = open_store(&a.target.target)?;
    let manifest = store.manifest(&a.volume_id, &a.backup).await?;
    if a.to.exists() && !std::fs::metadata(&a.to)?.is_file() && !is_block_device(&a.to)? {
        bail!("{} is neither a file nor a block device", a.to.display());
    }
    let sink = FileSink::create(&a.to, manifest.size).with_context(|| format!("opening {}", a.to.display()))?;
    let sink: Arc<dyn wasmcsi_backup::Sink> = Arc::new(sink);
    let progress = Arc::new(Progress::default());
    let options = RestoreOptions { downloads_in_flight: a.in_flight.max(1) };
    store.restore(&a.volume_id, &a.backup, sink, &options, Arc::clone(&progress), &CancellationToken::new()).await?;
    let p = progress.snapshot();
    println!(
        "restored backup {} of {} ({} bytes) into {}: downloaded {} bytes",
        a.backup,
        a.volume_id,
        manifest.size,
        a.to.display(),
        p.transferred_bytes
    );
    Ok(())
}

fn is_block_device(path: &Path) -> anyhow::Result<bool> {
    use std::os::unix::fs::FileTypeExt as _;
    Ok(std::fs::metadata(path)?.file_type().is_block_device())
}
