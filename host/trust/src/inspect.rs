//! What a credentials directory holds, each fact found on its own ([`inspect`]): the role, the
//! validity, the issuer, whether the key matches the certificate and whether the chain verifies
//! to the CA bundle. [`crate::Credentials::load`] refuses a set at its first fault; an operator
//! looking at a set (`wasmcsi pki show`) wants every fault at once, and the facts of a set that
//! loads.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::sign::CertifiedKey;

use crate::identity::Role;
use crate::provider::provider;
use crate::secret_dir::{self, SecretDirError};
use crate::verifier::{TrustAnchors, Usage};

/// The facts of one credentials directory. A fact that could not be found says why.
#[derive(Debug)]
pub struct Inspection {
    /// The leaf's wasmcsi role.
    pub role: Result<Role, String>,
    /// The leaf's subject and issuer, as X.500 names.
    pub subject: String,
    pub issuer: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// Certificates in `tls.crt` (leaf first).
    pub chain_len: usize,
    /// Subjects of the CA bundle's certificates.
    pub anchors: Vec<String>,
    /// Whether `tls.key` is the leaf's key.
    pub key: Result<(), String>,
    /// Whether the chain verifies to the bundle now, for both ends of a connection.
    pub trusted: Result<(), String>,
}

impl Inspection {
    /// Whether the set would load and serve now.
    pub fn usable(&self) -> bool {
        self.role.is_ok() && self.key.is_ok() && self.trusted.is_ok()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error(transparent)]
    Files(#[from] SecretDirError),
    #[error("{file}: {what}")]
    Unreadable { file: &'static str, what: String },
}

/// Reads `dir` and finds each fact of [`Inspection`]; fails only when there is no certificate to
/// look at (a file missing or not PEM).
pub fn inspect(dir: &Path) -> Result<Inspection, InspectError> {
    let files = secret_dir::read(dir)?;
    let certificates = |file: &'static str, pem: &[u8]| -> Result<Vec<CertificateDer<'static>>, InspectError> {
        let parsed = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| InspectError::Unreadable { file, what: e.to_string() })?;
        if parsed.is_empty() {
            return Err(InspectError::Unreadable { file, what: "no certificate in it".into() });
        }
        Ok(parsed)
    };
    let chain = certificates(secret_dir::CERT_FILE, &files.cert)?;
    let bundle = certificates(secret_dir::CA_FILE, &files.ca)?;
    let leaf = &chain[0];
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| InspectError::Unreadable { file: secret_dir::CERT_FILE, what: e.to_string() })?;
    let time = |t: &x509_parser::time::ASN1Time| UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64);
    let anchors = bundle
        .iter()
        .map(|der| match x509_parser::parse_x509_certificate(der) {
            Ok((_, ca)) => ca.subject().to_string(),
            Err(e) => format!("(unparsable: {e})"),
        })
        .collect();

    let key = PrivateKeyDer::from_pem_slice(&files.key)
        .map_err(|e| e.to_string())
        .and_then(|key| provider().key_provider.load_private_key(key).map_err(|e| e.to_string()))
        .and_then(|key| {
            CertifiedKey::new(chain.clone(), key)
                .keys_match()
                .map_err(|_| "tls.key is not the key of the certificate in tls.crt".to_owned())
        });
    let trusted = TrustAnchors::new(bundle).map_err(|e| e.to_string()).and_then(|anchors| {
        [Usage::Server, Usage::Client]
            .into_iter()
            .try_for_each(|usage| anchors.verify_chain(leaf, &chain[1..], UnixTime::now(), usage))
            .map_err(|e| format!("the chain does not verify to ca.crt: {e}"))
    });
    Ok(Inspection {
        role: Role::of_certificate(leaf).map_err(|e| e.to_string()),
        subject: parsed.subject().to_string(),
        issuer: parsed.issuer().to_string(),
        not_before: time(&parsed.validity().not_before),
        not_after: time(&parsed.validity().not_after),
        chain_len: chain.len(),
        anchors,
        key,
        trusted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Authority, DEFAULT_CA_VALIDITY, Validity};

    fn issue(ca: &Authority, role: &Role, dir: &Path, life: Duration) {
        ca.issue(role, Validity::starting_now(life))
            .expect("issue")
            .write(dir, &[ca.certificate().clone()])
            .expect("write");
    }

    #[test]
    fn a_good_set_shows_its_role_validity_and_issuer() {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let dir = tempfile::tempdir().expect("tempdir");
        issue(&ca, &Role::Node("n1".into()), dir.path(), Duration::from_secs(3600));
        let found = inspect(dir.path()).expect("inspect");
        assert!(found.usable(), "{found:?}");
        assert_eq!(found.role, Ok(Role::Node("n1".into())));
        assert!(found.issuer.contains("wasmcsi CA"), "{}", found.issuer);
        assert_eq!(found.anchors.len(), 1);
        let left = found.not_after.duration_since(SystemTime::now()).expect("not expired");
        assert!(left <= Duration::from_secs(3600) && left > Duration::from_secs(3500), "{left:?}");
    }

    #[test]
    fn a_wrong_key_and_a_foreign_ca_are_both_reported() {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let other = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let dir = tempfile::tempdir().expect("tempdir");
        let stray = tempfile::tempdir().expect("tempdir");
        issue(&ca, &Role::Controller, dir.path(), Duration::from_secs(3600));
        issue(&other, &Role::Controller, stray.path(), Duration::from_secs(3600));
        let mut files = secret_dir::read(dir.path()).expect("read");
        let foreign = secret_dir::read(stray.path()).expect("read");
        files.key = foreign.key;
        files.ca = foreign.ca;
        secret_dir::write(dir.path(), &files).expect("write");
        let found = inspect(dir.path()).expect("inspect");
        assert_eq!(found.role, Ok(Role::Controller));
        assert!(found.key.as_ref().is_err_and(|e| e.contains("not the key")), "{:?}", found.key);
        assert!(found.trusted.as_ref().is_err_and(|e| e.contains("UnknownIssuer")), "{:?}", found.trusted);
        assert!(!found.usable());
    }
}
