//! The data path in a process of its own (`wasmcsi datapath`): this node's replica server, every
//! attached volume's engine, its FUSE session and loop device, and the rbd-fuse daemons of RBD
//! volumes staged here, served to the node plugin on a unix socket ([`crate::socket`]). The
//! plugin can then crash, restart or be upgraded while every mounted volume keeps its I/O; it
//! finds the volumes again through the socket. The process takes its volumes over from the
//! image before it after a live upgrade ([`crate::upgrade`]), and hands them to the next one
//! when asked.
//!
//! What it does not own: CSI, backends, mounts of filesystems (the plugin formats and mounts the
//! devices this process makes), nor its command line and metrics endpoint (the binary's). A data
//! path that is stopped (SIGTERM) or killed takes its volumes' devices with it, at once: writes
//! acknowledged before are on every replica; the next start of a data path reclaims the dead
//! FUSE mounts and loop devices (a loop device a staged filesystem holds goes when the plugin
//! unmounts it at unstage), and the next engine resyncs the replicas from their dirty flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::rbd_fuse::RbdFuseError;
use crate::socket::{self, SocketError};
use crate::upgrade::{self, Served, UpgradeError, UpgradeRequest};
use crate::{DataPath, DataPathConfig, DataPathError};

/// What a data-path process serves, and where.
#[derive(Clone)]
pub struct ProcessConfig {
    /// The unix socket the node plugin reaches this data path on.
    pub socket: PathBuf,
    /// Where this process's pid file, the handover state and the rbd-fuse daemons' records live:
    /// the node plugin's state directory, so either process finds what the other left.
    pub state_dir: PathBuf,
    pub datapath: DataPathConfig,
    /// The bounds of the socket's connections.
    pub socket_limits: socket::SocketLimits,
    /// The handover state the previous image of this process wrote (`--adopt`): take over its
    /// volumes with the fds it kept open.
    pub adopt: Option<PathBuf>,
    /// Where attached volumes' grants come from (the controller's authority endpoint), given
    /// before the handed-over volumes are adopted: an engine that now needs a grant it does not
    /// hold (a switch to `required`) gets one at once instead of attaching without the replicas
    /// that refuse it.
    pub grants: Option<Arc<dyn wasmcsi_trust::GrantSource>>,
}

impl std::fmt::Debug for ProcessConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessConfig")
            .field("socket", &self.socket)
            .field("state_dir", &self.state_dir)
            .field("datapath", &self.datapath)
            .field("socket_limits", &self.socket_limits)
            .field("adopt", &self.adopt)
            .field("grants", &self.grants.is_some())
            .finish()
    }
}

/// Why a data-path process could not start, or did not stop cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError {
    #[error("taking over a handed-over data path: {0}")]
    TakeOver(#[source] UpgradeError),
    #[error("serving replicas from {} on {listen}: {source}", root.display())]
    Start {
        root: PathBuf,
        listen: SocketAddr,
        #[source]
        source: DataPathError,
    },
    #[error(transparent)]
    RbdFuse(#[from] RbdFuseError),
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("waiting for a signal: {0}")]
    Signal(#[source] std::io::Error),
}

/// Where a data path with state in `state_dir` writes its pid.
pub fn pid_file(state_dir: &Path) -> PathBuf {
    state_dir.join("datapath.pid")
}

/// A data-path process serving on its socket (see the module docs).
pub struct DataPathProcess {
    datapath: Arc<DataPath>,
    socket: PathBuf,
    state_dir: PathBuf,
    served: Served,
    /// Where the socket sends the binaries of `upgrade` requests, and where they are read.
    upgrades: mpsc::UnboundedSender<UpgradeRequest>,
    upgrade_requests: mpsc::UnboundedReceiver<UpgradeRequest>,
}

impl DataPathProcess {
    /// Starts the data path (taking over the volumes a previous image handed over, and the
    /// rbd-fuse daemons it or a crashed process left), writes the pid file and serves the
    /// socket.
    pub async fn start(config: ProcessConfig) -> Result<Self, ProcessError> {
        let ProcessConfig { socket, state_dir, datapath: config, socket_limits, adopt, grants } = config;
        // Inherited fds are taken before anything else opens a file (see `upgrade::inherit`).
        let inherited = match &adopt {
            Some(state) => Some(upgrade::take_over(state).map_err(ProcessError::TakeOver)?),
            None => None,
        };
        let (replica_listener, socket_listener, adopted) = match inherited {
            Some(i) => (Some(i.replica_listener), Some(i.socket_listener), Some((i.state.handovers, i.volumes))),
            None => (None, None, None),
        };
        let (root, listen) = (config.replica_root.clone(), config.listen);
        let started = DataPath::start_on(config, replica_listener).await;
        let datapath = Arc::new(started.map_err(|source| ProcessError::Start { root, listen, source })?);
        if let Some(source) = grants {
            datapath.serve_grants(source);
        }
        // Before the socket answers: the daemons a previous image (or a crashed process) left are
        // adopted, so the plugin's first question about them finds them.
        crate::rbd_fuse::daemons::serve(&datapath, &state_dir)?;
        let socket_listener = match socket_listener {
            Some(l) => l,
            None => socket::bind(&socket).await?,
        };
        if let Some((handovers, volumes)) = adopted {
            // Before the socket is served: requests queued during the handover see the volumes.
            upgrade::adopt(&datapath, handovers, volumes).await;
        }
        let (upgrades, upgrade_requests) = mpsc::unbounded_channel();
        // Written whole (renamed into place) before the socket answers: whoever reads it, also
        // during a live upgrade (same pid), finds the pid, never an empty file.
        let pid_tmp = pid_file(&state_dir).with_extension("pid.tmp");
        std::fs::write(&pid_tmp, format!("{}\n", std::process::id()))
            .and_then(|()| std::fs::rename(&pid_tmp, pid_file(&state_dir)))
            .map_err(|source| ProcessError::Io { what: "writing", path: pid_file(&state_dir), source })?;
        let io = |source| ProcessError::Io { what: "serving", path: socket.clone(), source };
        let listener = socket_listener.try_clone().map_err(io)?;
        let task = socket::serve_on(datapath.clone(), listener, Some(upgrades.clone()), socket_limits).map_err(io)?;
        let served = Served { socket_listener, task, limits: socket_limits };
        Ok(Self { datapath, socket, state_dir, served, upgrades, upgrade_requests })
    }

    pub fn datapath(&self) -> &Arc<DataPath> {
        &self.datapath
    }

    /// Serves until SIGINT or SIGTERM, handing the volumes to a new binary when the socket asks
    /// for an upgrade (this returns only if that failed: the process serves on); then removes
    /// the socket and the pid file and stops at once, as a crash would ([`DataPath::abandon`]):
    /// it waits for no volume.
    pub async fn run(mut self) -> Result<(), ProcessError> {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(ProcessError::Signal)?;
        loop {
            tokio::select! {
                r = tokio::signal::ctrl_c() => break r.map_err(ProcessError::Signal)?,
                _ = term.recv() => break,
                Some(request) = self.upgrade_requests.recv() => {
                    let state = self.state_dir.join("handover.json");
                    upgrade::hand_over(&self.datapath, &request, &state, &mut self.served, &self.upgrades).await;
                }
            }
        }
        // A stop is a crash, at once: nothing is detached (a filesystem the node plugin mounted
        // on a device holds it, and waiting for that is waiting for nothing), flushed or waited
        // for. The volumes' FUSE mounts and loop devices stay; their I/O fails once this
        // process is gone, until they are unstaged; the next start reclaims them.
        self.served.task.abort();
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(pid_file(&self.state_dir));
        let left = self.datapath.abandon().await;
        if left.is_empty() {
            tracing::info!("stopped the data path");
        } else {
            tracing::warn!(
                volumes = ?left,
                "stopped the data path with volumes attached, as a crash: their I/O fails until they are unstaged"
            );
        }
        Ok(())
    }
}
