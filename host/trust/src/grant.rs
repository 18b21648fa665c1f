//! Controller-signed grants: "node N may open sessions of volume V at epoch ≥ E, from T1 to T2".
//!
//! A grant is signed with the controller's certificate key and carries the controller's
//! certificate chain, so a replica server verifies it against the CA bundle alone ([`verify`]):
//! the chain is valid now, its leaf is the controller's, the signature verifies, and now lies
//! within `[not_before - SKEW, not_after + SKEW]`. What a verified grant allows (the peer's node,
//! the volume, the epoch) is the replica server's decision.
//!
//! [`Grant::sign`] never signs past the signing certificate's own expiry: a grant must stay
//! verifiable for its whole life, and the chain is checked at verification time. A grant holder
//! renews at half of what it was given, which is therefore always before the signer expires.
//!
//! Encoding (all integers big-endian; at most [`MAX_ENCODED_LEN`] bytes in all):
//!
//! ```text
//! magic    "WCSIGRT1"                              8 bytes
//! body     u16 length, then:                       signed (after the domain prefix)
//!            u16 length + volume (UTF-8)
//!            u16 length + node id (UTF-8)
//!            u64 epoch, u64 not_before, u64 not_after (Unix seconds)
//! scheme   u16 (TLS SignatureScheme)
//! sig      u16 length + signature
//! chain    u8 count (1..=4), then u16 length + DER per certificate, leaf first
//! ```
//!
//! The signature covers [`SIGNING_DOMAIN`] followed by the body bytes exactly as sent, so a
//! signature made for anything else with the same key (a TLS CertificateVerify starts with 64
//! spaces) can never pass for a grant, nor a grant for anything else.
//!
//! Where a node gets its grants (the authority endpoint, or this process's own controller
//! credentials) is [`source`].

pub mod source;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::SignatureScheme;
use rustls::pki_types::{CertificateDer, SignatureVerificationAlgorithm, UnixTime};
use webpki::EndEntityCert;

use crate::credentials::Credentials;
use crate::identity::{MAX_NODE_ID_LEN, Role};
use crate::verifier::{TrustAnchors, Usage};

/// First bytes of every encoded grant (format version 1).
pub const MAGIC: &[u8; 8] = b"WCSIGRT1";
/// What the signature covers before the body.
pub const SIGNING_DOMAIN: &[u8] = b"wasmcsi grant v1\0";
/// The largest encoded grant accepted or produced.
pub const MAX_ENCODED_LEN: usize = 8 * 1024;
/// Clock skew tolerated at both ends of a grant's validity.
pub const SKEW: Duration = Duration::from_secs(30);
/// Life of a grant unless told otherwise.
pub const DEFAULT_LIFE: Duration = Duration::from_secs(24 * 3600);
/// The longest volume (replica set) id.
pub const MAX_VOLUME_LEN: usize = 256;
/// Most certificates in a grant's chain (leaf and intermediates).
pub const MAX_CHAIN_LEN: usize = 4;

/// Schemes a grant is signed with, in order of preference.
const SIGNING_SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
];

/// What a grant allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The replica set id.
    pub volume: String,
    /// The node id the grant is for.
    pub node: String,
    /// The lowest replica epoch the grant opens sessions at.
    pub epoch: u64,
    /// Whole seconds: sub-second parts are dropped when signed.
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("the grant is {len} bytes, more than {MAX_ENCODED_LEN}")]
    TooLarge { len: usize },
    #[error("the grant is malformed: {0}")]
    Malformed(&'static str),
    #[error("the grant's signer chain does not verify against the wasmcsi CA: {0}")]
    UntrustedChain(webpki::Error),
    #[error("the grant is signed by {signer}, not the controller")]
    WrongSigner { signer: String },
    #[error("the grant's signature does not verify")]
    BadSignature,
    #[error("the grant is signed with scheme {0:#06x}, which is not accepted")]
    UnsupportedScheme(u16),
    #[error("the grant is not valid before {not_before:?} (now {now:?}, skew {SKEW:?})")]
    NotYetValid { not_before: SystemTime, now: SystemTime },
    #[error("the grant expired at {not_after:?} (now {now:?}, skew {SKEW:?})")]
    Expired { not_after: SystemTime, now: SystemTime },
    #[error("cannot sign: {0}")]
    Sign(String),
}

/// A grant as signed (validity clamped and truncated) and its encoding.
#[derive(Clone, Debug)]
pub struct SignedGrant {
    pub grant: Grant,
    pub encoded: Vec<u8>,
}

impl Grant {
    /// A grant valid from [`SKEW`] ago for `life`.
    pub fn starting_now(volume: impl Into<String>, node: impl Into<String>, epoch: u64, life: Duration) -> Grant {
        let now = SystemTime::now();
        Grant { volume: volume.into(), node: node.into(), epoch, not_before: now - SKEW, not_after: now + life }
    }

    /// Signs with the controller's credentials. The validity is cut to whole seconds and never
    /// outlasts the signing certificate.
    pub fn sign(&self, signer: &Credentials) -> Result<SignedGrant, GrantError> {
        if signer.role() != &Role::Controller {
            return Err(GrantError::Sign(format!(
                "the credentials are {}'s, only the controller signs grants",
                signer.role()
            )));
        }
        let mut grant = self.clone();
        grant.not_after = grant.not_after.min(signer.not_after());
        let not_before = unix_secs(grant.not_before)?;
        let not_after = unix_secs(grant.not_after)?;
        if not_after < not_before {
            return Err(GrantError::Sign("the grant would end before it starts".into()));
        }
        grant.not_before = UNIX_EPOCH + Duration::from_secs(not_before);
        grant.not_after = UNIX_EPOCH + Duration::from_secs(not_after);
        if grant.volume.is_empty() || grant.volume.len() > MAX_VOLUME_LEN {
            return Err(GrantError::Sign(format!("the volume id must be 1..={MAX_VOLUME_LEN} bytes")));
        }
        Role::node(grant.node.as_str()).map_err(|e| GrantError::Sign(e.to_string()))?;

        let mut body = Vec::with_capacity(64 + grant.volume.len() + grant.node.len());
        put_str(&mut body, &grant.volume);
        put_str(&mut body, &grant.node);
        body.extend_from_slice(&grant.epoch.to_be_bytes());
        body.extend_from_slice(&not_before.to_be_bytes());
        body.extend_from_slice(&not_after.to_be_bytes());

        let signer_key = signer.signing_key().choose_scheme(SIGNING_SCHEMES).ok_or_else(|| {
            GrantError::Sign(format!("the key ({:?}) fits no grant scheme", signer.signing_key().algorithm()))
        })?;
        let signature = signer_key.sign(&signed_message(&body)).map_err(|e| GrantError::Sign(e.to_string()))?;

        let chain = signer.chain();
        if chain.len() > MAX_CHAIN_LEN {
            return Err(GrantError::Sign(format!(
                "the signer's chain has {} certificates, at most {MAX_CHAIN_LEN} fit",
                chain.len()
            )));
        }
        let mut encoded = Vec::with_capacity(MAX_ENCODED_LEN / 4);
        encoded.extend_from_slice(MAGIC);
        put_bytes(&mut encoded, &body)?;
        encoded.extend_from_slice(&u16::from(signer_key.scheme()).to_be_bytes());
        put_bytes(&mut encoded, &signature)?;
        encoded.push(chain.len() as u8);
        for der in chain {
            put_bytes(&mut encoded, der)?;
        }
        if encoded.len() > MAX_ENCODED_LEN {
            return Err(GrantError::Sign(format!(
                "the grant would be {} bytes, more than {MAX_ENCODED_LEN}",
                encoded.len()
            )));
        }
        Ok(SignedGrant { grant, encoded })
    }
}

/// Verifies an encoded grant against the CA bundle at `now` and returns what it grants.
pub fn verify(encoded: &[u8], anchors: &TrustAnchors, now: SystemTime) -> Result<Grant, GrantError> {
    if encoded.len() > MAX_ENCODED_LEN {
        return Err(GrantError::TooLarge { len: encoded.len() });
    }
    let wire = Wire::decode(encoded)?;
    let grant = wire.grant()?;

    let (leaf, intermediates) = wire.chain.split_first().ok_or(GrantError::Malformed("no signer certificate"))?;
    let unix_now = UnixTime::since_unix_epoch(now.duration_since(UNIX_EPOCH).unwrap_or_default());
    anchors.verify_chain(leaf, intermediates, unix_now, Usage::Client).map_err(GrantError::UntrustedChain)?;
    match Role::of_certificate(leaf) {
        Ok(Role::Controller) => {}
        Ok(other) => return Err(GrantError::WrongSigner { signer: other.to_string() }),
        Err(e) => return Err(GrantError::WrongSigner { signer: e.to_string() }),
    }
    let algorithm = verification_algorithm(wire.scheme)?;
    let ee = EndEntityCert::try_from(leaf).map_err(GrantError::UntrustedChain)?;
    ee.verify_signature(algorithm, &signed_message(wire.body), wire.signature).map_err(|_| GrantError::BadSignature)?;

    if now + SKEW < grant.not_before {
        return Err(GrantError::NotYetValid { not_before: grant.not_before, now });
    }
    if now > grant.not_after + SKEW {
        return Err(GrantError::Expired { not_after: grant.not_after, now });
    }
    Ok(grant)
}

fn signed_message(body: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(SIGNING_DOMAIN.len() + body.len());
    message.extend_from_slice(SIGNING_DOMAIN);
    message.extend_from_slice(body);
    message
}

fn verification_algorithm(scheme: u16) -> Result<&'static dyn SignatureVerificationAlgorithm, GrantError> {
    Ok(match SignatureScheme::from(scheme) {
        SignatureScheme::ECDSA_NISTP256_SHA256 => webpki::ring::ECDSA_P256_SHA256,
        SignatureScheme::ECDSA_NISTP384_SHA384 => webpki::ring::ECDSA_P384_SHA384,
        SignatureScheme::ED25519 => webpki::ring::ED25519,
        SignatureScheme::RSA_PSS_SHA256 => webpki::ring::RSA_PSS_2048_8192_SHA256_LEGACY_KEY,
        _ => return Err(GrantError::UnsupportedScheme(scheme)),
    })
}

fn unix_secs(t: SystemTime) -> Result<u64, GrantError> {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).map_err(|_| GrantError::Sign("a time before 1970".into()))
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Lengths were checked by the caller (≤ MAX_VOLUME_LEN, ≤ MAX_NODE_ID_LEN).
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) -> Result<(), GrantError> {
    let len = u16::try_from(bytes.len()).map_err(|_| GrantError::Sign("a field longer than 64 KiB".into()))?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes);
    Ok(())
}

/// An encoded grant split into its parts, nothing checked but the framing.
struct Wire<'a> {
    body: &'a [u8],
    scheme: u16,
    signature: &'a [u8],
    chain: Vec<CertificateDer<'a>>,
}

impl<'a> Wire<'a> {
    fn decode(encoded: &'a [u8]) -> Result<Wire<'a>, GrantError> {
        let mut r = Reader(encoded);
        if r.take(MAGIC.len())? != MAGIC {
            return Err(GrantError::Malformed("not a wasmcsi grant (magic)"));
        }
        let body = r.bytes16()?;
        let scheme = r.u16()?;
        let signature = r.bytes16()?;
        let count = usize::from(r.u8()?);
        if count == 0 || count > MAX_CHAIN_LEN {
            return Err(GrantError::Malformed("the chain must hold 1 to 4 certificates"));
        }
        let chain = (0..count).map(|_| r.bytes16().map(CertificateDer::from)).collect::<Result<Vec<_>, _>>()?;
        if !r.0.is_empty() {
            return Err(GrantError::Malformed("trailing bytes"));
        }
        Ok(Wire { body, scheme, signature, chain })
    }

    fn grant(&self) -> Result<Grant, GrantError> {
        let mut r = Reader(self.body);
        let volume = r.str16(MAX_VOLUME_LEN)?;
        let node = r.str16(MAX_NODE_ID_LEN)?;
        let epoch = r.u64()?;
        let not_before = r.u64()?;
        let not_after = r.u64()?;
        if !r.0.is_empty() {
            return Err(GrantError::Malformed("trailing bytes in the body"));
        }
        if volume.is_empty() || node.is_empty() {
            return Err(GrantError::Malformed("an empty volume or node id"));
        }
        if not_after < not_before {
            return Err(GrantError::Malformed("validity ends before it starts"));
        }
        let time = |secs: u64| {
            UNIX_EPOCH.checked_add(Duration::from_secs(secs)).ok_or(GrantError::Malformed("a time out of range"))
        };
        Ok(Grant { volume, node, epoch, not_before: time(not_before)?, not_after: time(not_after)? })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GrantError> {
        if self.0.len() < n {
            return Err(GrantError::Malformed("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, GrantError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, GrantError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u64(&mut self) -> Result<u64, GrantError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(b))
    }

    fn bytes16(&mut self) -> Result<&'a [u8], GrantError> {
        let len = usize::from(self.u16()?);
        self.take(len)
    }

    fn str16(&mut self, max: usize) -> Result<String, GrantError> {
        let bytes = self.bytes16()?;
        if bytes.len() > max {
            return Err(GrantError::Malformed("an id longer than allowed"));
        }
        String::from_utf8(bytes.to_vec()).map_err(|_| GrantError::Malformed("an id that is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};

    struct Setup {
        _dir: tempfile::TempDir,
        _node_dir: tempfile::TempDir,
        controller: Credentials,
        node: Credentials,
        anchors: TrustAnchors,
    }

    fn setup_with(controller_validity: Validity) -> Setup {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let trust = [ca.certificate().clone()];
        let dir = tempfile::tempdir().expect("tempdir");
        ca.issue(&Role::Controller, controller_validity).expect("issue").write(dir.path(), &trust).expect("write");
        let node_dir = tempfile::tempdir().expect("tempdir");
        ca.issue(&Role::Node("n1".into()), Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .expect("issue")
            .write(node_dir.path(), &trust)
            .expect("write");
        Setup {
            controller: Credentials::load(dir.path()).expect("controller"),
            node: Credentials::load(node_dir.path()).expect("node"),
            anchors: TrustAnchors::new(trust.to_vec()).expect("anchors"),
            _dir: dir,
            _node_dir: node_dir,
        }
    }

    fn setup() -> Setup {
        setup_with(Validity::starting_now(DEFAULT_LEAF_VALIDITY))
    }

    fn grant() -> Grant {
        Grant::starting_now("set-1", "n1", 7, Duration::from_secs(3600))
    }

    #[test]
    fn a_signed_grant_verifies_to_what_was_signed() {
        let s = setup();
        let signed = grant().sign(&s.controller).expect("sign");
        assert!(signed.encoded.len() < 1024, "{} bytes", signed.encoded.len());
        let back = verify(&signed.encoded, &s.anchors, SystemTime::now()).expect("verifies");
        assert_eq!(back, signed.grant);
        assert_eq!((back.volume.as_str(), back.node.as_str(), back.epoch), ("set-1", "n1", 7));
    }

    #[test]
    fn the_validity_window_has_skew_at_both_ends_and_no_more() {
        let s = setup();
        // Inside the signer certificate's validity at every probe, so only the grant's own
        // window decides.
        let now = SystemTime::now();
        let later =
            Grant { not_before: now + Duration::from_secs(600), not_after: now + Duration::from_secs(1200), ..grant() };
        let signed = later.sign(&s.controller).expect("sign");
        let g = &signed.grant;
        let at = |t: SystemTime| verify(&signed.encoded, &s.anchors, t);
        assert!(at(g.not_before - SKEW).is_ok());
        assert!(matches!(at(g.not_before - SKEW - Duration::from_secs(1)), Err(GrantError::NotYetValid { .. })));
        assert!(at(g.not_after + SKEW).is_ok());
        assert!(matches!(at(g.not_after + SKEW + Duration::from_secs(1)), Err(GrantError::Expired { .. })));
    }

    #[test]
    fn a_grant_never_outlives_its_signers_certificate() {
        let s = setup_with(Validity::starting_now(Duration::from_secs(600)));
        let signed = Grant::starting_now("v", "n1", 1, DEFAULT_LIFE).sign(&s.controller).expect("sign");
        assert!(signed.grant.not_after <= s.controller.not_after());
    }

    #[test]
    fn a_node_cannot_sign_a_grant() {
        let s = setup();
        assert!(matches!(grant().sign(&s.node), Err(GrantError::Sign(_))));
    }

    #[test]
    fn a_grant_signed_by_a_node_key_is_refused_as_wrong_signer() {
        // Hand-built: a node's key and chain in the grant encoding.
        let s = setup();
        let signed = grant().sign(&s.controller).expect("sign");
        let wire = Wire::decode(&signed.encoded).expect("decode");
        let signer = s.node.signing_key().choose_scheme(SIGNING_SCHEMES).expect("scheme");
        let signature = signer.sign(&signed_message(wire.body)).expect("sign");
        let mut forged = MAGIC.to_vec();
        put_bytes(&mut forged, wire.body).expect("body");
        forged.extend_from_slice(&u16::from(signer.scheme()).to_be_bytes());
        put_bytes(&mut forged, &signature).expect("sig");
        forged.push(1);
        put_bytes(&mut forged, &s.node.chain()[0]).expect("chain");
        let err = verify(&forged, &s.anchors, SystemTime::now()).expect_err("node-signed");
        assert!(matches!(&err, GrantError::WrongSigner { signer } if signer.contains("n1")), "{err}");
    }

    #[test]
    fn any_changed_body_byte_breaks_the_signature() {
        let s = setup();
        let signed = grant().sign(&s.controller).expect("sign");
        let body_start = MAGIC.len() + 2;
        let body_len = u16::from_be_bytes([signed.encoded[8], signed.encoded[9]]) as usize;
        for i in body_start..body_start + body_len {
            let mut altered = signed.encoded.clone();
            altered[i] ^= 0x01;
            match verify(&altered, &s.anchors, SystemTime::now()) {
                Err(GrantError::BadSignature | GrantError::Malformed(_)) => {}
                other => panic!("byte {i} altered: {other:?}"),
            }
        }
    }

    #[test]
    fn a_chain_of_another_ca_is_untrusted() {
        let s = setup();
        let other = setup();
        let signed = grant().sign(&other.controller).expect("sign");
        let err = verify(&signed.encoded, &s.anchors, SystemTime::now()).expect_err("other CA");
        assert!(matches!(err, GrantError::UntrustedChain(webpki::Error::UnknownIssuer)), "{err}");
    }

    #[test]
    fn malformed_and_oversized_encodings_are_refused() {
        let s = setup();
        let signed = grant().sign(&s.controller).expect("sign");
        let now = SystemTime::now();
        for cut in [0, 7, 8, 9, 20, signed.encoded.len() - 1] {
            let err = verify(&signed.encoded[..cut], &s.anchors, now).expect_err("truncated");
            assert!(matches!(err, GrantError::Malformed(_)), "cut at {cut}: {err}");
        }
        let mut trailing = signed.encoded.clone();
        trailing.push(0);
        assert!(matches!(verify(&trailing, &s.anchors, now), Err(GrantError::Malformed("trailing bytes"))));
        let mut big = signed.encoded.clone();
        big.resize(MAX_ENCODED_LEN + 1, 0);
        assert!(matches!(verify(&big, &s.anchors, now), Err(GrantError::TooLarge { .. })));
        let mut scheme = signed.encoded.clone();
        let at = MAGIC.len() + 2 + u16::from_be_bytes([scheme[8], scheme[9]]) as usize;
        scheme[at..at + 2].copy_from_slice(&0x0401u16.to_be_bytes()); // rsa_pkcs1_sha256
        assert!(matches!(verify(&scheme, &s.anchors, now), Err(GrantError::UnsupportedScheme(0x0401))));
    }

    #[test]
    fn an_expired_signer_certificate_is_untrusted_even_inside_the_grant_window() {
        let s = setup_with(Validity::starting_now(Duration::from_secs(3600)));
        let signed = grant().sign(&s.controller).expect("sign");
        let after_signer = s.controller.not_after() + Duration::from_secs(1);
        let err = verify(&signed.encoded, &s.anchors, after_signer).expect_err("signer expired");
        assert!(matches!(err, GrantError::UntrustedChain(webpki::Error::CertExpired { .. })), "{err}");
    }
}
