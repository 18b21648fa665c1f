//! What TLS costs the engine's data connections: one 4 KiB write (a 16-byte frame header and
//! a 4 KiB payload, vectored) sent from a synchronous thread straight into the socket, over
//! mutual TLS ([`wasmcsi_trust::stream`]) and over plain TCP, to a loopback server that reads
//! and discards; the sender's encryption alone (into memory); and one full mutual-TLS
//! handshake.
//!
//! `cargo bench --workspace --locked --bench tls_stream`

use std::io::{self, IoSlice, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use wasmcsi_trust::credentials::server_name;
use wasmcsi_trust::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};
use wasmcsi_trust::stream::{self, Sent, TlsWriter};
use wasmcsi_trust::{Authority, Credentials, ExpectedRole, Limits, Listener, Role, Validity};

const HEADER: usize = 16;
const PAYLOAD: usize = 4096;

struct Setup {
    _dirs: Vec<tempfile::TempDir>,
    server: Arc<Credentials>,
    client: Credentials,
}

fn setup() -> Setup {
    let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
    let mut dirs = Vec::new();
    let mut load = |role: Role| {
        let dir = tempfile::tempdir().expect("tempdir");
        ca.issue(&role, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .expect("issue")
            .write(dir.path(), &[ca.certificate().clone()])
            .expect("write");
        let creds = Credentials::load(dir.path()).expect("load");
        dirs.push(dir);
        creds
    };
    let server = Arc::new(load(Role::Node("replica".into())));
    let client = load(Role::Node("engine".into()));
    Setup { _dirs: dirs, server, client }
}

/// A TLS server that reads and discards everything.
fn tls_sink(rt: &Runtime, server: Arc<Credentials>) -> SocketAddr {
    rt.block_on(async {
        let limits = Limits { max_per_source: 100_000, max_connections: 100_000, ..Limits::default() };
        let listener = Listener::bind("127.0.0.1:0", limits).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(listener.serve_tls(server, |mut conn| async move {
            let mut buf = vec![0u8; 256 * 1024];
            while matches!(conn.stream.read(&mut buf).await, Ok(n) if n > 0) {}
        }));
        addr
    })
}

/// A plain TCP server that reads and discards everything.
fn plain_sink(rt: &Runtime) -> SocketAddr {
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 256 * 1024];
                    while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {}
                });
            }
        });
        addr
    })
}

fn send_tls(rt: &Runtime, writer: &TlsWriter, bufs: &[IoSlice<'_>]) {
    if writer.try_send(bufs).expect("try_send") == Sent::Partly {
        rt.block_on(writer.flush()).expect("flush");
    }
}

fn send_plain(rt: &Runtime, tcp: &TcpStream, bufs: &[IoSlice<'_>]) {
    let mut owned: Vec<IoSlice<'_>> = bufs.to_vec();
    let mut rest = &mut owned[..];
    while !rest.is_empty() {
        match tcp.try_write_vectored(rest) {
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => rt.block_on(tcp.writable()).expect("writable"),
            Err(e) => panic!("write: {e}"),
        }
    }
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let s = setup();
    let header = [0x57u8; HEADER];
    let payload = vec![0xa5u8; PAYLOAD];
    let bufs = [IoSlice::new(&header), IoSlice::new(&payload)];

    let mut group = c.benchmark_group("write_4k");
    group.throughput(Throughput::Bytes((HEADER + PAYLOAD) as u64));

    let plain_addr = plain_sink(&rt);
    let tcp = rt.block_on(TcpStream::connect(plain_addr)).expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    group.bench_function("plain", |b| b.iter(|| send_plain(&rt, &tcp, &bufs)));

    let tls_addr = tls_sink(&rt, s.server.clone());
    let config = s.client.client_config(ExpectedRole::Node("replica".into())).expect("client config");
    let (writer, _reader, _) = rt
        .block_on(async {
            let tcp = TcpStream::connect(tls_addr).await.expect("connect");
            stream::connect(tcp, config.clone(), server_name(), Duration::from_secs(5)).await
        })
        .expect("handshake");
    group.bench_function("tls", |b| b.iter(|| send_tls(&rt, &writer, &bufs)));

    // The sender's CPU alone: record framing and AES-128-GCM into memory, no socket and no
    // receiver (on a shared 2-core machine the loopback receiver's decryption competes with the
    // sender for the same cores).
    let mut session = rt
        .block_on(async {
            let tcp = TcpStream::connect(tls_addr).await.expect("connect");
            tokio_rustls::TlsConnector::from(config.clone()).connect(server_name(), tcp).await
        })
        .expect("handshake")
        .into_inner()
        .1;
    session.set_buffer_limit(None);
    group.bench_function("tls_encrypt_only", |b| {
        b.iter(|| {
            let taken = session.writer().write_vectored(&bufs).expect("encrypt");
            assert_eq!(taken, HEADER + PAYLOAD);
            while session.wants_write() {
                session.write_tls(&mut io::sink()).expect("drain");
            }
        })
    });
    group.finish();

    c.bench_function("mtls_handshake", |b| {
        b.iter(|| {
            rt.block_on(async {
                let tcp = TcpStream::connect(tls_addr).await.expect("connect");
                stream::connect(tcp, config.clone(), server_name(), Duration::from_secs(5)).await.expect("handshake")
            })
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5)).sample_size(50);
    targets = bench
}
criterion_main!(benches);
