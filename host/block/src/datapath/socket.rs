//! The data path served on a unix socket: what makes a [`DataPath`] usable from another process
//! (the node plugin), so the engines, their FUSE sessions and loop devices, and the replica
//! server live in a process the plugin's death does not touch. Requests are [`wire`] frames;
//! each connection is answered in order, connections concurrently (at most
//! [`MAX_CONNECTIONS`]), and the socket is root-only (mode 0600), like the devices it makes.
//!
//! It decides nothing about CSI: the plugin asks the backend for the plan and the replica
//! nodes for the members and epoch, then hands them here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use super::wire::{self, ErrorKind, FrameError, Reply, Request, RequestFrame, WIRE_VERSION};
use super::{DataPath, DataPathError, view};
use crate::catalog::AttachInfo;

/// Connections served at once; more wait to be accepted.
pub const MAX_CONNECTIONS: usize = 64;

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
/// `datapath` on it until the returned task is aborted.
pub async fn serve(datapath: Arc<DataPath>, path: &Path) -> Result<tokio::task::JoinHandle<()>, SocketError> {
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
    let listener = UnixListener::bind(path).map_err(|e| io("binding", e))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .map_err(|e| io("restricting", e))?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    Ok(tokio::spawn(async move {
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else { return };
            match listener.accept().await {
                Ok((stream, _)) => {
                    let datapath = datapath.clone();
                    tokio::spawn(async move {
                        connection(&datapath, stream).await;
                        drop(permit);
                    });
                }
                Err(e) => tracing::warn!(error = %e, "accepting a data-path connection"),
            }
        }
    }))
}

async fn connection(datapath: &DataPath, mut stream: UnixStream) {
    loop {
        let reply = match wire::read_frame::<RequestFrame>(&mut stream).await {
            Ok(frame) if frame.version != WIRE_VERSION => Reply::error(
                ErrorKind::Version,
                format!("the plugin speaks data-path wire version {}, this data path {WIRE_VERSION}", frame.version),
            ),
            Ok(frame) => answer(datapath, frame.request).await,
            Err(FrameError::Closed) => return,
            Err(e @ (FrameError::TooLarge(_) | FrameError::Malformed(_))) => {
                // Answer once, then hang up: the stream's framing can no longer be trusted.
                let _ = wire::write_frame(&mut stream, &Reply::error(ErrorKind::Invalid, e.to_string())).await;
                return;
            }
            Err(FrameError::Io(e)) => {
                tracing::debug!(error = %e, "data-path connection");
                return;
            }
        };
        if wire::write_frame(&mut stream, &reply).await.is_err() {
            return;
        }
    }
}

fn failed(e: DataPathError) -> Reply {
    let kind = match e {
        DataPathError::Busy(_) => ErrorKind::Busy,
        _ => ErrorKind::Failed,
    };
    Reply::error(kind, e.to_string())
}

#[tracing::instrument(name = "datapath.request", skip_all, fields(op = request.name()))]
async fn answer(datapath: &DataPath, request: Request) -> Reply {
    match request {
        Request::Hello => Reply::ok(),
        Request::Attach { volume, size, epoch, members } => {
            if crate::replica::replica_dir_name(&volume).is_err() {
                return Reply::error(ErrorKind::Invalid, format!("{volume:?} is not a volume id"));
            }
            match datapath.attach(&volume, &AttachInfo { size, epoch, members }).await {
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
        Request::List => {
            let volumes =
                datapath.attached().into_iter().filter_map(|id| datapath.volume(&id).map(|v| view(&id, &v))).collect();
            Reply { volumes, ..Reply::ok() }
        }
    }
}
