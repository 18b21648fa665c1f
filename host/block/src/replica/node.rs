//! `ReplicaNode`: every replica a node holds, one directory per volume under a root
//! (`root/<dir name for the volume id>/`), looked up by volume id. It owns creating and deleting
//! replicas, the per-replica session state the server's dirty-flag and `Busy` rules need, and the
//! node's capacity report; it does not own sockets (that is `server`) or the on-disk layout of one
//! replica (that is `store`).
//!
//! Directory names are an injective encoding of the volume id: the id itself when it matches
//! `[A-Za-z0-9_.-]{1,200}` and does not start with `.`; otherwise `~` and the lowercase hex of
//! its UTF-8 bytes, for ids of at most 100 bytes (so the name stays under the usual 255-byte
//! limit). `~` is not in the plain alphabet, so the two forms never collide; longer unsafe ids are
//! refused (`Invalid`). Names starting with `.` are the node's own (`.deleting-*`, removed at open).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use thiserror::Error;

use super::error::StoreError;
use super::header_file::{self, HEADER_FILE};
use super::record::{RecordCell, RecordRefusal};
use super::store::{ReplicaStore, lock};
use crate::protocol::{RecordInfo, ReplicaHeader, ReplicaSummary, Status};

const MAX_PLAIN_ID: usize = 200;
const MAX_HEX_ID: usize = 100;
const DELETING_PREFIX: &str = ".deleting-";

#[derive(Debug, Error)]
pub enum NodeError {
    #[error("replica of volume {volume_id:?}: {source}")]
    Store { volume_id: String, source: StoreError },
    #[error("volume id {0:?} cannot name a replica directory (empty, or longer than the encoding allows)")]
    InvalidId(String),
    #[error("no replica of volume {0:?} on this node")]
    NotFound(String),
    #[error("replica of volume {volume_id:?} already exists with {size} bytes")]
    AlreadyExists { volume_id: String, size: u64 },
    #[error("replica of volume {0:?} is open by an engine")]
    Busy(String),
    #[error("replica of volume {volume_id:?} could not be opened: {what}")]
    Broken { volume_id: String, what: String },
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{0} holds a replica itself; the node server needs the directory above replica directories")]
    NotARoot(PathBuf),
    #[error("{0} is already open by another replica node (this process or another): one root, one server")]
    InUse(PathBuf),
    #[error("record of volume {0:?} is older than or conflicts with the one the replica holds")]
    StaleRecord(String),
    #[error("record of volume {0:?} is invalid (version 0, or too long)")]
    InvalidRecord(String),
    #[error("{0:?} cannot name a disk (a DNS label other than `default`, once per server)")]
    InvalidDisk(String),
    #[error("this replica server has no disk {0:?}")]
    NoSuchDisk(String),
    #[error("replica of volume {volume_id:?} is at epoch {epoch}, the session's grant only at {granted}")]
    StaleGrant { volume_id: String, granted: u64, epoch: u64 },
}

impl NodeError {
    /// The wire status that answers a request failing with this error.
    pub fn status(&self) -> Status {
        match self {
            Self::Store { source, .. } => source.status(),
            Self::InvalidId(_) | Self::InvalidRecord(_) | Self::InvalidDisk(_) => Status::Invalid,
            Self::NoSuchDisk(_) => Status::NotFound,
            Self::StaleRecord(_) => Status::StaleRevision,
            Self::NotFound(_) => Status::NotFound,
            Self::AlreadyExists { .. } => Status::AlreadyExists,
            Self::Busy(_) | Self::InUse(_) => Status::Busy,
            Self::Broken { .. } | Self::Io { .. } | Self::NotARoot(_) => Status::IoError,
            Self::StaleGrant { .. } => Status::Denied,
        }
    }
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> NodeError + 'a {
    move |source| NodeError::Io { op, path: path.to_path_buf(), source }
}

fn is_plain(id: &str) -> bool {
    (1..=MAX_PLAIN_ID).contains(&id.len())
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// The directory name (under the node's root) of the replica of `volume_id`.
pub fn replica_dir_name(volume_id: &str) -> Result<String, NodeError> {
    if is_plain(volume_id) {
        return Ok(volume_id.to_owned());
    }
    if volume_id.is_empty() || volume_id.len() > MAX_HEX_ID {
        return Err(NodeError::InvalidId(volume_id.to_owned()));
    }
    Ok(std::iter::once("~".to_owned()).chain(volume_id.bytes().map(|b| format!("{b:02x}"))).collect())
}

/// The volume id a directory name encodes; `None` for names this node did not produce.
fn volume_id_of_dir(name: &str) -> Option<String> {
    let id = match name.strip_prefix('~') {
        Some(hex) if hex.len() % 2 == 0 => {
            let bytes: Option<Vec<u8>> =
                (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect();
            String::from_utf8(bytes?).ok()?
        }
        Some(_) => return None,
        None => name.to_owned(),
    };
    // Only the canonical form: `~6162` would decode to "ab", whose directory is `ab`.
    (replica_dir_name(&id).ok()? == name).then_some(id)
}

/// Who has one replica open; the server's dirty-flag and `Busy` rules read and change it.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    /// Engine connections past `Hello`.
    pub(crate) open: usize,
    /// A session that overlapped the current ones ended uncleanly: the last one to leave must
    /// not clear the dirty flag even if it itself ends cleanly.
    pub(crate) unclean: bool,
    /// A revert is running: no new session may start (it would see the chain change under it).
    pub(crate) exclusive: bool,
}

/// One replica held by the node.
#[derive(Debug)]
pub struct Replica {
    pub(crate) volume_id: String,
    pub(crate) store: Arc<ReplicaStore>,
    pub(crate) sessions: Mutex<Sessions>,
    /// The volume record and the epoch fence (see `record`).
    pub(crate) record: RecordCell,
}

impl Replica {
    fn new(volume_id: &str, store: Arc<ReplicaStore>, record: RecordCell) -> Self {
        Self { volume_id: volume_id.to_owned(), store, sessions: Mutex::default(), record }
    }

    pub fn store(&self) -> &Arc<ReplicaStore> {
        &self.store
    }

    /// The volume record this replica holds (version 0 when none).
    pub fn record(&self) -> RecordInfo {
        self.record.get()
    }

    /// Engine sessions open on this replica now (over TCP or in-process).
    pub fn open_sessions(&self) -> usize {
        lock(&self.sessions).open
    }
}

#[derive(Debug)]
enum Entry {
    Open(Arc<Replica>),
    /// Its directory exists but does not open (corrupt header, I/O error): never served, never
    /// silently replaced by an empty replica, but deletable.
    Broken(String),
}

/// What `NodeInfo` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReport {
    pub capacity: u64,
    pub available: u64,
    pub replicas: Vec<ReplicaSummary>,
}

/// Every replica under one root directory.
#[derive(Debug)]
pub struct ReplicaNode {
    root: PathBuf,
    replicas: Mutex<BTreeMap<String, Entry>>,
    /// The root directory, held with an exclusive `flock` for as long as the node is open: two
    /// nodes on one root would each keep their own headers and block maps of the same files, and
    /// a snapshot or resize by one would be undone by the other.
    _lock: std::fs::File,
}

impl ReplicaNode {
    /// Opens (creating if missing) the root and every replica in it. A replica that does not
    /// open is kept as broken (logged, answered `IoError`) instead of failing the whole node.
    pub fn open(root: &Path) -> Result<Self, NodeError> {
        std::fs::create_dir_all(root).map_err(io("create directory", root))?;
        if root.join(HEADER_FILE).exists() {
            return Err(NodeError::NotARoot(root.to_path_buf()));
        }
        let lock = std::fs::File::open(root).map_err(io("open", root))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(NodeError::InUse(root.to_path_buf())),
            Err(std::fs::TryLockError::Error(e)) => return Err(io("lock", root)(e)),
        }
        let mut replicas = BTreeMap::new();
        for entry in std::fs::read_dir(root).map_err(io("list", root))? {
            let entry = entry.map_err(io("list", root))?;
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with(DELETING_PREFIX) {
                // A delete that crashed after its rename: finish it.
                std::fs::remove_dir_all(&path).map_err(io("remove", &path))?;
                continue;
            }
            let Some(volume_id) = volume_id_of_dir(name) else {
                tracing::debug!(path = %path.display(), "not a replica directory; ignored");
                continue;
            };
            if !path.join(HEADER_FILE).exists() {
                // A create that crashed before its header commit holds no replica; a later
                // create of the same id reuses the directory.
                tracing::info!(path = %path.display(), "replica directory without a header; ignored");
                continue;
            }
            let opened = ReplicaStore::open(&path).and_then(|store| {
                let found = store.header().volume_id;
                if found != volume_id {
                    return Err(StoreError::Invalid(format!("header is for volume {found:?}")));
                }
                Ok((store, RecordCell::load(&path)?))
            });
            let entry = match opened {
                Ok((store, record)) => Entry::Open(Arc::new(Replica::new(&volume_id, Arc::new(store), record))),
                Err(e) => {
                    tracing::error!(replica.volume = %volume_id, error = %e, "replica does not open; not serving it");
                    Entry::Broken(e.to_string())
                }
            };
            replicas.insert(volume_id, entry);
        }
        Ok(Self { root: root.to_path_buf(), replicas: Mutex::new(replicas), _lock: lock })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the replica of `volume_id` lives (whether or not it exists).
    pub fn replica_dir(&self, volume_id: &str) -> Result<PathBuf, NodeError> {
        Ok(self.root.join(replica_dir_name(volume_id)?))
    }

    /// The replica of `volume_id`, if it is held and opens.
    pub fn replica(&self, volume_id: &str) -> Option<Arc<Replica>> {
        match lock(&self.replicas).get(volume_id) {
            Some(Entry::Open(r)) => Some(r.clone()),
            _ => None,
        }
    }

    /// Whether the node holds a replica of `volume_id`, opening or not.
    pub fn holds(&self, volume_id: &str) -> bool {
        lock(&self.replicas).contains_key(volume_id)
    }

    /// The volumes the node holds a replica of, opening or not.
    pub fn volume_ids(&self) -> Vec<String> {
        lock(&self.replicas).keys().cloned().collect()
    }

    /// The store of `volume_id`'s replica, if held.
    pub fn store(&self, volume_id: &str) -> Option<Arc<ReplicaStore>> {
        self.replica(volume_id).map(|r| r.store.clone())
    }

    /// Creates an empty replica. Idempotent: an existing replica of the same size is `Ok`, one
    /// of another size [`NodeError::AlreadyExists`].
    pub fn create_replica(&self, volume_id: &str, size: u64) -> Result<Arc<ReplicaStore>, NodeError> {
        let dir = self.replica_dir(volume_id)?;
        let mut replicas = lock(&self.replicas);
        match replicas.get(volume_id) {
            Some(Entry::Open(r)) => {
                let have = r.store.header().size;
                return if have == size {
                    Ok(r.store.clone())
                } else {
                    Err(NodeError::AlreadyExists { volume_id: volume_id.to_owned(), size: have })
                };
            }
            Some(Entry::Broken(what)) => {
                return Err(NodeError::Broken { volume_id: volume_id.to_owned(), what: what.clone() });
            }
            None => {}
        }
        let store = ReplicaStore::create(&dir, volume_id, size)
            .map_err(|source| NodeError::Store { volume_id: volume_id.to_owned(), source })?;
        let store = Arc::new(store);
        // A directory reused after a create that crashed before its header commit may still
        // hold a record file: never, since records are written after the replica exists, but
        // a fresh replica must not inherit one either way.
        let _ = std::fs::remove_file(dir.join(super::record::RECORD_FILE));
        let replica = Replica::new(volume_id, store.clone(), RecordCell::default());
        replicas.insert(volume_id.to_owned(), Entry::Open(Arc::new(replica)));
        tracing::info!(replica.volume = volume_id, size, "replica created");
        Ok(store)
    }

    /// Deletes the replica and its files; [`NodeError::NotFound`] when absent,
    /// [`NodeError::Busy`] while an engine session is open. The directory is first renamed to a
    /// `.deleting-` name (durably), so a crash mid-removal never leaves a half replica that looks
    /// like a real one; open finishes such removals.
    pub fn delete_replica(&self, volume_id: &str) -> Result<(), NodeError> {
        let dir = self.replica_dir(volume_id)?;
        let mut replicas = lock(&self.replicas);
        match replicas.get(volume_id) {
            None => return Err(NodeError::NotFound(volume_id.to_owned())),
            Some(Entry::Open(r)) if lock(&r.sessions).open > 0 => return Err(NodeError::Busy(volume_id.to_owned())),
            Some(_) => {}
        }
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let trash = self.root.join(format!("{DELETING_PREFIX}{name}"));
        std::fs::rename(&dir, &trash).map_err(io("rename", &dir))?;
        replicas.remove(volume_id);
        header_file::sync_dir(&self.root)
            .map_err(|source| NodeError::Store { volume_id: volume_id.to_owned(), source })?;
        std::fs::remove_dir_all(&trash).map_err(io("remove", &trash))?;
        tracing::info!(replica.volume = volume_id, "replica deleted");
        Ok(())
    }

    /// Starts an engine session on `volume_id`'s replica: the replica and its header as it was
    /// before the session (whether the last session ended cleanly), with the replica now marked
    /// dirty. [`NodeError::NotFound`] when absent, [`NodeError::Busy`] while a revert runs.
    /// Counted under the node's lock so a concurrent delete either sees the session or happens
    /// before it; marked dirty under the sessions lock so a session ending meanwhile cannot clear
    /// the mark (see `session::end`). A session bound to a grant of epoch `granted` is refused
    /// ([`NodeError::StaleGrant`]) when the replica's epoch is newer, before anything is marked.
    pub(crate) fn open_session(
        &self,
        volume_id: &str,
        granted: Option<u64>,
    ) -> Result<(Arc<Replica>, ReplicaHeader), NodeError> {
        let replicas = lock(&self.replicas);
        match replicas.get(volume_id) {
            None => Err(NodeError::NotFound(volume_id.to_owned())),
            Some(Entry::Broken(what)) => Err(NodeError::Broken { volume_id: volume_id.to_owned(), what: what.clone() }),
            Some(Entry::Open(r)) => {
                let mut s = lock(&r.sessions);
                if s.exclusive {
                    return Err(NodeError::Busy(volume_id.to_owned()));
                }
                if let Some(granted) = granted {
                    let epoch = r.record().epoch;
                    if epoch > granted {
                        return Err(NodeError::StaleGrant { volume_id: volume_id.to_owned(), granted, epoch });
                    }
                }
                let header = r.store.header();
                r.store
                    .set_dirty(true)
                    .map_err(|source| NodeError::Store { volume_id: volume_id.to_owned(), source })?;
                if s.open == 0 {
                    s.unclean = false;
                }
                s.open += 1;
                Ok((r.clone(), header))
            }
        }
    }

    /// The header and record of `volume_id`'s replica.
    pub fn describe(&self, volume_id: &str) -> Result<(ReplicaHeader, RecordInfo), NodeError> {
        self.open_replica(volume_id).map(|r| (r.store.header(), r.record()))
    }

    /// Replaces the record of `volume_id`'s replica if `record` is newer (see `record`).
    pub fn set_record(&self, volume_id: &str, record: RecordInfo) -> Result<(), NodeError> {
        let replica = self.open_replica(volume_id)?;
        match replica.record.set(replica.store.dir(), record) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(RecordRefusal::Stale)) => Err(NodeError::StaleRecord(volume_id.to_owned())),
            Ok(Err(RecordRefusal::Invalid)) => Err(NodeError::InvalidRecord(volume_id.to_owned())),
            Err(source) => Err(NodeError::Store { volume_id: volume_id.to_owned(), source }),
        }
    }

    fn open_replica(&self, volume_id: &str) -> Result<Arc<Replica>, NodeError> {
        match lock(&self.replicas).get(volume_id) {
            None => Err(NodeError::NotFound(volume_id.to_owned())),
            Some(Entry::Broken(what)) => Err(NodeError::Broken { volume_id: volume_id.to_owned(), what: what.clone() }),
            Some(Entry::Open(r)) => Ok(r.clone()),
        }
    }

    /// Capacity of the root's file system and every replica that opens.
    pub fn report(&self) -> Result<NodeReport, NodeError> {
        let vfs = nix::sys::statvfs::statvfs(&self.root).map_err(|e| NodeError::Io {
            op: "statvfs",
            path: self.root.clone(),
            source: e.into(),
        })?;
        let frag = vfs.fragment_size();
        let replicas: Vec<Arc<Replica>> = lock(&self.replicas)
            .values()
            .filter_map(|e| match e {
                Entry::Open(r) => Some(r.clone()),
                Entry::Broken(_) => None,
            })
            .collect();
        let mut summaries = Vec::with_capacity(replicas.len());
        for r in replicas {
            let h = r.store.header();
            let allocated = r
                .store
                .allocated_bytes()
                .map_err(|source| NodeError::Store { volume_id: r.volume_id.clone(), source })?;
            summaries.push(ReplicaSummary {
                volume_id: h.volume_id,
                size: h.size,
                revision: h.revision,
                dirty: h.dirty,
                allocated,
            });
        }
        Ok(NodeReport {
            capacity: vfs.blocks().saturating_mul(frag),
            available: vfs.blocks_available().saturating_mul(frag),
            replicas: summaries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_names_are_injective_and_round_trip() {
        for id in ["pvc-1234", "a", "vol.1_x-y", ".hidden", "with/slash", "ünï", "~7e", "a b", ".."] {
            let name = replica_dir_name(id).expect("encodable");
            assert!(!name.contains('/') && name != "." && name != ".." && !name.starts_with('.'), "{id} -> {name}");
            assert_eq!(volume_id_of_dir(&name).as_deref(), Some(id));
        }
        assert_eq!(replica_dir_name("pvc-1").expect("plain"), "pvc-1");
        assert_eq!(replica_dir_name("a/b").expect("hex"), "~612f62");
        assert_eq!(volume_id_of_dir("~6162"), None, "not canonical: \"ab\" lives in ab");
        assert_eq!(volume_id_of_dir(".deleting-x"), None);
        assert_eq!(volume_id_of_dir("lost+found"), None);
        assert!(replica_dir_name("").is_err());
        assert!(replica_dir_name(&"x".repeat(201)).is_err());
        assert!(replica_dir_name(&"/".repeat(101)).is_err());
        assert_eq!(replica_dir_name(&"x".repeat(200)).expect("plain").len(), 200);
    }

    #[test]
    fn a_root_is_open_by_one_node_at_a_time_and_free_again_once_it_closes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = ReplicaNode::open(dir.path()).expect("first open");
        node.create_replica("vol-1", 1 << 20).expect("create");
        // Another open file description, as another process would have: refused, nothing touched.
        let second = ReplicaNode::open(dir.path()).expect_err("a second node on the same root");
        assert!(matches!(second, NodeError::InUse(_)), "{second}");
        assert_eq!(second.status(), Status::Busy);
        assert!(node.store("vol-1").is_some());
        drop(node);
        let again = ReplicaNode::open(dir.path()).expect("open after the first closed");
        assert!(again.store("vol-1").is_some());
        // The lock leaves nothing in the root beside the replicas.
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    }
}
