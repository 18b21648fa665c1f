//! The built-in CA kept in a Secret: created once with a new CA, read back by every later start
//! and by a second controller (both racing included), its certificate published in a ConfigMap
//! and updated when it changes. Against the stub Kubernetes API server (`wasmcsi-kube-stub`): no
//! kube-apiserver can run on the machines the tests run on.
#![allow(clippy::unwrap_used, reason = "tests")]
use wasmcsi_csi::authority_endpoint::ca_store::CaStore;
use wasmcsi_csi::authority_endpoint::token_review::KubeApi;
use wasmcsi_kube_stub::KubeStub;
use wasmcsi_trust::pki::{self, DEFAULT_LEAF_VALIDITY};
use wasmcsi_trust::{Credentials, Role, Validity};

fn store(stub: &KubeStub, dir: &std::path::Path) -> CaStore {
    stub.write_client_files(dir);
    let api = KubeApi { url: stub.url(), ca_file: dir.join("ca.crt"), token_file: dir.join("token") };
    CaStore::new(api, "wasmcsi-system", "wasmcsi-ca").unwrap()
}

#[tokio::test]
async fn the_first_start_creates_the_ca_and_every_later_one_signs_with_it() {
    let stub = KubeStub::start("controller-sa-token").await;
    let tmp = tempfile::tempdir().unwrap();
    let store = store(&stub, tmp.path());
    assert!(stub.object("/api/v1/namespaces/wasmcsi-system/secrets/wasmcsi-ca").is_none());

    let first = store.ensure(&tmp.path().join("ca-1")).await.unwrap();
    assert!(stub.object("/api/v1/namespaces/wasmcsi-system/secrets/wasmcsi-ca").is_some(), "the Secret was created");
    // A restart (a fresh emptyDir) and a second controller read the same CA back.
    let again = store.ensure(&tmp.path().join("ca-2")).await.unwrap();
    assert_eq!(first.certificate(), again.certificate());
    // A leaf the second one issues verifies under the first one's trust.
    let issued = again.issue(&Role::Node("node-a".into()), Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap();
    let dir = tmp.path().join("node-a");
    issued.write(&dir, first.bundle()).unwrap();
    assert_eq!(Credentials::load(&dir).unwrap().role(), &Role::Node("node-a".into()));
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(tmp.path().join("ca-2").join(pki::CA_KEY_FILE)).unwrap().permissions(),
    );
    assert_eq!(mode & 0o077, 0, "the CA key is the owner's only");
}

#[tokio::test]
async fn two_controllers_starting_at_once_end_with_one_ca() {
    let stub = KubeStub::start("controller-sa-token").await;
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (store(&stub, tmp.path()), store(&stub, tmp.path()));
    let (dir_a, dir_b) = (tmp.path().join("a"), tmp.path().join("b"));
    let (ca_a, ca_b) = tokio::join!(a.ensure(&dir_a), b.ensure(&dir_b));
    assert_eq!(ca_a.unwrap().certificate(), ca_b.unwrap().certificate());
}

#[tokio::test]
async fn the_ca_certificate_is_published_without_its_key_and_kept_current() {
    let stub = KubeStub::start("controller-sa-token").await;
    let tmp = tempfile::tempdir().unwrap();
    let store = store(&stub, tmp.path());
    let ca = store.ensure(&tmp.path().join("ca")).await.unwrap();
    store.publish(&ca).await.unwrap();
    let path = "/api/v1/namespaces/wasmcsi-system/configmaps/wasmcsi-ca";
    let map = stub.object(path).unwrap();
    assert_eq!(map["data"]["ca.crt"].as_str().unwrap(), pki::certificates_pem(ca.bundle()));
    assert!(map["data"].get("ca.key").is_none());
    assert!(!map.to_string().contains("PRIVATE KEY"));
    // Publishing the same CA again changes nothing; another CA (a bundle replaced by hand)
    // replaces the published one.
    store.publish(&ca).await.unwrap();
    assert_eq!(stub.object(path).unwrap()["metadata"]["resourceVersion"], "1");
    let other = wasmcsi_trust::Authority::generate(Validity::starting_now(pki::DEFAULT_CA_VALIDITY)).unwrap();
    store.publish(&other).await.unwrap();
    let map = stub.object(path).unwrap();
    assert_eq!(map["data"]["ca.crt"].as_str().unwrap(), pki::certificates_pem(other.bundle()));
    assert_eq!(map["metadata"]["resourceVersion"], "2");
}

#[tokio::test]
async fn a_controller_without_the_api_servers_trust_is_refused() {
    let stub = KubeStub::start("controller-sa-token").await;
    let tmp = tempfile::tempdir().unwrap();
    stub.write_client_files(tmp.path());
    std::fs::write(tmp.path().join("token"), "someone-else\n").unwrap();
    let api = KubeApi { url: stub.url(), ca_file: tmp.path().join("ca.crt"), token_file: tmp.path().join("token") };
    let store = CaStore::new(api, "wasmcsi-system", "wasmcsi-ca").unwrap();
    let Err(err) = store.ensure(&tmp.path().join("ca")).await else { panic!("a stranger's token was accepted") };
    assert!(err.to_string().contains("401"), "{err}");
    assert!(stub.object("/api/v1/namespaces/wasmcsi-system/secrets/wasmcsi-ca").is_none());
}
