//! The data path served on a unix socket: what makes a [`DataPath`] usable from another process
//! (the node plugin), so the engines, their FUSE sessions and loop devices, and the replica
//! server live in a process the plugin's death does not touch. Requests are [`wire`] frames;
//! each connection is answered in order, connections concurrently, and the socket is root-only
//! (mode 0600), like the devices it makes.
//!
//! Bounded so that no other process on the node can keep the node plugin from being answered
//! ([`slots`]): every connection is accepted at once and given a slot, or answered `busy` and
//! closed when its client (the connecting process, by `SO_PEERCRED`) holds its cap or every slot
//! is held; a connection that does not send a whole request within the idle timeout is closed.
//! A connection costs a task and its socket until it sends a request (a request's buffer grows
//! with the bytes that arrive, up to [`wire::MAX_FRAME`]).
//!
//! It decides nothing about CSI: the plugin asks the backend for the plan and the replica
//! nodes for the members and epoch, then hands them here.

pub mod slots;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use wasmcsi_block::catalog::AttachInfo;

pub use self::slots::SocketLimits;
use self::slots::{Client, Refusal, Slots};
use crate::upgrade::UpgradeRequest;
use crate::wire::{self, ErrorKind, FrameError, Reply, Request, RequestFrame, WIRE_VERSION};
use crate::{DataPath, DataPathError, view};

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("{0} is in use: another data path serves this node")]
    InUse(PathBuf),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Binds `path` (replacing a stale socket a killed data path left, never a live one) and serves
/// `datapath` on it within `limits` until the returned task is aborted.
pub async fn serve(
    datapath: Arc<DataPath>,
    path: &Path,
    limits: SocketLimits,
) -> Result<tokio::task::JoinHandle<()>, SocketError> {
    let listener = bind(path).await?;
    serve_on(datapath, listener, None, limits).map_err(|source| SocketError::Io {
        what: "serving",
        path: path.to_owned(),
        source,
    })
}

/// Binds `path` (replacing a stale socket a killed data path left, never a live one), root-only.
pub async fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, SocketError> {
    let io = |what, source| SocketError::Io { what, path: path.to_owned(), source };
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            return Err(SocketError::InUse(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(|e| io("removing the stale socket", e))?;
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io("creating the directory of", e))?;
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(|e| io("binding", e))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .map_err(|e| io("restricting", e))?;
    Ok(listener)
}

/// Serves `datapath` on `listener` (bound by [`bind`], or inherited from the data path this one
/// took over from) within `limits` until the returned task is aborted; the listener closes with
/// the task. `upgrades` receives the binaries of `upgrade` requests (none: they are refused).
pub fn serve_on(
    datapath: Arc<DataPath>,
    listener: std::os::unix::net::UnixListener,
    upgrades: Option<mpsc::UnboundedSender<UpgradeRequest>>,
    limits: SocketLimits,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let listener = UnixListener::from_std(listener)?;
    let slots = Slots::new(limits);
    Ok(tokio::spawn(async move {
        let mut backoff = wasmcsi_trust::listener::AcceptBackoff::new("datapath-socket");
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => {
                    backoff.after_success();
                    stream
                }
                Err(e) => match backoff.after_error(e) {
                    Ok(delay) => {
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "the data-path socket cannot accept; serving it stopped");
                        return;
                    }
                },
            };
            let client = Client::of(&stream);
            let (datapath, upgrades) = (datapath.clone(), upgrades.clone());
            match slots.try_take(client) {
                Ok(slot) => {
                    tokio::spawn(async move {
                        connection(&datapath, upgrades.as_ref(), stream, limits.idle_timeout).await;
                        drop(slot);
                    });
                }
                Err((refusal, first)) => {
                    let why = match refusal {
                        Refusal::PerClient => {
                            format!("{client} holds {} data-path connections, its cap", limits.max_per_client)
                        }
                        Refusal::Total => {
                            format!("the data path holds {} connections, its cap", limits.max_connections)
                        }
                    };
                    if first {
                        tracing::warn!(%client, held = slots.held(), "refusing data-path connections: {why}");
                    }
                    // Answered without reading: the refused connection costs nothing once this
                    // write (into the socket's buffer, bounded in time) is done.
                    tokio::spawn(refuse(stream, why, limits.idle_timeout));
                }
            }
        }
    }))
}

/// Answers a connection that got no slot `busy`, without reading its request, and closes it.
async fn refuse(mut stream: UnixStream, why: String, timeout: std::time::Duration) {
    let reply = Reply::error(ErrorKind::Busy, format!("{why}; try again"));
    let _ = tokio::time::timeout(timeout, wire::write_frame(&mut stream, &reply)).await;
}

/// Answers the requests of one connection in order until it closes, breaks the protocol, or
/// stays `idle` (no whole request, or a reply not read) for longer than `idle`.
async fn connection(
    datapath: &DataPath,
    upgrades: Option<&mpsc::UnboundedSender<UpgradeRequest>>,
    mut stream: UnixStream,
    idle: std::time::Duration,
) {
    loop {
        let frame = match tokio::time::timeout(idle, wire::read_frame::<RequestFrame>(&mut stream)).await {
            Ok(frame) => frame,
            Err(_) => {
                tracing::debug!(idle_secs = idle.as_secs(), "closing an idle data-path connection");
                return;
            }
        };
        let reply = match frame {
            Ok(frame) if frame.version != WIRE_VERSION => Reply::error(
                ErrorKind::Version,
                format!("the plugin speaks data-path wire version {}, this data path {WIRE_VERSION}", frame.version),
            ),
            Ok(frame) => answer(datapath, upgrades, frame.request).await,
            Err(FrameError::Closed) => return,
            Err(e @ (FrameError::TooLarge(_) | FrameError::Malformed(_))) => {
                // Answer once, then hang up: the stream's framing can no longer be trusted.
                let reply = Reply::error(ErrorKind::Invalid, e.to_string());
                let _ = tokio::time::timeout(idle, wire::write_frame(&mut stream, &reply)).await;
                return;
            }
            Err(FrameError::Io(e)) => {
                tracing::debug!(error = %e, "data-path connection");
                return;
            }
        };
        match tokio::time::timeout(idle, wire::write_frame(&mut stream, &reply)).await {
            Ok(Ok(())) => {}
            _ => return,
        }
    }
}

fn failed(e: DataPathError) -> Reply {
    let kind = match e {
        DataPathError::Busy(_) | DataPathError::HandingOver => ErrorKind::Busy,
        DataPathError::RbdFuse(crate::rbd_fuse::RbdFuseError::Invalid(_)) => ErrorKind::Invalid,
        _ => ErrorKind::Failed,
    };
    Reply::error(kind, e.to_string())
}

#[tracing::instrument(name = "datapath.request", skip_all, fields(op = request.name()))]
async fn answer(
    datapath: &DataPath,
    upgrades: Option<&mpsc::UnboundedSender<UpgradeRequest>>,
    request: Request,
) -> Reply {
    match request {
        Request::Hello => Reply {
            handover: Some(datapath.handover_report()),
            tls_mode: Some(datapath.tls_mode().to_string()),
            ..Reply::ok()
        },
        Request::Upgrade { binary, tls } => {
            if !binary.is_absolute() {
                return Reply::error(ErrorKind::Invalid, format!("{} is not an absolute path", binary.display()));
            }
            let Some(upgrades) = upgrades else {
                return Reply::error(ErrorKind::Failed, "this data path does not upgrade live");
            };
            let tls = match tls {
                None => None,
                Some(change) => {
                    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
                    let next = crate::tls_change::resolve(&change, &args);
                    if let Err(e) = crate::tls_change::check(datapath, &next).await {
                        tracing::warn!(error = %e, mode = %next.mode, "refused a live upgrade's TLS change");
                        return Reply::error(
                            ErrorKind::Failed,
                            format!("refused the change to --tls-mode {}: {e}", next.mode),
                        );
                    }
                    Some(next)
                }
            };
            match upgrades.send(UpgradeRequest { binary, tls }) {
                Ok(()) => Reply { handover: Some(datapath.handover_report()), ..Reply::ok() },
                Err(_) => Reply::error(ErrorKind::Failed, "this data path does not upgrade live"),
            }
        }
        Request::Attach { volume, size, epoch, members, disks, grant, limits } => {
            if wasmcsi_block::replica::replica_dir_name(&volume).is_err() {
                return Reply::error(ErrorKind::Invalid, format!("{volume:?} is not a volume id"));
            }
            match datapath.attach(&volume, &AttachInfo { size, epoch, members, disks, grant, limits }).await {
                Ok(attached) => Reply { volume: Some(view(&volume, &attached)), ..Reply::ok() },
                Err(e) => failed(e),
            }
        }
        Request::Detach { volume } => match datapath.detach(&volume).await {
            Ok(()) => Reply::ok(),
            Err(e) => failed(e),
        },
        Request::Status { volume } => {
            Reply { volume: datapath.volume(&volume).map(|v| view(&volume, &v)), ..Reply::ok() }
        }
        Request::RbdFuseAttach { attachment } => match datapath.rbd_fuse_attach(attachment).await {
            Ok(view) => Reply { rbd_fuse: vec![view], ..Reply::ok() },
            Err(e) => failed(e),
        },
        Request::RbdFuseDetach { volume } => match datapath.rbd_fuse_detach(&volume).await {
            Ok(()) => Reply::ok(),
            Err(e) => failed(e),
        },
        Request::RbdFuseList => {
            let daemons = datapath.rbd_fuse_list();
            Reply { rbd_fuse: daemons, ..Reply::ok() }
        }
        Request::List => {
            let volumes =
                datapath.attached().into_iter().filter_map(|id| datapath.volume(&id).map(|v| view(&id, &v))).collect();
            Reply { volumes, ..Reply::ok() }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use std::time::Duration;

    use wasmcsi_block::replica::NodeIdentity;

    use super::*;
    use crate::DataPathConfig;
    use crate::client::{DataPathClient, Engines, EnginesError};
    use crate::rbd_fuse::RbdFuseSpec;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_data_path_without_rbd_fuse_refuses_an_attachment_and_lists_none() {
        let dir = tempfile::tempdir().unwrap();
        let config = DataPathConfig {
            identity: NodeIdentity { node: "n".into(), labels: vec![] },
            replica_root: dir.path().join("replicas"),
            replica_disks: Vec::new(),
            listen: "127.0.0.1:0".parse().unwrap(),
            engine_root: dir.path().join("engines"),
            runtime_root: dir.path().join("run"),
            request_timeout: Duration::from_secs(1),
            attach_timeout: Duration::from_secs(1),
            transport: wasmcsi_block::transport::Transport::Plain,
            limits: wasmcsi_trust::Limits::default(),
        };
        let datapath = Arc::new(DataPath::start(config).await.unwrap());
        let socket = dir.path().join("datapath.sock");
        let task = serve(datapath.clone(), &socket, SocketLimits::default()).await.unwrap();
        let engines = Engines::Remote(DataPathClient::new(&socket));
        let err = engines.rbd_fuse_attach(RbdFuseSpec::example()).await.unwrap_err();
        assert!(matches!(&err, EnginesError::Failed(m) if m.contains("runs no rbd-fuse")), "{err:?}");
        assert!(!err.to_string().contains("AQBsecret"), "never the key in an error: {err}");
        assert_eq!(engines.rbd_fuse_status("ceph:v1").await.unwrap(), None);
        engines.rbd_fuse_detach("ceph:v1").await.unwrap_err();
        task.abort();
        datapath.shutdown().await.unwrap();
    }
}
