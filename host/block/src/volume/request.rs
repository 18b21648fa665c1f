//! What a handle asks of a volume's engine ([`Request`]), where the answer goes ([`ReplyTx`]:
//! a waiting thread or the frontend's completion), and how the engine's errors reach the
//! kernel as `io::Error` kinds. The driver carries requests; this file is what they are.
use std::io;

use bytes::Bytes;
use tokio::sync::oneshot;
use wasmcsi_frontend::{ReadDone, WriteDone};

use crate::engine::{ClientReply, IoError};

/// What a handle asks of the engine.
pub(super) enum Request {
    Read { offset: u64, len: u64 },
    Write { offset: u64, data: Bytes },
    Flush,
    Unmap { offset: u64, len: u64 },
    Resize { size: u64 },
    Snapshot { name: String },
    DeleteSnapshot { name: String },
}

/// Where a request's result goes: a thread blocked on it, or a completion the frontend gave
/// (run on whichever thread releases the driver after the answer, so it must not block). The
/// frontend's completions are kept as given, not wrapped in another closure: one allocation
/// less per I/O.
pub(super) enum ReplyTx {
    Wait(oneshot::Sender<io::Result<ClientReply>>),
    Written(WriteDone),
    Read { len: usize, done: ReadDone },
}

impl ReplyTx {
    pub(super) fn send(self, result: io::Result<ClientReply>) {
        match self {
            // The caller may have given up waiting; nothing to do then.
            ReplyTx::Wait(tx) => {
                let _ = tx.send(result);
            }
            ReplyTx::Written(done) => match result {
                Ok(ClientReply::Written) => done(Ok(())),
                Ok(other) => done(Err(unexpected(&other))),
                Err(e) => done(Err(e)),
            },
            ReplyTx::Read { len, done } => match result {
                Ok(ClientReply::Read(data)) if data.len() == len => done(Ok(&data)),
                Ok(other) => done(Err(unexpected(&other))),
                Err(e) => done(Err(e)),
            },
        }
    }
}

/// The engine answered a request with a reply of another kind (a bug, never the peer's doing:
/// the engine checks what replicas send).
pub(super) fn unexpected(reply: &ClientReply) -> io::Error {
    io::Error::other(format!("engine answered with the wrong reply kind: {reply:?}"))
}

pub(super) fn to_io_error(e: IoError) -> io::Error {
    let kind = match e {
        IoError::OutOfRange { .. }
        | IoError::TooLarge { .. }
        | IoError::Shrink { .. }
        | IoError::BadSnapshotName { .. } => io::ErrorKind::InvalidInput,
        // Retryable once the volume is whole again.
        IoError::Degraded { .. } => io::ErrorKind::ResourceBusy,
        IoError::NoHealthyReplica { .. } => io::ErrorKind::Other,
        // Final: the kernel sees EIO, the volume lives on with another engine.
        IoError::Fenced { .. } => io::ErrorKind::PermissionDenied,
    };
    io::Error::new(kind, e)
}

pub(super) fn stopped() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the volume's driver has stopped")
}
