//! Why a backend call produced no result of its own ([`CallError`]), and the bound on what a
//! failed call can make the host write: every message a backend or a trap puts in an error is
//! clipped to [`MAX_ERROR_MESSAGE`] (the `log` capability keeps that much of each call's log
//! budget for it).
use crate::bindings::types::Error as WitError;
use std::time::Duration;

/// Why a backend call produced no result of its own.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The guest answered with a WIT error: its own, well-formed failure.
    #[error("backend {backend}: {op}: {}", describe(error).1)]
    Backend { backend: String, op: &'static str, error: WitError },
    #[error("backend {backend}: {op}: stopped at its deadline of {deadline:?}")]
    Timeout { backend: String, op: &'static str, deadline: Duration },
    #[error("backend {backend}: {op}: exceeded its memory limit of {limit_mib} MiB")]
    OutOfMemory { backend: String, op: &'static str, limit_mib: u64 },
    #[error("backend {backend}: {op}: used up its fuel budget")]
    OutOfFuel { backend: String, op: &'static str },
    #[error("backend {backend}: {op}: trapped: {message}")]
    Trap { backend: String, op: &'static str, message: String },
    /// The guest returned something the host cannot accept (malformed or out of contract).
    #[error("backend {backend}: {op}: returned invalid output: {message}")]
    BadOutput { backend: String, op: &'static str, message: String },
    #[error("backend {backend}: {op}: {limit} calls already running; retry later")]
    Busy { backend: String, op: &'static str, limit: u32 },
}

impl CallError {
    /// How the call failed, for the `kind` label of `wasmcsi_backend_errors_total`: `error`
    /// when the backend answered a WIT error, else how the host stopped it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Backend { .. } => "error",
            Self::Timeout { .. } => "timeout",
            Self::OutOfMemory { .. } => "out-of-memory",
            Self::OutOfFuel { .. } => "out-of-fuel",
            Self::Trap { .. } => "trap",
            Self::BadOutput { .. } => "bad-output",
            Self::Busy { .. } => "busy",
        }
    }

    /// The gRPC code the CSI caller gets for this failure, spelled as grpc-go and the
    /// kubernetes-csi sidecars spell it (`NotFound`, `DeadlineExceeded`): the `code` label of
    /// every metric. `wasmcsi_csi::error` maps the same failures to `tonic::Code`; its tests
    /// hold the two to one answer.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Backend { error, .. } => match error {
                WitError::InvalidArgument(_) => "InvalidArgument",
                WitError::NotFound(_) => "NotFound",
                WitError::AlreadyExists(_) => "AlreadyExists",
                WitError::FailedPrecondition(_) => "FailedPrecondition",
                WitError::OutOfRange(_) => "OutOfRange",
                WitError::ResourceExhausted(_) => "ResourceExhausted",
                WitError::Unavailable(_) => "Unavailable",
                WitError::Aborted(_) => "Aborted",
                WitError::Unimplemented(_) => "Unimplemented",
                WitError::DeadlineExceeded(_) => "DeadlineExceeded",
                WitError::PermissionDenied(_) => "PermissionDenied",
                WitError::Internal(_) => "Internal",
            },
            // The call may have done part of its work; the CO retries DEADLINE_EXCEEDED.
            Self::Timeout { .. } => "DeadlineExceeded",
            Self::OutOfMemory { .. } | Self::OutOfFuel { .. } => "ResourceExhausted",
            Self::Busy { .. } => "Unavailable",
            Self::Trap { .. } | Self::BadOutput { .. } => "Internal",
        }
    }
}

/// Longest message of a [`CallError`] (a backend's error message, a trap's text, a rejected
/// answer's reason): what the host logs for a failed call and hands the CO, so a backend cannot
/// flood the node's log or a CO's gRPC client through an error. Longer messages are clipped.
pub const MAX_ERROR_MESSAGE: usize = 1024;

/// `message` clipped to [`MAX_ERROR_MESSAGE`], saying so.
pub(crate) fn clip_message(message: String) -> String {
    if message.len() <= MAX_ERROR_MESSAGE {
        return message;
    }
    const MARK: &str = " [clipped]";
    let kept = clip(&message, MAX_ERROR_MESSAGE - MARK.len());
    format!("{kept}{MARK}")
}

/// A backend's WIT error with its message clipped (see [`MAX_ERROR_MESSAGE`]).
pub(crate) fn clip_wit(e: WitError) -> WitError {
    use WitError::*;
    match e {
        InvalidArgument(m) => InvalidArgument(clip_message(m)),
        NotFound(m) => NotFound(clip_message(m)),
        AlreadyExists(m) => AlreadyExists(clip_message(m)),
        FailedPrecondition(m) => FailedPrecondition(clip_message(m)),
        OutOfRange(m) => OutOfRange(clip_message(m)),
        ResourceExhausted(m) => ResourceExhausted(clip_message(m)),
        Unavailable(m) => Unavailable(clip_message(m)),
        Aborted(m) => Aborted(clip_message(m)),
        Unimplemented(m) => Unimplemented(clip_message(m)),
        DeadlineExceeded(m) => DeadlineExceeded(clip_message(m)),
        PermissionDenied(m) => PermissionDenied(clip_message(m)),
        Internal(m) => Internal(clip_message(m)),
    }
}

/// The case name and message of a WIT error.
pub fn describe(e: &WitError) -> (&'static str, &str) {
    match e {
        WitError::InvalidArgument(m) => ("invalid-argument", m),
        WitError::NotFound(m) => ("not-found", m),
        WitError::AlreadyExists(m) => ("already-exists", m),
        WitError::FailedPrecondition(m) => ("failed-precondition", m),
        WitError::OutOfRange(m) => ("out-of-range", m),
        WitError::ResourceExhausted(m) => ("resource-exhausted", m),
        WitError::Unavailable(m) => ("unavailable", m),
        WitError::Aborted(m) => ("aborted", m),
        WitError::Unimplemented(m) => ("unimplemented", m),
        WitError::DeadlineExceeded(m) => ("deadline-exceeded", m),
        WitError::PermissionDenied(m) => ("permission-denied", m),
        WitError::Internal(m) => ("internal", m),
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn clip(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
