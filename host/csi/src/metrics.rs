//! What the CSI layer measures itself: how long each CSI call took, by method and gRPC code
//! (`wasmcsi_csi_request_duration_seconds`). The runtime's `Metrics` owns the backend series
//! and the request counter; this registry is the CSI layer's, so neither crate reaches into
//! the other's, and the `/metrics` endpoint in the binary writes both. One registry per
//! process, like the CSI socket it measures.
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::OnceLock;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    /// The gRPC code as `wasmcsi_csi_requests_total` spells it (`NotFound`).
    pub code: String,
}

fn request_histogram() -> Histogram {
    // 100 µs .. ~52 s: an Identity call is well under a millisecond, a NodeStage that runs
    // mkfs or waits on an rbd-fuse mount is seconds.
    Histogram::new(exponential_buckets(1e-4, 2.0, 20))
}

pub struct CsiMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Histogram, fn() -> Histogram>,
}

impl CsiMetrics {
    fn new() -> Self {
        let requests: Family<RequestLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(request_histogram);
        let mut registry = Registry::with_prefix("wasmcsi");
        registry.register(
            "csi_request_duration_seconds",
            "CSI request latency by method and gRPC code",
            requests.clone(),
        );
        Self { registry, requests }
    }

    /// Record one finished CSI call.
    pub fn observe(&self, method: &str, code: &str, seconds: f64) {
        self.requests.get_or_create(&RequestLabels { method: method.into(), code: code.into() }).observe(seconds);
    }

    /// The text exposition of these series, without the closing `# EOF` (the endpoint
    /// writes it once, after every registry).
    pub fn encode_without_eof(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode_registry(out, &self.registry)
    }
}

/// The process's CSI metrics.
pub fn global() -> &'static CsiMetrics {
    static METRICS: OnceLock<CsiMetrics> = OnceLock::new();
    METRICS.get_or_init(CsiMetrics::new)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn a_call_lands_in_its_method_and_code_bucket() {
        let m = CsiMetrics::new();
        m.observe("NodeStageVolume", "NotFound", 0.003);
        m.observe("NodeStageVolume", "NotFound", 0.5);
        let mut out = String::new();
        m.encode_without_eof(&mut out).unwrap();
        assert!(out.contains("# TYPE wasmcsi_csi_request_duration_seconds histogram"), "{out}");
        let count = out
            .lines()
            .find(|l| {
                l.starts_with("wasmcsi_csi_request_duration_seconds_count")
                    && l.contains(r#"method="NodeStageVolume""#)
                    && l.contains(r#"code="NotFound""#)
            })
            .unwrap_or_else(|| panic!("no count line: {out}"));
        assert!(count.ends_with(" 2"), "{count}");
        assert!(!out.contains("# EOF"), "{out}");
    }
}
