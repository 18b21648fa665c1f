//! Mutual TLS between wasmcsi roles, and every client the server must refuse: refused before
//! the handler runs, with the alert that says why, after reading no more than the handshake
//! budget.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use rustls::AlertDescription;
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use wasmcsi_trust::credentials::server_name;
use wasmcsi_trust::listener::{DEFAULT_HANDSHAKE_BUDGET, Transport};
use wasmcsi_trust::stream;
use wasmcsi_trust::{ExpectedRole, Limits, Listener, Role, Validity};

use crate::support::{EchoServer, Pki, dial, echo_server, leaf_params, raw_client, refusal, round_trip};

fn assert_refused_unread(server: &EchoServer, refusals: u64) {
    assert!(server.roles.lock().expect("roles").is_empty(), "the handler ran for a refused client");
    let stats = &server.stats;
    let failed = stats.handshakes_failed.load(Ordering::Relaxed) + stats.handshakes_over_budget.load(Ordering::Relaxed);
    assert_eq!(failed, refusals);
    let read = stats.max_handshake_bytes.load(Ordering::Relaxed);
    assert!(read <= DEFAULT_HANDSHAKE_BUDGET as u64, "read {read} bytes before refusing");
}

#[tokio::test]
async fn a_node_and_the_controller_authenticate_each_other_both_ways() {
    let mut pki = Pki::new();
    let node = Arc::new(pki.credentials(&Role::Node("n1".into())));
    let controller = Arc::new(pki.credentials(&Role::Controller));

    // The controller dials node n1's replica port.
    let server = echo_server(node.clone(), Limits::default()).await;
    let config = controller.client_config(ExpectedRole::Node("n1".into())).expect("config");
    let mut conn = dial(config, server.addr).await.expect("handshake");
    round_trip(&mut conn, b"hello node").await.expect("echo");
    assert_eq!(server.roles.lock().expect("roles").as_slice(), &[Role::Controller]);
    let negotiated = conn.get_ref().1.negotiated_cipher_suite().expect("suite").suite();
    assert_eq!(negotiated, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);

    // Node n1 dials the controller's authority endpoint, through the shared stream.
    let server = echo_server(controller.clone(), Limits::default()).await;
    let config = node.client_config(ExpectedRole::Controller).expect("config");
    let tcp = TcpStream::connect(server.addr).await.expect("connect");
    let (writer, mut reader, role) =
        stream::connect(tcp, config, server_name(), Duration::from_secs(5)).await.expect("handshake");
    assert_eq!(role, Role::Controller);
    writer.try_send(&[std::io::IoSlice::new(b"hello controller")]).expect("send");
    writer.flush().await.expect("flush");
    let mut back = [0u8; 16];
    reader.read_exact(&mut back).await.expect("echo");
    assert_eq!(&back, b"hello controller");
    assert_eq!(server.roles.lock().expect("roles").as_slice(), &[Role::Node("n1".into())]);
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), Limits::default()).await;
    let alert = refusal(raw_client(pki.anchors(), None), server.addr).await;
    assert_eq!(alert, AlertDescription::CertificateRequired);
    assert_refused_unread(&server, 1);
}

#[tokio::test]
async fn a_self_signed_certificate_is_refused() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), Limits::default()).await;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let cert = leaf_params(&[Role::Node("n2".into()).uri()]).self_signed(&key).expect("self-signed");
    let identity = (vec![cert.der().clone()], rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der()).into());
    let alert = refusal(raw_client(pki.anchors(), Some(identity)), server.addr).await;
    assert_eq!(alert, AlertDescription::UnknownCA);
    assert_refused_unread(&server, 1);
}

#[tokio::test]
async fn a_certificate_of_another_ca_is_refused() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), Limits::default()).await;
    let other = Pki::new();
    let issued = other
        .ca
        .issue(&Role::Controller, Validity::starting_now(Duration::from_secs(3600)))
        .expect("issue by another CA");
    let alert = refusal(raw_client(pki.anchors(), Some((issued.chain, issued.key.into()))), server.addr).await;
    assert_eq!(alert, AlertDescription::UnknownCA);
    assert_refused_unread(&server, 1);
}

#[tokio::test]
async fn an_expired_certificate_is_refused() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), Limits::default()).await;
    let now = SystemTime::now();
    let past = Validity { not_before: now - Duration::from_secs(7200), not_after: now - Duration::from_secs(60) };
    let issued = pki.ca.issue(&Role::Controller, past).expect("issue expired");
    let alert = refusal(raw_client(pki.anchors(), Some((issued.chain, issued.key.into()))), server.addr).await;
    assert_eq!(alert, AlertDescription::CertificateExpired);
    assert_refused_unread(&server, 1);
}

#[tokio::test]
async fn a_certificate_with_two_wasmcsi_identities_is_refused() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), Limits::default()).await;
    // Signed by the right CA, so only the identity rule refuses it.
    let identity = pki.sign_raw(&leaf_params(&[Role::Node("n2".into()).uri(), Role::Controller.uri()]));
    let alert = refusal(raw_client(pki.anchors(), Some(identity)), server.addr).await;
    assert_eq!(alert, AlertDescription::CertificateUnknown);
    assert_refused_unread(&server, 1);
}

#[tokio::test]
async fn a_certificate_without_client_auth_is_refused() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), Limits::default()).await;
    let mut params = leaf_params(&[Role::Node("n2".into()).uri()]);
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let alert = refusal(raw_client(pki.anchors(), Some(pki.sign_raw(&params))), server.addr).await;
    assert_eq!(alert, AlertDescription::UnsupportedCertificate);
    assert_refused_unread(&server, 1);
}

#[tokio::test]
async fn a_client_that_sends_more_than_the_budget_is_cut_off_at_it() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), Limits::default()).await;
    // A valid leaf followed by 40 KiB of "intermediates": the client sends them all in its
    // Certificate message; the server must stop reading at 16 KiB.
    let issued = pki.ca.issue(&Role::Controller, Validity::starting_now(Duration::from_secs(3600))).expect("issue");
    let mut chain = issued.chain;
    chain.extend((0..10).map(|_| CertificateDer::from(vec![0x30; 4000])));
    let config = raw_client(pki.anchors(), Some((chain, issued.key.into())));
    let mut conn = dial(config, server.addr).await.expect("the client's side of the handshake completes");
    let _ = conn.write_all(b"x").await;
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut byte)).await.expect("refused in time");
    assert!(!matches!(read, Ok(n) if n > 0), "the server echoed: {read:?}");
    assert_eq!(server.stats.handshakes_over_budget.load(Ordering::Relaxed), 1);
    assert_eq!(server.stats.max_handshake_bytes.load(Ordering::Relaxed), DEFAULT_HANDSHAKE_BUDGET as u64);
    assert_refused_unread(&server, 1);
}

#[tokio::test]
async fn a_client_expecting_node_x_refuses_node_y() {
    let mut pki = Pki::new();
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("y".into()))), Limits::default()).await;
    let engine = pki.credentials(&Role::Node("engine".into()));
    let config = engine.client_config(ExpectedRole::Node("x".into())).expect("config");
    let err = dial(config, server.addr).await.expect_err("node y is not node x");
    let text = err.to_string();
    assert!(text.contains(r#"the peer is node "y", expected node "x""#), "{text}");
    // The same server is fine for a client that expects it.
    let config = engine.client_config(ExpectedRole::Node("y".into())).expect("config");
    round_trip(&mut dial(config, server.addr).await.expect("node y"), b"ok").await.expect("echo");
}

#[tokio::test]
async fn a_silent_client_is_dropped_at_the_handshake_deadline() {
    let mut pki = Pki::new();
    let limits = Limits { handshake_timeout: Duration::from_millis(300), ..Limits::default() };
    let server = echo_server(Arc::new(pki.credentials(&Role::Node("n1".into()))), limits).await;
    let mut tcp = TcpStream::connect(server.addr).await.expect("connect");
    let started = std::time::Instant::now();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut byte)).await.expect("closed in time");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert!(started.elapsed() >= Duration::from_millis(250), "closed after {:?}", started.elapsed());
    assert_eq!(server.stats.handshakes_timed_out.load(Ordering::Relaxed), 1);
    assert_eq!(server.stats.open.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_permissive_listener_tells_tls_from_plaintext_and_loses_no_byte() {
    let mut pki = Pki::new();
    let node = Arc::new(pki.credentials(&Role::Node("n1".into())));
    let listener = Listener::bind("127.0.0.1:0", Limits::default()).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(listener.serve_permissive(node, |conn| async move {
        // Answers "plain:<first bytes>" or "tls:<role>".
        match conn.transport {
            Transport::Plain(mut tcp) => {
                let mut first = [0u8; 5];
                if tcp.read_exact(&mut first).await.is_ok() {
                    let _ = tcp.write_all(&[b"plain:".as_slice(), &first].concat()).await;
                }
            }
            Transport::Tls { mut stream, role } => {
                let _ = stream.write_all(format!("tls:{role}").as_bytes()).await;
                let _ = stream.shutdown().await;
            }
        }
    }));

    let mut legacy = TcpStream::connect(addr).await.expect("connect");
    legacy.write_all(b"WHELO").await.expect("legacy frame");
    let mut answer = [0u8; 11];
    legacy.read_exact(&mut answer).await.expect("answer");
    assert_eq!(&answer, b"plain:WHELO");

    let controller = pki.credentials(&Role::Controller);
    let mut tls = dial(controller.client_config(ExpectedRole::Node("n1".into())).expect("config"), addr)
        .await
        .expect("handshake");
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await.expect("a clean end");
    assert_eq!(answer, "tls:controller");
}

#[tokio::test]
async fn a_permissive_listener_counts_the_plaintext_connections_it_serves_and_no_tls_one() {
    let mut pki = Pki::new();
    let node = Arc::new(pki.credentials(&Role::Node("n1".into())));
    let listener = Listener::bind("127.0.0.1:0", Limits::default()).await.expect("bind");
    let (addr, stats) = (listener.local_addr().expect("addr"), listener.stats());
    // Each connection is held until its peer closes it.
    tokio::spawn(listener.serve_permissive(node, |conn| async move {
        let mut rest = Vec::new();
        match conn.transport {
            Transport::Plain(mut tcp) => drop(tcp.read_to_end(&mut rest).await),
            Transport::Tls { mut stream, .. } => drop(stream.read_to_end(&mut rest).await),
        }
    }));
    let open = || stats.plaintext_open.load(Ordering::Relaxed);
    let settled = |want: u64| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while open() != want {
            assert!(tokio::time::Instant::now() < deadline, "plaintext connections open: {}, not {want}", open());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };

    let mut legacy = TcpStream::connect(addr).await.expect("connect");
    legacy.write_all(b"W").await.expect("legacy frame");
    settled(1).await;
    let controller = pki.credentials(&Role::Controller);
    let tls = dial(controller.client_config(ExpectedRole::Node("n1".into())).expect("config"), addr)
        .await
        .expect("handshake");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(open(), 1, "a TLS connection is not counted");
    drop(legacy);
    settled(0).await;
    drop(tls);
}
