//! Test infrastructure: a real OCI registry, Debian's `docker-registry` (CNCF distribution v2,
//! installed by `scripts/setup`), on 127.0.0.1 with TLS (a CA and a certificate made here with
//! rcgen) and htpasswd basic auth (a bcrypt line from `htpasswd`, apache2-utils), its storage in a
//! temporary directory. Dropping it kills the process and removes the directory, a failing test
//! included (the panic unwinds through the drop).
use base64::Engine as _;
use std::io;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BINARY: &str = "/usr/bin/docker-registry";
pub const USER: &str = "wasmcsi";
pub const PASSWORD: &str = "s3cret-test-password";

pub struct TestRegistry {
    child: Child,
    dir: tempfile::TempDir,
    /// `127.0.0.1:PORT`
    pub addr: String,
    /// the CA that signed the registry's certificate (PEM)
    pub ca_file: PathBuf,
    /// a docker `config.json` with the registry's credentials
    pub docker_config: PathBuf,
}

impl TestRegistry {
    /// Whether the machine has the registry (scripts/setup installs it); tests skip loudly
    /// without it.
    pub fn available() -> bool {
        Path::new(BINARY).exists() && which("htpasswd")
    }

    /// A started registry; `None` (saying so) where the machine has none, except under `CI`,
    /// where a missing registry fails the test: CI must not pass by skipping.
    pub fn start_or_skip() -> Option<Self> {
        if !Self::available() {
            assert!(
                std::env::var_os("CI").is_none(),
                "no {BINARY} or htpasswd under CI: scripts/setup installs docker-registry and apache2-utils"
            );
            eprintln!("SKIPPED: no {BINARY} or htpasswd (scripts/setup installs docker-registry and apache2-utils)");
            return None;
        }
        Some(Self::start().expect("starting docker-registry"))
    }

    pub fn start() -> io::Result<Self> {
        let mut dir = tempfile::Builder::new().prefix("wasmcsi-registry-").tempdir()?;
        let (ca_pem, cert_pem, key_pem) = certificates().map_err(io::Error::other)?;
        let ca_file = dir.path().join("ca.crt");
        std::fs::write(&ca_file, ca_pem)?;
        std::fs::write(dir.path().join("tls.crt"), cert_pem)?;
        std::fs::write(dir.path().join("tls.key"), key_pem)?;
        let htpasswd = Command::new("htpasswd").args(["-Bbn", USER, PASSWORD]).output()?;
        if !htpasswd.status.success() {
            return Err(io::Error::other(format!("htpasswd: {}", String::from_utf8_lossy(&htpasswd.stderr))));
        }
        std::fs::write(dir.path().join("htpasswd"), &htpasswd.stdout)?;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
        // A port that was free a moment ago; a lost race shows as the child exiting, retried.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let addr = format!("127.0.0.1:{port}");
            let docker_config = dir.path().join("docker/config.json");
            std::fs::create_dir_all(dir.path().join("docker"))?;
            std::fs::write(&docker_config, format!(r#"{{"auths": {{"{addr}": {{"auth": "{auth}"}}}}}}"#))?;
            let d = dir.path().display();
            let config = format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {d}/storage\n  delete:\n    enabled: true\n\
                 http:\n  addr: {addr}\n  tls:\n    certificate: {d}/tls.crt\n    key: {d}/tls.key\n\
                 auth:\n  htpasswd:\n    realm: wasmcsi-test\n    path: {d}/htpasswd\n"
            );
            let config_path = dir.path().join("config.yml");
            std::fs::write(&config_path, config)?;
            let log = std::fs::File::create(dir.path().join("registry.log"))?;
            let child = Command::new(BINARY)
                .arg("serve")
                .arg(&config_path)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?;
            let mut registry = Self { child, dir, addr, ca_file: ca_file.clone(), docker_config };
            if registry.wait_listening(Duration::from_secs(15))? {
                return Ok(registry);
            }
            let _ = registry.child.kill();
            let _ = registry.child.wait();
            // Take the directory back for the next try (the struct's Drop must not remove it).
            dir = std::mem::replace(&mut registry.dir, tempfile::tempdir()?);
        }
        Err(io::Error::other("docker-registry did not start listening"))
    }

    fn wait_listening(&mut self, within: Duration) -> io::Result<bool> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(false);
            }
            if TcpStream::connect(&self.addr).is_ok() {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(false)
    }

    /// The file the registry serves blob `sha256:HEX` from (filesystem driver layout).
    pub fn blob_data(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.dir.path().join("storage/docker/registry/v2/blobs/sha256").join(&hex[..2]).join(hex).join("data")
    }

    /// Stop the process (SIGSTOP): connections are accepted by the kernel and never answered.
    pub fn pause(&self) -> io::Result<()> {
        self.signal("-STOP")
    }

    pub fn resume(&self) -> io::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, sig: &str) -> io::Result<()> {
        let status = Command::new("kill").arg(sig).arg(self.child.id().to_string()).status()?;
        if status.success() { Ok(()) } else { Err(io::Error::other(format!("kill {sig} failed"))) }
    }

    /// The registry's own log, for assertion messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(program).is_file()))
}

/// (CA PEM, certificate PEM, key PEM) for 127.0.0.1 and localhost.
fn certificates() -> Result<(String, String, String), rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "wasmcsi test registry CA");
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((ca.pem(), cert.pem(), key.serialize_pem()))
}
