//! A replica node as a child process: `wasmcsi serve --mode node` serving its replicas on a
//! loopback port, started, killed with SIGKILL and restarted on the same port and root, as a
//! machine loses a node and its DaemonSet brings the plugin back. The demo and the
//! replicated-block benchmark use it; a real node's plugin is started by Kubernetes.
//!
//! The child runs in its own process group, so a Ctrl-C at the terminal reaches only the
//! parent, which then takes its volumes apart and stops the children itself (dropping a
//! [`ReplicaProcess`] kills and reaps it).
use anyhow::Context;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a started plugin may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// One replica node (see the module docs).
pub struct ReplicaProcess {
    exe: PathBuf,
    home: PathBuf,
    name: String,
    addr: SocketAddr,
    /// This node's credentials (mutual TLS, `required`); none: plaintext, said so.
    tls_dir: Option<PathBuf>,
    child: Option<Child>,
}

/// A loopback address with a port free right now (the child binds it a moment later; a
/// restarted child binds the same one again).
pub fn free_loopback_addr() -> std::io::Result<SocketAddr> {
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

impl ReplicaProcess {
    /// Starts node `name` from the binary `exe`, its replicas, state and log under `home`;
    /// returns once its replica server accepts connections.
    pub async fn start(exe: &Path, home: &Path, name: &str) -> anyhow::Result<Self> {
        Self::start_with_tls(exe, home, name, None).await
    }

    /// [`Self::start`], serving its replicas over mutual TLS (`required`) with the node's
    /// credentials in `tls_dir` when given, in plaintext otherwise.
    pub async fn start_with_tls(exe: &Path, home: &Path, name: &str, tls_dir: Option<&Path>) -> anyhow::Result<Self> {
        std::fs::create_dir_all(home.join("backends")).with_context(|| format!("creating {}", home.display()))?;
        let addr = free_loopback_addr().context("finding a free loopback port")?;
        let mut node = Self {
            exe: exe.to_owned(),
            home: home.to_owned(),
            name: name.to_owned(),
            addr,
            tls_dir: tls_dir.map(Path::to_owned),
            child: None,
        };
        node.spawn().await?;
        Ok(node)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where its replica server listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The running process's id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The child's log (stderr), for a failure's report.
    pub fn log(&self) -> PathBuf {
        self.home.join(format!("{}.log", self.name))
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.log())
            .with_context(|| format!("opening {}", self.log().display()))?;
        let mut command = Command::new(&self.exe);
        command
            .args(["--log", "warn", "serve", "--mode", "node", "--reconcile-interval", "0", "--node-id"])
            .arg(&self.name)
            .arg("--socket")
            .arg(self.home.join("csi.sock"))
            .arg("--state-dir")
            .arg(self.home.join("state"))
            .arg("--backends-dir")
            .arg(self.home.join("backends"))
            .arg("--replica-listen")
            .arg(self.addr.to_string())
            .arg("--replica-root")
            .arg(self.home.join("replicas"));
        match &self.tls_dir {
            Some(dir) => command.arg("--tls-dir").arg(dir).args(["--tls-mode", "required"]),
            // Plaintext, said so: a benchmark node on loopback.
            None => command.args(["--tls-mode", "off"]),
        };
        let child = command
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {} ({})", self.name, self.exe.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return Ok(());
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                anyhow::bail!("{} exited at start ({status}); see {}", self.name, self.log().display());
            }
            if Instant::now() > deadline {
                self.kill();
                anyhow::bail!("{} did not listen on {} within {START_TIMEOUT:?}", self.name, self.addr);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, then reaps it: the node is gone as a crashed machine's is (no flush, no
    /// goodbye to the engines connected to it).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Already dead is fine: the wait reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same address and replica root.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }
}

impl Drop for ReplicaProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
