//! How the replica protocol travels between processes ([`Transport`]: plaintext, or mutual TLS
//! with this process's credentials, `permissive` or `required`), and the client side of reaching
//! a replica server over it ([`dial`] for control clients, [`dial_split`] for engine
//! connections): TCP, then the TLS handshake within one deadline, checking that the server is the
//! node the caller meant to reach. A client in `permissive` mode falls back to plaintext only
//! against a server that answered the handshake like one that predates TLS (it closed the
//! connection without a TLS alert: an old server reads a ClientHello as a bad frame and drops
//! it); any other failure (a refused certificate, a server of the wrong node) stays a failure.
//!
//! The halves both sides read and write through ([`ReadHalf`], [`WriteHalf`]) hide which of the
//! two a connection is; TLS connections are split with `wasmcsi_trust::stream`, so one thread can
//! write encrypted records while another task reads.

use std::fmt;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;
use wasmcsi_trust::credentials::server_name;
use wasmcsi_trust::stream::{self, Sent, StreamError, TlsReader, TlsWriter};
use wasmcsi_trust::verifier::peer_role;
use wasmcsi_trust::{ExpectedRole, LiveCredentials, Role, TlsMode};

/// How the replica protocol is carried: what `--tls-mode` and `--tls-dir` chose.
#[derive(Clone)]
pub enum Transport {
    /// `off`: plaintext, no authentication.
    Plain,
    /// `permissive`: TLS with these credentials; plaintext peers are still served (server) or
    /// fallen back to (client, against a server that does not speak TLS).
    Permissive(LiveCredentials),
    /// `required`: mutual TLS only.
    Required(LiveCredentials),
}

#[derive(Debug, thiserror::Error)]
#[error("--tls-mode {0} needs credentials (--tls-dir)")]
pub struct NoCredentials(pub TlsMode);

impl Transport {
    /// The transport `mode` names, with `credentials` for the two TLS modes (`off` ignores
    /// them).
    pub fn new(mode: TlsMode, credentials: Option<LiveCredentials>) -> Result<Transport, NoCredentials> {
        match (mode, credentials) {
            (TlsMode::Off, _) => Ok(Transport::Plain),
            (TlsMode::Permissive, Some(c)) => Ok(Transport::Permissive(c)),
            (TlsMode::Required, Some(c)) => Ok(Transport::Required(c)),
            (mode, None) => Err(NoCredentials(mode)),
        }
    }

    pub fn mode(&self) -> TlsMode {
        match self {
            Transport::Plain => TlsMode::Off,
            Transport::Permissive(_) => TlsMode::Permissive,
            Transport::Required(_) => TlsMode::Required,
        }
    }

    pub fn credentials(&self) -> Option<&LiveCredentials> {
        match self {
            Transport::Plain => None,
            Transport::Permissive(c) | Transport::Required(c) => Some(c),
        }
    }

    /// Our own role (from the current certificate); `None` in plaintext.
    pub fn role(&self) -> Option<Role> {
        self.credentials().map(|c| c.current().role().clone())
    }
}

impl fmt::Debug for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.role() {
            Some(role) => write!(f, "Transport({}, as {role})", self.mode()),
            None => write!(f, "Transport({})", self.mode()),
        }
    }
}

/// Why a replica server could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("{0}")]
    Unreachable(#[source] io::Error),
    #[error("no connection within {0:?}")]
    TimedOut(Duration),
    /// The handshake failed, or the server is not who the caller expected.
    #[error("TLS: {0}")]
    Tls(String),
    /// Our credentials cannot make a client config (never expected: they loaded).
    #[error("TLS credentials: {0}")]
    Credentials(String),
}

/// A connected control client's stream.
pub enum ClientStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// A connection to a replica server: the stream, and the server's role when it is TLS.
pub struct Dialed {
    pub stream: ClientStream,
    pub server: Option<Role>,
}

/// An engine connection split for the driver thread and the reader task.
pub enum Split {
    Plain(TcpStream),
    Tls { writer: TlsWriter, reader: TlsReader, server: Role },
}

/// Connects to the replica server at `addr` as `transport` says, the server being `expected`
/// (TLS only), TCP and handshake within `timeout`.
pub async fn dial(
    addr: SocketAddr,
    transport: &Transport,
    expected: &ExpectedRole,
    timeout: Duration,
) -> Result<Dialed, DialError> {
    let deadline = Instant::now() + timeout;
    let Some((config, permissive)) = client_config(transport, expected)? else {
        return Ok(Dialed { stream: ClientStream::Plain(tcp(addr, deadline, timeout).await?), server: None });
    };
    let tcp_stream = tcp(addr, deadline, timeout).await?;
    let handshake = tokio_rustls::TlsConnector::from(config).connect(server_name(), tcp_stream);
    match tokio::time::timeout_at(deadline, handshake).await {
        Err(_) => Err(DialError::TimedOut(timeout)),
        Ok(Ok(stream)) => {
            let server = peer_role(stream.get_ref().1).map_err(|e| DialError::Tls(e.to_string()))?;
            Ok(Dialed { stream: ClientStream::Tls(Box::new(stream)), server: Some(server) })
        }
        Ok(Err(e)) if permissive && answered_like_an_old_server(&e) => {
            tracing::info!(%addr, error = %e, "the replica server does not speak TLS; plaintext (permissive mode)");
            Ok(Dialed { stream: ClientStream::Plain(tcp(addr, deadline, timeout).await?), server: None })
        }
        Ok(Err(e)) => Err(DialError::Tls(e.to_string())),
    }
}

/// Like [`dial`], split for an engine connection (see `wasmcsi_trust::stream`).
pub async fn dial_split(
    addr: SocketAddr,
    transport: &Transport,
    expected: &ExpectedRole,
    timeout: Duration,
) -> Result<Split, DialError> {
    let deadline = Instant::now() + timeout;
    let Some((config, permissive)) = client_config(transport, expected)? else {
        return Ok(Split::Plain(tcp(addr, deadline, timeout).await?));
    };
    let tcp_stream = tcp(addr, deadline, timeout).await?;
    let left = deadline.saturating_duration_since(Instant::now());
    match stream::connect(tcp_stream, config, server_name(), left).await {
        Ok((writer, reader, server)) => Ok(Split::Tls { writer, reader, server }),
        Err(StreamError::TimedOut { .. }) => Err(DialError::TimedOut(timeout)),
        Err(StreamError::Handshake { source, .. }) if permissive && answered_like_an_old_server(&source) => {
            tracing::info!(%addr, error = %source, "the replica server does not speak TLS; plaintext (permissive mode)");
            Ok(Split::Plain(tcp(addr, deadline, timeout).await?))
        }
        Err(e) => Err(DialError::Tls(e.to_string())),
    }
}

/// The client config for `transport` (and whether it may fall back), `None` in plaintext.
fn client_config(
    transport: &Transport,
    expected: &ExpectedRole,
) -> Result<Option<(Arc<ClientConfig>, bool)>, DialError> {
    let (credentials, permissive) = match transport {
        Transport::Plain => return Ok(None),
        Transport::Permissive(c) => (c, true),
        Transport::Required(c) => (c, false),
    };
    let config = credentials.client_config(expected.clone()).map_err(|e| DialError::Credentials(e.to_string()))?;
    Ok(Some((config, permissive)))
}

async fn tcp(addr: SocketAddr, deadline: Instant, timeout: Duration) -> Result<TcpStream, DialError> {
    let stream = match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(DialError::Unreachable(e)),
        Err(_) => return Err(DialError::TimedOut(timeout)),
    };
    // Requests are small and latency-bound (4k writes); Nagle would add a round trip.
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// A server that predates TLS reads the ClientHello as a frame with a bad magic and closes the
/// connection: the client sees the stream end (or a reset), never a TLS alert.
fn answered_like_an_old_server(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

impl AsyncRead for ClientStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    /// TLS: a close_notify, then the end of the TCP stream.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The read side of a server or engine connection.
pub(crate) enum ReadHalf {
    Plain(OwnedReadHalf),
    Tls(TlsReader),
}

impl AsyncRead for ReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Plain(r) => Pin::new(r).poll_read(cx, buf),
            ReadHalf::Tls(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

/// The write side of a server connection (one writer task).
pub(crate) enum WriteHalf {
    Plain(OwnedWriteHalf),
    Tls(TlsWriter),
}

impl WriteHalf {
    pub(crate) async fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            WriteHalf::Plain(w) => w.write_all(buf).await,
            WriteHalf::Tls(w) => {
                if w.try_send(&[IoSlice::new(buf)])? == Sent::Partly {
                    w.flush().await?;
                }
                Ok(())
            }
        }
    }

    /// Completes when the TLS reader left an answer (a KeyUpdate's) for the writer to flush;
    /// never for plaintext.
    pub(crate) async fn flush_wanted(&self) {
        match self {
            WriteHalf::Plain(_) => std::future::pending().await,
            WriteHalf::Tls(w) => w.flush_wanted().await,
        }
    }

    pub(crate) async fn flush(&mut self) -> io::Result<()> {
        match self {
            WriteHalf::Plain(w) => w.flush().await,
            WriteHalf::Tls(w) => w.flush().await,
        }
    }

    /// The end of the stream: TLS sends its close_notify first, so the peer reads a clean end.
    pub(crate) async fn shutdown(&mut self) -> io::Result<()> {
        match self {
            WriteHalf::Plain(w) => w.shutdown().await,
            WriteHalf::Tls(w) => {
                if w.close()? == Sent::Partly {
                    w.flush().await?;
                }
                shutdown_write(w.socket())
            }
        }
    }
}

/// Half-closes a socket shared by a TLS reader and writer (neither owns it alone).
pub(crate) fn shutdown_write(socket: &TcpStream) -> io::Result<()> {
    nix::sys::socket::shutdown(socket.as_raw_fd(), nix::sys::socket::Shutdown::Write).map_err(io::Error::from)
}

/// Turns on TCP keepalive: an engine session is long-lived and mostly idle on a quiet volume,
/// so a peer that vanished (a node powered off, a cable cut) is found by probes, not by a
/// timeout that would also end quiet sessions. Probes after `idle` without traffic, then every
/// `idle / 3`, three unanswered probes end the connection.
pub(crate) fn keepalive(socket: &TcpStream, idle: Duration) {
    use nix::sys::socket::{setsockopt, sockopt};
    let secs = u32::try_from(idle.as_secs().max(1)).unwrap_or(u32::MAX);
    let fd = socket.as_fd();
    let set = setsockopt(&fd, sockopt::KeepAlive, &true)
        .and_then(|()| setsockopt(&fd, sockopt::TcpKeepIdle, &secs))
        .and_then(|()| setsockopt(&fd, sockopt::TcpKeepInterval, &(secs / 3).max(1)))
        .and_then(|()| setsockopt(&fd, sockopt::TcpKeepCount, &3));
    if let Err(e) = set {
        tracing::debug!(error = %e, "TCP keepalive not set");
    }
}
