//! `nfs`: the backend's NFS exports through the host's userspace NFS client
//! (`wasmcsi_nfs::NfsClient`), so a controller needs no privileged mount. One client per loaded
//! backend, built from its grants: exports not granted are refused before any network traffic,
//! connections are pooled per export, and every call is bounded by the backend's
//! `import_timeout` on top of the client's own timeouts, so a dead server answers `unavailable`
//! or `deadline-exceeded`, never a hung call.
//!
//! Its host functions see an [`NfsCtxView`]: the backend's [`NfsCtx`], nothing of the call.
use std::future::Future;
use std::time::Duration;

use wasmcsi_nfs::{NfsClient, NfsConfig, NfsError, NfsExport};
use wasmtime::component::{HasData, LinkerInstance};

use crate::bindings::types::{Error, Timestamp};
use crate::bindings::wasmcsi::backend::dir::{FileKind, FileStat, Space};
use crate::bindings::wasmcsi::backend::nfs::{self as wit, CopyProgress, Host, NfsExport as WitExport};
use crate::config::NfsGrant;

/// What `nfs` needs of one backend, resolved at load and shared by its calls.
pub struct NfsCtx {
    pub backend: String,
    /// the userspace NFS client scoped to the granted exports; `None` without an nfs grant
    pub client: Option<NfsClient>,
    /// how long one import may take
    pub import_timeout: Duration,
}

impl NfsCtx {
    /// The context of a backend granted `grants`: one pooled client scoped to the granted
    /// exports, whose own timeouts are kept below the import timeout so the client reports
    /// which server failed before the import's deadline cuts it off.
    pub fn new(backend: &str, grants: &[NfsGrant], import_timeout: Duration) -> Self {
        let client = (!grants.is_empty()).then(|| {
            let exports = grants.iter().map(|g| NfsExport::new(g.server.clone(), g.share.clone())).collect();
            let mut config = NfsConfig::new(exports);
            let budget = import_timeout.mul_f32(0.8);
            config.connect_timeout = config.connect_timeout.min(budget);
            config.op_timeout = config.op_timeout.min(budget);
            NfsClient::new(config)
        });
        Self { backend: backend.into(), client, import_timeout }
    }
}

/// What `nfs` sees of a call.
pub struct NfsCtxView<'a> {
    pub ctx: &'a NfsCtx,
}

/// A store whose calls can reach `nfs`: it lends `nfs` its view.
pub trait NfsView: Send {
    fn nfs(&mut self) -> NfsCtxView<'_>;
}

/// `nfs` for the linker: its host functions get an [`NfsCtxView`].
pub struct Nfs;

impl HasData for Nfs {
    type Data<'a> = NfsCtxView<'a>;
}

/// Link `nfs`'s host functions into `instance` (named as the component's contract version
/// names the interface).
pub fn add_to_instance<T: NfsView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Nfs>(instance, T::nfs)
}

/// The WIT error for a client error: one case each, the message kept.
pub fn to_wit(e: NfsError) -> Error {
    let msg = e.to_string();
    match e {
        NfsError::InvalidArgument(_) => Error::InvalidArgument(msg),
        NfsError::NotFound(_) => Error::NotFound(msg),
        NfsError::AlreadyExists(_) => Error::AlreadyExists(msg),
        NfsError::PermissionDenied(_) => Error::PermissionDenied(msg),
        NfsError::Unavailable { .. } => Error::Unavailable(msg),
        NfsError::NoSpace(_) => Error::ResourceExhausted(msg),
        NfsError::Internal(_) => Error::Internal(msg),
    }
}

fn stat_to_wit(s: wasmcsi_nfs::FileStat) -> FileStat {
    let kind = match s.kind {
        wasmcsi_nfs::FileKind::Directory => FileKind::Directory,
        wasmcsi_nfs::FileKind::File => FileKind::File,
        wasmcsi_nfs::FileKind::Symlink => FileKind::Symlink,
        wasmcsi_nfs::FileKind::Other => FileKind::Other,
    };
    FileStat {
        kind,
        size: s.size,
        mode: s.mode,
        uid: s.uid,
        gid: s.gid,
        modified: Timestamp { seconds: s.modified.seconds, nanos: s.modified.nanos },
    }
}

impl NfsCtxView<'_> {
    /// The client and the deadline of one import.
    fn client(&self) -> Result<(NfsClient, Duration), Error> {
        let client = self
            .ctx
            .client
            .clone()
            .ok_or_else(|| Error::PermissionDenied(format!("backend {} has no nfs grant", self.ctx.backend)))?;
        Ok((client, self.ctx.import_timeout))
    }
}

/// Runs one client operation under the import timeout.
async fn nfs_call<T, F, Fut>(
    handle: Result<(NfsClient, Duration), Error>,
    what: &str,
    target: WitExport,
    op: F,
) -> Result<T, Error>
where
    F: FnOnce(NfsClient, NfsExport) -> Fut,
    Fut: Future<Output = Result<T, NfsError>>,
{
    let (client, timeout) = handle?;
    let export = NfsExport::new(target.server, target.share);
    match tokio::time::timeout(timeout, op(client, export.clone())).await {
        Ok(result) => result.map_err(to_wit),
        Err(_) => Err(Error::DeadlineExceeded(format!("nfs {what} on {export} did not finish within {timeout:?}"))),
    }
}

impl Host for NfsCtxView<'_> {
    #[tracing::instrument(name = "import.nfs.mkdir", skip_all, fields(backend = %self.ctx.backend, %path))]
    async fn mkdir(&mut self, target: WitExport, path: String, mode: u32, uid: u32, gid: u32) -> Result<(), Error> {
        nfs_call(self.client(), "mkdir", target, |c, e| async move { c.mkdir(&e, &path, mode, uid, gid).await }).await
    }
    #[tracing::instrument(name = "import.nfs.stat", skip_all, fields(backend = %self.ctx.backend, %path))]
    async fn stat(&mut self, target: WitExport, path: String) -> Result<Option<FileStat>, Error> {
        let s = nfs_call(self.client(), "stat", target, |c, e| async move { c.stat(&e, &path).await }).await?;
        Ok(s.map(stat_to_wit))
    }
    #[tracing::instrument(name = "import.nfs.read_dir", skip_all, fields(backend = %self.ctx.backend, %path))]
    async fn read_dir(&mut self, target: WitExport, path: String) -> Result<Vec<String>, Error> {
        nfs_call(self.client(), "read-dir", target, |c, e| async move { c.read_dir(&e, &path).await }).await
    }
    #[tracing::instrument(name = "import.nfs.read_file", skip_all, fields(backend = %self.ctx.backend, %path))]
    async fn read_file(&mut self, target: WitExport, path: String) -> Result<Vec<u8>, Error> {
        nfs_call(self.client(), "read-file", target, |c, e| async move { c.read_file(&e, &path).await }).await
    }
    #[tracing::instrument(name = "import.nfs.write_file", skip_all, fields(backend = %self.ctx.backend, %path))]
    async fn write_file(&mut self, target: WitExport, path: String, data: Vec<u8>) -> Result<(), Error> {
        nfs_call(self.client(), "write-file", target, |c, e| async move { c.write_file(&e, &path, &data).await }).await
    }
    #[tracing::instrument(name = "import.nfs.copy_tree", skip_all, fields(backend = %self.ctx.backend, %from, %to))]
    async fn copy_tree(&mut self, target: WitExport, from: String, to: String) -> Result<(), Error> {
        nfs_call(self.client(), "copy-tree", target, |c, e| async move { c.copy_tree(&e, &from, &to).await }).await
    }
    #[tracing::instrument(name = "import.nfs.copy_tree_background", skip_all, fields(backend = %self.ctx.backend, %from, %to))]
    async fn copy_tree_background(
        &mut self,
        target: WitExport,
        from: String,
        to: String,
    ) -> Result<CopyProgress, Error> {
        // A small tree finishes inside one call; the answer comes back well before the import
        // (and the CSI call) times out.
        let wait = (self.ctx.import_timeout / 2).min(Duration::from_secs(2));
        let p = nfs_call(self.client(), "copy-tree-background", target, |c, e| async move {
            c.copy_tree_background(&e, &from, &to, wait).await
        })
        .await?;
        Ok(CopyProgress { done: p.done, bytes: p.bytes })
    }
    #[tracing::instrument(name = "import.nfs.cancel_copy", skip_all, fields(backend = %self.ctx.backend, %to))]
    async fn cancel_copy(&mut self, target: WitExport, to: String) {
        let Ok((client, _)) = self.client() else { return };
        client.cancel_copy(&NfsExport::new(target.server, target.share), &to).await;
    }
    #[tracing::instrument(name = "import.nfs.rename", skip_all, fields(backend = %self.ctx.backend, %from, %to))]
    async fn rename(&mut self, target: WitExport, from: String, to: String) -> Result<(), Error> {
        nfs_call(self.client(), "rename", target, |c, e| async move { c.rename(&e, &from, &to).await }).await
    }
    #[tracing::instrument(name = "import.nfs.remove_all", skip_all, fields(backend = %self.ctx.backend, %path))]
    async fn remove_all(&mut self, target: WitExport, path: String) -> Result<(), Error> {
        nfs_call(self.client(), "remove-all", target, |c, e| async move { c.remove_all(&e, &path).await }).await
    }
    #[tracing::instrument(name = "import.nfs.usage", skip_all, fields(backend = %self.ctx.backend, %path))]
    async fn usage(&mut self, target: WitExport, path: String) -> Result<u64, Error> {
        nfs_call(self.client(), "usage", target, |c, e| async move { c.usage(&e, &path).await }).await
    }
    #[tracing::instrument(name = "import.nfs.fs_stats", skip_all, fields(backend = %self.ctx.backend))]
    async fn fs_stats(&mut self, target: WitExport) -> Result<Space, Error> {
        let s = nfs_call(self.client(), "fs-stats", target, |c, e| async move { c.fs_stats(&e).await }).await?;
        Ok(Space { total_bytes: s.total_bytes, available_bytes: s.available_bytes })
    }
}

#[cfg(test)]
mod tests {
    //! The provider against a real nfs-ganesha (started by `wasmcsi_ganesha` in a private
    //! namespace; needs root and the packages `scripts/nfs-setup` installs): the WIT calls a
    //! guest would make, their error cases, and the import timeout.
    use super::*;
    use wasmcsi_ganesha::Ganesha;

    fn ctx(client: Option<NfsClient>, timeout: Duration) -> NfsCtx {
        NfsCtx { backend: "nfs-test".into(), client, import_timeout: timeout }
    }

    fn wit(e: &NfsExport) -> WitExport {
        WitExport { server: e.server.clone(), share: e.share.clone() }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wit_calls_reach_ganesha_and_errors_map_to_their_cases() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: not root (ganesha runs in a private namespace)");
            return;
        }
        let g = Ganesha::start().expect("start ganesha");
        let ctx = ctx(Some(NfsClient::new(g.config())), Duration::from_secs(5));
        let mut s = NfsCtxView { ctx: &ctx };
        let e = wit(&g.export());
        s.mkdir(e.clone(), "vols/pvc-1".into(), 0o2775, 1000, 1000).await.expect("mkdir");
        s.write_file(e.clone(), "vols/pvc-1/.meta".into(), b"{\"size\":1}".to_vec()).await.expect("write");
        assert_eq!(s.read_file(e.clone(), "vols/pvc-1/.meta".into()).await.expect("read"), b"{\"size\":1}");
        let st = s.stat(e.clone(), "vols/pvc-1".into()).await.expect("stat").expect("exists");
        assert_eq!((st.kind, st.mode, st.uid, st.gid), (FileKind::Directory, 0o2775, 1000, 1000));
        s.mkdir(e.clone(), "snaps".into(), 0o755, 0, 0).await.expect("mkdir snaps");
        s.copy_tree(e.clone(), "vols/pvc-1".into(), "snaps/s1".into()).await.expect("copy-tree");
        assert_eq!(s.read_dir(e.clone(), "snaps/s1".into()).await.expect("read-dir"), [".meta"]);
        assert!(s.usage(e.clone(), "snaps".into()).await.expect("usage") > 0);
        assert!(s.fs_stats(e.clone()).await.expect("fs-stats").total_bytes > 0);
        assert!(matches!(s.stat(e.clone(), "nope".into()).await, Ok(None)));
        assert!(matches!(s.read_file(e.clone(), "nope".into()).await, Err(Error::NotFound(_))));
        assert!(matches!(s.mkdir(e.clone(), "../x".into(), 0o755, 0, 0).await, Err(Error::InvalidArgument(_))));
        let copy = s.copy_tree(e.clone(), "vols/pvc-1".into(), "snaps/s1".into()).await;
        assert!(matches!(copy, Err(Error::AlreadyExists(_))), "{copy:?}");
        s.remove_all(e.clone(), "vols".into()).await.expect("remove-all");
        s.remove_all(e.clone(), "vols".into()).await.expect("remove-all of an absent tree");
        let other = WitExport { server: e.server.clone(), share: "/elsewhere".into() };
        assert!(matches!(s.stat(other, "x".into()).await, Err(Error::PermissionDenied(_))), "ungranted export");

        // A frozen server: the call ends within the client's timeouts, as unavailable or
        // deadline-exceeded, never hangs.
        g.pause().expect("pause");
        let started = std::time::Instant::now();
        let frozen = s.stat(e.clone(), "snaps".into()).await;
        g.resume().expect("resume");
        assert!(matches!(frozen, Err(Error::Unavailable(_) | Error::DeadlineExceeded(_))), "{frozen:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn without_a_grant_every_call_is_permission_denied() {
        let ctx = ctx(None, Duration::from_secs(1));
        let mut s = NfsCtxView { ctx: &ctx };
        let e = WitExport { server: "127.0.0.1".into(), share: "/export".into() };
        assert!(matches!(s.stat(e, "x".into()).await, Err(Error::PermissionDenied(_))));
    }
}
