//! Prometheus metrics: per backend calls, errors by code, latency, traps, timeouts, memory
//! peak, `kv` usage, loads and rejected files; configuration files put in force or refused; and
//! per CSI method requests by code (recorded by the CSI layer). One registry, encoded by the
//! `/metrics` endpoint in the binary.
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub backend: String,
    pub op: String,
}

/// The labels of `wasmcsi_backend_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub backend: String,
    pub op: String,
    /// The gRPC code the CSI caller got, spelled as every `code` label is (grpc-go's names,
    /// as the kubernetes-csi sidecars' metrics spell them: `NotFound`, `OK`); see
    /// [`crate::CallError::code`].
    pub code: String,
    /// How the call failed ([`crate::CallError::kind`]): `error` (the backend answered one),
    /// `timeout`, `out-of-memory`, `out-of-fuel`, `trap`, `bad-output`, `busy`. Not a gRPC
    /// code: several kinds end in the same code (a trap and a bad answer are both `Internal`).
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub backend: String,
}

/// The labels of `wasmcsi_backend_info`: which build of each backend serves on this pod.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendInfoLabels {
    pub backend: String,
    /// `sha256:HEX`: the artifact's manifest digest for a backend with an OCI source, the
    /// component file's own digest for one from the backends directory
    pub digest: String,
    /// the configured `oci://` source, or the component file
    pub source: String,
    /// the contract version it was built against, e.g. `wasmcsi:backend@0.2.0`
    pub contract: String,
}

/// The labels of `wasmcsi_backend_source_failing`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub backend: String,
    pub source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: String,
    /// The gRPC code, spelled as in [`ErrorLabels::code`].
    pub code: String,
}

fn latency_histogram() -> Histogram {
    // 5 µs .. ~42 s: a pooled instantiate+call is microseconds, a hung import seconds.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(5e-6, 2.0, 24))
}

/// All metrics of the process.
pub struct Metrics {
    registry: Mutex<Registry>,
    pub calls: Family<CallLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub latency: Family<CallLabels, Histogram, fn() -> Histogram>,
    pub traps: Family<BackendLabels, Counter>,
    pub timeouts: Family<BackendLabels, Counter>,
    pub memory_peak: Family<BackendLabels, Gauge<u64, AtomicU64>>,
    pub reloads: Family<BackendLabels, Counter>,
    pub rejected: Family<BackendLabels, Counter>,
    /// configuration files put in force after a change (the one read at start not counted)
    pub config_loads: Counter,
    /// changed configuration files refused (the one in force kept serving)
    pub config_rejected: Counter,
    pub rpcs: Family<RpcLabels, Counter>,
    pub kv_bytes: Family<BackendLabels, Gauge<u64, AtomicU64>>,
    pub kv_keys: Family<BackendLabels, Gauge<u64, AtomicU64>>,
    /// 1 per serving backend build (rebuilt after every scan)
    pub backend_info: Family<BackendInfoLabels, Gauge>,
    /// 1 per configured OCI source whose last pull or verification failed
    pub source_failing: Family<SourceLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let m = Self {
            registry: Mutex::new(Registry::with_prefix("wasmcsi")),
            calls: Family::default(),
            errors: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            traps: Family::default(),
            timeouts: Family::default(),
            memory_peak: Family::default(),
            reloads: Family::default(),
            rejected: Family::default(),
            config_loads: Counter::default(),
            config_rejected: Counter::default(),
            rpcs: Family::default(),
            kv_bytes: Family::default(),
            kv_keys: Family::default(),
            backend_info: Family::default(),
            source_failing: Family::default(),
        };
        if let Ok(mut r) = m.registry.lock() {
            r.register("backend_calls", "Backend calls", m.calls.clone());
            r.register(
                "backend_errors",
                "Backend calls that failed, by the gRPC code the caller got and how the call failed",
                m.errors.clone(),
            );
            r.register("backend_call_duration_seconds", "Instantiate + call latency", m.latency.clone());
            r.register("backend_traps", "Calls that trapped (panics, OOM, bugs)", m.traps.clone());
            r.register("backend_timeouts", "Calls stopped at their deadline", m.timeouts.clone());
            r.register("backend_memory_peak_bytes", "Largest linear memory a call grew to", m.memory_peak.clone());
            r.register("backend_loads", "Component versions loaded (start and hot reload)", m.reloads.clone());
            r.register("backend_rejected", "Component files rejected at load", m.rejected.clone());
            r.register("config_loads", "Changed configuration files put in force", m.config_loads.clone());
            r.register(
                "config_rejected",
                "Changed configuration files refused (the previous configuration kept serving)",
                m.config_rejected.clone(),
            );
            r.register("csi_requests", "CSI requests by method and gRPC code", m.rpcs.clone());
            r.register(
                "backend_kv_bytes",
                "Bytes the backend's kv namespace uses (keys + values + 64 per key)",
                m.kv_bytes.clone(),
            );
            r.register("backend_kv_keys", "Keys in the backend's kv namespace", m.kv_keys.clone());
            r.register(
                "backend_info",
                "The backend build serving: its digest, where it came from and its contract (1 per backend)",
                m.backend_info.clone(),
            );
            r.register(
                "backend_source_failing",
                "Configured OCI sources whose last pull or verification failed (the previous version serves)",
                m.source_failing.clone(),
            );
        }
        m
    }

    /// Record a finished CSI request.
    pub fn rpc(&self, method: &str, code: &str) {
        self.rpcs.get_or_create(&RpcLabels { method: method.into(), code: code.into() }).inc();
    }

    /// Show a backend's `kv` usage.
    pub fn kv_usage(&self, backend: &str, usage: crate::metadata::KvUsage) {
        let labels = BackendLabels { backend: backend.into() };
        self.kv_bytes.get_or_create(&labels).set(usage.bytes);
        self.kv_keys.get_or_create(&labels).set(usage.keys);
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(r) = self.registry.lock() {
            let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        }
        out
    }
}
