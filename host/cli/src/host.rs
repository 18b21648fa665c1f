//! Starting a whole host in this process: runtime, backend registry (scanned and watched),
//! CSI services on a unix socket, and the metrics endpoint. `serve`, `backend check`, `demo`
//! and the integration tests all start hosts the same way.
use anyhow::Context;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use wasmcsi_block::datapath::{DataPath, DataPathConfig};
use wasmcsi_block::replica::NodeIdentity;
use wasmcsi_csi::node::mounts::KernelMounts;
use wasmcsi_csi::node::{Attachers, NodeSetup};
use wasmcsi_csi::{Driver, Mode};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::engine::EngineSettings;
use wasmcsi_runtime::{Registry, Runtime, RuntimeOptions};

/// Everything a host needs to start.
#[derive(Debug, Clone)]
pub struct HostOptions {
    pub driver_name: String,
    pub mode: Mode,
    pub node_id: String,
    pub socket: PathBuf,
    pub config: HostConfig,
    /// The file `config` was read from: re-read when it changes, like the backends directory
    /// (`None`: `config` stays in force).
    pub config_file: Option<PathBuf>,
    pub backends_dir: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub reload_interval: Duration,
    pub metrics_addr: Option<SocketAddr>,
    /// This node's replica server and engines (node mode); `None`: no replicated volumes here.
    pub replicas: Option<ReplicaOptions>,
    /// How often the controller reconciles every self-healing backend's volumes (controller
    /// mode); `None`: never.
    pub reconcile_interval: Option<Duration>,
}

/// This host's part in a multi-node cluster for node-local backends (see
/// `wasmcsi_csi::topology`); the default: none (a standalone host, or central backends only).
#[derive(Debug, Clone, Default)]
pub struct PeerOptions {
    /// A node plugin: serve node-local calls forwarded by the controller on this address,
    /// accepting those signed by one of these public keys.
    pub listen: Option<SocketAddr>,
    pub trusted_keys: Vec<PathBuf>,
    /// A controller: forward node-local calls to these node plugins, signed with this key.
    pub sources: wasmcsi_csi::peer::PeerSources,
    pub signing_key: Option<PathBuf>,
}

/// A node's part of the replicated block data path.
#[derive(Debug, Clone)]
pub struct ReplicaOptions {
    /// Where the replica server listens; other nodes' engines connect here.
    pub listen: SocketAddr,
    /// Every replica on this node, one directory each.
    pub root: PathBuf,
    /// The labels this node reports to backends (for replica selectors and spreading).
    pub labels: Vec<(String, String)>,
}

/// A running host; dropping it (or `shutdown`) stops serving.
pub struct Host {
    pub driver: Arc<Driver>,
    pub registry: Arc<Registry>,
    pub socket: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    /// This node's replicas and engines, when it serves them.
    pub datapath: Option<Arc<DataPath>>,
    stop: Option<oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    watcher: tokio::task::JoinHandle<()>,
    reconciler: Option<tokio::task::JoinHandle<()>>,
    /// Where the peer endpoint listens (a node plugin serving node-local calls).
    pub peer_addr: Option<SocketAddr>,
    peer_server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Host {
    pub async fn start(opts: HostOptions) -> anyhow::Result<Self> {
        Self::start_with_peers(opts, PeerOptions::default()).await
    }

    /// [`Host::start`], as one host of a multi-node cluster (see [`PeerOptions`]).
    pub async fn start_with_peers(opts: HostOptions, peer: PeerOptions) -> anyhow::Result<Self> {
        use wasmcsi_csi::peer::{Peers, auth};
        let peers = match &peer.signing_key {
            Some(key) => {
                let signer = auth::Signer::from_file(key).context("the peer signing key")?;
                Some(Arc::new(Peers::new(peer.sources.clone(), signer)))
            }
            None if !peer.sources.nodes.is_empty() || !peer.sources.services.is_empty() => {
                anyhow::bail!("node plugins to forward to are given, but no signing key (--peer-signing-key)")
            }
            None => None,
        };
        let verifier = match peer.listen {
            Some(_) if !opts.mode.node() => {
                anyhow::bail!("a peer endpoint is served by a node plugin (--mode node or all)")
            }
            Some(_) if peer.trusted_keys.is_empty() => {
                anyhow::bail!("a peer endpoint needs the controller's public key (--peer-trusted-key)")
            }
            Some(_) => Some(auth::Verifier::new(&opts.node_id, &peer.trusted_keys).context("the trusted peer keys")?),
            None => None,
        };
        let runtime = Runtime::new(RuntimeOptions {
            config: opts.config.clone(),
            cache_dir: Some(opts.state_dir.join("compile-cache")),
            store_path: opts.state_dir.join("meta.redb"),
            engine: EngineSettings::default(),
        })
        .with_context(|| format!("starting the runtime with state in {}", opts.state_dir.display()))?;
        let registry = Registry::new(runtime.clone(), opts.backends_dir.clone(), opts.config_file.clone());
        let report = registry.scan().await;
        tracing::info!(loaded = ?report.loaded, rejected = report.rejected.len(), "backends scanned");
        let watcher = registry.watch(opts.reload_interval);
        let datapath = match (&opts.replicas, opts.mode.node()) {
            (Some(r), true) => Some(Arc::new(start_datapath(&opts, r).await?)),
            _ => None,
        };
        let reconciler = match (opts.reconcile_interval, opts.mode.controller()) {
            (Some(every), true) => Some(tokio::spawn(wasmcsi_csi::reconcile::run(registry.clone(), every))),
            _ => None,
        };

        let driver = Arc::new(Driver {
            name: opts.driver_name.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            mode: opts.mode,
            node_id: opts.node_id.clone(),
            registry: registry.clone(),
            inflight: Default::default(),
            attachers: Attachers::new(NodeSetup {
                node_id: opts.node_id.clone(),
                state_dir: opts.state_dir.join("node"),
                config: runtime.clone(),
                mounts: Arc::new(KernelMounts),
                runtime_dir: opts.state_dir.join("run"),
                datapath: datapath.clone(),
            }),
            node_local: wasmcsi_csi::topology::NodeLocal { peers, pinned: verifier.is_some() },
        });
        let metrics_addr = match opts.metrics_addr {
            Some(addr) => Some(crate::metrics_http::serve(addr, runtime.metrics.clone(), datapath.clone()).await?),
            None => None,
        };
        let (tx, rx) = oneshot::channel::<()>();
        let listener = wasmcsi_csi::server::bind(&opts.socket)?;
        let d = driver.clone();
        let served = tokio::spawn(async move {
            wasmcsi_csi::server::serve(d, listener, async {
                let _ = rx.await;
            })
            .await
            .map_err(anyhow::Error::from)
        });
        let (peer_addr, peer_server) = match (peer.listen, verifier) {
            (Some(addr), Some(verifier)) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the peer endpoint on {addr}"))?;
                let bound = listener.local_addr()?;
                let d = driver.clone();
                // Stopped by aborting the task (shutdown, drop): its calls are idempotent and
                // the controller retries one cut short.
                let task = tokio::spawn(async move {
                    wasmcsi_csi::peer::serve(d, listener, verifier, std::future::pending())
                        .await
                        .map_err(anyhow::Error::from)
                });
                tracing::info!(addr = %bound, "serving node-local calls to the controller");
                (Some(bound), Some(task))
            }
            _ => (None, None),
        };
        Ok(Self {
            peer_addr,
            peer_server,
            driver,
            registry,
            socket: opts.socket,
            metrics_addr,
            datapath,
            stop: Some(tx),
            served: Some(served),
            watcher,
            reconciler,
        })
    }

    /// Stop serving and wait for the server to finish.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.stop.take().map(|s| s.send(()));
        if let Some(p) = self.peer_server.take() {
            p.abort();
        }
        self.watcher.abort();
        if let Some(r) = self.reconciler.take() {
            r.abort();
        }
        if let Some(served) = self.served.take() {
            served.await.context("CSI server task")??;
        }
        if let Some(d) = &self.datapath {
            d.shutdown().await.context("stopping the replica data path")?;
        }
        Ok(())
    }

    /// Serve until the server stops on its own (e.g. an error).
    pub async fn wait(mut self) -> anyhow::Result<()> {
        if let Some(served) = self.served.take() {
            served.await.context("CSI server task")??;
        }
        Ok(())
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop.take().map(|s| s.send(()));
        if let Some(p) = self.peer_server.take() {
            p.abort();
        }
        self.watcher.abort();
        if let Some(r) = self.reconciler.take() {
            r.abort();
        }
    }
}

/// Opens this node's replicas and starts serving them.
async fn start_datapath(opts: &HostOptions, r: &ReplicaOptions) -> anyhow::Result<DataPath> {
    let config = DataPathConfig {
        identity: NodeIdentity { node: opts.node_id.clone(), labels: r.labels.clone() },
        replica_root: r.root.clone(),
        listen: r.listen,
        engine_root: opts.state_dir.join("engines"),
        runtime_root: opts.state_dir.join("run"),
        request_timeout: Duration::from_secs(10),
        attach_timeout: Duration::from_secs(30),
    };
    DataPath::start(config).await.with_context(|| format!("serving replicas from {} on {}", r.root.display(), r.listen))
}

/// A gRPC channel to a CSI socket.
pub async fn connect(socket: &Path) -> anyhow::Result<tonic::transport::Channel> {
    let uri = format!("unix://{}", socket.display());
    tonic::transport::Endpoint::try_from(uri)?
        .connect()
        .await
        .with_context(|| format!("connecting to {}", socket.display()))
}
