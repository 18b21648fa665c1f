//! Backups of replicated volumes to the operator's backup targets, run by the host for the
//! `backup` capability, and restores into new replica sets for the catalog
//! ([`wasmcsi_block::catalog::Restorer`]).
//!
//! - [`Backups`] is one per host, shared by every backend and by every version of a backend
//!   across hot reloads: it holds the configured targets (`[backup_targets.NAME]`), the backups
//!   running now, and the credentials a call's secrets brought for a target.
//! - A backup is a job in this process: `start` answers at once (in progress, with its
//!   progress), the job reads the snapshot from one healthy replica ([`ReplicaSnapshot`]) and
//!   writes chunks, then the manifest. A backup exists on the target exactly when its manifest
//!   does, so a crash of this process mid-backup leaves nothing listed: the next `start` of the
//!   same name (the CO retries CreateSnapshot until it is ready) begins again and reuses the
//!   chunks already uploaded.
//! - Each backup is incremental against the newest complete backup of the volume on the target:
//!   what changed since that backup's snapshot comes from the replica's layer chain.
//! - At most [`MAX_RUNNING`] backups move data at once per host; the rest wait their turn, in
//!   progress at 0 bytes.
//! - Credentials: a target's configured ones, replaced by those a call's secrets carry
//!   (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, Longhorn's names). The
//!   last ones that worked for a target are kept in memory for the work no call carries secrets
//!   for (a restore a CreateVolume started, the collection after a delete), never on disk.

mod replica_sink;
mod replica_source;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Semaphore;
use wasmcsi_backup::{
    BackupOptions, BackupRequest, BackupStore, BackupTargets, CancellationToken, Error as StoreError, ErrorKind,
    Progress, ProgressSnapshot, RestoreOptions, S3Credentials, StoreOptions,
};
use wasmcsi_block::catalog::{Catalog, RestoreInto, RestoreProgress, Restorer};

pub use replica_sink::ReplicaSink;
pub use replica_source::{ReplicaSnapshot, ReplicaSourceError};

/// The host's id of backup `name` of `volume`, as the `backup` capability names it:
/// `VOLUME/NAME` (a backup's name is unique per volume and target, not across volumes).
pub fn backup_id(volume: &str, name: &str) -> String {
    format!("{volume}/{name}")
}

/// `(volume, name)` of a [`backup_id`] (the name has no `/`, a volume id may).
pub fn parse_backup_id(id: &str) -> Option<(&str, &str)> {
    id.rsplit_once('/').filter(|(volume, name)| !volume.is_empty() && !name.is_empty())
}

/// Backups moving data at once in one host: each holds `uploads_in_flight` chunk buffers
/// (~40 MiB at 8 × 2 MiB) and a replica's read bandwidth.
pub const MAX_RUNNING: usize = 2;

/// Requests to the replica a backup reads at once.
const READS_IN_FLIGHT: usize = 8;

/// Why a backup operation failed, classified for the caller's error codes.
#[derive(Debug, thiserror::Error)]
pub enum BackupsError {
    #[error("backup target {0:?} is not configured on this host (add [backup_targets.NAME])")]
    UnknownTarget(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Where one backup stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackupState {
    InProgress,
    Ready,
    Failed(String),
}

/// One backup as the `backup` capability reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupStatus {
    pub volume: String,
    pub backup: String,
    pub snapshot: String,
    pub size: u64,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    pub state: BackupState,
    /// Volume bytes done (read, skipped as unchanged or holes) and to do.
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// A backup running (or just failed) in this process.
struct Job {
    snapshot: String,
    size: u64,
    created_ms: u64,
    progress: Arc<Progress>,
    cancel: CancellationToken,
    /// `Some` once the job failed: reported once, then the job is forgotten so a retry starts
    /// it again.
    failed: Mutex<Option<String>>,
}

impl Job {
    fn status(&self, volume: &str, backup: &str) -> BackupStatus {
        let p = self.progress.snapshot();
        let failed = self.failed.lock().unwrap_or_else(PoisonError::into_inner).clone();
        BackupStatus {
            volume: volume.to_owned(),
            backup: backup.to_owned(),
            snapshot: self.snapshot.clone(),
            size: self.size,
            created_ms: self.created_ms,
            state: failed.map_or(BackupState::InProgress, BackupState::Failed),
            done_bytes: done(&p),
            total_bytes: p.total_bytes.max(self.size),
        }
    }
}

fn done(p: &ProgressSnapshot) -> u64 {
    (p.read_bytes + p.skipped_bytes).min(p.total_bytes)
}

/// `(target, volume, backup)`.
type JobKey = (String, String, String);

/// The host's backups: configured targets, running jobs, remembered credentials.
pub struct Backups {
    /// The configured targets: replaced whole when the host configuration changes.
    targets: RwLock<BackupTargets>,
    jobs: Mutex<HashMap<JobKey, Arc<Job>>>,
    remembered: Mutex<HashMap<String, S3Credentials>>,
    running: Arc<Semaphore>,
    options: BackupOptions,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Backups {
    pub fn new(targets: BackupTargets) -> Self {
        Self {
            targets: RwLock::new(targets),
            jobs: Mutex::default(),
            remembered: Mutex::default(),
            running: Arc::new(Semaphore::new(MAX_RUNNING)),
            options: BackupOptions::default(),
        }
    }

    /// Puts `targets` in force (a changed host configuration); running backups keep theirs.
    pub fn configure(&self, targets: BackupTargets) {
        *self.targets.write().unwrap_or_else(PoisonError::into_inner) = targets;
    }

    /// The names of the configured targets.
    pub fn names(&self) -> Vec<String> {
        self.targets.read().unwrap_or_else(PoisonError::into_inner).names().map(str::to_owned).collect()
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<JobKey, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store of `target`, with `credentials` if given, else the last that worked, else the
    /// configured ones.
    fn store(&self, target: &str, credentials: Option<S3Credentials>) -> Result<BackupStore, BackupsError> {
        let targets = self.targets.read().unwrap_or_else(PoisonError::into_inner);
        if !targets.names().any(|n| n == target) {
            return Err(BackupsError::UnknownTarget(target.to_owned()));
        }
        let credentials =
            credentials.or_else(|| self.remembered.lock().unwrap_or_else(PoisonError::into_inner).get(target).cloned());
        let opened = targets.open(target, credentials)?;
        Ok(BackupStore::new(opened, StoreOptions::default()))
    }

    /// Keeps `credentials` for `target` once a call with them succeeded.
    fn remember(&self, target: &str, credentials: Option<S3Credentials>) {
        if let Some(c) = credentials {
            self.remembered.lock().unwrap_or_else(PoisonError::into_inner).insert(target.to_owned(), c);
        }
    }

    /// The complete backup `backup` of `volume`, if its manifest is there.
    async fn complete(store: &BackupStore, volume: &str, backup: &str) -> Result<Option<BackupStatus>, BackupsError> {
        match store.manifest(volume, backup).await {
            Ok(m) => Ok(Some(BackupStatus {
                volume: m.volume,
                backup: m.backup,
                snapshot: m.snapshot.unwrap_or_default(),
                size: m.size,
                created_ms: m.created_ms,
                state: BackupState::Ready,
                done_bytes: m.size,
                total_bytes: m.size,
            })),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The job of `key`; a failed one is reported once and forgotten.
    fn job_status(&self, key: &JobKey) -> Option<BackupStatus> {
        let mut jobs = self.jobs();
        let status = jobs.get(key)?.status(&key.1, &key.2);
        if matches!(status.state, BackupState::Failed(_)) {
            jobs.remove(key);
        }
        Some(status)
    }

    /// Starts backup `backup` of snapshot `snapshot` of set `volume` (through `catalog`) to
    /// `target`, or reports on it: idempotent by name (see the module docs).
    #[tracing::instrument(name = "backups.start", skip(self, catalog, credentials))]
    pub async fn start(
        self: &Arc<Self>,
        catalog: &Catalog,
        target: &str,
        volume: &str,
        snapshot: &str,
        backup: &str,
        credentials: Option<S3Credentials>,
    ) -> Result<BackupStatus, BackupsError> {
        let store = self.store(target, credentials.clone())?;
        let key: JobKey = (target.to_owned(), volume.to_owned(), backup.to_owned());
        if let Some(status) = self.job_status(&key) {
            return Ok(status);
        }
        if let Some(done) = Self::complete(&store, volume, backup).await? {
            self.remember(target, credentials);
            if done.snapshot != snapshot {
                return Err(BackupsError::AlreadyExists(format!(
                    "backup {backup} of {volume} on {target} is of snapshot {:?}, not {snapshot:?}",
                    done.snapshot
                )));
            }
            return Ok(done);
        }
        let (view, replicas) = catalog
            .healthy_replicas(volume)
            .await
            .map_err(|e| BackupsError::Unavailable(e.to_string()))?
            .ok_or_else(|| BackupsError::NotFound(format!("volume {volume} not found")))?;
        if !view.snapshots.iter().any(|s| s.name == snapshot) {
            return Err(BackupsError::NotFound(format!("volume {volume} has no snapshot {snapshot:?}")));
        }
        if replicas.is_empty() {
            return Err(BackupsError::Unavailable(format!("no healthy replica of {volume} answers")));
        }
        // Incremental against the newest complete backup (the check of the target also proves
        // the credentials before a job is started on them).
        let parent = store.list_backups(volume).await?.pop().map(|b| b.backup);
        self.remember(target, credentials);
        let job = Arc::new(Job {
            snapshot: snapshot.to_owned(),
            size: view.size,
            created_ms: now_ms(),
            progress: Arc::new(Progress::default()),
            cancel: CancellationToken::new(),
            failed: Mutex::new(None),
        });
        {
            let mut jobs = self.jobs();
            if let Some(running) = jobs.get(&key) {
                // Another call started it meanwhile.
                return Ok(running.status(volume, backup));
            }
            jobs.insert(key.clone(), Arc::clone(&job));
        }
        let status = job.status(volume, backup);
        let this = Arc::clone(self);
        let (reach, timeout) = (catalog.reach().clone(), catalog.timeout());
        let span = tracing::info_span!("backup", %target, %volume, %snapshot, %backup, parent = ?parent);
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let result = async {
                    let _turn = this.running.acquire().await.map_err(|_| BackupsError::Unavailable("closed".into()))?;
                    let source =
                        ReplicaSnapshot::open(&key.1, &job.snapshot, &replicas, timeout, reach, READS_IN_FLIGHT)
                            .await
                            .map_err(|e| BackupsError::Unavailable(e.to_string()))?;
                    let source = Arc::new(source);
                    let request = BackupRequest {
                        volume: &key.1,
                        backup: &key.2,
                        parent: parent.as_deref(),
                        snapshot: Some(&job.snapshot),
                    };
                    let result = store
                        .backup(request, source.clone(), &this.options, Arc::clone(&job.progress), &job.cancel)
                        .await;
                    source.close().await;
                    result.map_err(BackupsError::from)
                }
                .await;
                match result {
                    Ok(m) => {
                        tracing::info!(uploaded = m.stats.uploaded_bytes, read = m.stats.read_bytes, "backup ready");
                        this.jobs().remove(&key);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "backup failed");
                        *job.failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.to_string());
                    }
                }
            },
            span,
        ));
        Ok(status)
    }

    /// Backup `backup` of `volume` on `target`: running, failed (reported once), complete, or
    /// `None`.
    #[tracing::instrument(name = "backups.get", skip(self, credentials))]
    pub async fn get(
        &self,
        target: &str,
        volume: &str,
        backup: &str,
        credentials: Option<S3Credentials>,
    ) -> Result<Option<BackupStatus>, BackupsError> {
        let store = self.store(target, credentials.clone())?;
        if let Some(status) = self.job_status(&(target.to_owned(), volume.to_owned(), backup.to_owned())) {
            return Ok(Some(status));
        }
        let found = Self::complete(&store, volume, backup).await?;
        self.remember(target, credentials);
        Ok(found)
    }

    /// The backups on `target` of `volume` (or of every volume there), complete ones and those
    /// running here, ordered by `(volume, backup)`. Reads each volume's own manifests, never
    /// the whole target.
    #[tracing::instrument(name = "backups.list", skip(self, credentials))]
    pub async fn list(
        &self,
        target: &str,
        volume: Option<&str>,
        credentials: Option<S3Credentials>,
    ) -> Result<Vec<BackupStatus>, BackupsError> {
        let store = self.store(target, credentials.clone())?;
        let volumes = match volume {
            Some(v) => vec![v.to_owned()],
            None => store.volumes().await?,
        };
        let mut out: Vec<BackupStatus> = Vec::new();
        for v in &volumes {
            for b in store.list_backups(v).await? {
                out.push(BackupStatus {
                    volume: b.volume,
                    backup: b.backup,
                    snapshot: b.snapshot.unwrap_or_default(),
                    size: b.size,
                    created_ms: b.created_ms,
                    state: BackupState::Ready,
                    done_bytes: b.size,
                    total_bytes: b.size,
                });
            }
        }
        self.remember(target, credentials);
        let running: Vec<BackupStatus> = self
            .jobs()
            .iter()
            .filter(|((t, v, _), _)| t == target && volume.is_none_or(|want| want == v))
            .map(|((_, v, b), job)| job.status(v, b))
            .collect();
        for r in running {
            if !out.iter().any(|o| o.volume == r.volume && o.backup == r.backup) {
                out.push(r);
            }
        }
        out.sort_by(|a, b| (&a.volume, &a.backup).cmp(&(&b.volume, &b.backup)));
        Ok(out)
    }

    /// Deletes backup `backup` of `volume` on `target` (a running one is cancelled first), then
    /// collects the volume's chunks no backup uses any more, in the background.
    #[tracing::instrument(name = "backups.delete", skip(self, credentials))]
    pub async fn delete(
        self: &Arc<Self>,
        target: &str,
        volume: &str,
        backup: &str,
        credentials: Option<S3Credentials>,
    ) -> Result<(), BackupsError> {
        let store = self.store(target, credentials.clone())?;
        if let Some(job) = self.jobs().remove(&(target.to_owned(), volume.to_owned(), backup.to_owned())) {
            job.cancel.cancel();
        }
        store.delete_backup(volume, backup).await?;
        self.remember(target, credentials);
        let volume = volume.to_owned();
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                match store.collect_garbage(&volume).await {
                    Ok(report) => tracing::info!(?report, "chunks collected"),
                    // A backup running on the volume: the next delete collects.
                    Err(e) => tracing::info!(error = %e, "no collection now"),
                }
            },
            tracing::info_span!("backup.collect", %target),
        ));
        Ok(())
    }
}

impl Restorer for Backups {
    fn restore(
        &self,
        target: String,
        volume: String,
        backup: String,
        into: RestoreInto,
        progress: RestoreProgress,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>> {
        let store = self.store(&target, None);
        Box::pin(async move {
            let store = store.map_err(|e| e.to_string())?;
            let counted = Arc::new(Progress::default());
            let sink = Arc::new(ReplicaSink::open(&into).await.map_err(|e| e.to_string())?);
            let ticker = {
                let (counted, progress) = (Arc::clone(&counted), Arc::clone(&progress));
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        let p = counted.snapshot();
                        progress(done(&p), p.total_bytes);
                    }
                })
            };
            let result = store
                .restore(
                    &volume,
                    &backup,
                    sink.clone(),
                    &RestoreOptions::default(),
                    Arc::clone(&counted),
                    &CancellationToken::new(),
                )
                .await;
            ticker.abort();
            let closed = sink.close().await;
            let m = result.map_err(|e| e.to_string())?;
            closed.map_err(|e| format!("closing the restored replicas: {e}"))?;
            progress(m.size, m.size);
            Ok(())
        })
    }
}
