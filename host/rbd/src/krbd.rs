//! Kernel RBD: map an image as `/dev/rbdN` through sysfs (`/sys/bus/rbd/add_single_major`), the
//! node-side attach on kernels with the `rbd` module (production kernels; the kernel-VM test
//! tier here). No `rbd` CLI: the kernel takes the monitors, the cephx name and key, pool and
//! image in one write, and the key never appears in argv, the environment or a file.
//!
//! Mapping is idempotent: an image already mapped on this node (a retry, a plugin restart
//! between the map and recording it) is found in `/sys/bus/rbd/devices` and reused. Unmapping
//! waits for the device to be let go, then forces it (pending I/O fails instead of hanging on a
//! cluster that no longer answers); an image no longer mapped is success.
use crate::RbdCredentials;
use crate::names::check;
use nix::errno::Errno;
use std::io::{self, Write};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BUS: &str = "/sys/bus/rbd";

#[derive(Debug, thiserror::Error)]
pub enum KrbdError {
    #[error("{0}")]
    InvalidArgument(String),
    /// The kernel could not reach the cluster in time, or it refused the credentials.
    #[error("mapping {what}: {detail}")]
    Unavailable { what: String, detail: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// What to map.
#[derive(Clone, Debug)]
pub struct KrbdRequest {
    /// As in the host config: `10.0.0.1`, `10.0.0.1:6789`, `[v2:10.0.0.1:3300,v1:10.0.0.1:6789]`.
    pub monitors: Vec<String>,
    pub pool: String,
    pub image: String,
    pub creds: RbdCredentials,
    pub read_only: bool,
    /// The kernel's `mount_timeout`: how long the map may wait for the monitors.
    pub timeout: Duration,
}

/// A mapped image, as recorded by the caller (state file) for the unmap.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KrbdRecord {
    pub id: u32,
    pub device: PathBuf,
    pub pool: String,
    pub image: String,
}

/// Whether this kernel maps RBD images (the `rbd` module is loaded or loads).
pub fn available() -> bool {
    if Path::new(BUS).join("add").exists() {
        return true;
    }
    // Built as a module and not loaded yet: one bounded attempt.
    let loaded = std::process::Command::new("modprobe")
        .arg("rbd")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    loaded && Path::new(BUS).join("add").exists()
}

/// The kernel's monitor list: IP:port of each monitor's v1 (legacy msgr) address, which every
/// kernel speaks; v2-only entries are left out; host names are resolved here, because the
/// kernel parses addresses only.
pub fn kernel_monitors(monitors: &[String]) -> Result<String, KrbdError> {
    let mut out: Vec<String> = Vec::new();
    for entry in monitors {
        let entry = entry.trim();
        let vector = entry.strip_prefix('[').and_then(|e| e.strip_suffix(']'));
        let addrs: Vec<&str> = match vector {
            Some(inner) => inner.split(',').filter_map(|a| a.trim().strip_prefix("v1:")).collect(),
            None if entry.starts_with("v2:") => vec![],
            None => vec![entry.strip_prefix("v1:").unwrap_or(entry)],
        };
        for a in addrs {
            let with_port = if a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) {
                a.to_owned()
            } else {
                format!("{a}:6789")
            };
            let resolved = with_port
                .to_socket_addrs()
                .map_err(|e| KrbdError::InvalidArgument(format!("monitor {a:?}: {e}")))?
                .next()
                .ok_or_else(|| KrbdError::InvalidArgument(format!("monitor {a:?} resolves to nothing")))?;
            out.push(resolved.to_string());
        }
    }
    if out.is_empty() {
        return Err(KrbdError::InvalidArgument(format!(
            "no v1 monitor address among {monitors:?}: the kernel client needs one (port 6789)"
        )));
    }
    Ok(out.join(","))
}

/// A field of the sysfs string: no separators (space, comma; '=' where the field is an option's
/// name or a positional field) and no control characters. A key's base64 padding is its '='.
fn plain(kind: &str, value: &str) -> Result<(), KrbdError> {
    let eq_allowed = kind.contains("key");
    if value.is_empty()
        || value.chars().any(|c| c.is_whitespace() || c.is_control() || c == ',' || (c == '=' && !eq_allowed))
    {
        return Err(KrbdError::InvalidArgument(format!("{kind} cannot be passed to the kernel rbd client")));
    }
    Ok(())
}

fn errno_of(e: &io::Error) -> Errno {
    e.raw_os_error().map_or(Errno::UnknownErrno, Errno::from_raw)
}

fn read_attr(dir: &Path, name: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(name)).ok().map(|s| s.trim().to_owned())
}

/// The head (not a snapshot) of `pool/image` as mapped on this node, if it is.
pub fn find(pool: &str, image: &str) -> Option<KrbdRecord> {
    let mut found: Vec<u32> = std::fs::read_dir(Path::new(BUS).join("devices"))
        .ok()?
        .flatten()
        .filter_map(|e| {
            let dir = e.path();
            let id: u32 = e.file_name().to_str()?.parse().ok()?;
            let same = read_attr(&dir, "pool")? == pool
                && read_attr(&dir, "name")? == image
                && read_attr(&dir, "current_snap")? == "-";
            same.then_some(id)
        })
        .collect();
    found.sort_unstable();
    let id = *found.first()?;
    Some(KrbdRecord { id, device: PathBuf::from(format!("/dev/rbd{id}")), pool: pool.into(), image: image.into() })
}

/// Whether `record` is still mapped (the same id still shows that image).
pub fn is_mapped(record: &KrbdRecord) -> bool {
    let dir = Path::new(BUS).join("devices").join(record.id.to_string());
    read_attr(&dir, "pool").as_deref() == Some(record.pool.as_str())
        && read_attr(&dir, "name").as_deref() == Some(record.image.as_str())
}

/// The mapped device's size in bytes.
pub fn size_bytes(record: &KrbdRecord) -> Option<u64> {
    let dir = Path::new(BUS).join("devices").join(record.id.to_string());
    read_attr(&dir, "size")?.parse().ok()
}

fn bus_file(single_major: &str, legacy: &str) -> PathBuf {
    let s = Path::new(BUS).join(single_major);
    if s.exists() { s } else { Path::new(BUS).join(legacy) }
}

/// Map `req.pool/req.image` (or find it mapped already) and wait for its device node.
#[tracing::instrument(name = "rbd.krbd_map", skip_all, fields(pool = %req.pool, image = %req.image))]
pub fn map(req: &KrbdRequest) -> Result<KrbdRecord, KrbdError> {
    let invalid = |e: crate::RbdError| KrbdError::InvalidArgument(e.to_string());
    check("pool", &req.pool).map_err(invalid)?;
    check("image", &req.image).map_err(invalid)?;
    plain("the pool name", &req.pool)?;
    plain("the image name", &req.image)?;
    plain("the cephx user", &req.creds.user)?;
    plain("the cephx key", req.creds.key())?;
    let record = match find(&req.pool, &req.image) {
        Some(r) => {
            tracing::debug!(id = r.id, "already mapped");
            r
        }
        None => {
            let monitors = kernel_monitors(&req.monitors)?;
            let mut options = format!(
                "name={},secret={},mount_timeout={}",
                req.creds.user,
                req.creds.key(),
                req.timeout.as_secs().max(1)
            );
            if req.read_only {
                options.push_str(",read_only");
            }
            let line = format!("{monitors} {options} {} {} -", req.pool, req.image);
            let what = format!("{}/{}", req.pool, req.image);
            let t = Instant::now();
            let written = std::fs::OpenOptions::new()
                .write(true)
                .open(bus_file("add_single_major", "add"))
                .and_then(|mut f| f.write_all(line.as_bytes()));
            drop(line);
            if let Err(e) = written {
                // Errors name the image and the errno's meaning, never the options (the key).
                let errno = errno_of(&e);
                let detail = match errno {
                    Errno::ENOENT => "the pool or image does not exist".to_owned(),
                    Errno::ETIMEDOUT => format!("no monitor answered within {:?}", req.timeout),
                    Errno::EACCES | Errno::EPERM => "the cluster refused the credentials".to_owned(),
                    Errno::EINVAL => "the kernel refused the map request (options or image features)".to_owned(),
                    _ => e.to_string(),
                };
                return Err(match errno {
                    Errno::EINVAL | Errno::ENOENT => KrbdError::InvalidArgument(format!("mapping {what}: {detail}")),
                    _ => KrbdError::Unavailable { what, detail },
                });
            }
            let r = find(&req.pool, &req.image).ok_or_else(|| KrbdError::Unavailable {
                what: what.clone(),
                detail: "the kernel accepted the map but shows no device for it".into(),
            })?;
            tracing::debug!(id = r.id, took = ?t.elapsed(), "mapped");
            r
        }
    };
    // devtmpfs creates the node as the disk appears; give it a moment on a slow machine.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !record.device.exists() {
        if Instant::now() > deadline {
            return Err(KrbdError::Io {
                what: format!("waiting for {}", record.device.display()),
                source: io::Error::from(io::ErrorKind::NotFound),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(record)
}

/// Unmap `record`: retried while the device is busy for up to `patience`, then forced (pending
/// I/O fails). Success when it is no longer mapped.
#[tracing::instrument(name = "rbd.krbd_unmap", skip_all, fields(id = record.id, pool = %record.pool, image = %record.image))]
pub fn unmap(record: &KrbdRecord, patience: Duration) -> Result<(), KrbdError> {
    let deadline = Instant::now() + patience;
    let remove = bus_file("remove_single_major", "remove");
    loop {
        if !is_mapped(record) {
            return Ok(());
        }
        let force = Instant::now() >= deadline;
        let line = if force { format!("{} force", record.id) } else { record.id.to_string() };
        let r = std::fs::OpenOptions::new().write(true).open(&remove).and_then(|mut f| f.write_all(line.as_bytes()));
        match r {
            Ok(()) => return Ok(()),
            Err(e) if errno_of(&e) == Errno::ENOENT => return Ok(()),
            Err(e) if errno_of(&e) == Errno::EBUSY && !force => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(KrbdError::Io {
                    what: format!("unmapping {} ({})", record.device.display(), line),
                    source: e,
                });
            }
        }
        if force {
            tracing::warn!("forced the unmap of a busy device");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn kernel_monitors_take_v1_addresses_and_default_the_port() {
        let m = |v: &[&str]| kernel_monitors(&v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        assert_eq!(m(&["[v2:10.0.0.1:3300,v1:10.0.0.1:6789]"]).unwrap(), "10.0.0.1:6789");
        assert_eq!(
            m(&["10.0.0.1", "10.0.0.2:6790", "v1:10.0.0.3:6789"]).unwrap(),
            "10.0.0.1:6789,10.0.0.2:6790,10.0.0.3:6789"
        );
        assert_eq!(m(&["localhost:6789"]).unwrap(), "127.0.0.1:6789");
        assert!(matches!(m(&["v2:10.0.0.1:3300"]), Err(KrbdError::InvalidArgument(_))));
        assert!(matches!(m(&[]), Err(KrbdError::InvalidArgument(_))));
    }

    #[test]
    fn separators_never_reach_the_kernel_string() {
        for bad in ["a b", "a,b", "a=b", "a\nb", ""] {
            assert!(plain("x", bad).is_err(), "{bad:?}");
        }
        assert!(plain("x", "a=b").is_err(), "'=' separates an option's value");
        assert!(plain("the cephx key", "AQBx+/9==").is_ok(), "base64 padding");
        assert!(plain("the cephx key", "AQ,x").is_err());
        let req = KrbdRequest {
            monitors: vec!["10.0.0.1".into()],
            pool: "rbd".into(),
            image: "has space".into(),
            creds: RbdCredentials::new("u", "k"),
            read_only: false,
            timeout: Duration::from_secs(1),
        };
        let e = map(&req).unwrap_err();
        assert!(matches!(e, KrbdError::InvalidArgument(_)), "{e:?}");
    }
}
