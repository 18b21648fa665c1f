//! Backends named by an OCI `source` in the configuration (`[backends.NAME] source =
//! "oci://…@sha256:…"`): each scan pulls what a source names into the artifact cache (in the
//! state directory), verified by `wasmcsi_oci` (digests, the Wasm layout, size, signatures when
//! keys are configured), and loads it through the same path as a file of the backends
//! directory. A source is pulled when it is new or changed and again under a new
//! configuration (keys may have changed: the cached signature is verified again); a pull or
//! verification that fails is logged once, the previous version keeps serving, and it is tried
//! again after `[oci] retry_interval_ms`.
use super::{Registry, ScanReport};
use crate::config::HostConfig;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use wasmcsi_oci::{ArtifactCache, ClientOptions, FetchPolicy, PublicKeys, RegistryClient, Source};

/// What a backend with a source is serving and how its last attempt went (`backend ls` of a
/// running host, metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceStatus {
    /// the configured source
    pub source: String,
    /// the manifest digest serving, when one does
    pub serving: Option<String>,
    /// why the last attempt failed, when it did
    pub failed: Option<String>,
}

#[derive(Default)]
pub(super) struct Sources {
    cache: std::sync::OnceLock<ArtifactCache>,
    state: std::sync::Mutex<HashMap<String, (SourceStatus, Option<Instant>)>>,
}

impl Registry {
    /// Keep pulled backends in `dir` (the host's state directory's `artifacts/`). Without it a
    /// configured source is refused, saying so.
    pub fn set_artifact_cache(&self, dir: PathBuf) {
        let _ = self.sources.cache.set(ArtifactCache::new(dir));
    }

    /// The status of every backend with a source.
    pub fn sources(&self) -> Vec<(String, SourceStatus)> {
        let state = self.sources.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out: Vec<_> = state.iter().map(|(n, (s, _))| (n.clone(), s.clone())).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Rebuild `wasmcsi_backend_info` and `wasmcsi_backend_source_failing` from what serves now.
    pub(super) fn publish_info(&self) {
        let metrics = &self.runtime.metrics;
        let sources: HashMap<String, SourceStatus> = self.sources().into_iter().collect();
        metrics.backend_info.clear();
        metrics.source_failing.clear();
        for b in self.all() {
            let sourced = sources.get(&b.name).filter(|s| s.serving.is_some());
            let (digest, source) = match sourced {
                Some(s) => (s.serving.clone().unwrap_or_default(), s.source.clone()),
                None => (
                    format!("sha256:{}", b.digest),
                    b.path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "embedded".into()),
                ),
            };
            let labels = crate::metrics::BackendInfoLabels {
                backend: b.name.clone(),
                digest,
                source,
                contract: b.contract.to_string(),
            };
            metrics.backend_info.get_or_create(&labels).set(1);
        }
        for (name, status) in &sources {
            if status.failed.is_some() {
                let labels = crate::metrics::SourceLabels { backend: name.clone(), source: status.source.clone() };
                metrics.source_failing.get_or_create(&labels).set(1);
            }
        }
    }

    fn source_state(&self) -> std::sync::MutexGuard<'_, HashMap<String, (SourceStatus, Option<Instant>)>> {
        self.sources.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One pass over the configured sources (under the scan's lock).
    pub(super) async fn scan_sources(&self, report: &mut ScanReport, reconfigured: bool) {
        let config = self.runtime.config();
        // A source taken out of the configuration takes its backend with it.
        let gone: Vec<String> = self
            .source_state()
            .keys()
            .filter(|name| config.backends.get(*name).is_none_or(|b| b.source.is_none()))
            .cloned()
            .collect();
        for name in gone {
            self.source_state().remove(&name);
            if self.remove(&name) {
                if let Ok(mut d) = self.departed.lock() {
                    d.insert(name.clone(), Instant::now());
                }
                tracing::warn!(backend = %name, "backend source removed from the configuration; backend unloaded");
                report.removed.push(name);
            }
        }
        for (name, backend) in &config.backends {
            let Some(source) = &backend.source else { continue };
            let due = {
                let mut state = self.source_state();
                let (status, failed_at) = state.entry(name.clone()).or_default();
                if status.source != *source {
                    *status = SourceStatus { source: source.clone(), serving: status.serving.take(), failed: None };
                    *failed_at = None;
                    true
                } else if reconfigured {
                    true
                } else if status.failed.is_some() {
                    failed_at.is_none_or(|at| at.elapsed() >= config.oci.retry_interval())
                } else {
                    status.serving.is_none()
                }
            };
            if !due {
                continue;
            }
            if let Ok(mut l) = self.loading.lock() {
                l.insert(name.clone());
            }
            let started = Instant::now();
            let outcome = self.pull_and_load(name, source, &config).await;
            if let Ok(mut l) = self.loading.lock() {
                l.remove(name);
            }
            let mut state = self.source_state();
            let (status, failed_at) = state.entry(name.clone()).or_default();
            match outcome {
                Ok((fetched, b)) => {
                    tracing::info!(
                        backend = %name, source = %source, pinned = %fetched.pinned, digest = %b.digest,
                        version = %b.info.version, contract = %b.contract,
                        signed_by = ?fetched.signed_by, from_cache = fetched.from_cache,
                        took_ms = started.elapsed().as_millis() as u64,
                        "backend loaded from its source"
                    );
                    status.serving = Some(fetched.manifest_digest);
                    status.failed = None;
                    *failed_at = None;
                    report.loaded.push(name.clone());
                }
                Err(why) => {
                    let serving = self.get(name).map(|b| b.digest.clone());
                    // Once per distinct failure, not once per retry.
                    if status.failed.as_deref() != Some(why.as_str()) {
                        let keeps =
                            if serving.is_some() { "the previous version keeps serving" } else { "nothing serves it" };
                        tracing::error!(backend = %name, source = %source, previous = ?serving, "backend source refused, {keeps}: {why}");
                    }
                    self.runtime
                        .metrics
                        .rejected
                        .get_or_create(&crate::metrics::BackendLabels { backend: name.clone() })
                        .inc();
                    status.failed = Some(why.clone());
                    *failed_at = Some(Instant::now());
                    report.rejected.push((name.clone(), why));
                }
            }
        }
    }

    async fn pull_and_load(
        &self,
        name: &str,
        source: &str,
        config: &HostConfig,
    ) -> Result<(wasmcsi_oci::Fetched, Arc<crate::Backend>), String> {
        let cache = self.sources.cache.get().ok_or("no artifact cache: the host keeps one in its state directory")?;
        let parsed = Source::parse(source).map_err(|e| e.to_string())?;
        let backend = config.backends.get(name);
        let keys = PublicKeys::load(config.public_keys_for(name)).map_err(|e| e.to_string())?;
        let client = RegistryClient::new(ClientOptions {
            ca_file: config.oci.ca_file.clone(),
            docker_config: config.oci.docker_config.clone(),
            request_timeout: config.oci.request_timeout(),
            max_layer_bytes: config.oci.max_layer_bytes(),
        })
        .map_err(|e| e.to_string())?;
        let policy = FetchPolicy { allow_tag: backend.is_some_and(|b| b.allow_tag), keys };
        let fetched = wasmcsi_oci::fetch(&client, &parsed, cache, &policy).await.map_err(|e| e.to_string())?;
        let serving = self.get(name);
        let config_now = self.runtime.config();
        if let Some(b) =
            serving.filter(|b| b.digest == crate::Runtime::digest(&fetched.wasm) && Arc::ptr_eq(&b.config, &config_now))
        {
            return Ok((fetched, b));
        }
        let loaded = self.install(name, &fetched.wasm, Some(fetched.path.clone())).await.map_err(|e| e.to_string())?;
        Ok((fetched, loaded))
    }
}
