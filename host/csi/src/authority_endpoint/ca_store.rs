//! The built-in CA kept in a Kubernetes Secret, so that `kubectl apply -k deploy/` is the whole
//! install: the controller reads the CA from the Secret at start and creates it (a new CA) when
//! there is none ([`CaStore::ensure`]), then publishes the CA's certificate, never its key, in a
//! ConfigMap of the same name ([`CaStore::publish`]), which the node plugins mount to trust the
//! authority endpoint by before they hold a certificate of their own.
//!
//! Two controllers starting at once (`replicas: 2`) both find no Secret and both create one:
//! the API server keeps the first and answers the second 409 Conflict, and the second reads
//! the first's back. Every controller therefore signs with the one CA in the Secret. The
//! Secret is never replaced here: a new CA would leave every node certificate unverifiable (a
//! CA is rotated by hand, with a bundle in `ca.crt`, see docs/security.md).
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hyper::{Method, StatusCode};
use wasmcsi_trust::pki::{CA_CERT_FILE, CA_KEY_FILE, DEFAULT_CA_VALIDITY};
use wasmcsi_trust::{Authority, Validity};

use super::kube_client::{KubeClient, KubeError};
use super::token_review::KubeApi;

/// Attempts at a create-or-read race before giving up (each loser reads the winner's).
const ATTEMPTS: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum CaStoreError {
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error("{what} {namespace}/{name}: HTTP {status}: {text}")]
    Refused { what: &'static str, namespace: String, name: String, status: StatusCode, text: String },
    #[error("the Secret {namespace}/{name} does not hold a CA: {why}")]
    Unreadable { namespace: String, name: String, why: String },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Pki(#[from] wasmcsi_trust::pki::PkiError),
    #[error("{what} {namespace}/{name}: another writer kept winning ({ATTEMPTS} attempts)")]
    Contended { what: &'static str, namespace: String, name: String },
}

/// Where the CA lives: the Secret `namespace/name` (`ca.crt`, `ca.key`) and the ConfigMap of
/// the same name (`ca.crt`).
pub struct CaStore {
    client: KubeClient,
    namespace: String,
    name: String,
}

impl CaStore {
    pub fn new(api: KubeApi, namespace: &str, name: &str) -> Result<CaStore, CaStoreError> {
        Ok(CaStore { client: KubeClient::new(api)?, namespace: namespace.to_owned(), name: name.to_owned() })
    }

    fn path(&self, kind: &str) -> String {
        format!("/api/v1/namespaces/{}/{kind}/{}", self.namespace, self.name)
    }

    fn collection(&self, kind: &str) -> String {
        format!("/api/v1/namespaces/{}/{kind}", self.namespace)
    }

    fn refused(&self, what: &'static str, status: StatusCode, body: &[u8]) -> CaStoreError {
        CaStoreError::Refused {
            what,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            status,
            text: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
        }
    }

    fn contended(&self, what: &'static str) -> CaStoreError {
        CaStoreError::Contended { what, namespace: self.namespace.clone(), name: self.name.clone() }
    }

    /// The CA of the Secret (created with a new CA when there is none), written into `dir`
    /// (`ca.crt` 0644, `ca.key` 0600) as `--ca-dir` holds it, and loaded from there.
    #[tracing::instrument(name = "authority.ca_store.ensure", skip_all, fields(secret = %format!("{}/{}", self.namespace, self.name)))]
    pub async fn ensure(&self, dir: &Path) -> Result<Authority, CaStoreError> {
        for _ in 0..ATTEMPTS {
            let (status, body) = self.client.call(Method::GET, &self.path("secrets"), None).await?;
            if status.is_success() {
                self.write_dir(dir, &body)?;
                return Ok(Authority::load(dir)?);
            }
            if status != StatusCode::NOT_FOUND {
                return Err(self.refused("reading the CA Secret", status, &body));
            }
            let (status, body) =
                self.client.call(Method::POST, &self.collection("secrets"), Some(&self.new_secret(dir)?)).await?;
            match status {
                // Read back what was stored: one path for the creator and the loser of a race.
                s if s.is_success() => tracing::info!("created the built-in CA and its Secret"),
                StatusCode::CONFLICT => tracing::info!("another controller created the CA Secret first; using its CA"),
                s => return Err(self.refused("creating the CA Secret", s, &body)),
            }
        }
        Err(self.contended("the CA Secret"))
    }

    /// A Secret holding a new CA (generated in a scratch directory under `dir`, removed after).
    fn new_secret(&self, dir: &Path) -> Result<serde_json::Value, CaStoreError> {
        let scratch = dir.join(".new-ca");
        let _ = fs::remove_dir_all(&scratch);
        Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY))?.save(&scratch)?;
        let read = |file: &str| {
            let path = scratch.join(file);
            fs::read(&path).map_err(|source| CaStoreError::Write { path, source })
        };
        let (cert, key) = (read(CA_CERT_FILE), read(CA_KEY_FILE));
        let _ = fs::remove_dir_all(&scratch);
        let (cert, key) = (cert?, zeroize::Zeroizing::new(key?));
        Ok(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/name": "wasmcsi", "app.kubernetes.io/component": "ca"},
            },
            "type": "Opaque",
            "data": {CA_CERT_FILE: STANDARD.encode(&cert), CA_KEY_FILE: STANDARD.encode(key.as_slice())},
        }))
    }

    /// `ca.crt` and `ca.key` of the Secret `body` into `dir`, each replaced whole.
    fn write_dir(&self, dir: &Path, body: &[u8]) -> Result<(), CaStoreError> {
        let unreadable =
            |why: String| CaStoreError::Unreadable { namespace: self.namespace.clone(), name: self.name.clone(), why };
        let secret: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| unreadable(format!("not a Secret: {e}")))?;
        let field = |file: &str| {
            let text = secret["data"][file].as_str().ok_or_else(|| unreadable(format!("no {file}")))?;
            STANDARD.decode(text).map(zeroize::Zeroizing::new).map_err(|e| unreadable(format!("{file}: {e}")))
        };
        let (cert, key) = (field(CA_CERT_FILE)?, field(CA_KEY_FILE)?);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| CaStoreError::Write { path: dir.to_owned(), source })?;
        replace(&dir.join(CA_KEY_FILE), &key, 0o600)?;
        replace(&dir.join(CA_CERT_FILE), &cert, 0o644)
    }

    /// Puts the CA's certificates (`ca.crt`, the whole bundle) in the ConfigMap, creating it
    /// or updating it when it says something else.
    #[tracing::instrument(name = "authority.ca_store.publish", skip_all, fields(configmap = %format!("{}/{}", self.namespace, self.name)))]
    pub async fn publish(&self, ca: &Authority) -> Result<(), CaStoreError> {
        let pem = wasmcsi_trust::pki::certificates_pem(ca.bundle());
        for _ in 0..ATTEMPTS {
            let (status, body) = self.client.call(Method::GET, &self.path("configmaps"), None).await?;
            let mut map = serde_json::json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": self.name,
                    "namespace": self.namespace,
                    "labels": {"app.kubernetes.io/name": "wasmcsi", "app.kubernetes.io/component": "ca"},
                },
                "data": {CA_CERT_FILE: pem},
            });
            let (status, body) = if status == StatusCode::NOT_FOUND {
                self.client.call(Method::POST, &self.collection("configmaps"), Some(&map)).await?
            } else if status.is_success() {
                let current: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                if current["data"][CA_CERT_FILE].as_str() == Some(pem.as_str()) {
                    return Ok(());
                }
                // An update names the version it replaces: a concurrent writer makes it 409.
                map["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
                self.client.call(Method::PUT, &self.path("configmaps"), Some(&map)).await?
            } else {
                return Err(self.refused("reading the CA ConfigMap", status, &body));
            };
            match status {
                s if s.is_success() => {
                    tracing::info!("published the CA's certificate");
                    return Ok(());
                }
                StatusCode::CONFLICT => continue,
                s => return Err(self.refused("writing the CA ConfigMap", s, &body)),
            }
        }
        Err(self.contended("the CA ConfigMap"))
    }
}

/// Writes `path` whole: a new file beside it, renamed over it.
fn replace(path: &Path, contents: &[u8], mode: u32) -> Result<(), CaStoreError> {
    let err = |source| CaStoreError::Write { path: path.to_owned(), source };
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp).map_err(err)?;
    f.write_all(contents).map_err(err)?;
    f.sync_all().map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}
