//! Backends named by an OCI `source`, against a real registry (distribution v2 with TLS and
//! basic auth): the registry pulls, verifies and loads them through the same scan as the
//! backends directory, rolls a changed source out, and keeps the serving version through a
//! source that cannot be pulled or verified.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmcsi_oci::{ArtifactAnnotations, ClientOptions, RegistryClient, SigningKey, Source};
use wasmcsi_oci_registry::TestRegistry;
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::driver::{CapacityRange, CreateVolumeRequest};
use wasmcsi_runtime::registry::ConfigChange;
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{Registry, Runtime, RuntimeOptions};

fn annotations(version: &str) -> ArtifactAnnotations {
    ArtifactAnnotations {
        name: "hostpath".into(),
        version: version.into(),
        contract: "wasmcsi:backend@0.2.0".into(),
        info: "{}".into(),
    }
}

fn request(name: &str) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 },
        capabilities: vec![],
        parameters: vec![],
        secrets: vec![],
        content_source: None,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

/// A host configuration naming `source` for hostpath, signatures by `key` required.
/// The registry's CA is read from beside `root` (a copy that outlives the registry).
fn config_text(reg: &TestRegistry, root: &Path, key: &Path, source: &str, extra: &str) -> String {
    let ca = root.with_file_name("ca.crt");
    if !ca.exists() {
        std::fs::copy(&reg.ca_file, &ca).unwrap();
    }
    format!(
        "[oci]\nca_file = \"{}\"\ndocker_config = \"{}\"\npublic_keys = [\"{}\"]\nretry_interval_ms = 100\nrequest_timeout_ms = 5000\n\
         [backends.hostpath]\nsource = \"{source}\"\n{extra}\
         [backends.hostpath.grants]\ndir = {{ default = \"{}\" }}\n",
        ca.display(),
        reg.docker_config.display(),
        key.display(),
        root.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_digest_pinned_source_loads_and_serves_rolls_out_and_a_bad_one_keeps_the_old_serving() {
    let Some(reg) = TestRegistry::start_or_skip() else { return };
    let d = tempfile::tempdir().unwrap();
    let (root, file, artifacts) =
        (d.path().join("root"), d.path().join("config.toml"), d.path().join("state/artifacts"));
    std::fs::create_dir_all(&root).unwrap();
    let (private, public) = SigningKey::generate().unwrap();
    let (key_file, pub_file) = (d.path().join("team.key"), d.path().join("team.pub"));
    std::fs::write(&key_file, private).unwrap();
    std::fs::write(&pub_file, public).unwrap();
    let key = SigningKey::load(&key_file).unwrap();
    let client = RegistryClient::new(ClientOptions {
        ca_file: Some(reg.ca_file.clone()),
        docker_config: Some(reg.docker_config.clone()),
        ..Default::default()
    })
    .unwrap();
    let target = Source::parse(&format!("oci://{}/backends/hostpath:v1", reg.addr)).unwrap();
    let v1 = wasmcsi_oci::push(&client, &target, wasmcsi_artifacts::HOSTPATH, &annotations("1")).await.unwrap();
    wasmcsi_oci::sign(&client, &v1, &key).await.unwrap();

    std::fs::write(&file, config_text(&reg, &root, &pub_file, &v1.to_string(), "")).unwrap();
    let rt = Runtime::new(RuntimeOptions {
        config: HostConfig::load(&file).unwrap(),
        cache_dir: Some(d.path().join("cache")),
        store_path: d.path().join("state/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 64, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let registry = Registry::new(rt.clone(), None, Some(file.clone()));
    registry.set_artifact_cache(artifacts.clone());
    let started = Instant::now();
    let report = registry.scan().await;
    let cold = started.elapsed();
    assert_eq!(report.loaded, ["hostpath"], "{report:?}");
    let serving = registry.get("hostpath").unwrap();
    assert_eq!(serving.digest, Runtime::digest(wasmcsi_artifacts::HOSTPATH));
    serving.create_volume(request("pvc-oci"), vec![]).await.unwrap();
    assert!(root.join("volumes/pvc-oci").is_dir());
    let status = registry.sources();
    assert_eq!(status[0].1.serving.as_deref(), v1.digest.as_deref(), "{status:?}");
    let quiet = registry.scan().await;
    assert!(quiet.loaded.is_empty() && quiet.rejected.is_empty(), "nothing changed: {quiet:?}");

    // A new version (another manifest), signed: rolled out at the next scan.
    let v2 =
        wasmcsi_oci::push(&client, &target.at_tag("v2"), wasmcsi_artifacts::HOSTPATH, &annotations("2")).await.unwrap();
    assert_ne!(v1, v2);
    wasmcsi_oci::sign(&client, &v2, &key).await.unwrap();
    std::fs::write(&file, config_text(&reg, &root, &pub_file, &v2.to_string(), "# v2\n")).unwrap();
    let report = registry.scan().await;
    assert_eq!(
        (report.config.clone(), report.loaded.clone()),
        (Some(ConfigChange::Applied), vec!["hostpath".to_string()])
    );
    assert_eq!(registry.sources()[0].1.serving.as_deref(), v2.digest.as_deref());

    // An unsigned v3: refused, v2 keeps serving, the status says why; retried, said once.
    let v3 =
        wasmcsi_oci::push(&client, &target.at_tag("v3"), wasmcsi_artifacts::HOSTPATH, &annotations("3")).await.unwrap();
    let before = registry.get("hostpath").unwrap();
    std::fs::write(&file, config_text(&reg, &root, &pub_file, &v3.to_string(), "# v3, unsigned\n")).unwrap();
    let report = registry.scan().await;
    assert!(report.rejected.iter().any(|(n, why)| n == "hostpath" && why.contains("unsigned")), "{report:?}");
    assert!(Arc::ptr_eq(&before, &registry.get("hostpath").unwrap()), "the serving version was replaced");
    let status = &registry.sources()[0].1;
    assert_eq!(status.serving.as_deref(), v2.digest.as_deref());
    assert!(status.failed.as_deref().is_some_and(|f| f.contains("unsigned")), "{status:?}");
    assert!(!artifacts.join("manifests").join(&v3.digest.as_deref().unwrap()[7..]).exists(), "refused manifest cached");
    // Signed later: the retry after retry_interval_ms loads it without a configuration change.
    wasmcsi_oci::sign(&client, &v3, &key).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let report = registry.scan().await;
    assert_eq!(report.loaded, ["hostpath"], "{report:?}");
    assert_eq!(
        registry.sources()[0].1,
        wasmcsi_runtime::registry::SourceStatus { source: v3.to_string(), serving: v3.digest.clone(), failed: None }
    );

    // A tag without the opt-in is refused with the configuration; the one in force serves on.
    std::fs::write(&file, config_text(&reg, &root, &pub_file, &target.to_string(), "# tag\n")).unwrap();
    let report = registry.scan().await;
    assert!(matches!(&report.config, Some(ConfigChange::Rejected(why)) if why.contains("allow_tag")), "{report:?}");
    assert_eq!(registry.sources()[0].1.serving.as_deref(), v3.digest.as_deref());

    // A restart with the registry gone loads from the cache, re-verified.
    drop(reg);
    let rt2 = Runtime::new(RuntimeOptions {
        config: HostConfig::parse(
            &std::fs::read_to_string(&file).unwrap().replace(&target.to_string(), &v3.to_string()),
            &file,
        )
        .unwrap(),
        cache_dir: Some(d.path().join("cache")),
        store_path: d.path().join("state2/meta.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 64, max_memory_bytes: 256 << 20 },
    })
    .unwrap();
    let restarted = Registry::new(rt2, None, None);
    restarted.set_artifact_cache(artifacts.clone());
    let started = Instant::now();
    let report = restarted.scan().await;
    let warm = started.elapsed();
    assert_eq!(report.loaded, ["hostpath"], "{report:?}");
    eprintln!(
        "source to serving: cold (pull + verify + compile + load) {cold:?}, from the cache with the registry gone {warm:?}"
    );
}
