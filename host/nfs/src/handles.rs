//! Handle-level steps on one export's [`Pool`]: LOOKUP walks that refuse symlinks, GETATTR,
//! the directory operations by handle, temporary names. Both the client's operations
//! (`client`) and the tree copy (`copy`) are built from them, so neither depends on the other.
use crate::path::RelPath;
use crate::pool::Pool;
use crate::{FileKind, FileStat, NfsError, Timestamp};
use futures::TryStreamExt;
use nfs3_client::nfs3_types::nfs3::{
    self, Nfs3Option, Nfs3Result, diropargs3, fattr3, filename3, ftype3, nfs_fh3, nfsstat3, sattr3,
};
use nfs3_client::nfs3_types::xdr_codec::Opaque;
use std::sync::atomic::{AtomicU64, Ordering};

/// One directory entry as READDIRPLUS (or LOOKUP after it) describes it.
pub(crate) struct Child {
    pub name: Vec<u8>,
    pub fh: nfs_fh3,
    pub attr: fattr3,
}

pub(crate) fn name(n: &[u8]) -> filename3<'static> {
    filename3(Opaque::owned(n.to_vec()))
}

pub(crate) fn dirop(dir: &nfs_fh3, n: &[u8]) -> diropargs3<'static> {
    diropargs3 { dir: dir.clone(), name: name(n) }
}

pub(crate) fn kind(t: ftype3) -> FileKind {
    match t {
        ftype3::NF3DIR => FileKind::Directory,
        ftype3::NF3REG => FileKind::File,
        ftype3::NF3LNK => FileKind::Symlink,
        _ => FileKind::Other,
    }
}

pub(crate) fn file_stat(a: &fattr3) -> FileStat {
    FileStat {
        kind: kind(a.type_),
        size: a.size,
        mode: a.mode & 0o7777,
        uid: a.uid,
        gid: a.gid,
        modified: Timestamp { seconds: i64::from(a.mtime.seconds), nanos: a.mtime.nseconds },
    }
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// A hidden name for a temporary sibling, unique per process and call. It does not embed the
/// target's name: that may already be 255 bytes.
pub(crate) fn temp_name(tag: &str) -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!(".wasmcsi-{tag}-{}-{}-{nanos:x}", std::process::id(), TMP_SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Handle-level steps shared by the operations and `copy`.
impl Pool {
    pub(crate) async fn root(&self) -> Result<nfs_fh3, NfsError> {
        Ok(self.mounted().await?.root)
    }

    pub(crate) async fn getattr(&self, fh: &nfs_fh3) -> Result<fattr3, NfsError> {
        let args = nfs3::GETATTR3args { object: fh.clone() };
        match rpc!(self, "GETATTR", |c| c.getattr(&args)) {
            Nfs3Result::Ok(ok) => Ok(ok.obj_attributes),
            Nfs3Result::Err((stat, _)) => Err(self.status(stat, "GETATTR")),
        }
    }

    /// LOOKUP without following; `None` when absent.
    pub(crate) async fn lookup(&self, dir: &nfs_fh3, n: &[u8]) -> Result<Option<(nfs_fh3, fattr3)>, NfsError> {
        let args = nfs3::LOOKUP3args { what: dirop(dir, n) };
        match rpc!(self, "LOOKUP", |c| c.lookup(&args)) {
            Nfs3Result::Ok(ok) => {
                let attr = match ok.obj_attributes {
                    Nfs3Option::Some(a) => a,
                    Nfs3Option::None => self.getattr(&ok.object).await?,
                };
                Ok(Some((ok.object, attr)))
            }
            Nfs3Result::Err((nfsstat3::NFS3ERR_NOENT, _)) => Ok(None),
            Nfs3Result::Err((stat, _)) => Err(self.status(stat, "LOOKUP")),
        }
    }

    /// Walk `parts` from the root. `Ok(None)` when a component is absent; a symlink anywhere on
    /// the way (the last component included, as in `dir`) is refused.
    pub(crate) async fn walk(&self, path: &str, parts: &[&str]) -> Result<Option<(nfs_fh3, fattr3)>, NfsError> {
        let mut fh = self.root().await?;
        let mut attr = if parts.is_empty() { Some(self.getattr(&fh).await?) } else { None };
        for (i, part) in parts.iter().enumerate() {
            if i > 0 && attr.as_ref().is_some_and(|a| a.type_ != ftype3::NF3DIR) {
                return Err(NfsError::InvalidArgument(format!(
                    "path {path:?} on {}: {:?} is not a directory",
                    self.label,
                    parts[i - 1]
                )));
            }
            let Some((next, a)) = self.lookup(&fh, part.as_bytes()).await? else {
                return Ok(None);
            };
            if a.type_ == ftype3::NF3LNK {
                return Err(NfsError::PermissionDenied(format!(
                    "path {path:?} on {} crosses a symlink at {part:?}",
                    self.label
                )));
            }
            fh = next;
            attr = Some(a);
        }
        Ok(attr.map(|a| (fh, a)))
    }

    /// The parent directory of a non-root path (must exist: `NotFound` otherwise) and the name.
    pub(crate) async fn parent<'p>(&self, path: &RelPath<'p>, op: &str) -> Result<(nfs_fh3, &'p str), NfsError> {
        let Some((parents, last)) = path.split_last() else {
            return Err(NfsError::InvalidArgument(format!(
                "{op}: the export root {} itself is not allowed",
                self.label
            )));
        };
        match self.walk(path.raw, parents).await? {
            Some((fh, a)) if a.type_ == ftype3::NF3DIR => Ok((fh, last)),
            Some(_) => Err(NfsError::InvalidArgument(format!(
                "{op} {:?} on {}: parent is not a directory",
                path.raw, self.label
            ))),
            None => Err(NfsError::NotFound(format!("{op} {:?} on {}: parent directory missing", path.raw, self.label))),
        }
    }

    /// Every entry of a directory with handle and attributes (READDIRPLUS, cookie by cookie).
    pub(crate) async fn list(&self, dir: &nfs_fh3) -> Result<Vec<Child>, NfsError> {
        let mut out = Vec::new();
        let mut cookie = 0;
        let mut cookieverf = nfs3::cookieverf3::default();
        loop {
            let args = nfs3::READDIRPLUS3args {
                dir: dir.clone(),
                cookie,
                cookieverf,
                dircount: 64 * 1024,
                maxcount: 256 * 1024,
            };
            let ok = match rpc!(self, "READDIRPLUS", |c| c.readdirplus(&args)) {
                Nfs3Result::Ok(ok) => ok,
                Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "READDIRPLUS")),
            };
            for e in ok.reply.entries.0 {
                cookie = e.cookie;
                let n = e.name.0.to_vec();
                if n == b"." || n == b".." {
                    continue;
                }
                // Servers may omit handle or attributes of an entry; ask for them.
                let (fh, attr) = match (e.name_handle, e.name_attributes) {
                    (Nfs3Option::Some(fh), Nfs3Option::Some(a)) => (fh, a),
                    _ => match self.lookup(dir, &n).await? {
                        Some(found) => found,
                        None => continue, // removed meanwhile
                    },
                };
                out.push(Child { name: n, fh, attr });
            }
            if ok.reply.eof {
                return Ok(out);
            }
            cookieverf = ok.cookieverf;
        }
    }

    /// REMOVE or RMDIR one name; absent is fine (removed concurrently).
    pub(crate) async fn unlink(&self, dir: &nfs_fh3, n: &[u8], is_dir: bool) -> Result<(), NfsError> {
        let stat = if is_dir {
            let args = nfs3::RMDIR3args { object: dirop(dir, n) };
            match rpc!(self, "RMDIR", |c| c.rmdir(&args)) {
                Nfs3Result::Ok(_) => return Ok(()),
                Nfs3Result::Err((stat, _)) => stat,
            }
        } else {
            let args = nfs3::REMOVE3args { object: dirop(dir, n) };
            match rpc!(self, "REMOVE", |c| c.remove(&args)) {
                Nfs3Result::Ok(_) => return Ok(()),
                Nfs3Result::Err((stat, _)) => stat,
            }
        };
        match stat {
            nfsstat3::NFS3ERR_NOENT => Ok(()),
            stat => Err(self.status(stat, if is_dir { "RMDIR" } else { "REMOVE" })),
        }
    }

    /// Empty a directory, depth first; entries are removed several at a time.
    pub(crate) fn empty_dir<'a>(&'a self, dir: nfs_fh3) -> futures::future::BoxFuture<'a, Result<(), NfsError>> {
        Box::pin(async move {
            let children = self.list(&dir).await?;
            let parallel = self.config().max_connections.max(1);
            futures::stream::iter(children.into_iter().map(Ok))
                .try_for_each_concurrent(parallel, |child| {
                    let dir = dir.clone();
                    async move {
                        let is_dir = child.attr.type_ == ftype3::NF3DIR;
                        if is_dir {
                            self.empty_dir(child.fh).await?;
                        }
                        self.unlink(&dir, &child.name, is_dir).await
                    }
                })
                .await
        })
    }

    pub(crate) async fn setattr(&self, fh: &nfs_fh3, attrs: sattr3, what: &str) -> Result<(), NfsError> {
        let args = nfs3::SETATTR3args { object: fh.clone(), new_attributes: attrs, guard: Nfs3Option::None };
        match rpc!(self, "SETATTR", |c| c.setattr(&args)) {
            Nfs3Result::Ok(_) => Ok(()),
            Nfs3Result::Err((stat, _)) => Err(self.status(stat, what)),
        }
    }

    /// Rename within the export; the target must not exist (checked first, as `dir` does:
    /// RENAME alone would replace a file or an empty directory).
    pub(crate) async fn rename_checked(
        &self,
        from_dir: &nfs_fh3,
        from: &[u8],
        to_dir: &nfs_fh3,
        to: &[u8],
        what: &str,
    ) -> Result<(), NfsError> {
        if self.lookup(to_dir, to).await?.is_some() {
            return Err(NfsError::AlreadyExists(format!("{what}: target exists")));
        }
        let args = nfs3::RENAME3args { from: dirop(from_dir, from), to: dirop(to_dir, to) };
        match rpc!(self, "RENAME", |c| c.rename(&args)) {
            Nfs3Result::Ok(_) => Ok(()),
            Nfs3Result::Err((stat, _)) => Err(self.status(stat, what)),
        }
    }
}
