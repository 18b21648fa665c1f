//! `wasmcsi backend push | pull | sign | keygen`: backends as OCI artifacts by hand. The registry
//! work is `wasmcsi_oci`; this module parses arguments, loads a component to read its `info()`
//! and contract for the artifact's annotations, and prints what happened.
use anyhow::Context;
use std::path::PathBuf;
use std::time::Duration;
use wasmcsi_oci::{ArtifactAnnotations, ArtifactCache, ClientOptions, FetchPolicy, PublicKeys, RegistryClient, Source};
use wasmcsi_runtime::capabilities::Capability;
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{Runtime, RuntimeOptions};

/// How to reach the registry.
#[derive(clap::Args, Debug)]
pub struct RegistryArgs {
    /// A docker `config.json` with the registry's credentials (`docker login` writes one; a
    /// Kubernetes dockerconfigjson Secret holds one). Default: `$DOCKER_CONFIG/config.json`,
    /// else `~/.docker/config.json`; none found: anonymous.
    #[arg(long)]
    pub docker_config: Option<PathBuf>,
    /// PEM CA certificates to trust beside the system's (a private registry's CA).
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// Bound of each registry request, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub timeout_ms: u64,
    /// The largest component pulled, in MiB.
    #[arg(long, default_value_t = 64)]
    pub max_layer_mib: u64,
}

impl RegistryArgs {
    fn client(&self) -> anyhow::Result<RegistryClient> {
        Ok(RegistryClient::new(ClientOptions {
            ca_file: self.ca_file.clone(),
            docker_config: self.docker_config.clone().or_else(wasmcsi_oci::auth::default_docker_config),
            request_timeout: Duration::from_millis(self.timeout_ms.max(1)),
            max_layer_bytes: self.max_layer_mib.saturating_mul(1 << 20),
        })?)
    }
}

#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// The component (`NAME.wasm`); it is loaded first, and its `info()` and contract version
    /// written into the artifact's annotations.
    pub file: PathBuf,
    /// Where to: `oci://REGISTRY/REPO:TAG`. The digest to pin in the configuration is printed.
    pub target: String,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

#[derive(clap::Args, Debug)]
pub struct PullArgs {
    /// What: `oci://REGISTRY/REPO@sha256:HEX` (a tag only with --allow-tag).
    pub source: String,
    /// Where to write the component (default: `NAME.wasm` in the current directory, NAME its
    /// title annotation, else the repository's last segment).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Resolve a tag to a digest (printed) instead of refusing it.
    #[arg(long)]
    pub allow_tag: bool,
    /// A public key (PEM) of which one must have signed the artifact (repeatable); none: no
    /// signature required.
    #[arg(long = "public-key")]
    pub public_keys: Vec<PathBuf>,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

#[derive(clap::Args, Debug)]
pub struct SignArgs {
    /// What: `oci://REGISTRY/REPO@sha256:HEX` (a digest: a tag may name other bytes tomorrow).
    pub artifact: String,
    /// The private key (unencrypted PKCS#8 PEM, ECDSA P-256; `backend keygen` writes one).
    #[arg(long)]
    pub key: PathBuf,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

#[derive(clap::Args, Debug)]
pub struct KeygenArgs {
    /// Write `PREFIX.key` (private, mode 0600) and `PREFIX.pub` (public, for `public_keys`).
    #[arg(default_value = "wasmcsi")]
    pub prefix: PathBuf,
}

/// Load `wasm` in a scratch runtime, granting whatever it imports (reaching nothing), to read
/// what the annotations say.
async fn annotations_of(name: &str, wasm: &[u8]) -> anyhow::Result<ArtifactAnnotations> {
    let scratch = tempfile::tempdir()?;
    let mut config = wasmcsi_runtime::config::HostConfig::default();
    let runtime = |config| {
        Runtime::new(RuntimeOptions {
            config,
            cache_dir: None,
            store_path: scratch.path().join("push.redb"),
            wasm_engine: WasmEngineSettings { max_instances: 8, ..Default::default() },
        })
    };
    let (imports, _) = runtime(config.clone())?.inspect(name, wasm)?;
    let grants = &mut config.backends.entry(name.into()).or_default().grants;
    for c in &imports.capabilities {
        match c {
            Capability::Dir => {
                let root = scratch.path().join("root");
                std::fs::create_dir_all(&root)?;
                grants.dir.insert("default".into(), root);
            }
            Capability::Nfs => grants.nfs = Some(vec![]),
            Capability::Rbd => grants.rbd = Some(vec![]),
            Capability::Block => {
                let nodes = scratch.path().join("nodes");
                std::fs::write(&nodes, "")?;
                grants.block =
                    Some(wasmcsi_block::catalog::NodeSources { nodes_file: Some(nodes), ..Default::default() });
            }
            _ => {}
        }
    }
    let backend = runtime(config)?.load(name, wasm, None).await?;
    let info = serde_json::json!({
        "name": backend.info.name,
        "version": backend.info.version,
        // The WIT enum's Debug is `Feature::CreateDeleteVolume`: the case alone.
        "features": backend.info.features.iter().map(|f| format!("{f:?}").trim_start_matches("Feature::").to_string()).collect::<Vec<_>>(),
        "parameters": backend.info.parameters,
    });
    Ok(ArtifactAnnotations {
        name: name.into(),
        version: backend.info.version.clone(),
        contract: backend.contract.to_string(),
        info: info.to_string(),
    })
}

/// `backend push FILE oci://…:TAG`.
pub async fn push(args: PushArgs) -> anyhow::Result<()> {
    let name = crate::check::backend_name(&args.file)?;
    let wasm = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    if let Some(why) = crate::backend_dir::not_a_component(&wasm) {
        anyhow::bail!("{}: {why}", args.file.display());
    }
    let target = Source::parse(&args.target)?;
    anyhow::ensure!(target.tag.is_some() && target.digest.is_none(), "push to a tag (oci://REGISTRY/REPO:TAG)");
    let annotations = annotations_of(&name, &wasm).await.with_context(|| format!("loading {}", args.file.display()))?;
    let pinned = wasmcsi_oci::push(&args.registry.client()?, &target, &wasm, &annotations).await?;
    println!(
        "pushed {} ({} bytes, {} {}, contract {})",
        args.file.display(),
        wasm.len(),
        name,
        annotations.version,
        annotations.contract
    );
    println!("{pinned}");
    Ok(())
}

/// `backend pull oci://…@sha256:… [-o FILE]`.
pub async fn pull(args: PullArgs) -> anyhow::Result<()> {
    let source = Source::parse(&args.source)?;
    let client = args.registry.client()?;
    // Through a scratch cache: the same verified path the host pulls by.
    let scratch = tempfile::tempdir()?;
    let cache = ArtifactCache::new(scratch.path());
    let policy = FetchPolicy { allow_tag: args.allow_tag, keys: PublicKeys::load(&args.public_keys)? };
    let fetched = wasmcsi_oci::fetch(&client, &source, &cache, &policy).await?;
    let title = fetched.annotations.get(wasmcsi_oci::artifact::ANNOTATION_TITLE).cloned();
    let name = title.unwrap_or_else(|| source.repository.rsplit('/').next().unwrap_or("backend").to_string());
    let output = args.output.unwrap_or_else(|| PathBuf::from(format!("{name}.wasm")));
    // Renamed into place: a backends directory being watched never sees half a file.
    let partial = output.with_extension("wasm.partial");
    std::fs::write(&partial, &fetched.wasm).with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &output).with_context(|| format!("writing {}", output.display()))?;
    println!("{}", fetched.pinned);
    for (k, v) in &fetched.annotations {
        println!("  {k}: {v}");
    }
    if let Some(key) = &fetched.signed_by {
        println!("  signature verified with {}", key.display());
    }
    println!("wrote {} ({} bytes)", output.display(), fetched.wasm.len());
    Ok(())
}

/// `backend sign oci://…@sha256:… --key KEY`.
pub async fn sign(args: SignArgs) -> anyhow::Result<()> {
    let artifact = Source::parse(&args.artifact)?;
    let key = wasmcsi_oci::SigningKey::load(&args.key)?;
    let signature = wasmcsi_oci::sign(&args.registry.client()?, &artifact, &key).await?;
    let tag = wasmcsi_oci::signature::signature_tag(artifact.digest.as_deref().unwrap_or_default());
    println!("signed {artifact}");
    println!("signature: {}@{signature}", artifact.at_tag(&tag));
    Ok(())
}

/// `backend keygen [PREFIX]`.
pub fn keygen(args: KeygenArgs) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let (private, public) = wasmcsi_oci::SigningKey::generate()?;
    let key = args.prefix.with_extension("key");
    let pubkey = args.prefix.with_extension("pub");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&key)
        .with_context(|| format!("creating {} (an existing key is never overwritten)", key.display()))?;
    f.write_all(private.as_bytes())?;
    std::fs::write(&pubkey, public).with_context(|| format!("writing {}", pubkey.display()))?;
    println!("wrote {} (private: keep it secret) and {} (public: [oci] public_keys)", key.display(), pubkey.display());
    Ok(())
}
