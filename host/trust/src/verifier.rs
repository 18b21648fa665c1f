//! Deciding whether a peer's certificate chain speaks for a wasmcsi role: our own rustls
//! verifiers, for both ends of every connection.
//!
//! A chain is accepted when, in this order: it verifies to one of the CA bundle's certificates
//! (webpki: signatures, validity at the handshake's time, basic constraints), the leaf carries the
//! extended key usage of its end (clientAuth for a client, serverAuth for a server; the extension
//! is *required*, not merely obeyed when present), it names exactly one wasmcsi role
//! ([`Role::of_certificate`]), and that role is one the verifier admits ([`ExpectedRole`]). No
//! host name is checked: wasmcsi peers are named by role, never by DNS.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, TrustAnchor, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, CommonState, DigitallySignedStruct, DistinguishedName, OtherError, SignatureScheme};
use webpki::{EndEntityCert, KeyUsage};

use crate::identity::{IdentityError, Role};
use crate::provider::provider;

/// id-kp-serverAuth (1.3.6.1.5.5.7.3.1), DER content octets.
const EKU_SERVER_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01];
/// id-kp-clientAuth (1.3.6.1.5.5.7.3.2), DER content octets.
const EKU_CLIENT_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x02];

/// Which end of a TLS connection a certificate is checked for: its required EKU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    Server,
    Client,
}

impl Usage {
    fn key_usage(self) -> KeyUsage {
        match self {
            Usage::Server => KeyUsage::required(EKU_SERVER_AUTH),
            Usage::Client => KeyUsage::required(EKU_CLIENT_AUTH),
        }
    }
}

/// Which peers a verifier admits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpectedRole {
    /// Any valid wasmcsi role; the caller authorizes by the role it gets back (the replica port).
    Any,
    /// The controller only (the peer endpoint; a node dialling the authority endpoint).
    Controller,
    /// Any node (a replica server reached without a name, e.g. a `replace-replica` target).
    AnyNode,
    /// This node and no other (an engine dialling member node M).
    Node(String),
}

impl ExpectedRole {
    pub fn admits(&self, role: &Role) -> bool {
        match (self, role) {
            (ExpectedRole::Any, _) => true,
            (ExpectedRole::Controller, Role::Controller) => true,
            (ExpectedRole::AnyNode, Role::Node(_)) => true,
            (ExpectedRole::Node(want), Role::Node(got)) => want == got,
            _ => false,
        }
    }
}

impl From<Role> for ExpectedRole {
    fn from(role: Role) -> Self {
        match role {
            Role::Controller => ExpectedRole::Controller,
            Role::Node(id) => ExpectedRole::Node(id),
        }
    }
}

impl fmt::Display for ExpectedRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpectedRole::Any => f.write_str("any wasmcsi role"),
            ExpectedRole::Controller => f.write_str("the controller"),
            ExpectedRole::AnyNode => f.write_str("a node"),
            ExpectedRole::Node(id) => write!(f, "node {id:?}"),
        }
    }
}

#[derive(thiserror::Error)]
pub enum VerifyError {
    #[error("the CA bundle is empty")]
    NoAnchors,
    #[error("certificate {index} of the CA bundle is not a usable trust anchor: {error}")]
    BadAnchor { index: usize, error: webpki::Error },
    #[error("the certificate chain does not verify against the wasmcsi CA: {0}")]
    Chain(webpki::Error),
    #[error("the certificate names no usable wasmcsi role: {0}")]
    Identity(#[from] IdentityError),
    #[error("the peer is {found}, expected {expected}")]
    UnexpectedRole { found: Role, expected: ExpectedRole },
}

/// As its message: rustls prints a verifier's error with `{:?}` in its own messages (and so
/// in the handshake errors callers log).
impl fmt::Debug for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The CA bundle (`ca.crt`): every certificate in it is a trust anchor, so a bundle of the old
/// and the new CA trusts both while a CA is rotated.
#[derive(Clone, Debug)]
pub struct TrustAnchors {
    certificates: Vec<CertificateDer<'static>>,
    anchors: Vec<TrustAnchor<'static>>,
}

impl TrustAnchors {
    pub fn new(certificates: Vec<CertificateDer<'static>>) -> Result<Self, VerifyError> {
        if certificates.is_empty() {
            return Err(VerifyError::NoAnchors);
        }
        let anchors = certificates
            .iter()
            .enumerate()
            .map(|(index, der)| {
                webpki::anchor_from_trusted_cert(der)
                    .map(|a| a.to_owned())
                    .map_err(|error| VerifyError::BadAnchor { index, error })
            })
            .collect::<Result<_, _>>()?;
        Ok(TrustAnchors { certificates, anchors })
    }

    /// The CA certificates, as given.
    pub fn certificates(&self) -> &[CertificateDer<'static>] {
        &self.certificates
    }

    /// Verifies the chain `end_entity` + `intermediates` to one of the anchors at `now`, for
    /// `usage`. Says nothing of the role.
    pub fn verify_chain(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: Usage,
    ) -> Result<(), webpki::Error> {
        let ee = EndEntityCert::try_from(end_entity)?;
        ee.verify_for_usage(
            provider().signature_verification_algorithms.all,
            &self.anchors,
            intermediates,
            now,
            usage.key_usage(),
            None,
            None,
        )?;
        Ok(())
    }

    /// The chain checked as [`Self::verify_chain`] does, then the role it names.
    pub fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: Usage,
    ) -> Result<Role, VerifyError> {
        self.verify_chain(end_entity, intermediates, now, usage).map_err(VerifyError::Chain)?;
        Ok(Role::of_certificate(end_entity)?)
    }
}

/// Our rustls verifier: a [`ClientCertVerifier`] for servers, a [`ServerCertVerifier`] for
/// clients, both over one CA bundle and one [`ExpectedRole`].
#[derive(Debug)]
pub struct PeerVerifier {
    anchors: Arc<TrustAnchors>,
    expected: ExpectedRole,
    algorithms: WebPkiSupportedAlgorithms,
    /// As a client verifier: whether a client without a certificate is refused.
    client_required: bool,
}

impl PeerVerifier {
    pub fn new(anchors: Arc<TrustAnchors>, expected: ExpectedRole) -> Self {
        PeerVerifier {
            anchors,
            expected,
            algorithms: provider().signature_verification_algorithms,
            client_required: true,
        }
    }

    /// A client verifier that also lets a client without any certificate finish the handshake
    /// (the authority endpoint, where a node that has none yet asks for its first with another
    /// proof). A client that presents one is verified as [`Self::new`] verifies it.
    pub fn client_optional(anchors: Arc<TrustAnchors>, expected: ExpectedRole) -> Self {
        PeerVerifier { client_required: false, ..PeerVerifier::new(anchors, expected) }
    }

    fn check(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: Usage,
    ) -> Result<(), rustls::Error> {
        let role = self.anchors.verify(end_entity, intermediates, now, usage).map_err(to_rustls)?;
        if !self.expected.admits(&role) {
            return Err(to_rustls(VerifyError::UnexpectedRole { found: role, expected: self.expected.clone() }));
        }
        Ok(())
    }
}

impl ClientCertVerifier for PeerVerifier {
    fn client_auth_mandatory(&self) -> bool {
        self.client_required
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints: a wasmcsi process has exactly one certificate to present.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity, intermediates, now, Usage::Client)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(rustls::PeerIncompatible::Tls12NotOfferedOrEnabled))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity, intermediates, now, Usage::Server)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(rustls::PeerIncompatible::Tls12NotOfferedOrEnabled))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The role of the peer of a finished handshake (its leaf certificate was verified by a
/// [`PeerVerifier`] during the handshake; this only reads it).
pub fn peer_role(tls: &CommonState) -> Result<Role, IdentityError> {
    match tls.peer_certificates().and_then(|chain| chain.first()) {
        Some(leaf) => Role::of_certificate(leaf),
        None => Err(IdentityError::RoleUris { count: 0, found: "no peer certificate".into() }),
    }
}

/// A verification error as rustls reports it: the certificate alert that says the most to the
/// peer (expired, unknown CA, …), our own error with its context otherwise.
fn to_rustls(e: VerifyError) -> rustls::Error {
    let certificate_error = match &e {
        VerifyError::Chain(chain) => match chain {
            webpki::Error::CertExpired { .. } => CertificateError::Expired,
            webpki::Error::CertNotValidYet { .. } => CertificateError::NotValidYet,
            webpki::Error::UnknownIssuer => CertificateError::UnknownIssuer,
            webpki::Error::BadDer | webpki::Error::BadDerTime => CertificateError::BadEncoding,
            webpki::Error::InvalidSignatureForPublicKey => CertificateError::BadSignature,
            webpki::Error::RequiredEkuNotFoundContext(_) => CertificateError::InvalidPurpose,
            _ => CertificateError::Other(OtherError(Arc::new(e))),
        },
        _ => CertificateError::Other(OtherError(Arc::new(e))),
    };
    rustls::Error::InvalidCertificate(certificate_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_roles_admit_what_they_say() {
        let a = Role::Node("a".into());
        let b = Role::Node("b".into());
        assert!(ExpectedRole::Any.admits(&a) && ExpectedRole::Any.admits(&Role::Controller));
        assert!(ExpectedRole::Controller.admits(&Role::Controller) && !ExpectedRole::Controller.admits(&a));
        assert!(ExpectedRole::AnyNode.admits(&a) && !ExpectedRole::AnyNode.admits(&Role::Controller));
        assert!(ExpectedRole::Node("a".into()).admits(&a) && !ExpectedRole::Node("a".into()).admits(&b));
        assert!(!ExpectedRole::Node("a".into()).admits(&Role::Controller));
    }

    #[test]
    fn an_empty_bundle_trusts_nothing() {
        assert!(matches!(TrustAnchors::new(Vec::new()), Err(VerifyError::NoAnchors)));
    }

    #[test]
    fn a_bundle_entry_that_is_no_certificate_is_named_by_index() {
        let err = TrustAnchors::new(vec![CertificateDer::from(vec![1, 2, 3])]).expect_err("garbage");
        assert!(matches!(err, VerifyError::BadAnchor { index: 0, .. }), "{err}");
    }
}
