//! A stub of the one Kubernetes API the authority endpoint calls: `POST
//! /apis/authentication.k8s.io/v1/tokenreviews`, over HTTPS, answered from a table of tokens.
//! No kube-apiserver can run on the machines the tests run on (see the project's machine
//! notes), so the TokenReview client is tested against this, and every test that uses it says
//! so. What it checks and answers is what the real API server does for a review: the caller's
//! bearer token (else 401), a `TokenReview` body, `spec.audiences` (a token is authenticated only
//! for an audience it was minted for, and `status.audiences` says which), the user's name and
//! the `authentication.kubernetes.io/node-name` extra of a pod-bound token.
//!
//! It also keeps Secrets and ConfigMaps (`GET`, `POST`, `PUT` under `/api/v1/namespaces/NS/`), as
//! the built-in CA's store uses them: a create of an existing name is 409 Conflict, an update
//! naming another `resourceVersion` is 409 too, as the API server's optimistic concurrency is.
//!
//! And CSINodes (`GET /apis/storage.k8s.io/v1/csinodes[/NAME]`, the list in pages with `limit` and
//! `continue`), as the controller's node directory reads them; [`KubeStub::set_down`] makes
//! every call fail as an API server that cannot answer.
//!
//! Its certificate comes from a CA of its own ([`KubeStub::ca_pem`]), naming `127.0.0.1`.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

/// What the stub knows of one token.
#[derive(Clone, Debug)]
pub struct Token {
    /// `system:serviceaccount:NAMESPACE:NAME`.
    pub username: String,
    /// The node of the pod the token is bound to.
    pub node: Option<String>,
    /// The audiences it was minted for.
    pub audiences: Vec<String>,
}

struct Shared {
    bearer: String,
    tokens: Mutex<HashMap<String, Token>>,
    reviews: AtomicUsize,
    /// Secrets and ConfigMaps by path (`/api/v1/namespaces/NS/KIND/NAME`), CSINodes by
    /// `/apis/storage.k8s.io/v1/csinodes/NAME`.
    objects: Mutex<HashMap<String, serde_json::Value>>,
    /// Every call answered 503.
    down: std::sync::atomic::AtomicBool,
}

/// The cluster-scoped CSINode collection.
const CSINODES: &str = "/apis/storage.k8s.io/v1/csinodes";

/// A running stub; dropping it stops the server.
pub struct KubeStub {
    pub addr: SocketAddr,
    ca_pem: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KubeStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KubeStub {
    /// Serves on 127.0.0.1 (a free port), accepting calls that carry `bearer` (the controller's
    /// own ServiceAccount token).
    pub async fn start(bearer: &str) -> KubeStub {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).expect("CA");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().expect("key");
        let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("leaf");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(leaf.der().to_vec())],
                PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
            )
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shared = Arc::new(Shared {
            bearer: bearer.to_owned(),
            tokens: Mutex::default(),
            reviews: AtomicUsize::new(0),
            objects: Mutex::default(),
            down: std::sync::atomic::AtomicBool::new(false),
        });
        let state = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else { continue };
                let (acceptor, state) = (acceptor.clone(), state.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let service = hyper::service::service_fn(move |req| answer(state.clone(), req));
                    let _ =
                        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service).await;
                });
            }
        });
        KubeStub { addr, ca_pem: ca.pem(), shared, task }
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The CA bundle that verifies the stub.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Writes the CA bundle and the bearer token into `dir` (`ca.crt`, `token`), as a pod finds
    /// them in its ServiceAccount directory.
    pub fn write_client_files(&self, dir: &Path) {
        std::fs::write(dir.join("ca.crt"), &self.ca_pem).expect("ca.crt");
        std::fs::write(dir.join("token"), format!("{}\n", self.shared.bearer)).expect("token");
    }

    /// From now on `token` reviews as `what`.
    pub fn add(&self, token: &str, what: Token) {
        self.shared.tokens.lock().unwrap_or_else(PoisonError::into_inner).insert(token.to_owned(), what);
    }

    /// The stored object at `path` (`/api/v1/namespaces/NS/KIND/NAME`), if any.
    pub fn object(&self, path: &str) -> Option<serde_json::Value> {
        self.shared.objects.lock().unwrap_or_else(PoisonError::into_inner).get(path).cloned()
    }

    /// From now on the CSINode `name` (a Kubernetes node) lists `driver` with node id `node_id`,
    /// as kubelet writes it when a node plugin registers.
    pub fn add_csi_node(&self, name: &str, driver: &str, node_id: &str) {
        let object = serde_json::json!({
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSINode",
            "metadata": {"name": name, "resourceVersion": "1"},
            "spec": {"drivers": [{"name": driver, "nodeID": node_id, "topologyKeys": ["topology.wasmcsi.io/node"]}]},
        });
        let mut objects = self.shared.objects.lock().unwrap_or_else(PoisonError::into_inner);
        objects.insert(format!("{CSINODES}/{name}"), object);
    }

    /// From now on every call to the API server fails with 503 (`true`), or is answered again.
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
    }

    /// TokenReviews answered so far (authenticated or not).
    pub fn reviews(&self) -> usize {
        self.shared.reviews.load(Ordering::SeqCst)
    }
}

async fn answer(
    state: Arc<Shared>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let reply = |status: StatusCode, body: serde_json::Value| {
        let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        Ok(response)
    };
    let authorized = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {}", state.bearer));
    if state.down.load(Ordering::SeqCst) {
        return reply(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"kind": "Status", "reason": "ServiceUnavailable"}),
        );
    }
    if req.method() == hyper::Method::GET && req.uri().path().starts_with(CSINODES) {
        if !authorized {
            return reply(StatusCode::UNAUTHORIZED, serde_json::json!({"kind": "Status", "reason": "Unauthorized"}));
        }
        let (status, body) = csi_nodes(&state, req.uri().path(), req.uri().query().unwrap_or_default());
        return reply(status, body);
    }
    if req.uri().path().starts_with("/api/v1/namespaces/") {
        if !authorized {
            return reply(StatusCode::UNAUTHORIZED, serde_json::json!({"kind": "Status", "reason": "Unauthorized"}));
        }
        let (method, path) = (req.method().clone(), req.uri().path().to_owned());
        let body = req.into_body().collect().await?.to_bytes();
        let (status, body) = store(&state, &method, &path, &body);
        return reply(status, body);
    }
    if req.method() != hyper::Method::POST || req.uri().path() != "/apis/authentication.k8s.io/v1/tokenreviews" {
        return reply(StatusCode::NOT_FOUND, serde_json::json!({"kind": "Status", "reason": "NotFound"}));
    }
    if !authorized {
        return reply(StatusCode::UNAUTHORIZED, serde_json::json!({"kind": "Status", "reason": "Unauthorized"}));
    }
    let body = req.into_body().collect().await?.to_bytes();
    let Ok(review) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return reply(StatusCode::BAD_REQUEST, serde_json::json!({"kind": "Status", "reason": "BadRequest"}));
    };
    state.reviews.fetch_add(1, Ordering::SeqCst);
    let token = review["spec"]["token"].as_str().unwrap_or_default();
    let wanted: Vec<String> = review["spec"]["audiences"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let known = state.tokens.lock().unwrap_or_else(PoisonError::into_inner).get(token).cloned();
    let status = match known {
        Some(t) => {
            let audiences: Vec<String> = t.audiences.iter().filter(|a| wanted.contains(a)).cloned().collect();
            if audiences.is_empty() {
                serde_json::json!({"authenticated": false, "error": "token audiences is invalid for the target audiences"})
            } else {
                let mut extra = serde_json::Map::new();
                if let Some(node) = &t.node {
                    extra.insert("authentication.kubernetes.io/node-name".into(), serde_json::json!([node]));
                }
                serde_json::json!({
                    "authenticated": true,
                    "user": {"username": t.username, "uid": "u-1", "groups": ["system:serviceaccounts"], "extra": extra},
                    "audiences": audiences,
                })
            }
        }
        None => serde_json::json!({"authenticated": false, "error": "invalid bearer token"}),
    };
    reply(
        StatusCode::CREATED,
        serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}),
    )
}

/// A Secret or ConfigMap call: `GET|PUT .../KIND/NAME`, `POST .../KIND`.
fn store(state: &Shared, method: &hyper::Method, path: &str, body: &[u8]) -> (StatusCode, serde_json::Value) {
    let status = |code: StatusCode, reason: &str| (code, serde_json::json!({"kind": "Status", "reason": reason}));
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (collection, name) = match parts.as_slice() {
        ["api", "v1", "namespaces", _, "secrets" | "configmaps"] => (path.to_owned(), None),
        ["api", "v1", "namespaces", _, "secrets" | "configmaps", name] => {
            (path.rsplit_once('/').map(|(c, _)| c.to_owned()).unwrap_or_default(), Some((*name).to_owned()))
        }
        _ => return status(StatusCode::NOT_FOUND, "NotFound"),
    };
    let mut objects = state.objects.lock().unwrap_or_else(PoisonError::into_inner);
    let parsed = || serde_json::from_slice::<serde_json::Value>(body).ok();
    match (method, name) {
        (&hyper::Method::GET, Some(_)) => match objects.get(path) {
            Some(object) => (StatusCode::OK, object.clone()),
            None => status(StatusCode::NOT_FOUND, "NotFound"),
        },
        (&hyper::Method::POST, None) => {
            let Some(mut object) = parsed() else { return status(StatusCode::BAD_REQUEST, "BadRequest") };
            let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
                return status(StatusCode::BAD_REQUEST, "BadRequest");
            };
            let key = format!("{collection}/{name}");
            if objects.contains_key(&key) {
                return status(StatusCode::CONFLICT, "AlreadyExists");
            }
            object["metadata"]["resourceVersion"] = "1".into();
            objects.insert(key, object.clone());
            (StatusCode::CREATED, object)
        }
        (&hyper::Method::PUT, Some(_)) => {
            let Some(mut object) = parsed() else { return status(StatusCode::BAD_REQUEST, "BadRequest") };
            let Some(current) = objects.get(path) else { return status(StatusCode::NOT_FOUND, "NotFound") };
            let version = current["metadata"]["resourceVersion"].as_str().unwrap_or("0").to_owned();
            if object["metadata"]["resourceVersion"].as_str() != Some(version.as_str()) {
                return status(StatusCode::CONFLICT, "Conflict");
            }
            let next = version.parse::<u64>().unwrap_or(0) + 1;
            object["metadata"]["resourceVersion"] = next.to_string().into();
            objects.insert(path.to_owned(), object.clone());
            (StatusCode::OK, object)
        }
        _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed"),
    }
}

/// `GET csinodes/NAME`, or the list in pages as the API server gives it: `limit`, and an opaque
/// `continue` token (here the index of the next object, in name order).
fn csi_nodes(state: &Shared, path: &str, query: &str) -> (StatusCode, serde_json::Value) {
    let objects = state.objects.lock().unwrap_or_else(PoisonError::into_inner);
    if path != CSINODES {
        return match objects.get(path) {
            Some(object) => (StatusCode::OK, object.clone()),
            None => (StatusCode::NOT_FOUND, serde_json::json!({"kind": "Status", "reason": "NotFound"})),
        };
    }
    let param = |key: &str| {
        query.split('&').find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v.to_owned()))
    };
    let limit = param("limit").and_then(|l| l.parse::<usize>().ok()).filter(|l| *l > 0).unwrap_or(usize::MAX);
    let from = param("continue").and_then(|c| c.parse::<usize>().ok()).unwrap_or(0);
    let mut names: Vec<&String> = objects.keys().filter(|k| k.starts_with(&format!("{CSINODES}/"))).collect();
    names.sort();
    let items: Vec<serde_json::Value> = names.iter().skip(from).take(limit).map(|k| objects[*k].clone()).collect();
    let next = if from.saturating_add(limit) < names.len() { (from + limit).to_string() } else { String::new() };
    (
        StatusCode::OK,
        serde_json::json!({"apiVersion": "storage.k8s.io/v1", "kind": "CSINodeList", "metadata": {"continue": next}, "items": items}),
    )
}
