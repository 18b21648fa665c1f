//! Every way a CSI call can fail, and the one total mapping to gRPC codes. A failure is
//! logged once, here, where it becomes a `Status`.
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
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("an operation on {0} is already in progress")]
    InProgress(String),
    /// A paging token we did not hand out (the spec answers ABORTED).
    #[error("{0}")]
    InvalidToken(String),
    #[error("{0}")]
    Unimplemented(String),
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("{0}")]
    Mount(String),
    /// A storage server the node needs (an NFS server on mount) did not answer in time.
    #[error("{0}")]
    Unavailable(String),
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

impl CsiError {
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::Missing(_) | Self::Invalid(_) | Self::UnknownBackend { .. } => Code::InvalidArgument,
            Self::BackendNotLoaded(_) | Self::Unavailable(_) => Code::Unavailable,
            Self::NotFound(_) => Code::NotFound,
            Self::AlreadyExists(_) => Code::AlreadyExists,
            Self::FailedPrecondition(_) => Code::FailedPrecondition,
            Self::InProgress(_) | Self::InvalidToken(_) => Code::Aborted,
            Self::Unimplemented(_) => Code::Unimplemented,
            Self::Internal(_) | Self::Mount(_) => Code::Internal,
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
                    B::NotGranted(_) => Code::FailedPrecondition,
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

/// The one conversion to a Status. It logs nothing: `Driver::observe`, where every RPC ends,
/// logs each failure once with its method, code and duration.
impl From<CsiError> for tonic::Status {
    fn from(e: CsiError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

pub type CsiResult<T> = Result<T, CsiError>;
