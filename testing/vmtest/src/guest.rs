//! Helpers for test bodies running *inside* the VM (as root, on the VM's kernel): a kernel NFS
//! server on the guest's loopback, an NBD device backed by a file, a minimal SELinux policy
//! (in a guest booted with `security=selinux`), and running a command with its failure turned
//! into an error that says what failed.
//!
//! The NFS userland (`rpc.nfsd`, `rpc.mountd`, `exportfs`, `mount.nfs`) is not installed on the
//! host: `scripts/vm/fetch` unpacks Debian's nfs-kernel-server and nfs-common into the guest
//! layer, so they are at their usual paths only inside the VM. `qemu-nbd` comes from the host's
//! qemu-utils. Nothing here works on the host kernel, which has neither nfsd nor NBD.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A step of a guest helper that failed.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("{command} failed ({status}): {stderr}")]
    Command { command: String, status: String, stderr: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{what}: not done after {}s", waited.as_secs())]
    Timeout { what: String, waited: Duration },
    #[error("no free /dev/nbdN (is the nbd module loaded?)")]
    NoFreeNbd,
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> GuestError {
    let what = what.into();
    move |source| GuestError::Io { what, source }
}

/// Runs `program args` to completion; its stdout on success, an error naming the command and
/// carrying its stderr otherwise.
pub fn sh(program: &str, args: &[&str]) -> Result<String, GuestError> {
    let command = std::iter::once(program).chain(args.iter().copied()).collect::<Vec<_>>().join(" ");
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(io_error(format!("cannot run {command}")))?;
    if !out.status.success() {
        return Err(GuestError::Command {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `done` every 50 ms until it is true or `limit` passed.
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Result<(), GuestError> {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > limit {
            return Err(GuestError::Timeout { what: what.to_owned(), waited: limit });
        }
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The kernel NFS server (nfsd) serving one directory as the NFSv4 pseudo-root, on the guest's
/// loopback only. NFSv4 only: no rpcbind, no statd. Mount it with
/// `mount -t nfs4 127.0.0.1:/ MOUNTPOINT` (subdirectories: `127.0.0.1:/SUB`).
///
/// Dropping it stops nfsd and mountd; mounts of it must be gone first (the test's job: a
/// hard-mounted NFS client of a stopped server hangs).
pub struct KernelNfsServer {
    export: PathBuf,
    mountd: Option<Child>,
}

impl KernelNfsServer {
    /// Exports `export` read-write to 127.0.0.1 (`no_root_squash`, `sync`) and starts nfsd with
    /// `threads` threads. The grace period (90 s by default, during which every OPEN is
    /// refused) is ended at once: a fresh server has no clients to reclaim state.
    pub fn start(export: &Path, threads: u32) -> Result<Self, GuestError> {
        fs::create_dir_all(export).map_err(io_error(format!("create {}", export.display())))?;
        if !Path::new("/proc/fs/nfsd/threads").exists() {
            sh("mount", &["-t", "nfsd", "nfsd", "/proc/fs/nfsd"])?;
        }
        // The legacy client tracker keeps its records here; without it nfsd logs errors.
        fs::create_dir_all("/var/lib/nfs/v4recovery").map_err(io_error("create /var/lib/nfs/v4recovery"))?;
        let line = format!("{} 127.0.0.1(rw,sync,no_subtree_check,no_root_squash,insecure,fsid=0)\n", export.display());
        fs::write("/etc/exports", line).map_err(io_error("write /etc/exports"))?;
        sh("exportfs", &["-ra"])?;
        // mountd answers the kernel's export-cache upcalls (NFSv4 needs it too); kept in the
        // foreground so this handle owns it.
        let mountd = Command::new("rpc.mountd")
            .args(["--foreground", "--no-nfs-version", "2", "--no-nfs-version", "3", "--no-udp"])
            .stdin(Stdio::null())
            .spawn()
            .map_err(io_error("cannot start rpc.mountd"))?;
        let mut server = Self { export: export.to_owned(), mountd: Some(mountd) };
        // Shortest lease and grace the kernel accepts (10 s), then end grace outright.
        for knob in ["nfsv4leasetime", "nfsv4gracetime"] {
            let path = format!("/proc/fs/nfsd/{knob}");
            fs::write(&path, "10").map_err(io_error(format!("write {path}")))?;
        }
        sh("rpc.nfsd", &["--no-nfs-version", "3", "--no-udp", &threads.to_string()])?;
        fs::write("/proc/fs/nfsd/v4_end_grace", "Y").map_err(io_error("end the nfsd grace period"))?;
        server.wait_for_mountd()?;
        Ok(server)
    }

    /// The directory served as `127.0.0.1:/`.
    pub fn export(&self) -> &Path {
        &self.export
    }

    /// The mount source for `mount -t nfs4`, e.g. `source("vol1")` = `127.0.0.1:/vol1`.
    pub fn source(&self, sub: &str) -> String {
        format!("127.0.0.1:/{}", sub.trim_start_matches('/'))
    }

    // mountd opens the export-cache channels shortly after it starts; a mount before that gets
    // a spurious "access denied".
    fn wait_for_mountd(&mut self) -> Result<(), GuestError> {
        let mountd_pid = self.mountd.as_ref().map(|c| c.id());
        wait_until("rpc.mountd to open the export cache channel", Duration::from_secs(10), || {
            let Some(pid) = mountd_pid else { return false };
            let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
            fds.flatten()
                .any(|fd| fs::read_link(fd.path()).is_ok_and(|target| target.to_string_lossy().contains("nfsd.export")))
        })
    }
}

impl Drop for KernelNfsServer {
    fn drop(&mut self) {
        let _ = sh("rpc.nfsd", &["0"]);
        let _ = sh("exportfs", &["-ua"]);
        if let Some(mut mountd) = self.mountd.take() {
            let _ = mountd.kill();
            let _ = mountd.wait();
        }
    }
}

/// A file exported to the kernel as `/dev/nbdN` by the host's `qemu-nbd`. Dropping it
/// disconnects the device (unmount what is on it first).
pub struct NbdDevice {
    device: PathBuf,
}

impl NbdDevice {
    /// Connects the first free NBD device to the raw image `file`.
    pub fn attach(file: &Path) -> Result<Self, GuestError> {
        let index = (0..16)
            .find(|i| fs::read_to_string(format!("/sys/block/nbd{i}/size")).is_ok_and(|s| s.trim() == "0"))
            .ok_or(GuestError::NoFreeNbd)?;
        let device = PathBuf::from(format!("/dev/nbd{index}"));
        let file_arg = file.to_string_lossy();
        let connect = format!("--connect={}", device.display());
        sh("qemu-nbd", &["--fork", &connect, "--format=raw", "--cache=none", "--aio=threads", &file_arg])?;
        let attached = Self { device };
        // qemu-nbd returns once it has handed the socket to the kernel; the size shows up a
        // moment later.
        let size_path = format!("/sys/block/nbd{index}/size");
        wait_until(&format!("{} to get its size", attached.device.display()), Duration::from_secs(10), || {
            fs::read_to_string(&size_path).is_ok_and(|s| s.trim() != "0")
        })?;
        Ok(attached)
    }

    /// `/dev/nbdN`.
    pub fn path(&self) -> &Path {
        &self.device
    }
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        let device = self.device.to_string_lossy().into_owned();
        let _ = sh("qemu-nbd", &["--disconnect", &device]);
    }
}

/// The minimal policy `load_selinux_policy` compiles, without its MCS categories.
const MINIMAL_POLICY: &str = include_str!("../selinux/minimal.cil");

/// Loads a minimal SELinux policy (`selinux/minimal.cil` plus categories c0..c1023), permissive,
/// into a guest booted with `security=selinux` ([`crate::Vm::kernel_arg`]): from then on the
/// kernel labels files, and a label like kubelet's (`system_u:object_r:container_file_t:s0:c3,c7`)
/// is valid. Compiled with the host's `secilc` (installed by `scripts/setup`).
pub fn load_selinux_policy() -> Result<(), GuestError> {
    let selinuxfs = Path::new("/sys/fs/selinux");
    if !selinuxfs.join("load").exists() {
        if !selinuxfs.exists() {
            return Err(GuestError::Io {
                what: "SELinux is not enabled in this guest (boot it with security=selinux)".into(),
                source: io::Error::from(io::ErrorKind::NotFound),
            });
        }
        sh("mount", &["-t", "selinuxfs", "selinuxfs", "/sys/fs/selinux"])?;
    }
    let mut cil = String::from(MINIMAL_POLICY);
    for c in 0..1024 {
        cil.push_str(&format!("(category c{c})\n"));
    }
    let order = (0..1024).map(|c| format!("c{c}")).collect::<Vec<_>>().join(" ");
    cil.push_str(&format!("(categoryorder ({order}))\n"));
    cil.push_str("(sensitivitycategory s0 (range c0 c1023))\n");
    cil.push_str("(userlevel system_u (s0))\n");
    cil.push_str("(userrange system_u ((s0) (s0 (range c0 c1023))))\n");
    let dir = std::env::temp_dir().join(format!("wasmcsi-selinux-{}", std::process::id()));
    fs::create_dir_all(&dir).map_err(io_error(format!("create {}", dir.display())))?;
    let (source, binary) = (dir.join("policy.cil"), dir.join("policy.bin"));
    fs::write(&source, cil).map_err(io_error(format!("write {}", source.display())))?;
    let (source, binary_arg) = (source.to_string_lossy().into_owned(), binary.to_string_lossy().into_owned());
    sh("secilc", &["-o", &binary_arg, "-f", "/dev/null", &source])?;
    let policy = fs::read(&binary).map_err(io_error(format!("read {}", binary.display())))?;
    fs::write(selinuxfs.join("load"), policy).map_err(io_error("load the SELinux policy (see dmesg)"))?;
    let _ = fs::remove_dir_all(&dir);
    selinux_config()
}

/// Gives the guest the `/etc/selinux/config` of an SELinux host: without it libselinux says
/// SELinux is disabled (`is_selinux_enabled` wants the file as well as selinuxfs), and
/// util-linux mount(8) then drops every SELinux mount option. The guest's root is the host's,
/// read-only, so the directory gets a tmpfs of its own.
fn selinux_config() -> Result<(), GuestError> {
    let etc = Path::new("/etc/selinux");
    if etc.join("config").exists() {
        return Ok(());
    }
    if !etc.is_dir() {
        return Err(GuestError::Io {
            what: "/etc/selinux is missing on the host whose root the guest boots (scripts/setup installs it)".into(),
            source: io::Error::from(io::ErrorKind::NotFound),
        });
    }
    sh("mount", &["-t", "tmpfs", "-o", "size=1m,mode=0755", "selinux-config", "/etc/selinux"])?;
    fs::write(etc.join("config"), "SELINUX=permissive\nSELINUXTYPE=minimal\n")
        .map_err(io_error("write /etc/selinux/config"))
}

/// The SELinux label of `path` (its `security.selinux` attribute, not following a symlink).
pub fn selinux_label(path: &Path) -> Result<String, GuestError> {
    let out = sh("stat", &["-c", "%C", &path.to_string_lossy()])?;
    Ok(out.trim().to_owned())
}
