//! The plugin's side of the data-path socket ([`crate::socket`]): one connection per request
//! (a data path that restarted between two calls is simply found again), each bounded in time,
//! and [`Engines`], the one handle the node attacher holds whether the engines run in its own
//! process or in a data-path process of their own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixStream;
use wasmcsi_block::catalog::AttachInfo;

use crate::rbd_fuse::{RbdFuseSpec, RbdFuseView};
use crate::wire::{self, ErrorKind, Reply, Request, RequestFrame, VolumeView, WIRE_VERSION};
use crate::{DataPath, DataPathError};

/// Bound of an attach: the engine's own attach timeout (30 s) and the FUSE + loop setup, with
/// room to spare; a request that takes longer means a data path that hangs.
const ATTACH_DEADLINE: Duration = Duration::from_secs(90);
/// Bound of every other request (a detach flushes the engine).
const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// Why a request to the data path failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EnginesError {
    /// Another attach or detach of the volume runs.
    #[error("{0}")]
    Busy(String),
    /// No data path answers at the socket (not started, or died).
    #[error("no data path answers at {socket}: {message}")]
    Unreachable { socket: PathBuf, message: String },
    /// The data path answered with an error, or broke the protocol.
    #[error("{0}")]
    Failed(String),
}

/// A client of the data-path socket at one path.
#[derive(Debug, Clone)]
pub struct DataPathClient {
    socket: PathBuf,
}

impl DataPathClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self { socket: socket.into() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn unreachable(&self, message: impl ToString) -> EnginesError {
        EnginesError::Unreachable { socket: self.socket.clone(), message: message.to_string() }
    }

    /// Sends `request` and waits for its reply; an error reply becomes an [`EnginesError`].
    #[tracing::instrument(name = "datapath.call", skip_all, fields(op = request.name()))]
    pub async fn call(&self, request: Request) -> Result<Reply, EnginesError> {
        // rbd-fuse's start and its teardown are each bounded by 30 s per step in the data path.
        let long =
            matches!(request, Request::Attach { .. } | Request::RbdFuseAttach { .. } | Request::RbdFuseDetach { .. });
        let deadline = if long { ATTACH_DEADLINE } else { REQUEST_DEADLINE };
        let exchange = async {
            let mut stream = UnixStream::connect(&self.socket).await.map_err(|e| self.unreachable(e))?;
            wire::write_frame(&mut stream, &RequestFrame { version: WIRE_VERSION, request })
                .await
                .map_err(|e| self.unreachable(e))?;
            wire::read_frame::<Reply>(&mut stream).await.map_err(|e| match e {
                // Gone mid-request: the data path died (or was killed) while answering.
                wire::FrameError::Closed | wire::FrameError::Io(_) => self.unreachable(e),
                other => EnginesError::Failed(format!("the data path's reply: {other}")),
            })
        };
        let reply = tokio::time::timeout(deadline, exchange).await.map_err(|_| {
            EnginesError::Failed(format!("the data path did not answer within {}s", deadline.as_secs()))
        })??;
        if reply.version != WIRE_VERSION {
            return Err(EnginesError::Failed(format!(
                "the data path speaks wire version {}, this plugin {WIRE_VERSION}",
                reply.version
            )));
        }
        match reply.error {
            None => Ok(reply),
            Some(e) if e.kind == ErrorKind::Busy => Err(EnginesError::Busy(e.message)),
            Some(e) => Err(EnginesError::Failed(e.message)),
        }
    }

    /// The data path's pid, when one answers.
    pub async fn hello(&self) -> Result<u32, EnginesError> {
        Ok(self.call(Request::Hello).await?.pid)
    }

    /// Asks the data path to hand its volumes to `binary`, with the replica port's TLS
    /// configuration changed as `tls` says (refused, with the reason, when that would cut an
    /// attached volume off); the report before it starts.
    pub async fn upgrade(
        &self,
        binary: &Path,
        tls: Option<crate::wire::TlsChange>,
    ) -> Result<crate::handover::HandoverReport, EnginesError> {
        let reply = self.call(Request::Upgrade { binary: binary.to_owned(), tls }).await?;
        Ok(reply.handover.unwrap_or_default())
    }

    /// The data path's pid and its handover report, when one answers.
    pub async fn report(&self) -> Result<(u32, crate::handover::HandoverReport), EnginesError> {
        let reply = self.call(Request::Hello).await?;
        Ok((reply.pid, reply.handover.unwrap_or_default()))
    }

    /// How the data path's replica port travels (`off`, `permissive`, `required`); `None` from
    /// a data path of the version before it said.
    pub async fn tls_mode(&self) -> Result<Option<String>, EnginesError> {
        Ok(self.call(Request::Hello).await?.tls_mode)
    }

    /// Waits until a data path answers, at most `wait`.
    pub async fn wait_ready(&self, wait: Duration) -> Result<u32, EnginesError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match self.hello().await {
                Ok(pid) => return Ok(pid),
                Err(e @ EnginesError::Unreachable { .. }) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(EnginesError::Unreachable { .. }) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => return Err(e),
            }
        }
    }
}

/// Where this node's engines run: in this process, or in a data-path process reached through
/// its socket. Cheap to clone.
#[derive(Clone)]
pub enum Engines {
    InProcess(Arc<DataPath>),
    Remote(DataPathClient),
}

fn local_err(e: DataPathError) -> EnginesError {
    match e {
        DataPathError::Busy(_) | DataPathError::HandingOver => EnginesError::Busy(e.to_string()),
        other => EnginesError::Failed(other.to_string()),
    }
}

/// A data path of the previous version refuses the rbd-fuse requests as malformed (an unknown
/// `op`): say what to do instead of the serde message.
fn old_datapath(e: EnginesError) -> EnginesError {
    match e {
        EnginesError::Failed(m) if m.contains("unknown variant") => EnginesError::Failed(format!(
            "the data path runs no rbd-fuse: an older binary (upgrade it live: wasmcsi upgrade datapath): {m}"
        )),
        other => other,
    }
}

impl Engines {
    /// Starts the engine of `id` and exposes it as a block device; the running one when it is.
    pub async fn attach(&self, id: &str, info: &AttachInfo) -> Result<VolumeView, EnginesError> {
        match self {
            Self::InProcess(d) => d.attach(id, info).await.map(|v| crate::view(id, &v)).map_err(local_err),
            Self::Remote(c) => c
                .call(Request::attach(id, info))
                .await?
                .volume
                .ok_or_else(|| EnginesError::Failed(format!("the data path attached {id} but sent no volume"))),
        }
    }

    /// Stops the engine of `id`; absent succeeds.
    pub async fn detach(&self, id: &str) -> Result<(), EnginesError> {
        match self {
            Self::InProcess(d) => d.detach(id).await.map_err(local_err),
            Self::Remote(c) => c.call(Request::Detach { volume: id.to_owned() }).await.map(drop),
        }
    }

    /// The attached volume `id`, when its engine runs.
    pub async fn view(&self, id: &str) -> Result<Option<VolumeView>, EnginesError> {
        match self {
            Self::InProcess(d) => Ok(d.volume(id).map(|v| crate::view(id, &v))),
            Self::Remote(c) => Ok(c.call(Request::Status { volume: id.to_owned() }).await?.volume),
        }
    }

    /// Starts rbd-fuse for an RBD volume in the data path; the running one when it is.
    pub async fn rbd_fuse_attach(&self, spec: RbdFuseSpec) -> Result<RbdFuseView, EnginesError> {
        let volume = spec.volume.clone();
        let views = match self {
            Self::InProcess(d) => return d.rbd_fuse_attach(spec).await.map_err(local_err),
            Self::Remote(c) => {
                c.call(Request::RbdFuseAttach { attachment: spec }).await.map_err(old_datapath)?.rbd_fuse
            }
        };
        views.into_iter().find(|v| v.volume == volume).ok_or_else(|| {
            EnginesError::Failed(format!("the data path attached rbd-fuse for {volume} but sent no attachment"))
        })
    }

    /// Stops an RBD volume's rbd-fuse; absent succeeds.
    pub async fn rbd_fuse_detach(&self, volume: &str) -> Result<(), EnginesError> {
        match self {
            Self::InProcess(d) => d.rbd_fuse_detach(volume).await.map_err(local_err),
            Self::Remote(c) => {
                c.call(Request::RbdFuseDetach { volume: volume.to_owned() }).await.map_err(old_datapath).map(drop)
            }
        }
    }

    /// The rbd-fuse attachment of `volume`, if the data path has one.
    pub async fn rbd_fuse_status(&self, volume: &str) -> Result<Option<RbdFuseView>, EnginesError> {
        let views = match self {
            Self::InProcess(d) => d.rbd_fuse_list(),
            Self::Remote(c) => c.call(Request::RbdFuseList).await.map_err(old_datapath)?.rbd_fuse,
        };
        Ok(views.into_iter().find(|v| v.volume == volume))
    }

    /// Every attached volume.
    pub async fn list(&self) -> Result<Vec<VolumeView>, EnginesError> {
        match self {
            Self::InProcess(d) => {
                Ok(d.attached().into_iter().filter_map(|id| d.volume(&id).map(|v| crate::view(&id, &v))).collect())
            }
            Self::Remote(c) => Ok(c.call(Request::List).await?.volumes),
        }
    }
}
