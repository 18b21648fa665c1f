//! The authority endpoint over real TLS on loopback: grants only for the node a volume is
//! published to (its caller's certificate decides who that is), node certificates only for the
//! node a proof speaks for, and a node's enrollment and renewal writing a set that loads.
//!
//! Token proofs are checked against a stub Kubernetes API server (`wasmcsi-kube-stub`): no
//! kube-apiserver can run on this machine. Everything else is real: the endpoint, its TLS, the
//! built-in CA, the client. Which volume is published where comes from a table here
//! (`PublicationTable`); the block catalog's answer is tested with real replica servers in the
//! `wasmcsi` crate's `authority` tests.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rcgen::PublicKeyData as _;
use tonic::Code;
use wasmcsi_csi::authority_endpoint::client::ClientIdentity;
use wasmcsi_csi::authority_endpoint::enroll::Enrollment;
use wasmcsi_csi::authority_endpoint::token_review::{AUDIENCE, KubeApi, TokenReviewer};
use wasmcsi_csi::authority_endpoint::{AuthorityClient, AuthorityService, CertificateIssuer};
use wasmcsi_kube_stub::{KubeStub, Token};
use wasmcsi_trust::grant::source::PublicationTable;
use wasmcsi_trust::pki::{self, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};
use wasmcsi_trust::{
    Authority, Credentials, GrantSource, GrantSourceError, Limits, Listener, LiveCredentials, Role, TrustAnchors,
    Validity,
};

const NODE_ACCOUNT: &str = "wasmcsi:wasmcsi-node";
const NODE_USER: &str = "system:serviceaccount:wasmcsi:wasmcsi-node";

/// A CA, credentials issued by it, a stub API server, and the endpoint serving.
struct Cluster {
    ca: Authority,
    dir: tempfile::TempDir,
    stub: KubeStub,
    table: Arc<PublicationTable>,
    addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Cluster {
    async fn start() -> Cluster {
        Cluster::start_issuing(DEFAULT_LEAF_VALIDITY).await
    }

    /// The endpoint's CA issues node certificates valid for `validity`.
    async fn start_issuing(validity: Duration) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        ca.save(&dir.path().join("ca")).unwrap();
        let controller = dir.path().join("controller");
        ca.issue(&Role::Controller, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .unwrap()
            .write(&controller, ca.bundle())
            .unwrap();

        let stub = KubeStub::start("controller-sa-token").await;
        let sa = dir.path().join("serviceaccount");
        std::fs::create_dir(&sa).unwrap();
        stub.write_client_files(&sa);
        for (token, node) in [("token-a", "node-a"), ("token-b", "node-b")] {
            stub.add(
                token,
                Token { username: NODE_USER.into(), node: Some(node.into()), audiences: vec![AUDIENCE.into()] },
            );
        }
        stub.add(
            "token-default-sa",
            Token {
                username: "system:serviceaccount:default:default".into(),
                node: Some("node-a".into()),
                audiences: vec![AUDIENCE.into()],
            },
        );
        stub.add(
            "token-for-the-api",
            Token {
                username: NODE_USER.into(),
                node: Some("node-a".into()),
                audiences: vec!["https://kubernetes.default.svc".into()],
            },
        );
        let reviewer =
            TokenReviewer::new(KubeApi { url: stub.url(), ca_file: sa.join("ca.crt"), token_file: sa.join("token") })
                .unwrap();

        let live = LiveCredentials::new(Credentials::load(&controller).unwrap());
        let table = Arc::new(PublicationTable::default());
        let issuer = CertificateIssuer::new(
            Authority::load(&dir.path().join("ca")).unwrap(),
            validity,
            Some((reviewer, NODE_ACCOUNT)),
        )
        .unwrap();
        let service = AuthorityService::new(live.clone(), table.clone()).with_issuer(issuer);
        let listener = Listener::bind("127.0.0.1:0", Limits::default()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            wasmcsi_csi::authority_endpoint::serve(listener, live, service).await.unwrap();
        });
        Cluster { ca, dir, stub, table, addr, server }
    }

    fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    fn anchors(&self) -> Arc<TrustAnchors> {
        Arc::new(TrustAnchors::new(self.ca.bundle().to_vec()).unwrap())
    }

    /// A credentials directory for `role`, issued by the CA directly.
    fn issue(&self, role: &Role) -> PathBuf {
        let dir = self.dir.path().join(role.uri().replace('/', "_"));
        self.ca
            .issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .unwrap()
            .write(&dir, self.ca.bundle())
            .unwrap();
        dir
    }

    /// A client presenting `role`'s certificate.
    fn client_as(&self, role: &Role) -> AuthorityClient {
        let live = LiveCredentials::new(Credentials::load(&self.issue(role)).unwrap());
        AuthorityClient::new(&self.url(), ClientIdentity::Credentials(live)).unwrap()
    }

    /// A client with no certificate.
    fn anonymous(&self) -> AuthorityClient {
        AuthorityClient::new(&self.url(), ClientIdentity::Anonymous(self.anchors())).unwrap()
    }

    fn verify(&self, grant: &[u8]) -> wasmcsi_trust::Grant {
        wasmcsi_trust::grant::verify(grant, &self.anchors(), SystemTime::now()).unwrap()
    }
}

fn node(id: &str) -> Role {
    Role::Node(id.into())
}

/// A CSR for a fresh key, and the key's SubjectPublicKeyInfo (DER).
fn request() -> (Vec<u8>, Vec<u8>) {
    let key = pki::new_key().unwrap();
    (pki::certificate_request(&key).unwrap().as_ref().to_vec(), key.subject_public_key_info())
}

#[tokio::test]
async fn a_grant_is_signed_only_for_the_node_the_volume_is_published_to() {
    let c = Cluster::start().await;
    c.table.publish("set-1", "node-a", 7);
    let a = c.client_as(&node("node-a"));
    let b = c.client_as(&node("node-b"));

    let grant = c.verify(&a.grant_volume("set-1").await.unwrap());
    assert_eq!((grant.volume.as_str(), grant.node.as_str(), grant.epoch), ("set-1", "node-a", 7));

    // Node B holds a valid certificate, but the volume is A's.
    let refused = b.grant_volume("set-1").await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("node-a"), "says why: {refused:?}");
    // Nor one that is published nowhere, or unknown.
    assert_eq!(a.grant_volume("set-unknown").await.unwrap_err().code(), Code::PermissionDenied);

    // Republished to B at a higher epoch: B's grant carries it, A gets none any more.
    c.table.publish("set-1", "node-b", 9);
    assert_eq!(c.verify(&b.grant_volume("set-1").await.unwrap()).epoch, 9);
    assert_eq!(a.grant_volume("set-1").await.unwrap_err().code(), Code::PermissionDenied);

    // The data path's view of the same: a GrantSource whose refusals say "stop asking".
    let source: Arc<dyn GrantSource> = Arc::new(a);
    assert!(matches!(source.grant("set-1").await, Err(GrantSourceError::Refused { .. })));
}

#[tokio::test]
async fn grants_need_a_node_certificate() {
    let c = Cluster::start().await;
    c.table.publish("set-1", "node-a", 1);
    let anonymous = c.anonymous().grant_volume("set-1").await.unwrap_err();
    assert_eq!(anonymous.code(), Code::Unauthenticated, "{anonymous:?}");
    let controller = c.client_as(&Role::Controller).grant_volume("set-1").await.unwrap_err();
    assert_eq!(controller.code(), Code::PermissionDenied, "{controller:?}");
    let empty = c.client_as(&node("node-a")).grant_volume("").await.unwrap_err();
    assert_eq!(empty.code(), Code::InvalidArgument, "{empty:?}");
}

#[tokio::test]
async fn a_certificate_of_another_ca_gets_no_connection_at_all() {
    let c = Cluster::start().await;
    let other = Cluster::start().await;
    // Issued by `other`'s CA, dialling `c`: the handshake fails before any call.
    let live = LiveCredentials::new(Credentials::load(&other.issue(&node("node-a"))).unwrap());
    let stranger = AuthorityClient::new(&c.url(), ClientIdentity::Credentials(live)).unwrap();
    let err = stranger.grant_volume("set-1").await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "a transport error, no answer: {err:?}");
    // And a node that trusts another CA does not talk to this controller.
    let misled = AuthorityClient::new(&c.url(), ClientIdentity::Anonymous(other.anchors())).unwrap();
    let (csr, _) = request();
    let err = misled.issue_certificate(&csr, "node-a", Some("token-a".into())).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(c.stub.reviews(), 0, "the token never left the node");
}

#[tokio::test]
async fn a_token_proves_only_its_own_node_and_its_own_service_account() {
    let c = Cluster::start().await;
    let anonymous = c.anonymous();
    let ask = |node: &'static str, token: &'static str| {
        let client = anonymous.clone();
        async move {
            let (csr, _) = request();
            client.issue_certificate(&csr, node, Some(token.into())).await
        }
    };
    // The stub says token-b is node-b's node plugin: asking for node-a with it is refused.
    let err = ask("node-a", "token-b").await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("node-b"), "{err:?}");
    let err = ask("node-a", "token-default-sa").await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "another ServiceAccount: {err:?}");
    let err = ask("node-a", "token-for-the-api").await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "a token minted for another audience: {err:?}");
    let err = ask("node-a", "no-such-token").await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let (csr, _) = request();
    let err = anonymous.issue_certificate(&csr, "node-a", None).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "no proof at all: {err:?}");
    assert_eq!(c.stub.reviews(), 4, "every token was reviewed by the API server");

    // Its own token: a certificate naming node-a for the request's key.
    let (csr, spki) = request();
    let answer = anonymous.issue_certificate(&csr, "node-a", Some("token-a".into())).await.unwrap();
    let leaf = rustls::pki_types::CertificateDer::from(answer.chain[0].clone());
    assert_eq!(Role::of_certificate(&leaf).unwrap(), node("node-a"));
    // The SubjectPublicKeyInfo sits in the certificate verbatim.
    assert!(leaf.windows(spki.len()).any(|w| w == spki.as_slice()), "the certificate is for the request's key");
    assert_eq!(answer.ca, vec![c.ca.certificate().to_vec()]);
}

#[tokio::test]
async fn only_a_node_itself_renews_its_certificate() {
    let c = Cluster::start().await;
    let (csr, _) = request();
    let renewed = c.client_as(&node("node-a")).issue_certificate(&csr, "node-a", None).await.unwrap();
    let leaf = rustls::pki_types::CertificateDer::from(renewed.chain[0].clone());
    assert_eq!(Role::of_certificate(&leaf).unwrap(), node("node-a"));
    let err = c.client_as(&node("node-b")).issue_certificate(&csr, "node-a", None).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "node B renewing node A: {err:?}");
    let err = c.client_as(&Role::Controller).issue_certificate(&csr, "node-a", None).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert_eq!(c.stub.reviews(), 0, "a renewal asks no API server");
}

#[tokio::test]
async fn a_node_enrolls_with_its_token_and_renews_with_its_certificate() {
    // Certificates of 6 s: renewal is due 4 s after issue.
    let c = Cluster::start_issuing(Duration::from_secs(6)).await;
    let dir = c.dir.path().join("node-a");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("ca.crt"), pki::certificates_pem(c.ca.bundle())).unwrap();
    let token = c.dir.path().join("node-token");
    std::fs::write(&token, "token-a\n").unwrap();
    let enrollment = Enrollment {
        url: c.url(),
        node: "node-a".into(),
        dir: dir.clone(),
        ca_file: None,
        token_file: Some(token.clone()),
    };
    enrollment.ensure().await.unwrap();
    let first = Credentials::load(&dir).unwrap();
    assert_eq!(first.role(), &node("node-a"));
    assert_eq!(c.stub.reviews(), 1);
    // A second start finds them current and asks nothing.
    enrollment.ensure().await.unwrap();
    assert_eq!(Credentials::load(&dir).unwrap().chain()[0], first.chain()[0]);

    // The token is gone (as after the pod's first start): renewals prove themselves with the
    // certificate alone.
    std::fs::remove_file(&token).unwrap();
    let (live, _watcher) = wasmcsi_trust::watch(&dir, Duration::from_millis(100)).unwrap();
    let renewer = tokio::spawn(Enrollment { token_file: None, ..enrollment }.renew_forever(live.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while live.generation() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "two renewals within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    renewer.abort();
    let now = live.current();
    assert_eq!(now.role(), &node("node-a"));
    assert!(now.not_after() > first.not_after(), "a later certificate");
    assert_eq!(c.stub.reviews(), 1, "renewals asked no API server");
}

#[tokio::test]
async fn a_node_without_a_token_or_a_certificate_is_told_so() {
    let c = Cluster::start().await;
    let dir = c.dir.path().join("empty");
    let enrollment = Enrollment { url: c.url(), node: "node-a".into(), dir, ca_file: None, token_file: None };
    let err = enrollment.ensure().await.unwrap_err();
    assert!(err.to_string().contains("no ServiceAccount token"), "{err}");
}
