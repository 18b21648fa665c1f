//! The controller's HTTPS client of the Kubernetes API server: one request per call, hyper's
//! HTTP/1 client over rustls (TLS 1.3, ring), the cluster's CA as the only trust anchor and the
//! controller's own ServiceAccount token as bearer (re-read at each call: kubelet rotates it).
//! No kube client library for the few calls the controller makes (a TokenReview, the built-in
//! CA's Secret and ConfigMap).
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Bytes;
use hyper::{Method, StatusCode};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};

use super::token_review::KubeApi;

/// The longest answer read from the API server.
const MAX_RESPONSE: usize = 64 * 1024;
/// A whole call (connect, TLS, request, answer).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The client cannot be built or the call cannot be made as configured.
    #[error("the Kubernetes API client: {0}")]
    Config(String),
    /// No answer, or one that cannot be read: retry.
    #[error("the Kubernetes API at {url}: {what}")]
    Unavailable { url: String, what: String },
}

/// A client of one API server.
pub struct KubeClient {
    pub(super) api: KubeApi,
    pub(super) host: String,
    pub(super) port: u16,
    tls: Arc<rustls::ClientConfig>,
    server_name: ServerName<'static>,
}

impl KubeClient {
    /// Reads the CA bundle now (a CA that does not parse is a configuration error, said at
    /// start); the bearer token is read at each call.
    pub fn new(api: KubeApi) -> Result<KubeClient, KubeError> {
        let config = |what: String| KubeError::Config(what);
        let rest = api
            .url
            .strip_prefix("https://")
            .ok_or_else(|| config(format!("{}: the API server's URL must start with https://", api.url)))?;
        let authority = rest.split('/').next().unwrap_or(rest);
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !port.contains(']') => {
                (host, port.parse::<u16>().map_err(|_| config(format!("{}: the port is not a number", api.url)))?)
            }
            _ => (authority, 443),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let server_name = ServerName::try_from(host.clone())
            .map_err(|e| config(format!("{}: {host:?} is no host name: {e}", api.url)))?;
        let pem = std::fs::read(&api.ca_file).map_err(|e| config(format!("reading {}: {e}", api.ca_file.display())))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| config(format!("{}: {e}", api.ca_file.display())))?;
            roots.add(cert).map_err(|e| config(format!("{}: {e}", api.ca_file.display())))?;
        }
        if roots.is_empty() {
            return Err(config(format!("{}: no certificate in it", api.ca_file.display())));
        }
        let tls = rustls::ClientConfig::builder_with_provider(wasmcsi_trust::provider::provider())
            .with_protocol_versions(wasmcsi_trust::provider::PROTOCOL_VERSIONS)
            .map_err(|e| config(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(KubeClient { host, port, tls: Arc::new(tls), server_name: server_name.to_owned(), api })
    }

    /// The API server's URL.
    pub fn url(&self) -> &str {
        &self.api.url
    }

    pub(crate) fn unavailable(&self, what: impl Into<String>) -> KubeError {
        KubeError::Unavailable { url: self.api.url.clone(), what: what.into() }
    }

    /// One call: `method path` with `body` (JSON), answered by a status and at most
    /// [`MAX_RESPONSE`] bytes, within [`CALL_TIMEOUT`].
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(StatusCode, Bytes), KubeError> {
        match tokio::time::timeout(CALL_TIMEOUT, self.send(method, path, body)).await {
            Ok(result) => result,
            Err(_) => Err(self.unavailable(format!("no answer within {CALL_TIMEOUT:?}"))),
        }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(StatusCode, Bytes), KubeError> {
        let bearer = std::fs::read_to_string(&self.api.token_file)
            .map_err(|e| KubeError::Config(format!("reading {}: {e}", self.api.token_file.display())))?;
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, format!("{}:{}", self.host, self.port))
            .header(hyper::header::AUTHORIZATION, format!("Bearer {}", bearer.trim()))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::ACCEPT, "application/json")
            .body(Full::new(body.map(|b| Bytes::from(b.to_string())).unwrap_or_default()))
            .map_err(|e| KubeError::Config(e.to_string()))?;

        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| self.unavailable(format!("connecting: {e}")))?;
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|e| self.unavailable(format!("TLS: {e}")))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| self.unavailable(format!("HTTP: {e}")))?;
        let driver = tokio::spawn(connection);
        let answer = sender.send_request(request).await.map_err(|e| self.unavailable(format!("HTTP: {e}")));
        let result = match answer {
            Ok(response) => {
                let status = response.status();
                match Limited::new(response.into_body(), MAX_RESPONSE).collect().await {
                    Ok(body) => Ok((status, body.to_bytes())),
                    Err(e) => Err(self.unavailable(format!("reading the answer: {e}"))),
                }
            }
            Err(e) => Err(e),
        };
        driver.abort();
        result
    }
}
