//! The one error type of the client. Each variant is exactly one case of the WIT `types.error`
//! (named in brackets), so the runtime's mapping is a total `match` with no judgement left.
use nfs3_client::nfs3_types::mount::mountstat3;
use nfs3_client::nfs3_types::nfs3::nfsstat3;

#[derive(Debug, Clone, thiserror::Error)]
pub enum NfsError {
    /// [invalid-argument] a bad path (absolute, `..`, NUL, over-long component), a path that is
    /// not the kind the operation needs (read-file of a directory), a file too large to read.
    #[error("{0}")]
    InvalidArgument(String),
    /// [not-found] the path, its parent, or the export on the server does not exist.
    #[error("{0}")]
    NotFound(String),
    /// [already-exists] the target of a copy or rename exists, or mkdir meets a non-directory.
    #[error("{0}")]
    AlreadyExists(String),
    /// [permission-denied] the export is not granted to this backend (refused before any
    /// network traffic), a path crosses a symlink, or the server refused the credentials.
    #[error("{0}")]
    PermissionDenied(String),
    /// [unavailable] the server did not answer within the configured timeout, refused or reset
    /// the connection, or is temporarily busy. `server` names it, for the operator.
    #[error("nfs server {server} unavailable: {reason}")]
    Unavailable { server: String, reason: String },
    /// [resource-exhausted] the export is full or a quota is hit.
    #[error("{0}")]
    NoSpace(String),
    /// [internal] anything else: a server fault, a protocol error, a broken invariant.
    #[error("{0}")]
    Internal(String),
}

impl NfsError {
    /// The WIT error case this maps to (for logs and the runtime's tests).
    pub fn wit_case(&self) -> &'static str {
        match self {
            Self::InvalidArgument(_) => "invalid-argument",
            Self::NotFound(_) => "not-found",
            Self::AlreadyExists(_) => "already-exists",
            Self::PermissionDenied(_) => "permission-denied",
            Self::Unavailable { .. } => "unavailable",
            Self::NoSpace(_) => "resource-exhausted",
            Self::Internal(_) => "internal",
        }
    }
}

/// An NFS status from the server, for operation `what` (which names export and path).
pub(crate) fn from_status(stat: nfsstat3, what: &str, server: &str) -> NfsError {
    use nfsstat3 as S;
    let msg = format!("{what}: {stat}");
    match stat {
        S::NFS3ERR_NOENT | S::NFS3ERR_STALE | S::NFS3ERR_BADHANDLE => NfsError::NotFound(msg),
        S::NFS3ERR_EXIST | S::NFS3ERR_NOTEMPTY => NfsError::AlreadyExists(msg),
        S::NFS3ERR_PERM | S::NFS3ERR_ACCES | S::NFS3ERR_ROFS => NfsError::PermissionDenied(msg),
        S::NFS3ERR_INVAL
        | S::NFS3ERR_NAMETOOLONG
        | S::NFS3ERR_NOTDIR
        | S::NFS3ERR_ISDIR
        | S::NFS3ERR_FBIG
        | S::NFS3ERR_XDEV
        | S::NFS3ERR_MLINK => NfsError::InvalidArgument(msg),
        S::NFS3ERR_NOSPC | S::NFS3ERR_DQUOT => NfsError::NoSpace(msg),
        // JUKEBOX: "try again later" (e.g. data being recalled from tape) — the server is
        // there but cannot serve now.
        S::NFS3ERR_JUKEBOX => NfsError::Unavailable { server: server.to_owned(), reason: msg },
        _ => NfsError::Internal(msg),
    }
}

/// A MOUNT refusal: the share does not exist on the server or this client may not mount it.
pub(crate) fn from_mount_status(stat: mountstat3, export: &str) -> NfsError {
    use mountstat3 as M;
    let msg = format!("mount {export}: {stat:?}");
    match stat {
        M::MNT3ERR_NOENT | M::MNT3ERR_NOTDIR => NfsError::NotFound(msg),
        M::MNT3ERR_PERM | M::MNT3ERR_ACCES => NfsError::PermissionDenied(msg),
        M::MNT3ERR_INVAL | M::MNT3ERR_NAMETOOLONG => NfsError::InvalidArgument(msg),
        _ => NfsError::Internal(msg),
    }
}
