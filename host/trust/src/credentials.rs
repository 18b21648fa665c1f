//! A loaded credentials directory ([`Credentials`]) and the rustls configs built from it.
//!
//! Loading checks everything a peer would, so a set that loads is a set that works: `ca.crt`
//! holds one or more CA certificates (all trusted); `tls.crt` holds the leaf first, then any
//! intermediates; `tls.key` is the leaf's key (PKCS#8, or SEC1 `EC PRIVATE KEY` as cert-manager
//! writes by default) and must match it; the chain verifies to the bundle now, with both EKUs
//! (serverAuth and clientAuth); the leaf names exactly one wasmcsi role.
//!
//! Server configs require a client certificate and verify it with [`PeerVerifier`]; client
//! configs present ours and verify the server with the [`ExpectedRole`] the caller names. Both:
//! TLS 1.3 only, AES-128-GCM preferred, no resumption, no early data (see [`crate::provider`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::NoServerSessionStorage;
use rustls::sign::{CertifiedKey, SigningKey, SingleCertAndKey};
use rustls::{ClientConfig, InconsistentKeys, ServerConfig};

use crate::identity::Role;
use crate::provider::{PROTOCOL_VERSIONS, provider};
use crate::secret_dir::{self, CA_FILE, CERT_FILE, KEY_FILE, SecretDirError, SecretFiles};
use crate::verifier::{ExpectedRole, PeerVerifier, TrustAnchors, Usage, VerifyError};

/// The server name a client config sends (it sends no SNI; the name is never checked: peers
/// are named by role).
pub const SERVER_NAME: &str = "wasmcsi.invalid";

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error(transparent)]
    Files(#[from] SecretDirError),
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("{path}: no certificate in it")]
    NoCertificate { path: PathBuf },
    #[error("{path}: {error}")]
    Anchors { path: PathBuf, error: VerifyError },
    #[error("{path}: the key is not usable: {error}")]
    Key { path: PathBuf, error: rustls::Error },
    #[error("{key} does not match the certificate in {cert}")]
    KeyMismatch { key: PathBuf, cert: PathBuf },
    #[error("{path}: the certificate is not valid for wasmcsi ({usage:?} use): {error}")]
    Leaf { path: PathBuf, usage: Usage, error: VerifyError },
    #[error("{path}: the certificate's validity does not parse: {what}")]
    Validity { path: PathBuf, what: String },
    #[error("building the TLS config: {0}")]
    Config(rustls::Error),
}

/// One loaded, checked credentials set.
pub struct Credentials {
    dir: PathBuf,
    anchors: Arc<TrustAnchors>,
    certified: Arc<CertifiedKey>,
    role: Role,
    not_before: SystemTime,
    not_after: SystemTime,
    hash: [u8; 32],
    server_config: Arc<ServerConfig>,
    client_optional_config: Arc<ServerConfig>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("dir", &self.dir)
            .field("role", &self.role)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// Loads and checks `dir` (see the module doc).
    pub fn load(dir: &Path) -> Result<Credentials, CredentialsError> {
        let files = secret_dir::read(dir)?;
        Credentials::from_files(dir, &files)
    }

    /// Checks a set already read from `dir` (the reloader reads, hashes, then builds), or about
    /// to be written there (a renewal checks what it got before it replaces what works).
    pub fn from_files(dir: &Path, files: &SecretFiles) -> Result<Credentials, CredentialsError> {
        let ca_path = dir.join(CA_FILE);
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);

        let ca = read_certificates(&ca_path, &files.ca)?;
        let anchors = Arc::new(
            TrustAnchors::new(ca).map_err(|error| CredentialsError::Anchors { path: ca_path.clone(), error })?,
        );
        let chain = read_certificates(&cert_path, &files.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&files.key)
            .map_err(|e| CredentialsError::Pem { path: key_path.clone(), what: e.to_string() })?;
        let signing_key = provider()
            .key_provider
            .load_private_key(key)
            .map_err(|error| CredentialsError::Key { path: key_path.clone(), error })?;
        let certified = CertifiedKey::new(chain, signing_key);
        match certified.keys_match() {
            Ok(()) => {}
            // The ring provider always knows a key's public half; "unknown" would be a key this
            // check cannot vouch for, so it is refused like a mismatch.
            Err(rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch | InconsistentKeys::Unknown)) => {
                return Err(CredentialsError::KeyMismatch { key: key_path, cert: cert_path });
            }
            Err(error) => return Err(CredentialsError::Key { path: key_path, error }),
        }
        let (leaf, intermediates) = match certified.cert.split_first() {
            Some(split) => split,
            None => return Err(CredentialsError::NoCertificate { path: cert_path }),
        };
        let now = UnixTime::now();
        let mut role = None;
        for usage in [Usage::Server, Usage::Client] {
            let r = anchors.verify(leaf, intermediates, now, usage).map_err(|error| CredentialsError::Leaf {
                path: cert_path.clone(),
                usage,
                error,
            })?;
            role = Some(r);
        }
        let role = role.ok_or(CredentialsError::NoCertificate { path: cert_path.clone() })?;
        let (not_before, not_after) =
            validity(leaf).map_err(|what| CredentialsError::Validity { path: cert_path.clone(), what })?;
        let certified = Arc::new(certified);
        let server_config = build_server_config(&anchors, &certified, ExpectedRole::Any)?;
        let client_optional_config =
            build_server_config_with(PeerVerifier::client_optional(anchors.clone(), ExpectedRole::Any), &certified)?;
        Ok(Credentials {
            dir: dir.to_owned(),
            anchors,
            certified,
            role,
            not_before,
            not_after,
            hash: files.hash(),
            server_config,
            client_optional_config,
        })
    }

    /// The directory this set was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Our own role, from our leaf certificate.
    pub fn role(&self) -> &Role {
        &self.role
    }

    /// When our leaf certificate became valid.
    pub fn not_before(&self) -> SystemTime {
        self.not_before
    }

    /// When our leaf certificate expires.
    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }

    /// Seconds until our leaf certificate expires (negative once it has).
    pub fn seconds_to_expiry(&self) -> i64 {
        match self.not_after.duration_since(SystemTime::now()) {
            Ok(left) => i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
            Err(past) => -i64::try_from(past.duration().as_secs()).unwrap_or(i64::MAX),
        }
    }

    /// The CA bundle.
    pub fn anchors(&self) -> &Arc<TrustAnchors> {
        &self.anchors
    }

    /// Our chain, leaf first.
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.certified.cert
    }

    /// Our key, as the crypto provider loaded it (to sign grants with).
    pub fn signing_key(&self) -> &Arc<dyn SigningKey> {
        &self.certified.key
    }

    /// SHA-256 of the three files this set was built from.
    pub(crate) fn hash(&self) -> [u8; 32] {
        self.hash
    }

    /// The server config: clients of any wasmcsi role; the caller authorizes by the role the
    /// handshake yields.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server_config.clone()
    }

    /// A server config that admits only `clients` (the peer endpoint: the controller).
    pub fn server_config_for(&self, clients: ExpectedRole) -> Result<Arc<ServerConfig>, CredentialsError> {
        build_server_config(&self.anchors, &self.certified, clients)
    }

    /// A server config that admits clients of any wasmcsi role *and* clients with no certificate
    /// at all (see [`PeerVerifier::client_optional`]); the caller authorizes each call by the
    /// role the handshake yields, or by the proof the call carries when there is none.
    pub fn server_config_client_optional(&self) -> Arc<ServerConfig> {
        self.client_optional_config.clone()
    }

    /// A client config that presents our certificate and accepts only a server of role
    /// `server`.
    pub fn client_config(&self, server: ExpectedRole) -> Result<Arc<ClientConfig>, CredentialsError> {
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(PROTOCOL_VERSIONS)
            .map_err(CredentialsError::Config)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerVerifier::new(self.anchors.clone(), server)))
            .with_client_cert_resolver(Arc::new(SingleCertAndKey::from(self.certified.clone())));
        config.resumption = Resumption::disabled();
        config.enable_sni = false;
        Ok(Arc::new(config))
    }
}

/// A client config that presents no certificate and accepts only a server of role `server`,
/// verified against `anchors`: a node that has no certificate yet, asking the authority endpoint
/// for its first.
pub fn anonymous_client_config(
    anchors: Arc<TrustAnchors>,
    server: ExpectedRole,
) -> Result<Arc<ClientConfig>, CredentialsError> {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .map_err(CredentialsError::Config)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PeerVerifier::new(anchors, server)))
        .with_no_client_auth();
    config.resumption = Resumption::disabled();
    config.enable_sni = false;
    Ok(Arc::new(config))
}

/// The name to pass where rustls asks for the server's name (see [`SERVER_NAME`]).
pub fn server_name() -> ServerName<'static> {
    ServerName::DnsName(rustls::pki_types::DnsName::try_from(SERVER_NAME).expect("SERVER_NAME is a valid DNS name"))
}

fn build_server_config(
    anchors: &Arc<TrustAnchors>,
    certified: &Arc<CertifiedKey>,
    clients: ExpectedRole,
) -> Result<Arc<ServerConfig>, CredentialsError> {
    build_server_config_with(PeerVerifier::new(anchors.clone(), clients), certified)
}

fn build_server_config_with(
    verifier: PeerVerifier,
    certified: &Arc<CertifiedKey>,
) -> Result<Arc<ServerConfig>, CredentialsError> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .map_err(CredentialsError::Config)?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_cert_resolver(Arc::new(SingleCertAndKey::from(certified.clone())));
    config.ignore_client_order = true;
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

fn read_certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, CredentialsError> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CredentialsError::Pem { path: path.to_owned(), what: e.to_string() })?;
    if certificates.is_empty() {
        return Err(CredentialsError::NoCertificate { path: path.to_owned() });
    }
    Ok(certificates)
}

/// The leaf's notBefore and notAfter.
fn validity(leaf: &CertificateDer<'_>) -> Result<(SystemTime, SystemTime), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf).map_err(|e| e.to_string())?;
    let at = |t: &x509_parser::time::ASN1Time, what: &str| {
        let secs = t.timestamp();
        let secs = u64::try_from(secs).map_err(|_| format!("{what} {secs} is before 1970"))?;
        Ok::<_, String>(UNIX_EPOCH + Duration::from_secs(secs))
    };
    Ok((at(&cert.validity().not_before, "notBefore")?, at(&cert.validity().not_after, "notAfter")?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity, certificates_pem};
    use std::fs;

    fn issue(ca: &Authority, role: &Role, dir: &Path) {
        ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .expect("issue")
            .write(dir, &[ca.certificate().clone()])
            .expect("write");
    }

    fn ca() -> Authority {
        Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA")
    }

    #[test]
    fn an_issued_set_loads_with_its_role_and_expiry() {
        let tmp = tempfile::tempdir().expect("tempdir");
        issue(&ca(), &Role::Node("n1".into()), tmp.path());
        let creds = Credentials::load(tmp.path()).expect("load");
        assert_eq!(creds.role(), &Role::Node("n1".into()));
        let left = creds.seconds_to_expiry();
        assert!((DEFAULT_LEAF_VALIDITY.as_secs() as i64 - 5..=DEFAULT_LEAF_VALIDITY.as_secs() as i64).contains(&left));
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let other = tempfile::tempdir().expect("tempdir");
        let ca = ca();
        issue(&ca, &Role::Node("n1".into()), tmp.path());
        issue(&ca, &Role::Node("n1".into()), other.path());
        let key = fs::read(other.path().join(KEY_FILE)).expect("key");
        let mut files = secret_dir::read(tmp.path()).expect("read");
        files.key = zeroize::Zeroizing::new(key);
        let err = Credentials::from_files(tmp.path(), &files).expect_err("mismatch");
        assert!(matches!(err, CredentialsError::KeyMismatch { .. }), "{err}");
        assert!(err.to_string().contains("tls.key"), "{err}");
    }

    #[test]
    fn a_leaf_of_another_ca_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        issue(&ca(), &Role::Controller, tmp.path());
        let mut files = secret_dir::read(tmp.path()).expect("read");
        files.ca = certificates_pem(&[ca().certificate().clone()]).into_bytes();
        let err = Credentials::from_files(tmp.path(), &files).expect_err("untrusted");
        assert!(
            matches!(err, CredentialsError::Leaf { error: VerifyError::Chain(webpki::Error::UnknownIssuer), .. }),
            "{err}"
        );
    }

    #[test]
    fn a_bundle_of_two_cas_trusts_leaves_of_either() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let old = ca();
        let new = ca();
        issue(&old, &Role::Controller, tmp.path());
        let mut files = secret_dir::read(tmp.path()).expect("read");
        files.ca = certificates_pem(&[new.certificate().clone(), old.certificate().clone()]).into_bytes();
        let creds = Credentials::from_files(tmp.path(), &files).expect("either CA");
        assert_eq!(creds.anchors().certificates().len(), 2);
    }

    #[test]
    fn an_expired_leaf_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let ca = ca();
        let now = SystemTime::now();
        let past = Validity { not_before: now - Duration::from_secs(7200), not_after: now - Duration::from_secs(3600) };
        ca.issue(&Role::Controller, past)
            .expect("issue")
            .write(tmp.path(), &[ca.certificate().clone()])
            .expect("write");
        let err = Credentials::load(tmp.path()).expect_err("expired");
        assert!(
            matches!(err, CredentialsError::Leaf { error: VerifyError::Chain(webpki::Error::CertExpired { .. }), .. }),
            "{err}"
        );
    }

    #[test]
    fn empty_and_garbage_files_are_named() {
        let tmp = tempfile::tempdir().expect("tempdir");
        issue(&ca(), &Role::Controller, tmp.path());
        let good = secret_dir::read(tmp.path()).expect("read");
        let mut files = secret_dir::read(tmp.path()).expect("read");
        files.cert = Vec::new();
        let err = Credentials::from_files(tmp.path(), &files).expect_err("no cert");
        assert!(matches!(&err, CredentialsError::NoCertificate { path } if path.ends_with("tls.crt")), "{err}");
        let mut files = secret_dir::read(tmp.path()).expect("read");
        files.key = zeroize::Zeroizing::new(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".to_vec());
        let err = Credentials::from_files(tmp.path(), &files).expect_err("bad key");
        assert!(err.to_string().contains("tls.key"), "{err}");
        assert!(Credentials::from_files(tmp.path(), &good).is_ok());
    }

    #[test]
    fn a_sec1_key_as_cert_manager_writes_it_loads() {
        let tmp = tempfile::tempdir().expect("tempdir");
        issue(&ca(), &Role::Controller, tmp.path());
        let mut files = secret_dir::read(tmp.path()).expect("read");
        let pkcs8 = rustls::pki_types::PrivatePkcs8KeyDer::from_pem_slice(&files.key).expect("pkcs8");
        let sec1 = sec1_from_pkcs8(pkcs8.secret_pkcs8_der());
        files.key = zeroize::Zeroizing::new(pem::encode(&pem::Pem::new("EC PRIVATE KEY", sec1)).into_bytes());
        Credentials::from_files(tmp.path(), &files).expect("SEC1 key loads");
    }

    /// The SEC1 `ECPrivateKey` inside a PKCS#8 P-256 key as ring writes it (test-only DER
    /// walking over a fixed layout): SEQUENCE (3 bytes) { INTEGER 0 (3), SEQUENCE { ecPublicKey,
    /// prime256v1 } (21), OCTET STRING (2 + 0x6d) { ECPrivateKey } }.
    fn sec1_from_pkcs8(pkcs8: &[u8]) -> Vec<u8> {
        assert_eq!(&pkcs8[27..29], &[0x04, 0x6d], "ring's PKCS#8 layout for P-256");
        pkcs8[29..29 + 0x6d].to_vec()
    }
}
