//! One replica connection's frames: reading them ([`Reader`], with the server's shutdown and an
//! idle deadline), writing replies in the order they complete ([`write_loop`], [`drain`]), and
//! why a connection ended ([`ConnError`]). The accept loop and first frames (`server`) and an
//! engine session's request pipeline (`pipeline`) both use them; neither needs the other's
//! internals.
use std::time::Duration;

use thiserror::Error;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::protocol::{DecodeError, Frame, FrameDecoder, encode_with_limit};
use crate::transport::{ReadHalf, WriteHalf};

/// Why one connection ended early; logged, never propagated past the connection.
#[derive(Debug, Error)]
pub(super) enum ConnError {
    #[error("reading: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Decode(#[from] DecodeError),
    #[error("protocol: {0}")]
    Unexpected(&'static str),
    /// A request was refused `Denied` (already logged with the peer and why).
    #[error("a request was denied")]
    Denied,
}

/// Reads frames off one connection.
pub(super) struct Reader {
    rd: ReadHalf,
    decoder: FrameDecoder,
    pub(super) shutdown: watch::Receiver<bool>,
}

impl Reader {
    /// A reader of `rd` that allocates nothing until the first read; its buffer grows with what
    /// arrives, up to one frame of `max_payload`.
    pub(super) fn new(rd: ReadHalf, max_payload: usize, shutdown: watch::Receiver<bool>) -> Self {
        Self { rd, decoder: FrameDecoder::new(max_payload), shutdown }
    }

    /// The next frame; `None` on end of stream or server shutdown.
    pub(super) async fn next(&mut self) -> Result<Option<Frame>, ConnError> {
        loop {
            if let Some(frame) = self.decoder.next_frame()? {
                return Ok(Some(frame));
            }
            if *self.shutdown.borrow() {
                return Ok(None);
            }
            // `read_buf` is cancel safe: a read either landed in the decoder or did not happen.
            let mut room = self.decoder.read_buffer();
            let n = tokio::select! {
                n = self.rd.read_buf(&mut room) => n?,
                _ = self.shutdown.changed() => return Ok(None),
            };
            if n == 0 {
                return Ok(None);
            }
        }
    }

    /// [`Self::next`] within `idle`; `None` when nothing came (the connection is then closed).
    pub(super) async fn next_within(&mut self, idle: Duration) -> Result<Option<Frame>, ConnError> {
        match tokio::time::timeout(idle, self.next()).await {
            Ok(next) => next,
            Err(_) => {
                tracing::debug!(after = ?idle, "closing an idle replica connection");
                Ok(None)
            }
        }
    }

    /// The next frame already buffered, without reading the socket.
    pub(super) fn buffered(&mut self) -> Result<Option<Frame>, ConnError> {
        Ok(self.decoder.next_frame()?)
    }
}

/// Waits for the writer to deliver every queued reply; `None` if it failed or if the server is
/// shutting down and the grace period ran out first (the writer is then aborted).
pub(super) async fn drain(
    writer: &mut JoinHandle<Option<WriteHalf>>,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> Option<WriteHalf> {
    let deadline = async {
        // Err: the server handle is gone, which is a shutdown too.
        let _ = shutdown.wait_for(|stop| *stop).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        delivered = &mut *writer => delivered.ok().flatten(),
        () = deadline => {
            writer.abort();
            None
        }
    }
}

/// Writes replies in the order they complete, coalescing whatever is queued into one write,
/// until every sender is gone; returns the write half (still open) when all were delivered,
/// `None` on a failure. A TLS record the reader could not answer at once (a KeyUpdate's) is
/// flushed from here too.
pub(super) async fn write_loop(
    mut wr: WriteHalf,
    mut rx: mpsc::Receiver<Frame>,
    max_payload: usize,
) -> Option<WriteHalf> {
    // Grows with the replies actually sent: an idle connection holds none of it.
    let mut out = Vec::new();
    loop {
        let frame = tokio::select! {
            frame = rx.recv() => match frame {
                Some(frame) => frame,
                None => return Some(wr),
            },
            () = wr.flush_wanted() => {
                if let Err(e) = wr.flush().await {
                    tracing::debug!(error = %e, "replica connection write failed");
                    return None;
                }
                continue;
            }
        };
        out.clear();
        let mut next = Some(frame);
        while let Some(frame) = next.take() {
            if let Err(e) = encode_with_limit(&frame, &mut out, max_payload) {
                // Execute never builds an oversized reply; if it did, the engine would wait
                // forever for this id, so failing the connection is the honest answer.
                tracing::error!(error = %e, request_id = frame.request_id, "replica reply not encodable");
                return None;
            }
            if out.len() < 1024 * 1024 {
                next = rx.try_recv().ok();
            }
        }
        if let Err(e) = wr.write_all(&out).await {
            tracing::debug!(error = %e, "replica connection write failed");
            return None;
        }
    }
}
