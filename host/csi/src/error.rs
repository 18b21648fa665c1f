//! Every way a CSI call can fail, and the one total mapping to gRPC codes. A failure is
//! logged once, here, where it becomes a `Status`.
use wasmcsi_runtime::metadata::MetadataError;
use wasmcsi_runtime::{CallError, WitError};

/// A CSI request failure, carrying what identifies it.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    #[error("missing required field {0}")]
    Missing(&'static str),
    #[error("{0}")]
    Invalid(String),
    #[error("unknown backend {name:?}; available: {}", if available.is_empty() { "none loaded".to_string() } else { available.join(", ") })]
    UnknownBackend { name: String, available: Vec<String> },
    #[error("backend {0} is not loaded on this host; retry when it is")]
    BackendNotLoaded(String),
    /// An object a request names does not exist (or its id cannot be one of ours).
    #[error("{kind} {id} not found")]
    ObjectNotFound { kind: ObjectKind, id: String },
    /// A node-local object asked of a node that is not its own, with no node plugins to ask.
    #[error("{id} lives on node {tag}, not on this node ({node})")]
    NotOnThisNode { id: String, tag: String, node: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// A backend planned a replicated block attachment without a `block` grant.
    #[error(
        "backend {backend} planned a replicated-block attachment but has no block grant ([backends.{backend}.grants.block])"
    )]
    NoBlockGrant { backend: String },
    /// Another call holds this key (a volume id, a name) or the other side of the backend's gate.
    #[error("an operation on {0} is already in progress")]
    InProgress(String),
    /// A paging token we did not hand out (the spec answers ABORTED).
    #[error("{0}")]
    InvalidToken(String),
    /// The backend lacks the feature the call needs.
    #[error("backend {backend} does not support {what}")]
    Unsupported { backend: String, what: &'static str },
    #[error("{0}")]
    Unimplemented(String),
    #[error("{0}")]
    Internal(String),
    /// The host's journal of volumes (in the runtime's metadata store) failed.
    #[error("journal of {subject}: {source}")]
    Journal {
        subject: String,
        #[source]
        source: MetadataError,
    },
    /// A node-local call to forward, on a controller that has no node plugins to forward to.
    #[error("a call for node {node} to forward, but no node plugins are configured")]
    NoPeers { node: String },
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("{0}")]
    Mount(String),
    /// A device step on this node failed: a loop device, making or growing a filesystem, a
    /// FUSE mount.
    #[error("{0}")]
    Device(#[source] wasmcsi_frontend::FrontendError),
    /// A Ceph cluster call of this node failed in a way no other code describes.
    #[error("{0}")]
    Rbd(#[source] wasmcsi_rbd::RbdError),
    /// Unmapping a kernel RBD device failed.
    #[error("{0}")]
    Krbd(#[source] wasmcsi_rbd::krbd::KrbdError),
    /// Recording or stopping an rbd-fuse this plugin runs failed.
    #[error("{0}")]
    RbdFuse(#[source] wasmcsi_rbd::fuse_attach::FuseAttachError),
    /// The node's data path failed to detach volume `volume_id`.
    #[error("the data path, detaching {volume_id}: {source}")]
    DataPath {
        volume_id: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A blocking step on this node died before it answered (it panicked).
    #[error("{0}")]
    Task(#[source] tokio::task::JoinError),
    /// A node's record of a staged volume could not be written.
    #[error("encoding the state of {volume_id}: {source}")]
    State {
        volume_id: String,
        #[source]
        source: serde_json::Error,
    },
    /// A storage server the node needs (an NFS server on mount) did not answer in time.
    #[error("{0}")]
    Unavailable(String),
    /// A node-local object whose node's plugin does not answer.
    #[error("{id} lives on node {tag}, whose node plugin does not answer")]
    NodeUnreachable { id: String, tag: String },
    /// No node plugin answers to take a new volume of a node-local backend.
    #[error("no node plugin answers to hold a {backend} volume")]
    NoNode { backend: String },
    /// A call forwarded to a node no node plugin answers for.
    #[error("node {node}: no node plugin of that name answers")]
    UnknownNode { node: String },
    /// The replicated block control plane (publishing, attaching a replicated volume).
    #[error(transparent)]
    Block(#[from] wasmcsi_block::catalog::CatalogError),
    /// No node the request allows can hold the volume (a node-local backend's placement).
    #[error("{0}")]
    ResourceExhausted(String),
    /// The node plugin a node-local call was forwarded to answered this (its code kept).
    #[error("node {node}: {}", status.message())]
    Peer { node: String, status: tonic::Status },
}

/// What kind of object an [`CsiError::ObjectNotFound`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectKind {
    Volume,
    Snapshot,
    /// the volume a snapshot is asked of
    SourceVolume,
    /// the snapshot or volume a new volume is asked to start from
    ContentSource,
    GroupSnapshot,
}

impl std::fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Volume => "volume",
            Self::Snapshot => "snapshot",
            Self::SourceVolume => "source volume",
            Self::ContentSource => "content source",
            Self::GroupSnapshot => "group snapshot",
        })
    }
}

impl CsiError {
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::Missing(_) | Self::Invalid(_) | Self::UnknownBackend { .. } => Code::InvalidArgument,
            Self::BackendNotLoaded(_)
            | Self::Unavailable(_)
            | Self::NodeUnreachable { .. }
            | Self::NoNode { .. }
            | Self::UnknownNode { .. } => Code::Unavailable,
            Self::ObjectNotFound { .. } | Self::NotOnThisNode { .. } | Self::NotFound(_) => Code::NotFound,
            Self::AlreadyExists(_) => Code::AlreadyExists,
            Self::FailedPrecondition(_) | Self::NoBlockGrant { .. } => Code::FailedPrecondition,
            Self::InProgress(_) | Self::InvalidToken(_) => Code::Aborted,
            Self::Unsupported { .. } | Self::Unimplemented(_) => Code::Unimplemented,
            Self::Internal(_)
            | Self::Mount(_)
            | Self::Journal { .. }
            | Self::NoPeers { .. }
            | Self::Device(_)
            | Self::Rbd(_)
            | Self::Krbd(_)
            | Self::RbdFuse(_)
            | Self::DataPath { .. }
            | Self::Task(_)
            | Self::State { .. } => Code::Internal,
            Self::ResourceExhausted(_) => Code::ResourceExhausted,
            Self::Peer { status, .. } => status.code(),
            Self::Block(e) => {
                use wasmcsi_block::catalog::CatalogError as B;
                match e {
                    B::Invalid(_) => Code::InvalidArgument,
                    B::NotFound(_) => Code::NotFound,
                    B::AlreadyExists(_) => Code::AlreadyExists,
                    B::FailedPrecondition(_) => Code::FailedPrecondition,
                    B::OutOfRange(_) => Code::OutOfRange,
                    B::ResourceExhausted(_) => Code::ResourceExhausted,
                    B::Unavailable(_) => Code::Unavailable,
                    B::Aborted(_) => Code::Aborted,
                    B::NotGranted(_) => Code::FailedPrecondition,
                    B::Denied(_) => Code::PermissionDenied,
                    B::Internal(_) => Code::Internal,
                }
            }
            Self::Call(CallError::Backend { error, .. }) => match error {
                WitError::InvalidArgument(_) => Code::InvalidArgument,
                WitError::NotFound(_) => Code::NotFound,
                WitError::AlreadyExists(_) => Code::AlreadyExists,
                WitError::FailedPrecondition(_) => Code::FailedPrecondition,
                WitError::OutOfRange(_) => Code::OutOfRange,
                WitError::ResourceExhausted(_) => Code::ResourceExhausted,
                WitError::Unavailable(_) => Code::Unavailable,
                WitError::Aborted(_) => Code::Aborted,
                WitError::Unimplemented(_) => Code::Unimplemented,
                WitError::DeadlineExceeded(_) => Code::DeadlineExceeded,
                WitError::PermissionDenied(_) => Code::PermissionDenied,
                WitError::Internal(_) => Code::Internal,
            },
            // The call may have done part of its work; the CO retries DEADLINE_EXCEEDED.
            Self::Call(CallError::Timeout { .. }) => Code::DeadlineExceeded,
            Self::Call(CallError::OutOfMemory { .. } | CallError::OutOfFuel { .. }) => Code::ResourceExhausted,
            Self::Call(CallError::Busy { .. }) => Code::Unavailable,
            Self::Call(CallError::Trap { .. } | CallError::BadOutput { .. }) => Code::Internal,
        }
    }
}

/// `code` as every `code` label and log field spells it: grpc-go's names, which the
/// kubernetes-csi sidecars' own metrics use (`OK`, `NotFound`, `DeadlineExceeded`), so one
/// query or alert reads the driver's and the sidecars' series alike. (tonic's `Debug` would
/// write `Ok`.)
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// The one conversion to a Status. It logs nothing: `Plugin::observe`, where every RPC ends,
/// logs each failure once with its method, code and duration.
impl From<CsiError> for tonic::Status {
    fn from(e: CsiError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

pub type CsiResult<T> = Result<T, CsiError>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way a backend call fails, each WIT error case included.
    fn every_call_error() -> Vec<CallError> {
        let (backend, op) = (String::from("b"), "create_volume");
        let m = || String::from("m");
        let wit = [
            WitError::InvalidArgument(m()),
            WitError::NotFound(m()),
            WitError::AlreadyExists(m()),
            WitError::FailedPrecondition(m()),
            WitError::OutOfRange(m()),
            WitError::ResourceExhausted(m()),
            WitError::Unavailable(m()),
            WitError::Aborted(m()),
            WitError::Unimplemented(m()),
            WitError::DeadlineExceeded(m()),
            WitError::PermissionDenied(m()),
            WitError::Internal(m()),
        ];
        let mut all: Vec<CallError> =
            wit.into_iter().map(|error| CallError::Backend { backend: backend.clone(), op, error }).collect();
        all.extend([
            CallError::Timeout { backend: backend.clone(), op, deadline: std::time::Duration::from_secs(1) },
            CallError::OutOfMemory { backend: backend.clone(), op, limit_mib: 1 },
            CallError::OutOfFuel { backend: backend.clone(), op },
            CallError::Trap { backend: backend.clone(), op, message: m() },
            CallError::BadOutput { backend: backend.clone(), op, message: m() },
            CallError::Busy { backend, op, limit: 1 },
        ]);
        all
    }

    /// `wasmcsi_backend_errors_total{code}` names the code the CSI caller got, spelled as
    /// `wasmcsi_csi_requests_total{code}` spells it.
    #[test]
    fn a_backend_error_is_counted_under_the_code_the_caller_gets() {
        for e in every_call_error() {
            let label = e.code();
            assert_eq!(code_name(CsiError::Call(e).code()), label);
        }
    }

    /// The messages COs and operators saw before the payloads were typed are kept.
    #[test]
    fn an_object_not_found_is_named_by_its_kind() {
        let e = CsiError::ObjectNotFound { kind: ObjectKind::SourceVolume, id: "b:v".into() };
        assert_eq!((e.code(), e.to_string()), (tonic::Code::NotFound, "source volume b:v not found".to_string()));
        let e = CsiError::Unsupported { backend: "b".into(), what: "expansion" };
        assert_eq!(
            (e.code(), e.to_string()),
            (tonic::Code::Unimplemented, "backend b does not support expansion".into())
        );
    }

    #[test]
    fn a_journal_failure_is_internal_names_its_subject_and_keeps_its_cause() {
        use std::error::Error as _;
        let e = CsiError::Journal { subject: "volume b:v".into(), source: MetadataError::Db("disk full".into()) };
        assert!(e.source().is_some_and(|s| s.to_string() == "metadata store disk full"), "{:?}", e.source());
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::Internal);
        assert_eq!(status.message(), "journal of volume b:v: metadata store disk full");
    }

    #[test]
    fn codes_are_spelled_as_grpc_go_spells_them() {
        assert_eq!(code_name(tonic::Code::Ok), "OK");
        assert_eq!(code_name(tonic::Code::Cancelled), "Canceled");
        assert_eq!(code_name(tonic::Code::NotFound), "NotFound");
        assert_eq!(code_name(tonic::Code::DeadlineExceeded), "DeadlineExceeded");
    }
}
