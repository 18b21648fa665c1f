//! Live upgrade of a data-path process (see [`crate::handover`]): the process side. On an
//! `upgrade` request the running data path checks the new binary, stops accepting on its socket
//! (the listener stays open: clients queue), suspends every volume, writes the handover state,
//! clears close-on-exec on the fds it names and `execve`s the new binary with its own arguments
//! and `--adopt STATE` ([`hand_over`]). Same pid, same container, same cgroup: to the kernel,
//! the mounts and the loop devices nothing happened but a pause. If the `execve` fails, the
//! process adopts its own volumes again and serves on.
//!
//! The new image ([`take_over`]) takes the inherited fds, adopts every volume ([`adopt`]) and
//! reports the longest pause. The operator's command that asks for an upgrade (`wasmcsi upgrade
//! datapath`) is the binary's, a client of the socket ([`crate::client::DataPathClient::upgrade`]).

use std::ffi::{CString, NulError, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use wasmcsi_block::catalog::AttachInfo;

use crate::attach::SuspendedVolume;
use crate::handover::{HandedOwner, HandedVolume, HandoverReport, HandoverState, STATE_VERSION, StateError};
use crate::tls_change::NextTls;
use crate::{DataPath, DataPathError};

/// How long the check of the new binary may take.
const CHECK_WAIT: Duration = Duration::from_secs(10);

/// Why a handover did not happen (the data path serves on), or why a new image could not take
/// one over.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpgradeError {
    /// The new binary is not a wasmcsi data path that adopts this version's handover state.
    #[error("{0}")]
    Binary(String),
    #[error("keeping the replica listener: {0}")]
    Listener(#[source] std::io::Error),
    #[error("suspending the volumes: {0}")]
    Suspend(#[source] DataPathError),
    /// The handover state could not be written, or read back by the new image.
    #[error(transparent)]
    State(#[from] StateError),
    #[error("{what} holds a NUL byte: {source}")]
    Nul {
        what: &'static str,
        #[source]
        source: NulError,
    },
    #[error("keeping an fd open across execve: {0}")]
    KeepOpen(#[source] std::io::Error),
    #[error("execve {}: {source}", binary.display())]
    Exec {
        binary: PathBuf,
        #[source]
        source: nix::Error,
    },
    /// The owner of the previous image's mounts could not be taken over.
    #[error("taking over the owner of the mounts: {0}")]
    Owner(#[source] wasmcsi_frontend::FrontendError),
    /// An fd the handover state names is not open in the new image.
    #[error("the inherited {what} (fd {fd}) is not open: {source}")]
    Inherited {
        what: &'static str,
        fd: i32,
        #[source]
        source: std::io::Error,
    },
}

/// Whether `binary` is a wasmcsi that adopts this version's handover state: its `datapath
/// --help` names `--adopt`.
async fn check_binary(binary: &Path) -> Result<(), String> {
    let run = tokio::process::Command::new(binary).args(["datapath", "--help"]).kill_on_drop(true).output();
    let out = tokio::time::timeout(CHECK_WAIT, run)
        .await
        .map_err(|_| format!("{} did not answer --help within {}s", binary.display(), CHECK_WAIT.as_secs()))?
        .map_err(|e| format!("running {}: {e}", binary.display()))?;
    let help = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !help.contains("--adopt") {
        return Err(format!("{} is not a wasmcsi data path that adopts volumes ({})", binary.display(), out.status));
    }
    Ok(())
}

fn set_cloexec(fd: BorrowedFd<'_>, on: bool) -> std::io::Result<()> {
    let flags = if on { FdFlag::FD_CLOEXEC } else { FdFlag::empty() };
    fcntl(fd, FcntlArg::F_SETFD(flags))?;
    Ok(())
}

/// The process's own arguments for the next image: `binary` as argv[0], any `--adopt FILE` of
/// this image's replaced by `--adopt state`, the TLS flags replaced by `tls`'s when given.
fn next_argv(binary: &Path, state: &Path, tls: Option<&NextTls>) -> Result<Vec<CString>, UpgradeError> {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--adopt") {
        args.drain(i..(i + 2).min(args.len()));
    }
    args.retain(|a| !a.as_bytes().starts_with(b"--adopt="));
    if let Some(tls) = tls {
        crate::tls_change::apply(tls, &mut args);
    }
    args.extend([OsString::from("--adopt"), state.as_os_str().to_owned()]);
    std::iter::once(binary.as_os_str().to_owned())
        .chain(args)
        .map(|a| CString::new(a.as_bytes()).map_err(|source| UpgradeError::Nul { what: "an argument", source }))
        .collect()
}

/// What the socket asks the process for: a live upgrade to `binary`, with the replica port's
/// new TLS configuration when it changes (already checked, [`crate::tls_change::check`]).
#[derive(Debug, Clone)]
pub struct UpgradeRequest {
    pub binary: PathBuf,
    pub tls: Option<NextTls>,
}

/// What a running data path keeps to hand over: its socket's listener.
pub struct Served {
    pub socket_listener: UnixListener,
    pub task: tokio::task::JoinHandle<()>,
    /// The bounds it is served within (again, if the handover fails).
    pub limits: crate::socket::SocketLimits,
}

/// Hands every volume of `datapath` to `binary` by replacing this process image (see the module
/// docs). Returns only if that did not happen; the data path then serves on (on `served`'s
/// listener again) and its report says why.
pub async fn hand_over(
    datapath: &Arc<DataPath>,
    request: &UpgradeRequest,
    state_path: &Path,
    served: &mut Served,
    upgrades: &tokio::sync::mpsc::UnboundedSender<UpgradeRequest>,
) -> UpgradeError {
    let binary = &request.binary;
    let error = match try_hand_over(datapath, binary, request.tls.as_ref(), state_path, served).await {
        Ok(never) => match never {},
        Err(e) => e,
    };
    tracing::error!(binary = %binary.display(), error = %error, "live upgrade failed; serving on");
    let mut report = datapath.handover_report();
    report.last_error = Some(error.to_string());
    datapath.record_handover(report);
    datapath.end_handover();
    if served.task.is_finished() {
        match served
            .socket_listener
            .try_clone()
            .and_then(|l| crate::socket::serve_on(datapath.clone(), l, Some(upgrades.clone()), served.limits))
        {
            Ok(task) => served.task = task,
            Err(e) => tracing::error!(error = %e, "serving the data-path socket again"),
        }
    }
    error
}

async fn try_hand_over(
    datapath: &Arc<DataPath>,
    binary: &Path,
    tls: Option<&NextTls>,
    state_path: &Path,
    served: &mut Served,
) -> Result<std::convert::Infallible, UpgradeError> {
    check_binary(binary).await.map_err(UpgradeError::Binary)?;
    let replica_listener = datapath.replica_listener().map_err(UpgradeError::Listener)?;
    // No new connection is answered by this image; they queue on the listener for the next.
    served.task.abort();
    let _ = (&mut served.task).await;
    let started = Instant::now();
    let suspended = datapath.suspend_all().await.map_err(UpgradeError::Suspend)?;
    let volumes: Vec<HandedVolume> = suspended
        .iter()
        .map(|(info, s)| HandedVolume {
            volume: s.volume_id.clone(),
            size: s.size,
            epoch: info.epoch,
            members: info.members.clone(),
            disks: info.disks.clone(),
            grant: info.grant.clone(),
            limits: info.limits,
            session_fd: s.session.as_raw_fd(),
            mount: s.mount.clone(),
            device: s.device.clone(),
            suspended_at_ns: s
                .suspended_at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        })
        .collect();
    let owner = wasmcsi_frontend::owner::this_process();
    let state = HandoverState {
        version: STATE_VERSION,
        handovers: datapath.handover_report().handovers + 1,
        from_binary: std::env::current_exe().unwrap_or_default(),
        replica_listener: replica_listener.as_raw_fd(),
        socket_listener: served.socket_listener.as_raw_fd(),
        volumes,
        owner: Some(HandedOwner { id: owner.id().to_owned(), locks: owner.locks() }),
    };
    let exec = (|| -> Result<std::convert::Infallible, UpgradeError> {
        state.write(state_path)?;
        let argv = next_argv(binary, state_path, tls)?;
        let inherited: Vec<BorrowedFd<'_>> = suspended
            .iter()
            .map(|(_, s)| s.session.as_fd())
            .chain([replica_listener.as_fd(), served.socket_listener.as_fd()])
            .collect();
        for fd in &inherited {
            set_cloexec(*fd, false).map_err(UpgradeError::KeepOpen)?;
        }
        // The owner's locks too: held through the execve, no reclaimer sees the owner dead.
        owner
            .with_lock_fds(|fds| fds.iter().try_for_each(|fd| set_cloexec(*fd, false)))
            .map_err(UpgradeError::KeepOpen)?;
        tracing::info!(
            binary = %binary.display(),
            tls_mode = %tls.map_or(datapath.tls_mode(), |t| t.mode),
            volumes = suspended.len(),
            suspended_in = ?started.elapsed(),
            "handing the volumes to the new binary"
        );
        let path = CString::new(binary.as_os_str().as_bytes())
            .map_err(|source| UpgradeError::Nul { what: "the binary's path", source })?;
        let err = nix::unistd::execv(&path, &argv).map_or_else(|e| e, |never| match never {});
        for fd in &inherited {
            let _ = set_cloexec(*fd, true);
        }
        owner.with_lock_fds(|fds| {
            for fd in fds {
                let _ = set_cloexec(*fd, true);
            }
        });
        Err(UpgradeError::Exec { binary: binary.to_owned(), source: err })
    })();
    let Err(e) = exec;
    // The volumes never left: serve them here again.
    let _ = std::fs::remove_file(state_path);
    let pauses = datapath.adopt_all(suspended).await;
    tracing::info!(volumes = pauses.len(), "the volumes are served again by this image");
    Err(e)
}

/// Takes an fd the previous process image kept open for this one.
fn inherit(fd: i32, what: &'static str) -> Result<OwnedFd, UpgradeError> {
    // Close-on-exec again: a child of this process must not hold the volumes' connections.
    #[allow(
        unsafe_code,
        reason = "taking ownership of an fd inherited across execve, named once in the handover state"
    )]
    // SAFETY: `HandoverState::read` checked that no fd is named twice and none is stdio; the
    // previous image kept exactly these open for this one, and nothing else in this process
    // took them (they are read before any other file is opened by the data path).
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_cloexec(fd.as_fd(), true).map_err(|source| UpgradeError::Inherited { what, fd: fd.as_raw_fd(), source })?;
    Ok(fd)
}

/// What the new image takes over: the listeners and the suspended volumes.
pub struct Inherited {
    pub state: HandoverState,
    pub replica_listener: std::net::TcpListener,
    pub socket_listener: UnixListener,
    pub volumes: Vec<(AttachInfo, SuspendedVolume)>,
}

/// Reads the handover state at `path` (and removes it) and takes the fds it names.
pub fn take_over(path: &Path) -> Result<Inherited, UpgradeError> {
    let state = HandoverState::read(path)?;
    let _ = std::fs::remove_file(path);
    let replica_listener = std::net::TcpListener::from(inherit(state.replica_listener, "replica listener")?);
    let socket_listener = UnixListener::from(inherit(state.socket_listener, "data-path socket")?);
    if let Some(owner) = &state.owner {
        let locks = owner
            .locks
            .iter()
            .map(|(dir, fd)| Ok((dir.clone(), inherit(*fd, "owner lock")?)))
            .collect::<Result<Vec<_>, UpgradeError>>()?;
        wasmcsi_frontend::owner::adopt(&owner.id, locks).map_err(UpgradeError::Owner)?;
    }
    let mut volumes = Vec::new();
    for v in &state.volumes {
        let session = inherit(v.session_fd, "FUSE connection")?;
        volumes.push((
            AttachInfo {
                size: v.size,
                epoch: v.epoch,
                members: v.members.clone(),
                disks: v.disks.clone(),
                grant: v.grant.clone(),
                limits: v.limits,
            },
            SuspendedVolume {
                volume_id: v.volume.clone(),
                size: v.size,
                session,
                mount: v.mount.clone(),
                device: v.device.clone(),
                suspended_at: UNIX_EPOCH + Duration::from_nanos(v.suspended_at_ns),
            },
        ));
    }
    Ok(Inherited { state, replica_listener, socket_listener, volumes })
}

/// Adopts what [`take_over`] took and records the handover in the data path's report.
pub async fn adopt(datapath: &DataPath, handovers: u64, volumes: Vec<(AttachInfo, SuspendedVolume)>) {
    let n = volumes.len();
    let pauses = datapath.adopt_all(volumes).await;
    let longest = pauses.iter().map(|(_, p)| *p).max();
    for (id, pause) in &pauses {
        tracing::info!(volume.id = %id, pause = ?pause, "volume taken over");
    }
    if pauses.len() < n {
        tracing::error!(lost = n - pauses.len(), "volumes lost in the handover (see above)");
    }
    datapath.record_handover(HandoverReport {
        handovers,
        last_pause_us: longest.map(|p| u64::try_from(p.as_micros()).unwrap_or(u64::MAX)),
        last_volumes: pauses.len(),
        last_error: None,
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn the_next_image_gets_this_one_s_arguments_with_one_adopt() {
        let argv = next_argv(Path::new("/new/wasmcsi"), Path::new("/state/handover.json"), None).unwrap();
        assert_eq!(argv[0].to_str().unwrap(), "/new/wasmcsi");
        let adopts = argv.iter().filter(|a| a.to_str() == Ok("--adopt")).count();
        assert_eq!(adopts, 1);
        assert_eq!(argv.last().unwrap().to_str().unwrap(), "/state/handover.json");
    }
}
