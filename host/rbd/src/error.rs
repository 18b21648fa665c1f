//! The one error type of the client. Each variant is exactly one case of the WIT `types.error`
//! (named in brackets), so the runtime's mapping is a total `match` with no judgement left.
use nix::errno::Errno;

#[derive(Clone, Debug, thiserror::Error)]
pub enum RbdError {
    /// [invalid-argument] a bad pool, image or snapshot name, an unknown feature, an empty
    /// metadata key.
    #[error("{0}")]
    InvalidArgument(String),
    /// [not-found] the image, snapshot or pool does not exist.
    #[error("{0}")]
    NotFound(String),
    /// [already-exists] an image or snapshot of that name exists.
    #[error("{0}")]
    AlreadyExists(String),
    /// [failed-precondition] the object is in a state that forbids the call: an image with
    /// snapshots or watchers, a snapshot with children.
    #[error("{0}")]
    FailedPrecondition(String),
    /// [out-of-range] a shrink, or a size librbd cannot represent.
    #[error("{0}")]
    OutOfRange(String),
    /// [permission-denied] the cluster or pool is not granted to this backend (refused before
    /// any network traffic), or the cluster refused the credentials (cephx).
    #[error("{0}")]
    PermissionDenied(String),
    /// [unavailable] the cluster did not answer within the timeout, or refused connections.
    /// `monitors` names them, for the operator.
    #[error("ceph cluster {cluster} (monitors {monitors}) unavailable: {reason}")]
    Unavailable { cluster: String, monitors: String, reason: String },
    /// [resource-exhausted] the pool or cluster is full, or a quota is hit.
    #[error("{0}")]
    ResourceExhausted(String),
    /// [internal] anything else: an unexpected errno, a broken invariant.
    #[error("{0}")]
    Internal(String),
}

impl RbdError {
    /// The WIT error case this maps to (for logs and the runtime's tests).
    pub fn wit_case(&self) -> &'static str {
        match self {
            Self::InvalidArgument(_) => "invalid-argument",
            Self::NotFound(_) => "not-found",
            Self::AlreadyExists(_) => "already-exists",
            Self::FailedPrecondition(_) => "failed-precondition",
            Self::OutOfRange(_) => "out-of-range",
            Self::PermissionDenied(_) => "permission-denied",
            Self::Unavailable { .. } => "unavailable",
            Self::ResourceExhausted(_) => "resource-exhausted",
            Self::Internal(_) => "internal",
        }
    }

    pub(crate) fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }
}

/// Which cluster a failing call went to, for [`RbdError::Unavailable`].
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub cluster: String,
    pub monitors: String,
}

impl Target {
    pub fn unavailable(&self, reason: impl Into<String>) -> RbdError {
        RbdError::Unavailable { cluster: self.cluster.clone(), monitors: self.monitors.clone(), reason: reason.into() }
    }

    /// A negative return code of librados/librbd for operation `what` (which names the object).
    /// The mapping is generic; operations that give an errno a specific meaning (EBUSY on
    /// remove, EINVAL on flatten) match it before calling this.
    pub fn errno(&self, ret: i32, what: &str) -> RbdError {
        let errno = Errno::from_raw(ret.saturating_neg());
        let msg = format!("{what}: {} ({})", errno.desc(), errno as i32);
        match errno {
            Errno::ENOENT => RbdError::NotFound(msg),
            Errno::EEXIST => RbdError::AlreadyExists(msg),
            Errno::EPERM | Errno::EACCES | Errno::EROFS => RbdError::PermissionDenied(msg),
            Errno::EINVAL | Errno::ENAMETOOLONG => RbdError::InvalidArgument(msg),
            Errno::ENOTEMPTY | Errno::EBUSY | Errno::EXDEV => RbdError::FailedPrecondition(msg),
            Errno::ERANGE | Errno::EFBIG | Errno::EOVERFLOW => RbdError::OutOfRange(msg),
            Errno::ENOSPC | Errno::EDQUOT => RbdError::ResourceExhausted(msg),
            // What librados returns when its own mon/osd/mount timeouts fire, or the session
            // to the cluster is gone (ESHUTDOWN is also "this client was blocklisted").
            Errno::ETIMEDOUT
            | Errno::ENOTCONN
            | Errno::ESHUTDOWN
            | Errno::ECONNREFUSED
            | Errno::ECONNRESET
            | Errno::EHOSTUNREACH
            | Errno::ENETUNREACH
            | Errno::EAGAIN => self.unavailable(msg),
            _ => RbdError::Internal(msg),
        }
    }
}
