//! `NfsClient`: the operations of the WIT `nfs` interface, with the semantics of the local `dir`
//! capability (`host/runtime/src/host/dir.rs`) carried over to NFSv3 file handles.
//!
//! Paths are walked with LOOKUP one component at a time from the export's root handle. LOOKUP
//! never follows a symlink, and the walk refuses any component that is one (as `dir` refuses
//! them), so no operation can leave the export through a link; later steps use the handles the
//! walk returned, never a path the server would resolve again.
use crate::handles::{dirop, file_stat, kind, temp_name};
use crate::path::RelPath;
use crate::pool::Pool;
use crate::{FileKind, FileStat, MAX_READ, NfsConfig, NfsError, NfsExport, Space};
use nfs3_client::nfs3_types::nfs3::{self, Nfs3Option, Nfs3Result, ftype3, nfs_fh3, nfsstat3, sattr3};
use std::collections::HashMap;
use std::sync::Arc;

/// The `nfs` capability of one backend: the exports it was granted, a pool for each.
/// Cheap to clone; clones share pools.
#[derive(Clone)]
pub struct NfsClient {
    pools: Arc<HashMap<NfsExport, Arc<Pool>>>,
    config: Arc<NfsConfig>,
    pub(crate) jobs: Arc<crate::background::Jobs>,
}

impl std::fmt::Debug for NfsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NfsClient").field("exports", &self.config.exports).finish()
    }
}

fn set_mode_owner(mode: u32, uid: u32, gid: u32) -> sattr3 {
    sattr3 {
        mode: Nfs3Option::Some(mode & 0o7777),
        uid: Nfs3Option::Some(uid),
        gid: Nfs3Option::Some(gid),
        ..sattr3::default()
    }
}

impl NfsClient {
    /// A client for the granted exports. Connects lazily: nothing is sent before the first call.
    pub fn new(config: NfsConfig) -> Self {
        let config = Arc::new(config);
        let pools =
            config.exports.iter().map(|e| (e.clone(), Arc::new(Pool::new(e.clone(), Arc::clone(&config))))).collect();
        Self { pools: Arc::new(pools), config, jobs: Arc::default() }
    }

    pub fn config(&self) -> &NfsConfig {
        &self.config
    }

    /// The granted exports, for the guest (like `dir.roots`).
    pub fn exports(&self) -> Vec<NfsExport> {
        self.config.exports.clone()
    }

    pub(crate) fn pool(&self, export: &NfsExport) -> Result<&Pool, NfsError> {
        let key = export.clone().normalized();
        self.pools
            .get(&key)
            .map(|p| p.as_ref())
            .ok_or_else(|| NfsError::PermissionDenied(format!("nfs export {key} is not granted")))
    }

    /// Create a directory (parents too, with the same mode and owner) with `mode`, `uid`, `gid`.
    /// An existing directory is success and keeps its attributes.
    /// Errors: `PermissionDenied` (export not granted, symlink on the path), `Unavailable`,
    /// `InvalidArgument` (bad path), `AlreadyExists` (a non-directory is there), `Internal`.
    #[tracing::instrument(name = "nfs.mkdir", skip_all, fields(export = %export, path = %path, mode, uid, gid))]
    pub async fn mkdir(&self, export: &NfsExport, path: &str, mode: u32, uid: u32, gid: u32) -> Result<(), NfsError> {
        let pool = self.pool(export)?;
        let rel = RelPath::parse(path)?;
        let mut fh = pool.root().await?;
        for (i, part) in rel.parts.iter().enumerate() {
            let last = i + 1 == rel.parts.len();
            let existing = match pool.lookup(&fh, part.as_bytes()).await? {
                Some(found) => Some(found),
                None => {
                    let args = nfs3::MKDIR3args {
                        where_: dirop(&fh, part.as_bytes()),
                        attributes: set_mode_owner(mode, uid, gid),
                    };
                    match rpc!(pool, "MKDIR", |c| c.mkdir(&args)) {
                        Nfs3Result::Ok(ok) => {
                            let (created, attr) = match (ok.obj, ok.obj_attributes) {
                                (Nfs3Option::Some(h), Nfs3Option::Some(a)) => (h, a),
                                _ => pool.lookup(&fh, part.as_bytes()).await?.ok_or_else(|| {
                                    NfsError::Internal(format!("mkdir {path:?} on {}: created but gone", pool.label))
                                })?,
                            };
                            // Servers may apply a umask or inherit the group; the guest asked for
                            // exact values.
                            if attr.mode & 0o7777 != mode & 0o7777 || attr.uid != uid || attr.gid != gid {
                                pool.setattr(&created, set_mode_owner(mode, uid, gid), "mkdir: SETATTR").await?;
                            }
                            fh = created;
                            continue;
                        }
                        // Created concurrently by someone else: look at what is there now.
                        Nfs3Result::Err((nfsstat3::NFS3ERR_EXIST, _)) => pool.lookup(&fh, part.as_bytes()).await?,
                        Nfs3Result::Err((stat, _)) => return Err(pool.status(stat, &format!("mkdir {path:?}"))),
                    }
                }
            };
            match existing {
                Some((h, a)) if a.type_ == ftype3::NF3DIR => fh = h,
                Some((_, a)) if a.type_ == ftype3::NF3LNK => {
                    return Err(NfsError::PermissionDenied(format!(
                        "mkdir {path:?} on {}: crosses a symlink at {part:?}",
                        pool.label
                    )));
                }
                Some(_) if last => {
                    return Err(NfsError::AlreadyExists(format!("mkdir {path:?} on {}: not a directory", pool.label)));
                }
                Some(_) => {
                    return Err(NfsError::InvalidArgument(format!(
                        "mkdir {path:?} on {}: {part:?} is not a directory",
                        pool.label
                    )));
                }
                None => {
                    return Err(NfsError::Internal(format!("mkdir {path:?} on {}: exists and vanished", pool.label)));
                }
            }
        }
        Ok(())
    }

    /// Metadata of a path, `None` when absent (the last component or a parent).
    /// Errors: `PermissionDenied`, `Unavailable`, `InvalidArgument`, `Internal`.
    #[tracing::instrument(name = "nfs.stat", skip_all, fields(export = %export, path = %path))]
    pub async fn stat(&self, export: &NfsExport, path: &str) -> Result<Option<FileStat>, NfsError> {
        let pool = self.pool(export)?;
        let rel = RelPath::parse(path)?;
        Ok(pool.walk(path, &rel.parts).await?.map(|(_, a)| file_stat(&a)))
    }

    /// Names in a directory, sorted. Errors: `NotFound`, `InvalidArgument` (not a directory),
    /// as `mkdir`.
    #[tracing::instrument(name = "nfs.read_dir", skip_all, fields(export = %export, path = %path))]
    pub async fn read_dir(&self, export: &NfsExport, path: &str) -> Result<Vec<String>, NfsError> {
        let pool = self.pool(export)?;
        let fh = self.existing(pool, path, FileKind::Directory, "read-dir").await?;
        let mut names = Vec::new();
        let mut cookie = 0;
        let mut cookieverf = nfs3::cookieverf3::default();
        loop {
            let args = nfs3::READDIR3args { dir: fh.clone(), cookie, cookieverf, count: 64 * 1024 };
            let ok = match rpc!(pool, "READDIR", |c| c.readdir(&args)) {
                Nfs3Result::Ok(ok) => ok,
                Nfs3Result::Err((stat, _)) => return Err(pool.status(stat, &format!("read-dir {path:?}"))),
            };
            for e in ok.reply.entries.0 {
                cookie = e.cookie;
                let n = e.name.0.as_ref();
                if n != b"." && n != b".." {
                    names.push(String::from_utf8_lossy(n).into_owned());
                }
            }
            if ok.reply.eof {
                break;
            }
            cookieverf = ok.cookieverf;
        }
        names.sort();
        Ok(names)
    }

    /// The handle of an existing path of the given kind.
    async fn existing(&self, pool: &Pool, path: &str, want: FileKind, op: &str) -> Result<nfs_fh3, NfsError> {
        let rel = RelPath::parse(path)?;
        match pool.walk(path, &rel.parts).await? {
            None => Err(NfsError::NotFound(format!("{op} {path:?} on {}: no such file or directory", pool.label))),
            Some((fh, a)) if kind(a.type_) == want => Ok(fh),
            Some((_, a)) => Err(NfsError::InvalidArgument(format!(
                "{op} {path:?} on {}: is a {:?}, not a {want:?}",
                pool.label,
                kind(a.type_)
            ))),
        }
    }

    /// Read a whole regular file of at most [`MAX_READ`] bytes. Errors: `NotFound`,
    /// `InvalidArgument` (not a regular file, too large), as `mkdir`.
    #[tracing::instrument(name = "nfs.read_file", skip_all, fields(export = %export, path = %path))]
    pub async fn read_file(&self, export: &NfsExport, path: &str) -> Result<Vec<u8>, NfsError> {
        let pool = self.pool(export)?;
        let fh = self.existing(pool, path, FileKind::File, "read-file").await?;
        let rtmax = pool.mounted().await?.rtmax;
        let mut data = Vec::new();
        loop {
            let args = nfs3::READ3args { file: fh.clone(), offset: data.len() as u64, count: rtmax };
            let ok = match rpc!(pool, "READ", |c| c.read(&args)) {
                Nfs3Result::Ok(ok) => ok,
                Nfs3Result::Err((stat, _)) => return Err(pool.status(stat, &format!("read-file {path:?}"))),
            };
            data.extend_from_slice(ok.data.as_ref());
            if data.len() as u64 > MAX_READ {
                return Err(NfsError::InvalidArgument(format!(
                    "read-file {path:?} on {}: larger than {MAX_READ} bytes",
                    pool.label
                )));
            }
            if ok.eof || ok.data.is_empty() {
                return Ok(data);
            }
        }
    }

    /// Write a whole file atomically: a temporary sibling (mode 0600) is written with FILE_SYNC,
    /// then renamed over `path`, so a reader sees the old or the new content, never a mix.
    /// Errors: `NotFound` (parent missing), as `mkdir`.
    #[tracing::instrument(name = "nfs.write_file", skip_all, fields(export = %export, path = %path, len = data.len()))]
    pub async fn write_file(&self, export: &NfsExport, path: &str, data: &[u8]) -> Result<(), NfsError> {
        let pool = self.pool(export)?;
        let rel = RelPath::parse(path)?;
        let (dir, last) = pool.parent(&rel, "write-file").await?;
        // Writing through a symlink would leave the export; replacing a directory is not a write.
        if let Some((_, a)) = pool.lookup(&dir, last.as_bytes()).await? {
            match a.type_ {
                ftype3::NF3LNK => {
                    return Err(NfsError::PermissionDenied(format!(
                        "write-file {path:?} on {}: is a symlink",
                        pool.label
                    )));
                }
                ftype3::NF3DIR => {
                    return Err(NfsError::InvalidArgument(format!(
                        "write-file {path:?} on {}: is a directory",
                        pool.label
                    )));
                }
                _ => {}
            }
        }
        let tmp = temp_name("tmp");
        let result = self.write_then_rename(pool, &dir, &tmp, last, data, path).await;
        if result.is_err() {
            // Best effort: the temporary name is hidden and unique, a leftover harms nobody.
            let _ = pool.unlink(&dir, tmp.as_bytes(), false).await;
        }
        result
    }

    async fn write_then_rename(
        &self,
        pool: &Pool,
        dir: &nfs_fh3,
        tmp: &str,
        last: &str,
        data: &[u8],
        path: &str,
    ) -> Result<(), NfsError> {
        let fh = pool.create(dir, tmp.as_bytes(), 0o600).await?;
        let wtmax = pool.mounted().await?.wtmax as usize;
        let mut offset = 0;
        while offset < data.len() {
            let end = (offset + wtmax).min(data.len());
            pool.write_all(&fh, offset as u64, &data[offset..end], nfs3::stable_how::FILE_SYNC).await?;
            offset = end;
        }
        let args = nfs3::RENAME3args { from: dirop(dir, tmp.as_bytes()), to: dirop(dir, last.as_bytes()) };
        match rpc!(pool, "RENAME", |c| c.rename(&args)) {
            Nfs3Result::Ok(_) => Ok(()),
            Nfs3Result::Err((stat, _)) => Err(pool.status(stat, &format!("write-file {path:?}: RENAME"))),
        }
    }

    /// Copy a tree (or one file) to `to`, which must not exist; modes, owners, times and
    /// symlinks are preserved (see [`crate::copy`] for how). The copy is built under a hidden
    /// temporary name beside `to` and renamed into place at the end, so `to` appears complete or
    /// not at all; a failure removes the partial copy.
    /// Errors: `NotFound` (source, or the target's parent), `AlreadyExists` (target),
    /// `InvalidArgument` (target inside the source), as `mkdir`.
    #[tracing::instrument(name = "nfs.copy_tree", skip_all, fields(export = %export, from = %from, to = %to))]
    pub async fn copy_tree(&self, export: &NfsExport, from: &str, to: &str) -> Result<(), NfsError> {
        let pool = self.pool(export)?;
        let src = RelPath::parse(from)?;
        let dst = RelPath::parse(to)?;
        if dst.starts_with(&src) {
            return Err(NfsError::InvalidArgument(format!(
                "copy-tree {from:?} -> {to:?} on {}: target inside the source",
                pool.label
            )));
        }
        let what = format!("copy-tree {from:?} -> {to:?} on {}", pool.label);
        let (src_fh, src_attr) =
            pool.walk(from, &src.parts).await?.ok_or_else(|| NfsError::NotFound(format!("{what}: source missing")))?;
        let (dst_dir, dst_name) = pool.parent(&dst, "copy-tree").await?;
        if pool.lookup(&dst_dir, dst_name.as_bytes()).await?.is_some() {
            return Err(NfsError::AlreadyExists(format!("{what}: target exists")));
        }
        crate::copy::copy(pool, src_fh, src_attr, &dst_dir, dst_name, &what).await
    }

    /// Rename within the export (atomic on the server). Errors: `NotFound` (source or target's
    /// parent), `AlreadyExists` (target), as `mkdir`.
    #[tracing::instrument(name = "nfs.rename", skip_all, fields(export = %export, from = %from, to = %to))]
    pub async fn rename(&self, export: &NfsExport, from: &str, to: &str) -> Result<(), NfsError> {
        let pool = self.pool(export)?;
        let src = RelPath::parse(from)?;
        let dst = RelPath::parse(to)?;
        let what = format!("rename {from:?} -> {to:?} on {}", pool.label);
        if dst.starts_with(&src) {
            return Err(NfsError::InvalidArgument(format!("{what}: target inside the source")));
        }
        let (from_dir, from_name) = pool.parent(&src, "rename").await?;
        if pool.walk(from, &src.parts).await?.is_none() {
            return Err(NfsError::NotFound(format!("{what}: source missing")));
        }
        let (to_dir, to_name) = pool.parent(&dst, "rename").await?;
        pool.rename_checked(&from_dir, from_name.as_bytes(), &to_dir, to_name.as_bytes(), &what).await
    }

    /// Remove a file or a whole tree; an absent path (or parent) succeeds.
    /// Errors: `InvalidArgument` (the export root itself), as `mkdir`.
    #[tracing::instrument(name = "nfs.remove_all", skip_all, fields(export = %export, path = %path))]
    pub async fn remove_all(&self, export: &NfsExport, path: &str) -> Result<(), NfsError> {
        let pool = self.pool(export)?;
        let rel = RelPath::parse(path)?;
        let Some((parents, last)) = rel.split_last() else {
            return Err(NfsError::InvalidArgument(format!("refusing to remove the export root {} itself", pool.label)));
        };
        let dir = match pool.walk(path, parents).await? {
            Some((fh, a)) if a.type_ == ftype3::NF3DIR => fh,
            Some(_) | None => return Ok(()),
        };
        let Some((fh, attr)) = pool.lookup(&dir, last.as_bytes()).await? else {
            return Ok(());
        };
        if attr.type_ == ftype3::NF3LNK {
            return Err(NfsError::PermissionDenied(format!(
                "remove-all {path:?} on {}: crosses a symlink at {last:?}",
                pool.label
            )));
        }
        let is_dir = attr.type_ == ftype3::NF3DIR;
        if is_dir {
            pool.empty_dir(fh).await?;
        }
        pool.unlink(&dir, last.as_bytes(), is_dir).await
    }

    /// Bytes used by a tree: apparent sizes of files and symlinks summed (directories count 0,
    /// as in `dir`). Errors: `NotFound`, as `mkdir`.
    #[tracing::instrument(name = "nfs.usage", skip_all, fields(export = %export, path = %path))]
    pub async fn usage(&self, export: &NfsExport, path: &str) -> Result<u64, NfsError> {
        let pool = self.pool(export)?;
        let rel = RelPath::parse(path)?;
        let (fh, attr) = pool.walk(path, &rel.parts).await?.ok_or_else(|| {
            NfsError::NotFound(format!("usage {path:?} on {}: no such file or directory", pool.label))
        })?;
        if attr.type_ != ftype3::NF3DIR {
            return Ok(attr.size);
        }
        let mut total = 0u64;
        let mut stack = vec![fh];
        while let Some(dir) = stack.pop() {
            for child in pool.list(&dir).await? {
                match child.attr.type_ {
                    ftype3::NF3DIR => stack.push(child.fh),
                    _ => total = total.saturating_add(child.attr.size),
                }
            }
        }
        Ok(total)
    }

    /// Space of the export (FSSTAT): total and available to this (root) client.
    /// Errors: `PermissionDenied`, `Unavailable`, `Internal`.
    #[tracing::instrument(name = "nfs.fs_stats", skip_all, fields(export = %export))]
    pub async fn fs_stats(&self, export: &NfsExport) -> Result<Space, NfsError> {
        let pool = self.pool(export)?;
        let args = nfs3::FSSTAT3args { fsroot: pool.root().await? };
        match rpc!(pool, "FSSTAT", |c| c.fsstat(&args)) {
            Nfs3Result::Ok(ok) => Ok(Space { total_bytes: ok.tbytes, available_bytes: ok.abytes }),
            Nfs3Result::Err((stat, _)) => Err(pool.status(stat, "fs-stats")),
        }
    }
}
