//! A node's own certificate from the controller's built-in CA ([`Enrollment`]): the first one,
//! proven with the node plugin's projected ServiceAccount token, and a renewal at 2/3 of each
//! certificate's life, proven by the certificate itself.
//!
//! The credentials directory is written as one set (the layout every process reads, see
//! `wasmcsi_trust::secret_dir`) and only after what came back was checked the way a loader
//! checks it, so a bad answer never replaces a working set. The processes that use the
//! credentials follow the directory (`wasmcsi_trust::watch`) and pick the new set up there;
//! connections already open keep theirs.
//!
//! Renewal failures are retried with back-off (from [`FIRST_RETRY`] to [`MAX_RETRY`]); the
//! certificate still serves meanwhile, since a third of its life is left when renewal starts.
//! A certificate that expired anyway (the controller was away longer than that) can no longer
//! prove anything: the token is used again, when there is one.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use wasmcsi_trust::pki::{self, Issued};
use wasmcsi_trust::{Credentials, LiveCredentials, Role, TrustAnchors};

use super::client::{AuthorityClient, ClientError, ClientIdentity};

pub const FIRST_RETRY: Duration = Duration::from_secs(5);
pub const MAX_RETRY: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("no CA to trust the authority endpoint by: {0}")]
    NoTrust(String),
    #[error("node {node} has no usable certificate in {dir} and no ServiceAccount token to ask for one with")]
    NoProof { node: String, dir: PathBuf },
    #[error("reading the ServiceAccount token {path}: {source}")]
    Token { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("the authority endpoint {url} refused: {status}")]
    Refused { url: String, status: tonic::Status },
    #[error("the authority endpoint {url} answered a set that does not serve: {why}")]
    BadAnswer { url: String, why: String },
    #[error("{0}")]
    Pki(#[from] wasmcsi_trust::pki::PkiError),
    #[error("{0}")]
    SecretDir(#[from] wasmcsi_trust::secret_dir::SecretDirError),
}

/// Where a node gets its certificate, and where it keeps it.
#[derive(Clone, Debug)]
pub struct Enrollment {
    /// The authority endpoint, `https://HOST:PORT`.
    pub url: String,
    /// This node's id.
    pub node: String,
    /// The node's credentials directory (written here).
    pub dir: PathBuf,
    /// The CA bundle to trust the authority endpoint by before the first certificate (default:
    /// `ca.crt` in [`Self::dir`], when it is there).
    pub ca_file: Option<PathBuf>,
    /// The node plugin's projected ServiceAccount token (audience `wasmcsi`), read at each use.
    pub token_file: Option<PathBuf>,
}

/// When a certificate valid from `not_before` to `not_after` is renewed: at 2/3 of its life,
/// counted from when it was issued. The built-in CA starts a validity [`pki::BACKDATE`] before
/// issue (for peers whose clocks are behind); counting from `not_before` would make a short
/// certificate due at once, and every renewal of it too.
pub fn renewal_due(not_before: SystemTime, not_after: SystemTime) -> SystemTime {
    let issued = (not_before + pki::BACKDATE).min(not_after);
    let life = not_after.duration_since(issued).unwrap_or_default();
    issued + life * 2 / 3
}

impl Enrollment {
    /// Makes sure [`Self::dir`] holds this node's credentials with more than a third of their
    /// life left: they are, or they are renewed with themselves, or (none, or unusable) the
    /// first are asked for with the token.
    pub async fn ensure(&self) -> Result<(), EnrollError> {
        match Credentials::load(&self.dir) {
            Ok(current) if current.role() == &Role::Node(self.node.clone()) => {
                if SystemTime::now() < renewal_due(current.not_before(), current.not_after()) {
                    return Ok(());
                }
                let live = LiveCredentials::new(current);
                match self.renew(&live).await {
                    Ok(_) => Ok(()),
                    Err(e) if self.token_file.is_some() => {
                        tracing::warn!(error = %e, "renewing with the current certificate failed; asking with the token");
                        self.bootstrap().await.map(drop)
                    }
                    Err(e) => Err(e),
                }
            }
            Ok(other) => {
                tracing::warn!(dir = %self.dir.display(), role = %other.role(), node = %self.node, "the credentials are another identity's; asking for this node's");
                self.bootstrap().await.map(drop)
            }
            Err(e) => {
                tracing::info!(dir = %self.dir.display(), reason = %e, "no usable node certificate; asking the authority endpoint for one");
                self.bootstrap().await.map(drop)
            }
        }
    }

    /// Renews the certificate `live` holds at 2/3 of each certificate's life, forever (run it
    /// on a task of its own; see the module doc for failures).
    pub async fn renew_forever(self, live: LiveCredentials) {
        let current = live.current();
        let mut due = renewal_due(current.not_before(), current.not_after());
        let mut retry = FIRST_RETRY;
        loop {
            if let Ok(wait) = due.duration_since(SystemTime::now()) {
                tokio::time::sleep(wait).await;
            }
            let expired = SystemTime::now() >= live.current().not_after();
            let renewed = match (expired, &self.token_file) {
                (true, Some(_)) => self.bootstrap().await,
                _ => self.renew(&live).await,
            };
            match renewed {
                Ok(fresh) => {
                    due = renewal_due(fresh.not_before(), fresh.not_after());
                    retry = FIRST_RETRY;
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?retry, expired, "renewing this node's certificate failed");
                    due = SystemTime::now() + retry;
                    retry = (retry * 2).min(MAX_RETRY);
                }
            }
        }
    }

    /// A new certificate proven with the current one.
    async fn renew(&self, live: &LiveCredentials) -> Result<Credentials, EnrollError> {
        let client = AuthorityClient::new(&self.url, ClientIdentity::Credentials(live.clone()))?;
        self.request(&client, None).await
    }

    /// A new certificate proven with the token.
    async fn bootstrap(&self) -> Result<Credentials, EnrollError> {
        let token_file = self
            .token_file
            .as_ref()
            .ok_or_else(|| EnrollError::NoProof { node: self.node.clone(), dir: self.dir.clone() })?;
        let token = std::fs::read_to_string(token_file)
            .map_err(|source| EnrollError::Token { path: token_file.clone(), source })?;
        let anchors = Arc::new(self.initial_trust()?);
        let client = AuthorityClient::new(&self.url, ClientIdentity::Anonymous(anchors))?;
        self.request(&client, Some(token.trim().to_owned())).await
    }

    /// The CA bundle to trust before there is a certificate.
    fn initial_trust(&self) -> Result<TrustAnchors, EnrollError> {
        let path = self.ca_file.clone().unwrap_or_else(|| self.dir.join(wasmcsi_trust::secret_dir::CA_FILE));
        let pem = std::fs::read(&path).map_err(|e| EnrollError::NoTrust(format!("{}: {e}", path.display())))?;
        let certificates = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EnrollError::NoTrust(format!("{}: {e}", path.display())))?;
        TrustAnchors::new(certificates).map_err(|e| EnrollError::NoTrust(format!("{}: {e}", path.display())))
    }

    /// A key, its request, the call; the answer checked, then written.
    async fn request(&self, client: &AuthorityClient, token: Option<String>) -> Result<Credentials, EnrollError> {
        let key = pki::new_key()?;
        let csr = pki::certificate_request(&key)?;
        let answer = client
            .issue_certificate(csr.as_ref(), &self.node, token)
            .await
            .map_err(|status| EnrollError::Refused { url: self.url.clone(), status })?;
        let bad = |why: String| EnrollError::BadAnswer { url: self.url.clone(), why };
        let chain: Vec<CertificateDer<'static>> = answer.chain.into_iter().map(CertificateDer::from).collect();
        let ca: Vec<CertificateDer<'static>> = answer.ca.into_iter().map(CertificateDer::from).collect();
        let issued = Issued { chain, key: PrivatePkcs8KeyDer::from(key.serialize_der()) };
        let files = issued.files(&ca);
        let credentials = Credentials::from_files(&self.dir, &files).map_err(|e| bad(e.to_string()))?;
        if credentials.role() != &Role::Node(self.node.clone()) {
            return Err(bad(format!("the certificate is {}'s, not node {:?}'s", credentials.role(), self.node)));
        }
        wasmcsi_trust::secret_dir::write(&self.dir, &files)?;
        tracing::info!(
            dir = %self.dir.display(),
            node = %self.node,
            expires_in = credentials.seconds_to_expiry(),
            "wrote this node's new certificate"
        );
        Ok(credentials)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_is_due_at_two_thirds_of_the_life_from_issue() {
        let issued = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let due = renewal_due(issued - pki::BACKDATE, issued + Duration::from_secs(24 * 3600));
        assert_eq!(due, issued + Duration::from_secs(16 * 3600));
        // A certificate of 6 s (shorter than the backdating): due 4 s after issue, not at once.
        assert_eq!(
            renewal_due(issued - pki::BACKDATE, issued + Duration::from_secs(6)),
            issued + Duration::from_secs(4)
        );
        // A certificate that ends before it starts is due at once.
        assert!(renewal_due(issued, issued - Duration::from_secs(1)) <= issued);
    }
}
