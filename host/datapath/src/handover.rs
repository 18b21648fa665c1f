//! Live upgrade of the data path: what one process image hands the next. The old image
//! suspends every volume ([`crate::DataPath::suspend_all`]), writes a [`HandoverState`] naming
//! each volume's FUSE connection by the number of an fd it keeps open across `execve`, with the
//! replica listener and the data-path socket's listener, and replaces itself with the new
//! binary (same pid: the attacher's "is the data path that served this volume still there"
//! check and a container's main process both stay true). The new image takes those fds,
//! adopts every volume ([`crate::DataPath::adopt_all`]), and records the pause in its
//! [`HandoverReport`].
//!
//! This module owns the description and its file; the `execve` and the taking of inherited fds
//! are [`crate::upgrade`]'s.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use wasmcsi_block::qos::IoLimits;

/// Bumped on any change an adopting binary of the previous version would misread.
pub const STATE_VERSION: u32 = 1;

/// Everything the next process image needs to take the volumes over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoverState {
    pub version: u32,
    /// Handovers this data path went through, this one included.
    pub handovers: u64,
    /// The binary that wrote this.
    pub from_binary: PathBuf,
    /// The replica server's listening socket, inherited.
    pub replica_listener: i32,
    /// The data-path socket's listener, inherited.
    pub socket_listener: i32,
    pub volumes: Vec<HandedVolume>,
    /// The owner of the volumes' FUSE mounts (`wasmcsi_frontend::owner`): the next image is the
    /// same owner, and holds its locks through the `execve`. Absent from a binary before owners.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<HandedOwner>,
}

/// The owner id of this process and the fd of its lock in each runtime directory, inherited.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandedOwner {
    pub id: String,
    pub locks: Vec<(PathBuf, i32)>,
}

/// One suspended volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandedVolume {
    pub volume: String,
    pub size: u64,
    pub epoch: u64,
    /// Each member's node name and address, in the engine's replica order.
    pub members: Vec<(String, Option<SocketAddr>)>,
    /// Each member's disk, in the same order; absent from a state an image before disks wrote
    /// (every member then on its node's disk `default`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<String>,
    /// The grant the volume's engine presents (the current one, renewed since its attach
    /// perhaps); absent from a state an image before grants wrote, and the new image then asks
    /// its grant source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<Vec<u8>>,
    /// The volume's I/O limits as its engine applies them; absent from a state an image before
    /// limits wrote (none were applied then).
    #[serde(default, skip_serializing_if = "IoLimits::is_unlimited")]
    pub limits: IoLimits,
    /// The FUSE connection's fd, inherited.
    pub session_fd: i32,
    pub mount: PathBuf,
    pub device: PathBuf,
    /// When its I/O stopped being answered, nanoseconds since the Unix epoch.
    pub suspended_at_ns: u64,
}

/// Handovers so far, as the data path reports them (socket `hello`, `/metrics`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoverReport {
    /// Handovers this data path went through (it is the same process, pid and all).
    pub handovers: u64,
    /// The longest I/O pause of a volume in the last handover, in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_pause_us: Option<u64>,
    /// How many volumes the last handover moved.
    #[serde(default)]
    pub last_volumes: usize,
    /// Why the last upgrade attempt did not happen (the process serves on, unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a handover state: {message}")]
    Malformed { path: PathBuf, message: String },
}

impl HandoverState {
    /// Writes the state to `path` whole or not at all (a temporary file renamed over it).
    pub fn write(&self, path: &Path) -> Result<(), StateError> {
        let io = |what, source| StateError::Io { what, path: path.to_owned(), source };
        let body = serde_json::to_vec_pretty(self)
            .map_err(|e| StateError::Malformed { path: path.to_owned(), message: e.to_string() })?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, body).map_err(|e| io("writing", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("renaming into place", e))
    }

    /// Reads and checks a state: its version, and that no fd is named twice (each is taken
    /// over exactly once).
    pub fn read(path: &Path) -> Result<Self, StateError> {
        let malformed = |message: String| StateError::Malformed { path: path.to_owned(), message };
        let body =
            std::fs::read(path).map_err(|source| StateError::Io { what: "reading", path: path.to_owned(), source })?;
        let state: Self = serde_json::from_slice(&body).map_err(|e| malformed(e.to_string()))?;
        if state.version != STATE_VERSION {
            return Err(malformed(format!("version {}, this binary adopts version {STATE_VERSION}", state.version)));
        }
        let mut fds: Vec<i32> = state.volumes.iter().map(|v| v.session_fd).collect();
        fds.extend([state.replica_listener, state.socket_listener]);
        fds.extend(state.owner.iter().flat_map(|o| o.locks.iter().map(|(_, fd)| *fd)));
        fds.sort_unstable();
        if fds.windows(2).any(|w| w[0] == w[1]) || fds.first().is_some_and(|fd| *fd <= 2) {
            return Err(malformed(format!("fds {fds:?} repeat or name stdio")));
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn state() -> HandoverState {
        HandoverState {
            version: STATE_VERSION,
            handovers: 3,
            from_binary: "/usr/bin/wasmcsi".into(),
            replica_listener: 7,
            socket_listener: 8,
            volumes: vec![HandedVolume {
                volume: "v1".into(),
                size: 1 << 30,
                epoch: 4,
                members: vec![("node-a".into(), Some("10.0.0.1:9501".parse().unwrap())), ("node-b".into(), None)],
                disks: vec!["default".into(), "ssd".into()],
                grant: Some(b"WCSIGRT1 a grant".to_vec()),
                limits: IoLimits { write_iops: 100, ..IoLimits::UNLIMITED },
                session_fd: 9,
                mount: "/run/fuse-v1.1.0".into(),
                device: "/dev/loop3".into(),
                suspended_at_ns: 1,
            }],
            owner: Some(HandedOwner { id: "0123abcd-0123456789abcdef".into(), locks: vec![("/run".into(), 10)] }),
        }
    }

    #[test]
    fn a_state_survives_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.json");
        state().write(&path).unwrap();
        assert_eq!(HandoverState::read(&path).unwrap(), state());
    }

    #[test]
    fn a_state_naming_an_fd_twice_or_of_another_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.json");
        let mut twice = state();
        twice.volumes[0].session_fd = 8;
        twice.write(&path).unwrap();
        assert!(matches!(HandoverState::read(&path), Err(StateError::Malformed { .. })));
        let mut other = state();
        other.version = STATE_VERSION + 1;
        other.write(&path).unwrap();
        let err = HandoverState::read(&path).unwrap_err();
        assert!(err.to_string().contains("version"), "{err}");
    }
}
