//! The control socket of an attached volume: `wasmcsi volume attach` listens on
//! `RUNTIME_DIR/VOLUME_ID.ctl`, and the other `wasmcsi volume …` commands talk to it while the
//! volume is attached, so online operations (snapshot, expand, replica replacement, detach) are
//! ordered with client I/O by the engine that owns the replicas. One JSON request per line, one
//! JSON reply per line; the socket is root-only (mode 0600), like the device it controls. The
//! status it sends is the attached volume's own view (`wasmcsi_datapath::attach::AttachStatus`).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use wasmcsi_datapath::attach::AttachStatus;

/// Where the control socket of `volume_id` lives.
pub fn socket_path(runtime_dir: &Path, volume_id: &str) -> PathBuf {
    runtime_dir.join(format!("{volume_id}.ctl"))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    Status,
    Snapshot { name: String },
    DeleteSnapshot { name: String },
    Snapshots,
    Expand { size: u64 },
    ReplaceReplica { index: usize, addr: std::net::SocketAddr },
    Detach,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<AttachStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<SnapshotView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

impl Reply {
    pub fn ok() -> Self {
        Self { ok: true, ..Self::default() }
    }
    pub fn error(e: impl std::fmt::Display) -> Self {
        Self { ok: false, error: Some(e.to_string()), ..Self::default() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotView {
    pub name: String,
    pub created_ns: u64,
}

/// A request from a client connection, with where to send its reply.
pub type Incoming = (Request, tokio::sync::oneshot::Sender<Reply>);

/// How long stopping the control socket waits for its connections to write the replies they
/// were given (a `volume detach` waits for its answer).
const REPLY_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// The control socket's server: stop it with [`CtlServer::stop`], which lets answered requests
/// reach their clients first.
pub struct CtlServer {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl CtlServer {
    /// Stops accepting and waits (at most [`REPLY_GRACE`]) until every connection wrote its
    /// replies and ended. Without it a detach's `ok` was lost when the process exited right after
    /// answering (the client saw the socket close without an answer).
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Binds the socket (replacing a stale one left by a crashed attach, but not a live one) and
/// forwards every request to `tx`.
pub async fn serve(path: PathBuf, tx: mpsc::Sender<Incoming>) -> anyhow::Result<CtlServer> {
    if path.exists() {
        if UnixStream::connect(&path).await.is_ok() {
            bail!("{} is in use: the volume is already attached by another process", path.display());
        }
        std::fs::remove_file(&path).with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    let listener = UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        connections.spawn(connection(stream, tx.clone()));
                    }
                    Err(_) => break,
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                _ = &mut stopped => break,
            }
        }
        // Connections end when their client hangs up after its answer; the rest are aborted
        // when the set drops.
        let _ = tokio::time::timeout(REPLY_GRACE, async { while connections.join_next().await.is_some() {} }).await;
    });
    Ok(CtlServer { stop, task })
}

async fn connection(stream: UnixStream, tx: mpsc::Sender<Incoming>) {
    let (rd, mut wr) = stream.into_split();
    let mut lines = BufReader::new(rd).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(request) => {
                let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
                if tx.send((request, reply_tx)).await.is_err() {
                    Reply::error("the volume is detaching")
                } else {
                    reply_rx.await.unwrap_or_else(|_| Reply::error("the volume is detaching"))
                }
            }
            Err(e) => Reply::error(format!("malformed request: {e}")),
        };
        let Ok(mut out) = serde_json::to_vec(&reply) else { return };
        out.push(b'\n');
        if wr.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Sends one request to an attached volume; `Ok(None)` when it is not attached here (no socket).
pub async fn call(runtime_dir: &Path, volume_id: &str, request: &Request) -> anyhow::Result<Option<Reply>> {
    let path = socket_path(runtime_dir, volume_id);
    let stream = match UnixStream::connect(&path).await {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) => {
            return Ok(None);
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("connecting to {}", path.display()))),
    };
    let (rd, mut wr) = stream.into_split();
    let mut line = serde_json::to_vec(request)?;
    line.push(b'\n');
    wr.write_all(&line).await.with_context(|| format!("writing to {}", path.display()))?;
    let mut lines = BufReader::new(rd).lines();
    let reply = lines
        .next_line()
        .await
        .with_context(|| format!("reading from {}", path.display()))?
        .with_context(|| format!("{} closed without answering", path.display()))?;
    Ok(Some(serde_json::from_str(&reply).context("parsing the attached volume's reply")?))
}

/// A progress bar of bytes on stderr (indicatif), drawn only for a person at a terminal: when
/// stderr is a pipe, a file or a pod's log it writes nothing at all, so logs stay free of
/// redrawn lines and escape codes.
pub struct Progress(indicatif::ProgressBar);

impl Progress {
    pub fn new(label: &str) -> Self {
        Self::drawn_on(label, indicatif::ProgressDrawTarget::stderr())
    }

    fn drawn_on(label: &str, target: indicatif::ProgressDrawTarget) -> Self {
        let bar = indicatif::ProgressBar::with_draw_target(Some(0), target);
        let style = indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {percent:>3}% {binary_bytes}/{binary_total_bytes} ({eta} left)",
        )
        .map_or_else(|_| indicatif::ProgressStyle::default_bar(), |s| s.progress_chars("#>."));
        bar.set_style(style);
        bar.set_message(label.to_owned());
        Self(bar)
    }

    /// `done` of `total` bytes.
    pub fn update(&self, done: u64, total: u64) {
        self.0.set_length(total);
        self.0.set_position(done.min(total));
    }

    /// What the bar is about, when it changes (another replica's rebuild).
    pub fn relabel(&self, label: &str) {
        self.0.set_message(label.to_owned());
    }

    /// Leave the bar as it ends, on a line of its own.
    pub fn finish(&self) {
        self.0.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex, PoisonError};

    /// What a terminal would have shown (text only, cursor moves ignored).
    #[derive(Debug, Default, Clone)]
    struct Screen(Arc<Mutex<String>>);

    impl Screen {
        fn text(&self) -> String {
            self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
        }
        fn push(&self, s: &str) {
            self.0.lock().unwrap_or_else(PoisonError::into_inner).push_str(s);
        }
    }

    impl indicatif::TermLike for Screen {
        fn width(&self) -> u16 {
            120
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.push(s);
            self.push("\n");
            Ok(())
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.push(s);
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    const CHILD: &str = "WASMCSI_TEST_DRAW_A_BAR";

    /// A whole clone's bar drawn with stderr a pipe (this test runs itself as a child with its
    /// stderr captured) writes nothing to it; on a terminal the same bar shows its label and
    /// its end.
    #[test]
    fn a_bar_is_drawn_on_a_terminal_and_writes_nothing_to_a_pipe() {
        let draw = |p: &Progress| {
            for i in 0..=10u64 {
                p.update(i << 20, 10 << 20);
                std::thread::sleep(std::time::Duration::from_millis(if std::env::var_os(CHILD).is_some() {
                    60
                } else {
                    1
                }));
            }
            p.finish();
        };
        if std::env::var_os(CHILD).is_some() {
            draw(&Progress::new("clone a@s -> b"));
            return;
        }
        let me = std::env::current_exe().expect("the test binary");
        let out = std::process::Command::new(me)
            .args(["--exact", "block_ctl::tests::a_bar_is_drawn_on_a_terminal_and_writes_nothing_to_a_pipe"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run the child");
        assert!(out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran the test: {out:?}");
        assert!(out.stderr.is_empty(), "wrote to a pipe: {:?}", String::from_utf8_lossy(&out.stderr));

        let screen = Screen::default();
        draw(&Progress::drawn_on("clone a@s -> b", indicatif::ProgressDrawTarget::term_like(Box::new(screen.clone()))));
        let shown = screen.text();
        assert!(shown.contains("clone a@s -> b [") && shown.contains("100%"), "{shown:?}");
        assert!(shown.contains("10.00 MiB/10.00 MiB"), "{shown:?}");
    }
}
