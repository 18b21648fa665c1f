//! Who may do what on the replica port: the decisions, apart from the I/O that carries them out
//! (the server's).
//!
//! A connection's [`Caller`] is who the TLS handshake said it is (its certificate's role) or, on
//! a plaintext connection (`--tls-mode off`, or a legacy peer in `permissive`), nobody in
//! particular: such a peer keeps the rules of the version before TLS, every request allowed.
//!
//! | request | controller | node N | plaintext |
//! |---|---|---|---|
//! | engine session (`Grant` → `Hello` → `Claim`) | any volume, no grant needed | only with a verified grant for (that volume, N), of an epoch ≥ the replica's; `Claim` = the grant's epoch | yes |
//! | `CreateReplica`, `CreateReplicaOn`, `DeleteReplica`, `SetRecord`, `EngineCall` (but its status) | yes | refused | yes |
//! | `Identify`, `NodeInfo`, `ListDisks`, `Describe`, `EngineCall` asking the engine's status | yes | yes | yes |
//!
//! An engine's status is read like a record (`Describe`): a node plugin's stats and plans ask its
//! own data path's engine for it, and it changes nothing.
//!
//! A grant names the volume, the node whose engine may open sessions of it and an epoch, not a
//! replica: it is what the controller's ControllerPublishVolume gave that node, and an engine
//! needs a session on every replica of the volume, wherever it lives. So one grant opens the
//! volume's replica on any disk of any server (a server with several replicas of the volume,
//! one per disk, takes the same grant for each, and checks each replica's epoch on its own), and
//! nothing else: the disk a `Hello` names only says which of the volume's replicas it opens,
//! never another volume's, so naming the disk in the grant would add nothing it could refuse.
//!
//! A grant is verified against the CA bundle of the server's current credentials, at the time
//! it arrives (`wasmcsi_trust::grant::verify`: the controller's signature and chain, validity
//! ±30 s); the replica's epoch is compared when the session opens (`ReplicaNode::open_session`,
//! under the lock that marks the replica dirty, so a refused session changes nothing).

use std::fmt;
use std::net::SocketAddr;
use std::time::SystemTime;

use wasmcsi_trust::grant::{self, GrantError};
use wasmcsi_trust::{Role, TrustAnchors};

use crate::catalog::engine_call::EngineRequest;
use crate::protocol::{Message, RecordInfo, ReplicaHeader, Status};

/// Who is at the other end of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// A plaintext peer: unauthenticated, served by the rules before TLS.
    Plaintext,
    /// A peer with a verified certificate of this role.
    Tls(Role),
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Plaintext => f.write_str("a plaintext peer"),
            Caller::Tls(role) => write!(f, "{role}"),
        }
    }
}

/// A grant this server verified for the connection's node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Granted {
    pub(crate) volume: String,
    pub(crate) epoch: u64,
}

/// Why a request was refused (`Denied`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("{request} is the controller's to make")]
    ControllerOnly { request: &'static str },
    #[error("a node's session needs a grant first, and none was sent")]
    NoGrant,
    #[error("a grant may only be the first frame of a connection")]
    LateGrant,
    #[error("the grant is for volume {granted:?}, the session is for {asked:?}")]
    OtherVolume { granted: String, asked: String },
    #[error("the grant is for node {granted:?}, the peer is node {peer:?}")]
    OtherNode { granted: String, peer: String },
    #[error("{0}")]
    Grant(#[from] GrantError),
    #[error("the grant's epoch {granted} is older than the replica's {replica}")]
    StaleEpoch { granted: u64, replica: u64 },
    #[error("the session claimed epoch {claimed}, its grant is for epoch {granted}")]
    OtherClaim { claimed: u64, granted: u64 },
}

impl Caller {
    /// Verifies a `Grant` sent as the first frame. `Ok(None)` for a peer that needs none (the
    /// controller, a plaintext peer): its session is not bound to a grant.
    pub(crate) fn accept_grant(
        &self,
        encoded: &[u8],
        anchors: &TrustAnchors,
        now: SystemTime,
    ) -> Result<Option<Granted>, Refusal> {
        let Caller::Tls(Role::Node(peer)) = self else { return Ok(None) };
        let verified = grant::verify(encoded, anchors, now)?;
        if &verified.node != peer {
            return Err(Refusal::OtherNode { granted: verified.node, peer: peer.clone() });
        }
        Ok(Some(Granted { volume: verified.volume, epoch: verified.epoch }))
    }

    /// Whether a `Hello` for `volume` may open a session; the lowest replica epoch it is
    /// refused at comes from the grant (a node's session only).
    pub(crate) fn may_open(&self, volume: &str, granted: Option<&Granted>) -> Result<Option<u64>, Refusal> {
        match (self, granted) {
            (Caller::Tls(Role::Node(_)), None) => Err(Refusal::NoGrant),
            (Caller::Tls(Role::Node(_)), Some(g)) if g.volume != volume => {
                Err(Refusal::OtherVolume { granted: g.volume.clone(), asked: volume.to_owned() })
            }
            (Caller::Tls(Role::Node(_)), Some(g)) => Ok(Some(g.epoch)),
            _ => Ok(None),
        }
    }

    /// Whether a control request (no session) may be made.
    pub(crate) fn may_control(&self, request: &Message) -> Result<(), Refusal> {
        // Only a node is refused anything: the controller's and plaintext peers' requests are
        // not looked into (an engine call's body is parsed by the engine, once).
        if !matches!(self, Caller::Tls(Role::Node(_))) {
            return Ok(());
        }
        let request = match request {
            Message::CreateReplica { .. } => "CreateReplica",
            Message::CreateReplicaOn { .. } => "CreateReplicaOn",
            Message::DeleteReplica { .. } => "DeleteReplica",
            Message::SetRecord { .. } => "SetRecord",
            Message::EngineCall { request, .. } if is_status(request) => return Ok(()),
            Message::EngineCall { .. } => "EngineCall",
            _ => return Ok(()),
        };
        Err(Refusal::ControllerOnly { request })
    }
}

/// Whether an `EngineCall`'s body asks only for the engine's status (a read).
fn is_status(request: &[u8]) -> bool {
    matches!(serde_json::from_slice::<EngineRequest>(request), Ok(EngineRequest::Status))
}

/// Whether a session's `Claim` matches its grant (sessions without one claim freely).
pub(crate) fn may_claim(granted: Option<&Granted>, claimed: u64) -> Result<(), Refusal> {
    match granted {
        Some(g) if g.epoch != claimed => Err(Refusal::OtherClaim { claimed, granted: g.epoch }),
        _ => Ok(()),
    }
}

/// The reply that refuses `request`: its own reply message, status `Denied`.
pub(crate) fn denied(request: &Message) -> Message {
    match request {
        Message::Hello { volume_id, .. } => {
            Message::HelloReply { status: Status::Denied, header: nothing_of(volume_id) }
        }
        Message::EngineCall { .. } => Message::EngineReply { status: Status::Denied, reply: Vec::new() },
        Message::Describe { volume_id, .. } => Message::Description {
            status: Status::Denied,
            header: nothing_of(volume_id),
            record: RecordInfo::default(),
        },
        Message::NodeInfo => {
            Message::NodeInfoReply { status: Status::Denied, capacity: 0, available: 0, replicas: Vec::new() }
        }
        Message::Identify => Message::Identity { status: Status::Denied, node: String::new(), labels: Vec::new() },
        Message::ListDisks => Message::DiskList { status: Status::Denied, disks: Vec::new() },
        Message::Read { .. } | Message::ReadExtent { .. } | Message::ReadSnapshot { .. } => {
            Message::ReadReply { status: Status::Denied, data: Vec::new() }
        }
        Message::ListExtents { .. } | Message::ListSnapshotExtents { .. } | Message::ListSnapshotDelta { .. } => {
            Message::ExtentMap { status: Status::Denied, extents: Vec::new() }
        }
        _ => Message::Reply { status: Status::Denied },
    }
}

/// The header a refusal carries: the volume asked for, nothing about it.
fn nothing_of(volume_id: &str) -> ReplicaHeader {
    ReplicaHeader { volume_id: volume_id.to_owned(), size: 0, revision: 0, snapshots: Vec::new(), dirty: false }
}

/// Where the connection came from and who it is, for the one log line of a refusal.
pub(crate) fn log_refusal(peer: SocketAddr, caller: &Caller, request: &Message, why: &Refusal) {
    tracing::warn!(
        replica.peer = %peer,
        replica.caller = %caller,
        request = request_name(request),
        reason = %why,
        "replica request denied; closing the connection"
    );
}

fn request_name(m: &Message) -> &'static str {
    match m {
        Message::Grant { .. } => "Grant",
        Message::Hello { .. } => "Hello",
        Message::Claim { .. } => "Claim",
        Message::CreateReplica { .. } => "CreateReplica",
        Message::CreateReplicaOn { .. } => "CreateReplicaOn",
        Message::DeleteReplica { .. } => "DeleteReplica",
        Message::SetRecord { .. } => "SetRecord",
        Message::EngineCall { .. } => "EngineCall",
        _ => "a request",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n: &str) -> Caller {
        Caller::Tls(Role::Node(n.into()))
    }

    #[test]
    fn a_node_makes_no_change_of_the_controllers_but_reads_like_it() {
        let writes = [
            Message::CreateReplica { volume_id: "v".into(), size: 4096 },
            Message::CreateReplicaOn { disk: "ssd".into(), volume_id: "v".into(), size: 4096 },
            Message::DeleteReplica { volume_id: "v".into(), disk: crate::protocol::DEFAULT_DISK.into() },
            Message::SetRecord {
                volume_id: "v".into(),
                version: 2,
                epoch: 2,
                data: vec![],
                disk: crate::protocol::DEFAULT_DISK.into(),
            },
            Message::EngineCall { volume_id: "v".into(), request: vec![] },
        ];
        let reads = [
            Message::Identify,
            Message::NodeInfo,
            Message::ListDisks,
            Message::Describe { volume_id: "v".into(), disk: crate::protocol::DEFAULT_DISK.into() },
        ];
        for m in &writes {
            assert!(matches!(node("a").may_control(m), Err(Refusal::ControllerOnly { .. })), "{m:?}");
            assert!(Caller::Tls(Role::Controller).may_control(m).is_ok(), "{m:?}");
            assert!(Caller::Plaintext.may_control(m).is_ok(), "{m:?}");
        }
        for m in &reads {
            assert!(node("a").may_control(m).is_ok(), "{m:?}");
        }
    }

    #[test]
    fn a_node_may_ask_an_engine_its_status_and_nothing_else() {
        let call = |r: &EngineRequest| Message::EngineCall {
            volume_id: "v".into(),
            request: serde_json::to_vec(r).expect("encodes"),
        };
        assert!(node("a").may_control(&call(&EngineRequest::Status)).is_ok());
        for r in [
            EngineRequest::Snapshot { name: "s".into() },
            EngineRequest::DeleteSnapshot { name: "s".into() },
            EngineRequest::Expand { size: 1 << 30 },
            EngineRequest::SetLimits { limits: crate::qos::IoLimits { write_iops: 1, ..Default::default() } },
            EngineRequest::ReplaceReplica { index: 0, addr: "127.0.0.1:9".parse().expect("addr"), disk: "ssd".into() },
            EngineRequest::AddReplica {
                addr: "127.0.0.1:9".parse().expect("addr"),
                disk: "ssd".into(),
                node: "c".into(),
            },
            EngineRequest::RemoveReplica { addr: "127.0.0.1:9".parse().expect("addr"), disk: "ssd".into() },
            EngineRequest::HoldSnapshot { holder: "g".into(), name: "s".into(), hold_ms: 1 },
            EngineRequest::ReleaseHold { holder: "g".into() },
        ] {
            assert!(matches!(node("a").may_control(&call(&r)), Err(Refusal::ControllerOnly { .. })), "{r:?}");
        }
        // A body that is no engine request at all is no status request either.
        for body in [&b"status"[..], b"", br#"{"op":"expand"}"#] {
            let m = Message::EngineCall { volume_id: "v".into(), request: body.to_vec() };
            assert!(node("a").may_control(&m).is_err(), "{:?}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn a_nodes_session_needs_a_grant_of_that_volume_and_claims_its_epoch() {
        let granted = Granted { volume: "v".into(), epoch: 4 };
        assert!(matches!(node("a").may_open("v", None), Err(Refusal::NoGrant)));
        assert!(matches!(node("a").may_open("w", Some(&granted)), Err(Refusal::OtherVolume { .. })));
        assert_eq!(node("a").may_open("v", Some(&granted)).ok(), Some(Some(4)));
        assert_eq!(Caller::Tls(Role::Controller).may_open("v", None).ok(), Some(None));
        assert_eq!(Caller::Plaintext.may_open("v", None).ok(), Some(None));
        assert!(may_claim(Some(&granted), 4).is_ok());
        assert!(matches!(may_claim(Some(&granted), 5), Err(Refusal::OtherClaim { claimed: 5, granted: 4 })));
        assert!(may_claim(None, 9).is_ok());
    }

    #[test]
    fn each_refusal_is_the_refused_requests_own_reply() {
        let hello = Message::Hello {
            volume_id: "v".into(),
            protocol_version: 1,
            revision: 0,
            disk: crate::protocol::DEFAULT_DISK.into(),
        };
        assert!(matches!(denied(&hello), Message::HelloReply { status: Status::Denied, .. }));
        let call = Message::EngineCall { volume_id: "v".into(), request: vec![] };
        assert!(matches!(denied(&call), Message::EngineReply { status: Status::Denied, .. }));
        let delta = Message::ListSnapshotDelta { base: None, name: "s".into(), offset: 0, len: 1 };
        assert_eq!(denied(&delta), Message::ExtentMap { status: Status::Denied, extents: Vec::new() });
        for m in [
            Message::Grant { grant: vec![] },
            Message::Claim { epoch: 1 },
            Message::DeleteReplica { volume_id: "v".into(), disk: crate::protocol::DEFAULT_DISK.into() },
        ] {
            assert_eq!(denied(&m), Message::Reply { status: Status::Denied });
        }
    }
}
