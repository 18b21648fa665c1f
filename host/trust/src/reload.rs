//! Credentials that follow their directory: [`LiveCredentials`] holds the current set, and a
//! [`Watcher`] thread polls the directory and swaps in a new set when the files change.
//!
//! Polling, not inotify: Kubernetes updates a mounted Secret by re-pointing a `..data` symlink,
//! which an inotify watch on the files themselves never sees. Each poll `stat`s the three files
//! (through their symlinks); when that changes it reads them and compares a SHA-256 of the
//! contents, so a touch is not a reload. A changed set is loaded and checked as at start
//! ([`Credentials::from_files`]); a good one replaces the current one in one step (handshakes
//! that start afterwards use it, connections already open keep theirs: a TLS session never looks
//! at the config again), a broken one is refused with one warning line naming what is wrong, and
//! the current set keeps serving. The same broken contents are not warned about twice.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rustls::{ClientConfig, ServerConfig};

use crate::credentials::{Credentials, CredentialsError};
use crate::secret_dir::{self, Fingerprint};
use crate::verifier::ExpectedRole;

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Load(#[from] CredentialsError),
    #[error("starting the thread that watches {dir}: {source}")]
    Thread { dir: PathBuf, source: std::io::Error },
}

/// How often the directory is polled unless told otherwise.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// The current credentials of a process; cheap to clone, shared by every listener and dialer.
#[derive(Clone)]
pub struct LiveCredentials {
    inner: Arc<Live>,
}

struct Live {
    current: RwLock<Arc<Credentials>>,
    /// Bumped on every swap.
    generation: AtomicU64,
    /// Why the last changed set was refused, until a good one is loaded.
    refusal: Mutex<Option<String>>,
}

impl LiveCredentials {
    /// Fixed credentials (nothing watches them until [`watch`] is used).
    pub fn new(credentials: Credentials) -> LiveCredentials {
        LiveCredentials {
            inner: Arc::new(Live {
                current: RwLock::new(Arc::new(credentials)),
                generation: AtomicU64::new(0),
                refusal: Mutex::new(None),
            }),
        }
    }

    /// The current set.
    pub fn current(&self) -> Arc<Credentials> {
        self.inner.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The current set's server config (any client role; see [`Credentials::server_config`]).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.current().server_config()
    }

    /// The current set's server config that also admits clients without a certificate (see
    /// [`Credentials::server_config_client_optional`]).
    pub fn server_config_client_optional(&self) -> Arc<ServerConfig> {
        self.current().server_config_client_optional()
    }

    /// A client config of the current set for a server of role `server`.
    pub fn client_config(&self, server: ExpectedRole) -> Result<Arc<ClientConfig>, CredentialsError> {
        self.current().client_config(server)
    }

    /// How many times the set was replaced since the start.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }

    /// Seconds until the current leaf certificate expires (negative once it has): the value of
    /// `wasmcsi_tls_certificate_expiry_seconds`.
    pub fn seconds_to_expiry(&self) -> i64 {
        self.current().seconds_to_expiry()
    }

    /// Why the last changed set was refused, while the one before it keeps serving.
    pub fn refusal(&self) -> Option<String> {
        self.inner.refusal.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn replace(&self, credentials: Credentials) {
        *self.inner.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(credentials);
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        *self.inner.refusal.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    fn refuse(&self, why: String) {
        *self.inner.refusal.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
    }
}

/// The polling thread; stops (and is joined) when dropped.
pub struct Watcher {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // Dropping the sender wakes the thread at once.
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Loads `dir` (it must load: a process does not start without credentials) and starts a
/// thread that polls it every `interval`.
pub fn watch(dir: &Path, interval: Duration) -> Result<(LiveCredentials, Watcher), ReloadError> {
    // The fingerprint is taken before the read, so a change that lands between the two is seen
    // by the first poll rather than missed.
    let fingerprint = secret_dir::fingerprint(dir).ok();
    let credentials = Credentials::load(dir)?;
    let hash = credentials.hash();
    let live = LiveCredentials::new(credentials);
    let (stop, stopped) = mpsc::channel();
    let poller = Poller { dir: dir.to_owned(), live: live.clone(), fingerprint, hash, last_error: None };
    let thread = std::thread::Builder::new()
        .name("tls-reload".into())
        .spawn(move || poller.run(interval, stopped))
        .map_err(|source| ReloadError::Thread { dir: dir.to_owned(), source })?;
    Ok((live, Watcher { stop: Some(stop), thread: Some(thread) }))
}

struct Poller {
    dir: PathBuf,
    live: LiveCredentials,
    /// What `stat` said when the files were last read.
    fingerprint: Option<Fingerprint>,
    /// The contents last considered (loaded or refused).
    hash: [u8; 32],
    /// The last error warned about, so a lasting one is one line, not one per poll.
    last_error: Option<String>,
}

impl Poller {
    fn run(mut self, interval: Duration, stopped: mpsc::Receiver<()>) {
        loop {
            match stopped.recv_timeout(interval) {
                Err(RecvTimeoutError::Timeout) => self.poll(),
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn poll(&mut self) {
        let fingerprint = match secret_dir::fingerprint(&self.dir) {
            Ok(f) => f,
            Err(e) => return self.warn(e.to_string()),
        };
        if self.fingerprint.as_ref() == Some(&fingerprint) {
            return;
        }
        let files = match secret_dir::read(&self.dir) {
            Ok(files) => files,
            Err(e) => return self.warn(e.to_string()),
        };
        self.fingerprint = Some(fingerprint);
        let hash = files.hash();
        if hash == self.hash {
            return;
        }
        self.hash = hash;
        match Credentials::from_files(&self.dir, &files) {
            Ok(credentials) => {
                let role = credentials.role().to_string();
                let expires_in = credentials.seconds_to_expiry();
                self.live.replace(credentials);
                self.last_error = None;
                tracing::info!(dir = %self.dir.display(), role, expires_in, "loaded new TLS credentials");
            }
            Err(e) => {
                self.live.refuse(e.to_string());
                self.warn(e.to_string());
            }
        }
    }

    fn warn(&mut self, error: String) {
        if self.last_error.as_ref() == Some(&error) {
            return;
        }
        let expires_in = self.live.seconds_to_expiry();
        tracing::warn!(
            dir = %self.dir.display(),
            %error,
            expires_in,
            "refusing new TLS credentials; the current ones keep serving"
        );
        self.last_error = Some(error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Role;
    use crate::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
    use std::time::Instant;

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_new_set_is_swapped_in_and_a_broken_one_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let trust = [ca.certificate().clone()];
        let life = Validity::starting_now(DEFAULT_LEAF_VALIDITY);
        ca.issue(&Role::Node("n1".into()), life).expect("issue").write(tmp.path(), &trust).expect("write");
        let (live, _watcher) = watch(tmp.path(), Duration::from_millis(20)).expect("watch");
        let first = live.current().chain()[0].clone();

        ca.issue(&Role::Node("n1".into()), life).expect("issue").write(tmp.path(), &trust).expect("rewrite");
        wait_for("the reload", || live.generation() == 1);
        let second = live.current().chain()[0].clone();
        assert_ne!(first, second);

        // A set whose key belongs to another certificate.
        let stray = tempfile::tempdir().expect("tempdir");
        ca.issue(&Role::Node("n1".into()), life).expect("issue").write(stray.path(), &trust).expect("write");
        let mut files = secret_dir::read(tmp.path()).expect("read");
        files.key = secret_dir::read(stray.path()).expect("read").key;
        secret_dir::write(tmp.path(), &files).expect("write broken");
        wait_for("the refusal", || live.refusal().is_some());
        assert!(live.refusal().is_some_and(|r| r.contains("does not match")), "{:?}", live.refusal());
        assert_eq!(live.generation(), 1);
        assert_eq!(live.current().chain()[0], second);

        // Fixed again: the refusal clears.
        ca.issue(&Role::Node("n1".into()), life).expect("issue").write(tmp.path(), &trust).expect("fix");
        wait_for("the second reload", || live.generation() == 2);
        assert_eq!(live.refusal(), None);
    }

    #[test]
    fn touching_the_files_reloads_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA");
        let trust = [ca.certificate().clone()];
        ca.issue(&Role::Controller, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .expect("issue")
            .write(tmp.path(), &trust)
            .expect("write");
        let (live, watcher) = watch(tmp.path(), Duration::from_millis(10)).expect("watch");
        // The same contents written again: new inodes and times, same hash.
        let files = secret_dir::read(tmp.path()).expect("read");
        secret_dir::write(tmp.path(), &files).expect("same set again");
        std::thread::sleep(Duration::from_millis(200));
        drop(watcher);
        assert_eq!(live.generation(), 0);
    }
}
