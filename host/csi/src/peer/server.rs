//! A node plugin's peer endpoint: Identity (who this node is) and Controller (the node-local
//! calls a controller forwards), served over the product's bounded [`Listener`].
//!
//! ```text
//!  controller ──TLS 1.3──► Listener (caps, handshake deadline and byte budget;
//!                          the client's certificate must verify and name the controller,
//!                          else the handshake fails and nothing of a request is read)
//!                            ──► Timeouts (idle, write) ──► tonic: Identity, Controller
//! ```
//!
//! In `required` only the controller's certificate opens a connection: the handshake's verifier
//! refuses any other role ([`ControllerOnly`]), and the role the handshake yields is checked once
//! more before a byte of HTTP/2 is read. `permissive` serves TLS clients the same way and
//! plaintext ones (a controller that predates TLS, during the upgrade) unauthenticated; `off`
//! serves everyone in plaintext, by explicit choice only.
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt as _;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use wasmcsi_block::transport::Transport;
use wasmcsi_proto::csi::v1::{controller_server::ControllerServer, identity_server::IdentityServer};
use wasmcsi_trust::listener::{
    PermissiveConnection, Permit, PlainConnection, ServerConfigSource, Timeouts, TlsConnection, Transport as Accepted,
};
use wasmcsi_trust::{ExpectedRole, Listener, LiveCredentials, Role};

use crate::controller::ControllerService;
use crate::identity::IdentityService;
use crate::plugin::Plugin;

/// A connection with no byte from the controller for this long is closed. HTTP/2 pings
/// ([`KEEPALIVE`]) keep a connection whose call runs longer than this alive.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A controller that takes no answer bytes for this long is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(20);
/// How often the server pings a connection: a forwarded call may run for minutes (a backend's
/// call deadline, twice), and the controller's ping answers are what the idle clock sees.
const KEEPALIVE: Duration = Duration::from_secs(20);

/// Who is on the other end of a connection: its address and, over TLS, its verified role.
#[derive(Clone, Debug)]
pub struct PeerCaller {
    pub addr: SocketAddr,
    pub role: Option<Role>,
}

/// Any stream the listener hands over (plaintext or TLS).
trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// An accepted connection as tonic serves it: the stream under read/write timeouts, the caller,
/// and its slot in the listener's caps.
struct PeerIo {
    stream: Timeouts<Box<dyn Stream>>,
    caller: PeerCaller,
    _permit: Permit,
}

impl PeerIo {
    fn new(stream: Box<dyn Stream>, caller: PeerCaller, permit: Permit) -> Self {
        PeerIo { stream: Timeouts::new(stream, IDLE_TIMEOUT, WRITE_TIMEOUT), caller, _permit: permit }
    }

    /// A TLS connection, if its role is the controller's (the handshake already refused any
    /// other; this holds even if a config that admits every role was served).
    fn controller(stream: Box<dyn Stream>, addr: SocketAddr, role: Role, permit: Permit) -> Option<Self> {
        if role != Role::Controller {
            tracing::warn!(peer = %addr, %role, "peer connection refused: only the controller calls a node plugin");
            return None;
        }
        Some(PeerIo::new(stream, PeerCaller { addr, role: Some(role) }, permit))
    }
}

impl tonic::transport::server::Connected for PeerIo {
    type ConnectInfo = PeerCaller;

    fn connect_info(&self) -> PeerCaller {
        self.caller.clone()
    }
}

impl AsyncRead for PeerIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The server config of the current credentials that admits only the controller as a client,
/// built once per credentials generation (a rotation applies to the next handshake).
struct ControllerOnly {
    credentials: LiveCredentials,
    built: Mutex<Option<(u64, Arc<ServerConfig>)>>,
}

impl ServerConfigSource for ControllerOnly {
    fn server_config(&self) -> Arc<ServerConfig> {
        let generation = self.credentials.generation();
        let mut built = self.built.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((g, config)) = built.as_ref()
            && *g == generation
        {
            return config.clone();
        }
        match self.credentials.current().server_config_for(ExpectedRole::Controller) {
            Ok(config) => {
                *built = Some((generation, config.clone()));
                config
            }
            Err(error) => {
                // The same credentials built the any-role config when they loaded; should this
                // one fail, that config serves and `PeerIo::controller` refuses other roles.
                tracing::warn!(%error, "no controller-only TLS config; checking the role after the handshake");
                self.credentials.server_config()
            }
        }
    }
}

/// Serves the peer endpoint on `listener` as `transport` says, until the listening socket fails
/// (or the future is dropped: its calls are idempotent and the controller retries one cut short).
pub async fn serve(driver: Arc<Plugin>, listener: Listener, transport: Transport) -> io::Result<()> {
    // Each accepted connection reaches tonic's accept loop through this channel (a full channel
    // holds handshaken connections back, each still counted by its permit).
    let (tx, rx) = tokio::sync::mpsc::channel::<PeerIo>(64);
    let accept = async move {
        match transport {
            Transport::Plain => {
                listener
                    .serve_plain(move |PlainConnection { stream, peer, permit }| {
                        let tx = tx.clone();
                        async move {
                            let _ = tx
                                .send(PeerIo::new(Box::new(stream), PeerCaller { addr: peer, role: None }, permit))
                                .await;
                        }
                    })
                    .await
            }
            Transport::Required(credentials) => {
                let source = ControllerOnly { credentials, built: Mutex::new(None) };
                listener
                    .serve_tls(source, move |TlsConnection { stream, peer, role, permit }| {
                        let tx = tx.clone();
                        async move {
                            if let Some(io) = PeerIo::controller(Box::new(stream), peer, role, permit) {
                                let _ = tx.send(io).await;
                            }
                        }
                    })
                    .await
            }
            Transport::Permissive(credentials) => {
                let source = ControllerOnly { credentials, built: Mutex::new(None) };
                listener
                    .serve_permissive(source, move |PermissiveConnection { transport, peer, permit }| {
                        let tx = tx.clone();
                        async move {
                            let io = match transport {
                                Accepted::Tls { stream, role } => PeerIo::controller(stream, peer, role, permit),
                                Accepted::Plain(stream) => {
                                    Some(PeerIo::new(Box::new(stream), PeerCaller { addr: peer, role: None }, permit))
                                }
                            };
                            if let Some(io) = io {
                                let _ = tx.send(io).await;
                            }
                        }
                    })
                    .await
            }
        }
    };
    let incoming = futures::stream::unfold(rx, |mut rx| async move {
        let io = rx.recv().await?;
        Some((Ok::<_, io::Error>(io), rx))
    })
    .boxed();
    let grpc = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE))
        .add_service(IdentityServer::new(IdentityService(driver.clone())))
        .add_service(ControllerServer::new(ControllerService(driver)))
        .serve_with_incoming(incoming);
    tokio::select! {
        served = accept => served,
        served = grpc => served.map_err(io::Error::other),
    }
}
