//! The one bounded accept loop for every TCP listener of the product ([`Listener`]).
//!
//! ```text
//!  accept ──► gate (total cap, per-source cap) ──► refused: reset at once, nothing read
//!    │            │ Permit (held as long as the connection)
//!    │            ▼
//!    │      serve_tls:        handshake (deadline, byte budget) ──► handler(TlsConnection)
//!    │      serve_tls_client_optional: the same, a client certificate optional
//!    │                        ──────────────────────────────────► handler(ClientOptionalConnection)
//!    │      serve_plain:      ─────────────────────────────────────► handler(PlainConnection)
//!    │      serve_permissive: peek 1 byte: 0x16 ► handshake ┐
//!    │                                  else ► plain ───────┴───────► handler(PermissiveConnection)
//!    ▼
//!  EMFILE/ENFILE/ENOBUFS/ENOMEM: back off 5 ms … 1 s, one log line per burst
//! ```
//!
//! Before the handshake completes a connection costs its permit, a task and rustls' handshake
//! state; nothing of the application is allocated until the handler runs, and the handler runs
//! only for an authenticated peer (or a plain one, in the plain and permissive modes). Idle
//! timeouts after the handshake are the handler's: control and metrics connections want one,
//! engine sessions are long-lived and use TCP keepalive; [`Timeouts`] is the wrapper they use.
//! The same back-off serves accept loops that are not TCP ([`AcceptBackoff`]: the CSI unix
//! socket).

mod backoff;
mod budget;
mod gate;
mod timeouts;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

pub use backoff::{AcceptBackoff, FIRST_DELAY as ACCEPT_BACKOFF_FIRST, MAX_DELAY as ACCEPT_BACKOFF_MAX};
pub use budget::{BudgetExceeded, HandshakeBudget, is_budget_exceeded};
pub use gate::{Permit, Refusal};
pub use timeouts::Timeouts;

use crate::credentials::Credentials;
use crate::identity::{IdentityError, Role};
use crate::reload::LiveCredentials;
use crate::verifier::peer_role;
use backoff::{AcceptError, Backoff, classify};
use gate::Gate;

pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
pub const DEFAULT_MAX_PER_SOURCE: usize = 64;
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_HANDSHAKE_BUDGET: usize = 16 * 1024;
/// The first byte of a TLS connection (a handshake record); a replica frame starts with `W`,
/// an HTTP request with a method name.
pub const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The bounds of one listener.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections open at once (pre- and post-handshake).
    pub max_connections: usize,
    /// Connections open at once from one source (an IPv4 address or an IPv6 /64).
    pub max_per_source: usize,
    /// From accept to the end of the TLS handshake (or to the first byte, when peeking).
    pub handshake_timeout: Duration,
    /// Bytes read from a peer before its handshake completes.
    pub handshake_budget: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_source: DEFAULT_MAX_PER_SOURCE,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            handshake_budget: DEFAULT_HANDSHAKE_BUDGET,
        }
    }
}

/// Counters of one listener, for metrics and tests.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections accepted from the kernel (admitted or not).
    pub accepted: AtomicU64,
    /// Connections holding a permit now.
    pub open: AtomicU64,
    pub refused_total_cap: AtomicU64,
    pub refused_per_source_cap: AtomicU64,
    /// Failed `accept` calls (exhaustion and per-connection errors).
    pub accept_errors: AtomicU64,
    pub handshakes_completed: AtomicU64,
    pub handshakes_failed: AtomicU64,
    pub handshakes_timed_out: AtomicU64,
    pub handshakes_over_budget: AtomicU64,
    /// The most bytes read from one peer before its handshake completed or failed.
    pub max_handshake_bytes: AtomicU64,
    /// Plaintext connections being served now (plain and permissive listeners): who would be
    /// cut off if this listener went to `required`.
    pub plaintext_open: AtomicU64,
}

impl Stats {
    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn read_before_handshake(&self, bytes: usize) {
        self.max_handshake_bytes.fetch_max(bytes as u64, Ordering::Relaxed);
    }
}

/// Counts a plaintext connection in [`Stats::plaintext_open`] while it is held.
struct PlaintextOpen(Arc<Stats>);

impl PlaintextOpen {
    fn new(stats: &Arc<Stats>) -> Self {
        stats.plaintext_open.fetch_add(1, Ordering::Relaxed);
        PlaintextOpen(stats.clone())
    }
}

impl Drop for PlaintextOpen {
    fn drop(&mut self) {
        self.0.plaintext_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a TLS listener gets the server config for each new handshake: the current one, so a
/// reload applies to the next handshake.
pub trait ServerConfigSource: Send + Sync + 'static {
    fn server_config(&self) -> Arc<ServerConfig>;
}

impl ServerConfigSource for LiveCredentials {
    fn server_config(&self) -> Arc<ServerConfig> {
        LiveCredentials::server_config(self)
    }
}

impl ServerConfigSource for Arc<Credentials> {
    fn server_config(&self) -> Arc<ServerConfig> {
        Credentials::server_config(self)
    }
}

impl ServerConfigSource for Arc<ServerConfig> {
    fn server_config(&self) -> Arc<ServerConfig> {
        self.clone()
    }
}

/// The current credentials' server config that also admits clients without a certificate
/// ([`LiveCredentials::server_config_client_optional`]), for [`Listener::serve_tls_client_optional`].
#[derive(Clone)]
pub struct ClientOptional(pub LiveCredentials);

impl ServerConfigSource for ClientOptional {
    fn server_config(&self) -> Arc<ServerConfig> {
        self.0.server_config_client_optional()
    }
}

/// A server-side TLS stream as the listener hands it over (the budget is lifted by then).
pub type ServerTlsStream = tokio_rustls::server::TlsStream<HandshakeBudget<TcpStream>>;

/// An authenticated connection.
#[derive(Debug)]
pub struct TlsConnection {
    pub stream: ServerTlsStream,
    pub peer: SocketAddr,
    /// The peer's role, from its verified certificate.
    pub role: Role,
    pub permit: Permit,
}

/// A TLS connection whose client may have presented no certificate (see
/// [`Listener::serve_tls_client_optional`]).
#[derive(Debug)]
pub struct ClientOptionalConnection {
    pub stream: ServerTlsStream,
    pub peer: SocketAddr,
    /// The client's role, from its verified certificate; `None`: it presented none.
    pub role: Option<Role>,
    pub permit: Permit,
}

/// A plaintext connection (`/metrics`).
#[derive(Debug)]
pub struct PlainConnection {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    pub permit: Permit,
}

/// What a permissive listener accepted.
#[derive(Debug)]
pub enum Transport {
    /// Boxed: a TLS stream is over a kilobyte, the plain one a few words.
    Tls { stream: Box<ServerTlsStream>, role: Role },
    /// A peer whose first byte was not a TLS record; that byte is still unread.
    Plain(TcpStream),
}

#[derive(Debug)]
pub struct PermissiveConnection {
    pub transport: Transport,
    pub peer: SocketAddr,
    pub permit: Permit,
}

/// Why a handshake did not yield a connection.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("no handshake within {0:?}")]
    TimedOut(Duration),
    #[error(transparent)]
    OverBudget(BudgetExceeded),
    #[error("TLS handshake: {0}")]
    Tls(io::Error),
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// A bounded listener; `serve_*` runs its accept loop until the listening socket fails (or
/// the future is dropped).
pub struct Listener {
    tcp: TcpListener,
    limits: Limits,
    gate: Arc<Gate>,
    stats: Arc<Stats>,
}

impl Listener {
    pub fn new(tcp: TcpListener, limits: Limits) -> Listener {
        let stats = Arc::new(Stats::default());
        let gate = Gate::new(limits.max_connections, limits.max_per_source, stats.clone());
        Listener { tcp, limits, gate, stats }
    }

    pub async fn bind(addr: impl ToSocketAddrs, limits: Limits) -> io::Result<Listener> {
        Ok(Listener::new(TcpListener::bind(addr).await?, limits))
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Mutual TLS: `handler` gets each authenticated connection, on a task of its own.
    pub async fn serve_tls<S, H, F>(self, source: S, handler: H) -> io::Result<()>
    where
        S: ServerConfigSource,
        H: Fn(TlsConnection) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let limits = self.limits.clone();
        let stats = self.stats.clone();
        self.run(move |tcp, peer, permit| {
            let config = source.server_config();
            let handler = handler.clone();
            let limits = limits.clone();
            let stats = stats.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + limits.handshake_timeout;
                match handshake(tcp, config, deadline, &limits, &stats, ClientCertificate::Required).await {
                    Ok((stream, Some(role))) => handler(TlsConnection { stream, peer, role, permit }).await,
                    // A config of a [`ServerConfigSource`] that does not require a certificate.
                    Ok((_, None)) => tracing::debug!(%peer, "connection refused: no client certificate"),
                    Err(error) => tracing::debug!(%peer, %error, "connection refused"),
                }
            });
        })
        .await
    }

    /// TLS where the client may present no certificate: `source` must give a config that allows
    /// that ([`ClientOptional`]); a certificate that is presented is verified as in
    /// [`Self::serve_tls`]. Every other bound is the same. The handler authorizes each call,
    /// by role or by the proof a call without one carries.
    pub async fn serve_tls_client_optional<S, H, F>(self, source: S, handler: H) -> io::Result<()>
    where
        S: ServerConfigSource,
        H: Fn(ClientOptionalConnection) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let limits = self.limits.clone();
        let stats = self.stats.clone();
        self.run(move |tcp, peer, permit| {
            let config = source.server_config();
            let handler = handler.clone();
            let limits = limits.clone();
            let stats = stats.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + limits.handshake_timeout;
                match handshake(tcp, config, deadline, &limits, &stats, ClientCertificate::Optional).await {
                    Ok((stream, role)) => handler(ClientOptionalConnection { stream, peer, role, permit }).await,
                    Err(error) => tracing::debug!(%peer, %error, "connection refused"),
                }
            });
        })
        .await
    }

    /// Plaintext (`/metrics`): the same caps, no handshake.
    pub async fn serve_plain<H, F>(self, handler: H) -> io::Result<()>
    where
        H: Fn(PlainConnection) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let stats = self.stats.clone();
        self.run(move |stream, peer, permit| {
            let open = PlaintextOpen::new(&stats);
            let served = handler(PlainConnection { stream, peer, permit });
            tokio::spawn(async move {
                served.await;
                drop(open);
            });
        })
        .await
    }

    /// TLS and legacy plaintext side by side (the `permissive` upgrade mode): a connection whose
    /// first byte is a TLS handshake record is handshaken as [`Self::serve_tls`] does, any other
    /// is handed over as it is, its first byte unread.
    pub async fn serve_permissive<S, H, F>(self, source: S, handler: H) -> io::Result<()>
    where
        S: ServerConfigSource,
        H: Fn(PermissiveConnection) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let limits = self.limits.clone();
        let stats = self.stats.clone();
        self.run(move |tcp, peer, permit| {
            let config = source.server_config();
            let handler = handler.clone();
            let limits = limits.clone();
            let stats = stats.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + limits.handshake_timeout;
                let mut first = [0u8; 1];
                let transport = match tokio::time::timeout_at(deadline, tcp.peek(&mut first)).await {
                    Ok(Ok(1)) if first[0] == TLS_HANDSHAKE_RECORD => {
                        match handshake(tcp, config, deadline, &limits, &stats, ClientCertificate::Required).await {
                            Ok((stream, Some(role))) => Transport::Tls { stream: Box::new(stream), role },
                            Ok((_, None)) => {
                                return tracing::debug!(%peer, "connection refused: no client certificate");
                            }
                            Err(error) => return tracing::debug!(%peer, %error, "connection refused"),
                        }
                    }
                    Ok(Ok(1)) => {
                        let _open = PlaintextOpen::new(&stats);
                        return handler(PermissiveConnection { transport: Transport::Plain(tcp), peer, permit }).await;
                    }
                    Ok(Ok(_)) => return,
                    Ok(Err(error)) => return tracing::debug!(%peer, %error, "connection failed before its first byte"),
                    Err(_) => {
                        Stats::count(&stats.handshakes_timed_out);
                        return tracing::debug!(%peer, "connection refused: nothing sent within the handshake deadline");
                    }
                };
                handler(PermissiveConnection { transport, peer, permit }).await
            });
        })
        .await
    }

    async fn run(self, mut admitted: impl FnMut(TcpStream, SocketAddr, Permit)) -> io::Result<()> {
        let local = self.tcp.local_addr().ok();
        let mut backoff = Backoff::default();
        loop {
            match self.tcp.accept().await {
                Ok((tcp, peer)) => {
                    let errors = backoff.on_success();
                    if errors > 0 {
                        tracing::info!(listener = ?local, errors, "accepting again after running out of resources");
                    }
                    Stats::count(&self.stats.accepted);
                    match self.gate.try_admit(peer.ip()) {
                        Ok(permit) => admitted(tcp, peer, permit),
                        Err(refusal) => {
                            Stats::count(match refusal {
                                Refusal::Total => &self.stats.refused_total_cap,
                                Refusal::PerSource => &self.stats.refused_per_source_cap,
                            });
                            // A reset, not a FIN: the peer learns at once, and no TIME_WAIT is
                            // left here per refused connection.
                            let _ = tcp.set_zero_linger();
                            tracing::trace!(%peer, ?refusal, "connection refused at the cap");
                        }
                    }
                }
                Err(error) => match classify(&error) {
                    AcceptError::Connection => Stats::count(&self.stats.accept_errors),
                    AcceptError::Fatal => return Err(error),
                    AcceptError::Exhausted => {
                        Stats::count(&self.stats.accept_errors);
                        let (delay, burst_starts) = backoff.on_error();
                        if burst_starts {
                            tracing::warn!(
                                listener = ?local,
                                %error,
                                "accept failed: out of descriptors or memory; backing off (up to {:?}) until it succeeds",
                                ACCEPT_BACKOFF_MAX
                            );
                        }
                        tokio::time::sleep(delay).await;
                    }
                },
            }
        }
    }
}

/// Whether a handshake without a client certificate yields a connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ClientCertificate {
    Required,
    Optional,
}

/// The server side of a handshake under the listener's bounds: done by `deadline`, at most
/// `limits.handshake_budget` bytes read before it completes. The role is `None` only for a
/// client without a certificate where `client` allows one.
async fn handshake(
    tcp: TcpStream,
    config: Arc<ServerConfig>,
    deadline: Instant,
    limits: &Limits,
    stats: &Stats,
    client: ClientCertificate,
) -> Result<(ServerTlsStream, Option<Role>), HandshakeError> {
    // Handshake flights and the small frames after them are latency-bound.
    let _ = tcp.set_nodelay(true);
    let io = HandshakeBudget::new(tcp, limits.handshake_budget);
    let accept = TlsAcceptor::from(config).accept(io).into_fallible();
    match tokio::time::timeout_at(deadline, accept).await {
        Err(_) => {
            Stats::count(&stats.handshakes_timed_out);
            Err(HandshakeError::TimedOut(limits.handshake_timeout))
        }
        Ok(Err((error, io))) => {
            stats.read_before_handshake(io.bytes_read());
            if is_budget_exceeded(&error) {
                Stats::count(&stats.handshakes_over_budget);
                Err(HandshakeError::OverBudget(BudgetExceeded { budget: limits.handshake_budget }))
            } else {
                Stats::count(&stats.handshakes_failed);
                Err(HandshakeError::Tls(error))
            }
        }
        Ok(Ok(mut stream)) => {
            let (io, tls) = stream.get_mut();
            stats.read_before_handshake(io.bytes_read());
            io.lift();
            let anonymous = tls.peer_certificates().is_none_or(|chain| chain.is_empty());
            let role = match peer_role(tls) {
                Ok(role) => Some(role),
                Err(_) if anonymous && client == ClientCertificate::Optional => None,
                Err(e) => {
                    Stats::count(&stats.handshakes_failed);
                    return Err(e.into());
                }
            };
            Stats::count(&stats.handshakes_completed);
            Ok((stream, role))
        }
    }
}
