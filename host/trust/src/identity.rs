//! Who a certificate speaks for: the [`Role`] a wasmcsi certificate carries in its one
//! `spiffe://wasmcsi/…` URI SAN (never in its subject CN), and reading it back from a DER
//! certificate.
//!
//! A node id is percent-encoded with RFC 3986's unreserved characters kept and every other byte
//! written `%XX` (upper-case hex). Decoding accepts only that canonical form, so the mapping
//! between roles and URIs is one-to-one: two different node ids never share a URI, and a URI
//! spelled differently (`%2d` for `-`, a lower-case escape) names no role at all.

use std::fmt;

use rustls::pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

/// Scheme and trust domain of every wasmcsi identity.
pub const TRUST_DOMAIN: &str = "spiffe://wasmcsi";
/// The controller's URI SAN.
pub const CONTROLLER_URI: &str = "spiffe://wasmcsi/controller";
/// What a node's URI SAN starts with; the percent-encoded node id follows.
pub const NODE_URI_PREFIX: &str = "spiffe://wasmcsi/node/";
/// The longest node id, in bytes of UTF-8: a Kubernetes node name is a DNS subdomain (≤ 253).
pub const MAX_NODE_ID_LEN: usize = 253;

/// URIs listed in an error about a certificate's SANs; the rest are counted, not quoted.
const MAX_URIS_QUOTED: usize = 4;
/// Characters of one URI quoted in an error.
const MAX_URI_QUOTED_LEN: usize = 300;

/// What a certificate's holder is to wasmcsi.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The control plane: creates and deletes replicas, calls engines, signs grants.
    Controller,
    /// The node plugin and data path of the node with this id (the Kubernetes node name).
    Node(String),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("node id is empty")]
    EmptyNodeId,
    #[error("node id is {len} bytes, more than {MAX_NODE_ID_LEN}")]
    NodeIdTooLong { len: usize },
    #[error("URI {uri:?} is not a wasmcsi identity (expected {CONTROLLER_URI} or {NODE_URI_PREFIX}<node id>)")]
    NotWasmcsi { uri: String },
    #[error("URI {uri:?}: the node id is not in canonical percent-encoding ({why})")]
    BadNodeEncoding { uri: String, why: &'static str },
    #[error("certificate does not parse as X.509: {0}")]
    BadCertificate(String),
    #[error("certificate has {count} spiffe://wasmcsi URI SANs, expected exactly one: {found}")]
    RoleUris { count: usize, found: String },
}

impl Role {
    /// A node role, checked: the id is non-empty and at most [`MAX_NODE_ID_LEN`] bytes.
    pub fn node(id: impl Into<String>) -> Result<Role, IdentityError> {
        let id = id.into();
        check_node_id(&id)?;
        Ok(Role::Node(id))
    }

    /// Checks what [`Role::node`] checks, for a `Role` built directly.
    pub fn check(&self) -> Result<(), IdentityError> {
        match self {
            Role::Controller => Ok(()),
            Role::Node(id) => check_node_id(id),
        }
    }

    /// The role's URI SAN.
    pub fn uri(&self) -> String {
        match self {
            Role::Controller => CONTROLLER_URI.to_owned(),
            Role::Node(id) => {
                let mut uri = String::with_capacity(NODE_URI_PREFIX.len() + id.len() * 3);
                uri.push_str(NODE_URI_PREFIX);
                percent_encode(id, &mut uri);
                uri
            }
        }
    }

    /// The role a URI SAN names; only the canonical spelling [`Role::uri`] writes is accepted.
    pub fn from_uri(uri: &str) -> Result<Role, IdentityError> {
        if uri == CONTROLLER_URI {
            return Ok(Role::Controller);
        }
        let Some(encoded) = uri.strip_prefix(NODE_URI_PREFIX) else {
            return Err(IdentityError::NotWasmcsi { uri: quote(uri) });
        };
        let id = percent_decode(encoded).map_err(|why| IdentityError::BadNodeEncoding { uri: quote(uri), why })?;
        check_node_id(&id)?;
        Ok(Role::Node(id))
    }

    /// The role of a DER certificate: its one `spiffe://wasmcsi…` URI SAN. Other URI SANs (a
    /// cert-manager csi-driver adds its own) are ignored; none or several wasmcsi ones is an
    /// error naming what was found. This reads the certificate only: whether it is to be
    /// trusted is [`crate::verifier`]'s question, asked first.
    pub fn of_certificate(der: &CertificateDer<'_>) -> Result<Role, IdentityError> {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der).map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
        let san = cert.subject_alternative_name().map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
        let mut ours: Vec<String> = Vec::new();
        for name in san.iter().flat_map(|san| san.value.general_names.iter()) {
            let uri = match name {
                GeneralName::URI(uri) => (*uri).to_owned(),
                // A URI that is not UTF-8 still counts when it claims our trust domain, so a
                // second, broken wasmcsi URI cannot hide next to a good one.
                GeneralName::Invalid(tag, bytes) if tag.0 == URI_TAG => String::from_utf8_lossy(bytes).into_owned(),
                _ => continue,
            };
            if claims_trust_domain(&uri) {
                ours.push(uri);
            }
        }
        match ours.as_slice() {
            [one] => Role::from_uri(one),
            _ => Err(IdentityError::RoleUris { count: ours.len(), found: list_uris(&ours) }),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Controller => f.write_str("controller"),
            Role::Node(id) => write!(f, "node {id:?}"),
        }
    }
}

/// The context-specific tag of `uniformResourceIdentifier` in a GeneralName.
const URI_TAG: u32 = 6;

fn check_node_id(id: &str) -> Result<(), IdentityError> {
    if id.is_empty() {
        return Err(IdentityError::EmptyNodeId);
    }
    if id.len() > MAX_NODE_ID_LEN {
        return Err(IdentityError::NodeIdTooLong { len: id.len() });
    }
    Ok(())
}

/// Whether a URI claims the wasmcsi trust domain, compared as a URI's scheme and host are
/// (ignoring ASCII case), so `SPIFFE://WASMCSI/…` cannot pass for a second, foreign identity.
fn claims_trust_domain(uri: &str) -> bool {
    let Some(head) = uri.get(..TRUST_DOMAIN.len()) else {
        return false;
    };
    head.eq_ignore_ascii_case(TRUST_DOMAIN) && matches!(uri.as_bytes().get(TRUST_DOMAIN.len()), None | Some(b'/'))
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn percent_encode(id: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in id.as_bytes() {
        if is_unreserved(b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
    }
}

fn percent_decode(encoded: &str) -> Result<String, &'static str> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = encoded.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let (Some(hi), Some(lo)) =
                (bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex))
            else {
                return Err("'%' not followed by two upper-case hex digits");
            };
            let decoded = hi << 4 | lo;
            if is_unreserved(decoded) {
                return Err("an unreserved character is escaped");
            }
            out.push(decoded);
            i += 3;
        } else if is_unreserved(b) {
            out.push(b);
            i += 1;
        } else {
            return Err("a reserved character is not escaped");
        }
    }
    String::from_utf8(out).map_err(|_| "the decoded bytes are not UTF-8")
}

fn quote(uri: &str) -> String {
    match uri.char_indices().nth(MAX_URI_QUOTED_LEN) {
        Some((cut, _)) => format!("{}…", &uri[..cut]),
        None => uri.to_owned(),
    }
}

fn list_uris(uris: &[String]) -> String {
    if uris.is_empty() {
        return "none".to_owned();
    }
    let mut list: Vec<String> = uris.iter().take(MAX_URIS_QUOTED).map(|u| format!("{:?}", quote(u))).collect();
    if uris.len() > MAX_URIS_QUOTED {
        list.push(format!("and {} more", uris.len() - MAX_URIS_QUOTED));
    }
    list.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair, SanType};

    fn cert_with_uris(uris: &[&str]) -> CertificateDer<'static> {
        let mut params = CertificateParams::default();
        params.subject_alt_names =
            uris.iter().map(|u| SanType::URI(rcgen::string::Ia5String::try_from(*u).expect("ascii uri"))).collect();
        params.subject_alt_names.push(SanType::DnsName("example.invalid".try_into().expect("dns name")));
        let key = KeyPair::generate().expect("key");
        params.self_signed(&key).expect("self-signed").der().clone()
    }

    #[test]
    fn controller_uri_round_trips() {
        assert_eq!(Role::Controller.uri(), "spiffe://wasmcsi/controller");
        assert_eq!(Role::from_uri(&Role::Controller.uri()), Ok(Role::Controller));
    }

    #[test]
    fn node_ids_round_trip_and_unreserved_stay_readable() {
        let cases = [
            ("worker-1.example", "spiffe://wasmcsi/node/worker-1.example"),
            ("a_b~c", "spiffe://wasmcsi/node/a_b~c"),
            ("a/b", "spiffe://wasmcsi/node/a%2Fb"),
            ("100%", "spiffe://wasmcsi/node/100%25"),
            ("ü", "spiffe://wasmcsi/node/%C3%BC"),
            (" ", "spiffe://wasmcsi/node/%20"),
        ];
        for (id, uri) in cases {
            let role = Role::node(id).expect("valid id");
            assert_eq!(role.uri(), uri);
            assert_eq!(Role::from_uri(uri), Ok(role));
        }
    }

    #[test]
    fn every_byte_value_round_trips() {
        // Every ASCII byte (controls included) and a few multi-byte characters, each alone and
        // all together: the encoding is total over UTF-8.
        let mut all = String::new();
        for b in 0u8..0x80 {
            let id = char::from(b).to_string();
            assert_eq!(Role::from_uri(&Role::Node(id.clone()).uri()), Ok(Role::Node(id.clone())));
            all.push_str(&id);
        }
        all.push_str("é漢🦀");
        assert_eq!(Role::from_uri(&Role::Node(all.clone()).uri()), Ok(Role::Node(all)));
    }

    #[test]
    fn longest_id_round_trips_and_one_more_byte_is_refused() {
        let longest = "é".repeat(MAX_NODE_ID_LEN / 2) + "x";
        assert_eq!(longest.len(), MAX_NODE_ID_LEN);
        let role = Role::node(longest.as_str()).expect("253 bytes");
        assert_eq!(Role::from_uri(&role.uri()), Ok(role));
        let too_long = longest + "x";
        assert_eq!(Role::node(too_long.as_str()), Err(IdentityError::NodeIdTooLong { len: 254 }));
        assert!(matches!(Role::from_uri(&Role::Node(too_long).uri()), Err(IdentityError::NodeIdTooLong { .. })));
    }

    #[test]
    fn different_ids_never_share_a_uri() {
        // The pairs a sloppy encoding would merge.
        let ids = ["a/b", "a%2Fb", "a%2fb", "A", "a", "a b", "a+b", "a%20b", "-", "%2D"];
        let uris: std::collections::HashSet<String> = ids.iter().map(|id| Role::Node((*id).into()).uri()).collect();
        assert_eq!(uris.len(), ids.len());
    }

    #[test]
    fn non_canonical_spellings_name_no_role() {
        for uri in [
            "spiffe://wasmcsi/node/a%2fb",     // lower-case hex
            "spiffe://wasmcsi/node/%2D",       // unreserved escaped
            "spiffe://wasmcsi/node/a/b",       // reserved not escaped
            "spiffe://wasmcsi/node/a%2",       // truncated escape
            "spiffe://wasmcsi/node/%FF",       // not UTF-8
            "spiffe://wasmcsi/node/",          // empty id
            "spiffe://wasmcsi/controller/",    // trailing slash
            "spiffe://wasmcsi/node",           // no id
            "SPIFFE://wasmcsi/controller",     // scheme case
            "spiffe://wasmcsi.example/node/a", // another trust domain
            "spiffe://wasmcsi/admin",
        ] {
            assert!(Role::from_uri(uri).is_err(), "{uri} must name no role");
        }
    }

    #[test]
    fn role_is_read_from_the_one_wasmcsi_uri_san() {
        let der = cert_with_uris(&["spiffe://other/x", "spiffe://wasmcsi/node/n1"]);
        assert_eq!(Role::of_certificate(&der), Ok(Role::Node("n1".into())));
        let der = cert_with_uris(&["spiffe://wasmcsi/controller"]);
        assert_eq!(Role::of_certificate(&der), Ok(Role::Controller));
    }

    #[test]
    fn two_wasmcsi_uri_sans_are_an_error_naming_both() {
        let der = cert_with_uris(&["spiffe://wasmcsi/node/a", "SPIFFE://WASMCSI/controller"]);
        let err = Role::of_certificate(&der).expect_err("two identities");
        assert!(matches!(err, IdentityError::RoleUris { count: 2, .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("spiffe://wasmcsi/node/a") && text.contains("SPIFFE://WASMCSI/controller"), "{text}");
    }

    #[test]
    fn no_wasmcsi_uri_san_is_an_error() {
        let der = cert_with_uris(&["spiffe://other/node/a"]);
        let err = Role::of_certificate(&der).expect_err("no identity");
        assert_eq!(err, IdentityError::RoleUris { count: 0, found: "none".into() });
    }

    #[test]
    fn an_unparsable_wasmcsi_uri_san_is_an_error() {
        let der = cert_with_uris(&["spiffe://wasmcsi/root"]);
        assert!(matches!(Role::of_certificate(&der), Err(IdentityError::NotWasmcsi { .. })));
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        let der = CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01]);
        assert!(matches!(Role::of_certificate(&der), Err(IdentityError::BadCertificate(_))));
    }
}
