//! `copy-tree` through the client. NFSv3 has no server-side copy (COPY is NFSv4.2), so the data
//! passes through the host; what makes it fast is keeping many calls in flight: directories are
//! created level by level in parallel, files are copied several at a time, and each large file
//! moves in `copy_chunk` pieces (READ then unstable WRITE) several at a time, with one COMMIT per
//! file. Chunks that read as all zeros are not written, so sparse files stay sparse.
//!
//! Metadata: every object is created owner-only (0600/0700) and receives its final mode, owner,
//! group, atime and mtime only once its content is complete (a directory's mtime changes with
//! every entry created in it, so directories are stamped last). Hard links are copied as
//! separate files; sockets, fifos and devices are skipped, as in the `dir` capability.
//!
//! Memory: the source tree's listing is held while copying (about 200 bytes per entry).
use crate::NfsError;
use crate::handles::{Child, dirop, temp_name};
use crate::pool::Pool;
use futures::{StreamExt, TryStreamExt};
use nfs3_client::nfs3_types::nfs3::{
    self, Nfs3Option, Nfs3Result, fattr3, ftype3, nfs_fh3, sattr3, set_atime, set_mtime, stable_how, writeverf3,
};
use nfs3_client::nfs3_types::xdr_codec::Opaque;
use std::sync::Mutex;

/// A source directory, in breadth-first order; `parent` indexes the same list.
struct DirNode {
    src: nfs_fh3,
    attr: fattr3,
    parent: usize,
    depth: usize,
    name: Vec<u8>,
}

/// A source file or symlink, and the index of its directory.
struct Leaf {
    child: Child,
    parent: usize,
}

fn final_attrs(a: &fattr3) -> sattr3 {
    sattr3 {
        mode: Nfs3Option::Some(a.mode & 0o7777),
        uid: Nfs3Option::Some(a.uid),
        gid: Nfs3Option::Some(a.gid),
        size: Nfs3Option::None,
        atime: set_atime::SET_TO_CLIENT_TIME(a.atime),
        mtime: set_mtime::SET_TO_CLIENT_TIME(a.mtime),
    }
}

fn mode_only(mode: u32) -> sattr3 {
    sattr3 { mode: Nfs3Option::Some(mode & 0o7777), ..sattr3::default() }
}

impl Pool {
    /// CREATE GUARDED (fails if the name exists) with `mode`.
    pub(crate) async fn create(&self, dir: &nfs_fh3, n: &[u8], mode: u32) -> Result<nfs_fh3, NfsError> {
        let args = nfs3::CREATE3args { where_: dirop(dir, n), how: nfs3::createhow3::GUARDED(mode_only(mode)) };
        let ok = match rpc!(self, "CREATE", |c| c.create(&args)) {
            Nfs3Result::Ok(ok) => ok,
            Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "CREATE")),
        };
        self.created_handle(ok.obj, dir, n, "CREATE").await
    }

    /// MKDIR with `mode`, returning the new handle.
    async fn mkdir_fh(&self, dir: &nfs_fh3, n: &[u8], mode: u32) -> Result<nfs_fh3, NfsError> {
        let args = nfs3::MKDIR3args { where_: dirop(dir, n), attributes: mode_only(mode) };
        let ok = match rpc!(self, "MKDIR", |c| c.mkdir(&args)) {
            Nfs3Result::Ok(ok) => ok,
            Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "MKDIR")),
        };
        self.created_handle(ok.obj, dir, n, "MKDIR").await
    }

    /// The handle a CREATE/MKDIR reply carries; the reply may omit it (optional in NFSv3), and
    /// then a LOOKUP of the new name finds it.
    async fn created_handle(
        &self,
        obj: Nfs3Option<nfs_fh3>,
        dir: &nfs_fh3,
        n: &[u8],
        op: &str,
    ) -> Result<nfs_fh3, NfsError> {
        match obj {
            Nfs3Option::Some(fh) => Ok(fh),
            Nfs3Option::None => self
                .lookup(dir, n)
                .await?
                .map(|(fh, _)| fh)
                .ok_or_else(|| NfsError::Internal(format!("{op} on {}: created but gone", self.label))),
        }
    }

    /// WRITE all of `data` at `offset` (a server may accept less per call); the write verifier.
    pub(crate) async fn write_all(
        &self,
        fh: &nfs_fh3,
        offset: u64,
        data: &[u8],
        stable: stable_how,
    ) -> Result<writeverf3, NfsError> {
        let mut done = 0usize;
        let mut verf = writeverf3::default();
        while done < data.len() {
            let rest = &data[done..];
            let args = nfs3::WRITE3args {
                file: fh.clone(),
                offset: offset + done as u64,
                count: u32::try_from(rest.len()).unwrap_or(u32::MAX),
                stable,
                data: Opaque::borrowed(rest),
            };
            let ok = match rpc!(self, "WRITE", |c| c.write(&args)) {
                Nfs3Result::Ok(ok) => ok,
                Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "WRITE")),
            };
            if ok.count == 0 {
                return Err(NfsError::Internal(format!("WRITE on {}: server accepted 0 bytes", self.label)));
            }
            done += ok.count as usize;
            verf = ok.verf;
        }
        Ok(verf)
    }

    /// READ `len` bytes at `offset` (fewer at end of file).
    async fn read_exact(&self, fh: &nfs_fh3, offset: u64, len: u32) -> Result<Vec<u8>, NfsError> {
        let mut buf = Vec::with_capacity(len as usize);
        while (buf.len() as u64) < u64::from(len) {
            let args =
                nfs3::READ3args { file: fh.clone(), offset: offset + buf.len() as u64, count: len - buf.len() as u32 };
            let ok = match rpc!(self, "READ", |c| c.read(&args)) {
                Nfs3Result::Ok(ok) => ok,
                Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "READ")),
            };
            buf.extend_from_slice(ok.data.as_ref());
            if ok.eof || ok.data.is_empty() {
                break;
            }
        }
        Ok(buf)
    }

    /// Copy `size` bytes of content from `src` to the (empty) `dst`.
    async fn copy_data(&self, src: &nfs_fh3, dst: &nfs_fh3, size: u64) -> Result<(), NfsError> {
        if size == 0 {
            return Ok(());
        }
        let m = self.mounted().await?;
        let chunk = self.config().copy_chunk.min(m.rtmax).min(m.wtmax).max(4096);
        let parallel = self.config().max_connections.max(1);
        // (verifier of the unstable writes, end of the last byte written)
        let state: Mutex<(Option<writeverf3>, u64, bool)> = Mutex::new((None, 0, false));
        let offsets = (0..size).step_by(chunk as usize);
        futures::stream::iter(offsets.map(Ok))
            .try_for_each_concurrent(parallel, |offset| {
                let state = &state;
                async move {
                    let len = u32::try_from((size - offset).min(u64::from(chunk))).unwrap_or(chunk);
                    let data = self.read_exact(src, offset, len).await?;
                    if data.iter().all(|b| *b == 0) {
                        return Ok(());
                    }
                    let verf = self.write_all(dst, offset, &data, stable_how::UNSTABLE).await?;
                    crate::background::copied(data.len() as u64);
                    let mut s = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    if s.0.is_some_and(|v| v != verf) {
                        s.2 = true;
                    }
                    s.0 = Some(verf);
                    s.1 = s.1.max(offset + data.len() as u64);
                    Ok::<(), NfsError>(())
                }
            })
            .await?;
        let (verf, written_end, verf_changed) = *state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(verf) = verf {
            let args = nfs3::COMMIT3args { file: dst.clone(), offset: 0, count: 0 };
            let commit_timeout = self.config().commit_timeout;
            let committed = match rpc!(self, "COMMIT", timeout = commit_timeout, |c| c.commit(&args)) {
                Nfs3Result::Ok(ok) => ok.verf,
                Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "COMMIT")),
            };
            // A new verifier means the server restarted and may have lost unstable writes.
            if verf_changed || committed != verf {
                return Err(
                    self.unavailable(format!("{} restarted during a copy; unstable writes may be lost", self.label))
                );
            }
        }
        // Trailing zero chunks were skipped: extend the file to its size (a hole).
        if written_end < size {
            let attrs = sattr3 { size: Nfs3Option::Some(size), ..sattr3::default() };
            self.setattr(dst, attrs, "copy-tree: SETATTR size").await?;
        }
        Ok(())
    }

    async fn copy_file(&self, src: &nfs_fh3, attr: &fattr3, dir: &nfs_fh3, n: &[u8]) -> Result<(), NfsError> {
        let fh = self.create(dir, n, 0o600).await?;
        self.copy_data(src, &fh, attr.size).await?;
        self.setattr(&fh, final_attrs(attr), "copy-tree: SETATTR").await?;
        // A chown may clear setuid/setgid on a file: set the mode once more, alone.
        if attr.mode & 0o6000 != 0 {
            self.setattr(&fh, mode_only(attr.mode), "copy-tree: SETATTR mode").await?;
        }
        Ok(())
    }

    async fn copy_symlink(&self, src: &nfs_fh3, attr: &fattr3, dir: &nfs_fh3, n: &[u8]) -> Result<(), NfsError> {
        let args = nfs3::READLINK3args { symlink: src.clone() };
        let target = match rpc!(self, "READLINK", |c| c.readlink(&args)) {
            Nfs3Result::Ok(ok) => ok.data.0.to_vec(),
            Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "READLINK")),
        };
        let args = nfs3::SYMLINK3args {
            where_: dirop(dir, n),
            symlink: nfs3::symlinkdata3 {
                // Owner and times at creation too: some servers (ganesha's VFS) ignore a
                // later SETATTR of times on a symlink.
                symlink_attributes: sattr3 { mode: Nfs3Option::None, ..final_attrs(attr) },
                symlink_data: nfs3::nfspath3(Opaque::owned(target)),
            },
        };
        let ok = match rpc!(self, "SYMLINK", |c| c.symlink(&args)) {
            Nfs3Result::Ok(ok) => ok,
            Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "SYMLINK")),
        };
        let fh = match ok.obj {
            Nfs3Option::Some(fh) => fh,
            Nfs3Option::None => self
                .lookup(dir, n)
                .await?
                .map(|(fh, _)| fh)
                .ok_or_else(|| NfsError::Internal(format!("SYMLINK on {}: created but gone", self.label)))?,
        };
        // A symlink's mode means nothing on Linux; owner and times are what `cp -a` keeps.
        let attrs = sattr3 { mode: Nfs3Option::None, ..final_attrs(attr) };
        self.setattr(&fh, attrs, "copy-tree: SETATTR symlink").await
    }
}

/// Copy `src` (a directory, file or symlink) to `dst_dir/dst_name` via a temporary name.
pub(crate) async fn copy(
    pool: &Pool,
    src: nfs_fh3,
    attr: fattr3,
    dst_dir: &nfs_fh3,
    dst_name: &str,
    what: &str,
) -> Result<(), NfsError> {
    let tmp = temp_name("copy");
    let result = match attr.type_ {
        ftype3::NF3DIR => copy_dir(pool, src, attr, dst_dir, tmp.as_bytes()).await,
        ftype3::NF3REG => pool.copy_file(&src, &attr, dst_dir, tmp.as_bytes()).await,
        other => Err(NfsError::InvalidArgument(format!("{what}: source is a {other}, not a directory or file"))),
    };
    #[cfg(feature = "test-hooks")]
    if result.is_ok() {
        crate::hold::wait_while_held(&pool.export).await;
    }
    let result = match result {
        Ok(()) => pool.rename_checked(dst_dir, tmp.as_bytes(), dst_dir, dst_name.as_bytes(), what).await,
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        // Best effort, as `dir` does: remove the partial copy; its hidden name is unique.
        if let Ok(Some((fh, a))) = pool.lookup(dst_dir, tmp.as_bytes()).await {
            let is_dir = a.type_ == ftype3::NF3DIR;
            if is_dir {
                let _ = pool.empty_dir(fh).await;
            }
            let _ = pool.unlink(dst_dir, tmp.as_bytes(), is_dir).await;
        }
        return Err(e);
    }
    Ok(())
}

async fn copy_dir(pool: &Pool, src: nfs_fh3, attr: fattr3, dst_dir: &nfs_fh3, tmp: &[u8]) -> Result<(), NfsError> {
    let parallel = pool.config().max_connections.max(1);
    // 1. The source tree, breadth first.
    let mut dirs = vec![DirNode { src, attr, parent: 0, depth: 0, name: tmp.to_vec() }];
    let mut leaves = Vec::new();
    let mut i = 0;
    while i < dirs.len() {
        let depth = dirs[i].depth + 1;
        for child in pool.list(&dirs[i].src).await? {
            match child.attr.type_ {
                ftype3::NF3DIR => {
                    dirs.push(DirNode { src: child.fh, attr: child.attr, parent: i, depth, name: child.name })
                }
                ftype3::NF3REG | ftype3::NF3LNK => leaves.push(Leaf { child, parent: i }),
                other => tracing::debug!(name = %String::from_utf8_lossy(&child.name), kind = %other, "skipped"),
            }
        }
        i += 1;
    }
    tracing::debug!(dirs = dirs.len(), leaves = leaves.len(), "copy plan");

    // 2. The directories, owner-only for now, one level at a time (parents before children).
    let mut dest: Vec<Option<nfs_fh3>> = vec![None; dirs.len()];
    dest[0] = Some(pool.mkdir_fh(dst_dir, tmp, 0o700).await?);
    let mut start = 1;
    while start < dirs.len() {
        let depth = dirs[start].depth;
        let end = dirs[start..].iter().position(|d| d.depth != depth).map_or(dirs.len(), |p| start + p);
        let made: Vec<nfs_fh3> = futures::stream::iter(start..end)
            .map(|j| {
                let parent = dest[dirs[j].parent].clone();
                let n = &dirs[j].name;
                async move {
                    let parent = parent.ok_or_else(|| NfsError::Internal("copy-tree: parent not created".into()))?;
                    pool.mkdir_fh(&parent, n, 0o700).await
                }
            })
            .buffered(parallel)
            .try_collect()
            .await?;
        for (j, fh) in (start..end).zip(made) {
            dest[j] = Some(fh);
        }
        start = end;
    }
    let dest: Vec<nfs_fh3> = dest.into_iter().map(|d| d.unwrap_or_default()).collect();

    // 3. Files and symlinks, several at a time.
    futures::stream::iter(leaves.iter().map(Ok))
        .try_for_each_concurrent(parallel, |leaf| {
            let dir = &dest[leaf.parent];
            async move {
                let c = &leaf.child;
                if c.attr.type_ == ftype3::NF3LNK {
                    pool.copy_symlink(&c.fh, &c.attr, dir, &c.name).await
                } else {
                    pool.copy_file(&c.fh, &c.attr, dir, &c.name).await
                }
            }
        })
        .await?;

    // 4. Directory metadata last: creating entries changed their mtimes. Stamping one
    //    directory does not touch its parent, so any order works.
    futures::stream::iter(dirs.iter().zip(&dest).map(Ok))
        .try_for_each_concurrent(parallel, |(d, fh)| async move {
            pool.setattr(fh, final_attrs(&d.attr), "copy-tree: SETATTR directory").await
        })
        .await?;
    Ok(())
}
