//! The FUSE server of the volume file: worker threads that read requests from `/dev/fuse` and
//! answer them from the [`BlockDevice`], and that can be stopped at a request boundary and
//! started again, in this process or in another one that inherited the connection's fd.
//!
//! That last part is why this is not `fuser`: a fuser session cannot stop reading without
//! ending the connection, and cannot serve a connection whose INIT another process answered.
//! Here a connection is one *session fd* (the fd the mount was made with); each worker reads its
//! own clone of it (`FUSE_DEV_IOC_CLONE`, so the kernel spreads requests over the workers), and
//! answers on the fd it read from (the kernel matches a reply against that fd's requests).
//!
//! A worker that took a request looks for a second one before it handles the first: it reads a
//! second clone of its own, opened non-blocking. If there is one, it handles both and whatever
//! else is queued (up to [`MAX_BURST`]) with the thread plugged ([`crate::plug`]), then unplugs
//! the device and goes back to its blocking read: a burst the loop device queued is taken by
//! one thread and carried to the replicas in one send. A lone request is handled unplugged, so
//! at queue depth 1 nothing waits (its send to a replica is not put behind its local write). The
//! second clone, not `O_NONBLOCK` toggled on one fd or a `poll`: a blocking read wakes one
//! waiting worker per request, a poll would wake them all, and a read that blocks after a poll
//! said "ready" (another worker took the request) would sleep on what the plug held back.
//!
//! [`Server::suspend`] sets a flag and interrupts the workers' blocking reads with a signal
//! (SIGUSR2, whose handler does nothing and is installed without `SA_RESTART`, so `read`
//! returns `EINTR`); each worker answers the request it holds and stops. Then it waits until
//! every request handed to the device was answered. Requests the kernel queues meanwhile wait
//! in the kernel (an I/O pause, not an error) for whoever reads the session fd next: this
//! process after [`Server::resume`], or a new one.

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::FallocateFlags;
use nix::sys::pthread::{Pthread, pthread_kill, pthread_self};
use nix::sys::signal::Signal;

use super::abi::{self, Attr, op};
use crate::BlockDevice;
use crate::plug::Plug;

/// The name of the one file and its inode.
pub const VOLUME_FILE: &str = "volume";
pub const VOLUME_INO: u64 = 2;
const ROOT_INO: u64 = 1;
/// The largest write the kernel may send in one request.
pub const MAX_WRITE: u32 = 1 << 20;
/// Room for the largest request: a write's data plus its headers.
const BUFFER: usize = MAX_WRITE as usize + 4096;
/// Attributes change only on a resize, which invalidates them explicitly.
const TTL_SECS: u64 = 3600;
/// The signal that interrupts a worker's read.
const WAKE: Signal = Signal::SIGUSR2;
/// How long a suspend waits for the device to answer what it was handed.
const DRAIN: Duration = Duration::from_secs(60);
/// Most requests one worker takes under one plug: bounds what a device holds back, and so the
/// latency the first request of a burst can gain.
const MAX_BURST: usize = 32;

/// Requests handed to the device and not answered yet.
#[derive(Default)]
struct Inflight {
    count: Mutex<usize>,
    zero: Condvar,
}

impl Inflight {
    fn begin(&self) {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
    }

    fn end(&self) {
        let mut n = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.zero.notify_all();
        }
    }

    /// Waits until nothing is in flight; false if `wait` passed first.
    fn wait_zero(&self, wait: Duration) -> bool {
        let n = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        let (n, _) = self.zero.wait_timeout_while(n, wait, |n| *n > 0).unwrap_or_else(PoisonError::into_inner);
        *n == 0
    }
}

/// One reply owed to the kernel: sent once, on the fd the request came from. Dropped unsent (a
/// device that lost a completion), it answers EIO, so no request is left waiting forever.
struct Reply {
    fd: Arc<OwnedFd>,
    unique: u64,
    inflight: Arc<Inflight>,
    sent: bool,
}

impl Reply {
    fn new(fd: &Arc<OwnedFd>, unique: u64, inflight: &Arc<Inflight>) -> Self {
        inflight.begin();
        Self { fd: fd.clone(), unique, inflight: inflight.clone(), sent: false }
    }

    fn send(mut self, error: i32, body: &[u8]) {
        self.write(error, body);
    }

    fn ok(self, body: &[u8]) {
        self.send(0, body);
    }

    fn error(self, errno: Errno) {
        self.send(-(errno as i32), &[]);
    }

    fn io_error(self, e: &io::Error) {
        self.error(e.raw_os_error().map_or(Errno::EIO, Errno::from_raw));
    }

    fn write(&mut self, error: i32, body: &[u8]) {
        self.sent = true;
        let header = abi::out_header(abi::OUT_HEADER_LEN + body.len(), error, self.unique);
        if let Err(e) = nix::sys::uio::writev(&*self.fd, &[IoSlice::new(&header), IoSlice::new(body)]) {
            // ENOENT: the kernel gave up on the request (interrupted, or the connection ended).
            tracing::debug!(unique = self.unique, error = %e, "FUSE reply not delivered");
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.sent {
            self.write(-(Errno::EIO as i32), &[]);
        }
        self.inflight.end();
    }
}

/// Sends an inode-invalidation notification on `fd`.
pub fn notify_inval_inode(fd: &OwnedFd, ino: u64) -> io::Result<()> {
    let body = abi::encode_inval_inode(ino);
    let header = abi::out_header(abi::OUT_HEADER_LEN + body.len(), abi::NOTIFY_INVAL_INODE, 0);
    nix::sys::uio::writev(fd, &[IoSlice::new(&header), IoSlice::new(&body)])?;
    Ok(())
}

/// Reads the INIT request from a fresh connection and answers it.
pub fn handshake(fd: &OwnedFd) -> io::Result<()> {
    let mut buf = vec![0u8; BUFFER];
    let n = loop {
        match nix::unistd::read(fd, &mut buf) {
            Ok(n) => break n,
            Err(Errno::EINTR | Errno::EAGAIN | Errno::ENOENT) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("FUSE handshake: {what}"));
    let (header, args) = abi::parse(&buf[..n]).ok_or_else(|| invalid("a truncated request"))?;
    if header.opcode != op::INIT {
        return Err(invalid(&format!("opcode {} before INIT", header.opcode)));
    }
    let init = abi::InitIn::parse(args).ok_or_else(|| invalid("a truncated INIT"))?;
    if init.major != abi::KERNEL_VERSION || init.minor < 23 {
        return Err(invalid(&format!(
            "kernel protocol {}.{}, this server needs 7.23 or later",
            init.major, init.minor
        )));
    }
    let wanted = abi::init::ASYNC_READ | abi::init::BIG_WRITES | abi::init::ASYNC_DIO | abi::init::MAX_PAGES;
    let out = abi::InitOut {
        minor: init.minor.min(abi::KERNEL_MINOR),
        max_readahead: init.max_readahead,
        flags: init.flags & wanted,
        // Lets the kernel keep many direct-I/O requests of the file in flight (the loop device
        // submits asynchronously): they are background requests, capped by max_background.
        max_background: 256,
        congestion_threshold: 192,
        max_write: MAX_WRITE,
        max_pages: u16::try_from(MAX_WRITE / 4096).unwrap_or(u16::MAX),
    };
    let reply = out.encode();
    let header = abi::out_header(abi::OUT_HEADER_LEN + reply.len(), 0, header.unique);
    nix::sys::uio::writev(fd, &[IoSlice::new(&header), IoSlice::new(&reply)])?;
    Ok(())
}

/// A clone of `fd` reading the same connection (`FUSE_DEV_IOC_CLONE`).
fn clone_fd(fd: &OwnedFd) -> io::Result<OwnedFd> {
    nix::ioctl_read!(fuse_dev_ioc_clone, 229, 0, u32);
    let clone: OwnedFd = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse")?.into();
    let mut source = u32::try_from(fd.as_raw_fd()).map_err(|_| io::Error::other("negative fd"))?;
    #[allow(unsafe_code, reason = "FUSE_DEV_IOC_CLONE on two fds this function holds; nix has no safe wrapper")]
    // SAFETY: both fds are open for the whole call, the argument points to a live u32.
    unsafe {
        fuse_dev_ioc_clone(clone.as_raw_fd(), &mut source)?;
    }
    Ok(clone)
}

/// A clone of `fd` whose reads never block (see the module docs).
fn clone_nonblocking(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let clone = clone_fd(fd)?;
    nix::fcntl::fcntl(&clone, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))?;
    Ok(clone)
}

/// What one worker reads: a blocking fd it sleeps on and a non-blocking clone it drains a burst
/// from (see the module docs). Each answers the requests read from it.
struct WorkerFds {
    blocking: Arc<OwnedFd>,
    nonblocking: Arc<OwnedFd>,
}

extern "C" fn interrupted(_: nix::libc::c_int) {}

/// Installs the do-nothing handler of [`WAKE`], without `SA_RESTART`, once per process.
fn install_wake_handler() -> io::Result<()> {
    static INSTALLED: OnceLock<Result<(), Errno>> = OnceLock::new();
    let result = INSTALLED.get_or_init(|| {
        let action = nix::sys::signal::SigAction::new(
            nix::sys::signal::SigHandler::Handler(interrupted),
            nix::sys::signal::SaFlags::empty(),
            nix::sys::signal::SigSet::empty(),
        );
        #[allow(unsafe_code, reason = "installing a signal handler; the handler does nothing at all")]
        // SAFETY: the handler is async-signal-safe (it has no body).
        unsafe { nix::sys::signal::sigaction(WAKE, &action) }.map(drop)
    });
    (*result).map_err(io::Error::from)
}

struct Worker {
    handle: JoinHandle<io::Result<()>>,
    thread: Pthread,
}

/// Serves one FUSE connection (see the module docs).
pub struct Server {
    name: String,
    session: Arc<OwnedFd>,
    /// Per worker: the session fd or a clone of it, and a non-blocking clone.
    fds: Vec<WorkerFds>,
    /// Given up when the connection ended ([`Self::join`]): the device is its owner's again.
    dev: Mutex<Option<Arc<dyn BlockDevice>>>,
    stop: Arc<AtomicBool>,
    inflight: Arc<Inflight>,
    workers: Mutex<Vec<Worker>>,
}

impl Server {
    /// Serves the connection of `session` (its INIT already answered, by this process or
    /// another) with `threads` workers.
    pub fn start(session: OwnedFd, dev: Arc<dyn BlockDevice>, threads: usize, name: &str) -> io::Result<Self> {
        install_wake_handler()?;
        let session = Arc::new(session);
        let mut fds = Vec::new();
        for i in 0..threads.max(1) {
            let blocking = if i == 0 { session.clone() } else { Arc::new(clone_fd(&session)?) };
            fds.push(WorkerFds { blocking, nonblocking: Arc::new(clone_nonblocking(&session)?) });
        }
        let server = Self {
            name: name.to_owned(),
            session,
            fds,
            dev: Mutex::new(Some(dev)),
            stop: Arc::new(AtomicBool::new(false)),
            inflight: Arc::default(),
            workers: Mutex::new(Vec::new()),
        };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&self) -> io::Result<()> {
        let dev = self.dev.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let dev = dev.ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "the FUSE connection ended"))?;
        self.stop.store(false, Ordering::SeqCst);
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, fd) in self.fds.iter().enumerate() {
            let worker = WorkerLoop {
                fd: fd.blocking.clone(),
                burst: fd.nonblocking.clone(),
                dev: dev.clone(),
                stop: self.stop.clone(),
                inflight: self.inflight.clone(),
            };
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            // What a worker logs (and the device it calls, on this thread) names the volume.
            let span = tracing::info_span!("frontend.fuse", volume.id = %self.name, worker = i);
            let handle = std::thread::Builder::new().name(format!("fuse-{}-{i}", self.name)).spawn(move || {
                let _span = span.entered();
                let _ = tx.send(pthread_self());
                worker.run()
            })?;
            let thread = rx.recv().map_err(|_| io::Error::other("a FUSE worker died at its start"))?;
            workers.push(Worker { handle, thread });
        }
        Ok(())
    }

    /// The connection's fd: what another process needs to serve it.
    pub fn session(&self) -> &OwnedFd {
        &self.session
    }

    /// Stops reading at a request boundary and waits until every request read was answered
    /// (see the module docs). Returns how long it took.
    pub fn suspend(&self) -> io::Result<Duration> {
        let start = Instant::now();
        self.stop.store(true, Ordering::SeqCst);
        let mut workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(PoisonError::into_inner));
        // A signal that lands between a worker's check of the flag and its read is lost: keep
        // signalling until each worker returned.
        while workers.iter().any(|w| !w.handle.is_finished()) {
            for w in workers.iter().filter(|w| !w.handle.is_finished()) {
                // The thread is not joined yet, so its id is still valid.
                let _ = pthread_kill(w.thread, WAKE);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let mut first = Ok(());
        for w in workers.drain(..) {
            match w.handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => first = first.and(Err(e)),
                Err(_) => first = first.and(Err(io::Error::other("a FUSE worker panicked"))),
            }
        }
        first?;
        if !self.inflight.wait_zero(DRAIN) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the device did not answer what it was handed"));
        }
        Ok(start.elapsed())
    }

    /// Reads again after [`Self::suspend`].
    pub fn resume(&self) -> io::Result<()> {
        if !self.workers.lock().unwrap_or_else(PoisonError::into_inner).is_empty() {
            return Ok(());
        }
        self.spawn()
    }

    /// Waits for the workers to end on their own (after the unmount ended the connection), and
    /// lets go of the device.
    pub fn join(&self) -> io::Result<()> {
        self.dev.lock().unwrap_or_else(PoisonError::into_inner).take();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(PoisonError::into_inner));
        let mut first = Ok(());
        for w in workers {
            match w.handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => first = first.and(Err(e)),
                Err(_) => first = first.and(Err(io::Error::other("a FUSE worker panicked"))),
            }
        }
        first
    }
}

struct WorkerLoop {
    fd: Arc<OwnedFd>,
    /// The non-blocking clone a burst is drained from.
    burst: Arc<OwnedFd>,
    dev: Arc<dyn BlockDevice>,
    stop: Arc<AtomicBool>,
    inflight: Arc<Inflight>,
}

impl WorkerLoop {
    fn run(self) -> io::Result<()> {
        let mut buf = vec![0u8; BUFFER];
        let mut next = vec![0u8; BUFFER];
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Ok(());
            }
            let n = match nix::unistd::read(self.fd.as_fd(), &mut buf) {
                Ok(n) => n,
                // EINTR: woken to look at the flag; ENOENT: a request the kernel withdrew.
                Err(Errno::EINTR | Errno::EAGAIN | Errno::ENOENT) => continue,
                // The connection ended: unmounted or aborted (a detach aborts it to end copies
                // of the mount in other namespaces). An abort reads as ENODEV or, depending on
                // the kernel and the moment, ECONNABORTED: either is the end, not a failure.
                Err(Errno::ENODEV | Errno::ECONNABORTED) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let second = match self.read_queued(&mut next) {
                Ok(Some(m)) => m,
                // A lone request (or the look for another failed): handled unplugged.
                other => {
                    self.take(&self.fd, &buf[..n]);
                    other?;
                    continue;
                }
            };
            let plug = Plug::new();
            self.take(&self.fd, &buf[..n]);
            self.take(&self.burst, &next[..second]);
            let ended = self.burst(&mut buf);
            drop(plug);
            // Before this thread sleeps (or stops): nothing it submitted may stay held back.
            self.dev.unplug();
            ended?;
        }
    }

    /// Takes what else is queued, up to [`MAX_BURST`] requests in all.
    fn burst(&self, buf: &mut [u8]) -> io::Result<()> {
        for _ in 2..MAX_BURST {
            match self.read_queued(buf)? {
                Some(n) => self.take(&self.burst, &buf[..n]),
                None => return Ok(()),
            }
        }
        Ok(())
    }

    /// Reads a request that is already queued from the non-blocking clone; `None` if there is
    /// none (or the worker is to stop, or the connection ended: the blocking read says so next).
    fn read_queued(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Ok(None);
            }
            return match nix::unistd::read(self.burst.as_fd(), buf) {
                Ok(n) => Ok(Some(n)),
                Err(Errno::EAGAIN | Errno::EINTR | Errno::ENODEV | Errno::ECONNABORTED) => Ok(None),
                // A request the kernel withdrew: look again.
                Err(Errno::ENOENT) => continue,
                Err(e) => Err(e.into()),
            };
        }
    }

    /// Handles one request read from `fd`, which its reply goes to.
    fn take(&self, fd: &Arc<OwnedFd>, request: &[u8]) {
        match abi::parse(request) {
            Some((header, args)) => self.handle(fd, header, args),
            None => tracing::warn!(len = request.len(), "malformed FUSE request ignored"),
        }
    }

    fn attr(&self, ino: u64) -> Option<Attr> {
        match ino {
            ROOT_INO => Some(Attr { ino, size: 0, mode: abi::S_IFDIR | 0o700, nlink: 2 }),
            VOLUME_INO => Some(Attr { ino, size: self.dev.size(), mode: abi::S_IFREG | 0o600, nlink: 1 }),
            _ => None,
        }
    }

    /// Clamps a request to the device: `None` if it starts at or beyond the end.
    fn clamp(&self, offset: u64, len: u64) -> Option<u64> {
        let size = self.dev.size();
        (offset < size).then(|| len.min(size - offset))
    }

    fn handle(&self, fd: &Arc<OwnedFd>, header: abi::InHeader, args: &[u8]) {
        // Requests that get no reply.
        if matches!(header.opcode, op::FORGET | op::BATCH_FORGET | op::INTERRUPT) {
            return;
        }
        let reply = Reply::new(fd, header.unique, &self.inflight);
        let ino = header.nodeid;
        match header.opcode {
            op::LOOKUP => {
                let name = args.split(|b| *b == 0).next().unwrap_or_default();
                match self.attr(VOLUME_INO) {
                    Some(a) if ino == ROOT_INO && name == VOLUME_FILE.as_bytes() => {
                        reply.ok(&a.encode_entry_out(TTL_SECS))
                    }
                    _ => reply.error(Errno::ENOENT),
                }
            }
            op::GETATTR => match self.attr(ino) {
                Some(a) => reply.ok(&a.encode_attr_out(TTL_SECS)),
                None => reply.error(Errno::ENOENT),
            },
            op::SETATTR => {
                // The size is the device's; a truncate to anything else is refused. Other
                // attribute changes are accepted and ignored: nothing depends on them.
                let Some(set) = abi::SetattrIn::parse(args) else { return reply.error(Errno::EINVAL) };
                match self.attr(ino) {
                    Some(a) if set.valid & abi::FATTR_SIZE == 0 || set.size == a.size => {
                        reply.ok(&a.encode_attr_out(TTL_SECS))
                    }
                    Some(_) => reply.error(Errno::EPERM),
                    None => reply.error(Errno::ENOENT),
                }
            }
            op::OPEN if ino == VOLUME_INO => {
                // DIRECT_IO: no page cache in the FUSE layer (flushes must reach the device).
                // PARALLEL_DIRECT_WRITES: without it direct writes to one file serialise on
                // the inode lock, i.e. queue depth 1.
                reply.ok(&abi::encode_open_out(abi::FOPEN_DIRECT_IO | abi::FOPEN_PARALLEL_DIRECT_WRITES))
            }
            op::OPEN => reply.error(Errno::EISDIR),
            op::OPENDIR if ino == ROOT_INO => reply.ok(&abi::encode_open_out(0)),
            op::OPENDIR => reply.error(Errno::ENOTDIR),
            op::READ => self.read(reply, ino, args),
            op::WRITE => self.write(reply, ino, args),
            // FLUSH comes with every close(2); it is not a durability point (FSYNC is).
            op::RELEASE | op::RELEASEDIR | op::FLUSH | op::ACCESS | op::FSYNCDIR | op::DESTROY => reply.ok(&[]),
            // The loop device turns REQ_PREFLUSH/FUA into fdatasync of the file.
            op::FSYNC => match self.dev.flush() {
                Ok(()) => reply.ok(&[]),
                Err(e) => reply.io_error(&e),
            },
            op::STATFS => {
                // The loop device derives its discard granularity from the block size.
                reply.ok(&abi::encode_statfs_out(self.dev.size() / 4096, 4096))
            }
            op::READDIR => self.readdir(reply, ino, args),
            op::FALLOCATE => self.fallocate(reply, ino, args),
            _ => reply.error(Errno::ENOSYS),
        }
    }

    fn read(&self, reply: Reply, ino: u64, args: &[u8]) {
        if ino != VOLUME_INO {
            return reply.error(Errno::EISDIR);
        }
        let Some(io) = abi::IoIn::parse(args) else { return reply.error(Errno::EINVAL) };
        let Some(len) = self.clamp(io.offset, u64::from(io.size)) else { return reply.ok(&[]) };
        // len <= size, which the kernel bounds by max_read (far below usize::MAX).
        self.dev.submit_read(
            io.offset,
            len as usize,
            Box::new(move |result| match result {
                Ok(data) => reply.ok(data),
                Err(e) => reply.io_error(&e),
            }),
        );
    }

    fn write(&self, reply: Reply, ino: u64, args: &[u8]) {
        if ino != VOLUME_INO {
            return reply.error(Errno::EISDIR);
        }
        let Some(io) = abi::IoIn::parse(args) else { return reply.error(Errno::EINVAL) };
        let Some(data) = args.get(abi::WRITE_IN_LEN..abi::WRITE_IN_LEN + io.size as usize) else {
            return reply.error(Errno::EINVAL);
        };
        // A block device does not grow: writing at or past the end is "no space".
        let Some(len) = self.clamp(io.offset, data.len() as u64) else { return reply.error(Errno::ENOSPC) };
        let data = &data[..len as usize];
        self.dev.submit_write(
            data,
            io.offset,
            Box::new(move |result| match result {
                // len <= data.len() <= max_write, which fits u32.
                Ok(()) => reply.ok(&abi::encode_write_out(len as u32)),
                Err(e) => reply.io_error(&e),
            }),
        );
    }

    fn readdir(&self, reply: Reply, ino: u64, args: &[u8]) {
        if ino != ROOT_INO {
            return reply.error(Errno::ENOTDIR);
        }
        let Some(io) = abi::IoIn::parse(args) else { return reply.error(Errno::EINVAL) };
        const DT_DIR: u32 = 4;
        const DT_REG: u32 = 8;
        let entries = [(ROOT_INO, DT_DIR, "."), (ROOT_INO, DT_DIR, ".."), (VOLUME_INO, DT_REG, VOLUME_FILE)];
        let mut out = Vec::new();
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(usize::try_from(io.offset).unwrap_or(usize::MAX))
        {
            let mut entry = Vec::new();
            // The offset given is that of the next entry.
            abi::put_dirent(&mut entry, *ino, i as u64 + 1, *kind, name);
            if out.len() + entry.len() > io.size as usize {
                break;
            }
            out.extend_from_slice(&entry);
        }
        reply.ok(&out);
    }

    fn fallocate(&self, reply: Reply, ino: u64, args: &[u8]) {
        if ino != VOLUME_INO {
            return reply.error(Errno::EISDIR);
        }
        let Some(f) = abi::FallocateIn::parse(args) else { return reply.error(Errno::EINVAL) };
        let mode = FallocateFlags::from_bits_retain(f.mode as i32);
        let keep = FallocateFlags::FALLOC_FL_KEEP_SIZE;
        let Some(len) = self.clamp(f.offset, f.length) else { return reply.error(Errno::EINVAL) };
        let result = if mode == keep || mode.is_empty() {
            // Plain preallocation: every byte of the device already exists.
            Ok(())
        } else if mode == FallocateFlags::FALLOC_FL_PUNCH_HOLE | keep
            || mode == FallocateFlags::FALLOC_FL_ZERO_RANGE | keep
            || mode == FallocateFlags::FALLOC_FL_ZERO_RANGE
        {
            // The loop device's discard and write-zeroes, both served by discard, which the
            // BlockDevice contract defines to read back as zeros.
            self.dev.discard(f.offset, len)
        } else {
            return reply.error(Errno::EOPNOTSUPP);
        };
        match result {
            Ok(()) => reply.ok(&[]),
            Err(e) => reply.io_error(&e),
        }
    }
}
