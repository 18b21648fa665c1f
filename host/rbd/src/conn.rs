//! Connections to a cluster, one per (cluster, user), and the thread every blocking call runs
//! on.
//!
//! librados calls block, some without a bound of their own (connecting to a frozen monitor,
//! an OSD that accepted the TCP connection and never answers). Two layers keep callers from
//! hanging: librados' own `client_mount_timeout` / `rados_mon_op_timeout` /
//! `rados_osd_op_timeout`, and above them every call runs on a fresh thread the caller waits for
//! with a deadline. A call that misses the deadline is answered `Unavailable` at once; its
//! thread finishes (or fails) when librados' own timeout fires, shortly after, and only then
//! drops its reference to the connection. The number of such threads per client is capped, so
//! a dead cluster cannot make the host spawn without bound.
#![allow(unsafe_code, reason = "owns librados handles (FFI)")]

use crate::error::Target;
use crate::ffi;
use crate::{RbdCredentials, RbdError};
use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// A connected `rados_t`. librados handles are thread-safe; the handle is shut down when the
/// last reference goes (which may be a worker thread that outlived its caller's deadline).
pub(crate) struct Rados {
    handle: ffi::rados_t,
}

// SAFETY: librados documents `rados_t` as safe to use from several threads at once.
unsafe impl Send for Rados {}
unsafe impl Sync for Rados {}

impl Drop for Rados {
    fn drop(&mut self) {
        // rados_shutdown waits for librados' threads, which may be blocked on a dead cluster
        // until their timeouts fire: it runs on a thread of its own, and the caller waits a
        // little for it. The wait matters at process exit: a shutdown still running while the
        // C++ runtime destroys its statics threw through our thread's frames, which aborts the
        // process ("Rust cannot catch foreign exceptions"; seen in CI after a passing test).
        let handle = SendHandle(self.handle);
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let shutdown = move || {
            let h = handle;
            // SAFETY: created by rados_create2, shut down once; no ioctx outlives it (an Ioctx
            // holds an Arc<Connection>).
            unsafe { ffi::rados_shutdown(h.0) };
            let _ = done.send(());
        };
        match std::thread::Builder::new().name("rados-shutdown".into()).spawn(shutdown) {
            Ok(_) => {
                if finished.recv_timeout(SHUTDOWN_WAIT).is_err() {
                    tracing::warn!("rados_shutdown still runs (a cluster that does not answer); not waiting for it");
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not spawn the rados shutdown thread; leaking the handle"),
        }
    }
}

/// How long dropping a connection waits for its shutdown (a live cluster takes milliseconds).
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

struct SendHandle(ffi::rados_t);
// SAFETY: moved to the thread that shuts it down; nothing else uses it any more.
unsafe impl Send for SendHandle {}

pub(crate) fn cstring(s: &str, what: &str) -> Result<CString, RbdError> {
    CString::new(s).map_err(|_| RbdError::InvalidArgument(format!("{what} {s:?} contains NUL")))
}

/// Seconds for librados' timeout options: whole seconds, at least 1 (0 means "no timeout").
fn secs(d: Duration) -> String {
    d.as_secs_f64().ceil().max(1.0).to_string()
}

impl Rados {
    /// Create and connect a handle. Blocks up to `client_mount_timeout`; run on a worker.
    fn connect(
        target: &Target,
        creds: &RbdCredentials,
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> Result<Self, RbdError> {
        let user = cstring(&format!("client.{}", creds.user), "user")?;
        let cluster = cstring("ceph", "cluster")?;
        let mut handle: ffi::rados_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; strings live across the call. Flags 0: no config file
        // is read (nothing from /etc/ceph leaks in); every option is set below.
        let ret = unsafe { ffi::rados_create2(&mut handle, cluster.as_ptr(), user.as_ptr(), 0) };
        if ret < 0 {
            return Err(target.errno(ret, "rados_create2"));
        }
        let rados = Self { handle };
        let options = [
            ("mon_host", target.monitors.clone()),
            ("key", creds.key.clone()),
            ("client_mount_timeout", secs(connect_timeout)),
            ("rados_mon_op_timeout", secs(op_timeout)),
            ("rados_osd_op_timeout", secs(op_timeout)),
            // No keyring files, no admin socket, no log file: a library in a host process.
            ("keyring", String::new()),
            ("admin_socket", String::new()),
            ("log_to_stderr", "false".into()),
            ("err_to_stderr", "false".into()),
            ("log_file", String::new()),
            // librbd's in-memory cache only delays write errors here; the host does no image I/O
            // but the test helpers' reads/writes.
            ("rbd_cache", "false".into()),
        ];
        for (name, value) in options {
            let (n, v) = (cstring(name, "option")?, cstring(&value, name)?);
            // SAFETY: valid handle and NUL-terminated strings.
            let ret = unsafe { ffi::rados_conf_set(rados.handle, n.as_ptr(), v.as_ptr()) };
            if ret < 0 {
                // Never echo the value: it may be the key.
                return Err(match name {
                    "mon_host" => RbdError::InvalidArgument(format!(
                        "monitors {:?} of cluster {}",
                        target.monitors, target.cluster
                    )),
                    "key" => RbdError::InvalidArgument(format!("the key of client.{} is malformed", creds.user)),
                    _ => target.errno(ret, &format!("setting {name}")),
                });
            }
        }
        // SAFETY: valid, configured handle.
        let ret = unsafe { ffi::rados_connect(rados.handle) };
        if ret < 0 {
            let errno = nix::errno::Errno::from_raw(-ret);
            return Err(match errno {
                // What a wrong key or unknown user looks like from librados.
                nix::errno::Errno::EACCES | nix::errno::Errno::EPERM => RbdError::PermissionDenied(format!(
                    "cluster {} refused client.{}: {}",
                    target.cluster,
                    creds.user,
                    errno.desc()
                )),
                // A monitor that never answers, or one that refuses, is "cannot reach".
                _ => target.unavailable(format!("connecting as client.{}: {}", creds.user, errno.desc())),
            });
        }
        Ok(rados)
    }

    /// `ceph <cmd>` as JSON through the monitor; returns its output buffer.
    pub fn mon_command(&self, target: &Target, cmd: &str) -> Result<Vec<u8>, RbdError> {
        let c = cstring(cmd, "command")?;
        let mut cmds = [c.as_ptr()];
        let (mut out, mut outlen, mut outs, mut outslen) =
            (std::ptr::null_mut::<c_char>(), 0usize, std::ptr::null_mut::<c_char>(), 0usize);
        // SAFETY: one valid command string; out-pointers to locals; buffers freed below.
        let ret = unsafe {
            ffi::rados_mon_command(
                self.handle,
                cmds.as_mut_ptr(),
                1,
                std::ptr::null(),
                0,
                &mut out,
                &mut outlen,
                &mut outs,
                &mut outslen,
            )
        };
        let take = |p: *mut c_char, len: usize| {
            if p.is_null() {
                return Vec::new();
            }
            // SAFETY: librados returned `len` bytes at `p`, which we free once, here.
            let v = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }.to_vec();
            unsafe { ffi::rados_buffer_free(p) };
            v
        };
        let (out, status) = (take(out, outlen), take(outs, outslen));
        if ret < 0 {
            return Err(target.errno(ret, &format!("mon command {cmd}: {}", String::from_utf8_lossy(&status))));
        }
        Ok(out)
    }
}

/// A connection of one user to one cluster, shared by the calls that use it.
pub(crate) struct Connection {
    pub rados: Rados,
    /// To notice a changed key (rotated secret): the pooled connection is then replaced.
    key: String,
}

/// An I/O context on one pool; holds its connection alive.
pub(crate) struct Ioctx {
    pub handle: ffi::rados_ioctx_t,
    conn: Arc<Connection>,
}

impl Ioctx {
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The pool's id (what librbd names a group's pool by).
    pub fn pool_id(&self) -> i64 {
        // SAFETY: a live ioctx.
        unsafe { ffi::rados_ioctx_get_id(self.handle) }
    }
}

impl Drop for Ioctx {
    fn drop(&mut self) {
        // SAFETY: created by rados_ioctx_create, destroyed once.
        unsafe { ffi::rados_ioctx_destroy(self.handle) }
    }
}

impl Connection {
    /// An ioctx for `pool`; NotFound when the pool does not exist.
    pub fn ioctx(self: &Arc<Self>, target: &Target, pool: &str) -> Result<Ioctx, RbdError> {
        let p = cstring(pool, "pool")?;
        let mut handle: ffi::rados_ioctx_t = std::ptr::null_mut();
        // SAFETY: connected handle, out-pointer to a local.
        let ret = unsafe { ffi::rados_ioctx_create(self.rados.handle, p.as_ptr(), &mut handle) };
        if ret < 0 {
            return Err(target.errno(ret, &format!("pool {pool} of cluster {}", target.cluster)));
        }
        Ok(Ioctx { handle, conn: self.clone() })
    }
}

type Key = (String, String);
type Slot = Arc<tokio::sync::Mutex<Option<Arc<Connection>>>>;

/// The connections of one client, and the bound on its worker threads.
pub(crate) struct Pool {
    slots: Mutex<HashMap<Key, Slot>>,
    in_flight: Arc<AtomicUsize>,
    pub max_in_flight: usize,
    pub connect_timeout: Duration,
    pub op_timeout: Duration,
}

impl Pool {
    pub fn new(max_in_flight: usize, connect_timeout: Duration, op_timeout: Duration) -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            in_flight: Arc::new(AtomicUsize::new(0)),
            max_in_flight: max_in_flight.max(1),
            connect_timeout,
            op_timeout,
        }
    }

    fn slot(&self, target: &Target, user: &str) -> Slot {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        slots.entry((target.cluster.clone(), user.to_owned())).or_default().clone()
    }

    /// The pooled connection of `creds.user` to the cluster, connecting (once, however many
    /// callers wait) when there is none or the key changed.
    pub async fn connection(&self, target: &Target, creds: &RbdCredentials) -> Result<Arc<Connection>, RbdError> {
        let slot = self.slot(target, &creds.user);
        let mut conn = slot.lock().await;
        if let Some(c) = conn.as_ref()
            && c.key == creds.key
        {
            return Ok(c.clone());
        }
        // The old connection (if any) is dropped by whoever holds it last.
        *conn = None;
        let (t, c, ct, ot) = (target.clone(), creds.clone(), self.connect_timeout, self.op_timeout);
        let what = format!("connecting to cluster {} as client.{}", target.cluster, creds.user);
        let rados = self.run(target, &what, self.connect_timeout, move || Rados::connect(&t, &c, ct, ot)).await?;
        let fresh = Arc::new(Connection { rados, key: creds.key.clone() });
        *conn = Some(fresh.clone());
        tracing::debug!(cluster = %target.cluster, user = %creds.user, "connected");
        Ok(fresh)
    }

    /// Forget the pooled connection after it failed to reach the cluster: the next call
    /// connects again (monitors may have moved; a frozen session is not reused).
    pub async fn evict(&self, target: &Target, user: &str) {
        let slot = self.slot(target, user);
        *slot.lock().await = None;
    }

    /// Run `f` on its own thread; `Unavailable` if it has not returned within `limit`.
    pub async fn run<T: Send + 'static>(
        &self,
        target: &Target,
        what: &str,
        limit: Duration,
        f: impl FnOnce() -> Result<T, RbdError> + Send + 'static,
    ) -> Result<T, RbdError> {
        let in_flight = self.in_flight.clone();
        if in_flight.fetch_add(1, Ordering::AcqRel) >= self.max_in_flight {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(target.unavailable(format!(
                "{what}: {} calls already in flight (the cluster is not answering them)",
                self.max_in_flight
            )));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new().name("rbd-call".into()).spawn(move || {
            let r = f();
            in_flight.fetch_sub(1, Ordering::AcqRel);
            // The caller may have given up (deadline): then nobody listens, which is fine.
            let _ = tx.send(r);
        });
        if let Err(e) = spawned {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(RbdError::Internal(format!("{what}: spawning a worker thread: {e}")));
        }
        match tokio::time::timeout(limit, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(RbdError::Internal(format!("{what}: worker thread panicked"))),
            Err(_) => Err(target.unavailable(format!("{what}: no answer within {limit:?}"))),
        }
    }
}
