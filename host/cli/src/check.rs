//! `wasmcsi backend check`: what a component imports and exports, which grants it needs, and
//! whether it keeps CSI's semantics (the conformance suite, run through a real host on a
//! scratch directory with real capabilities). `backend ls` and `export` are `backend_dir`.
use crate::host::{Host, HostOptions, ReplicaOptions};
use anyhow::Context;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use wasmcsi_block::replica::{NodeIdentity, ReplicaNode, ReplicaServer, ServerConfig};
use wasmcsi_conformance::{self as conformance, Profile};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::capabilities::Capability;
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{ContractVersion, Runtime, RuntimeOptions};

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The component to check (`NAME.wasm`; NAME becomes the backend name).
    pub file: PathBuf,
    /// Host configuration to take limits and grants from. Grants the component needs and
    /// the file lacks are given on a scratch directory.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// StorageClass parameters for the volumes the suite creates (repeatable KEY=VALUE).
    #[arg(long = "param", value_parser = parse_kv)]
    pub params: Vec<(String, String)>,
    /// CSI secrets for every controller request that carries secrets (repeatable KEY=VALUE),
    /// as the CO passes them from a StorageClass's secret references: e.g. `userID=csi` and
    /// `userKey=...` for ceph-rbd-shim. Values are never printed.
    #[arg(long = "secret", value_parser = parse_secret)]
    pub secrets: Vec<(String, String)>,
    /// Skip the node checks (stage/publish need root and a node executor for the backend).
    #[arg(long)]
    pub no_node: bool,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

/// Like [`parse_kv`], without echoing the argument (it holds a secret).
fn parse_secret(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| "a --secret is not KEY=VALUE".to_string())
}

/// The backend name of `file`: its stem, with cargo's `_` read as the `-` it stands for
/// (`cargo build` writes the component of crate `my-store` as `my_store.wasm`; the host loads it
/// as `my-store.wasm`).
pub(crate) fn backend_name(file: &Path) -> anyhow::Result<String> {
    let stem = file.file_stem().and_then(|s| s.to_str()).context("the file needs a NAME.wasm name")?;
    let name = stem.replace('_', "-");
    anyhow::ensure!(
        wasmcsi_runtime::config::is_valid_name(&name),
        "backend name {stem:?} (the file stem) must be 1-32 of [a-z0-9-]"
    );
    Ok(name)
}

/// Check one component; `Ok(false)` when it loads but fails checks.
pub async fn run(args: CheckArgs) -> anyhow::Result<bool> {
    let name = backend_name(&args.file)?;
    let wasm = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    if let Some(why) = crate::backend_dir::not_a_component(&wasm) {
        anyhow::bail!("{}: {why}", args.file.display());
    }
    let scratch = tempfile::tempdir()?;
    let mut config = crate::load_config_file(args.config.as_deref())?;

    // 1. What it is.
    let inspector = Runtime::new(RuntimeOptions {
        config: config.clone(),
        cache_dir: None,
        store_path: scratch.path().join("inspect.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 8, ..Default::default() },
    })?;
    let (imports, exports) = inspector.inspect(&name, &wasm)?;
    drop(inspector);
    println!("component {} ({} bytes, sha256 {})", args.file.display(), wasm.len(), Runtime::digest(&wasm));
    if args.file.file_stem().and_then(|s| s.to_str()) == Some(name.as_str()) {
        println!("backend name: {name}");
    } else {
        println!("backend name: {name} (the host loads it as {name}.wasm)");
    }
    println!("imports:");
    for c in &imports.capabilities {
        println!("  wasmcsi:backend/{}", c.name());
    }
    for w in &imports.wasi {
        println!("  {w} (deny-by-default WASI)");
    }
    for u in &imports.unknown {
        println!("  {u} (unknown: cannot load)");
    }
    println!("exports:");
    for e in &exports {
        println!("  {e}");
    }
    match ContractVersion::detect(&imports.wasmcsi, &exports) {
        Ok(v) if v == ContractVersion::CURRENT => println!("contract: {v}"),
        Ok(v) => println!("contract: {v} (previous version, served beside {})", ContractVersion::CURRENT),
        Err(e) => println!("contract: none this host serves: {e}"),
    }
    let needed: Vec<&str> = imports
        .capabilities
        .iter()
        .filter(|c| !matches!(c, Capability::Types | Capability::Log | Capability::Kv))
        .map(|c| c.name())
        .collect();
    println!(
        "grants needed: {}",
        if needed.is_empty() { "none beyond log and kv".to_string() } else { needed.join(", ") }
    );

    // 2. Grants for the check: what the config gives, plus a scratch dir root when needed.
    let entry = config.backends.entry(name.clone()).or_default();
    if imports.capabilities.contains(&Capability::Dir) && entry.grants.dir.is_empty() {
        let root = scratch.path().join("dir-root");
        std::fs::create_dir_all(&root)?;
        entry.grants.dir.insert("default".into(), root);
    }
    // A block backend without a block grant gets scratch replica nodes: this host's own (it
    // stages the suite's volumes, its replica in-process) and two more servers in this process,
    // granted through a nodes file written once they listen.
    let scratch_replicas =
        imports.capabilities.contains(&Capability::Block) && entry.grants.block.as_ref().is_none_or(|s| s.is_empty());
    let nodes_file = scratch.path().join("replica-nodes");
    if scratch_replicas {
        std::fs::write(&nodes_file, "")?;
        entry.grants.block =
            Some(wasmcsi_block::catalog::NodeSources { nodes_file: Some(nodes_file.clone()), ..Default::default() });
    }
    let backends = scratch.path().join("backends");
    std::fs::create_dir_all(&backends)?;
    std::fs::write(backends.join(format!("{name}.wasm")), &wasm)?;
    let host = Host::start(HostOptions {
        driver_name: "check.wasmcsi.io".into(),
        mode: wasmcsi_csi::Mode::All,
        node_id: "check-node".into(),
        socket: scratch.path().join("csi.sock"),
        config,
        config_file: None,
        backends_dir: Some(backends),
        state_dir: scratch.path().join("state"),
        reload_interval: Duration::from_secs(3600),
        metrics_addr: None,
        replicas: scratch_replicas.then(|| ReplicaOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            root: scratch.path().join("replicas/check-node"),
            disks: vec![],
            labels: vec![],
        }),
        reconcile: None,
    })
    .await?;
    let mut replica_servers = Vec::new();
    if scratch_replicas {
        let own = host.datapath.as_ref().context("the check host serves no replicas")?.local_addr();
        let mut addrs = vec![own.to_string()];
        for i in 1..=2 {
            let node = format!("check-replica-{i}");
            let root = scratch.path().join("replicas").join(&node);
            std::fs::create_dir_all(&root)?;
            let replicas = Arc::new(ReplicaNode::open(&root)?);
            let identity = NodeIdentity { node, labels: vec![] };
            let server =
                ReplicaServer::serve("127.0.0.1:0", replicas, ServerConfig { identity, ..ServerConfig::plaintext() })
                    .await?;
            addrs.push(server.local_addr().to_string());
            replica_servers.push(server);
        }
        std::fs::write(&nodes_file, addrs.join("\n") + "\n")?;
        println!("replica nodes: {} (scratch: this host's and two in this process)", addrs.join(", "));
    }
    let Some(backend) = host.registry.get(&name) else {
        println!("\nFAIL: the component does not load (see the log line above)");
        host.shutdown().await?;
        return Ok(false);
    };
    println!("info: {} {} — features: {:?}", backend.info.name, backend.info.version, backend.info.features);
    println!("parameters: {}", backend.info.parameters.join(", "));

    // 3. The suite.
    let mut parameters: HashMap<String, String> = args.params.into_iter().collect();
    parameters.insert("backend".into(), name.clone());
    let node = !args.no_node && nix::unistd::geteuid().is_root();
    let profile = Profile {
        parameters,
        capability: mount_capability(),
        required_bytes: 1 << 20,
        node,
        work_dir: scratch.path().join("node"),
        secrets: args.secrets.into_iter().collect(),
    };
    let report = conformance::run(&host.socket, &profile).await?;
    host.shutdown().await?;
    for server in replica_servers {
        server.shutdown().await?;
    }
    println!("\nconformance ({}):", if node { "controller + node" } else { "controller only; node checks need root" });
    print!("{}", report.render());
    Ok(report.passed())
}

pub fn mount_capability() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}
