//! The node ids Kubernetes knows for this driver: its CSINode objects (`storage.k8s.io/v1`).
//! kubelet writes one per node when the node plugin registers, listing each driver with the
//! node id its NodeGetInfo answered; the external-attacher publishes to exactly that id. So a
//! node id no CSINode lists for this driver is one no CO in this cluster got from a node plugin.
//!
//! One GET of `csinodes/ID` first (the node id is the Kubernetes node name unless a plugin says
//! otherwise), then, when that does not list it, the whole list in pages (each answer stays
//! within the API client's 64 KiB). Ids found are remembered for [`KNOWN_TTL`], so a busy
//! attacher costs one GET a minute per node. Needs `get` and `list` on `csinodes`.
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::Lookup;
use crate::authority_endpoint::kube_client::{KubeClient, KubeError};
use crate::authority_endpoint::token_review::KubeApi;

const PATH: &str = "/apis/storage.k8s.io/v1/csinodes";
/// Objects per page of the list.
const PAGE: usize = 16;
/// The most pages read for one lookup (16 000 nodes).
const MAX_PAGES: usize = 1000;
/// How long a node found stays found without asking again.
pub const KNOWN_TTL: Duration = Duration::from_secs(60);

/// The CSINode source of one API server, for one driver name.
pub struct CsiNodes {
    client: KubeClient,
    driver: String,
    known: Mutex<HashMap<String, Instant>>,
}

#[derive(Deserialize)]
struct CsiNode {
    #[serde(default)]
    spec: Spec,
}

#[derive(Default, Deserialize)]
struct Spec {
    #[serde(default)]
    drivers: Vec<Driver>,
}

#[derive(Deserialize)]
struct Driver {
    #[serde(default)]
    name: String,
    #[serde(default, rename = "nodeID")]
    node_id: String,
}

#[derive(Deserialize)]
struct List {
    #[serde(default)]
    items: Vec<CsiNode>,
    #[serde(default)]
    metadata: ListMeta,
}

#[derive(Default, Deserialize)]
struct ListMeta {
    #[serde(default, rename = "continue")]
    next: String,
}

impl CsiNode {
    fn lists(&self, driver: &str, node: &str) -> bool {
        self.spec.drivers.iter().any(|d| d.name == driver && d.node_id == node)
    }
}

/// Whether `name` can be an object name in a URL path as it is (a DNS subdomain).
fn is_object_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// A query value percent-encoded (RFC 3986 unreserved characters kept).
fn query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl CsiNodes {
    /// The CSINodes of the API server `api`, for driver `driver` (the CSIDriver's name).
    pub fn new(api: KubeApi, driver: &str) -> Result<CsiNodes, KubeError> {
        Ok(CsiNodes { client: KubeClient::new(api)?, driver: driver.to_owned(), known: Mutex::default() })
    }

    fn remembered(&self, node: &str) -> bool {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.get(node).is_some_and(|at| at.elapsed() < KNOWN_TTL)
    }

    fn remember(&self, node: &str) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.retain(|_, at| at.elapsed() < KNOWN_TTL);
        known.insert(node.to_owned(), Instant::now());
    }

    /// Whether a CSINode lists this driver with node id `node`.
    #[tracing::instrument(name = "node_directory.csi_nodes", skip(self), fields(api = %self.client.url()))]
    pub async fn lookup(&self, node: &str) -> Lookup {
        if self.remembered(node) {
            return Lookup::Known;
        }
        let found = match self.find(node).await {
            Ok(found) => found,
            Err(e) => return Lookup::Unreachable(e.to_string()),
        };
        if found {
            self.remember(node);
            Lookup::Known
        } else {
            Lookup::Unknown
        }
    }

    async fn find(&self, node: &str) -> Result<bool, KubeError> {
        if is_object_name(node) {
            let (status, body) = self.client.call(hyper::Method::GET, &format!("{PATH}/{node}"), None).await?;
            if status.is_success() {
                let object: CsiNode = serde_json::from_slice(&body)
                    .map_err(|e| self.client.unavailable(format!("an unreadable CSINode {node}: {e}")))?;
                if object.lists(&self.driver, node) {
                    return Ok(true);
                }
            } else if status != hyper::StatusCode::NOT_FOUND {
                return Err(self.refused(status, &body));
            }
        }
        let mut next = String::new();
        for _ in 0..MAX_PAGES {
            let mut path = format!("{PATH}?limit={PAGE}");
            if !next.is_empty() {
                path.push_str(&format!("&continue={}", query_value(&next)));
            }
            let (status, body) = self.client.call(hyper::Method::GET, &path, None).await?;
            if !status.is_success() {
                return Err(self.refused(status, &body));
            }
            let page: List = serde_json::from_slice(&body)
                .map_err(|e| self.client.unavailable(format!("an unreadable CSINode list: {e}")))?;
            if page.items.iter().any(|n| n.lists(&self.driver, node)) {
                return Ok(true);
            }
            if page.metadata.next.is_empty() {
                return Ok(false);
            }
            next = page.metadata.next;
        }
        Err(self.client.unavailable(format!("more than {} CSINodes", PAGE * MAX_PAGES)))
    }

    /// An answer that is not the object: 401/403 are this deployment's (the controller's token
    /// or its RBAC: `get`/`list` on csinodes), not the node's; either way the list is unknown.
    fn refused(&self, status: hyper::StatusCode, body: &[u8]) -> KubeError {
        let text = String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned();
        self.client.unavailable(format!("HTTP {status} reading CSINodes: {text}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csinode_lists_a_node_only_for_this_driver_and_that_id() {
        let node: CsiNode = serde_json::from_str(
            r#"{"metadata":{"name":"k1"},"spec":{"drivers":[
                {"name":"other.io","nodeID":"n1"},{"name":"wasmcsi.io","nodeID":"n1","topologyKeys":[]}]}}"#,
        )
        .expect("parses");
        assert!(node.lists("wasmcsi.io", "n1"));
        assert!(!node.lists("wasmcsi.io", "k1"));
        assert!(!node.lists("third.io", "n1"));
        let bare: CsiNode = serde_json::from_str(r#"{"metadata":{"name":"k2"},"spec":{}}"#).expect("parses");
        assert!(!bare.lists("wasmcsi.io", "k2"));
    }

    #[test]
    fn only_dns_names_go_into_the_path_and_tokens_are_escaped() {
        assert!(is_object_name("node-1.example"));
        for bad in ["", "Node", "a/b", "a?b", "a b", "..%2f"] {
            assert!(!is_object_name(bad), "{bad:?}");
        }
        assert_eq!(query_value("eyJ2+/=&x"), "eyJ2%2B%2F%3D%26x");
    }
}
