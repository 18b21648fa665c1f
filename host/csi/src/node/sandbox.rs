//! Test support: a temporary directory for tests that make real mounts (they need root and
//! skip, saying why, without it).
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags};

use wasmcsi_mountinfo::{self as mountinfo, MountEntry};

/// A temporary directory for real mounts. Dropping it lazily unmounts everything mounted
/// under it before the directory is deleted (deleting through a live bind mount would
/// delete the source's files), also when a test panics half-way.
pub struct Sandbox {
    pub root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Sandbox {
    /// `None`, after saying why, when this process may not mount.
    pub fn new(test: &str) -> Option<Self> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping {test}: mounting needs root");
            return None;
        }
        let dir = tempfile::tempdir().expect("create sandbox directory");
        // The mount table spells paths without symlinks.
        let root = dir.path().canonicalize().expect("canonicalize sandbox directory");
        Some(Self { root, _dir: dir })
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        let path = self.root.join(name);
        std::fs::create_dir_all(&path).expect("create sandbox subdirectory");
        path
    }

    pub fn mounts_at(&self, target: &Path) -> Vec<MountEntry> {
        let table = mountinfo::read_current().expect("read mount table");
        mountinfo::mounts_at(&table, target).into_iter().cloned().collect()
    }

    pub fn mount_tmpfs(&self, target: &Path, flags: MsFlags) {
        nix::mount::mount(Some("tmpfs"), target, Some("tmpfs"), flags, Some("size=1m")).expect("mount tmpfs");
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // Bounded: a detach that keeps failing must not hang the test run.
        for _ in 0..16 {
            let Ok(table) = mountinfo::read_current() else {
                return;
            };
            let mut inside: Vec<&MountEntry> = table.iter().filter(|e| e.mount_point.starts_with(&self.root)).collect();
            if inside.is_empty() {
                return;
            }
            inside.sort_by_key(|e| std::cmp::Reverse(e.mount_id));
            for entry in inside {
                let _ = nix::mount::umount2(&entry.mount_point, MntFlags::MNT_DETACH);
            }
        }
    }
}
