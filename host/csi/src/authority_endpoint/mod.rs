//! The controller's authority endpoint (`proto/authority.proto`): node certificates from the
//! built-in CA, and grants of volumes for the nodes they are published to. (Not the HTTP/2
//! `:authority` header: that is [`crate::authority`].)
//!
//! ```text
//!  node plugin / data path ──TLS 1.3──► wasmcsi_trust::Listener (caps, handshake bounds;
//!                                        a client certificate optional) ──► Timeouts ──► tonic
//!     GrantVolume(set)            caller: a node certificate N ──► the volume's records:
//!                                 published to N at epoch E? ──► a grant (set, N, E) signed
//!                                 with the controller's credentials
//!     IssueCertificate(csr, N)    caller: node N's certificate (renewal), or a token the
//!                                 TokenReview API says is N's node plugin's ──► the CA signs
//!                                 the request's key as node N
//! ```
//!
//! The server is the controller (its certificate's role), so a node never hands a token or a
//! request to anyone else. The role of a caller with a certificate comes from the TLS handshake
//! (`Caller`, carried to each call by tonic's connect info); the request never names its own
//! caller. Every refusal is logged once, with the caller and why.
//!
//! The parts: `service` (the two calls and their decisions), `publications` (which volume is
//! published where: the block catalog), `token_review` (the TokenReview client), `kube_client`
//! (the HTTPS client of the API server both use), `ca_store` (the built-in CA kept in a Secret,
//! its certificate published in a ConfigMap), `client` (the
//! node's side: a gRPC client over TLS, and the data path's [`wasmcsi_trust::GrantSource`]),
//! `enroll` (a node's first certificate and its renewals).
pub mod ca_store;
pub mod client;
pub mod enroll;
pub mod kube_client;
pub mod publications;
mod service;
pub mod token_review;

pub use client::{AuthorityClient, ClientError};
pub use publications::CatalogPublications;
pub use service::{AuthorityService, CertificateIssuer};

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt as _;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use wasmcsi_proto::authority::v1::authority_server::AuthorityServer;
use wasmcsi_trust::listener::{ClientOptional, ClientOptionalConnection, Permit, ServerTlsStream, Timeouts};
use wasmcsi_trust::{Listener, LiveCredentials, Role};

/// A connection with no byte from the node for this long is closed (calls are bounded by
/// [`CALL_TIMEOUT`], well within it; a client reconnects at its next call).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A node that takes no answer bytes for this long is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(20);
/// The longest a call runs (a token review, the discovery behind a grant).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Who made a call: the peer's address and, when it presented a certificate, its role.
#[derive(Clone, Debug)]
pub struct Caller {
    pub addr: SocketAddr,
    pub role: Option<Role>,
}

/// An accepted connection as tonic serves it: the TLS stream under read/write timeouts, the
/// caller's identity for every call on it, and its slot in the listener's caps.
pub struct AuthorityIo {
    stream: Timeouts<ServerTlsStream>,
    caller: Caller,
    _permit: Permit,
}

impl AuthorityIo {
    fn new(connection: ClientOptionalConnection) -> Self {
        let ClientOptionalConnection { stream, peer, role, permit } = connection;
        AuthorityIo {
            stream: Timeouts::new(stream, IDLE_TIMEOUT, WRITE_TIMEOUT),
            caller: Caller { addr: peer, role },
            _permit: permit,
        }
    }
}

impl tonic::transport::server::Connected for AuthorityIo {
    type ConnectInfo = Caller;

    fn connect_info(&self) -> Caller {
        self.caller.clone()
    }
}

impl AsyncRead for AuthorityIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for AuthorityIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Serves `service` on `listener` with `credentials` (the controller's, followed as they
/// rotate) until the listening socket fails or the future is dropped.
pub async fn serve(listener: Listener, credentials: LiveCredentials, service: AuthorityService) -> io::Result<()> {
    // The listener hands each authenticated connection to a task of its own; they reach tonic's
    // accept loop through this channel (a full channel holds the handshaken connections back,
    // each still counted by its permit).
    let (tx, rx) = tokio::sync::mpsc::channel::<ClientOptionalConnection>(64);
    let accept = listener.serve_tls_client_optional(ClientOptional(credentials), move |connection| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(connection).await;
        }
    });
    let incoming = futures::stream::unfold(rx, |mut rx| async move {
        let connection = rx.recv().await?;
        Some((Ok::<_, io::Error>(AuthorityIo::new(connection)), rx))
    })
    .boxed();
    let grpc = tonic::transport::Server::builder()
        .timeout(CALL_TIMEOUT)
        .add_service(AuthorityServer::new(service))
        .serve_with_incoming(incoming);
    tokio::select! {
        served = accept => served,
        served = grpc => served.map_err(io::Error::other),
    }
}
