# Shared by scripts/vm/*: where the VM tier keeps its files, the private apt state, the pinned
# packages. Sourced, not run.
#
# Everything lives under one cache directory, outside the repo by default so `cargo clean` and a
# fresh clone in CI keep it (override with WASMCSI_VM_CACHE; non-root users fall back to
# target/vm). Layout:
#   apt/        private apt state (sources, lists): the machine's own sources are never touched
#   debs/       downloaded .deb files, checked against packages.lock
#   qemu/       qemu-system-x86 and the libraries the machine lacks, run from there (host side)
#   guest/      a layer over the host root inside the VM: the kernel's modules (+ modules.dep),
#               kmod, busybox, the NFS userland
#   vmlinuz     the kernel booted by scripts/vm/run
#   initramfs.cpio.gz

vm_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_dir=$(cd "$vm_dir/../.." && pwd)

if [ -n "${WASMCSI_VM_CACHE:-}" ]; then
  cache=$WASMCSI_VM_CACHE
elif [ "$(id -u)" -eq 0 ]; then
  cache=/var/cache/wasmcsi-vm
else
  cache=$repo_dir/target/vm
fi

# The kernel release inside the kernel package pinned in packages.lock.
kernel_release=6.12.95+deb12-amd64

# Modules the initramfs loads (with their dependencies from modules.dep). The first five are
# what the init needs to reach the host root and the scratch disk; the rest are the kernel
# frontends the tests exercise. Anything else can be `modprobe`d inside the VM.
boot_modules=(9pnet_virtio 9p overlay virtio_blk ext4)
test_modules=(loop nbd ublk_drv rbd nfsv4 nfsd)

# Exit status of fetch/setup when the Debian registry cannot be reached and nothing is cached:
# the one failure the Rust helper turns into a skip (EX_TEMPFAIL).
exit_offline=75

apt_opts=(
  -o "Dir::State::Lists=$cache/apt/lists"
  -o "Dir::Etc::SourceList=$cache/apt/sources.list"
  -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::Cache=$cache/apt/cache"
  -o APT::Sandbox::User=root
  -o Acquire::Retries=3
)

say() { echo "vm: $*" >&2; }
die() { echo "vm: error: $*" >&2; exit 1; }

# Serialises fetch/initramfs between concurrent callers (several test binaries, two shells).
take_lock() {
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  flock 9
}

# A short digest of files, to stamp what a cached artifact was built from.
digest_of() { cat "$@" | sha256sum | cut -c1-16; }
