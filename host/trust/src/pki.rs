//! The built-in CA ([`Authority`]): generating and loading it (`ca.crt`, `ca.key`), issuing node
//! and controller certificates, signing certificate requests, and writing the result as a
//! credentials directory ([`Issued::write`]).
//!
//! What every certificate issued here carries: an ECDSA P-256 key, the role's URI SAN and no
//! other name, EKU serverAuth + clientAuth (a node serves replicas and dials them as an engine;
//! the controller serves the authority endpoint and dials nodes), `CA:FALSE`, a random 128-bit
//! serial, and a validity that starts [`BACKDATE`] before issue so a peer whose clock is a little
//! behind accepts it at once. A signed request gets the same certificate: the CA takes only the
//! public key from it (its signature proving possession of the key); the role comes from the
//! caller, which has verified who asks, never from the request's own SANs.

use std::fs::{self, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, PublicKeyData, SanType,
    SerialNumber,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, CertificateSigningRequestDer, PrivatePkcs8KeyDer};
use zeroize::Zeroizing;

use crate::identity::{IdentityError, Role};
use crate::provider::provider;
use crate::secret_dir::{self, SecretDirError, SecretFiles};

/// Life of an issued node or controller certificate unless told otherwise.
pub const DEFAULT_LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// Life of a generated CA: ten years (rotating a CA is an operator's act, see the crate doc).
pub const DEFAULT_CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 3600);
/// How long before its issue a certificate becomes valid.
pub const BACKDATE: Duration = Duration::from_secs(60);
/// File names of the CA in its own directory.
pub const CA_CERT_FILE: &str = "ca.crt";
pub const CA_KEY_FILE: &str = "ca.key";

/// The longest common name written (X.520's upper bound); the name is informational, the role
/// is in the URI SAN.
const MAX_COMMON_NAME_LEN: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("{path} already exists: refusing to replace a CA (its certificates would stop verifying)")]
    CaExists { path: PathBuf },
    #[error("{path}: {what}")]
    Parse { path: PathBuf, what: String },
    #[error("{path}: no certificate in the CA bundle matches the key in {key}")]
    NoMatchingCaCertificate { path: PathBuf, key: PathBuf },
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("the certificate request is not acceptable: {0}")]
    BadRequest(String),
    #[error("the certificate request's key is {found}, expected ECDSA P-256")]
    UnsupportedKey { found: String },
    #[error("validity ends ({not_after:?}) before it starts ({not_before:?})")]
    EmptyValidity { not_before: SystemTime, not_after: SystemTime },
    #[error("generating {what}: {error}")]
    Generate { what: &'static str, error: String },
    #[error(transparent)]
    SecretDir(#[from] SecretDirError),
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl Validity {
    /// From [`BACKDATE`] ago until `life` from now.
    pub fn starting_now(life: Duration) -> Validity {
        let now = SystemTime::now();
        Validity { not_before: now - BACKDATE, not_after: now + life }
    }

    fn check(&self) -> Result<(), PkiError> {
        if self.not_after <= self.not_before {
            return Err(PkiError::EmptyValidity { not_before: self.not_before, not_after: self.not_after });
        }
        Ok(())
    }
}

/// A certificate chain (leaf first) and the PKCS#8 key it was issued for.
pub struct Issued {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivatePkcs8KeyDer<'static>,
}

impl Issued {
    /// Writes `ca.crt` (`trust`, the CA bundle the holder will trust), `tls.crt` (the chain)
    /// and `tls.key` into `dir` as one set (see [`secret_dir::write`]).
    pub fn write(&self, dir: &Path, trust: &[CertificateDer<'_>]) -> Result<(), PkiError> {
        Ok(secret_dir::write(dir, &self.files(trust))?)
    }

    /// The three files [`Self::write`] writes, in memory (to check them with
    /// [`crate::Credentials::from_files`] before they replace a working set).
    pub fn files(&self, trust: &[CertificateDer<'_>]) -> SecretFiles {
        SecretFiles {
            ca: certificates_pem(trust).into_bytes(),
            cert: certificates_pem(&self.chain).into_bytes(),
            key: Zeroizing::new(pem_block("PRIVATE KEY", self.key.secret_pkcs8_der()).into_bytes()),
        }
    }
}

/// The built-in CA: its certificate, the bundle it was loaded from and its key.
pub struct Authority {
    certificate: CertificateDer<'static>,
    bundle: Vec<CertificateDer<'static>>,
    issuer: Issuer<'static, KeyPair>,
}

impl Authority {
    /// A new CA: ECDSA P-256, `CN=wasmcsi CA <8 hex digits>`, allowed to sign leaf certificates only (path
    /// length 0).
    pub fn generate(validity: Validity) -> Result<Authority, PkiError> {
        validity.check()?;
        let key = new_key()?;
        let serial = random_serial()?;
        let mut params = CertificateParams::default();
        // Each CA its own name (a bundle holds the old and the new one while a CA is replaced,
        // and an operator tells them apart by name): the serial's first 4 bytes.
        let tag: String = serial.to_bytes().iter().take(4).map(|b| format!("{b:02x}")).collect();
        params.distinguished_name = distinguished_name(&format!("wasmcsi CA {tag}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        params.not_before = validity.not_before.into();
        params.not_after = validity.not_after.into();
        params.serial_number = Some(serial);
        let certificate = params.self_signed(&key).map_err(generate_err("the CA certificate"))?.der().clone();
        Ok(Authority { bundle: vec![certificate.clone()], certificate, issuer: Issuer::new(params, key) })
    }

    /// Loads `dir/ca.crt` and `dir/ca.key`. `ca.crt` may hold several CAs (while one replaces
    /// another); the one whose key is `ca.key` signs, the whole bundle is what issued
    /// credentials trust.
    pub fn load(dir: &Path) -> Result<Authority, PkiError> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let bundle_pem = fs::read(&cert_path).map_err(|source| PkiError::Read { path: cert_path.clone(), source })?;
        let key_pem = Zeroizing::new(
            fs::read_to_string(&key_path).map_err(|source| PkiError::Read { path: key_path.clone(), source })?,
        );
        let bundle = CertificateDer::pem_slice_iter(&bundle_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| PkiError::Parse { path: cert_path.clone(), what: e.to_string() })?;
        let key =
            KeyPair::from_pem(&key_pem).map_err(|e| PkiError::Parse { path: key_path.clone(), what: e.to_string() })?;
        let spki = key.subject_public_key_info();
        let certificate = bundle
            .iter()
            .find(|der| {
                x509_parser::parse_x509_certificate(der).is_ok_and(|(_, cert)| cert.public_key().raw == spki.as_slice())
            })
            .cloned()
            .ok_or_else(|| PkiError::NoMatchingCaCertificate { path: cert_path.clone(), key: key_path.clone() })?;
        let issuer = Issuer::from_ca_cert_der(&certificate, key)
            .map_err(|e| PkiError::Parse { path: cert_path.clone(), what: e.to_string() })?;
        Ok(Authority { certificate, bundle, issuer })
    }

    /// Writes `dir/ca.crt` (0644) and `dir/ca.key` (0600), creating `dir` (0700). Refuses to
    /// replace an existing `ca.key`: every certificate it issued would stop verifying.
    pub fn save(&self, dir: &Path) -> Result<(), PkiError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| PkiError::Write { path: dir.to_owned(), source })?;
        let key_path = dir.join(CA_KEY_FILE);
        if key_path.exists() {
            return Err(PkiError::CaExists { path: key_path });
        }
        let key_pem = Zeroizing::new(self.issuer.key().serialize_pem());
        write_new(&key_path, key_pem.as_bytes(), 0o600)?;
        let cert_path = dir.join(CA_CERT_FILE);
        let tmp = dir.join(format!("{CA_CERT_FILE}.tmp"));
        let _ = fs::remove_file(&tmp);
        write_new(&tmp, certificates_pem(&self.bundle).as_bytes(), 0o644)?;
        fs::rename(&tmp, &cert_path).map_err(|source| PkiError::Write { path: cert_path, source })
    }

    /// The CA's own certificate.
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.certificate
    }

    /// Every certificate of the CA bundle it was loaded from (its own first when generated).
    pub fn bundle(&self) -> &[CertificateDer<'static>] {
        &self.bundle
    }

    /// Issues a certificate for `role` with a new key.
    pub fn issue(&self, role: &Role, validity: Validity) -> Result<Issued, PkiError> {
        let key = new_key()?;
        let leaf = self.issue_for_key(role, &key, validity)?;
        Ok(Issued { chain: vec![leaf], key: PrivatePkcs8KeyDer::from(key.serialize_der()) })
    }

    /// Issues a certificate for `role` to the holder of `public_key` (a P-256 key).
    pub fn issue_for_key(
        &self,
        role: &Role,
        public_key: &impl PublicKeyData,
        validity: Validity,
    ) -> Result<CertificateDer<'static>, PkiError> {
        if public_key.algorithm() != &PKCS_ECDSA_P256_SHA256 {
            return Err(PkiError::UnsupportedKey { found: format!("{:?}", public_key.algorithm()) });
        }
        let params = leaf_params(role, validity)?;
        Ok(params.signed_by(public_key, &self.issuer).map_err(generate_err("the certificate"))?.der().clone())
    }

    /// Signs a certificate request (DER, PKCS#10) for `role`: the request's signature must
    /// verify (its sender holds the key); of the request only the public key is used.
    pub fn sign_request(
        &self,
        request: &[u8],
        role: &Role,
        validity: Validity,
    ) -> Result<CertificateDer<'static>, PkiError> {
        let request = CertificateSigningRequestParams::from_der(&CertificateSigningRequestDer::from(request))
            .map_err(|e| PkiError::BadRequest(e.to_string()))?;
        self.issue_for_key(role, &request.public_key, validity)
    }
}

/// A new ECDSA P-256 key.
pub fn new_key() -> Result<KeyPair, PkiError> {
    KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(generate_err("a P-256 key"))
}

/// A certificate request for `key`, to send to the authority: no subject and no SANs, since the
/// authority decides the name itself.
pub fn certificate_request(key: &KeyPair) -> Result<CertificateSigningRequestDer<'static>, PkiError> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    Ok(params.serialize_request(key).map_err(generate_err("the certificate request"))?.der().clone())
}

/// Certificates as consecutive PEM blocks.
pub fn certificates_pem(certificates: &[CertificateDer<'_>]) -> String {
    certificates.iter().map(|c| pem_block("CERTIFICATE", c)).collect()
}

fn pem_block(tag: &str, der: &[u8]) -> String {
    pem::encode_config(&pem::Pem::new(tag, der), pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF))
}

fn leaf_params(role: &Role, validity: Validity) -> Result<CertificateParams, PkiError> {
    role.check()?;
    validity.check()?;
    let uri = rcgen::string::Ia5String::try_from(role.uri())
        .map_err(|e| PkiError::Generate { what: "the URI SAN", error: e.to_string() })?;
    let mut params = CertificateParams::default();
    params.distinguished_name = distinguished_name(&common_name(role));
    params.subject_alt_names = vec![SanType::URI(uri)];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.not_before = validity.not_before.into();
    params.not_after = validity.not_after.into();
    params.serial_number = Some(random_serial()?);
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

/// `wasmcsi controller` or `wasmcsi node NAME`, cut to [`MAX_COMMON_NAME_LEN`] bytes.
fn common_name(role: &Role) -> String {
    let mut name = match role {
        Role::Controller => "wasmcsi controller".to_owned(),
        Role::Node(id) => format!("wasmcsi node {id}"),
    };
    if name.len() > MAX_COMMON_NAME_LEN {
        let mut cut = MAX_COMMON_NAME_LEN;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
    }
    name
}

fn distinguished_name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "wasmcsi");
    dn.push(DnType::CommonName, common_name);
    dn
}

/// 128 random bits, the top one clear so the DER integer stays positive.
fn random_serial() -> Result<SerialNumber, PkiError> {
    let mut bytes = [0u8; 16];
    provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|e| PkiError::Generate { what: "a serial number", error: format!("{e:?}") })?;
    bytes[0] &= 0x7f;
    Ok(SerialNumber::from_slice(&bytes))
}

fn generate_err(what: &'static str) -> impl Fn(rcgen::Error) -> PkiError {
    move |e| PkiError::Generate { what, error: e.to_string() }
}

fn write_new(path: &Path, contents: &[u8], mode: u32) -> Result<(), PkiError> {
    let err = |source| PkiError::Write { path: path.to_owned(), source };
    let mut f = OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(err)?;
    f.write_all(contents).map_err(err)?;
    f.sync_all().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verifier::{TrustAnchors, Usage};
    use rustls::pki_types::UnixTime;
    use x509_parser::extensions::{GeneralName, ParsedExtension};

    fn ca() -> Authority {
        Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA")
    }

    fn anchors(ca: &Authority) -> TrustAnchors {
        TrustAnchors::new(vec![ca.certificate().clone()]).expect("anchors")
    }

    #[test]
    fn an_issued_node_certificate_verifies_for_both_ends_and_names_its_node() {
        let ca = ca();
        let issued =
            ca.issue(&Role::Node("worker-1".into()), Validity::starting_now(DEFAULT_LEAF_VALIDITY)).expect("issue");
        let leaf = &issued.chain[0];
        let now = UnixTime::now();
        for usage in [Usage::Server, Usage::Client] {
            assert_eq!(anchors(&ca).verify(leaf, &[], now, usage).expect("verifies"), Role::Node("worker-1".into()));
        }
        let (_, cert) = x509_parser::parse_x509_certificate(leaf).expect("parses");
        let basic = cert.basic_constraints().expect("one extension").expect("present");
        assert!(!basic.value.ca);
        let life = cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp();
        assert_eq!(life, (DEFAULT_LEAF_VALIDITY + BACKDATE).as_secs() as i64);
    }

    #[test]
    fn a_signed_request_gets_the_callers_role_never_its_own_sans() {
        let ca = ca();
        let key = new_key().expect("key");
        // A request asking for the controller's identity and a DNS name.
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![
            SanType::URI(rcgen::string::Ia5String::try_from(Role::Controller.uri()).expect("uri")),
            SanType::DnsName("evil.example".try_into().expect("dns")),
        ];
        let request = params.serialize_request(&key).expect("csr");
        let leaf = ca
            .sign_request(request.der(), &Role::Node("n1".into()), Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .expect("signed");
        assert_eq!(Role::of_certificate(&leaf), Ok(Role::Node("n1".into())));
        let (_, cert) = x509_parser::parse_x509_certificate(&leaf).expect("parses");
        let names: Vec<String> = cert
            .extensions()
            .iter()
            .filter_map(|e| match e.parsed_extension() {
                ParsedExtension::SubjectAlternativeName(san) => Some(san.general_names.iter()),
                _ => None,
            })
            .flatten()
            .map(|n| match n {
                GeneralName::URI(u) => (*u).to_owned(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(names, vec!["spiffe://wasmcsi/node/n1".to_owned()]);
        assert_eq!(cert.public_key().raw, key.subject_public_key_info().as_slice());
    }

    #[test]
    fn a_request_with_a_broken_signature_is_refused() {
        let ca = ca();
        let key = new_key().expect("key");
        let mut request = certificate_request(&key).expect("csr").as_ref().to_vec();
        let last = request.len() - 1;
        request[last] ^= 0x01;
        let err = ca.sign_request(&request, &Role::Node("n1".into()), Validity::starting_now(DEFAULT_LEAF_VALIDITY));
        assert!(matches!(err, Err(PkiError::BadRequest(_))), "{:?}", err.err());
    }

    #[test]
    fn a_request_for_another_key_type_is_refused() {
        let ca = ca();
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("ed25519 key");
        let request = certificate_request(&key).expect("csr");
        let err = ca.sign_request(&request, &Role::Controller, Validity::starting_now(DEFAULT_LEAF_VALIDITY));
        assert!(matches!(err, Err(PkiError::UnsupportedKey { .. })), "{:?}", err.err());
    }

    #[test]
    fn invalid_roles_and_empty_validity_issue_nothing() {
        let ca = ca();
        let life = Validity::starting_now(DEFAULT_LEAF_VALIDITY);
        assert!(matches!(ca.issue(&Role::Node(String::new()), life), Err(PkiError::Identity(_))));
        let now = SystemTime::now();
        let empty = Validity { not_before: now, not_after: now };
        assert!(matches!(ca.issue(&Role::Controller, empty), Err(PkiError::EmptyValidity { .. })));
    }

    #[test]
    fn a_saved_ca_loads_back_and_keeps_issuing_verifiable_certificates() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let original = ca();
        original.save(tmp.path()).expect("save");
        let loaded = Authority::load(tmp.path()).expect("load");
        assert_eq!(loaded.certificate(), original.certificate());
        let issued = loaded.issue(&Role::Controller, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).expect("issue");
        let role = anchors(&original).verify(&issued.chain[0], &[], UnixTime::now(), Usage::Client).expect("verifies");
        assert_eq!(role, Role::Controller);
        // A second save would orphan every certificate the first CA issued.
        assert!(matches!(ca().save(tmp.path()), Err(PkiError::CaExists { .. })));
    }

    #[test]
    fn loading_picks_the_bundle_certificate_that_matches_the_key() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let old = ca();
        let new = ca();
        new.save(tmp.path()).expect("save");
        // The bundle of a CA rotation: the old CA first, the signing one second.
        fs::write(
            tmp.path().join(CA_CERT_FILE),
            certificates_pem(&[old.certificate().clone(), new.certificate().clone()]),
        )
        .expect("bundle");
        let loaded = Authority::load(tmp.path()).expect("load");
        assert_eq!(loaded.certificate(), new.certificate());
        assert_eq!(loaded.bundle().len(), 2);
    }

    #[test]
    fn a_key_without_its_certificate_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        ca().save(tmp.path()).expect("save");
        fs::write(tmp.path().join(CA_CERT_FILE), certificates_pem(&[ca().certificate().clone()])).expect("other CA");
        assert!(matches!(Authority::load(tmp.path()), Err(PkiError::NoMatchingCaCertificate { .. })));
    }

    #[test]
    fn long_node_names_are_cut_in_the_common_name_only() {
        let id = "ü".repeat(100);
        let cn = common_name(&Role::Node(id));
        assert!(cn.len() <= MAX_COMMON_NAME_LEN && cn.starts_with("wasmcsi node ü"));
    }
}
