//! A filesystem target: objects are files under a root directory the operator made (a local disk
//! or an NFS mount). A `put` writes a hidden temporary file beside the object, syncs it, renames it
//! over the object and syncs the directory, so an object is whole or absent after any crash.
//! Listings skip the hidden temporaries a crash may leave.

use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt as _};

use super::{ObjectInfo, Target};
use crate::error::{TargetError, TargetErrorKind};

/// Objects as files under `root`.
#[derive(Debug, Clone)]
pub struct FsTarget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    name: String,
    /// Distinguishes the temporary files of concurrent puts of one process.
    serial: AtomicU64,
}

impl FsTarget {
    /// A target rooted at `root`, which must exist (it is the operator's mount or directory; a
    /// missing one is reported by every operation as a missing bucket, never created here).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        let name = root.display().to_string();
        Self { inner: Arc::new(Inner { root, name, serial: AtomicU64::new(0) }) }
    }

    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    async fn blocking<T: Send + 'static>(
        &self,
        op: &'static str,
        key: &str,
        f: impl FnOnce(&Inner) -> io::Result<T> + Send + 'static,
    ) -> Result<T, TargetError> {
        let inner = Arc::clone(&self.inner);
        let result = tokio::task::spawn_blocking(move || {
            let r = f(&inner);
            (r, inner)
        })
        .await;
        match result {
            Ok((Ok(v), _)) => Ok(v),
            Ok((Err(e), inner)) => Err(inner.error(op, key, &e)),
            Err(join) => Err(self.inner.error(op, key, &io::Error::other(join.to_string()))),
        }
    }
}

impl Inner {
    fn error(&self, op: &'static str, key: &str, e: &io::Error) -> TargetError {
        use nix::libc::{EACCES, EDQUOT, ENOSPC, EPERM, EROFS};
        let kind = match e.raw_os_error() {
            // The operator's mount or directory is gone: the filesystem's "missing bucket".
            _ if !self.root.is_dir() => TargetErrorKind::BucketMissing,
            Some(ENOSPC | EDQUOT) => TargetErrorKind::Full,
            Some(EACCES | EPERM | EROFS) => TargetErrorKind::Forbidden,
            _ if e.kind() == io::ErrorKind::NotFound => TargetErrorKind::NotFound,
            _ => TargetErrorKind::Other,
        };
        TargetError { kind, op, key: key.to_owned(), target: self.name.clone(), message: e.to_string() }
    }

    fn path(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    fn put(&self, key: &str, data: &[u8]) -> io::Result<()> {
        if !self.root.is_dir() {
            return Err(io::Error::new(io::ErrorKind::NotFound, "the target's root directory is missing"));
        }
        let path = self.path(key);
        let dir = path.parent().ok_or_else(|| io::Error::other("key without a folder"))?;
        let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| io::Error::other("key without a name"))?;
        self.make_dirs(dir)?;
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{serial}.tmp", std::process::id()));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(data)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            sync_dir(dir)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Creates the folders of `dir` below the root, syncing each new one's parent so the entry of
    /// a folder made for an object survives a crash with the object.
    fn make_dirs(&self, dir: &Path) -> io::Result<()> {
        if dir.is_dir() {
            return Ok(());
        }
        let parent = dir.parent().ok_or_else(|| io::Error::other("folder outside the root"))?;
        if dir != self.root {
            self.make_dirs(parent)?;
        }
        match std::fs::create_dir(dir) {
            Ok(()) => sync_dir(parent),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn head(&self, key: &str) -> io::Result<Option<ObjectInfo>> {
        match std::fs::metadata(self.path(key)) {
            Ok(m) => Ok(Some(ObjectInfo { key: key.to_owned(), size: m.len(), modified: m.modified()? })),
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.root.is_dir() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every object under `prefix`, walking depth-first (the layout is at most three folders
    /// deep under a volume).
    fn walk(&self, prefix: &str, out: &mut Vec<ObjectInfo>) -> io::Result<()> {
        let dir = self.path(prefix);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.root.is_dir() => return Ok(()),
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            if name.starts_with('.') {
                continue;
            }
            let meta = entry.metadata()?;
            let key = format!("{prefix}{name}");
            if meta.is_dir() {
                self.walk(&format!("{key}/"), out)?;
            } else {
                out.push(ObjectInfo { key, size: meta.len(), modified: meta.modified()? });
            }
        }
        Ok(())
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[async_trait]
impl Target for FsTarget {
    fn describe(&self) -> &str {
        &self.inner.name
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<(), TargetError> {
        let k = key.to_owned();
        self.blocking("put", key, move |i| i.put(&k, &data)).await
    }

    async fn get(&self, key: &str) -> Result<Bytes, TargetError> {
        let k = key.to_owned();
        self.blocking("get", key, move |i| std::fs::read(i.path(&k)).map(Bytes::from)).await
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, TargetError> {
        let k = key.to_owned();
        self.blocking("head", key, move |i| i.head(&k)).await
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxStream<'a, Result<ObjectInfo, TargetError>> {
        // One folder tree of one volume: its entries are small next to the chunks they name, and
        // read in one blocking call.
        let p = prefix.to_owned();
        stream::once(async move {
            let listed = self
                .blocking("list", prefix, move |i| {
                    let mut out = Vec::new();
                    i.walk(&p, &mut out)?;
                    Ok(out)
                })
                .await;
            match listed {
                Ok(v) => stream::iter(v.into_iter().map(Ok)).left_stream(),
                Err(e) => stream::iter([Err(e)]).right_stream(),
            }
        })
        .flatten()
        .boxed()
    }

    async fn folders(&self, prefix: &str) -> Result<Vec<String>, TargetError> {
        let p = prefix.to_owned();
        self.blocking("list", prefix, move |i| {
            let dir = i.path(&p);
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == io::ErrorKind::NotFound && i.root.is_dir() => return Ok(Vec::new()),
                Err(e) => return Err(e),
            };
            let mut out = Vec::new();
            for entry in entries {
                let entry = entry?;
                if entry.file_type()?.is_dir()
                    && let Some(name) = entry.file_name().to_str()
                    && !name.starts_with('.')
                {
                    out.push(name.to_owned());
                }
            }
            Ok(out)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), TargetError> {
        let k = key.to_owned();
        self.blocking("delete", key, move |i| match std::fs::remove_file(i.path(&k)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && i.root.is_dir() => Ok(()),
            other => other,
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt as _;

    #[tokio::test]
    async fn put_get_list_delete_and_a_missing_root() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = FsTarget::new(dir.path());
        t.put("volumes/v/chunks/ab/x", Bytes::from_static(b"1")).await.expect("put");
        t.put("volumes/v/chunks/ab/x", Bytes::from_static(b"22")).await.expect("replace");
        t.put("volumes/v/gc.lock", Bytes::from_static(b"")).await.expect("put");
        assert_eq!(&t.get("volumes/v/chunks/ab/x").await.expect("get")[..], b"22");
        assert_eq!(t.head("volumes/v/chunks/ab/x").await.expect("head").map(|i| i.size), Some(2));
        assert_eq!(t.head("volumes/v/none").await.expect("head"), None);
        let mut keys: Vec<String> = t.list("volumes/v/").map_ok(|i| i.key).try_collect().await.expect("list");
        keys.sort();
        assert_eq!(keys, ["volumes/v/chunks/ab/x", "volumes/v/gc.lock"]);
        assert_eq!(t.folders("volumes/").await.expect("folders"), ["v"]);
        assert!(t.list("volumes/none/").try_collect::<Vec<_>>().await.expect("empty").is_empty());
        assert_eq!(t.get("volumes/v/none").await.expect_err("absent").kind, TargetErrorKind::NotFound);
        t.delete("volumes/v/chunks/ab/x").await.expect("delete");
        t.delete("volumes/v/chunks/ab/x").await.expect("delete again");

        let gone = FsTarget::new(dir.path().join("missing"));
        let e = gone.put("volumes/v/gc.lock", Bytes::new()).await.expect_err("no root");
        assert_eq!(e.kind, TargetErrorKind::BucketMissing);
        assert_eq!(gone.head("x").await.expect_err("no root").kind, TargetErrorKind::BucketMissing);
    }
}
