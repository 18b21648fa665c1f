//! Checking a node's projected ServiceAccount token with the Kubernetes TokenReview API: the
//! proof a node without a certificate gives the authority endpoint.
//!
//! One HTTPS POST of `authentication.k8s.io/v1` `TokenReview` to the API server per check, with
//! the controller's own ServiceAccount token as bearer and the cluster's CA as the only trust
//! anchor (both from `/var/run/secrets/kubernetes.io/serviceaccount/` in a pod, re-read for every
//! check: kubelet rotates the token). The review names the audience `wasmcsi`, so a token minted
//! for anything else (the default API audience included) is refused by the API server itself.
//! The call goes through [`KubeClient`] (hyper's HTTP/1 client over rustls).
//!
//! What the review returns is only read here ([`ReviewedToken`]); whether that user and node may
//! have a certificate is the endpoint's decision.
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::kube_client::{KubeClient, KubeError};

/// The audience a node's projected token must be minted for.
pub const AUDIENCE: &str = "wasmcsi";
/// The extra field the API server sets to the node a pod-bound token's pod runs on.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// Where a pod finds its ServiceAccount's token and the cluster's CA.
pub const IN_CLUSTER_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
const PATH: &str = "/apis/authentication.k8s.io/v1/tokenreviews";

/// Where the API server is and how the controller authenticates to it.
#[derive(Clone, Debug)]
pub struct KubeApi {
    /// `https://HOST:PORT`.
    pub url: String,
    /// The cluster's CA bundle (PEM).
    pub ca_file: PathBuf,
    /// The controller's own ServiceAccount token.
    pub token_file: PathBuf,
}

impl KubeApi {
    /// The API server as a pod sees it: `KUBERNETES_SERVICE_HOST`/`_PORT` and the files of
    /// [`IN_CLUSTER_DIR`]. `None` outside a pod.
    pub fn in_cluster() -> Option<KubeApi> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").ok()?;
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        Some(KubeApi {
            url: format!("https://{host}:{port}"),
            ca_file: Path::new(IN_CLUSTER_DIR).join("ca.crt"),
            token_file: Path::new(IN_CLUSTER_DIR).join("token"),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// The API server says the token proves nothing (invalid, expired, wrong audience).
    #[error("the token is not accepted: {0}")]
    Rejected(String),
    /// No answer, or one that cannot be read: retry.
    #[error("token review at {url}: {what}")]
    Unavailable { url: String, what: String },
    #[error("token review: {0}")]
    Config(String),
}

/// What the API server says a token is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReviewedToken {
    /// `system:serviceaccount:NAMESPACE:NAME` for a ServiceAccount token.
    pub username: String,
    /// The node the token's pod runs on, when the token is bound to a pod.
    pub node: Option<String>,
}

/// A TokenReview client for one API server.
pub struct TokenReviewer {
    client: KubeClient,
}

impl TokenReviewer {
    /// Reads the CA bundle now (a CA that does not parse is a configuration error, said at
    /// start); the bearer token is read at each review.
    pub fn new(api: KubeApi) -> Result<TokenReviewer, ReviewError> {
        let client = KubeClient::new(api).map_err(|e| ReviewError::Config(e.to_string()))?;
        Ok(TokenReviewer { client })
    }

    /// Asks the API server what `token` is, for the audience [`AUDIENCE`].
    #[tracing::instrument(name = "authority.token_review", skip_all, fields(api = %self.client.url()))]
    pub async fn review(&self, token: &str) -> Result<ReviewedToken, ReviewError> {
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": { "token": token, "audiences": [AUDIENCE] },
        });
        match self.client.call(hyper::Method::POST, PATH, Some(&body)).await {
            Ok((status, body)) => self.read_answer(status, &body),
            Err(KubeError::Config(what)) => Err(ReviewError::Config(what)),
            Err(KubeError::Unavailable { url, what }) => Err(ReviewError::Unavailable { url, what }),
        }
    }

    fn unavailable(&self, what: impl Into<String>) -> ReviewError {
        ReviewError::Unavailable { url: self.client.url().to_owned(), what: what.into() }
    }

    fn read_answer(&self, status: hyper::StatusCode, body: &[u8]) -> Result<ReviewedToken, ReviewError> {
        if !status.is_success() {
            // 401/403 here are about the controller's own token or RBAC (it needs `create` on
            // tokenreviews): a fault of this deployment, not of the node's token.
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
            return Err(self.unavailable(format!("HTTP {status}: {text}")));
        }
        let review: Review =
            serde_json::from_slice(body).map_err(|e| self.unavailable(format!("an unreadable TokenReview: {e}")))?;
        let status = review.status.unwrap_or_default();
        if !status.authenticated {
            return Err(ReviewError::Rejected(if status.error.is_empty() {
                "the API server does not authenticate it".into()
            } else {
                status.error
            }));
        }
        // An API server that ignored the requested audiences answers without them: a token of
        // another audience must not pass for ours.
        if !status.audiences.iter().any(|a| a == AUDIENCE) {
            return Err(ReviewError::Rejected(format!(
                "it is not for the audience {AUDIENCE:?} (audiences: {:?})",
                status.audiences
            )));
        }
        let user = status.user.unwrap_or_default();
        let node = user.extra.get(NODE_NAME_EXTRA).and_then(|names| match names.as_slice() {
            [one] => Some(one.clone()),
            _ => None,
        });
        Ok(ReviewedToken { username: user.username, node })
    }
}

#[derive(Deserialize)]
struct Review {
    status: Option<ReviewStatus>,
}

#[derive(Default, Deserialize)]
struct ReviewStatus {
    #[serde(default)]
    authenticated: bool,
    #[serde(default)]
    user: Option<UserInfo>,
    #[serde(default)]
    audiences: Vec<String>,
    #[serde(default)]
    error: String,
}

#[derive(Default, Deserialize)]
struct UserInfo {
    #[serde(default)]
    username: String,
    #[serde(default)]
    extra: std::collections::HashMap<String, Vec<String>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reviewer() -> (TokenReviewer, tempfile::TempDir) {
        // Any PEM certificate parses as a root; this one is never dialled.
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = wasmcsi_trust::Authority::generate(wasmcsi_trust::Validity::starting_now(
            std::time::Duration::from_secs(60),
        ))
        .expect("CA");
        std::fs::write(dir.path().join("ca.crt"), wasmcsi_trust::pki::certificates_pem(&[ca.certificate().clone()]))
            .expect("ca");
        let api = KubeApi {
            url: "https://[::1]:6443".into(),
            ca_file: dir.path().join("ca.crt"),
            token_file: dir.path().join("token"),
        };
        (TokenReviewer::new(api).expect("reviewer"), dir)
    }

    #[test]
    fn an_ipv6_url_is_split_into_host_and_port() {
        let (r, _dir) = reviewer();
        assert_eq!((r.client.host.as_str(), r.client.port), ("::1", 6443));
    }

    #[test]
    fn answers_are_read_as_the_api_server_means_them() {
        let (r, _dir) = reviewer();
        let ok = br#"{"status":{"authenticated":true,"audiences":["wasmcsi"],
            "user":{"username":"system:serviceaccount:wasmcsi:node","extra":{"authentication.kubernetes.io/node-name":["n1"]}}}}"#;
        assert_eq!(
            r.read_answer(hyper::StatusCode::CREATED, ok).expect("reviewed"),
            ReviewedToken { username: "system:serviceaccount:wasmcsi:node".into(), node: Some("n1".into()) }
        );
        let no = br#"{"status":{"authenticated":false,"error":"token expired"}}"#;
        assert!(
            matches!(r.read_answer(hyper::StatusCode::CREATED, no), Err(ReviewError::Rejected(e)) if e == "token expired")
        );
        let other_audience = br#"{"status":{"authenticated":true,"audiences":["https://kubernetes.default.svc"],"user":{"username":"u"}}}"#;
        assert!(matches!(r.read_answer(hyper::StatusCode::CREATED, other_audience), Err(ReviewError::Rejected(_))));
        let forbidden = br#"{"kind":"Status","reason":"Forbidden"}"#;
        assert!(matches!(r.read_answer(hyper::StatusCode::FORBIDDEN, forbidden), Err(ReviewError::Unavailable { .. })));
        let two_nodes = br#"{"status":{"authenticated":true,"audiences":["wasmcsi"],
            "user":{"username":"u","extra":{"authentication.kubernetes.io/node-name":["a","b"]}}}}"#;
        assert_eq!(r.read_answer(hyper::StatusCode::CREATED, two_nodes).expect("reviewed").node, None);
    }

    #[test]
    fn a_url_that_is_not_https_is_refused() {
        let (r, dir) = reviewer();
        let api = KubeApi { url: "http://10.0.0.1:6443".into(), ..r.client.api.clone() };
        assert!(matches!(TokenReviewer::new(api), Err(ReviewError::Config(_))));
        drop(dir);
    }
}
