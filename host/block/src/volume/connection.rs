//! One replica connection over TCP, plaintext or mutual TLS: the write side the driver writes
//! to directly while nothing is queued ([`Conn`], [`Outbox`]), the task that connects (and, a
//! node's engine over TLS, presents the volume's grant first) and reports every frame read, and
//! the writer task for what the socket did not take at once.

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
use wasmcsi_trust::stream::{Sent, TlsWriter};
use wasmcsi_trust::{ExpectedRole, Role};

use super::event::ConnEvent;
use super::grant::VolumeGrant;
use crate::engine::ReplicaId;
use crate::protocol::{self, DEFAULT_MAX_PAYLOAD, Frame, FrameDecoder, Message, PayloadCrc, Status};
use crate::transport::{self, ReadHalf, Split, Transport};

/// Most buffers the writer task hands to one vectored write.
const MAX_IOVECS: usize = 64;
/// The request id of the `Grant` frame (before `Hello`, so it meets no engine request's id).
const GRANT_REQUEST_ID: u64 = 0;

/// A connection's write side.
enum Wr {
    Plain(Arc<OwnedWriteHalf>),
    /// Shared with the writer task: everything goes through the one TLS connection, in order,
    /// whoever writes it out.
    Tls(TlsWriter),
}

/// The write side of one replica connection. The driver writes to the socket itself while the
/// writer task has nothing queued (no task hop for a lone request) and queues what the socket
/// does not take at once; `pending` (bytes queued, not yet written) keeps the two in order.
/// Over TLS the driver encrypts everything it sends at once (`TlsWriter::try_send`), what the
/// socket did not take waits inside the TLS connection, and `queue` only wakes the writer task
/// to flush it.
pub(super) struct Conn {
    wr: Wr,
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
        let wr = match &self.wr {
            Wr::Tls(w) => return self.send_tls(w, out),
            Wr::Plain(wr) => wr,
        };
        let idle = self.pending.load(Ordering::Acquire) == 0;
        if out.segments.is_empty() {
            // Only small frames: one plain write, and the buffer keeps its capacity.
            let mut sent = 0;
            if idle {
                // An error other than WouldBlock is left to the writer task to hit and report.
                if let Ok(n) = wr.try_write(&out.small) {
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
            if let Ok(n) = wr.try_write_vectored(&slices) {
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

    /// Encrypts all of `out` straight from its buffers (the write payloads uncopied) and writes
    /// what the socket takes; the writer task is woken for the rest, and for an error (which its
    /// flush then hits and reports).
    fn send_tls(&self, wr: &TlsWriter, out: &mut Outbox) {
        let sent = if out.segments.is_empty() {
            wr.try_send(&[IoSlice::new(&out.small)])
        } else {
            out.seal();
            let slices: Vec<IoSlice<'_>> = out.segments.iter().map(|b| IoSlice::new(b)).collect();
            wr.try_send(&slices)
        };
        out.clear();
        if !matches!(sent, Ok(Sent::All)) {
            let _ = self.queue.send(Bytes::new());
        }
    }

    fn enqueue(&self, bytes: Bytes) {
        self.pending.fetch_add(bytes.len(), Ordering::AcqRel);
        let _ = self.queue.send(bytes);
    }

    /// Closes the connection with a reset: bytes still in its send buffer are discarded, never
    /// delivered later (after a partition heals they could overwrite what a rebuild copied).
    pub(super) fn reset(self) {
        match &self.wr {
            Wr::Plain(wr) => {
                let stream: &TcpStream = (**wr).as_ref();
                let _ = stream.set_zero_linger();
            }
            Wr::Tls(wr) => wr.reset(),
        }
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

/// How a connection reaches its replica: where, over what, the server being whom, with which
/// grant (a node's engine session needs one, see [`super::VolumeGrant`]).
#[derive(Clone)]
pub(super) struct Dial {
    pub(super) addr: SocketAddr,
    pub(super) transport: Transport,
    pub(super) expected: ExpectedRole,
    pub(super) grant: Option<Arc<VolumeGrant>>,
    pub(super) timeout: Duration,
}

/// Connects after `delay`, then reports every frame the replica sends until the connection ends;
/// the link it reports connected is the driver's (`L`), made of the connection's write side.
/// Its writer task runs in the caller's span (the replica's, see `Driver::spawn_connect`).
pub(super) async fn connection<L: From<Conn> + Send + 'static>(
    replica: ReplicaId,
    generation: u64,
    dial: Dial,
    delay: Duration,
    events: mpsc::UnboundedSender<ConnEvent<L>>,
) {
    tokio::time::sleep(delay).await;
    let failed = |error: String| {
        let _ = events.send(ConnEvent::ConnectFailed { replica, generation, error });
    };
    let split = match transport::dial_split(dial.addr, &dial.transport, &dial.expected, dial.timeout).await {
        Ok(split) => split,
        Err(e) => return failed(e.to_string()),
    };
    let mut decoder = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
    let (mut rd, wr) = match split {
        Split::Plain(stream) => {
            let (rd, wr) = stream.into_split();
            (ReadHalf::Plain(rd), Wr::Plain(Arc::new(wr)))
        }
        Split::Tls { writer, reader, server } => {
            let mut rd = ReadHalf::Tls(reader);
            // A node's session opens only with a grant (a controller needs none).
            if matches!(dial.transport.role(), Some(Role::Node(_)))
                && let Err(error) = present_grant(&dial, &writer, &mut rd, &mut decoder).await
            {
                writer.reset();
                return failed(format!("{server}: {error}"));
            }
            (rd, Wr::Tls(writer))
        }
    };
    let (queue, queued) = mpsc::unbounded_channel();
    let pending = Arc::new(AtomicUsize::new(0));
    let task = match &wr {
        Wr::Plain(w) => tokio::spawn(tracing::Instrument::in_current_span(write_loop(
            w.clone(),
            queued,
            pending.clone(),
            replica,
            generation,
            events.clone(),
        ))),
        Wr::Tls(w) => tokio::spawn(tracing::Instrument::in_current_span(flush_loop(
            w.clone(),
            queued,
            replica,
            generation,
            events.clone(),
        ))),
    };
    let link = L::from(Conn { wr, queue, pending, task });
    // On failure the driver is gone; dropping the link's queue ends its writer task.
    if events.send(ConnEvent::Connected { replica, generation, link }).is_err() {
        return;
    }
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

/// Sends the volume's grant as the session's first frame and waits for the replica's answer.
/// Without a grant, or when the replica refuses it, the keeper is asked for a fresh one and the
/// connection fails (the driver retries it with back-off, with the grant it then holds).
async fn present_grant(
    dial: &Dial,
    writer: &TlsWriter,
    rd: &mut ReadHalf,
    decoder: &mut FrameDecoder,
) -> Result<(), String> {
    let Some(holder) = &dial.grant else { return Err("this node has no grant source for the volume".into()) };
    let Some(grant) = holder.current() else {
        holder.want_fresh();
        return Err("no grant of the volume yet; asked for one".into());
    };
    let mut out = Vec::new();
    protocol::encode(
        &Frame { request_id: GRANT_REQUEST_ID, message: Message::Grant { grant: grant.to_vec() } },
        &mut out,
    )
    .map_err(|e| format!("encoding the grant: {e}"))?;
    let exchange = async {
        if writer.try_send(&[IoSlice::new(&out)]).map_err(|e| format!("sending the grant: {e}"))? == Sent::Partly {
            writer.flush().await.map_err(|e| format!("sending the grant: {e}"))?;
        }
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) => {}
                Err(e) => return Err(format!("decoding the grant's answer: {e}")),
            }
            match rd.read_buf(&mut decoder.read_buffer()).await {
                Ok(0) => return Err("closed by the replica before it answered the grant".to_owned()),
                Ok(_) => {}
                Err(e) => return Err(format!("reading the grant's answer: {e}")),
            }
        }
    };
    let answer = tokio::time::timeout(dial.timeout, exchange)
        .await
        .map_err(|_| format!("no answer to the grant within {:?}", dial.timeout))??;
    match answer.message {
        Message::Reply { status: Status::Ok } if answer.request_id == GRANT_REQUEST_ID => Ok(()),
        Message::Reply { status: Status::Denied } => {
            // Expired, of an old epoch, or for another node: only a fresh one can help.
            holder.want_fresh();
            Err("the replica refused the volume's grant; asked for a fresh one".into())
        }
        other => Err(format!("unexpected answer to the grant: {other:?}")),
    }
}

/// Writes what `try_send` left inside the TLS connection when the socket would not take it,
/// woken by the driver (any message on `wake`) or by the reader (an answer to a KeyUpdate).
/// Ends when the driver drops the link, with the end of the stream ([`close`]).
async fn flush_loop<L>(
    writer: TlsWriter,
    mut wake: mpsc::UnboundedReceiver<Bytes>,
    replica: ReplicaId,
    generation: u64,
    events: mpsc::UnboundedSender<ConnEvent<L>>,
) {
    loop {
        tokio::select! {
            woken = wake.recv() => if woken.is_none() { return close(&writer).await },
            () = writer.flush_wanted() => {}
        }
        while wake.try_recv().is_ok() {}
        if let Err(e) = writer.flush().await {
            let _ = events.send(ConnEvent::Closed { replica, generation, error: format!("writing: {e}") });
            return;
        }
    }
}

/// The driver let go of the link: what is still inside the TLS connection goes out, then its
/// close_notify and the end of the TCP stream, as dropping a plaintext write half sends the end.
/// The replica then reads a clean end, not a truncation, so a session whose last request was a
/// flush clears its dirty flag (without it every detach over TLS left the replicas dirty, and
/// the next attach resynced). A link reset ([`Conn::reset`]) aborts this task instead.
async fn close(writer: &TlsWriter) {
    if writer.flush().await.is_err() {
        return;
    }
    if matches!(writer.close(), Ok(Sent::Partly)) && writer.flush().await.is_err() {
        return;
    }
    let _ = crate::transport::shutdown_write(writer.socket());
}

/// Writes what the driver queued (whatever the socket did not take at once), many buffers per
/// vectored write and without copying them together. Ends when the driver drops the queue.
async fn write_loop<L>(
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

async fn write_all_vectored(stream: &OwnedWriteHalf, bufs: &[Bytes]) -> io::Result<()> {
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
