//! An in-memory file tree: what the fake `dir` roots and `nfs` exports hold. Paths are the
//! already-checked relative paths of the capabilities (`""` = the root), `/`-separated.
//! Semantics follow the host's: atomic whole-file writes, copies to a target that must not
//! exist, renames that never overwrite, `remove_all` of an absent path succeeding.
use crate::dir::{FileKind, FileStat};
use crate::types::{Error, Timestamp};
use std::collections::BTreeMap;

/// What `read-file` returns at most (as the host).
pub const MAX_READ: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Dir { mode: u32, uid: u32, gid: u32, modified: Timestamp },
    File { data: Vec<u8>, mode: u32, modified: Timestamp },
}

/// One root's (or export's) contents.
#[derive(Debug, Clone)]
pub struct Tree {
    nodes: BTreeMap<String, Node>,
}

impl Default for Tree {
    fn default() -> Self {
        let root = Node::Dir { mode: 0o755, uid: 0, gid: 0, modified: Timestamp { seconds: 0, nanos: 0 } };
        Self { nodes: BTreeMap::from([(String::new(), root)]) }
    }
}

/// The parent of a path; `None` for the root.
fn parent(path: &str) -> Option<&str> {
    if path.is_empty() { None } else { Some(path.rsplit_once('/').map_or("", |(p, _)| p)) }
}

/// Whether `path` is `base` or lies below it.
fn within(path: &str, base: &str) -> bool {
    base.is_empty() || path == base || path.strip_prefix(base).is_some_and(|rest| rest.starts_with('/'))
}

fn join(base: &str, rest: &str) -> String {
    match (base.is_empty(), rest.is_empty()) {
        (true, _) => rest.to_owned(),
        (false, true) => base.to_owned(),
        (false, false) => format!("{base}/{rest}"),
    }
}

impl Tree {
    fn is_dir(&self, path: &str) -> bool {
        matches!(self.nodes.get(path), Some(Node::Dir { .. }))
    }

    /// Paths of `base` and everything below it, in order.
    fn subtree(&self, base: &str) -> Vec<String> {
        self.nodes
            .range(base.to_owned()..)
            .map(|(k, _)| k)
            .take_while(|k| k.starts_with(base))
            .filter(|k| within(k, base))
            .cloned()
            .collect()
    }

    fn need_parent_dir(&self, path: &str, what: &str) -> Result<(), Error> {
        match parent(path) {
            Some(p) if self.is_dir(p) => Ok(()),
            _ => Err(Error::NotFound(format!("{what} {path:?}: parent directory missing"))),
        }
    }

    pub fn exists(&self, path: &str) -> bool {
        self.nodes.contains_key(path)
    }

    /// Every path in the tree but the root, in order (for test assertions).
    pub fn paths(&self) -> Vec<String> {
        self.nodes.keys().filter(|k| !k.is_empty()).cloned().collect()
    }

    pub fn mkdir(&mut self, path: &str, mode: u32, uid: u32, gid: u32, now: Timestamp) -> Result<(), Error> {
        let mut at = String::new();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            at = join(&at, part);
            match self.nodes.get(&at) {
                Some(Node::Dir { .. }) => {}
                Some(Node::File { .. }) => {
                    return Err(Error::AlreadyExists(format!("mkdir {path:?}: {at:?} is not a directory")));
                }
                None => {
                    self.nodes.insert(at.clone(), Node::Dir { mode: mode & 0o7777, uid, gid, modified: now });
                }
            }
        }
        Ok(())
    }

    pub fn stat(&self, path: &str) -> Option<FileStat> {
        self.nodes.get(path).map(|n| match n {
            Node::Dir { mode, uid, gid, modified } => FileStat {
                kind: FileKind::Directory,
                size: 4096,
                mode: *mode,
                uid: *uid,
                gid: *gid,
                modified: *modified,
            },
            Node::File { data, mode, modified } => FileStat {
                kind: FileKind::File,
                size: data.len() as u64,
                mode: *mode,
                uid: 0,
                gid: 0,
                modified: *modified,
            },
        })
    }

    pub fn read_dir(&self, path: &str) -> Result<Vec<String>, Error> {
        match self.nodes.get(path) {
            None => return Err(Error::NotFound(format!("read-dir {path:?}: no such directory"))),
            Some(Node::File { .. }) => {
                return Err(Error::InvalidArgument(format!("read-dir {path:?}: not a directory")));
            }
            Some(Node::Dir { .. }) => {}
        }
        let names = self
            .subtree(path)
            .into_iter()
            .filter(|k| parent(k) == Some(path))
            .map(|k| k.rsplit('/').next().unwrap_or_default().to_owned());
        Ok(names.collect())
    }

    pub fn read_file(&self, path: &str) -> Result<Vec<u8>, Error> {
        match self.nodes.get(path) {
            Some(Node::File { data, .. }) if data.len() <= MAX_READ => Ok(data.clone()),
            Some(_) => Err(Error::InvalidArgument(format!(
                "read-file {path:?}: not a regular file of at most {MAX_READ} bytes"
            ))),
            None => Err(Error::NotFound(format!("read-file {path:?}: no such file"))),
        }
    }

    pub fn write_file(&mut self, path: &str, data: &[u8], now: Timestamp) -> Result<(), Error> {
        self.need_parent_dir(path, "write-file")?;
        if self.is_dir(path) {
            return Err(Error::InvalidArgument(format!("write-file {path:?}: is a directory")));
        }
        self.nodes.insert(path.to_owned(), Node::File { data: data.to_vec(), mode: 0o600, modified: now });
        Ok(())
    }

    pub fn copy_tree(&mut self, from: &str, to: &str, now: Timestamp) -> Result<(), Error> {
        let what = format!("copy-tree {from:?} -> {to:?}");
        if self.exists(to) {
            return Err(Error::AlreadyExists(format!("{what}: target exists")));
        }
        if !self.exists(from) {
            return Err(Error::NotFound(format!("{what}: source missing")));
        }
        if within(to, from) {
            return Err(Error::InvalidArgument(format!("{what}: target inside the source")));
        }
        self.need_parent_dir(to, &what)?;
        for path in self.subtree(from) {
            let node = self.nodes[&path].clone();
            let copy = match node {
                // Copies keep modes, owners and data; their own time is the copy's.
                Node::Dir { mode, uid, gid, .. } => Node::Dir { mode, uid, gid, modified: now },
                Node::File { data, mode, .. } => Node::File { data, mode, modified: now },
            };
            self.nodes.insert(join(to, path[from.len()..].trim_start_matches('/')), copy);
        }
        Ok(())
    }

    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), Error> {
        let what = format!("rename {from:?} -> {to:?}");
        if from.is_empty() || within(to, from) {
            return Err(Error::InvalidArgument(format!("{what}: target inside the source")));
        }
        if !self.exists(from) {
            return Err(Error::NotFound(format!("{what}: source missing")));
        }
        if self.exists(to) {
            return Err(Error::AlreadyExists(format!("{what}: target exists")));
        }
        self.need_parent_dir(to, &what)?;
        for path in self.subtree(from) {
            if let Some(node) = self.nodes.remove(&path) {
                self.nodes.insert(join(to, path[from.len()..].trim_start_matches('/')), node);
            }
        }
        Ok(())
    }

    /// Remove a path and everything below it; absent succeeds. The caller refuses the root.
    pub fn remove_all(&mut self, path: &str) {
        for p in self.subtree(path) {
            self.nodes.remove(&p);
        }
    }

    /// Bytes of file data in a tree.
    pub fn usage(&self, path: &str) -> Result<u64, Error> {
        if !self.exists(path) {
            return Err(Error::NotFound(format!("usage {path:?}: no such file or directory")));
        }
        Ok(self
            .subtree(path)
            .iter()
            .map(|p| match &self.nodes[p] {
                Node::File { data, .. } => data.len() as u64,
                Node::Dir { .. } => 0,
            })
            .sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timestamp = Timestamp { seconds: 1, nanos: 0 };

    #[test]
    fn copies_and_renames_move_whole_subtrees_only() {
        let mut t = Tree::default();
        t.mkdir("a/b", 0o700, 1, 2, T).expect("mkdir");
        t.write_file("a/b/f", b"xyz", T).expect("write");
        t.mkdir("ab", 0o700, 0, 0, T).expect("a sibling sharing the prefix");
        t.copy_tree("a", "c", T).expect("copy");
        assert_eq!(t.read_file("c/b/f").expect("copied"), b"xyz");
        assert_eq!(t.stat("c/b").map(|s| (s.mode, s.uid, s.gid)), Some((0o700, 1, 2)));
        assert!(!t.exists("cb"), "the sibling ab was not copied");
        assert!(matches!(t.copy_tree("a", "c", T), Err(Error::AlreadyExists(_))));
        assert!(matches!(t.copy_tree("nope", "d", T), Err(Error::NotFound(_))));
        assert!(matches!(t.copy_tree("a", "x/y", T), Err(Error::NotFound(_))), "parent of the target missing");
        assert!(matches!(t.copy_tree("a", "a/b/z", T), Err(Error::InvalidArgument(_))));
        t.rename("c", "d").expect("rename");
        assert!(!t.exists("c") && t.exists("d/b/f"));
        assert!(matches!(t.rename("a", "d"), Err(Error::AlreadyExists(_))));
        assert_eq!(t.usage("").expect("usage"), 6);
        assert_eq!(t.read_dir("").expect("root"), ["a", "ab", "d"]);
        t.remove_all("a");
        assert_eq!(t.paths(), ["ab", "d", "d/b", "d/b/f"]);
        assert!(matches!(t.write_file("x/f", b"", T), Err(Error::NotFound(_))));
        assert!(matches!(t.mkdir("d/b/f/g", 0o700, 0, 0, T), Err(Error::AlreadyExists(_))));
    }
}
