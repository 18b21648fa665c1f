//! The node's view of the mount table: parsing `/proc/self/mountinfo` (proc(5)) into
//! [`MountEntry`] values and looking entries up by mount point. It owns the format only: it does
//! not decide what a mount means for a volume (that is the CSI node's planners' job, e.g.
//! `wasmcsi_csi::node::mounts`, and the frontends' teardown) and it never changes the mount table.
//! A crate of its own, below everything that reads the table (the frontends' teardown, the CSI
//! node, the conformance suite's node checks), so they parse it one way and none of them has to
//! depend on another to do it.
//!
//! Paths are kept as raw bytes from the kernel, so a mount point that is not UTF-8 still compares
//! equal to the `Path` a caller holds.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// Where the kernel publishes the calling process's mount namespace.
const MOUNTINFO_PATH: &str = "/proc/self/mountinfo";

/// One line of `/proc/self/mountinfo`. Paths and strings are unescaped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub parent_id: u32,
    pub major: u32,
    pub minor: u32,
    /// The directory of the filesystem that forms this mount's root: `/` for a plain mount, the
    /// bound directory for a bind mount.
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount flags (`ro`, `nosuid`, ...), as set by `mount(2)` on this mount only.
    pub mount_options: Vec<String>,
    pub fs_type: String,
    pub source: String,
    /// Per-superblock options, shared by every mount of the same filesystem.
    pub super_options: Vec<String>,
    /// The optional fields: how mounts propagate to and from this one (`shared:N`,
    /// `master:N`, `propagate_from:N`, `unbindable`); none for a private mount.
    pub propagation: Vec<String>,
}

impl MountEntry {
    /// Whether writes through this mount fail: either the mount itself or the whole filesystem
    /// is read-only.
    pub fn is_read_only(&self) -> bool {
        self.has_read_only_flag() || self.super_options.iter().any(|o| o == "ro")
    }

    /// Whether the per-mount `ro` flag is set: the flag a read-only bind remount changes. Differs
    /// from [`MountEntry::is_read_only`] when a writable bind mount sits on a read-only
    /// filesystem.
    pub fn has_read_only_flag(&self) -> bool {
        self.mount_options.iter().any(|o| o == "ro")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MountInfoError {
    #[error("cannot read mount table {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("mountinfo line {line} is malformed ({reason}): {text:?}")]
    Malformed {
        /// 1-based, as an editor shows it.
        line: usize,
        reason: &'static str,
        text: String,
    },
}

/// Parses the whole text of a mountinfo file. Blank lines are skipped; any malformed line fails
/// the parse, because a planner acting on a partial mount table could mount twice.
pub fn parse(text: &str) -> Result<Vec<MountEntry>, MountInfoError> {
    parse_bytes(text.as_bytes())
}

/// Reads and parses the mount table of the calling process's mount namespace.
pub fn read_current() -> Result<Vec<MountEntry>, MountInfoError> {
    // Bytes, not a String: mount points are not guaranteed to be UTF-8.
    let bytes = std::fs::read(MOUNTINFO_PATH)
        .map_err(|source| MountInfoError::Read { path: PathBuf::from(MOUNTINFO_PATH), source })?;
    parse_bytes(&bytes)
}

/// Every entry mounted exactly at `path`, oldest first; the last one is the mount a lookup of
/// `path` reaches. `path` must be spelled as the kernel shows it (absolute, no symlinks).
pub fn mounts_at<'a>(entries: &'a [MountEntry], path: &Path) -> Vec<&'a MountEntry> {
    entries.iter().filter(|e| e.mount_point == path).collect()
}

/// Whether anything is mounted at `path` in the current mount table (spelled as for
/// [`mounts_at`]).
pub fn is_mount_point(path: &Path) -> Result<bool, MountInfoError> {
    Ok(!mounts_at(&read_current()?, path).is_empty())
}

fn parse_bytes(bytes: &[u8]) -> Result<Vec<MountEntry>, MountInfoError> {
    bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.iter().all(u8::is_ascii_whitespace))
        .map(|(index, line)| {
            parse_line(line).map_err(|reason| MountInfoError::Malformed {
                line: index + 1,
                reason,
                text: String::from_utf8_lossy(line).into_owned(),
            })
        })
        .collect()
}

fn parse_line(line: &[u8]) -> Result<MountEntry, &'static str> {
    // The kernel escapes spaces inside fields, so a single space always separates fields.
    let mut fields = line.split(|&b| b == b' ');
    let mut next = |what: &'static str| fields.next().ok_or(what);

    let mount_id = parse_u32(next("missing mount id")?).ok_or("mount id is not a number")?;
    let parent_id = parse_u32(next("missing parent id")?).ok_or("parent id is not a number")?;
    let (major, minor) = parse_device(next("missing major:minor")?)?;
    let root = unescape_path(next("missing root")?);
    let mount_point = unescape_path(next("missing mount point")?);
    let mount_options = split_options(next("missing mount options")?);
    // Zero or more optional fields (shared:N, master:N, propagate_from:N, unbindable) precede
    // the separator; their number varies between mounts and kernels.
    let mut propagation = Vec::new();
    loop {
        match next("missing '-' separator")? {
            b"-" => break,
            field => propagation.push(unescape_string(field)),
        }
    }
    let fs_type = unescape_string(next("missing filesystem type")?);
    let source = unescape_string(next("missing mount source")?);
    let super_options = split_options(next("missing super options")?);
    // Further fields are tolerated: proc(5) allows the format to grow at the end.

    Ok(MountEntry {
        mount_id,
        parent_id,
        major,
        minor,
        root,
        mount_point,
        mount_options,
        fs_type,
        source,
        super_options,
        propagation,
    })
}

fn parse_u32(field: &[u8]) -> Option<u32> {
    std::str::from_utf8(field).ok()?.parse().ok()
}

fn parse_device(field: &[u8]) -> Result<(u32, u32), &'static str> {
    let colon = field.iter().position(|&b| b == b':').ok_or("major:minor has no ':'")?;
    let major = parse_u32(&field[..colon]).ok_or("major is not a number")?;
    let minor = parse_u32(&field[colon + 1..]).ok_or("minor is not a number")?;
    Ok((major, minor))
}

/// Options are split before unescaping: a comma inside a value is escaped as `\054`.
/// Options are comma-separated, except that a comma inside double quotes belongs to the value:
/// SELinux shows a context with MCS categories as `context="system_u:object_r:t:s0:c3,c7"`.
fn split_options(field: &[u8]) -> Vec<String> {
    let mut quoted = false;
    field
        .split(|&b| {
            if b == b'"' {
                quoted = !quoted;
            }
            b == b',' && !quoted
        })
        .filter(|o| !o.is_empty())
        .map(unescape_string)
        .collect()
}

fn unescape_path(field: &[u8]) -> PathBuf {
    PathBuf::from(OsString::from_vec(unescape(field)))
}

fn unescape_string(field: &[u8]) -> String {
    String::from_utf8_lossy(&unescape(field)).into_owned()
}

/// Undoes the kernel's `\ooo` octal escaping (used for space, tab, newline, backslash and, in
/// some options, comma). A backslash not followed by three octal digits is kept literally, as
/// the kernel never produces one.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut rest = field;
    while let Some((&first, tail)) = rest.split_first() {
        if first == b'\\'
            && let Some(byte) = octal_byte(tail)
        {
            out.push(byte);
            rest = &tail[3..];
        } else {
            out.push(first);
            rest = tail;
        }
    }
    out
}

fn octal_byte(digits: &[u8]) -> Option<u8> {
    let [a, b, c] = *digits.get(..3)? else {
        return None;
    };
    if [a, b, c].iter().all(|d| (b'0'..=b'7').contains(d)) {
        let value = u32::from(a - b'0') * 64 + u32::from(b - b'0') * 8 + u32::from(c - b'0');
        u8::try_from(value).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBELET_NODE: &str = include_str!("../tests/fixtures/kubelet-node.txt");
    const ESCAPED_PATHS: &str = include_str!("../tests/fixtures/escaped-paths.txt");
    const STACKED: &str = include_str!("../tests/fixtures/stacked.txt");

    const STAGING: &str = "/var/lib/kubelet/plugins/kubernetes.io/csi/wasmcsi.example.io/\
        9c2e51b7f0a4d8e3c6b1a7f2e9d4c5b8a3f6e1d0c7b2a9f4e8d3c6b1a5f0e9d2/globalmount";
    const VOLUME_DIR: &str = "/var/lib/wasmcsi/volumes/pvc-3f1c9a2e-8b7d-4c6e-a5f4-0b1c2d3e4f5a";

    fn parsed(text: &str) -> Vec<MountEntry> {
        match parse(text) {
            Ok(entries) => entries,
            Err(e) => panic!("fixture must parse: {e}"),
        }
    }

    fn only_at<'a>(entries: &'a [MountEntry], path: &str) -> &'a MountEntry {
        match mounts_at(entries, Path::new(path)).as_slice() {
            [entry] => entry,
            other => panic!("expected one mount at {path}, found {}", other.len()),
        }
    }

    #[test]
    fn parses_every_line_of_a_kubelet_node() {
        let entries = parsed(KUBELET_NODE);
        assert_eq!(entries.len(), KUBELET_NODE.lines().count());
    }

    #[test]
    fn parses_all_fields_of_a_bind_mount() {
        let entries = parsed(KUBELET_NODE);
        let staging = only_at(&entries, STAGING);
        assert_eq!(
            staging,
            &MountEntry {
                mount_id: 310,
                parent_id: 22,
                major: 8,
                minor: 1,
                root: PathBuf::from(VOLUME_DIR),
                mount_point: PathBuf::from(STAGING),
                mount_options: vec!["rw".into(), "relatime".into()],
                fs_type: "ext4".into(),
                source: "/dev/sda1".into(),
                super_options: vec!["rw".into(), "errors=remount-ro".into()],
                propagation: vec!["shared:1".into()],
            }
        );
    }

    #[test]
    fn a_quoted_selinux_context_is_one_option() {
        let line = "42 32 7:0 / /mnt/a rw,relatime - ext4 /dev/loop0 rw,context=\"system_u:object_r:container_file_t:s0:c3,c7\",seclabel\n";
        let entry = &parsed(line)[0];
        assert_eq!(entry.super_options, ["rw", "context=\"system_u:object_r:container_file_t:s0:c3,c7\"", "seclabel"]);
    }

    #[test]
    fn skips_any_number_of_optional_fields() {
        let entries = parsed(KUBELET_NODE);
        // Zero optional fields.
        let zero = parsed("7 1 0:5 / /x rw - tmpfs tmpfs rw\n");
        assert_eq!(zero[0].fs_type, "tmpfs");
        // Two optional fields (shared + master).
        let slave = entries.iter().find(|e| e.mount_id == 160);
        assert_eq!(slave.map(|e| e.fs_type.as_str()), Some("overlay"));
        // A flag-like optional field.
        let unbindable = entries.iter().find(|e| e.mount_id == 320);
        assert_eq!(unbindable.map(|e| e.fs_type.as_str()), Some("tmpfs"));
    }

    #[test]
    fn keeps_overlay_options_with_colons_intact() {
        let entries = parsed(KUBELET_NODE);
        let overlay = entries.iter().find(|e| e.mount_id == 160);
        let lowerdir = overlay.and_then(|e| e.super_options.iter().find(|o| o.starts_with("lowerdir=")));
        let snapshots = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots";
        let expected = format!("lowerdir={snapshots}/41/fs:{snapshots}/40/fs");
        assert_eq!(lowerdir, Some(&expected));
    }

    #[test]
    fn unescapes_space_tab_newline_and_backslash() {
        let entries = parsed(ESCAPED_PATHS);
        let spaced = entries.iter().find(|e| e.mount_id == 400);
        assert_eq!(
            spaced.map(|e| e.mount_point.as_path()),
            Some(Path::new(
                "/var/lib/kubelet/pods/3c4d5e6f-7a8b-4c9d-8e0f-1a2b3c4d5e6f/volumes/\
                 kubernetes.io~csi/team share/mount"
            ))
        );
        assert_eq!(spaced.map(|e| e.root.as_path()), Some(Path::new("/srv/volumes/my data")));

        let control = entries.iter().find(|e| e.mount_id == 401);
        assert_eq!(control.map(|e| e.mount_point.as_path()), Some(Path::new("/mnt/tab\tand\nnewline")));
        assert_eq!(control.map(|e| e.source.as_str()), Some("scratch space"));

        let backslash = entries.iter().find(|e| e.mount_id == 402);
        assert_eq!(backslash.map(|e| e.mount_point.as_path()), Some(Path::new("/mnt/back\\slash")));
    }

    #[test]
    fn keeps_a_backslash_without_octal_digits_literally() {
        assert_eq!(unescape(b"a\\9b\\04"), b"a\\9b\\04");
        assert_eq!(unescape(b"\\054x"), b",x");
    }

    #[test]
    fn unescapes_a_comma_inside_an_option_value() {
        let entries = parsed("7 1 0:5 / /x rw - fuse.s s rw,subtype=a\\054b\n");
        assert_eq!(entries[0].super_options, ["rw", "subtype=a,b"]);
    }

    #[test]
    fn keeps_non_utf8_mount_points_byte_exact() {
        let entries = match parse_bytes(b"7 1 0:5 / /mnt/\xff rw - tmpfs tmpfs rw\n") {
            Ok(entries) => entries,
            Err(e) => panic!("non-UTF-8 line must parse: {e}"),
        };
        assert_eq!(entries[0].mount_point, PathBuf::from(OsString::from_vec(b"/mnt/\xff".to_vec())));
    }

    #[test]
    fn lists_stacked_mounts_oldest_first() {
        let entries = parsed(STACKED);
        let at = mounts_at(
            &entries,
            Path::new(
                "/var/lib/kubelet/pods/0a1b2c3d-0000-4000-8000-000000000001/volumes/\
                 kubernetes.io~csi/pvc-aa11/mount",
            ),
        );
        let ids: Vec<u32> = at.iter().map(|e| e.mount_id).collect();
        assert_eq!(ids, [500, 502]);
    }

    #[test]
    fn finds_nothing_at_an_unmounted_path() {
        let entries = parsed(KUBELET_NODE);
        assert!(mounts_at(&entries, Path::new("/var/lib/kubelet")).is_empty());
        // A prefix of a mount point is not the mount point.
        assert!(mounts_at(&entries, Path::new("/sys/fs")).is_empty());
    }

    #[test]
    fn the_live_table_has_proc_mounted_and_not_a_fresh_directory() {
        assert!(is_mount_point(Path::new("/proc")).expect("mount table"));
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(!is_mount_point(dir.path()).expect("mount table"));
    }

    #[test]
    fn tells_read_only_from_mount_flag_and_from_superblock() {
        let entries = parsed(KUBELET_NODE);
        let publish_ro = entries.iter().find(|e| e.mount_id == 311);
        assert_eq!(publish_ro.map(MountEntry::is_read_only), Some(true));
        let publish_rw = entries.iter().find(|e| e.mount_id == 312);
        assert_eq!(publish_rw.map(MountEntry::is_read_only), Some(false));

        let ro_superblock = parsed("7 1 7:0 / /snap rw,relatime - squashfs /dev/loop0 ro\n");
        assert!(ro_superblock[0].is_read_only());
        assert!(!ro_superblock[0].has_read_only_flag());
    }

    #[test]
    fn accepts_empty_text_and_blank_lines() {
        assert_eq!(parsed(""), []);
        assert_eq!(parsed("\n7 1 0:5 / /x rw - tmpfs tmpfs rw\n\n").len(), 1);
    }

    #[test]
    fn rejects_a_line_without_separator() {
        let err = parse("22 1 8:1 / / rw,relatime shared:1 ext4 /dev/sda1 rw\n");
        assert!(
            matches!(err, Err(MountInfoError::Malformed { line: 1, reason, .. })
                if reason.contains("separator")),
            "{err:?}"
        );
    }

    #[test]
    fn rejects_missing_fields_after_separator() {
        let err = parse("7 1 0:5 / /x rw - tmpfs tmpfs rw\n8 7 0:6 / /y rw - tmpfs\n");
        assert!(matches!(err, Err(MountInfoError::Malformed { line: 2, .. })), "{err:?}");
    }

    #[test]
    fn rejects_non_numeric_ids_and_devices() {
        for text in [
            "x 1 0:5 / /x rw - tmpfs tmpfs rw",
            "7 -1 0:5 / /x rw - tmpfs tmpfs rw",
            "7 1 05 / /x rw - tmpfs tmpfs rw",
            "7 1 0:y / /x rw - tmpfs tmpfs rw",
        ] {
            assert!(matches!(parse(text), Err(MountInfoError::Malformed { .. })), "{text} must be rejected");
        }
    }

    #[test]
    fn reads_the_current_mount_table_with_a_root_mount() {
        let entries = match read_current() {
            Ok(entries) => entries,
            Err(e) => panic!("/proc/self/mountinfo must be readable on Linux: {e}"),
        };
        assert!(!mounts_at(&entries, Path::new("/")).is_empty());
    }
}
