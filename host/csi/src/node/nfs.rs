//! The nfs attacher: NodeStage mounts `server:/share/path` on the staging path with the kernel
//! NFS client, the backend's mount options and then the CO's (a PV's `mountOptions`, kubelet's
//! SELinux context), once the export is found granted to the backend on this node; NodePublish then bind-mounts the staging path like any other volume.
//! Planning is pure (what is mounted where, what to do about it); the mount and unmount run
//! `mount(8)` / umount2(2) under deadlines, because an NFS server that died can block either in
//! the kernel for minutes: a mount that does not finish in time is killed and reported
//! UNAVAILABLE, and an unmount that does not finish falls back to a forced, then a lazy
//! (detached) unmount, so kubelet can tear the pod down and the node is not wedged.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::MntFlags;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::config::NfsGrant;
use wasmcsi_runtime::driver;

use super::attacher::{
    Attacher, ConfigSource, Expand, Publish, Stage, Stats, Unstaged, blocking, ensure_unmounted, mount_err,
    publish_staged,
};
use super::bounded::bounded;
use super::mount_options;
use super::mounts::MountSystem;
use super::usage;
use crate::error::{CsiError, CsiResult};
use wasmcsi_mountinfo::{self as mountinfo, MountEntry};

pub struct NfsAttacher {
    config: Arc<dyn ConfigSource>,
    mounts: Arc<dyn MountSystem>,
}

impl NfsAttacher {
    pub fn new(config: Arc<dyn ConfigSource>, mounts: Arc<dyn MountSystem>) -> Self {
        Self { config, mounts }
    }

    /// The plan's export must be one the operator granted to `backend` (the same grant its
    /// `nfs` import is scoped by): a backend must not make the node mount a server it was not
    /// given.
    fn check_granted(&self, backend: &str, plan: &driver::NfsPlan) -> CsiResult<()> {
        let grants = self.config.grants_for(backend).nfs;
        if grants.iter().flatten().any(|g| is_export(g, &plan.server, &plan.share)) {
            return Ok(());
        }
        Err(CsiError::FailedPrecondition(format!(
            "nfs export {}:{} is not granted to backend {backend} on this node ([backends.{backend}.grants] nfs)",
            plan.server, plan.share
        )))
    }
}

/// Whether `grant` is the export `server:share`; `/export/` and `/export` are one export, as
/// for the `nfs` import.
fn is_export(grant: &NfsGrant, server: &str, share: &str) -> bool {
    let trim = |s: &str| -> String {
        let mut s = s.to_owned();
        while s.len() > 1 && s.ends_with('/') {
            s.pop();
        }
        s
    };
    grant.server == server && trim(&grant.share) == trim(share)
}

#[tonic::async_trait]
impl Attacher for NfsAttacher {
    type Plan = driver::NfsPlan;

    async fn stage(&self, call: &Stage<'_>, plan: &driver::NfsPlan) -> CsiResult<()> {
        let backend = &call.volume.backend.name;
        self.check_granted(backend, plan)?;
        let invalid = |e: String| CsiError::Internal(format!("backend {backend} planned {e}"));
        let source = source_spec(&plan.server, &plan.share, &plan.path).map_err(invalid)?;
        let mut options = mount_options(&plan.mount_options, false).map_err(invalid)?;
        for opt in co_options(call.capability)? {
            options = if options.is_empty() { opt } else { format!("{options},{opt}") };
        }
        let staging = call.staging.to_owned();
        blocking(move || {
            let mounts = mountinfo::read_current().map_err(mount_err)?;
            match plan_stage(&mounts, &staging, &source) {
                StagePlan::Done => Ok(()),
                StagePlan::Conflict(why) => Err(CsiError::AlreadyExists(why)),
                StagePlan::Mount => mount_nfs(&source, &staging, &options, NFS_DEADLINE).map_err(CsiError::Unavailable),
            }
        })
        .await
    }

    /// An NFS share on top of the staging path is this kind's. A mount whose server died can
    /// block umount in the kernel: it goes first, bounded, with forced and lazy fallbacks; then
    /// whatever was stacked under it goes through the planned unmount.
    async fn unstage(&self, _volume_id: &str, staging: &Path) -> CsiResult<Unstaged> {
        let (sys, staging) = (self.mounts.clone(), staging.to_owned());
        blocking(move || {
            let mounts = mountinfo::read_current().map_err(mount_err)?;
            let top = mounts.iter().rev().find(|m| m.mount_point == staging);
            if !top.is_some_and(|m| m.fs_type.starts_with("nfs")) {
                return Ok(Unstaged::NotMine);
            }
            let how = unmount_bounded(&staging, NFS_DEADLINE).map_err(mount_err)?;
            tracing::info!(path = %staging.display(), ?how, "NFS share unmounted");
            ensure_unmounted(sys.as_ref(), &staging, false)?;
            Ok(Unstaged::Done)
        })
        .await
    }

    async fn publish(&self, call: &Publish<'_>, _plan: &driver::NfsPlan) -> CsiResult<()> {
        publish_staged(&self.mounts, call).await
    }

    /// The share's numbers, with the used bytes measured against the size the backend recorded
    /// for the volume (when it still answers for it).
    async fn stats(&self, call: &Stats<'_>, _plan: &driver::NfsPlan) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        let capacity = match call.volume.backend.get_volume(call.volume.local_id.to_owned()).await {
            Ok(status) => Some(status.volume.capacity_bytes),
            Err(e) => {
                tracing::debug!(volume = call.volume.id, error = %e, "no capacity record for NFS stats");
                None
            }
        };
        usage::fs_stats(call.path.to_owned(), "the NFS server of the volume does not answer", None, capacity).await
    }

    /// The share has no filesystem of its own on the node: the controller recorded the new
    /// size with the volume.
    async fn expand(&self, call: &Expand<'_>, _plan: &driver::NfsPlan) -> CsiResult<u64> {
        Ok(call.required_bytes)
    }
}

/// How long a mount or an unmount of an NFS share may take before the fallbacks.
pub const NFS_DEADLINE: Duration = Duration::from_secs(30);

/// What a stage has to do at the staging path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StagePlan {
    /// The share is already mounted there (a retry).
    Done,
    /// Nothing is mounted there: mount it.
    Mount,
    /// Something else is mounted there.
    Conflict(String),
}

/// `server:/share/path`, the source `mount.nfs` expects (IPv6 literals in brackets).
pub fn source_spec(server: &str, share: &str, path: &str) -> Result<String, String> {
    let bad = |what: &str, v: &str| format!("nfs plan: {what} {v:?} is not allowed");
    if server.is_empty() || server.contains(['/', ',', ' ', '\0']) {
        return Err(bad("server", server));
    }
    if !share.starts_with('/') || share.contains(['\0', ',', ' ']) || share.split('/').any(|c| c == "..") {
        return Err(bad("share", share));
    }
    if path.starts_with('/') || path.contains(['\0', ',', ' ']) || path.split('/').any(|c| c == ".." || c == ".") {
        return Err(bad("path", path));
    }
    let host = if server.contains(':') && !server.starts_with('[') { format!("[{server}]") } else { server.into() };
    let mut full = share.trim_end_matches('/').to_string();
    if !path.is_empty() {
        full.push('/');
        full.push_str(path.trim_end_matches('/'));
    }
    if full.is_empty() {
        full.push('/');
    }
    Ok(format!("{host}:{full}"))
}

/// The `-o` argument: the plan's options plus `ro` when asked; an option carrying a comma
/// or whitespace could smuggle in others, so it is refused.
pub fn mount_options(options: &[String], read_only: bool) -> Result<String, String> {
    let mut out: Vec<&str> = Vec::new();
    for o in options {
        if o.is_empty() || o.contains([',', ' ', '\t', '\n', '\0']) {
            return Err(format!("mount option {o:?} is not allowed"));
        }
        out.push(o);
    }
    if read_only && !out.contains(&"ro") {
        out.push("ro");
    }
    Ok(out.join(","))
}

/// The CO's mount flags for a share, mounted after the backend's options (so a PV's
/// `mountOptions` wins where both set one, as mount(8) takes the last): kubelet's SELinux
/// `context="…"` among them, quoted as one option. Options that would make it another kind of
/// mount are INVALID_ARGUMENT ([`mount_options::for_mount`]).
pub fn co_options(capability: &driver::VolumeCapability) -> CsiResult<Vec<String>> {
    let types::AccessType::Mount(m) = &capability.access_type else { return Ok(Vec::new()) };
    mount_options::for_mount(&m.mount_flags)
}

/// What is at `target` compared with the wanted NFS source.
pub fn plan_stage(mounts: &[MountEntry], target: &Path, source: &str) -> StagePlan {
    let Some(top) = mounts.iter().rev().find(|m| m.mount_point == target) else { return StagePlan::Mount };
    if top.fs_type.starts_with("nfs") && top.source.trim_end_matches('/') == source.trim_end_matches('/') {
        StagePlan::Done
    } else {
        StagePlan::Conflict(format!("{} already has {} ({}) mounted", target.display(), top.source, top.fs_type))
    }
}

/// Runs `mount -t nfs`; past `deadline` the mount helper is killed and the call fails (the
/// kernel abandons the mount attempt with it).
pub fn mount_nfs(source: &str, target: &Path, options: &str, deadline: Duration) -> Result<(), String> {
    std::fs::create_dir_all(target).map_err(|e| format!("creating {}: {e}", target.display()))?;
    let mut cmd = Command::new("mount");
    cmd.args(["-t", "nfs"]);
    if !options.is_empty() {
        cmd.args(["-o", options]);
    }
    let mut child = cmd
        .arg(source)
        .arg(target)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running mount: {e}"))?;
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                let mut stderr = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
                }
                return Err(format!("mount {source} on {} failed ({status}): {}", target.display(), stderr.trim()));
            }
            Ok(None) if started.elapsed() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("mount {source} did not finish within {deadline:?}: server unreachable?"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for mount: {e}")),
        }
    }
}

/// How an unmount ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmounted {
    Clean,
    /// The normal unmount did not finish in time (dead server); the mount was forced off.
    Forced,
    /// Even the forced unmount hung or failed: the mount was detached lazily; the kernel drops
    /// it when its last user lets go.
    Detached,
    NotMounted,
}

/// Unmounts `target` within `deadline`, falling back to MNT_FORCE, then MNT_DETACH. A syscall
/// stuck in the kernel cannot be cancelled: its thread is left behind, and the fallbacks run
/// on fresh threads, so the caller always gets an answer in about twice the deadline.
pub fn unmount_bounded(target: &Path, deadline: Duration) -> Result<Unmounted, String> {
    // The mount table decides what "not mounted" means, not the errno: EINVAL from umount2 can
    // also come from a mount the kernel is still tearing down.
    let mounted = || {
        mountinfo::read_current()
            .map(|m| !mountinfo::mounts_at(&m, target).is_empty())
            .map_err(|e| format!("reading the mount table: {e}"))
    };
    if !mounted()? {
        return Ok(Unmounted::NotMounted);
    }
    let attempt = |flags: MntFlags| {
        let path = target.to_path_buf();
        bounded(deadline, move || nix::mount::umount2(&path, flags))
    };
    match attempt(MntFlags::empty()) {
        Some(Ok(())) => return Ok(Unmounted::Clean),
        Some(Err(Errno::EINVAL | Errno::ENOENT)) if !mounted()? => return Ok(Unmounted::Clean),
        Some(Err(e)) if e != Errno::EBUSY => return Err(format!("unmount {}: {e}", target.display())),
        other => tracing::warn!(path = %target.display(), result = ?other, "NFS unmount did not finish; forcing"),
    }
    if !mounted()? {
        return Ok(Unmounted::Clean);
    }
    if let Some(Ok(())) = attempt(MntFlags::MNT_FORCE) {
        return Ok(Unmounted::Forced);
    }
    match attempt(MntFlags::MNT_DETACH) {
        Some(Ok(())) => Ok(Unmounted::Detached),
        Some(Err(Errno::EINVAL | Errno::ENOENT)) if !mounted()? => Ok(Unmounted::Detached),
        Some(Err(e)) => Err(format!("lazy unmount of {}: {e}", target.display())),
        None => Err(format!("even a lazy unmount of {} did not return within {deadline:?}", target.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn entry(point: &str, fs: &str, source: &str) -> MountEntry {
        MountEntry {
            mount_id: 1,
            parent_id: 0,
            major: 0,
            minor: 50,
            root: PathBuf::from("/"),
            mount_point: PathBuf::from(point),
            mount_options: vec!["rw".into()],
            fs_type: fs.into(),
            source: source.into(),
            super_options: vec![],
            propagation: vec![],
        }
    }

    #[test]
    fn sources_are_built_and_unsafe_parts_refused() {
        assert_eq!(source_spec("10.0.0.5", "/export/k8s/", "pvc-1").as_deref(), Ok("10.0.0.5:/export/k8s/pvc-1"));
        assert_eq!(source_spec("fd00::5", "/export", "").as_deref(), Ok("[fd00::5]:/export"));
        assert_eq!(source_spec("nfs.local", "/", "a/b").as_deref(), Ok("nfs.local:/a/b"));
        for (server, share, path) in [
            ("", "/e", "v"),
            ("a,b", "/e", "v"),
            ("s", "e", "v"),
            ("s", "/e/../x", "v"),
            ("s", "/e", "/abs"),
            ("s", "/e", "a/../../b"),
            ("s", "/e", "v,hard"),
        ] {
            assert!(source_spec(server, share, path).is_err(), "{server} {share} {path}");
        }
    }

    #[test]
    fn options_are_joined_and_injection_refused() {
        let opts = vec!["nfsvers=4.1".to_string(), "hard".into()];
        assert_eq!(mount_options(&opts, false).as_deref(), Ok("nfsvers=4.1,hard"));
        assert_eq!(mount_options(&opts, true).as_deref(), Ok("nfsvers=4.1,hard,ro"));
        assert!(mount_options(&["soft,nolock".into()], false).is_err());
        assert!(mount_options(&["".into()], false).is_err());
    }

    #[test]
    fn stage_plans_a_mount_finds_a_retry_and_refuses_another_source() {
        let t = Path::new("/var/lib/kubelet/staging/pv1");
        assert_eq!(plan_stage(&[], t, "s:/e/v"), StagePlan::Mount);
        let same = entry("/var/lib/kubelet/staging/pv1", "nfs4", "s:/e/v");
        assert_eq!(plan_stage(&[same], t, "s:/e/v"), StagePlan::Done);
        let other = entry("/var/lib/kubelet/staging/pv1", "nfs", "s:/e/w");
        assert!(matches!(plan_stage(&[other], t, "s:/e/v"), StagePlan::Conflict(_)));
        let ext4 = entry("/var/lib/kubelet/staging/pv1", "ext4", "/dev/loop0");
        assert!(matches!(plan_stage(&[ext4], t, "s:/e/v"), StagePlan::Conflict(_)));
    }

    #[test]
    fn an_export_is_granted_only_as_configured() {
        let grant = NfsGrant { server: "10.0.0.5".into(), share: "/export/".into() };
        assert!(is_export(&grant, "10.0.0.5", "/export"));
        assert!(is_export(&grant, "10.0.0.5", "/export//"));
        assert!(!is_export(&grant, "10.0.0.6", "/export"));
        assert!(!is_export(&grant, "10.0.0.5", "/export/k8s"), "a subdirectory is another export");
        assert!(!is_export(&grant, "10.0.0.5", "/"));
    }

    #[test]
    fn a_plan_outside_the_grants_is_refused_naming_the_export() {
        let config = wasmcsi_runtime::config::HostConfig::parse(
            "[backends.nfs.grants]\nnfs = [{ server = \"10.0.0.5\", share = \"/export\" }]\n",
            Path::new("test"),
        )
        .expect("config");
        let attacher = NfsAttacher::new(Arc::new(config), Arc::new(super::super::mounts::KernelMounts));
        let plan = |server: &str, share: &str| driver::NfsPlan {
            server: server.into(),
            share: share.into(),
            path: "pvc-1".into(),
            mount_options: vec![],
        };
        assert!(attacher.check_granted("nfs", &plan("10.0.0.5", "/export/")).is_ok());
        let refused = attacher.check_granted("nfs", &plan("evil.example", "/export"));
        assert!(
            matches!(&refused, Err(CsiError::FailedPrecondition(m))
                if m.contains("nfs export evil.example:/export is not granted to backend nfs")),
            "{refused:?}"
        );
        let other_backend = attacher.check_granted("hostpath", &plan("10.0.0.5", "/export"));
        assert!(matches!(other_backend, Err(CsiError::FailedPrecondition(_))), "grants are per backend");
    }

    #[test]
    fn unmounting_what_is_not_mounted_is_done() {
        let tmp = std::env::temp_dir().join(format!("wasmcsi-nfs-unmount-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).expect("dir");
        assert_eq!(unmount_bounded(&tmp, Duration::from_secs(5)), Ok(Unmounted::NotMounted));
        let _ = std::fs::remove_dir(&tmp);
    }
}
