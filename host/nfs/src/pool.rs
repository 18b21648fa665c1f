//! Connections to one export: establishing them (bounded by `connect_timeout`), keeping idle
//! ones for reuse, and running one call on one of them (bounded by `op_timeout`).
//!
//! `nfs3_client`'s RPC client runs one call at a time per connection, so concurrency comes from
//! several connections; a semaphore caps them at `max_connections` per export. A connection
//! whose call failed at the transport level or timed out is dropped, never reused: its stream may
//! hold half a reply. After the first successful mount the pool remembers the NFS port and the
//! root handle, so further connections skip portmapper and MOUNT; when that shortcut fails (the
//! server restarted on other ports) it mounts again from scratch.
use crate::error::{from_mount_status, from_status};
use crate::{NfsConfig, NfsError, NfsExport};
use nfs3_client::nfs3_types::nfs3::{self, nfs_fh3, nfsstat3};
use nfs3_client::nfs3_types::rpc::{auth_unix, opaque_auth};
use nfs3_client::nfs3_types::xdr_codec::Opaque;
use nfs3_client::{ConnectError, MountError, Nfs3Client, Nfs3ConnectionBuilder, PortmapError, RpcError};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{Semaphore, SemaphorePermit};

/// A TCP stream for `nfs3_client`. Its `async_read_exact` loops until the buffer is full and
/// treats a 0-byte read as progress, so a server closing the connection would make it spin
/// forever: end of stream is an error here.
pub(crate) struct Io(TcpStream);

impl nfs3_client::io::AsyncRead for Io {
    async fn async_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.0.read(buf).await?;
        if n == 0 && !buf.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the server"));
        }
        Ok(n)
    }
}

impl nfs3_client::io::AsyncWrite for Io {
    async fn async_write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.0.write(buf).await?;
        if n == 0 && !buf.is_empty() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed by the server"));
        }
        Ok(n)
    }
}

pub(crate) type Client = Nfs3Client<Io>;

struct Connector;

fn unspecified(addr: &SocketAddr) -> IpAddr {
    if addr.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(Ipv6Addr::UNSPECIFIED) }
}

impl nfs3_client::net::Connector for Connector {
    type Connection = Io;

    async fn connect(&self, addr: SocketAddr) -> io::Result<Io> {
        let stream = TcpStream::connect(addr).await?;
        // Calls are small request/reply exchanges: Nagle would delay each by up to 40 ms.
        stream.set_nodelay(true)?;
        Ok(Io(stream))
    }

    async fn connect_with_port(&self, addr: SocketAddr, local_port: u16) -> io::Result<Io> {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.bind(SocketAddr::new(unspecified(&addr), local_port))?;
        let stream = socket.connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Io(stream))
    }
}

/// Reserved source ports we use: above the range daemons commonly bind (rpcbind, sshd...).
const RESERVED_LOW: u16 = 600;
const RESERVED_HIGH: u16 = 1023;

/// Connect from a free reserved port. A port in use (or in TIME_WAIT towards the same server)
/// fails bind/connect with AddrInUse/AddrNotAvailable: try the next one.
async fn connect_reserved(addr: SocketAddr) -> io::Result<Io> {
    use nfs3_client::net::Connector as _;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let span = RESERVED_HIGH - RESERVED_LOW + 1;
    let seed = (std::process::id() % u32::from(span)) as u16;
    for _ in 0..span {
        let port = RESERVED_LOW + (seed.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % span);
        match Connector.connect_with_port(addr, port).await {
            Err(e) if matches!(e.kind(), io::ErrorKind::AddrInUse | io::ErrorKind::AddrNotAvailable) => continue,
            other => return other,
        }
    }
    Err(io::Error::new(io::ErrorKind::AddrInUse, "no free reserved source port (600-1023)"))
}

/// AUTH_UNIX as root: the host sets owners and modes on behalf of the guest (exports must not
/// squash root, as for any provisioner that chowns volume directories).
fn credential() -> opaque_auth<'static> {
    opaque_auth::auth_unix(&auth_unix {
        stamp: std::process::id(),
        machinename: Opaque::borrowed(b"wasmcsi"),
        uid: 0,
        gid: 0,
        gids: vec![],
    })
}

/// What a successful mount told us; enough to open more connections without MOUNT.
#[derive(Clone, Debug)]
pub(crate) struct Mounted {
    addr: IpAddr,
    nfs_port: u16,
    pub root: nfs_fh3,
    /// FSINFO: largest READ/WRITE the server accepts.
    pub rtmax: u32,
    pub wtmax: u32,
}

pub(crate) struct Pool {
    pub export: NfsExport,
    pub label: String,
    cfg: Arc<NfsConfig>,
    permits: Semaphore,
    idle: Mutex<Vec<Client>>,
    mounted: tokio::sync::Mutex<Option<Mounted>>,
}

/// A connection checked out of the pool. Dropped without `release`, the connection is closed:
/// the safe default when a call failed, timed out or was cancelled mid-way.
pub(crate) struct Lease<'a> {
    pool: &'a Pool,
    client: Option<Client>,
    /// It came from the idle list: a transport error may just mean the server restarted since.
    pub reused: bool,
    _permit: SemaphorePermit<'a>,
}

impl Lease<'_> {
    pub fn client(&mut self) -> &mut Client {
        // Set in `Pool::lease`, taken only by `release`, which consumes the lease.
        self.client.as_mut().expect("lease holds a client until released")
    }

    pub fn release(mut self) {
        if let Some(c) = self.client.take() {
            self.pool.idle.lock().unwrap_or_else(PoisonError::into_inner).push(c);
        }
    }
}

/// Errors after which the stream may be broken (and a retry on a fresh connection may succeed).
pub(crate) fn is_transport(e: &RpcError) -> bool {
    !e.is_connection_reusable()
}

impl Pool {
    pub fn new(export: NfsExport, cfg: Arc<NfsConfig>) -> Self {
        let label = export.to_string();
        let permits = Semaphore::new(cfg.max_connections.max(1));
        Self { export, label, cfg, permits, idle: Mutex::new(Vec::new()), mounted: tokio::sync::Mutex::new(None) }
    }

    pub fn config(&self) -> &NfsConfig {
        &self.cfg
    }

    pub fn op_timeout(&self) -> Duration {
        self.cfg.op_timeout
    }

    pub fn unavailable(&self, reason: impl Into<String>) -> NfsError {
        NfsError::Unavailable { server: self.export.server.clone(), reason: reason.into() }
    }

    pub fn status(&self, stat: nfsstat3, what: &str) -> NfsError {
        from_status(stat, &format!("{what} on {}", self.label), &self.export.server)
    }

    pub fn timed_out(&self, procedure: &str, limit: Duration) -> NfsError {
        self.unavailable(format!("no reply to {procedure} on {} within {limit:?}", self.label))
    }

    pub fn rpc_failed(&self, procedure: &str, e: RpcError) -> NfsError {
        if is_transport(&e) {
            self.unavailable(format!("{procedure} on {}: {e}", self.label))
        } else {
            NfsError::Internal(format!("{procedure} on {}: rpc error: {e}", self.label))
        }
    }

    /// A connection: an idle one, or a new one within `connect_timeout`.
    pub async fn lease(&self) -> Result<Lease<'_>, NfsError> {
        // Never closed; the error arm only satisfies the type.
        let permit = self.permits.acquire().await.map_err(|e| NfsError::Internal(format!("pool closed: {e}")))?;
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let (client, reused) = match idle {
            Some(c) => (c, true),
            None => (self.connect().await?, false),
        };
        Ok(Lease { pool: self, client: Some(client), reused, _permit: permit })
    }

    /// The mount facts (root handle, transfer sizes), connecting once if needed.
    pub async fn mounted(&self) -> Result<Mounted, NfsError> {
        if let Some(m) = self.mounted.lock().await.clone() {
            return Ok(m);
        }
        let lease = self.lease().await?;
        lease.release();
        self.mounted.lock().await.clone().ok_or_else(|| NfsError::Internal(format!("{}: not mounted", self.label)))
    }

    /// Forget idle connections (after the caller saw the server fail, they are likely dead too).
    pub fn drop_idle(&self) {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }

    #[tracing::instrument(name = "nfs.connect", skip_all, fields(export = %self.label))]
    async fn connect(&self) -> Result<Client, NfsError> {
        let limit = self.cfg.connect_timeout;
        match tokio::time::timeout(limit, self.connect_unbounded()).await {
            Ok(r) => r,
            Err(_) => Err(self.unavailable(format!("no connection to {} within {limit:?}", self.label))),
        }
    }

    async fn connect_unbounded(&self) -> Result<Client, NfsError> {
        // One connect at a time per export: parallel first calls would each run portmapper and
        // MOUNT; serialized, all but the first take the shortcut.
        let mut mounted = self.mounted.lock().await;
        if let Some(m) = mounted.as_ref() {
            let addr = SocketAddr::new(m.addr, m.nfs_port);
            let stream = if self.cfg.reserved_port {
                connect_reserved(addr).await
            } else {
                nfs3_client::net::Connector::connect(&Connector, addr).await
            };
            match stream {
                Ok(io) => return Ok(Nfs3Client::new_with_auth(io, credential(), opaque_auth::default())),
                Err(e) => {
                    tracing::debug!(error = %e, "cached nfs port failed; mounting again");
                    *mounted = None;
                }
            }
        }
        let addr = self.resolve().await?;
        let conn = Nfs3ConnectionBuilder::new(Connector, addr.to_string(), &self.export.share)
            .portmapper_port(self.cfg.portmapper_port)
            .connect_from_privileged_port(self.cfg.reserved_port)
            .credential(credential())
            .mount()
            .await
            .map_err(|e| self.connect_failed(e))?;
        let root = conn.root_nfs_fh3();
        let nfs_port = conn.nfs3_port;
        let mut client = conn.into_nfs3_client();
        let info = client
            .fsinfo(&nfs3::FSINFO3args { fsroot: root.clone() })
            .await
            .map_err(|e| self.rpc_failed("FSINFO", e))?;
        let (rtmax, wtmax) = match info {
            nfs3::Nfs3Result::Ok(ok) => (ok.rtmax, ok.wtmax),
            nfs3::Nfs3Result::Err((stat, _)) => return Err(self.status(stat, "FSINFO")),
        };
        tracing::debug!(nfs_port, rtmax, wtmax, "mounted");
        *mounted = Some(Mounted { addr, nfs_port, root, rtmax: rtmax.max(4096), wtmax: wtmax.max(4096) });
        Ok(client)
    }

    async fn resolve(&self) -> Result<IpAddr, NfsError> {
        if let Ok(ip) = self.export.server.parse::<IpAddr>() {
            return Ok(ip);
        }
        let mut addrs = tokio::net::lookup_host((self.export.server.as_str(), 0))
            .await
            .map_err(|e| self.unavailable(format!("resolving {}: {e}", self.export.server)))?;
        addrs.next().map(|a| a.ip()).ok_or_else(|| self.unavailable(format!("{} has no address", self.export.server)))
    }

    fn connect_failed(&self, e: ConnectError) -> NfsError {
        match e {
            ConnectError::Mount(MountError::Denied(stat)) => from_mount_status(stat, &self.label),
            ConnectError::Portmap(PortmapError::ProgramUnavailable) => {
                self.unavailable(format!("{}: MOUNT or NFSv3 not registered with the portmapper", self.label))
            }
            other => self.unavailable(format!("connecting to {}: {other}", self.label)),
        }
    }
}

/// Run one call on a pooled connection, bounded by the op timeout (or `timeout = ...`).
/// `|c| expr` gets `&mut Client`; the expression is evaluated again for the one retry, made only
/// when a connection reused from the pool fails at the transport level (the server restarted
/// while it sat idle). Returns the NFS result (`Nfs3Result`) or returns early with `NfsError`.
macro_rules! rpc {
    ($pool:expr, $procedure:literal, |$c:ident| $call:expr) => {
        rpc!($pool, $procedure, timeout = $pool.op_timeout(), |$c| $call)
    };
    ($pool:expr, $procedure:literal, timeout = $limit:expr, |$c:ident| $call:expr) => {{
        let pool: &$crate::pool::Pool = $pool;
        let limit: ::std::time::Duration = $limit;
        let mut retried = false;
        loop {
            let mut lease = pool.lease().await?;
            let reused = lease.reused;
            let outcome = {
                let $c = lease.client();
                ::tokio::time::timeout(limit, $call).await
            };
            match outcome {
                Ok(Ok(reply)) => {
                    lease.release();
                    break reply;
                }
                Ok(Err(e)) if reused && !retried && $crate::pool::is_transport(&e) => {
                    drop(lease);
                    pool.drop_idle();
                    retried = true;
                    ::tracing::debug!(procedure = $procedure, error = %e, "pooled connection failed; retrying on a new one");
                }
                Ok(Err(e)) => {
                    drop(lease);
                    return Err(pool.rpc_failed($procedure, e));
                }
                Err(_) => {
                    drop(lease);
                    pool.drop_idle();
                    return Err(pool.timed_out($procedure, limit));
                }
            }
        }
    }};
}
