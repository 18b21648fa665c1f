//! The channel from a controller to the node plugins, for node-local backends (see
//! `topology`): a node plugin serves its Controller service on a TCP address to the
//! controller only (`serve`, over mutual TLS: the client's certificate must name the
//! controller), and a controller finds the node plugins by name (`Peers`: addresses given, or
//! DNS names resolved, each asked who it is) and forwards a node-local call whole to the node
//! that holds, or is to hold, the volume, checking that the server's certificate names that
//! node. It carries CSI requests, not file operations: what a node does is the same validated
//! code that serves kubelet, under that node's own grants.
//!
//! Every call travels inside one mutually authenticated TLS 1.3 session: the records are
//! authenticated and numbered, so a call cannot be altered, replayed or moved to another node
//! (the session is with that node). `--tls-mode off` carries it in plaintext, by explicit
//! choice only.
mod server;

pub use server::{IDLE_TIMEOUT, PeerCaller, WRITE_TIMEOUT, serve};

use crate::error::{CsiError, CsiResult};
use hyper_util::rt::TokioIo;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tonic::transport::{Channel, Endpoint, Uri};
use wasmcsi_block::transport::Transport;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_proto::csi::v1::identity_client::IdentityClient;
use wasmcsi_trust::credentials::server_name;
use wasmcsi_trust::verifier::peer_role;
use wasmcsi_trust::{ExpectedRole, LiveCredentials, Role};

/// Manifest key of GetPluginInfo naming the node a plugin serves.
pub(crate) const NODE_MANIFEST_KEY: &str = "node";
/// How long one discovery is trusted before node names are asked again.
const DISCOVERY_TTL: Duration = Duration::from_secs(10);
/// How long a node plugin may take to say who it is.
const IDENTIFY_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the node plugins are: `node=host:port` pairs given, and DNS names (`name:port`,
/// e.g. a headless Service in front of every node plugin's peer port) whose every address is
/// asked its node name at each discovery.
#[derive(Debug, Clone, Default)]
pub struct PeerSources {
    pub nodes: BTreeMap<String, String>,
    pub services: Vec<String>,
}

/// The node plugins this controller forwards node-local calls to.
pub struct Peers {
    sources: PeerSources,
    /// Plaintext (`--tls-mode off`), or this controller's credentials to dial with (TLS in
    /// `permissive` and `required` alike: the nodes are upgraded first).
    transport: Transport,
    /// The last discovery, and when it was made.
    found: Mutex<Option<(Instant, Discovered)>>,
}

/// What one discovery found: node name → address, and what could not be asked.
#[derive(Clone, Default)]
struct Discovered {
    nodes: BTreeMap<String, String>,
    /// Each service or address that did not resolve or say who it is, and why.
    failed: Vec<String>,
}

impl Peers {
    pub fn new(sources: PeerSources, transport: Transport) -> Self {
        Self { sources, transport, found: Mutex::new(None) }
    }

    /// Node name → address of every node plugin found, from the last discovery when fresh.
    async fn nodes(&self, fresh: bool) -> BTreeMap<String, String> {
        self.discovered(fresh).await.nodes
    }

    /// The last discovery when fresh, else a new one.
    async fn discovered(&self, fresh: bool) -> Discovered {
        let mut found = self.found.lock().await;
        if let Some((at, d)) = found.as_ref()
            && !fresh
            && at.elapsed() < DISCOVERY_TTL
        {
            return d.clone();
        }
        let d = self.discover().await;
        *found = Some((Instant::now(), d.clone()));
        d
    }

    async fn discover(&self) -> Discovered {
        let mut nodes = self.sources.nodes.clone();
        let mut failed = Vec::new();
        for service in &self.sources.services {
            let addrs = match tokio::time::timeout(IDENTIFY_TIMEOUT, tokio::net::lookup_host(service.clone())).await {
                Ok(Ok(a)) => a.collect::<Vec<_>>(),
                Ok(Err(e)) => {
                    tracing::warn!(%service, error = %e, "peer service does not resolve");
                    failed.push(format!("{service} does not resolve: {e}"));
                    continue;
                }
                Err(_) => {
                    tracing::warn!(%service, "peer service did not resolve in time");
                    failed.push(format!("{service} did not resolve in time"));
                    continue;
                }
            };
            let transport = &self.transport;
            let asked =
                addrs.into_iter().map(|addr| async move { (addr, identify(&addr.to_string(), transport).await) });
            for (addr, answer) in futures::future::join_all(asked).await {
                match answer {
                    Ok(node) => {
                        nodes.entry(node).or_insert_with(|| addr.to_string());
                    }
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "node plugin did not say who it is");
                        failed.push(format!("{addr}: {e}"));
                    }
                }
            }
        }
        Discovered { nodes, failed }
    }

    /// Whether node `name` has a node plugin that answers (discovered again on a miss); when
    /// not, whether every node plugin could be asked. The nodes given by address (`--peer`) are
    /// known as given.
    pub(crate) async fn lookup(&self, name: &str) -> crate::node_directory::Lookup {
        use crate::node_directory::Lookup;
        if self.discovered(false).await.nodes.contains_key(name) {
            return Lookup::Known;
        }
        let d = self.discovered(true).await;
        if d.nodes.contains_key(name) {
            Lookup::Known
        } else if d.failed.is_empty() {
            Lookup::Unknown
        } else {
            Lookup::Unreachable(d.failed.join("; "))
        }
    }

    /// Whether node `name` has a node plugin we can reach (discovered again on a miss).
    pub(crate) async fn knows(&self, name: &str) -> bool {
        self.nodes(false).await.contains_key(name) || self.nodes(true).await.contains_key(name)
    }

    /// The node whose tag in `backend`'s ids is `tag`.
    pub(crate) async fn node_of_tag(&self, backend: &str, tag: &str) -> Option<String> {
        for fresh in [false, true] {
            let nodes = self.nodes(fresh).await;
            if let Some(n) = nodes.keys().find(|n| crate::ids::node_tag(backend, n) == tag) {
                return Some(n.clone());
            }
        }
        None
    }

    /// The first node by name (a volume asked for with no accessibility requirements).
    pub(crate) async fn first_node(&self) -> Option<String> {
        self.nodes(false).await.keys().next().cloned()
    }

    /// Every node plugin found, by name.
    pub(crate) async fn node_names(&self) -> Vec<String> {
        self.nodes(false).await.keys().cloned().collect()
    }

    /// Forward one Controller call (`method`, e.g. `CreateVolume`) to node `node` (over TLS: to
    /// a server whose certificate names `node`), within `timeout`; its answer or its error
    /// comes back as it was.
    pub(crate) async fn call<Req, Resp, F, Fut>(
        &self,
        node: &str,
        method: &'static str,
        timeout: Duration,
        req: Req,
        f: F,
    ) -> CsiResult<Resp>
    where
        F: FnOnce(ControllerClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let addr = self.nodes(false).await.get(node).cloned();
        let addr = match addr {
            Some(a) => a,
            None => self
                .nodes(true)
                .await
                .get(node)
                .cloned()
                .ok_or_else(|| CsiError::UnknownNode { node: node.to_string() })?,
        };
        let channel = channel(&addr, &self.transport, ExpectedRole::Node(node.to_string()), timeout, None)?;
        let mut request = tonic::Request::new(req);
        request.set_timeout(timeout);
        tracing::debug!(node, %addr, method, "forwarding to the node");
        f(ControllerClient::new(channel), request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| CsiError::Peer { node: node.to_string(), status })
    }
}

fn endpoint(addr: &str) -> CsiResult<Endpoint> {
    Endpoint::from_shared(format!("http://{addr}"))
        .map(|e| e.connect_timeout(IDENTIFY_TIMEOUT))
        .map_err(|e| CsiError::Invalid(format!("node plugin address {addr:?}: {e}")))
}

/// A channel to the node plugin at `addr`, calls bounded by `timeout`. Over TLS the server must
/// verify as `expected`; `seen` (when given) learns the role it had.
pub fn channel(
    addr: &str,
    transport: &Transport,
    expected: ExpectedRole,
    timeout: Duration,
    seen: Option<Arc<OnceLock<Role>>>,
) -> CsiResult<Channel> {
    let endpoint = endpoint(addr)?.timeout(timeout);
    let Some(credentials) = transport.credentials() else { return Ok(endpoint.connect_lazy()) };
    // tonic speaks HTTP/2 in the clear to what the connector returns: the TLS is ours.
    let (credentials, target) = (credentials.clone(), addr.to_owned());
    let connector = tower::service_fn(move |_: Uri| {
        let (credentials, target, expected, seen) =
            (credentials.clone(), target.clone(), expected.clone(), seen.clone());
        async move { connect(&target, &credentials, expected, seen).await }
    });
    Ok(endpoint.connect_with_connector_lazy(connector))
}

/// TCP, then TLS as this controller, accepting only a server of role `expected`.
async fn connect(
    target: &str,
    credentials: &LiveCredentials,
    expected: ExpectedRole,
    seen: Option<Arc<OnceLock<Role>>>,
) -> std::io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>> {
    let config = credentials.client_config(expected).map_err(std::io::Error::other)?;
    let timed_out = |what: &str| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what} {target}"));
    let tcp = tokio::time::timeout(IDENTIFY_TIMEOUT, TcpStream::connect(target))
        .await
        .map_err(|_| timed_out("connecting to"))??;
    let _ = tcp.set_nodelay(true);
    let tls =
        tokio::time::timeout(IDENTIFY_TIMEOUT, tokio_rustls::TlsConnector::from(config).connect(server_name(), tcp))
            .await
            .map_err(|_| timed_out("TLS handshake with"))??;
    if let Some(seen) = seen {
        let role = peer_role(tls.get_ref().1).map_err(std::io::Error::other)?;
        let _ = seen.set(role);
    }
    Ok(TokioIo::new(tls))
}

/// The node name a node plugin at `addr` serves (its GetPluginInfo manifest). Over TLS the
/// server must be a node, and the manifest must name the node its certificate names.
async fn identify(addr: &str, transport: &Transport) -> CsiResult<String> {
    let seen = Arc::new(OnceLock::new());
    let channel = channel(addr, transport, ExpectedRole::AnyNode, IDENTIFY_TIMEOUT, Some(seen.clone()))?;
    let info = IdentityClient::new(channel)
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .map_err(|status| CsiError::Peer { node: addr.to_string(), status })?
        .into_inner();
    let node = info
        .manifest
        .get(NODE_MANIFEST_KEY)
        .filter(|n| !n.is_empty())
        .cloned()
        .ok_or_else(|| CsiError::Unavailable(format!("the plugin at {addr} names no node")))?;
    match seen.get() {
        Some(Role::Node(certified)) if *certified != node => Err(CsiError::Unavailable(format!(
            "the plugin at {addr} says it serves node {node}, but its certificate is node {certified}'s"
        ))),
        _ => Ok(node),
    }
}
