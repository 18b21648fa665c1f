//! Everything one backend call can make the host write (its log lines with
//! their field names and values, and its error message) fits one byte budget, however the
//! guest calls `log`. Its own test binary: it installs the process's tracing subscriber.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::driver::{CapacityRange, CreateVolumeRequest, Pair};
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{CallError, Runtime, RuntimeOptions, WitError};

/// The budget docs/operating.md documents: 16 KiB per call, of which 1 KiB is the error message.
const BYTES_PER_CALL: usize = 16 << 10;
const MAX_ERROR_MESSAGE: usize = 1 << 10;
/// What the host adds to each guest line (time, level, target, span, `backend=`, `fields=`),
/// at most 65 lines (64 and the one saying the guest is muted).
const HOST_PART: usize = 65 * 400;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_a_backend_makes_the_host_log_in_one_call_fits_one_budget() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .unwrap();
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("hostile")).unwrap();
    let text = format!(
        "[runtime]\ncall_deadline_ms = 20000\nimport_timeout_ms = 1000\n\
         [backends.hostile.grants]\ndir = {{ default = \"{}/hostile\" }}\n",
        d.path().display()
    );
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::parse(&text, Path::new("test")).unwrap(),
        cache_dir: Some(d.path().join("cache")),
        store_path: d.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 64, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let b = rt.load("hostile", wasmcsi_artifacts::HOSTILE, None).await.unwrap();
    let request = CreateVolumeRequest {
        name: "v".into(),
        capacity: CapacityRange { required_bytes: 1, limit_bytes: 0 },
        capabilities: vec![],
        parameters: vec![Pair { key: "mode".into(), value: "log-flood".into() }],
        secrets: vec![],
        content_source: None,
        accessibility: None,
        mutable_parameters: vec![],
    };
    let before = captured.0.lock().unwrap().len();
    let r = b.create_volume(request, vec![]).await;
    let e = r.unwrap_err();
    assert!(matches!(&e, CallError::Backend { error: WitError::Internal(_), .. }), "{e}");
    // The CSI layer logs a failed call once, as this line does.
    tracing::warn!("{e}");
    let written = captured.0.lock().unwrap().len() - before;
    let message = e.to_string().len();
    assert!(
        written <= BYTES_PER_CALL + HOST_PART && message <= MAX_ERROR_MESSAGE + 100,
        "one call made the host write {written} bytes, with an error message of {message} bytes"
    );
}
