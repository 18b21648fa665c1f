//! The kernel-VM test tier: run a host-built test inside a qemu TCG VM whose kernel has what this
//! machine's kernel lacks (NFS client and server, NBD, ublk, rbd).
//!
//! The VM itself is `scripts/vm/run` (see `docs/vm-test-tier.md`): a Debian 6.12 kernel booting
//! into the host's own root over read-only 9p with a tmpfs overlay, so the test binary runs
//! unchanged at its host path, as root, with the modules loaded. This crate owns the Rust side:
//! deciding whether the tier can run here (and skipping *only* when it genuinely cannot: not
//! fetched and no registry, an explicit opt-out, a foreign architecture), re-invoking the current
//! test binary for one test inside the VM, mapping the outcome to a typed [`Error`], and small
//! helpers for what tests do inside the guest ([`guest`]). It does not build or fetch anything
//! itself; the scripts do, and cache it.
//!
//! A test says:
//!
//! ```no_run
//! #[test]
//! fn kernel_nfs_mount_round_trips() {
//!     // On the host: runs this very test inside the VM and returns None (or skips).
//!     // Inside the VM: Some(guest), and the body below runs as root on the VM's kernel.
//!     let Some(guest) = wasmcsi_vmtest::enter!() else { return };
//!     let export = guest.scratch().join("export");
//!     // ...
//! }
//! ```

pub mod guest;

use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::Duration;

/// Set (to `1`) by `scripts/vm/run` for every command it runs in the guest.
pub const IN_VM_ENV: &str = "WASMCSI_IN_VM";
/// `WASMCSI_VM_TESTS=skip` opts out of the VM tier (every VM test then skips, saying why);
/// `WASMCSI_VM_TESTS=require` turns "cannot run here" into a failure (CI, where a tier that
/// silently skipped would hide a broken fetch).
pub const MODE_ENV: &str = "WASMCSI_VM_TESTS";
/// Overrides where `scripts/vm/` is (default: found from this crate's source directory).
pub const SCRIPTS_ENV: &str = "WASMCSI_VM_SCRIPTS";

/// `scripts/vm/setup` and `run`: the registry is unreachable and nothing usable is cached.
const EXIT_OFFLINE: i32 = 75;

/// What went wrong running something in the VM. Only [`Error::Unavailable`] is a reason to skip;
/// everything else is a failure of the test or of the tier and must fail the test.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the VM tier cannot run here: {0}")]
    Unavailable(String),
    #[error("cannot run {script}: {source}")]
    Spawn {
        script: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("scripts/vm/setup failed ({status}): the VM tier is broken, not merely absent")]
    Setup { status: ExitStatus },
    #[error("{what} did not finish inside the VM before its {}s timeout", timeout.as_secs())]
    Timeout { what: String, timeout: Duration },
    #[error(
        "the VM ended without reporting the status of {what} (boot failure or kernel panic; its console is printed above)"
    )]
    NoStatus { what: String },
    #[error("{what} failed inside the VM: exit status {status}")]
    Failed { what: String, status: i32 },
    #[error("cannot read the status file {path}: {source}")]
    StatusFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot find the current test binary: {0}")]
    CurrentExe(#[source] io::Error),
}

/// True inside the VM (set by `scripts/vm/run`).
pub fn in_vm() -> bool {
    std::env::var_os(IN_VM_ENV).is_some_and(|v| v == "1")
}

/// What a command run in the VM left: its exit status and everything it printed.
#[derive(Debug)]
pub struct VmOutput {
    pub status: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// How to boot the VM for one command. Every run boots a fresh VM (~10 s under TCG on two cores):
/// nothing leaks from one test into the next.
#[derive(Debug, Clone)]
pub struct Vm {
    timeout: Duration,
    mem_mib: u32,
    scratch: String,
    env: Vec<(String, String)>,
    kernel_args: Vec<String>,
}

impl Default for Vm {
    fn default() -> Self {
        Self::new()
    }
}

impl Vm {
    /// 300 s for boot and command together, 2 GiB of memory, a 2 GiB sparse ext4 `/scratch`.
    pub fn new() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            mem_mib: 2048,
            scratch: "2G".into(),
            env: Vec::new(),
            kernel_args: Vec::new(),
        }
    }

    /// Hard limit for the whole VM, boot included; past it qemu is killed.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Guest memory. The tmpfs overlay holding every write outside `/scratch` lives in it.
    pub fn mem_mib(mut self, mem_mib: u32) -> Self {
        self.mem_mib = mem_mib;
        self
    }

    /// Size of the ext4 scratch disk at `/scratch` (`"0"` for none), e.g. `"8G"`; sparse.
    pub fn scratch(mut self, size: &str) -> Self {
        self.scratch = size.to_owned();
        self
    }

    /// An environment variable for the command in the VM (the guest starts from a clean one).
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }

    /// A parameter for the guest kernel's command line, e.g. `security=selinux` (the Debian
    /// kernel has SELinux built in, AppArmor chosen by default).
    pub fn kernel_arg(mut self, arg: &str) -> Self {
        self.kernel_args.push(arg.to_owned());
        self
    }

    /// Runs `program args` as root in a fresh VM, echoing its output through `print!`/`eprint!`
    /// (so libtest shows it for a failing test, or live with `--nocapture`), and keeps it.
    /// `Ok` whatever the command's exit status; `Err` when the VM could not run it.
    pub fn output<S: AsRef<OsStr>>(&self, program: impl AsRef<OsStr>, args: &[S]) -> Result<VmOutput, Error> {
        let what = program.as_ref().to_string_lossy().into_owned();
        ensure_ready()?;
        // Two TCG guests on two cores would each take twice as long and risk their timeouts.
        let _one_at_a_time = VM_LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let script = scripts_dir().join("run");
        let status_file = status_file_path();
        let mut cmd = Command::new(&script);
        cmd.arg("--timeout")
            .arg(self.timeout.as_secs().max(1).to_string())
            .arg("--mem")
            .arg(self.mem_mib.to_string())
            .arg("--scratch")
            .arg(&self.scratch)
            .arg("--status-file")
            .arg(&status_file);
        if !self.kernel_args.is_empty() {
            cmd.arg("--append").arg(self.kernel_args.join(" "));
        }
        for (name, value) in self.env.iter().chain(passed_through().iter()) {
            cmd.arg("-e").arg(format!("{name}={value}"));
        }
        cmd.arg("--").arg(program.as_ref()).args(args);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|source| Error::Spawn { script: script.clone(), source })?;
        let stdout = child.stdout.take().map(|out| echo_lines(out, false));
        let stderr = child.stderr.take().map(|err| echo_lines(err, true));
        let run_status = child.wait().map_err(|source| Error::Spawn { script: script.clone(), source })?;
        let stdout = stdout.map(join_echo).unwrap_or_default();
        let stderr = stderr.map(join_echo).unwrap_or_default();

        // The status file exists only if the command itself reported a status, which keeps a
        // command that exits 124 apart from a VM that timed out.
        let status = match std::fs::read_to_string(&status_file) {
            Ok(text) => {
                let _ = std::fs::remove_file(&status_file);
                text.trim().parse::<i32>().ok()
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => return Err(Error::StatusFile { path: status_file, source }),
        };
        match (status, run_status.code()) {
            (Some(status), _) => Ok(VmOutput { status, stdout, stderr }),
            (None, Some(EXIT_OFFLINE)) => {
                Err(Error::Unavailable("not fetched, and the Debian registry is unreachable".into()))
            }
            (None, Some(124)) => Err(Error::Timeout { what, timeout: self.timeout }),
            (None, _) => Err(Error::NoStatus { what }),
        }
    }

    /// Runs `program args` in the VM; `Ok` only if it exits 0.
    pub fn run<S: AsRef<OsStr>>(&self, program: impl AsRef<OsStr>, args: &[S]) -> Result<(), Error> {
        let what = program.as_ref().to_string_lossy().into_owned();
        match self.output(program, args)?.status {
            0 => Ok(()),
            status => Err(Error::Failed { what, status }),
        }
    }

    /// Runs the test `name` (its full libtest path, e.g. `nfs::mount_works`) of the current
    /// test binary in the VM. Inside, [`in_vm`] is true, so the test's body runs for real.
    pub fn run_test(&self, name: &str) -> Result<(), Error> {
        let exe = std::env::current_exe().map_err(Error::CurrentExe)?;
        // --include-ignored: an #[ignore]d test that was asked for on the host runs inside too.
        let args: [&OsStr; 6] = [
            OsStr::new("--exact"),
            OsStr::new(name),
            OsStr::new("--nocapture"),
            OsStr::new("--test-threads=1"),
            OsStr::new("--include-ignored"),
            OsStr::new("--quiet"),
        ];
        match self.output(&exe, &args) {
            Ok(out) if out.status == 0 => {
                // libtest exits 0 for a filter that matched nothing; a renamed test must not
                // pass by running nothing.
                if String::from_utf8_lossy(&out.stdout).contains("running 0 tests") {
                    return Err(Error::Failed { what: format!("test {name} (no such test in the VM)"), status: 0 });
                }
                Ok(())
            }
            Ok(out) => Err(Error::Failed { what: format!("test {name}"), status: out.status }),
            Err(Error::Timeout { timeout, .. }) => Err(Error::Timeout { what: format!("test {name}"), timeout }),
            Err(Error::NoStatus { .. }) => Err(Error::NoStatus { what: format!("test {name}") }),
            Err(e) => Err(e),
        }
    }
}

/// What the test body gets inside the VM.
#[derive(Debug)]
pub struct Guest {
    scratch: PathBuf,
}

impl Guest {
    /// The ext4 scratch disk (a virtio disk, so a real block-backed filesystem: exportable by
    /// nfsd, unlike the overlay root). Writes anywhere else land in the overlay's tmpfs.
    pub fn scratch(&self) -> &Path {
        &self.scratch
    }
}

/// The body of [`enter!`]: inside the VM, `Some(Guest)`; on the host, runs test `name` in the
/// VM and returns `None`, panicking if it failed there and skipping (with a message that
/// bypasses libtest's capture, so CI logs show it) if the tier cannot run here.
pub fn enter_test(vm: &Vm, name: &str) -> Option<Guest> {
    if in_vm() {
        return Some(Guest { scratch: PathBuf::from("/scratch") });
    }
    match vm.run_test(name) {
        Ok(()) => None,
        Err(Error::Unavailable(why)) if !required() => {
            let _ = writeln!(io::stderr(), "skipped {name}: {why}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Runs the enclosing test inside the VM (see the crate docs): `Some(Guest)` inside, `None` on
/// the host once the VM run passed (or was skipped). `enter!(vm)` takes a configured [`Vm`].
#[macro_export]
macro_rules! enter {
    () => {
        $crate::enter!($crate::Vm::new())
    };
    ($vm:expr) => {{
        fn here() {}
        $crate::enter_test(&$vm, $crate::test_name(::std::any::type_name_of_val(&here)))
    }};
}

/// The libtest name of the test whose item path is `path`, as produced inside [`enter!`]:
/// `kernel::nfs::mount_works::here` (crate, modules, test, marker) gives `nfs::mount_works`.
pub fn test_name(path: &str) -> &str {
    let without_marker = path.rsplit_once("::").map_or(path, |(head, _)| head);
    without_marker.split_once("::").map_or(without_marker, |(_, rest)| rest)
}

/// True when `WASMCSI_VM_TESTS=require`: the tier must run, a skip is a failure.
pub fn required() -> bool {
    std::env::var_os(MODE_ENV).is_some_and(|v| v == "require")
}

static VM_LOCK: Mutex<()> = Mutex::new(());

/// Checked once per process: the opt-out, the architecture, then `scripts/vm/setup` (a no-op
/// when cached; a download of ~120 MB when not).
fn ensure_ready() -> Result<(), Error> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let ready = READY.get_or_init(|| match check_ready() {
        Ok(()) => Ok(()),
        Err(Error::Unavailable(why)) => Err(why),
        Err(e) => panic!("{e}"),
    });
    ready.clone().map_err(Error::Unavailable)
}

fn check_ready() -> Result<(), Error> {
    if std::env::var_os(MODE_ENV).is_some_and(|v| v == "skip") {
        return Err(Error::Unavailable(format!("{MODE_ENV}=skip")));
    }
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        return Err(Error::Unavailable("the VM tier boots an x86_64 Debian kernel on Linux hosts only".into()));
    }
    let script = scripts_dir().join("setup");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Spawn { script: script.clone(), source })?;
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    match out.status.code() {
        Some(0) => Ok(()),
        Some(EXIT_OFFLINE) => Err(Error::Unavailable("not fetched, and the Debian registry is unreachable".into())),
        _ => Err(Error::Setup { status: out.status }),
    }
}

fn scripts_dir() -> PathBuf {
    match std::env::var_os(SCRIPTS_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vm"),
    }
}

/// Host variables worth having in the guest (which otherwise starts from a clean environment).
fn passed_through() -> Vec<(String, String)> {
    // WASMCSI_CEPH_TESTS: "require" must fail a test in the guest as it does on the host.
    ["RUST_BACKTRACE", "RUST_LOG", "RUST_LIB_BACKTRACE", "WASMCSI_CEPH_TESTS"]
        .iter()
        .filter_map(|name| std::env::var(name).ok().map(|value| ((*name).to_owned(), value)))
        .collect()
}

fn status_file_path() -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "wasmcsi-vmtest-status.{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Copies a child's output line by line through `print!`/`eprint!` and keeps it. Printing from
/// this thread is still captured by libtest: spawned threads inherit the test's capture.
fn echo_lines(stream: impl Read + Send + 'static, to_stderr: bool) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut kept = Vec::new();
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    if to_stderr {
                        eprint!("{text}");
                    } else {
                        print!("{text}");
                    }
                    kept.extend_from_slice(&line);
                }
            }
        }
        kept
    })
}

fn join_echo(handle: thread::JoinHandle<Vec<u8>>) -> Vec<u8> {
    handle.join().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_name_drops_crate_and_marker() {
        assert_eq!(test_name("kernel::nfs_mount_works::here"), "nfs_mount_works");
        assert_eq!(test_name("kernel::nfs::mount_works::here"), "nfs::mount_works");
    }

    #[test]
    fn enter_names_the_enclosing_test() {
        fn here() {}
        assert_eq!(test_name(std::any::type_name_of_val(&here)), "tests::enter_names_the_enclosing_test");
    }
}
