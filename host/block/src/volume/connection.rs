//! One replica connection over TCP: the write side the driver writes to directly while nothing
//! is queued ([`Conn`], [`Outbox`]), the task that connects and reports every frame read, and the
//! writer task for what the socket did not take at once.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::event::ConnEvent;
use crate::engine::ReplicaId;
use crate::protocol::{self, DEFAULT_MAX_PAYLOAD, Frame, FrameDecoder, PayloadCrc};

/// Most buffers the writer task hands to one vectored write.
const MAX_IOVECS: usize = 64;

/// The write side of one replica connection. The driver writes to the socket itself while the
/// writer task has nothing queued (no task hop for a lone request) and queues what the socket
/// does not take at once; `pending` (bytes queued, not yet written) keeps the two in order.
pub(super) struct Conn {
    wr: Arc<OwnedWriteHalf>,
    queue: mpsc::UnboundedSender<Bytes>,
    pending: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Conn {
    /// Sends `out` (everything one driver iteration produced for this replica), leaving it
    /// empty.
    pub(super) fn send(&self, out: &mut Outbox) {
        if out.is_empty() {
            return;
        }
        let idle = self.pending.load(Ordering::Acquire) == 0;
        if out.segments.is_empty() {
            // Only small frames: one plain write, and the buffer keeps its capacity.
            let mut sent = 0;
            if idle {
                // An error other than WouldBlock is left to the writer task to hit and report.
                if let Ok(n) = self.wr.try_write(&out.small) {
                    sent = n;
                }
            }
            if sent == 0 {
                // Nothing went out: hand the buffer itself to the writer task, uncopied.
                self.enqueue(Bytes::from(std::mem::take(&mut out.small)));
            } else if sent < out.small.len() {
                self.enqueue(Bytes::copy_from_slice(&out.small[sent..]));
            }
            out.small.clear();
            return;
        }
        out.seal();
        let mut sent = 0;
        if idle {
            let slices: Vec<IoSlice<'_>> = out.segments.iter().take(MAX_IOVECS).map(|b| IoSlice::new(b)).collect();
            if let Ok(n) = self.wr.try_write_vectored(&slices) {
                sent = n;
            }
        }
        for mut seg in out.segments.drain(..) {
            if sent >= seg.len() {
                sent -= seg.len();
                continue;
            }
            seg.advance(sent);
            sent = 0;
            self.enqueue(seg);
        }
    }

    pub(super) fn enqueue(&self, bytes: Bytes) {
        self.pending.fetch_add(bytes.len(), Ordering::AcqRel);
        let _ = self.queue.send(bytes);
    }

    /// Closes the connection with a reset: bytes still in its send buffer are discarded, never
    /// delivered later (after a partition heals they could overwrite what a rebuild copied).
    pub(super) fn reset(self) {
        let stream: &TcpStream = (*self.wr).as_ref();
        let _ = stream.set_zero_linger();
        self.task.abort();
    }
}

/// The frames encoded for one replica during one driver iteration: small ones copied together,
/// large write payloads kept as the shared buffers they are (see [`protocol::encode_split`]).
#[derive(Default)]
pub(super) struct Outbox {
    /// Encoded bytes not yet sealed into `segments`.
    small: Vec<u8>,
    /// Sealed pieces, in order, before `small`.
    segments: Vec<Bytes>,
}

impl Outbox {
    pub(super) fn is_empty(&self) -> bool {
        self.small.is_empty() && self.segments.is_empty()
    }

    pub(super) fn push(&mut self, frame: &Frame, crc: &mut PayloadCrc) -> Result<(), protocol::EncodeError> {
        if let Some(payload) = protocol::encode_split(frame, &mut self.small, DEFAULT_MAX_PAYLOAD, crc)? {
            self.seal();
            self.segments.push(payload);
        }
        Ok(())
    }

    /// Moves `small` to the end of `segments`.
    pub(super) fn seal(&mut self) {
        if !self.small.is_empty() {
            self.segments.push(Bytes::from(std::mem::take(&mut self.small)));
        }
    }

    pub(super) fn clear(&mut self) {
        self.small.clear();
        self.segments.clear();
    }
}

/// Connects after `delay`, then reports every frame the replica sends until the connection ends;
/// the link it reports connected is the driver's (`L`), made of the connection's write side.
/// Its writer task runs in the caller's span (the replica's, see `Driver::spawn_connect`).
pub(super) async fn connection<L: From<Conn> + Send + 'static>(
    replica: ReplicaId,
    generation: u64,
    addr: SocketAddr,
    delay: Duration,
    connect_timeout: Duration,
    events: mpsc::UnboundedSender<ConnEvent<L>>,
) {
    tokio::time::sleep(delay).await;
    let stream = match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let _ = events.send(ConnEvent::ConnectFailed { replica, generation, error: e.to_string() });
            return;
        }
        Err(_) => {
            let _ = events.send(ConnEvent::ConnectFailed { replica, generation, error: "timed out".into() });
            return;
        }
    };
    // Requests are small and latency-bound (4k writes); Nagle would add a round trip.
    let _ = stream.set_nodelay(true);
    let (mut rd, wr) = stream.into_split();
    let wr = Arc::new(wr);
    let (queue, queued) = mpsc::unbounded_channel();
    let pending = Arc::new(AtomicUsize::new(0));
    let task = tokio::spawn(tracing::Instrument::in_current_span(write_loop(
        wr.clone(),
        queued,
        pending.clone(),
        replica,
        generation,
        events.clone(),
    )));
    let link = L::from(Conn { wr, queue, pending, task });
    // On failure the driver is gone; dropping the link's queue ends its writer task.
    if events.send(ConnEvent::Connected { replica, generation, link }).is_err() {
        return;
    }
    let mut decoder = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
    let error = loop {
        // Every frame this read completed goes to the driver in one event.
        let mut frames = Vec::new();
        let failed = loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break None,
                Err(e) => break Some(format!("decoding: {e}")),
            }
        };
        if !frames.is_empty() && events.send(ConnEvent::Received { replica, generation, frames }).is_err() {
            return;
        }
        if let Some(error) = failed {
            break error;
        }
        match rd.read_buf(&mut decoder.read_buffer()).await {
            Ok(0) => break "closed by the replica".to_owned(),
            Ok(_) => {}
            Err(e) => break format!("reading: {e}"),
        }
    };
    let _ = events.send(ConnEvent::Closed { replica, generation, error });
}

/// Writes what the driver queued (whatever the socket did not take at once), many buffers per
/// vectored write and without copying them together. Ends when the driver drops the queue.
pub(super) async fn write_loop<L>(
    wr: Arc<OwnedWriteHalf>,
    mut queue: mpsc::UnboundedReceiver<Bytes>,
    pending: Arc<AtomicUsize>,
    replica: ReplicaId,
    generation: u64,
    events: mpsc::UnboundedSender<ConnEvent<L>>,
) {
    let mut bufs = Vec::new();
    while let Some(buf) = queue.recv().await {
        bufs.push(buf);
        while bufs.len() < MAX_IOVECS {
            match queue.try_recv() {
                Ok(more) => bufs.push(more),
                Err(_) => break,
            }
        }
        let total: usize = bufs.iter().map(Bytes::len).sum();
        if let Err(e) = write_all_vectored(&wr, &bufs).await {
            let _ = events.send(ConnEvent::Closed { replica, generation, error: format!("writing: {e}") });
            return;
        }
        bufs.clear();
        pending.fetch_sub(total, Ordering::AcqRel);
    }
    // Dropping the last handle of the write half sends the end of the stream.
}

pub(super) async fn write_all_vectored(stream: &OwnedWriteHalf, bufs: &[Bytes]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        stream.writable().await?;
        match stream.try_write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
