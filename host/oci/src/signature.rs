//! cosign-compatible signatures ("simple signing", sigstore's `SIGNATURE_SPEC`): the signature of
//! artifact `sha256:HEX` is a manifest at the tag `sha256-HEX.sig` of the same repository, each
//! layer a payload of media type `application/vnd.dev.cosign.simplesigning.v1+json` naming the
//! signed digest in `critical.image.docker-manifest-digest`, with the base64 ECDSA P-256/SHA-256
//! signature (ASN.1 DER) over the payload's bytes in the annotation
//! `dev.cosignproject.cosign/signature`. `cosign sign --key` writes it and `cosign verify --key`
//! reads what [`sign_payload`] writes (no transparency log: `--tlog-upload=false`,
//! `--insecure-ignore-tlog`).
//!
//! Keys are PEM: public keys as `PUBLIC KEY` (SPKI, what `cosign public-key` prints); private keys
//! as unencrypted PKCS#8 `PRIVATE KEY` (what `backend keygen` and `openssl genpkey` write).
//! cosign's own encrypted `ENCRYPTED SIGSTORE PRIVATE KEY` files are refused by name: sign those
//! with cosign. Verification uses ring, which the process already carries for TLS.
use crate::error::OciError;
use base64::Engine as _;
use ring::signature::{ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, UnparsedPublicKey};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use x509_parser::prelude::FromDer as _;

pub const MEDIA_TYPE_SIMPLE_SIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
pub const ANNOTATION_SIGNATURE: &str = "dev.cosignproject.cosign/signature";
/// `critical.type` of every cosign payload.
pub const COSIGN_TYPE: &str = "cosign container image signature";

/// The tag the signatures of `digest` live at: `sha256-HEX.sig`.
pub fn signature_tag(digest: &str) -> String {
    format!("{}.sig", digest.replace(':', "-"))
}

#[derive(Debug, Serialize, Deserialize)]
struct Payload {
    critical: Critical,
    #[serde(default)]
    optional: Option<serde_json::Value>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Critical {
    identity: Identity,
    image: Image,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Identity {
    #[serde(rename = "docker-reference")]
    docker_reference: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Image {
    #[serde(rename = "docker-manifest-digest")]
    docker_manifest_digest: String,
}

/// The payload a signature of `digest` in `repository` (`REGISTRY/REPO`) signs.
pub fn payload(repository: &str, digest: &str) -> Vec<u8> {
    let payload = Payload {
        critical: Critical {
            identity: Identity { docker_reference: repository.into() },
            image: Image { docker_manifest_digest: digest.into() },
            kind: COSIGN_TYPE.into(),
        },
        optional: None,
    };
    serde_json::to_vec(&payload).unwrap_or_default()
}

/// The public keys an artifact must be signed by one of.
#[derive(Debug, Clone, Default)]
pub struct PublicKeys {
    /// file, uncompressed P-256 point
    keys: Vec<(PathBuf, Vec<u8>)>,
}

impl PublicKeys {
    /// Read PEM public keys, one per file.
    pub fn load(paths: &[PathBuf]) -> Result<Self, OciError> {
        let mut keys = Vec::with_capacity(paths.len());
        for path in paths {
            let text =
                std::fs::read_to_string(path).map_err(|e| OciError::Key { path: path.clone(), why: e.to_string() })?;
            keys.push((
                path.clone(),
                public_key_point(&text).map_err(|why| OciError::Key { path: path.clone(), why })?,
            ));
        }
        Ok(Self { keys })
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The key (its file) that verifies `signature` (DER) over `payload`, if any.
    pub fn verifier_of(&self, payload: &[u8], signature: &[u8]) -> Option<&Path> {
        self.keys
            .iter()
            .find(|(_, point)| {
                UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, point).verify(payload, signature).is_ok()
            })
            .map(|(path, _)| path.as_path())
    }
}

/// The EC point of a PEM `PUBLIC KEY` holding a P-256 key.
fn public_key_point(text: &str) -> Result<Vec<u8>, String> {
    let block = pem::parse(text).map_err(|e| format!("not PEM: {e}"))?;
    if block.tag() != "PUBLIC KEY" {
        return Err(format!("a {} block, not a PUBLIC KEY", block.tag()));
    }
    let (_, spki) = x509_parser::x509::SubjectPublicKeyInfo::from_der(block.contents())
        .map_err(|e| format!("not a SubjectPublicKeyInfo: {e}"))?;
    use x509_parser::oid_registry::{OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY};
    let curve = spki.algorithm.parameters.as_ref().and_then(|p| p.as_oid().ok());
    if spki.algorithm.algorithm != OID_KEY_TYPE_EC_PUBLIC_KEY || curve != Some(OID_EC_P256) {
        return Err("not an ECDSA P-256 key (the only kind cosign's key pairs use)".into());
    }
    Ok(spki.subject_public_key.data.to_vec())
}

/// A private key that signs artifacts.
pub struct SigningKey {
    pair: EcdsaKeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningKey(P-256)")
    }
}

impl SigningKey {
    pub fn load(path: &Path) -> Result<Self, OciError> {
        let bad = |why: String| OciError::Key { path: path.into(), why };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let block = pem::parse(&text).map_err(|e| bad(format!("not PEM: {e}")))?;
        match block.tag() {
            "PRIVATE KEY" => {}
            "ENCRYPTED SIGSTORE PRIVATE KEY" | "ENCRYPTED COSIGN PRIVATE KEY" => {
                return Err(bad("a cosign-encrypted key: sign with cosign, or use an unencrypted PKCS#8 key (`wasmcsi backend keygen`)".into()));
            }
            other => return Err(bad(format!("a {other} block, not an unencrypted PKCS#8 PRIVATE KEY"))),
        }
        let rng = ring::rand::SystemRandom::new();
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, block.contents(), &rng)
            .map_err(|e| bad(format!("not an ECDSA P-256 PKCS#8 key: {e}")))?;
        Ok(Self { pair })
    }

    /// A new key pair: (private key PEM, public key PEM).
    pub fn generate() -> Result<(String, String), OciError> {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| OciError::Key { path: PathBuf::new(), why: e.to_string() })?;
        Ok((pair.serialize_pem(), pair.public_key_pem()))
    }

    /// The DER signature of `payload`.
    pub fn sign(&self, payload: &[u8]) -> Result<Vec<u8>, OciError> {
        let rng = ring::rand::SystemRandom::new();
        self.pair
            .sign(&rng, payload)
            .map(|s| s.as_ref().to_vec())
            .map_err(|_| OciError::Key { path: PathBuf::new(), why: "signing failed".into() })
    }
}

/// Why one signature layer (its payload and annotation value) does not vouch for `digest`, or
/// the key that verifies it.
pub fn check_signature<'k>(
    keys: &'k PublicKeys,
    payload: &[u8],
    signature_b64: &str,
    digest: &str,
) -> Result<&'k Path, String> {
    let signature = base64::engine::general_purpose::STANDARD
        .decode(signature_b64.trim())
        .map_err(|e| format!("signature annotation is not base64: {e}"))?;
    // The signature first: a payload is only read once a trusted key vouches for it.
    let key = keys.verifier_of(payload, &signature).ok_or("signed by none of the configured keys")?;
    let payload: Payload =
        serde_json::from_slice(payload).map_err(|e| format!("payload is not a cosign payload: {e}"))?;
    if payload.critical.kind != COSIGN_TYPE {
        return Err(format!("payload type {:?}", payload.critical.kind));
    }
    // The identity (`docker-reference`) is not compared: an artifact copied to a mirror keeps
    // its digest and its signature, and the digest is what the configuration pins.
    if payload.critical.image.docker_manifest_digest != digest {
        return Err(format!("signs {}, not {digest}", payload.critical.image.docker_manifest_digest));
    }
    Ok(key)
}

/// The annotation value of a signature: base64 of the DER signature.
pub fn encode_signature(signature: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(signature)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const OTHER: &str = "sha256:1123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn pair(dir: &Path, name: &str) -> (SigningKey, PathBuf) {
        let (private, public) = SigningKey::generate().unwrap();
        let (k, p) = (dir.join(format!("{name}.key")), dir.join(format!("{name}.pub")));
        std::fs::write(&k, private).unwrap();
        std::fs::write(&p, public).unwrap();
        (SigningKey::load(&k).unwrap(), p)
    }

    #[test]
    fn a_signature_verifies_with_its_key_only_and_for_its_digest_only() {
        let dir = tempfile::tempdir().unwrap();
        let (ours, ours_pub) = pair(dir.path(), "ours");
        let (theirs, _) = pair(dir.path(), "theirs");
        let keys = PublicKeys::load(std::slice::from_ref(&ours_pub)).unwrap();
        let p = payload("reg/nfs", D);
        let sig = encode_signature(&ours.sign(&p).unwrap());
        assert_eq!(check_signature(&keys, &p, &sig, D).unwrap(), ours_pub);
        assert!(check_signature(&keys, &p, &sig, OTHER).unwrap_err().contains("not sha256:1123"));
        let foreign = encode_signature(&theirs.sign(&p).unwrap());
        assert!(check_signature(&keys, &p, &foreign, D).unwrap_err().contains("none of the configured keys"));
        let mut altered = p.clone();
        altered.push(b' ');
        assert!(check_signature(&keys, &altered, &sig, D).is_err());
        assert_eq!(signature_tag(D), "sha256-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.sig");
    }

    #[test]
    fn keys_that_are_not_p256_or_not_keys_are_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let ed = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let path = dir.path().join("ed.pub");
        std::fs::write(&path, ed.public_key_pem()).unwrap();
        let e = PublicKeys::load(std::slice::from_ref(&path)).unwrap_err().to_string();
        assert!(e.contains("ed.pub") && e.contains("P-256"), "{e}");
        std::fs::write(
            &path,
            "-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n",
        )
        .unwrap();
        assert!(SigningKey::load(&path).unwrap_err().to_string().contains("cosign-encrypted"));
    }
}
