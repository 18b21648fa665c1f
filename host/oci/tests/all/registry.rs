//! Push, pull, verify and refuse against a real registry: every refusal leaves the cache
//! without a file of the refused artifact.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use wasmcsi_oci::artifact::{
    ArtifactAnnotations, Descriptor, MEDIA_TYPE_OCI_CONFIG, MEDIA_TYPE_OCI_MANIFEST, Manifest,
};
use wasmcsi_oci::signature::signature_tag;
use wasmcsi_oci::{
    ArtifactCache, ClientOptions, FetchPolicy, OciError, PublicKeys, RegistryClient, SigningKey, Source,
};
use wasmcsi_oci_registry::TestRegistry;

fn registry() -> Option<TestRegistry> {
    TestRegistry::start_or_skip()
}

fn client(reg: &TestRegistry) -> RegistryClient {
    RegistryClient::new(ClientOptions {
        ca_file: Some(reg.ca_file.clone()),
        docker_config: Some(reg.docker_config.clone()),
        request_timeout: Duration::from_secs(10),
        ..Default::default()
    })
    .unwrap()
}

fn component() -> &'static [u8] {
    wasmcsi_artifacts::HOSTPATH
}

fn annotations() -> ArtifactAnnotations {
    ArtifactAnnotations {
        name: "hostpath".into(),
        version: "test".into(),
        contract: "wasmcsi:backend@0.2.0".into(),
        info: "{}".into(),
    }
}

fn target(reg: &TestRegistry, repo: &str) -> Source {
    Source::parse(&format!("oci://{}/{repo}:v1", reg.addr)).unwrap()
}

/// Files of the cache, `tmp/` included: a refusal leaves none.
fn cached(cache: &ArtifactCache) -> Vec<PathBuf> {
    cache.files()
}

fn keypair(dir: &Path, name: &str) -> (SigningKey, PublicKeys) {
    let (private, public) = SigningKey::generate().unwrap();
    std::fs::write(dir.join(format!("{name}.key")), private).unwrap();
    std::fs::write(dir.join(format!("{name}.pub")), public).unwrap();
    (
        SigningKey::load(&dir.join(format!("{name}.key"))).unwrap(),
        PublicKeys::load(&[dir.join(format!("{name}.pub"))]).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pushed_component_pulls_back_byte_exact_with_its_annotations_then_from_the_cache() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let pinned = wasmcsi_oci::push(&c, &target(&reg, "backends/hostpath"), component(), &annotations()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let started = Instant::now();
    let fetched = wasmcsi_oci::fetch(&c, &pinned, &cache, &FetchPolicy::default()).await.unwrap();
    let cold = started.elapsed();
    assert_eq!(fetched.wasm, component());
    assert_eq!(std::fs::read(&fetched.path).unwrap(), component());
    assert_eq!(fetched.annotations["io.wasmcsi.backend.contract"], "wasmcsi:backend@0.2.0");
    assert!(!fetched.from_cache);
    let started = Instant::now();
    let again = wasmcsi_oci::fetch(&c, &pinned, &cache, &FetchPolicy::default()).await.unwrap();
    let warm = started.elapsed();
    assert!(again.from_cache && again.wasm == component());
    eprintln!("pull of {} bytes: cold {cold:?}, from the cache (re-verified) {warm:?}", component().len());
    // Pushing the same bytes again gives the same digest: a re-push never moves a pinned config.
    let again = wasmcsi_oci::push(&c, &target(&reg, "backends/hostpath"), component(), &annotations()).await.unwrap();
    assert_eq!(again, pinned);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tampered_layer_is_refused_and_nothing_enters_the_cache() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let pinned = wasmcsi_oci::push(&c, &target(&reg, "tampered"), component(), &annotations()).await.unwrap();
    let layer = wasmcsi_oci::sha256_digest(component());
    let mut bytes = component().to_vec();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(reg.blob_data(&layer), &bytes).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let e = wasmcsi_oci::fetch(&c, &pinned, &cache, &FetchPolicy::default()).await.unwrap_err();
    assert!(matches!(e, OciError::DigestMismatch { what: "layer", .. } | OciError::Registry { .. }), "{e}");
    assert!(e.to_string().contains(&layer[..20]) || e.to_string().contains("digest"), "{e}");
    assert_eq!(cached(&cache), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn signatures_by_the_configured_key_load_and_every_other_case_is_refused() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let keys = tempfile::tempdir().unwrap();
    let (ours, ours_pub) = keypair(keys.path(), "ours");
    let (theirs, _) = keypair(keys.path(), "theirs");
    let signed = wasmcsi_oci::push(&c, &target(&reg, "signed"), component(), &annotations()).await.unwrap();
    wasmcsi_oci::sign(&c, &signed, &ours).await.unwrap();
    let policy = FetchPolicy { keys: ours_pub.clone(), ..Default::default() };

    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let started = Instant::now();
    let fetched = wasmcsi_oci::fetch(&c, &signed, &cache, &policy).await.unwrap();
    eprintln!("signed pull: {:?}", started.elapsed());
    assert_eq!(fetched.signed_by.unwrap().file_name().unwrap(), "ours.pub");
    // The kept signature verifies again from the cache, no registry asked.
    let again = wasmcsi_oci::fetch(&c, &signed, &cache, &policy).await.unwrap();
    assert!(again.from_cache && again.signed_by.is_some());

    // Signed by another key only.
    let other_annotations = ArtifactAnnotations { version: "other-key".into(), ..annotations() };
    let foreign = wasmcsi_oci::push(&c, &target(&reg, "foreign"), component(), &other_annotations).await.unwrap();
    wasmcsi_oci::sign(&c, &foreign, &theirs).await.unwrap();
    // Unsigned.
    let unsigned_annotations = ArtifactAnnotations { version: "unsigned".into(), ..annotations() };
    let unsigned = wasmcsi_oci::push(&c, &target(&reg, "unsigned"), component(), &unsigned_annotations).await.unwrap();
    // A real signature by our key, of another digest, put where this digest's would be.
    let swapped_annotations = ArtifactAnnotations { version: "swapped".into(), ..annotations() };
    let swapped = wasmcsi_oci::push(&c, &target(&reg, "signed"), component(), &swapped_annotations).await.unwrap();
    let (sig_manifest, _) =
        c.manifest(&signed.at_tag(&signature_tag(signed.digest.as_deref().unwrap()))).await.unwrap();
    c.push_manifest(&swapped.at_tag(&signature_tag(swapped.digest.as_deref().unwrap())), &sig_manifest).await.unwrap();

    for (case, source, expect) in [
        ("another key", &foreign, "none of the configured keys"),
        ("unsigned", &unsigned, "unsigned"),
        ("another digest", &swapped, "not sha256:"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cache = ArtifactCache::new(dir.path());
        let e = wasmcsi_oci::fetch(&c, source, &cache, &policy).await.unwrap_err();
        assert!(matches!(e, OciError::Signature { .. }) && e.to_string().contains(expect), "{case}: {e}");
        assert_eq!(cached(&cache), Vec::<PathBuf>::new(), "{case}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tag_is_refused_without_the_opt_in_and_resolved_to_its_digest_with_it() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let pinned = wasmcsi_oci::push(&c, &target(&reg, "tagged"), component(), &annotations()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let tag = target(&reg, "tagged");
    let e = wasmcsi_oci::fetch(&c, &tag, &cache, &FetchPolicy::default()).await.unwrap_err();
    assert!(matches!(e, OciError::TagNotAllowed { .. }), "{e}");
    assert_eq!(cached(&cache), Vec::<PathBuf>::new());
    let fetched =
        wasmcsi_oci::fetch(&c, &tag, &cache, &FetchPolicy { allow_tag: true, ..Default::default() }).await.unwrap();
    assert_eq!(fetched.pinned, pinned);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_manifest_that_is_not_a_wasm_artifact_is_refused_before_its_layer_is_pulled() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let repo = target(&reg, "container-image");
    let layer_bytes = b"not a tarball, but typed as one".to_vec();
    let config_bytes = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#.to_vec();
    let layer = Descriptor::of("application/vnd.oci.image.layer.v1.tar", &layer_bytes);
    let config = Descriptor::of(MEDIA_TYPE_OCI_CONFIG, &config_bytes);
    c.push_blob(&repo, &layer_bytes, &layer.digest).await.unwrap();
    c.push_blob(&repo, &config_bytes, &config.digest).await.unwrap();
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(MEDIA_TYPE_OCI_MANIFEST.into()),
        config,
        layers: vec![layer],
        annotations: Default::default(),
    };
    let digest = c.push_manifest(&repo, &serde_json::to_vec(&manifest).unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let e = wasmcsi_oci::fetch(&c, &repo.at_digest(&digest), &cache, &FetchPolicy::default()).await.unwrap_err();
    assert!(matches!(e, OciError::NotWasmArtifact { .. }) && e.to_string().contains(MEDIA_TYPE_OCI_CONFIG), "{e}");
    assert_eq!(cached(&cache), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_layer_over_the_size_bound_is_refused_before_its_first_byte() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let pinned = wasmcsi_oci::push(&c, &target(&reg, "large"), component(), &annotations()).await.unwrap();
    let small = RegistryClient::new(ClientOptions { max_layer_bytes: 4096, ..c.options().clone() }).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let e = wasmcsi_oci::fetch(&small, &pinned, &cache, &FetchPolicy::default()).await.unwrap_err();
    assert!(matches!(e, OciError::TooLarge { limit: 4096, .. }), "{e}");
    assert_eq!(cached(&cache), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_credentials_and_an_untrusted_certificate_are_refused_naming_the_registry() {
    let Some(reg) = registry() else { return };
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("config.json");
    let auth = base64_of(&format!("{}:wrong", wasmcsi_oci_registry::USER));
    std::fs::write(&wrong, format!(r#"{{"auths": {{"{}": {{"auth": "{auth}"}}}}}}"#, reg.addr)).unwrap();
    let c = RegistryClient::new(ClientOptions {
        ca_file: Some(reg.ca_file.clone()),
        docker_config: Some(wrong),
        ..Default::default()
    })
    .unwrap();
    let e = wasmcsi_oci::push(&c, &target(&reg, "denied"), component(), &annotations()).await.unwrap_err();
    assert!(e.to_string().contains(&reg.addr), "{e}");
    // Without the CA, the registry's certificate is not trusted.
    let untrusted =
        RegistryClient::new(ClientOptions { docker_config: Some(reg.docker_config.clone()), ..Default::default() })
            .unwrap();
    let e = wasmcsi_oci::push(&untrusted, &target(&reg, "denied"), component(), &annotations()).await.unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
}

fn base64_of(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_that_stops_answering_is_bounded_by_the_request_timeout() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let pinned = wasmcsi_oci::push(&c, &target(&reg, "hangs"), component(), &annotations()).await.unwrap();
    let bounded =
        RegistryClient::new(ClientOptions { request_timeout: Duration::from_secs(1), ..c.options().clone() }).unwrap();
    reg.pause().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let started = Instant::now();
    let e = wasmcsi_oci::fetch(&bounded, &pinned, &cache, &FetchPolicy::default()).await.unwrap_err();
    let took = started.elapsed();
    reg.resume().unwrap();
    assert!(took < Duration::from_secs(4), "took {took:?}: {e}");
    assert!(e.to_string().contains("within 1000 ms") || e.to_string().contains("timed out"), "{e}");
    assert_eq!(cached(&cache), Vec::<PathBuf>::new());
}

/// A registry that answers 500 (its storage fails: the layer's data cannot be opened) is refused
/// at once, naming the status, with nothing cached.
#[tokio::test(flavor = "multi_thread")]
async fn a_registry_answering_500_is_refused_at_once_naming_the_status() {
    let Some(reg) = registry() else { return };
    let c = client(&reg);
    let pinned = wasmcsi_oci::push(&c, &target(&reg, "broken-storage"), component(), &annotations()).await.unwrap();
    let data = reg.blob_data(&wasmcsi_oci::sha256_digest(component()));
    std::fs::remove_file(&data).unwrap();
    // A symlink to itself: every open fails with ELOOP, which the storage driver reports as an
    // internal error.
    std::os::unix::fs::symlink(&data, &data).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = ArtifactCache::new(dir.path());
    let started = Instant::now();
    let e = wasmcsi_oci::fetch(&c, &pinned, &cache, &FetchPolicy::default()).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "{e}");
    assert!(matches!(e, OciError::Registry { .. }) && e.to_string().contains("500"), "{e}\n{}", reg.log());
    assert_eq!(cached(&cache), Vec::<PathBuf>::new());
}
