//! Starting a whole host in this process: runtime, backend registry (scanned and watched),
//! CSI services on a unix socket, and the metrics endpoint. `serve`, `backend check`, `demo`
//! and the integration tests all start hosts the same way. A node's data path (replica server
//! and engines) runs in the host's process, or in a data-path process of its own
//! ([`DataPathPlace::Socket`]) that outlives the host.
use anyhow::Context;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use wasmcsi_block::replica::NodeIdentity;
use wasmcsi_block::transport::Transport;
use wasmcsi_csi::node::mounts::KernelMounts;
use wasmcsi_csi::node::{Attachers, NodeSetup};
use wasmcsi_csi::{Mode, Plugin};
use wasmcsi_datapath::client::{DataPathClient, Engines, EnginesError};
use wasmcsi_datapath::{DataPath, DataPathConfig};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
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
    /// The controller's rounds (controller mode): how often it reconciles every self-healing
    /// backend's volumes and tends clones being filled, and when a clone nobody asks for is
    /// abandoned; `None`: no rounds.
    pub reconcile: Option<wasmcsi_csi::reconcile::Rounds>,
}

/// This host's part in a multi-node cluster for node-local backends (see
/// `wasmcsi_csi::topology`); the default: none (a standalone host, or central backends only).
/// Both sides speak mutual TLS with this host's credentials, or plaintext with `--tls-mode off`
/// (see [`crate::trust::transport`]).
#[derive(Debug, Clone, Default)]
pub struct PeerOptions {
    /// A node plugin: serve node-local calls forwarded by the controller on this address (over
    /// TLS: to the controller's certificate only).
    pub listen: Option<SocketAddr>,
    /// A controller: forward node-local calls to these node plugins (over TLS: each must answer
    /// with its node's certificate).
    pub sources: wasmcsi_csi::peer::PeerSources,
    /// A controller: the node ids of the cluster, as the operator names them (`--known-node`):
    /// a complete source of the node directory (see `wasmcsi_csi::node_directory`).
    pub known_nodes: Vec<String>,
}

/// A node's part of the replicated block data path.
#[derive(Debug, Clone)]
pub struct ReplicaOptions {
    /// Where the replica server listens; other nodes' engines connect here.
    pub listen: SocketAddr,
    /// Every replica on this node, one directory each: its disk `default`.
    pub root: PathBuf,
    /// More disks (replica roots) by name, as `--replica-root NAME=PATH` gives them.
    pub disks: Vec<(String, PathBuf)>,
    /// The labels this node reports to backends (for replica selectors and spreading).
    pub labels: Vec<(String, String)>,
}

/// Where a node's data path runs.
#[derive(Debug, Clone, Default)]
pub enum DataPathPlace {
    /// In the host's process (with [`HostOptions::replicas`]): it dies with the host.
    #[default]
    InProcess,
    /// In a `wasmcsi datapath` process answering at `socket`, which outlives the host. With
    /// `start`, the host starts one (detached, from [`HostOptions::replicas`]) when none answers;
    /// without, it waits for one run by someone else (its own container).
    Socket { socket: PathBuf, start: bool },
}

/// A running host; dropping it (or `shutdown`) stops serving.
pub struct Host {
    pub driver: Arc<Plugin>,
    pub registry: Arc<Registry>,
    pub socket: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    /// This node's replicas and engines, when it serves them in this process.
    pub datapath: Option<Arc<DataPath>>,
    /// Where this node's engines run (this process or a data-path process), when it has any.
    pub engines: Option<Engines>,
    stop: Option<oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    watcher: tokio::task::JoinHandle<()>,
    reconciler: Option<tokio::task::JoinHandle<()>>,
    /// Where the peer endpoint listens (a node plugin serving node-local calls).
    pub peer_addr: Option<SocketAddr>,
    peer_server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// Restarts a data path this host started when it stops answering.
    keeper: Option<tokio::task::JoinHandle<()>>,
    /// This host's credentials, the authority endpoint (a controller), and where its data path
    /// gets grants (see `trust`).
    pub trust: crate::trust::Trust,
}

impl Host {
    /// A host whose data path, if any, runs in this process (tests, `demo`, `backend check`).
    pub async fn start(opts: HostOptions) -> anyhow::Result<Self> {
        Self::start_with(opts, DataPathPlace::InProcess, PeerOptions::default()).await
    }

    /// A host whose data path runs where `place` says, as one host of a cluster as `peer` says.
    pub async fn start_with(opts: HostOptions, place: DataPathPlace, peer: PeerOptions) -> anyhow::Result<Self> {
        Self::start_with_trust(opts, place, peer, crate::trust::TrustOptions::default()).await
    }

    /// [`Self::start_with`], with this host's identity and authority endpoint as `trust` says.
    pub async fn start_with_trust(
        opts: HostOptions,
        place: DataPathPlace,
        peer: PeerOptions,
        trust: crate::trust::TrustOptions,
    ) -> anyhow::Result<Self> {
        if peer.listen.is_some() && !opts.mode.node() {
            anyhow::bail!("a peer endpoint is served by a node plugin (--mode node or all)");
        }
        let runtime = Runtime::new(RuntimeOptions {
            config: opts.config.clone(),
            cache_dir: Some(opts.state_dir.join("compile-cache")),
            store_path: opts.state_dir.join("meta.redb"),
            wasm_engine: WasmEngineSettings::default(),
        })
        .with_context(|| format!("starting the runtime with state in {}", opts.state_dir.display()))?;
        let registry = Registry::new(runtime.clone(), opts.backends_dir.clone(), opts.config_file.clone());
        // Backends named by an OCI `source`, pulled and verified into the state directory.
        registry.set_artifact_cache(opts.state_dir.join("artifacts"));
        let tls_mode = trust.tls_mode;
        // What a data path this host starts is given: the same credentials and mode.
        let (trust_dir, authority) = (trust.tls_dir.clone(), trust.authority.clone());
        let nodes = node_directory(&opts, &peer, trust.kube_api.clone())?;
        let trust = crate::trust::start(&trust, opts.mode, &opts.node_id, &registry).await?;
        // The catalog reaches replica servers with this process's credentials (a controller's:
        // everything; a node's: its read-only discovery) in the replica port's mode.
        runtime.reach_replicas(wasmcsi_block::control::Reach::any_node(crate::trust::replica_transport(
            tls_mode,
            trust.credentials.as_ref(),
        )?));
        // Scanned once the catalog knows how to reach replica servers.
        let report = registry.scan().await;
        tracing::info!(loaded = ?report.loaded, rejected = report.rejected.len(), "backends scanned");
        let watcher = registry.watch(opts.reload_interval);
        let forwards = !peer.sources.nodes.is_empty() || !peer.sources.services.is_empty();
        let peers = if forwards {
            let transport = crate::trust::transport(tls_mode, &trust, "forwarding to node plugins (--peer)")?;
            crate::trust::require_role(&transport, &wasmcsi_trust::Role::Controller, "forwarding to node plugins")?;
            Some(Arc::new(wasmcsi_csi::peer::Peers::new(peer.sources.clone(), transport)))
        } else {
            None
        };
        let peer_listener = match peer.listen {
            Some(addr) => {
                let transport = crate::trust::transport(tls_mode, &trust, "the peer endpoint (--peer-listen)")?;
                let me = wasmcsi_trust::Role::node(opts.node_id.as_str())?;
                crate::trust::require_role(&transport, &me, "the peer endpoint")?;
                let listener = wasmcsi_trust::Listener::bind(addr, wasmcsi_trust::Limits::default())
                    .await
                    .with_context(|| format!("binding the peer endpoint on {addr}"))?;
                Some((listener, transport))
            }
            None => None,
        };
        let (datapath, engines) = match (&place, &opts.replicas, opts.mode.node()) {
            (_, _, false) => (None, None),
            (DataPathPlace::InProcess, Some(r), true) => {
                let transport = crate::trust::replica_transport(tls_mode, trust.credentials.as_ref())?;
                let d = Arc::new(start_datapath(&opts, r, transport).await?);
                if let Some(source) = &trust.grant_source {
                    d.serve_grants(source.clone());
                }
                (Some(d.clone()), Some(Engines::InProcess(d)))
            }
            (DataPathPlace::InProcess, None, true) => (None, None),
            (DataPathPlace::Socket { socket, start }, _, true) => {
                // What a dead data path (or plugin) left under the shared runtime directory;
                // the data path reclaims there too at its start, and both skip a live owner's.
                wasmcsi_datapath::reclaim_dead(opts.state_dir.join("run")).await;
                let tls = DataPathTls { dir: trust_dir.clone(), mode: tls_mode, authority: authority.clone() };
                (None, Some(Engines::Remote(find_datapath(&opts, socket, *start, &tls).await?)))
            }
        };
        let keeper = match &place {
            DataPathPlace::Socket { socket, start: true } if opts.mode.node() => {
                let tls = DataPathTls { dir: trust_dir.clone(), mode: tls_mode, authority: authority.clone() };
                Some(tokio::spawn(keep_datapath(opts.clone(), socket.clone(), tls)))
            }
            _ => None,
        };
        let reconciler = match (opts.reconcile, opts.mode.controller()) {
            (Some(rounds), true) => Some(tokio::spawn(wasmcsi_csi::reconcile::run(registry.clone(), rounds))),
            _ => None,
        };

        let driver = Arc::new(Plugin {
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
                datapath: engines.clone(),
            }),
            node_local: wasmcsi_csi::plugin::NodeLocal { peers, pinned: peer_listener.is_some() },
            nodes,
            // A controller signs the grants of the volumes it publishes (`wasmcsi.io/grant`).
            grant_signer: trust
                .credentials
                .clone()
                .filter(|c| opts.mode.controller() && c.current().role() == &wasmcsi_trust::Role::Controller),
        });
        if opts.mode.controller() && !driver.node_directory_is_authoritative() {
            tracing::warn!(
                "no complete source of node ids (Kubernetes CSINodes, --known-node, or a standalone host): \
                 ControllerPublishVolume cannot tell a node that does not exist and lets it through"
            );
        }
        let mut listeners = trust.listeners.clone();
        if let Some((listener, _)) = &peer_listener {
            listeners.push(("peer", listener.stats()));
        }
        if let Some(d) = &datapath {
            listeners.push(("replica", d.replica_stats().clone()));
        }
        let series = crate::metrics_http::TrustSeries { credentials: trust.credentials.clone(), listeners };
        let metrics_addr = match opts.metrics_addr {
            Some(addr) => {
                Some(crate::metrics_http::serve(addr, runtime.metrics.clone(), datapath.clone(), series).await?)
            }
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
        let (peer_addr, peer_server) = match peer_listener {
            Some((listener, transport)) => {
                let bound = listener.local_addr()?;
                let mode = transport.mode();
                let d = driver.clone();
                // Stopped by aborting the task (shutdown, drop): its calls are idempotent and
                // the controller retries one cut short.
                let task = tokio::spawn(async move {
                    wasmcsi_csi::peer::serve(d, listener, transport).await.map_err(anyhow::Error::from)
                });
                tracing::info!(addr = %bound, tls_mode = %mode, "serving node-local calls to the controller");
                (Some(bound), Some(task))
            }
            None => (None, None),
        };
        Ok(Self {
            peer_addr,
            peer_server,
            driver,
            registry,
            socket: opts.socket,
            metrics_addr,
            datapath,
            engines,
            stop: Some(tx),
            served: Some(served),
            watcher,
            reconciler,
            keeper,
            trust,
        })
    }

    /// Stop serving and wait for the server to finish.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.stop.take().map(|s| s.send(()));
        self.watcher.abort();
        // Aborted, then awaited: what their futures hold (the registry, a data path's client)
        // is dropped before the data path below stops, not whenever the runtime gets to it.
        if let Some(p) = self.peer_server.take() {
            p.abort();
            let _ = p.await;
        }
        for task in [self.reconciler.take(), self.keeper.take()].into_iter().flatten() {
            task.abort();
            let _ = task.await;
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
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
    }
}

/// Opens this node's replicas and starts serving them.
async fn start_datapath(opts: &HostOptions, r: &ReplicaOptions, transport: Transport) -> anyhow::Result<DataPath> {
    let config = DataPathConfig {
        identity: NodeIdentity { node: opts.node_id.clone(), labels: r.labels.clone() },
        replica_root: r.root.clone(),
        replica_disks: r.disks.clone(),
        listen: r.listen,
        engine_root: opts.state_dir.join("engines"),
        runtime_root: opts.state_dir.join("run"),
        request_timeout: Duration::from_secs(10),
        attach_timeout: Duration::from_secs(30),
        transport,
        limits: wasmcsi_trust::Limits::default(),
    };
    let datapath = DataPath::start(config)
        .await
        .with_context(|| format!("serving replicas from {} on {}", r.root.display(), r.listen))?;
    wasmcsi_datapath::rbd_fuse::daemons::serve(&datapath, &opts.state_dir)?;
    Ok(datapath)
}

/// The data path answering at `socket`; with `start`, one started (detached) when none answers.
/// Without `start` a data path that does not answer yet is not an error: it runs in a container
/// of its own that may start after this one, and calls fail UNAVAILABLE until it answers.
async fn find_datapath(
    opts: &HostOptions,
    socket: &Path,
    start: bool,
    tls: &DataPathTls,
) -> anyhow::Result<DataPathClient> {
    let client = DataPathClient::new(socket);
    match client.hello().await {
        Ok(pid) => tracing::info!(pid, socket = %socket.display(), "found the running data path"),
        Err(EnginesError::Unreachable { .. }) if start => {
            crate::datapath_cmd::spawn_detached(&datapath_args(opts, socket, tls)?).await?;
        }
        Err(e @ EnginesError::Unreachable { .. }) => {
            tracing::warn!(error = %e, "no data path answers yet; replicated volumes wait for it")
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("the data path at {}", socket.display()))),
    }
    Ok(client)
}

/// What a data path started by this host serves: its replicas, its state beside the host's.
/// The credentials a data path this host starts is given: this host's (`--tls-dir`, mode,
/// where grants come from).
#[derive(Debug, Clone, Default)]
struct DataPathTls {
    dir: Option<PathBuf>,
    mode: Option<wasmcsi_trust::TlsMode>,
    authority: Option<String>,
}

fn datapath_args(
    opts: &HostOptions,
    socket: &Path,
    tls: &DataPathTls,
) -> anyhow::Result<crate::datapath_cmd::DataPathArgs> {
    let r = opts.replicas.as_ref().context("--datapath-start needs --replica-listen (what it serves)")?;
    Ok(crate::datapath_cmd::DataPathArgs {
        socket: socket.to_owned(),
        state_dir: opts.state_dir.clone(),
        // Started here, it shares this host's mount namespace: nothing to propagate.
        shared_state_dir: false,
        node_id: opts.node_id.clone(),
        replica_listen: r.listen,
        replica_roots: vec![crate::datapath_cmd::ReplicaRoot::default_at(r.root.clone())],
        node_labels: r.labels.clone(),
        metrics_addr: None,
        adopt: None,
        tls_dir: tls.dir.clone(),
        // Without credentials this host serves plaintext (it was told so, or it is a host built
        // in code): the data path it starts is told the same, explicitly.
        tls_mode: tls.mode.or(tls.dir.is_none().then_some(wasmcsi_trust::TlsMode::Off)),
        authority: tls.authority.clone(),
        limits: crate::datapath_cmd::ListenerArgs::default(),
        socket_limits: crate::datapath_cmd::SocketArgs::default(),
    })
}

/// Starts the data path again whenever it stops answering (it crashed or was killed), as
/// Kubernetes restarts a container: the volumes it served come back at their next stage.
async fn keep_datapath(opts: HostOptions, socket: PathBuf, tls: DataPathTls) {
    let client = DataPathClient::new(&socket);
    loop {
        tokio::time::sleep(KEEPER_INTERVAL).await;
        if let Err(EnginesError::Unreachable { .. }) = client.hello().await {
            tracing::warn!(socket = %socket.display(), "the data path stopped answering; starting it again");
            let started = match datapath_args(&opts, &socket, &tls) {
                Ok(args) => crate::datapath_cmd::spawn_detached(&args).await,
                Err(e) => Err(e),
            };
            if let Err(e) = started {
                tracing::error!(error = format!("{e:#}"), "restarting the data path");
            }
        }
    }
}

/// How often a host that started its data path checks that it still answers.
const KEEPER_INTERVAL: Duration = Duration::from_millis(500);

/// A gRPC channel to a CSI socket (the conformance suite's: one way to open one).
pub use wasmcsi_conformance::connect;

/// The node directory's configured sources: the nodes named, and (a controller) the cluster's
/// CSINode objects through the API server given, or the one of the pod this runs in.
fn node_directory(
    opts: &HostOptions,
    peer: &PeerOptions,
    kube_api: Option<wasmcsi_csi::authority_endpoint::token_review::KubeApi>,
) -> anyhow::Result<wasmcsi_csi::node_directory::NodeDirectory> {
    use wasmcsi_csi::authority_endpoint::token_review::KubeApi;
    use wasmcsi_csi::node_directory::{CsiNodes, NodeDirectory};
    let csi_nodes = match kube_api.or_else(KubeApi::in_cluster).filter(|_| opts.mode.controller()) {
        Some(api) => {
            let url = api.url.clone();
            Some(
                CsiNodes::new(api, &opts.driver_name)
                    .with_context(|| format!("the node directory's Kubernetes API client ({url})"))?,
            )
        }
        None => None,
    };
    Ok(NodeDirectory::new(peer.known_nodes.iter().cloned(), csi_nodes))
}
