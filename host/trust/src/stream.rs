//! A TLS connection that a synchronous thread writes into directly: the engine's data
//! connections send from the thread that holds the volume's driver while nothing is queued,
//! and leave the rest to a writer task (see the block crate's replica connection).
//!
//! ```text
//!   driver thread ── try_send(&[IoSlice]) ─┐            ┌─ TlsWriter::flush().await  (writer task,
//!                                          ▼            ▼   when try_send left bytes or the
//!                          Mutex<rustls::Connection> ── socket (non-blocking try_write)   reader asks)
//!                                          ▲
//!   reader task ── TlsReader (AsyncRead): socket.try_read outside the lock, then decrypt one
//!                  read's worth under it
//! ```
//!
//! The rustls connection sits behind one short mutex. [`TlsWriter::try_send`] encrypts all the
//! plaintext it is given (the connection's send buffer is unbounded, as the plaintext queue it
//! replaces was) and writes what the socket takes without blocking; encrypted bytes the socket
//! did not take stay queued inside rustls, in order, and [`TlsWriter::flush`] writes them when
//! the socket is writable. Ordering needs nothing more than the lock: every byte goes through the
//! one TLS connection, whoever writes it out. The reader reads the socket without the lock into
//! its own buffer and decrypts under it, one read at a time, so neither side holds the lock for
//! longer than one record batch.
//!
//! A record the peer sends that needs an answer (a TLS 1.3 KeyUpdate, which rustls also sends
//! on its own after enough records) is answered by the reader if the socket takes it at once;
//! otherwise the reader wakes [`TlsWriter::flush_wanted`] for the writer task.

use std::io::{self, BufRead as _, IoSlice, Write};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, Connection};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_rustls::TlsConnector;

use crate::identity::{IdentityError, Role};
use crate::listener::ServerTlsStream;
use crate::verifier::peer_role;

/// Ciphertext read from the socket per read: a few full records.
const READ_BUFFER: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("TLS handshake with {peer}: no answer within {after:?}")]
    TimedOut { peer: String, after: Duration },
    #[error("TLS handshake with {peer}: {source}")]
    Handshake { peer: String, source: io::Error },
    #[error("TLS handshake with {peer}: {source}")]
    Identity { peer: String, source: IdentityError },
}

/// Whether [`TlsWriter::try_send`] wrote everything to the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    /// Everything is in the socket.
    All,
    /// Some encrypted bytes wait inside the connection: someone must [`TlsWriter::flush`].
    Partly,
}

struct Shared {
    socket: TcpStream,
    tls: Mutex<Connection>,
    flush_wanted: Notify,
}

impl Shared {
    fn lock(&self) -> io::Result<MutexGuard<'_, Connection>> {
        // A panic while encrypting leaves the session's state unknown: the connection is over.
        self.tls.lock().map_err(|_| io::Error::other("the TLS connection was poisoned by a panic"))
    }
}

/// The write side; clone it freely (the driver thread and the writer task share it).
#[derive(Clone)]
pub struct TlsWriter {
    shared: Arc<Shared>,
}

/// The read side (one reader).
pub struct TlsReader {
    shared: Arc<Shared>,
    buffer: Box<[u8]>,
    start: usize,
    end: usize,
    eof_seen: bool,
    eof_fed: bool,
}

/// The client's TLS handshake over a connected `tcp`, within `timeout`, then the connection
/// split for shared use. Returns the server's role (already checked against the config's
/// [`crate::ExpectedRole`] during the handshake).
pub async fn connect(
    tcp: TcpStream,
    config: Arc<ClientConfig>,
    server_name: ServerName<'static>,
    timeout: Duration,
) -> Result<(TlsWriter, TlsReader, Role), StreamError> {
    let peer = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "an unknown peer".into());
    // Requests are small and latency-bound (4k writes); Nagle would add a round trip.
    let _ = tcp.set_nodelay(true);
    let stream = match tokio::time::timeout(timeout, TlsConnector::from(config).connect(server_name, tcp)).await {
        Err(_) => return Err(StreamError::TimedOut { peer, after: timeout }),
        Ok(Err(source)) => return Err(StreamError::Handshake { peer, source }),
        Ok(Ok(stream)) => stream,
    };
    let (tcp, tls) = stream.into_inner();
    let role = peer_role(&tls).map_err(|source| StreamError::Identity { peer, source })?;
    let (writer, reader) = split(tcp, Connection::Client(tls));
    Ok((writer, reader, role))
}

/// A server-side stream from the listener, split for shared use the same way.
pub fn from_server_stream(stream: ServerTlsStream) -> (TlsWriter, TlsReader) {
    let (io, tls) = stream.into_inner();
    split(io.into_inner(), Connection::Server(tls))
}

fn split(socket: TcpStream, mut tls: Connection) -> (TlsWriter, TlsReader) {
    // Everything handed to try_send is encrypted at once; what the socket does not take waits
    // in the connection (bounded by the caller, as its plaintext queue was).
    tls.set_buffer_limit(None);
    let shared = Arc::new(Shared { socket, tls: Mutex::new(tls), flush_wanted: Notify::new() });
    let reader = TlsReader {
        shared: shared.clone(),
        buffer: vec![0; READ_BUFFER].into_boxed_slice(),
        start: 0,
        end: 0,
        eof_seen: false,
        eof_fed: false,
    };
    (TlsWriter { shared }, reader)
}

impl TlsWriter {
    /// Encrypts all of `bufs` and writes what the socket takes now, without blocking. Callable
    /// from any thread. `Sent::Partly` means the rest waits for [`Self::flush`]. An error other
    /// than the socket being full ends the connection.
    pub fn try_send(&self, bufs: &[IoSlice<'_>]) -> io::Result<Sent> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut tls = self.shared.lock()?;
        let mut taken = tls.writer().write_vectored(bufs)?;
        if taken < total {
            // With no buffer limit rustls takes everything; this keeps the promise if it ever
            // does not.
            let mut rest: Vec<IoSlice<'_>> = bufs.to_vec();
            let mut rest = &mut rest[..];
            IoSlice::advance_slices(&mut rest, taken);
            while taken < total {
                let n = tls.writer().write_vectored(rest)?;
                if n == 0 {
                    return Err(io::ErrorKind::WriteZero.into());
                }
                IoSlice::advance_slices(&mut rest, n);
                taken += n;
            }
        }
        write_out(&mut tls, &self.shared.socket)
    }

    /// Writes what waits in the connection, waiting for the socket as needed. The writer task's
    /// half of [`Self::try_send`].
    pub async fn flush(&self) -> io::Result<()> {
        loop {
            {
                let mut tls = self.shared.lock()?;
                if write_out(&mut tls, &self.shared.socket)? == Sent::All {
                    return Ok(());
                }
            }
            self.shared.socket.writable().await?;
        }
    }

    /// Completes when the reader queued an answer the socket did not take at once; the writer
    /// task then calls [`Self::flush`].
    pub async fn flush_wanted(&self) {
        self.shared.flush_wanted.notified().await
    }

    /// Whether encrypted bytes wait to be written.
    pub fn has_pending(&self) -> io::Result<bool> {
        Ok(self.shared.lock()?.wants_write())
    }

    /// Queues a TLS close_notify and writes what the socket takes; the peer reads a clean end.
    pub fn close(&self) -> io::Result<Sent> {
        let mut tls = self.shared.lock()?;
        tls.send_close_notify();
        write_out(&mut tls, &self.shared.socket)
    }

    /// Closes the connection with a TCP reset: nothing still buffered is delivered later.
    pub fn reset(&self) {
        let _ = self.shared.socket.set_zero_linger();
    }

    /// The socket (for its addresses and options).
    pub fn socket(&self) -> &TcpStream {
        &self.shared.socket
    }
}

/// Writes queued TLS records until the socket is full or nothing is left.
fn write_out(tls: &mut Connection, socket: &TcpStream) -> io::Result<Sent> {
    while tls.wants_write() {
        match tls.write_tls(&mut SocketWriter(socket)) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Sent::Partly),
            Err(e) => return Err(e),
        }
    }
    Ok(Sent::All)
}

/// `io::Write` over a tokio socket's non-blocking writes.
struct SocketWriter<'a>(&'a TcpStream);

impl Write for SocketWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.try_write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One step of the reader.
enum Step {
    /// Plaintext (or the end of the stream) is in the caller's buffer.
    Delivered,
    /// Ciphertext was fed to the connection; look again.
    Fed,
    /// The connection needs more from the socket.
    NeedSocket,
}

impl TlsReader {
    /// Under the lock: hands out decrypted bytes, or else feeds one read's worth of ciphertext
    /// (or the end of the stream) to the connection.
    fn step(&mut self, buf: &mut ReadBuf<'_>) -> io::Result<Step> {
        let mut tls = self.shared.lock()?;
        match tls.reader().fill_buf() {
            Ok(chunk) => {
                // Empty: the peer's close_notify, a clean end of the stream.
                let n = chunk.len().min(buf.remaining());
                buf.put_slice(&chunk[..n]);
                tls.reader().consume(n);
                return Ok(Step::Delivered);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // UnexpectedEof: the socket ended without a close_notify.
            Err(e) => return Err(e),
        }
        if self.start < self.end {
            let mut ciphertext = &self.buffer[self.start..self.end];
            let n = tls.read_tls(&mut ciphertext)?;
            if n == 0 {
                return Err(io::Error::other("the TLS connection accepts no more ciphertext"));
            }
            self.start += n;
        } else if self.eof_seen && !self.eof_fed {
            // Tell rustls the socket ended; its reader then says whether that was clean.
            self.eof_fed = true;
            tls.read_tls(&mut io::empty())?;
        } else if self.eof_fed {
            return Ok(Step::Delivered);
        } else {
            return Ok(Step::NeedSocket);
        }
        let processed = tls.process_new_packets();
        if tls.wants_write() && !matches!(write_out(&mut tls, &self.shared.socket), Ok(Sent::All)) {
            // An alert or a KeyUpdate answer the socket did not take: the writer task's job.
            self.shared.flush_wanted.notify_one();
        }
        processed.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        Ok(Step::Fed)
    }
}

impl AsyncRead for TlsReader {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            match this.step(buf)? {
                Step::Delivered => return Poll::Ready(Ok(())),
                Step::Fed => continue,
                Step::NeedSocket => {}
            }
            match this.shared.socket.try_read(&mut this.buffer) {
                Ok(0) => this.eof_seen = true,
                Ok(n) => {
                    this.start = 0;
                    this.end = n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    ready!(this.shared.socket.poll_read_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::credentials::server_name;
    use crate::listener::{Limits, Listener};
    use crate::test_support::Pki;
    use crate::verifier::ExpectedRole;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    const FRAMES: u64 = 100_000;
    /// Frames the writer may be ahead of the echoes it got back (keeps buffers bounded).
    const WINDOW: u64 = 2_000;

    /// A frame: seq (8) | len (4) | len bytes derived from seq. Lengths 0..=4096.
    fn frame(seq: u64) -> (Vec<u8>, Vec<u8>) {
        let mut x = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let len = (x % 4097) as usize;
        let mut payload = Vec::with_capacity(len);
        while payload.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            payload.extend_from_slice(&x.to_le_bytes()[..(len - payload.len()).min(8)]);
        }
        let mut header = seq.to_le_bytes().to_vec();
        header.extend_from_slice(&(len as u32).to_le_bytes());
        (header, payload)
    }

    /// Socket buffer size in the tests that must see the socket fill (the kernel doubles it).
    const SMALL_BUFFER: u32 = 8 * 1024;

    /// An echo server over mTLS on loopback; returns its address. `small`: its sockets get a
    /// small receive buffer (no autotuning), so a fast sender fills them.
    async fn echo_server(pki: &mut Pki, small: bool) -> std::net::SocketAddr {
        let server = Arc::new(pki.credentials(&Role::Node("replica".into())));
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        if small {
            socket.set_recv_buffer_size(SMALL_BUFFER).expect("SO_RCVBUF");
        }
        socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let listener = Listener::new(socket.listen(64).expect("listen"), Limits::default());
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(listener.serve_tls(server, |conn| async move {
            let (mut rd, mut wr) = tokio::io::split(conn.stream);
            let _ = tokio::io::copy(&mut rd, &mut wr).await;
            let _ = wr.shutdown().await;
        }));
        addr
    }

    async fn dial(pki: &mut Pki, addr: std::net::SocketAddr, small: bool) -> (TlsWriter, TlsReader, Role) {
        let engine = pki.credentials(&Role::Node("engine".into()));
        let config = engine.client_config(ExpectedRole::Node("replica".into())).expect("client config");
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        if small {
            socket.set_send_buffer_size(SMALL_BUFFER).expect("SO_SNDBUF");
        }
        let tcp = socket.connect(addr).await.expect("connect");
        connect(tcp, config, server_name(), Duration::from_secs(5)).await.expect("handshake")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_thread_and_a_reader_task_move_100k_frames_intact() {
        let mut pki = Pki::new();
        let addr = echo_server(&mut pki, true).await;
        let (writer, mut reader, role) = dial(&mut pki, addr, true).await;
        assert_eq!(role, Role::Node("replica".into()));

        let kick = Arc::new(Notify::new());
        let echoed = Arc::new(AtomicU64::new(0));

        // The writer task: flushes whatever try_send left, when the thread or the reader asks.
        let flusher = {
            let writer = writer.clone();
            let kick = kick.clone();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = kick.notified() => {}
                        _ = writer.flush_wanted() => {}
                    }
                    writer.flush().await.expect("flush");
                }
            })
        };

        // The synchronous writer: straight into the socket, like the engine's driver thread.
        let thread = {
            let writer = writer.clone();
            let kick = kick.clone();
            let echoed = echoed.clone();
            std::thread::spawn(move || {
                let mut partly = 0u64;
                for seq in 0..FRAMES {
                    while seq >= echoed.load(Ordering::Acquire) + WINDOW {
                        std::thread::yield_now();
                    }
                    let (header, payload) = frame(seq);
                    match writer.try_send(&[IoSlice::new(&header), IoSlice::new(&payload)]).expect("try_send") {
                        Sent::All => {}
                        Sent::Partly => {
                            partly += 1;
                            kick.notify_one();
                        }
                    }
                }
                partly
            })
        };

        // The reader task: every echoed frame, byte for byte, in order.
        let mut header = [0u8; 12];
        for seq in 0..FRAMES {
            reader.read_exact(&mut header).await.expect("header");
            let got_seq = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(header[8..].try_into().expect("4 bytes")) as usize;
            assert_eq!(got_seq, seq);
            let mut payload = vec![0u8; len];
            reader.read_exact(&mut payload).await.expect("payload");
            let (want_header, want_payload) = frame(seq);
            assert_eq!(&header[..], &want_header[..], "frame {seq} header");
            assert!(payload == want_payload, "frame {seq} payload differs");
            echoed.store(seq + 1, Ordering::Release);
        }
        let partly = thread.join().expect("writer thread");
        flusher.abort();
        // With small socket buffers and a window of megabytes the socket fills: the writer
        // task's path was taken, not only the direct one.
        assert!(partly > 0, "the socket never filled: the flush path went untested");
        eprintln!("{FRAMES} frames echoed intact; {partly} sends left bytes for the writer task");
    }

    #[tokio::test]
    async fn close_notify_ends_the_stream_cleanly() {
        let mut pki = Pki::new();
        let addr = echo_server(&mut pki, false).await;
        let (writer, mut reader, _) = dial(&mut pki, addr, false).await;
        writer.try_send(&[IoSlice::new(b"hello")]).expect("send");
        writer.flush().await.expect("flush");
        let mut got = [0u8; 5];
        reader.read_exact(&mut got).await.expect("echo");
        assert_eq!(&got, b"hello");
        if writer.close().expect("close") == Sent::Partly {
            writer.flush().await.expect("flush close");
        }
        // The echo server answers our close_notify with its own: a clean end, not an error.
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).await.expect("clean end");
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn a_tcp_end_without_close_notify_is_an_error() {
        let mut pki = Pki::new();
        let server = Arc::new(pki.credentials(&Role::Node("replica".into())));
        let listener = Listener::bind("127.0.0.1:0", Limits::default()).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        // A server that writes a little and drops the TCP connection without a close_notify.
        tokio::spawn(listener.serve_tls(server, |mut conn| async move {
            let _ = conn.stream.write_all(b"truncated").await;
            let _ = conn.stream.flush().await;
            let (io, _) = conn.stream.into_inner();
            drop(io);
        }));
        let (_writer, mut reader, _) = dial(&mut pki, addr, false).await;
        let mut got = Vec::new();
        let err = reader.read_to_end(&mut got).await.expect_err("unclean end");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(got, b"truncated");
    }
}
