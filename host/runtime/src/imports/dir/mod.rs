//! `dir`: directory operations under the roots the operator granted a backend.
//!
//! The guest names a root and a relative path (`path.rs` checks it); every operation then
//! opens what it works on beneath the root's file descriptor, following no symlink
//! (`root.rs`), and decides on what it opened, so a pod that swaps entries of its volume
//! meanwhile can never make the host read, copy or remove anything outside the root.
//!
//! Where each runs: single-entry operations (mkdir, stat, read-dir, read-file, write-file,
//! rename, fs-stats) take microseconds and run inline (see `capabilities::local_io`).
//! Tree-sized ones never do: `remove-all` and `usage` run on the blocking pool and stop
//! between entries at the import's deadline (`tree.rs`; a retry of `remove-all` goes on where
//! it stopped), and `copy-tree` runs as a background copy that a retry collects (`copies.rs`).
//! The host's temporary entries are named and locked so a dead writer's are recognised, hidden
//! from `read-dir` and swept (`temp.rs`).
//!
//! Its host functions see a [`DirCtxView`]: the backend's [`DirCtx`] and the call's deadline.
mod copies;
#[cfg(feature = "test-hooks")]
mod hold;
mod ops;
mod path;
mod root;
mod temp;
mod tree;

pub use copies::CopyJobs;
#[cfg(feature = "test-hooks")]
pub use hold::{CopyHold, hold_copies};
pub use path::resolve;

use crate::bindings::types::Error;
use crate::bindings::wasmcsi::backend::dir::{self as wit, FileStat, Host, Space};
use crate::local_io::local_io;
use path::GuestPath;
use root::Root;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tree::{Progress, Stop};
use wasmtime::component::{HasData, LinkerInstance};

/// What `dir` needs of one backend, resolved at load and shared by its calls.
pub struct DirCtx {
    pub backend: String,
    /// the granted roots: name → host directory
    pub roots: BTreeMap<String, PathBuf>,
    /// how long one import may take
    pub import_timeout: Duration,
    /// `copy-tree`s running in the background, shared by every backend of the runtime
    pub copies: Arc<CopyJobs>,
}

/// What `dir` sees of a call.
pub struct DirCtxView<'a> {
    pub ctx: &'a DirCtx,
    /// when the call must be over: tree-sized imports stop before it
    pub deadline: Instant,
}

/// A store whose calls can reach `dir`: it lends `dir` its view.
pub trait DirView: Send {
    fn dir(&mut self) -> DirCtxView<'_>;
}

/// `dir` for the linker: its host functions get a [`DirCtxView`].
pub struct Dir;

impl HasData for Dir {
    type Data<'a> = DirCtxView<'a>;
}

/// Link `dir`'s host functions into `instance` (named as the component's contract version
/// names the interface).
pub fn add_to_instance<T: DirView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Dir>(instance, T::dir)
}

/// Time a tree-sized import leaves its call to turn the answer into the guest's own.
const ANSWER_MARGIN: Duration = Duration::from_millis(100);

fn open_root(path: &Path) -> Result<Root, Error> {
    Root::open_or_create(path).map_err(|e| ops::errno(&format!("dir root {}", path.display()), e))
}

// The same operations for callers without a call (native backends, tests): run to the end,
// on the caller's thread.
pub fn mkdir(root: &Path, path: &str, mode: u32) -> Result<(), Error> {
    ops::mkdir(&open_root(root)?, GuestPath::parse(path)?, mode)
}
pub fn stat(root: &Path, path: &str) -> Result<Option<FileStat>, Error> {
    ops::stat(&open_root(root)?, GuestPath::parse(path)?)
}
pub fn read_dir(root: &Path, path: &str) -> Result<Vec<String>, Error> {
    ops::read_dir(&open_root(root)?, GuestPath::parse(path)?)
}
pub fn read_file(root: &Path, path: &str) -> Result<Vec<u8>, Error> {
    ops::read_file(&open_root(root)?, GuestPath::parse(path)?)
}
pub fn write_file(root: &Path, path: &str, data: &[u8]) -> Result<(), Error> {
    ops::write_file(&open_root(root)?, GuestPath::parse(path)?, data)
}
#[cfg_attr(not(feature = "native"), allow(dead_code, reason = "native SDK backends call it"))]
pub fn copy_tree(root: &Path, from: &str, to: &str) -> Result<(), Error> {
    let (from, to) = (GuestPath::parse(from)?, GuestPath::parse(to)?);
    ops::copy_to_temp(&open_root(root)?, from, to, &Stop::never(), &Progress::default())?.place()
}
pub fn rename(root: &Path, from: &str, to: &str) -> Result<(), Error> {
    ops::rename(&open_root(root)?, GuestPath::parse(from)?, GuestPath::parse(to)?)
}
#[cfg_attr(not(feature = "native"), allow(dead_code, reason = "native SDK backends call it"))]
pub fn remove_all(root: &Path, path: &str) -> Result<(), Error> {
    let p = GuestPath::parse(path)?;
    if p.is_root() {
        return Err(Error::InvalidArgument(format!("refusing to remove dir root {} itself", root.display())));
    }
    ops::remove_all(&open_root(root)?, p, &Stop::never())
}
#[cfg_attr(not(feature = "native"), allow(dead_code, reason = "native SDK backends call it"))]
pub fn usage(root: &Path, path: &str) -> Result<u64, Error> {
    ops::usage(&open_root(root)?, GuestPath::parse(path)?, &Stop::never())
}
/// Space of the root's file system; none at all when the root cannot be made (its parent is
/// missing, see [`Root::open_or_create`]): a capacity of 0 keeps the scheduler away from where
/// the root is missing, where an error would keep it from placing any pod of the driver.
pub fn space(root: &Path) -> Result<Space, Error> {
    match Root::open_or_create(root) {
        Ok(r) => ops::space(&r),
        Err(rustix::io::Errno::NOENT) => {
            tracing::warn!(root = %root.display(), "dir root missing and its parent too: reporting no space");
            Ok(Space { total_bytes: 0, available_bytes: 0 })
        }
        Err(e) => Err(ops::errno(&format!("dir root {}", root.display()), e)),
    }
}

impl DirCtx {
    /// The host directory of a granted root.
    pub fn root(&self, root: &str) -> Option<&Path> {
        self.roots.get(root).map(PathBuf::as_path)
    }
}

impl DirCtxView<'_> {
    fn root(&self, root: &str) -> Result<PathBuf, Error> {
        self.ctx.roots.get(root).cloned().ok_or_else(|| {
            Error::PermissionDenied(format!("dir root {root:?} is not granted to backend {}", self.ctx.backend))
        })
    }

    /// Run one single-entry operation inline (see `local_io` for why).
    fn on_root<T>(&self, root: &str, f: impl FnOnce(&Path) -> Result<T, Error>) -> Result<T, Error> {
        let base = self.root(root)?;
        local_io(|| f(&base))
    }

    /// Until when a tree-sized import may work: its import timeout, and never so close to the
    /// call's deadline that the guest cannot answer.
    fn tree_deadline(&self) -> Instant {
        let by_import = Instant::now() + self.ctx.import_timeout;
        let by_call = self.deadline.checked_sub(ANSWER_MARGIN).unwrap_or_else(Instant::now);
        by_import.min(by_call)
    }

    /// A tree walk on the blocking pool, stopping at [`DirCtxView::tree_deadline`]. The future
    /// holds nothing of the view.
    fn tree_op<T: Send + 'static>(
        &self,
        root: &str,
        what: &'static str,
        f: impl FnOnce(&Root, &Stop) -> Result<T, Error> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, Error>> + Send + 'static {
        let base = self.root(root);
        let stop = Stop::at(self.tree_deadline());
        async move {
            let base = base?;
            tokio::task::spawn_blocking(move || f(&open_root(&base)?, &stop))
                .await
                .map_err(|e| Error::Internal(format!("{what}: the walk failed: {e}")))?
        }
    }
}

impl Host for DirCtxView<'_> {
    async fn roots(&mut self) -> Vec<String> {
        self.ctx.roots.keys().cloned().collect()
    }
    #[tracing::instrument(name = "import.dir.mkdir", skip_all, fields(backend = %self.ctx.backend, %root, %path))]
    async fn mkdir(&mut self, root: String, path: String, mode: u32) -> Result<(), Error> {
        self.on_root(&root, |r| mkdir(r, &path, mode))
    }
    #[tracing::instrument(name = "import.dir.stat", skip_all, fields(backend = %self.ctx.backend, %root, %path))]
    async fn stat(&mut self, root: String, path: String) -> Result<Option<FileStat>, Error> {
        self.on_root(&root, |r| stat(r, &path))
    }
    #[tracing::instrument(name = "import.dir.read_dir", skip_all, fields(backend = %self.ctx.backend, %root, %path))]
    async fn read_dir(&mut self, root: String, path: String) -> Result<Vec<String>, Error> {
        self.on_root(&root, |r| read_dir(r, &path))
    }
    #[tracing::instrument(name = "import.dir.read_file", skip_all, fields(backend = %self.ctx.backend, %root, %path))]
    async fn read_file(&mut self, root: String, path: String) -> Result<Vec<u8>, Error> {
        self.on_root(&root, |r| read_file(r, &path))
    }
    #[tracing::instrument(name = "import.dir.write_file", skip_all, fields(backend = %self.ctx.backend, %root, %path))]
    async fn write_file(&mut self, root: String, path: String, data: Vec<u8>) -> Result<(), Error> {
        self.on_root(&root, |r| write_file(r, &path, &data))
    }
    #[tracing::instrument(name = "import.dir.copy_tree", skip_all, fields(backend = %self.ctx.backend, %root, %from, %to))]
    async fn copy_tree(&mut self, root: String, from: String, to: String) -> Result<(), Error> {
        let base = self.root(&root)?;
        let wait = self.tree_deadline().saturating_duration_since(Instant::now());
        let (copies, backend) = (self.ctx.copies.clone(), self.ctx.backend.clone());
        copies.copy_tree(&backend, base, &from, &to, wait).await
    }
    #[tracing::instrument(name = "import.dir.rename", skip_all, fields(backend = %self.ctx.backend, %root, %from, %to))]
    async fn rename(&mut self, root: String, from: String, to: String) -> Result<(), Error> {
        self.on_root(&root, |r| rename(r, &from, &to))
    }
    #[tracing::instrument(name = "import.dir.remove_all", skip_all, fields(backend = %self.ctx.backend, %root, %path))]
    async fn remove_all(&mut self, root: String, path: String) -> Result<(), Error> {
        if path.is_empty() {
            return Err(Error::InvalidArgument(format!("refusing to remove dir root {root:?} itself")));
        }
        self.tree_op(&root, "remove-all", move |r, stop| ops::remove_all(r, GuestPath::parse(&path)?, stop)).await
    }
    #[tracing::instrument(name = "import.dir.usage", skip_all, fields(backend = %self.ctx.backend, %root, %path))]
    async fn usage(&mut self, root: String, path: String) -> Result<u64, Error> {
        self.tree_op(&root, "usage", move |r, stop| ops::usage(r, GuestPath::parse(&path)?, stop)).await
    }
    #[tracing::instrument(name = "import.dir.fs_stats", skip_all, fields(backend = %self.ctx.backend, %root))]
    async fn fs_stats(&mut self, root: String) -> Result<Space, Error> {
        self.on_root(&root, space)
    }
}

#[cfg(test)]
mod tests;
