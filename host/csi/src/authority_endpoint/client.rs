//! The node's side of the authority endpoint: [`AuthorityClient`], a gRPC client over TLS 1.3
//! that accepts only the controller as the server, presenting the node's certificate (or none,
//! before it has one), and the data path's [`GrantSource`] over `GrantVolume`.
//!
//! The TLS config is taken from the credentials at every new connection, so a renewed
//! certificate is what the next connection presents; tonic reconnects on its own after the
//! server's idle timeout closes a connection.
use std::io;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint, Uri};
use wasmcsi_proto::authority::v1 as pb;
use wasmcsi_proto::authority::v1::authority_client::AuthorityClient as Rpc;
use wasmcsi_trust::credentials::{anonymous_client_config, server_name};
use wasmcsi_trust::grant::source::GrantFuture;
use wasmcsi_trust::{ExpectedRole, GrantSource, GrantSourceError, LiveCredentials, TrustAnchors};

/// A TCP connection and TLS handshake, each.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A whole call; the server bounds its side to [`super::CALL_TIMEOUT`].
const CALL_TIMEOUT: Duration = Duration::from_secs(40);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the authority endpoint {url:?} is not https://HOST:PORT")]
    Url { url: String },
    #[error("the TLS config for the authority endpoint: {0}")]
    Tls(#[from] wasmcsi_trust::CredentialsError),
}

/// What the client presents to the authority endpoint.
#[derive(Clone)]
pub enum ClientIdentity {
    /// No certificate (a node asking for its first); the server is verified against this bundle.
    Anonymous(Arc<TrustAnchors>),
    /// The node's certificate, as it rotates.
    Credentials(LiveCredentials),
}

impl ClientIdentity {
    fn config(&self) -> Result<Arc<rustls::ClientConfig>, wasmcsi_trust::CredentialsError> {
        match self {
            ClientIdentity::Anonymous(anchors) => anonymous_client_config(anchors.clone(), ExpectedRole::Controller),
            ClientIdentity::Credentials(live) => live.client_config(ExpectedRole::Controller),
        }
    }
}

/// A client of one authority endpoint.
#[derive(Clone)]
pub struct AuthorityClient {
    rpc: Rpc<Channel>,
    url: String,
}

impl AuthorityClient {
    /// A client of the endpoint at `url` (`https://HOST:PORT`); nothing is dialled until the
    /// first call.
    pub fn new(url: &str, identity: ClientIdentity) -> Result<AuthorityClient, ClientError> {
        let target = url
            .strip_prefix("https://")
            .map(|rest| rest.trim_end_matches('/'))
            .filter(|rest| !rest.is_empty() && !rest.contains('/'))
            .ok_or_else(|| ClientError::Url { url: url.to_owned() })?
            .to_owned();
        // Checked now, so a broken identity fails at start, not at the first call.
        identity.config()?;
        // tonic speaks HTTP/2 in the clear to what the connector returns: the TLS is ours.
        let endpoint = Endpoint::from_shared(format!("http://{target}"))
            .map_err(|_| ClientError::Url { url: url.to_owned() })?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(CALL_TIMEOUT);
        let connector = tower::service_fn(move |_: Uri| {
            let (identity, target) = (identity.clone(), target.clone());
            async move { connect(&target, &identity).await }
        });
        Ok(AuthorityClient { rpc: Rpc::new(endpoint.connect_with_connector_lazy(connector)), url: url.to_owned() })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// `GrantVolume`: a grant of `set_id` for the node this client's certificate names.
    pub async fn grant_volume(&self, set_id: &str) -> Result<Vec<u8>, tonic::Status> {
        let mut rpc = self.rpc.clone();
        let request = pb::GrantVolumeRequest { set_id: set_id.to_owned() };
        Ok(rpc.grant_volume(request).await?.into_inner().grant)
    }

    /// `IssueCertificate`: a certificate for the key of `csr` (DER) as node `node`, proven by
    /// this client's certificate (renewal) or by `token`.
    pub async fn issue_certificate(
        &self,
        csr: &[u8],
        node: &str,
        token: Option<String>,
    ) -> Result<pb::IssueCertificateResponse, tonic::Status> {
        let mut rpc = self.rpc.clone();
        let request = pb::IssueCertificateRequest {
            csr: csr.to_vec(),
            node: node.to_owned(),
            service_account_token: token.unwrap_or_default(),
        };
        Ok(rpc.issue_certificate(request).await?.into_inner())
    }
}

/// TCP, then TLS as `identity`, accepting only the controller.
async fn connect(
    target: &str,
    identity: &ClientIdentity,
) -> io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>> {
    let config = identity.config().map_err(io::Error::other)?;
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {target}")))??;
    let _ = tcp.set_nodelay(true);
    let tls =
        tokio::time::timeout(CONNECT_TIMEOUT, tokio_rustls::TlsConnector::from(config).connect(server_name(), tcp))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("TLS handshake with {target}")))??;
    Ok(TokioIo::new(tls))
}

/// The data path's grants from the controller: `GrantVolume` as this node.
impl GrantSource for AuthorityClient {
    fn grant<'a>(&'a self, set_id: &'a str) -> GrantFuture<'a> {
        Box::pin(async move {
            self.grant_volume(set_id).await.map_err(|status| {
                let reason = format!("{} ({:?})", status.message(), status.code());
                match status.code() {
                    tonic::Code::PermissionDenied | tonic::Code::InvalidArgument | tonic::Code::Unauthenticated => {
                        GrantSourceError::refused(set_id, reason)
                    }
                    _ => GrantSourceError::unavailable(set_id, reason),
                }
            })
        })
    }
}
