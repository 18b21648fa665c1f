//! What a guest may write as a `dir` path: relative, `/`-separated, no empty, `.` or `..`
//! component, no NUL, no component longer than a file name, and no name the host reserves for
//! its own temporary files. Checked once, before anything is opened; opening is `root.rs`.
use crate::bindings::types::Error;
use std::path::{Path, PathBuf};

/// Longest guest path.
const MAX_PATH: usize = 4096;
/// Longest component (NAME_MAX).
pub const MAX_NAME: usize = 255;
/// Names the host gives its temporary files (see `temp.rs`); a guest can neither name one
/// nor see one in `read-dir`.
pub const RESERVED_PREFIX: &str = ".wasmcsi-";

/// A checked guest path; empty is the root itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestPath<'a>(&'a str);

impl<'a> GuestPath<'a> {
    /// Check `path`: invalid-argument for an absolute or oversized path or a NUL,
    /// permission-denied for a component that could leave the root or is reserved.
    pub fn parse(path: &'a str) -> Result<Self, Error> {
        if path.starts_with('/') || path.contains('\0') || path.len() > MAX_PATH {
            return Err(Error::InvalidArgument(format!(
                "path {:?} must be relative, without NUL, at most {MAX_PATH} bytes",
                clip(path)
            )));
        }
        if !path.is_empty() {
            for part in path.split('/') {
                if part.is_empty() || part == "." || part == ".." || part.len() > MAX_NAME {
                    return Err(Error::PermissionDenied(format!(
                        "path {:?}: component {:?} is not allowed",
                        clip(path),
                        clip(part)
                    )));
                }
                if part.starts_with(RESERVED_PREFIX) {
                    return Err(Error::PermissionDenied(format!(
                        "path {:?}: names starting with {RESERVED_PREFIX:?} are reserved for the host",
                        clip(path)
                    )));
                }
            }
        }
        Ok(Self(path))
    }

    pub fn as_str(self) -> &'a str {
        self.0
    }

    pub fn is_root(self) -> bool {
        self.0.is_empty()
    }

    pub fn components(self) -> impl Iterator<Item = &'a str> {
        self.0.split('/').filter(|p| !p.is_empty())
    }

    /// The directory holding the last component, and that component; `None` for the root.
    pub fn split_last(self) -> Option<(GuestPath<'a>, &'a str)> {
        if self.is_root() {
            return None;
        }
        Some(match self.0.rsplit_once('/') {
            Some((parent, name)) => (GuestPath(parent), name),
            None => (GuestPath(""), self.0),
        })
    }
}

/// A path for messages: guest paths can be 4 KiB; a message needs the start.
fn clip(s: &str) -> &str {
    const SHOWN: usize = 256;
    if s.len() <= SHOWN {
        return s;
    }
    let mut end = SHOWN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Map a guest path onto the host as a path name, refusing anything that could leave `root`
/// and any symlink on the way *now*. For callers that need a path name (the node's bind
/// mounts); the capability itself never uses it: a path checked here can be swapped for a
/// symlink before it is used, which is why `dir` opens everything beneath the root's fd.
pub fn resolve(root: &Path, path: &str) -> Result<PathBuf, Error> {
    let checked = GuestPath::parse(path)?;
    let mut full = root.to_path_buf();
    for part in checked.components() {
        full.push(part);
        match std::fs::symlink_metadata(&full) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Error::PermissionDenied(format!("path {path:?} crosses a symlink at {part:?}")));
            }
            Ok(_) => {}
            // Nothing beyond a missing component can be a symlink.
            Err(_) => {
                for rest in checked.components().skip_while(|p| *p != part).skip(1) {
                    full.push(rest);
                }
                return Ok(full);
            }
        }
    }
    Ok(full)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_refuses_escapes_and_symlinks() {
        let d = tempfile::tempdir().expect("tempdir");
        let root = d.path();
        assert!(matches!(resolve(root, "/etc"), Err(Error::InvalidArgument(_))));
        assert!(matches!(resolve(root, "a/../../etc"), Err(Error::PermissionDenied(_))));
        assert!(matches!(resolve(root, "missing/../x"), Err(Error::PermissionDenied(_))));
        assert!(matches!(resolve(root, "a//b"), Err(Error::PermissionDenied(_))));
        std::os::unix::fs::symlink("/etc", root.join("link")).expect("symlink");
        assert!(matches!(resolve(root, "link/passwd"), Err(Error::PermissionDenied(_))));
        assert!(matches!(resolve(root, "link"), Err(Error::PermissionDenied(_))));
        assert_eq!(resolve(root, "a/b").expect("plain path"), root.join("a/b"));
    }

    #[test]
    fn reserved_names_cannot_be_named() {
        assert!(matches!(GuestPath::parse("meta/.wasmcsi-write.1.2.x"), Err(Error::PermissionDenied(_))));
        assert!(matches!(GuestPath::parse(".wasmcsi-copy"), Err(Error::PermissionDenied(_))));
        assert!(GuestPath::parse("meta/.wasmcsi").is_ok(), "only the prefix with its dash is reserved");
    }

    #[test]
    fn split_last_names_parent_and_leaf() {
        let p = GuestPath::parse("a/b/c").expect("valid");
        assert_eq!(p.split_last().map(|(d, n)| (d.as_str(), n)), Some(("a/b", "c")));
        let p = GuestPath::parse("c").expect("valid");
        assert_eq!(p.split_last().map(|(d, n)| (d.as_str(), n)), Some(("", "c")));
        assert_eq!(GuestPath::parse("").expect("root").split_last(), None);
    }
}
