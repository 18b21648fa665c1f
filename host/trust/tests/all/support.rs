//! Shared test machinery: a CA with credentials directories, an echo server behind the
//! listener, raw rustls clients that present any chain (bad ones included), and child
//! processes of this binary.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, Issuer, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{AlertDescription, ClientConfig};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use wasmcsi_trust::credentials::server_name;
use wasmcsi_trust::listener::{ServerConfigSource, Stats};
use wasmcsi_trust::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Issued};
use wasmcsi_trust::provider::{PROTOCOL_VERSIONS, provider};
use wasmcsi_trust::verifier::PeerVerifier;
use wasmcsi_trust::{Authority, Credentials, ExpectedRole, Limits, Listener, Role, TrustAnchors, Validity};

/// A CA (saved, so tests can sign with its key directly) and the directories issued by it.
pub struct Pki {
    pub ca: Authority,
    ca_dir: tempfile::TempDir,
    dirs: Vec<tempfile::TempDir>,
}

impl Pki {
    pub fn new() -> Pki {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let ca_dir = tempfile::tempdir().expect("tempdir");
        ca.save(ca_dir.path()).expect("save CA");
        Pki { ca, ca_dir, dirs: Vec::new() }
    }

    pub fn trust(&self) -> Vec<CertificateDer<'static>> {
        vec![self.ca.certificate().clone()]
    }

    pub fn anchors(&self) -> Arc<TrustAnchors> {
        Arc::new(TrustAnchors::new(self.trust()).expect("anchors"))
    }

    /// A new credentials directory for `role`, valid for a day.
    pub fn dir(&mut self, role: &Role) -> PathBuf {
        let dir = tempfile::tempdir().expect("tempdir");
        self.write(role, dir.path());
        let path = dir.path().to_owned();
        self.dirs.push(dir);
        path
    }

    /// Issues for `role` into `dir` (replacing what is there, as a rotation does).
    pub fn write(&self, role: &Role, dir: &Path) -> Issued {
        let issued = self.ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).expect("issue");
        issued.write(dir, &self.trust()).expect("write");
        issued
    }

    pub fn credentials(&mut self, role: &Role) -> Credentials {
        let dir = self.dir(role);
        Credentials::load(&dir).expect("load")
    }

    /// A certificate signed by this CA with `params` as given (for certificates `pki` would
    /// never issue), and its key.
    pub fn sign_raw(&self, params: &CertificateParams) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key_pem = std::fs::read_to_string(self.ca_dir.path().join("ca.key")).expect("ca.key");
        let issuer = Issuer::from_ca_cert_der(self.ca.certificate(), KeyPair::from_pem(&key_pem).expect("CA key"))
            .expect("issuer");
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
        let cert = params.signed_by(&key, &issuer).expect("sign");
        (vec![cert.der().clone()], PrivatePkcs8KeyDer::from(key.serialize_der()).into())
    }
}

/// Leaf parameters as `pki` would write them, with `uris` as the URI SANs.
pub fn leaf_params(uris: &[String]) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.subject_alt_names =
        uris.iter().map(|u| SanType::URI(rcgen::string::Ia5String::try_from(u.as_str()).expect("uri"))).collect();
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(1);
    params.not_after = now + time::Duration::hours(1);
    params
}

/// A client that verifies the server as ours do (any wasmcsi role) and presents `identity`
/// as given, checked or not: what an attacker's client can do.
pub fn raw_client(
    anchors: Arc<TrustAnchors>,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Arc<ClientConfig> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .expect("TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PeerVerifier::new(anchors, ExpectedRole::Any)));
    Arc::new(match identity {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).expect("client cert"),
        None => builder.with_no_client_auth(),
    })
}

/// An echo server behind a [`Listener`]: the roles of the connections its handler got, and
/// the listener's counters.
pub struct EchoServer {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    pub roles: Arc<Mutex<Vec<Role>>>,
}

pub async fn echo_server(source: impl ServerConfigSource, limits: Limits) -> EchoServer {
    let listener = Listener::bind("127.0.0.1:0", limits).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stats = listener.stats();
    let roles = Arc::new(Mutex::new(Vec::new()));
    let seen = roles.clone();
    tokio::spawn(listener.serve_tls(source, move |conn| {
        seen.lock().expect("roles").push(conn.role.clone());
        async move {
            let (mut rd, mut wr) = tokio::io::split(conn.stream);
            let _ = tokio::io::copy(&mut rd, &mut wr).await;
        }
    }));
    EchoServer { addr, stats, roles }
}

pub async fn dial(config: Arc<ClientConfig>, addr: SocketAddr) -> io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    tokio::time::timeout(Duration::from_secs(10), TlsConnector::from(config).connect(server_name(), tcp))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "handshake timed out"))?
}

/// One message out and back.
pub async fn round_trip(stream: &mut TlsStream<TcpStream>, message: &[u8]) -> io::Result<()> {
    stream.write_all(message).await?;
    stream.flush().await?;
    let mut back = vec![0u8; message.len()];
    stream.read_exact(&mut back).await?;
    assert_eq!(back, message);
    Ok(())
}

/// The alert a server refused us with: dials, sends a byte, reads. Panics if the server
/// echoed (it accepted the client).
pub async fn refusal(config: Arc<ClientConfig>, addr: SocketAddr) -> AlertDescription {
    let error = match dial(config, addr).await {
        Err(e) => e,
        Ok(mut stream) => {
            // TLS 1.3: the client's handshake ends before the server has checked its
            // certificate; the server's verdict arrives with the first read.
            let _ = stream.write_all(b"x").await;
            let _ = stream.flush().await;
            let mut byte = [0u8; 1];
            match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte)).await {
                Ok(Err(e)) => e,
                Ok(Ok(n)) => panic!("the server accepted the client (read {n} bytes)"),
                Err(_) => panic!("the server neither answered nor refused"),
            }
        }
    };
    match error.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::AlertReceived(alert)) => *alert,
        _ => panic!("refused without an alert: {error}"),
    }
}

pub mod child {
    //! Child processes of this test binary: `run` starts this binary again with one ignored
    //! test selected and an environment variable that makes that test do the child's part.

    use std::io::{BufRead as _, BufReader, Write as _};
    use std::process::{Child, ChildStdin, Command, Stdio};
    use std::sync::mpsc::{self, Receiver};
    use std::time::Duration;

    /// Set in a child to the part it plays.
    pub const ROLE_VAR: &str = "WASMCSI_TRUST_TEST_CHILD";

    pub struct ChildProcess {
        child: Child,
        stdin: ChildStdin,
        lines: Receiver<String>,
    }

    impl ChildProcess {
        /// Starts `test` (a full test path) of this binary in a child with `ROLE_VAR=role`,
        /// under `sh -c PREFIX` when a shell prefix (e.g. `ulimit -n 64;`) is given.
        pub fn run(test: &str, role: &str, env: &[(&str, &str)], shell_prefix: Option<&str>) -> ChildProcess {
            let exe = std::env::current_exe().expect("test binary");
            let args = ["--exact", test, "--include-ignored", "--nocapture", "--test-threads=1"];
            let mut command = match shell_prefix {
                Some(prefix) => {
                    let mut c = Command::new("sh");
                    c.arg("-c").arg(format!("{prefix} exec \"$0\" \"$@\"")).arg(&exe).args(args);
                    c
                }
                None => {
                    let mut c = Command::new(&exe);
                    c.args(args);
                    c
                }
            };
            command.env(ROLE_VAR, role).envs(env.iter().copied()).stdin(Stdio::piped()).stdout(Stdio::piped());
            let mut child = command.spawn().expect("spawn child");
            let stdin = child.stdin.take().expect("stdin");
            let stdout = child.stdout.take().expect("stdout");
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
            ChildProcess { child, stdin, lines }
        }

        /// What follows `prefix` in the next line the child printed that holds it.
        pub fn expect_line(&mut self, prefix: &str) -> String {
            loop {
                let line = self
                    .lines
                    .recv_timeout(Duration::from_secs(60))
                    .unwrap_or_else(|e| panic!("no line {prefix:?} from the child: {e}"));
                // Anywhere in the line: the harness prints "test NAME ... " before the child's
                // first line, without a line break.
                if let Some(at) = line.find(prefix) {
                    return line[at + prefix.len()..].trim().to_owned();
                }
            }
        }

        /// Sends one command line and returns the answer line starting with `answer`.
        pub fn ask(&mut self, command: &str, answer: &str) -> String {
            writeln!(self.stdin, "{command}").expect("write to child");
            self.stdin.flush().expect("flush to child");
            self.expect_line(answer)
        }
    }

    impl Drop for ChildProcess {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// In the child: the commands the parent sends, one per line.
    pub fn commands() -> impl Iterator<Item = String> {
        std::io::stdin().lines().map_while(Result::ok)
    }

    /// `key value` pairs of an answer line.
    pub fn field(line: &str, key: &str) -> u64 {
        let mut words = line.split_whitespace();
        while let Some(word) = words.next() {
            if word == key {
                return words.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{key} in {line:?}"));
            }
        }
        panic!("no {key} in {line:?}")
    }
}
