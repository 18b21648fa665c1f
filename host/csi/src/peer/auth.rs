//! Who may call a node plugin's peer endpoint: the controller, and only for this node.
//!
//! The controller holds an Ed25519 signing key; node plugins hold only its public key. Every
//! call carries a signature over (the node it is meant for, the gRPC method, the time), so a
//! node, which sees the signed calls meant for itself, can neither forge a call nor replay one
//! at another node, and a captured call goes stale after [`MAX_SKEW`]. Identity calls are not
//! checked: they say only who the node is (discovery asks them before it knows the name).
use ed25519_dalek::{Signature, Signer as _, SigningKey, Verifier as _, VerifyingKey};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Metadata carrying the signing time (unix seconds).
pub const TIME_HEADER: &str = "x-wasmcsi-peer-time";
/// Metadata carrying the signature (hex).
pub const SIGNATURE_HEADER: &str = "x-wasmcsi-peer-signature";
/// How far a call's time may be from the node's clock.
pub const MAX_SKEW: Duration = Duration::from_secs(120);
/// Methods of this service need no signature.
const UNSIGNED_SERVICE: &str = "/csi.v1.Identity/";

/// Errors reading or making keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("reading key {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("key {path}: {why}")]
    Invalid { path: String, why: String },
    #[error("no randomness for a new key: {0}")]
    Random(String),
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// What is signed: a domain, the node, the method path, the time.
fn message(node: &str, path: &str, time: u64) -> Vec<u8> {
    format!("wasmcsi-peer/1\n{node}\n{path}\n{time}").into_bytes()
}

/// 32 bytes from a file holding their hex (surrounding white space ignored).
fn read_key(path: &Path) -> Result<[u8; 32], KeyError> {
    let p = || path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read { path: p(), source })?;
    let bytes = hex::decode(text.trim()).map_err(|e| KeyError::Invalid { path: p(), why: format!("not hex: {e}") })?;
    bytes.try_into().map_err(|b: Vec<u8>| KeyError::Invalid { path: p(), why: format!("{} bytes, not 32", b.len()) })
}

/// The controller's side: signs the calls it sends.
pub struct Signer(SigningKey);

impl Signer {
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        Ok(Self(SigningKey::from_bytes(&read_key(path)?)))
    }

    /// A new key pair: the private key and the public key, each as hex.
    pub fn generate() -> Result<(String, String), KeyError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| KeyError::Random(e.to_string()))?;
        let key = SigningKey::from_bytes(&seed);
        Ok((hex::encode(key.to_bytes()), hex::encode(key.verifying_key().to_bytes())))
    }

    /// The metadata to send with a call of `path` to `node`, signed now.
    pub fn sign(&self, node: &str, path: &str) -> [(&'static str, String); 2] {
        let time = unix_now();
        let signature = self.0.sign(&message(node, path, time));
        [(TIME_HEADER, time.to_string()), (SIGNATURE_HEADER, hex::encode(signature.to_bytes()))]
    }
}

/// A node's side: accepts calls signed by a controller key it trusts, for itself, recently.
pub struct Verifier {
    node: String,
    keys: Vec<VerifyingKey>,
}

impl Verifier {
    pub fn new(node: &str, key_files: &[impl AsRef<Path>]) -> Result<Self, KeyError> {
        let mut keys = Vec::new();
        for f in key_files {
            let path = f.as_ref();
            let key = VerifyingKey::from_bytes(&read_key(path)?)
                .map_err(|e| KeyError::Invalid { path: path.display().to_string(), why: e.to_string() })?;
            keys.push(key);
        }
        Ok(Self { node: node.to_string(), keys })
    }

    /// Whether a call of `path` with `headers` may run here; why not, if not.
    pub fn check(&self, path: &str, headers: &http::HeaderMap) -> Result<(), String> {
        if path.starts_with(UNSIGNED_SERVICE) {
            return Ok(());
        }
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).ok_or(format!("no {name}"));
        let time: u64 = header(TIME_HEADER)?.parse().map_err(|_| format!("{TIME_HEADER} is no time"))?;
        if unix_now().abs_diff(time) > MAX_SKEW.as_secs() {
            return Err(format!("signed at {time}, more than {MAX_SKEW:?} from this node's clock"));
        }
        let bytes = hex::decode(header(SIGNATURE_HEADER)?).map_err(|_| format!("{SIGNATURE_HEADER} is not hex"))?;
        let signature = Signature::from_slice(&bytes).map_err(|e| format!("{SIGNATURE_HEADER}: {e}"))?;
        let signed = message(&self.node, path, time);
        if self.keys.iter().any(|k| k.verify(&signed, &signature).is_ok()) {
            Ok(())
        } else {
            Err(format!("not signed by a trusted controller key for node {} and {path}", self.node))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(dir: &Path) -> (Signer, Verifier, Verifier) {
        let (private, public) = Signer::generate().expect("a key");
        std::fs::write(dir.join("key"), &private).expect("write");
        std::fs::write(dir.join("key.pub"), format!("{public}\n")).expect("write");
        let signer = Signer::from_file(&dir.join("key")).expect("signer");
        let a = Verifier::new("node-a", &[dir.join("key.pub")]).expect("verifier");
        let b = Verifier::new("node-b", &[dir.join("key.pub")]).expect("verifier");
        (signer, a, b)
    }

    fn headers(signed: [(&'static str, String); 2]) -> http::HeaderMap {
        signed.into_iter().map(|(k, v)| (http::HeaderName::from_static(k), v.parse().expect("value"))).collect()
    }

    #[test]
    fn a_call_signed_for_one_node_and_method_runs_there_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (signer, a, b) = pair(dir.path());
        let create = "/csi.v1.Controller/CreateVolume";
        let for_a = headers(signer.sign("node-a", create));
        assert_eq!(a.check(create, &for_a), Ok(()));
        // Node a cannot use what it was sent at node b, nor for another method.
        assert!(b.check(create, &for_a).is_err());
        assert!(a.check("/csi.v1.Controller/DeleteVolume", &for_a).is_err());
        assert!(a.check(create, &http::HeaderMap::new()).is_err());
        // Identity needs no signature (discovery); nothing else goes unsigned.
        assert_eq!(b.check("/csi.v1.Identity/GetPluginInfo", &http::HeaderMap::new()), Ok(()));
    }

    #[test]
    fn another_key_or_a_stale_time_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (_, a, _) = pair(dir.path());
        let other = tempfile::tempdir().expect("tempdir");
        let (stranger, _, _) = pair(other.path());
        let path = "/csi.v1.Controller/GetCapacity";
        assert!(a.check(path, &headers(stranger.sign("node-a", path))).is_err());
        let mut stale = headers(stranger.sign("node-a", path));
        stale.insert(TIME_HEADER, (unix_now() - 1000).to_string().parse().expect("value"));
        let why = a.check(path, &stale).expect_err("stale");
        assert!(why.contains("clock"), "{why}");
        std::fs::write(dir.path().join("bad"), "zz").expect("write");
        assert!(matches!(Verifier::new("n", &[dir.path().join("bad")]), Err(KeyError::Invalid { .. })));
    }
}
