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
            for g in b.grants.rbd.iter().flatten() {
                if !self.clusters.contains_key(&g.cluster) {
                    return Err(invalid(format!(
                        "rbd grant names cluster {:?}, which no [clusters.NAME] defines",
                        g.cluster
                    )));
                }
            }
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
