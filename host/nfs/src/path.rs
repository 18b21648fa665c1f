//! Guest paths: checked by syntax here, before any traffic; the "no symlink on the way" half is
//! checked while walking (`client::Export::resolve`), since only the server knows what is a link.
use crate::NfsError;

/// Longest path accepted, as the `dir` capability.
pub const MAX_PATH: usize = 4096;
/// NAME_MAX of every server we talk to.
pub const MAX_COMPONENT: usize = 255;

/// A relative path split into components; empty means the export root.
#[derive(Debug, Clone)]
pub struct RelPath<'a> {
    pub raw: &'a str,
    pub parts: Vec<&'a str>,
}

impl<'a> RelPath<'a> {
    pub fn parse(raw: &'a str) -> Result<Self, NfsError> {
        if raw.starts_with('/') || raw.contains('\0') || raw.len() > MAX_PATH {
            return Err(NfsError::InvalidArgument(format!(
                "path {raw:?} must be relative, without NUL, at most {MAX_PATH} bytes"
            )));
        }
        if raw.is_empty() {
            return Ok(Self { raw, parts: Vec::new() });
        }
        let parts: Vec<&str> = raw.split('/').collect();
        for part in &parts {
            if part.is_empty() || *part == "." || *part == ".." || part.len() > MAX_COMPONENT {
                return Err(NfsError::InvalidArgument(format!(
                    "path {raw:?}: component {part:?} is not allowed (empty, `.`, `..` or over {MAX_COMPONENT} bytes)"
                )));
            }
        }
        Ok(Self { raw, parts })
    }

    /// Parent components and the last name; `None` for the root.
    pub fn split_last(&self) -> Option<(&[&'a str], &'a str)> {
        self.parts.split_last().map(|(last, parent)| (parent, *last))
    }

    /// Whether `self` is `other` or lies below it.
    pub fn starts_with(&self, other: &RelPath<'_>) -> bool {
        self.parts.len() >= other.parts.len() && self.parts.iter().zip(&other.parts).all(|(a, b)| a == b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_refuses_escapes_and_bad_components() {
        for bad in ["/etc", "a/../b", "..", ".", "a//b", "a/", "a\0b", &"x".repeat(256), &"a/".repeat(2049)] {
            assert!(matches!(RelPath::parse(bad), Err(NfsError::InvalidArgument(_))), "{bad:?} accepted");
        }
        assert!(RelPath::parse("").expect("root").parts.is_empty());
        let p = RelPath::parse("a/b/c").expect("plain");
        assert_eq!(p.split_last(), Some((&["a", "b"][..], "c")));
        assert!(p.starts_with(&RelPath::parse("a/b").expect("prefix")));
        assert!(!p.starts_with(&RelPath::parse("a/bc").expect("other")));
        assert!(RelPath::parse(&"x".repeat(255)).is_ok());
    }
}
