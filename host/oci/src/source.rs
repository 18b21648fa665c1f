//! `oci://REGISTRY/REPO(:TAG|@sha256:HEX)`: where a backend comes from. A digest pins the
//! bytes; a tag is a name the registry may point elsewhere tomorrow, so the configuration takes
//! one only with an explicit opt-in, and it is resolved to a digest before anything is pulled.
use crate::error::OciError;
use std::fmt;

const SCHEME: &str = "oci://";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// `host[:port]`
    pub registry: String,
    /// `path/to/repo`
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`
    pub digest: Option<String>,
}

impl Source {
    pub fn parse(text: &str) -> Result<Self, OciError> {
        let bad = |why: &str| OciError::Source { reference: text.into(), why: why.into() };
        let rest = text.strip_prefix(SCHEME).ok_or_else(|| bad("it must start with oci://"))?;
        let (registry, path) = rest.split_once('/').ok_or_else(|| bad("no repository after the registry"))?;
        if registry.is_empty() || registry.contains(['@', ' ']) {
            return Err(bad("no registry host"));
        }
        let (path, digest) = match path.split_once('@') {
            Some((p, d)) => (p, Some(d.to_string())),
            None => (path, None),
        };
        // A tag is after the last ':' of the last path segment (a registry port is not in `path`).
        let last = path.rsplit('/').next().unwrap_or(path);
        let (repository, tag) = match last.rsplit_once(':') {
            Some((_, t)) => (&path[..path.len() - t.len() - 1], Some(t.to_string())),
            None => (path, None),
        };
        if repository.is_empty()
            || !repository.split('/').all(|seg| {
                !seg.is_empty()
                    && seg.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
            })
        {
            return Err(bad("the repository is lowercase [a-z0-9._-] segments separated by /"));
        }
        if let Some(t) = &tag
            && (t.is_empty() || t.len() > 128 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
        {
            return Err(bad("a tag is 1-128 of [A-Za-z0-9._-]"));
        }
        if let Some(d) = &digest
            && !is_sha256_digest(d)
        {
            return Err(bad("a digest is sha256: and 64 lowercase hex digits"));
        }
        if tag.is_none() && digest.is_none() {
            return Err(bad("neither a tag nor a digest"));
        }
        Ok(Self { registry: registry.into(), repository: repository.into(), tag, digest })
    }

    /// The same repository, pinned to `digest` (the tag dropped).
    pub fn at_digest(&self, digest: &str) -> Self {
        Self { digest: Some(digest.into()), tag: None, ..self.clone() }
    }

    /// The same repository at `tag`.
    pub fn at_tag(&self, tag: &str) -> Self {
        Self { tag: Some(tag.into()), digest: None, ..self.clone() }
    }

    /// `REGISTRY/REPO`, as cosign's payload names it.
    pub fn repository_reference(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    pub(crate) fn reference(&self) -> oci_client::Reference {
        match (&self.digest, &self.tag) {
            (Some(d), _) => {
                oci_client::Reference::with_digest(self.registry.clone(), self.repository.clone(), d.clone())
            }
            (None, Some(t)) => {
                oci_client::Reference::with_tag(self.registry.clone(), self.repository.clone(), t.clone())
            }
            // `parse` refuses a source with neither.
            (None, None) => {
                oci_client::Reference::with_tag(self.registry.clone(), self.repository.clone(), "latest".into())
            }
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SCHEME}{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// `sha256:` and 64 lowercase hex digits.
pub fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn sources_parse_with_ports_tags_and_digests_and_print_back() {
        let s = Source::parse(&format!("oci://127.0.0.1:5000/team/nfs@{D}")).unwrap();
        assert_eq!(
            (s.registry.as_str(), s.repository.as_str(), s.tag.as_deref()),
            ("127.0.0.1:5000", "team/nfs", None)
        );
        assert_eq!(s.digest.as_deref(), Some(D));
        let t = Source::parse("oci://reg.example/nfs:v1.2").unwrap();
        assert_eq!((t.repository.as_str(), t.tag.as_deref()), ("nfs", Some("v1.2")));
        for text in [
            format!("oci://127.0.0.1:5000/team/nfs@{D}"),
            "oci://reg.example/a/b:v1".into(),
            format!("oci://r/a:t@{D}"),
        ] {
            assert_eq!(Source::parse(&text).unwrap().to_string(), text);
        }
        assert_eq!(t.at_digest(D).to_string(), format!("oci://reg.example/nfs@{D}"));
    }

    #[test]
    fn malformed_sources_are_refused_saying_why() {
        for bad in [
            "https://reg/nfs:v1",
            "oci://reg",
            "oci://reg/nfs",
            "oci://reg/NFS:v1",
            "oci://reg/nfs@sha256:abc",
            "oci://reg/nfs@md5:0123",
            "oci:///nfs:v1",
            "oci://reg//nfs:v1",
        ] {
            assert!(matches!(Source::parse(bad), Err(OciError::Source { .. })), "{bad}");
        }
    }
}
