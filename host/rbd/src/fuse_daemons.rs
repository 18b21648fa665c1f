//! rbd-fuse daemons kept by one long-lived process for many volumes: the node's data path
//! (`wasmcsi datapath`), so that a restart of the CSI plugin, which in a pod kills every process
//! of its container, does not take the daemons (and the loop devices and filesystems above
//! them) with it.
//!
//! Each attachment is one directory `<root>/<volume>/` (0700): rbd-fuse's mount point, its
//! private directory (conf, keyring, log; [`fuse_attach`]) and `record.json`, written once the
//! image file is there. The records are the truth: [`FuseDaemons::open`] reads them, so a
//! process that replaced its image by `execve` (a live upgrade: same pid, the daemons still its
//! children) or restarted after a crash finds every daemon again. A daemon that still runs is
//! adopted (a thread waits for it, so it never lingers as a zombie once it exits); one that died
//! stays listed as not alive until it is detached, which cleans up what it left.
//!
//! What a caller can make it do is bounded: the request names a volume id, a pool, an image,
//! monitors, a cephx user and key, and a size, all checked; every path is chosen here under the
//! root, and rbd-fuse's argv is fixed ([`fuse_attach`]). It does not serialize calls per volume:
//! the caller does (the data path's per-volume guard).

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::RbdCredentials;
use crate::fuse_attach::{self, FuseAttachError, FuseAttachRequest, FuseRecord};

/// Attachments one process keeps at most: far more than a node stages; a bound on what a
/// caller can make it spawn.
pub const MAX_ATTACHMENTS: usize = 512;
const RECORD: &str = "record.json";
const PRIVATE: &str = "private";

/// One attachment to make.
#[derive(Clone, Debug)]
pub struct DaemonSpec {
    /// The volume it serves: the key, and the name of its directory.
    pub volume: String,
    pub monitors: Vec<String>,
    pub pool: String,
    pub image: String,
    pub creds: RbdCredentials,
    /// The image's size: the attach is complete when the file shows it.
    pub size_bytes: u64,
}

/// `record.json`: what the daemon serves and how to tear it down.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonRecord {
    pub volume: String,
    pub pool: String,
    pub image: String,
    pub fuse: FuseRecord,
}

/// A recorded attachment and whether its daemon runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonState {
    pub record: DaemonRecord,
    pub alive: bool,
}

/// The rbd-fuse daemons of one process (see the module docs).
#[derive(Debug)]
pub struct FuseDaemons {
    root: PathBuf,
    timeout: Duration,
    records: Mutex<BTreeMap<String, DaemonRecord>>,
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> FuseAttachError {
    let context = context.into();
    move |source| FuseAttachError::Io { context, source }
}

/// A volume id as one path component: `[A-Za-z0-9._:-]`, at most 200 bytes, not `.`/`..`.
fn check_volume(volume: &str) -> Result<(), FuseAttachError> {
    let ok = !volume.is_empty()
        && volume.len() <= crate::MAX_NAME
        && volume != "."
        && volume != ".."
        && volume.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'));
    if ok { Ok(()) } else { Err(FuseAttachError::InvalidArgument(format!("{volume:?} is not a volume id"))) }
}

/// Waits for `pid` in a thread of its own, so that the daemon is reaped as soon as it exits.
/// A pid that is not this process's child (adopted after a crash of the previous process: init
/// reaps it) ends the thread at once.
fn reap(pid: u32) {
    let Ok(raw) = i32::try_from(pid) else { return };
    let spawned = std::thread::Builder::new().name("rbd-fuse-reaper".into()).spawn(move || {
        loop {
            match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(raw), None) {
                Err(nix::errno::Errno::EINTR) => continue,
                Ok(nix::sys::wait::WaitStatus::Exited(..) | nix::sys::wait::WaitStatus::Signaled(..)) | Err(_) => {
                    return;
                }
                Ok(_) => continue,
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(pid, error = %e, "no reaper thread for rbd-fuse; it stays a zombie after it exits");
    }
}

impl FuseDaemons {
    /// Opens `root` (created 0700) and adopts every recorded daemon. `timeout` bounds an
    /// attach and each teardown step.
    #[tracing::instrument(name = "rbd.fuse_daemons_open", skip_all, fields(root = %root.display()))]
    pub fn open(root: &Path, timeout: Duration) -> Result<Self, FuseAttachError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(io(format!("creating {}", root.display())))?;
        let mut records = BTreeMap::new();
        for entry in std::fs::read_dir(root).map_err(io(format!("reading {}", root.display())))? {
            let entry = entry.map_err(io(format!("reading {}", root.display())))?;
            let path = entry.path().join(RECORD);
            let record: DaemonRecord = match std::fs::read(&path) {
                Ok(bytes) => match serde_json::from_slice(&bytes) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(path = %path.display(), error = %e, "unreadable rbd-fuse record; left alone");
                        continue;
                    }
                },
                // A directory without a record: an attach cut short; the next attach of the
                // volume cleans it.
                Err(_) => continue,
            };
            if entry.file_name().to_str() != Some(record.volume.as_str()) {
                tracing::error!(path = %path.display(), "rbd-fuse record of another volume; left alone");
                continue;
            }
            let alive = fuse_attach::is_alive(&record.fuse);
            if alive {
                reap(record.fuse.pid);
            }
            tracing::info!(volume.id = %record.volume, pid = record.fuse.pid, alive, "rbd-fuse adopted");
            records.insert(record.volume.clone(), record);
        }
        Ok(Self { root: root.to_owned(), timeout, records: Mutex::new(records) })
    }

    fn dir(&self, volume: &str) -> PathBuf {
        self.root.join(volume)
    }

    fn record(&self, volume: &str) -> Option<DaemonRecord> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).get(volume).cloned()
    }

    /// Starts rbd-fuse for `spec` and waits until the image file is there; the running one when
    /// the volume has it already (same pool and image). A dead one is cleaned up first.
    #[tracing::instrument(name = "rbd.fuse_daemons_attach", skip_all, fields(volume.id = %spec.volume, pool = %spec.pool, image = %spec.image))]
    pub fn attach(&self, spec: &DaemonSpec) -> Result<DaemonState, FuseAttachError> {
        check_volume(&spec.volume)?;
        if let Some(record) = self.record(&spec.volume) {
            if (&record.pool, &record.image) != (&spec.pool, &spec.image) {
                return Err(FuseAttachError::InvalidArgument(format!(
                    "volume {} has rbd-fuse for {}/{} already",
                    spec.volume, record.pool, record.image
                )));
            }
            if fuse_attach::is_alive(&record.fuse) {
                return Ok(DaemonState { record, alive: true });
            }
            self.detach(&spec.volume)?;
        }
        if self.records.lock().unwrap_or_else(PoisonError::into_inner).len() >= MAX_ATTACHMENTS {
            return Err(FuseAttachError::InvalidArgument(format!(
                "{MAX_ATTACHMENTS} rbd-fuse attachments run already"
            )));
        }
        let dir = self.dir(&spec.volume);
        // What an attach cut short left (no record): a mount point, maybe still mounted by a
        // daemon that unmounting ends, and the private directory.
        if dir.exists() {
            self.clean_unrecorded(&dir)?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let attached = fuse_attach::attach(&FuseAttachRequest {
            monitors: spec.monitors.clone(),
            pool: spec.pool.clone(),
            image: spec.image.clone(),
            creds: spec.creds.clone(),
            size_bytes: spec.size_bytes,
            runtime_dir: dir.clone(),
            timeout: self.timeout,
            private_dir: Some(dir.join(PRIVATE)),
        });
        let fuse = match attached.and_then(fuse_attach::FuseAttachment::persist) {
            Ok(fuse) => fuse,
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
        };
        let record =
            DaemonRecord { volume: spec.volume.clone(), pool: spec.pool.clone(), image: spec.image.clone(), fuse };
        let bytes = serde_json::to_vec_pretty(&record).map_err(|e| FuseAttachError::Io {
            context: "encoding the rbd-fuse record".into(),
            source: std::io::Error::other(e),
        })?;
        let tmp = dir.join("record.json.tmp");
        if let Err(e) = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, dir.join(RECORD))) {
            let _ = fuse_attach::detach_recorded(&record.fuse, self.timeout);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(io(format!("writing the record in {}", dir.display()))(e));
        }
        tracing::info!(pid = record.fuse.pid, file = %record.fuse.file.display(), "rbd-fuse attached");
        self.records.lock().unwrap_or_else(PoisonError::into_inner).insert(spec.volume.clone(), record.clone());
        Ok(DaemonState { record, alive: true })
    }

    fn clean_unrecorded(&self, dir: &Path) -> Result<(), FuseAttachError> {
        for entry in std::fs::read_dir(dir).map_err(io(format!("reading {}", dir.display())))?.flatten() {
            let path = entry.path();
            if path.file_name().is_some_and(|n| n.as_encoded_bytes().starts_with(b"rbd-")) {
                let leftover = FuseRecord {
                    pid: 0,
                    file: path.clone(),
                    mount_point: path,
                    connection: None,
                    private_dir: PathBuf::new(),
                };
                fuse_attach::detach_recorded(&leftover, self.timeout)?;
            }
        }
        std::fs::remove_dir_all(dir).map_err(io(format!("removing {}", dir.display())))
    }

    /// Tears the volume's rbd-fuse down (its file must no longer be under a loop device) and
    /// forgets it; absent succeeds.
    #[tracing::instrument(name = "rbd.fuse_daemons_detach", skip(self))]
    pub fn detach(&self, volume: &str) -> Result<(), FuseAttachError> {
        check_volume(volume)?;
        let Some(record) = self.record(volume) else { return Ok(()) };
        fuse_attach::detach_recorded(&record.fuse, self.timeout)?;
        let dir = self.dir(volume);
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io(format!("removing {}", dir.display()))(e));
            }
            _ => {}
        }
        self.records.lock().unwrap_or_else(PoisonError::into_inner).remove(volume);
        tracing::info!(pid = record.fuse.pid, "rbd-fuse detached");
        Ok(())
    }

    /// Every recorded attachment and whether its daemon runs, by volume id.
    pub fn list(&self) -> Vec<DaemonState> {
        let records: Vec<DaemonRecord> =
            self.records.lock().unwrap_or_else(PoisonError::into_inner).values().cloned().collect();
        records
            .into_iter()
            .map(|record| {
                let alive = fuse_attach::is_alive(&record.fuse);
                DaemonState { record, alive }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn a_volume_id_is_one_plain_path_component() {
        for ok in ["ceph-rbd-shim:pvc-1", "a.b_c-d:e", "v"] {
            assert!(check_volume(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "../x", "a b", "a\nb", &"x".repeat(201)] {
            assert!(check_volume(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn open_adopts_records_and_lists_a_dead_daemon_as_not_alive() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ceph:v1");
        std::fs::create_dir(&dir).unwrap();
        let record = DaemonRecord {
            volume: "ceph:v1".into(),
            pool: "p".into(),
            image: "i".into(),
            fuse: FuseRecord {
                // No rbd-fuse runs as this pid with this mount point.
                pid: std::process::id(),
                mount_point: dir.join("rbd-p-i.1.0"),
                file: dir.join("rbd-p-i.1.0/i"),
                connection: None,
                private_dir: dir.join(PRIVATE),
            },
        };
        std::fs::write(dir.join(RECORD), serde_json::to_vec(&record).unwrap()).unwrap();
        // A record under another volume's name is not adopted.
        let other = root.path().join("ceph:v2");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join(RECORD), serde_json::to_vec(&record).unwrap()).unwrap();
        let daemons = FuseDaemons::open(root.path(), Duration::from_secs(1)).unwrap();
        assert_eq!(daemons.list(), vec![DaemonState { record, alive: false }]);
        // Detach of the dead one cleans its directory; then it is gone, and again succeeds.
        daemons.detach("ceph:v1").unwrap();
        assert!(!dir.exists());
        assert!(daemons.list().is_empty());
        daemons.detach("ceph:v1").unwrap();
        assert!(matches!(daemons.detach("../x"), Err(FuseAttachError::InvalidArgument(_))));
    }
}
