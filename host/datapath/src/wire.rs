//! The data-path socket's wire format: what the node plugin asks a data-path process
//! (`wasmcsi datapath`) and what it answers. One request, one reply, each a frame of a 4-byte
//! big-endian length and that many bytes of JSON; a frame over [`MAX_FRAME`] is refused before
//! anything is allocated for it. Every frame carries [`WIRE_VERSION`]; a peer that speaks
//! another version gets a `version` error naming both, so a plugin and a data path of different
//! builds fail loudly instead of misreading each other.
//!
//! This module owns the bytes and nothing else: the server ([`crate::socket`]) and the client
//! ([`crate::client`]) do the I/O.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use wasmcsi_block::catalog::AttachInfo;
use wasmcsi_block::catalog::engine_call::EngineStatus;
use wasmcsi_block::qos::IoLimits;
use wasmcsi_trust::TlsMode;

use crate::rbd_fuse::{RbdFuseSpec, RbdFuseView};

/// Bumped on any change a peer of the previous version would misread.
pub const WIRE_VERSION: u32 = 1;
/// Largest frame either side sends or accepts: a list of every attached volume fits many
/// times over; anything larger is a broken or hostile peer.
pub const MAX_FRAME: usize = 1 << 20;

/// What the plugin asks, with the version it speaks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestFrame {
    pub version: u32,
    pub request: Request,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Who serves here (its pid): how the plugin sees that the data path runs.
    Hello,
    /// Start the volume's engine and expose it as a block device; the running one when it is.
    Attach {
        volume: String,
        size: u64,
        epoch: u64,
        /// Each member's node name and address, in the engine's replica order.
        members: Vec<(String, Option<SocketAddr>)>,
        /// Each member's disk, in the same order; absent from a plugin of the version before
        /// disks (every member then on its node's disk `default`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        disks: Vec<String>,
        /// The volume's grant to this node as the controller signed it; absent from a plugin
        /// of the version before grants (the data path then asks its grant source).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grant: Option<Vec<u8>>,
        /// The volume's I/O limits (the record's); absent from a plugin of the version before
        /// limits, and then none.
        #[serde(default, skip_serializing_if = "IoLimits::is_unlimited")]
        limits: IoLimits,
    },
    /// Stop the volume's engine (its device must not be mounted); absent succeeds.
    Detach { volume: String },
    /// One attached volume, or none.
    Status { volume: String },
    /// Every attached volume.
    List,
    /// Hand every volume to the wasmcsi binary at `binary` (a live upgrade): answered before
    /// it starts; `hello` shows the outcome ([`Reply::handover`]).
    Upgrade {
        binary: PathBuf,
        /// A new TLS configuration for the replica port, taken by the new binary (checked first:
        /// a change that would cut an attached volume's engine off its replicas is refused).
        /// Absent: the same as now. A data path of the version before it ignores the field, so
        /// the client checks the mode the upgraded data path reports ([`Reply::tls_mode`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tls: Option<TlsChange>,
    },
    /// Start rbd-fuse for an RBD volume ([`crate::rbd_fuse`]); the running one when it is.
    /// Added without a version bump: a data path of the previous version refuses it as
    /// malformed, and everything else it answers as before.
    RbdFuseAttach { attachment: RbdFuseSpec },
    /// Stop an RBD volume's rbd-fuse (its file must not be under a loop device); absent
    /// succeeds.
    RbdFuseDetach { volume: String },
    /// Every rbd-fuse attachment.
    RbdFuseList,
}

impl Request {
    /// The request's name, for logs and spans.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Hello => "hello",
            Self::Attach { .. } => "attach",
            Self::Detach { .. } => "detach",
            Self::Status { .. } => "status",
            Self::List => "list",
            Self::Upgrade { .. } => "upgrade",
            Self::RbdFuseAttach { .. } => "rbd-fuse-attach",
            Self::RbdFuseDetach { .. } => "rbd-fuse-detach",
            Self::RbdFuseList => "rbd-fuse-list",
        }
    }

    pub fn attach(volume: &str, info: &AttachInfo) -> Self {
        Self::Attach {
            volume: volume.to_owned(),
            size: info.size,
            epoch: info.epoch,
            members: info.members.clone(),
            disks: info.disks.clone(),
            grant: info.grant.clone(),
            limits: info.limits,
        }
    }
}

/// The replica port's TLS configuration a live upgrade moves to (`wasmcsi upgrade datapath
/// --tls-mode … --tls-dir … --authority …`): the mode, and the credentials directory and
/// authority endpoint where they change (absent: the ones the data path runs with now).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsChange {
    #[serde(with = "tls_mode_name")]
    pub mode: TlsMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<String>,
}

/// A [`TlsMode`] on the wire: its flag value (`off`, `permissive`, `required`).
mod tls_mode_name {
    use serde::{Deserialize, Deserializer, Serializer};
    use wasmcsi_trust::TlsMode;

    pub fn serialize<S: Serializer>(mode: &TlsMode, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(mode)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TlsMode, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// An attached volume as the plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeView {
    /// The replica set's id.
    pub volume: String,
    /// The kernel block device the frontend made, e.g. `/dev/loop3`.
    pub device: PathBuf,
    /// The process whose engine serves the device (for logs: pids collide across pid
    /// namespaces, in pods every process is pid 1).
    pub pid: u32,
    /// The owner id of that process start (`wasmcsi_frontend::owner`): what tells the engine
    /// that serves the device now from one a restarted data path no longer has. Empty from a
    /// data path of the version before it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub owner: String,
    pub status: EngineStatus,
}

impl VolumeView {
    /// Replicas that serve reads and count for acknowledgments.
    pub fn healthy(&self) -> usize {
        self.status.replicas.iter().filter(|r| r.state == "healthy").count()
    }

    /// When the replicas are on fewer replica servers (nodes) than there are replicas: how many
    /// of each. `None` when each is on a node of its own, or the engine does not say where they
    /// are (a data path of the version before it).
    pub fn shared_nodes(&self) -> Option<(usize, usize)> {
        let servers: Option<std::collections::BTreeSet<_>> = self.status.replicas.iter().map(|r| r.server).collect();
        let servers = servers?.len();
        let replicas = self.status.replicas.len();
        (servers < replicas).then_some((replicas, servers))
    }

    /// The replica being rebuilt, with bytes done and to do.
    pub fn rebuild(&self) -> Option<(usize, u64, u64)> {
        self.status
            .replicas
            .iter()
            .enumerate()
            .find_map(|(i, r)| (r.rebuild_total > 0).then_some((i, r.rebuilt, r.rebuild_total)))
    }
}

/// Why a request failed, for the plugin to map to a CSI code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// Another attach or detach of the volume runs: retry.
    Busy,
    /// The request made no sense (malformed, unknown volume id form).
    Invalid,
    /// The peer speaks another wire version.
    Version,
    /// The engine, the frontend or a replica failed.
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    pub kind: ErrorKind,
    pub message: String,
}

/// The answer, with the version the data path speaks and its pid.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub version: u32,
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<WireError>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumeView>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeView>,
    /// Live upgrades of this data path so far (`hello` and `upgrade` answer it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover: Option<crate::handover::HandoverReport>,
    /// rbd-fuse attachments (`rbd-fuse-attach`: the one made; `rbd-fuse-list`: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rbd_fuse: Vec<RbdFuseView>,
    /// How the replica port travels now (`hello` answers it): `off`, `permissive` or
    /// `required`. Absent from a data path of the version before live TLS changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_mode: Option<String>,
}

impl Reply {
    pub fn ok() -> Self {
        Self { version: WIRE_VERSION, pid: std::process::id(), ..Self::default() }
    }

    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { error: Some(WireError { kind, message: message.into() }), ..Self::ok() }
    }
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("the peer closed the connection")]
    Closed,
    #[error("a frame of {0} bytes is over the limit of {MAX_FRAME}")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Writes `value` as one frame.
pub async fn write_frame<T: Serialize>(out: &mut (impl AsyncWrite + Unpin), value: &T) -> Result<(), FrameError> {
    let body = serde_json::to_vec(value)?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge(body.len()))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    out.write_all(&frame).await?;
    out.flush().await?;
    Ok(())
}

/// Reads one frame; [`FrameError::Closed`] when the peer closed before its first byte.
pub async fn read_frame<T: for<'de> Deserialize<'de>>(input: &mut (impl AsyncRead + Unpin)) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    // Grown with the bytes that arrive, not allocated from the length a peer claims: a peer
    // that announces a large frame and sends nothing costs nothing.
    let mut body = Vec::new();
    input.take(len as u64).read_to_end(&mut body).await?;
    if body.len() < len {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok(serde_json::from_slice(&body)?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[tokio::test]
    async fn a_request_survives_the_round_trip() {
        let frame = RequestFrame {
            version: WIRE_VERSION,
            request: Request::Attach {
                volume: "v1".into(),
                size: 1 << 30,
                epoch: 7,
                members: vec![("node-a".into(), Some("10.0.0.1:9501".parse().unwrap())), ("node-b".into(), None)],
                disks: vec!["default".into(), "ssd".into()],
                grant: Some(b"WCSIGRT1 a grant".to_vec()),
                limits: IoLimits { read_bytes_per_second: 1 << 20, ..IoLimits::UNLIMITED },
            },
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &frame).await.unwrap();
        assert_eq!(&buf[..4], &u32::try_from(buf.len() - 4).unwrap().to_be_bytes());
        let back: RequestFrame = read_frame(&mut buf.as_slice()).await.unwrap();
        assert_eq!(back, frame);
    }

    #[tokio::test]
    async fn an_oversized_length_is_refused_before_reading_the_body() {
        let mut buf = u32::try_from(MAX_FRAME + 1).unwrap().to_be_bytes().to_vec();
        buf.extend_from_slice(b"{}");
        let r: Result<RequestFrame, _> = read_frame(&mut buf.as_slice()).await;
        assert!(matches!(r, Err(FrameError::TooLarge(n)) if n == MAX_FRAME + 1), "{r:?}");
    }

    #[tokio::test]
    async fn garbage_is_malformed_and_an_empty_stream_closed() {
        let mut buf = 3u32.to_be_bytes().to_vec();
        buf.extend_from_slice(b"{x]");
        let r: Result<RequestFrame, _> = read_frame(&mut buf.as_slice()).await;
        assert!(matches!(r, Err(FrameError::Malformed(_))), "{r:?}");
        let r: Result<RequestFrame, _> = read_frame(&mut [].as_slice()).await;
        assert!(matches!(r, Err(FrameError::Closed)), "{r:?}");
    }

    #[test]
    fn a_view_counts_healthy_replicas_and_finds_the_rebuild() {
        use wasmcsi_block::catalog::engine_call::EngineReplica;
        let replica = |state: &str, rebuilt, total| EngineReplica {
            state: state.into(),
            down_since_ns: None,
            rebuilt,
            rebuild_total: total,
            server: None,
            disk: None,
        };
        let view = VolumeView {
            volume: "v".into(),
            device: "/dev/loop9".into(),
            pid: 1,
            owner: String::new(),
            status: EngineStatus {
                replicas: vec![replica("healthy", 0, 0), replica("rebuilding", 5, 10), replica("down", 0, 0)],
                ..EngineStatus::default()
            },
        };
        assert_eq!(view.healthy(), 1);
        assert_eq!(view.rebuild(), Some((1, 5, 10)));
        assert_eq!(view.shared_nodes(), None, "no server named: nothing known");
    }

    #[test]
    fn a_view_says_when_replicas_share_a_node() {
        use wasmcsi_block::catalog::engine_call::EngineReplica;
        let on = |server: &str, disk: &str| EngineReplica {
            state: "healthy".into(),
            server: Some(server.parse().expect("address")),
            disk: Some(disk.into()),
            ..EngineReplica::default()
        };
        let view = |replicas| VolumeView {
            volume: "v".into(),
            device: "/dev/loop9".into(),
            pid: 1,
            owner: String::new(),
            status: EngineStatus { replicas, ..EngineStatus::default() },
        };
        let one_node = view(vec![on("10.0.0.1:9501", "default"), on("10.0.0.1:9501", "d1"), on("10.0.0.1:9501", "d2")]);
        assert_eq!(one_node.shared_nodes(), Some((3, 1)));
        let two_nodes =
            view(vec![on("10.0.0.1:9501", "default"), on("10.0.0.2:9501", "default"), on("10.0.0.1:9501", "d1")]);
        assert_eq!(two_nodes.shared_nodes(), Some((3, 2)));
        let three =
            view(vec![on("10.0.0.1:9501", "default"), on("10.0.0.2:9501", "default"), on("10.0.0.3:9501", "default")]);
        assert_eq!(three.shared_nodes(), None);
    }
}
