//! The host configuration file (TOML): sandbox limits and, per backend, the capability
//! grants the operator gives it. Only parsing and validation live here; what a grant means
//! at run time lives with each capability in `host/`.
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors reading or validating the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing config {path}: {source}")]
    Parse { path: PathBuf, source: Box<toml::de::Error> },
    #[error("config: backend {backend:?}: {message}")]
    Invalid { backend: String, message: String },
}

/// The whole file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    #[serde(default)]
    pub runtime: Limits,
    /// Per backend (by file stem): limits overriding `[runtime]`, and grants.
    #[serde(default)]
    pub backends: BTreeMap<String, BackendConfig>,
    /// Ceph clusters by the name StorageClasses and `rbd` grants use (ceph-csi's `clusterID`):
    /// the controller's `rbd` capability and the node's rbd executor connect through these.
    #[serde(default)]
    pub clusters: BTreeMap<String, CephCluster>,
    /// Backup targets by the name `backup` grants and VolumeSnapshotClasses use
    /// (`[backup_targets.NAME]`: `kind = "s3"` or `"filesystem"`, see `wasmcsi_backup`).
    #[serde(default)]
    pub backup_targets: wasmcsi_backup::BackupTargets,
    /// How backends named by an OCI `source` are pulled and verified (`[oci]`).
    #[serde(default)]
    pub oci: OciSettings,
}

/// Registries, for every backend with a `source` (`wasmcsi_oci`). Credentials never live here:
/// they are in the docker config file named (a mounted `dockerconfigjson` Secret).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OciSettings {
    /// PEM CA certificates trusted beside the system's (a private registry's CA).
    pub ca_file: Option<PathBuf>,
    /// A docker `config.json` with registry credentials (a mounted `kubernetes.io/dockerconfigjson`
    /// Secret's `.dockerconfigjson`); none: anonymous pulls.
    pub docker_config: Option<PathBuf>,
    /// The largest component pulled; a larger layer is refused before its first byte.
    pub max_layer_mib: u64,
    /// Bound of each registry request, and of the silence between two chunks of a layer.
    pub request_timeout_ms: u64,
    /// After a pull or a verification failed, how long before the same source is tried again
    /// (the previous version serves meanwhile).
    pub retry_interval_ms: u64,
    /// Public keys (PEM, ECDSA P-256, as `cosign generate-key-pair` or `wasmcsi backend keygen`
    /// write them) of which one must have signed every pulled backend; a backend's own
    /// `public_keys` replaces this list. Empty: signatures are not required.
    pub public_keys: Vec<PathBuf>,
}

impl Default for OciSettings {
    fn default() -> Self {
        Self {
            ca_file: None,
            docker_config: None,
            // A component is a few MiB (the bundled ones 0.2–3 MiB); 64 leaves room and still
            // bounds what a hostile registry can make a pod write.
            max_layer_mib: 64,
            request_timeout_ms: 30_000,
            retry_interval_ms: 30_000,
            public_keys: Vec::new(),
        }
    }
}

impl OciSettings {
    pub fn max_layer_bytes(&self) -> u64 {
        self.max_layer_mib.saturating_mul(1 << 20)
    }
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
    pub fn retry_interval(&self) -> Duration {
        Duration::from_millis(self.retry_interval_ms)
    }
}

/// One Ceph cluster: where its monitors are. Credentials never live here: they come with each
/// CSI call's secrets.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CephCluster {
    /// `host:port` or `[v2:host:3300,v1:host:6789]` entries, as `mon_host` takes them
    pub monitors: Vec<String>,
}

/// Sandbox limits. `[runtime]` sets the defaults; `[backends.NAME]` may override each.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Linear memory a guest may grow to. A Rust guest that hits it traps (OOM).
    pub memory_limit_mib: u64,
    /// Wall-clock deadline of one backend call, host imports included.
    pub call_deadline_ms: u64,
    /// Deadline of each network host import (nfs, block, rbd): epochs cannot interrupt a
    /// blocked host call, so those carry their own timeout, shorter than the call's. Local
    /// imports (`dir`, `kv`) run inline in microseconds (see `capabilities::local_io`).
    pub import_timeout_ms: u64,
    /// Calls of one backend running at once; more wait up to the call deadline.
    pub max_concurrent_calls: u32,
    /// Optional instruction budget per call (wasmtime fuel); 0 = unlimited.
    pub fuel: u64,
    /// Bytes the backend's `kv` namespace may hold (keys + values + 64 per key): the store is
    /// shared with the host's own volume journal and never shrinks on disk.
    pub kv_quota_bytes: u64,
    /// Keys the backend's `kv` namespace may hold.
    pub kv_quota_keys: u64,
    /// Bytes one transfer from the guest (an export's answer, or one import call's arguments)
    /// may make the host allocate. Lifting copies every string and list the answer names, and
    /// one guest buffer can be named many times, so without this bound 1 MiB of guest memory
    /// lifts as gigabytes (wasmtime's own default is 128 MiB, which cost ~320 MiB per call).
    pub transfer_limit_mib: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_limit_mib: 64,
            call_deadline_ms: 5_000,
            import_timeout_ms: 3_000,
            max_concurrent_calls: 16,
            fuel: 0,
            kv_quota_bytes: 64 << 20,
            kv_quota_keys: 100_000,
            // Above the largest honest answer (a page or an error the host clips, a 2 MiB log
            // call) and the 4 MiB a gRPC client takes; far below what a node can spare.
            transfer_limit_mib: 16,
        }
    }
}

impl Limits {
    pub fn memory_bytes(&self) -> usize {
        usize::try_from(self.memory_limit_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
    }
    pub fn call_deadline(&self) -> Duration {
        Duration::from_millis(self.call_deadline_ms)
    }
    pub fn import_timeout(&self) -> Duration {
        Duration::from_millis(self.import_timeout_ms)
    }
    pub fn transfer_limit_bytes(&self) -> usize {
        usize::try_from(self.transfer_limit_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
    }
    pub fn kv_quota(&self) -> crate::metadata::KvQuota {
        crate::metadata::KvQuota { bytes: self.kv_quota_bytes, keys: self.kv_quota_keys }
    }
}

/// Overrides of `[runtime]` for one backend, all optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub memory_limit_mib: Option<u64>,
    pub call_deadline_ms: Option<u64>,
    pub import_timeout_ms: Option<u64>,
    pub max_concurrent_calls: Option<u32>,
    pub fuel: Option<u64>,
    pub kv_quota_bytes: Option<u64>,
    pub kv_quota_keys: Option<u64>,
    pub transfer_limit_mib: Option<u64>,
    #[serde(default)]
    pub grants: Grants,
    /// Where the component comes from instead of `NAME.wasm` in the backends directory:
    /// `oci://REGISTRY/REPO@sha256:HEX`, pulled into the state directory's artifact cache and
    /// verified (see `[oci]`). A changed source rolls the new version out; one that cannot be
    /// pulled or verified leaves the previous version serving.
    pub source: Option<String>,
    /// Take a `source` naming a tag (`oci://REGISTRY/REPO:TAG`): it is resolved to a digest
    /// (logged) when the configuration is put in force. Off: a tag is refused.
    #[serde(default)]
    pub allow_tag: bool,
    /// The keys one of which must have signed this backend, replacing `[oci] public_keys`.
    pub public_keys: Option<Vec<PathBuf>>,
}

/// What a backend may import beyond `log`, `kv` and deny-by-default WASI.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grants {
    /// `dir`: root name → host directory. Root names are `[a-z0-9-]`, 1–32 bytes.
    #[serde(default)]
    pub dir: BTreeMap<String, PathBuf>,
    /// `nfs`: the servers/exports the userspace NFS client may reach. Absent: not granted (a
    /// backend importing `nfs` does not load); `nfs = []`: granted, reaching no server yet (the
    /// backend loads and every call naming a server is refused until the operator adds it).
    #[serde(default)]
    pub nfs: Option<Vec<NfsGrant>>,
    /// `block`: where the replica nodes this backend may place on are found (addresses, a file
    /// of addresses re-read every time, DNS names such as a headless Service).
    pub block: Option<wasmcsi_block::catalog::NodeSources>,
    /// `rbd`: per cluster, the pools this backend may use. Absent: not granted; `rbd = []`:
    /// granted, reaching no cluster yet (as `nfs`).
    #[serde(default)]
    pub rbd: Option<Vec<RbdGrant>>,
    /// `backup`: the names of the backup targets this backend may use (`[a-z0-9-]`, 1–32
    /// bytes; the targets themselves are the host's).
    #[serde(default)]
    pub backup: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NfsGrant {
    pub server: String,
    pub share: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RbdGrant {
    pub cluster: String,
    pub pools: Vec<String>,
}

/// A backend name (file stem) or a dir root name: `[a-z0-9-]`, 1–32 bytes, so it can prefix
/// CSI ids and never needs escaping.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && !name.starts_with('-')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl HostConfig {
    /// Read and validate a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        Self::parse(&text, path)
    }

    /// Parse and validate config text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        let cfg: HostConfig = toml::from_str(text)
            .map_err(|source| ConfigError::Parse { path: origin.into(), source: Box::new(source) })?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        Self::validate_limits("runtime", &self.runtime)?;
        for (name, b) in &self.backends {
            let invalid = |message: String| ConfigError::Invalid { backend: name.clone(), message };
            if !is_valid_name(name) {
                return Err(invalid("backend names are 1-32 of [a-z0-9-]".into()));
            }
            for (root, path) in &b.grants.dir {
                if !is_valid_name(root) {
                    return Err(invalid(format!("dir root {root:?}: names are 1-32 of [a-z0-9-]")));
                }
                if !path.is_absolute() {
                    return Err(invalid(format!("dir root {root:?}: {} is not an absolute path", path.display())));
                }
            }
            Self::validate_limits(name, &self.limits_for(name))?;
            for (i, target) in b.grants.backup.iter().enumerate() {
                if !is_valid_name(target) {
                    return Err(invalid(format!("backup target {target:?}: names are 1-32 of [a-z0-9-]")));
                }
                if b.grants.backup[..i].contains(target) {
                    return Err(invalid(format!("backup target {target:?} is granted twice")));
                }
            }
            if let Some(text) = &b.source {
                let source = wasmcsi_oci::Source::parse(text).map_err(|e| invalid(format!("source: {e}")))?;
                if source.digest.is_none() && !b.allow_tag {
                    return Err(invalid(format!(
                        "source {text} names a tag: pin a digest (@sha256:…) or set allow_tag = true"
                    )));
                }
            } else if b.allow_tag || b.public_keys.is_some() {
                return Err(invalid("allow_tag and public_keys go with a source".into()));
            }
            for g in b.grants.rbd.iter().flatten() {
                if !self.clusters.contains_key(&g.cluster) {
                    return Err(invalid(format!(
                        "rbd grant names cluster {:?}, which no [clusters.NAME] defines",
                        g.cluster
                    )));
                }
            }
        }
        let oci = &self.oci;
        if oci.max_layer_mib == 0 || oci.request_timeout_ms == 0 || oci.retry_interval_ms == 0 {
            return Err(ConfigError::Invalid {
                backend: "oci".into(),
                message: "max_layer_mib, request_timeout_ms and retry_interval_ms must be > 0".into(),
            });
        }
        for (name, c) in &self.clusters {
            let invalid = |message: String| ConfigError::Invalid { backend: format!("clusters.{name}"), message };
            if !is_valid_name(name) {
                return Err(invalid("cluster names are 1-32 of [a-z0-9-]".into()));
            }
            if c.monitors.is_empty() || c.monitors.iter().any(|m| m.is_empty() || m.contains(char::is_whitespace)) {
                return Err(invalid("monitors: one or more host:port entries, no whitespace".into()));
            }
        }
        Ok(())
    }

    fn validate_limits(backend: &str, limits: &Limits) -> Result<(), ConfigError> {
        let invalid = |message: &str| ConfigError::Invalid { backend: backend.into(), message: message.into() };
        if limits.call_deadline_ms == 0 || limits.import_timeout_ms == 0 || limits.max_concurrent_calls == 0 {
            return Err(invalid("deadlines and max_concurrent_calls must be > 0"));
        }
        if limits.import_timeout_ms > limits.call_deadline_ms {
            return Err(invalid("import_timeout_ms must not exceed call_deadline_ms"));
        }
        if limits.kv_quota_bytes == 0 || limits.kv_quota_keys == 0 {
            return Err(invalid("kv_quota_bytes and kv_quota_keys must be > 0"));
        }
        if limits.transfer_limit_mib == 0 {
            return Err(invalid("transfer_limit_mib must be > 0"));
        }
        Ok(())
    }

    /// Effective limits of one backend: its overrides over `[runtime]`.
    pub fn limits_for(&self, backend: &str) -> Limits {
        let base = self.runtime.clone();
        let Some(b) = self.backends.get(backend) else { return base };
        Limits {
            memory_limit_mib: b.memory_limit_mib.unwrap_or(base.memory_limit_mib),
            call_deadline_ms: b.call_deadline_ms.unwrap_or(base.call_deadline_ms),
            import_timeout_ms: b.import_timeout_ms.unwrap_or(base.import_timeout_ms),
            max_concurrent_calls: b.max_concurrent_calls.unwrap_or(base.max_concurrent_calls),
            fuel: b.fuel.unwrap_or(base.fuel),
            kv_quota_bytes: b.kv_quota_bytes.unwrap_or(base.kv_quota_bytes),
            kv_quota_keys: b.kv_quota_keys.unwrap_or(base.kv_quota_keys),
            transfer_limit_mib: b.transfer_limit_mib.unwrap_or(base.transfer_limit_mib),
        }
    }

    /// The keys a pulled backend must be signed by: its own list, else `[oci] public_keys`.
    pub fn public_keys_for(&self, backend: &str) -> &[PathBuf] {
        match self.backends.get(backend).and_then(|b| b.public_keys.as_deref()) {
            Some(keys) => keys,
            None => &self.oci.public_keys,
        }
    }

    /// Grants of one backend (none when it has no section).
    pub fn grants_for(&self, backend: &str) -> Grants {
        self.backends.get(backend).map(|b| b.grants.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_overrides_win_over_runtime_defaults() {
        let cfg = HostConfig::parse(
            "[runtime]\nmemory_limit_mib = 10\n[backends.hostpath]\ncall_deadline_ms = 7\nimport_timeout_ms = 5\n[backends.hostpath.grants]\ndir = { default = \"/srv\" }\n",
            Path::new("t"),
        )
        .expect("valid config");
        let l = cfg.limits_for("hostpath");
        assert_eq!((l.memory_limit_mib, l.call_deadline_ms, l.import_timeout_ms), (10, 7, 5));
        assert_eq!(cfg.grants_for("hostpath").dir["default"], PathBuf::from("/srv"));
        assert!(cfg.grants_for("other").dir.is_empty());
    }

    #[test]
    fn unknown_keys_and_bad_names_are_rejected() {
        assert!(HostConfig::parse("[runtime]\nmemory = 1\n", Path::new("t")).is_err());
        assert!(HostConfig::parse("[backends.Bad_Name]\n", Path::new("t")).is_err());
        let e = HostConfig::parse("[backends.a.grants]\ndir = { r = \"relative\" }\n", Path::new("t"));
        assert!(matches!(e, Err(ConfigError::Invalid { .. })), "{e:?}");
    }

    #[test]
    fn backup_targets_are_granted_by_name() {
        let cfg = HostConfig::parse("[backends.rb.grants]\nbackup = [\"s3-main\", \"nfs-dr\"]\n", Path::new("t"))
            .expect("valid config");
        assert_eq!(cfg.grants_for("rb").backup, ["s3-main", "nfs-dr"]);
        assert!(cfg.grants_for("other").backup.is_empty());
        for bad in ["backup = [\"S3\"]", "backup = [\"a\", \"a\"]", "backup = \"a\""] {
            assert!(HostConfig::parse(&format!("[backends.rb.grants]\n{bad}\n"), Path::new("t")).is_err(), "{bad}");
        }
    }

    #[test]
    fn kv_quotas_default_and_override_per_backend() {
        let cfg =
            HostConfig::parse("[runtime]\nkv_quota_bytes = 1000\n[backends.nfs]\nkv_quota_keys = 7\n", Path::new("t"))
                .expect("valid config");
        let q = cfg.limits_for("nfs").kv_quota();
        assert_eq!((q.bytes, q.keys), (1000, 7));
        assert_eq!(cfg.limits_for("other").kv_quota().keys, Limits::default().kv_quota_keys);
        assert!(HostConfig::parse("[runtime]\nkv_quota_keys = 0\n", Path::new("t")).is_err());
    }

    #[test]
    fn the_transfer_limit_defaults_to_16_mib_and_is_overridable_per_backend() {
        let cfg = HostConfig::parse("[backends.nfs]\ntransfer_limit_mib = 2\n", Path::new("t")).expect("valid config");
        assert_eq!(cfg.limits_for("nfs").transfer_limit_bytes(), 2 << 20);
        assert_eq!(cfg.limits_for("other").transfer_limit_bytes(), 16 << 20);
        assert!(HostConfig::parse("[runtime]\ntransfer_limit_mib = 0\n", Path::new("t")).is_err());
    }

    #[test]
    fn oci_sources_need_a_digest_unless_a_tag_is_allowed_and_keys_go_per_backend_or_for_all() {
        let d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let cfg = HostConfig::parse(
            &format!(
                "[oci]\npublic_keys = [\"/k/all.pub\"]\n[backends.a]\nsource = \"oci://r:5000/a@{d}\"\n\
                 [backends.b]\nsource = \"oci://r/b:v1\"\nallow_tag = true\npublic_keys = [\"/k/b.pub\"]\n"
            ),
            Path::new("t"),
        )
        .expect("valid config");
        assert_eq!(cfg.public_keys_for("a"), [PathBuf::from("/k/all.pub")]);
        assert_eq!(cfg.public_keys_for("b"), [PathBuf::from("/k/b.pub")]);
        assert_eq!(cfg.oci.max_layer_bytes(), 64 << 20);
        let tag = HostConfig::parse("[backends.b]\nsource = \"oci://r/b:v1\"\n", Path::new("t"))
            .expect_err("a tag without allow_tag");
        assert!(tag.to_string().contains("allow_tag"), "{tag}");
        for bad in ["source = \"https://r/b:v1\"", "allow_tag = true", "source = \"oci://r/b@sha256:00\""] {
            assert!(HostConfig::parse(&format!("[backends.b]\n{bad}\n"), Path::new("t")).is_err(), "{bad}");
        }
        assert!(HostConfig::parse("[oci]\nrequest_timeout_ms = 0\n", Path::new("t")).is_err());
    }

    /// `nfs = []` grants the capability with no server in it (the backend loads, reaching
    /// nothing), which an absent key does not; the same for `rbd`.
    #[test]
    fn an_empty_grant_list_grants_nothing_yet_and_an_absent_one_is_no_grant() {
        let cfg =
            HostConfig::parse("[backends.nfs.grants]\nnfs = []\n[backends.rbd.grants]\nrbd = []\n", Path::new("t"))
                .expect("valid config");
        assert_eq!(cfg.grants_for("nfs").nfs, Some(vec![]));
        assert_eq!(cfg.grants_for("rbd").rbd, Some(vec![]));
        assert_eq!((cfg.grants_for("other").nfs, cfg.grants_for("other").rbd), (None, None));
    }
}

/// Every host configuration the project shows an operator loads: the ```toml blocks of the
/// READMEs and of every page in `docs/`, and the ConfigMap's `config.toml` (a sample in the
/// docs once did not start).
#[cfg(test)]
mod shown_configurations {
    use super::HostConfig;
    use std::path::{Path, PathBuf};

    fn workspace() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// A Cargo manifest shown to a developer (`docs/vm-test-tier.md`), not a host configuration:
    /// only Cargo's own tables say so, so a host configuration with a mistyped table still fails.
    fn is_cargo_manifest(block: &str) -> bool {
        block.lines().any(|l| {
            matches!(l.trim(), "[package]" | "[dependencies]" | "[dev-dependencies]" | "[workspace.dependencies]")
        })
    }

    /// The ```toml blocks of a markdown file, dedented (blocks inside list items are indented).
    fn toml_blocks(markdown: &str) -> Vec<String> {
        let mut blocks = vec![];
        let mut open: Option<(usize, String)> = None;
        for line in markdown.lines() {
            let trimmed = line.trim_start();
            match &mut open {
                None if trimmed == "```toml" => open = Some((line.len() - trimmed.len(), String::new())),
                Some(_) if trimmed == "```" => blocks.extend(open.take().map(|(_, b)| b)),
                Some((indent, block)) => {
                    block.push_str(line.get(*indent..).unwrap_or(""));
                    block.push('\n');
                }
                None => {}
            }
        }
        blocks
    }

    #[test]
    fn every_configuration_in_the_docs_and_deploy_loads() {
        let mut checked = 0;
        let mut docs = vec![workspace().join("README.md"), workspace().join("deploy/README.md")];
        for entry in std::fs::read_dir(workspace().join("docs")).expect("docs/") {
            let path = entry.expect("docs/ entry").path();
            if path.extension().is_some_and(|e| e == "md") {
                docs.push(path);
            }
        }
        for path in &docs {
            let doc = path.display();
            let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{doc}: {e}"));
            for block in toml_blocks(&text).into_iter().filter(|b| !is_cargo_manifest(b)) {
                if let Err(e) = HostConfig::parse(&block, path) {
                    panic!("a configuration in {doc} does not load: {e}\n{block}");
                }
                checked += 1;
            }
        }
        let configmap = std::fs::read_to_string(workspace().join("deploy/configmap.yaml")).expect("configmap");
        let body: String = configmap
            .lines()
            .skip_while(|l| l.trim() != "config.toml: |")
            .skip(1)
            .take_while(|l| l.starts_with("    ") || l.trim().is_empty())
            .map(|l| format!("{}\n", l.get(4..).unwrap_or("")))
            .collect();
        assert!(body.contains("[runtime]"), "the ConfigMap's config.toml was found:\n{body}");
        HostConfig::parse(&body, Path::new("deploy/configmap.yaml")).expect("the ConfigMap's config.toml loads");
        assert!(checked >= 5, "only {checked} blocks found: the extraction is broken");
    }
}
