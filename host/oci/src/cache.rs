//! The content-addressed cache of pulled artifacts, in the host's state directory:
//!
//! ```text
//! ROOT/manifests/HEX        a manifest, by the sha256 of its bytes
//! ROOT/blobs/HEX            a layer (the component), by the sha256 of its bytes
//! ROOT/signatures/HEX.json  the signature layers that verified for manifest HEX
//! ROOT/tmp/                 files being written
//! ```
//!
//! Every file is written under `tmp/`, synced and renamed into place, so a crash or a refused
//! download never leaves a partial file where a reader looks; every read is checked against the
//! digest it is named by again (a disk or a person may have changed it), and a file that fails
//! is removed and counts as absent.
use crate::error::OciError;
use serde::{Deserialize, Serialize};
use std::io::Write as _;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct ArtifactCache {
    root: PathBuf,
}

/// A signature layer that verified: its payload and annotation value, kept so a restart with
/// the registry down still loads a signed artifact (re-verified against the keys in force).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CachedSignature {
    pub payload: String,
    pub signature: String,
}

impl ArtifactCache {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn err(path: &Path) -> impl FnOnce(std::io::Error) -> OciError + '_ {
        move |source| OciError::Cache { path: path.into(), source }
    }

    fn hex(digest: &str) -> &str {
        digest.strip_prefix("sha256:").unwrap_or(digest)
    }

    pub fn manifest_path(&self, digest: &str) -> PathBuf {
        self.root.join("manifests").join(Self::hex(digest))
    }

    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.root.join("blobs").join(Self::hex(digest))
    }

    fn signatures_path(&self, digest: &str) -> PathBuf {
        self.root.join("signatures").join(format!("{}.json", Self::hex(digest)))
    }

    /// The file at `path` when its sha256 is `digest`; a file that is not is removed.
    fn read_verified(path: &Path, digest: &str) -> Result<Option<Vec<u8>>, OciError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Self::err(path)(e)),
        };
        if crate::sha256_digest(&bytes) != digest {
            tracing::warn!(file = %path.display(), %digest, "cached file does not match its digest; removed");
            std::fs::remove_file(path).map_err(Self::err(path))?;
            return Ok(None);
        }
        Ok(Some(bytes))
    }

    pub fn manifest(&self, digest: &str) -> Result<Option<Vec<u8>>, OciError> {
        Self::read_verified(&self.manifest_path(digest), digest)
    }

    pub fn blob(&self, digest: &str) -> Result<Option<Vec<u8>>, OciError> {
        Self::read_verified(&self.blob_path(digest), digest)
    }

    /// A temporary file in the cache's filesystem, removed when dropped uncommitted.
    pub fn temp_file(&self) -> Result<tempfile::NamedTempFile, OciError> {
        let tmp = self.root.join("tmp");
        std::fs::create_dir_all(&tmp).map_err(Self::err(&tmp))?;
        tempfile::NamedTempFile::new_in(&tmp).map_err(Self::err(&tmp))
    }

    /// Move a complete, verified temporary file to `path`.
    fn commit(&self, file: tempfile::NamedTempFile, path: &Path) -> Result<(), OciError> {
        file.as_file().sync_all().map_err(Self::err(path))?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(Self::err(parent))?;
        }
        file.persist(path).map_err(|e| OciError::Cache { path: path.into(), source: e.error })?;
        Ok(())
    }

    /// Put a verified blob (its bytes in `file`) in place.
    pub fn commit_blob(&self, file: tempfile::NamedTempFile, digest: &str) -> Result<PathBuf, OciError> {
        let path = self.blob_path(digest);
        self.commit(file, &path)?;
        Ok(path)
    }

    fn write(&self, path: &Path, bytes: &[u8]) -> Result<(), OciError> {
        let mut file = self.temp_file()?;
        file.write_all(bytes).map_err(Self::err(path))?;
        self.commit(file, path)
    }

    pub fn put_manifest(&self, digest: &str, bytes: &[u8]) -> Result<(), OciError> {
        self.write(&self.manifest_path(digest), bytes)
    }

    /// The signature layers kept for manifest `digest` (none when the file is unreadable: they
    /// are fetched again).
    pub fn signatures(&self, digest: &str) -> Vec<CachedSignature> {
        std::fs::read(self.signatures_path(digest))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    pub fn put_signatures(&self, digest: &str, signatures: &[CachedSignature]) -> Result<(), OciError> {
        let json = serde_json::to_vec(signatures).unwrap_or_default();
        self.write(&self.signatures_path(digest), &json)
    }

    /// Every file under the cache's content directories (not `tmp/`), for tests and `ls`.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut out = vec![];
        for dir in ["manifests", "blobs", "signatures", "tmp"] {
            if let Ok(entries) = std::fs::read_dir(self.root.join(dir)) {
                out.extend(entries.filter_map(Result::ok).map(|e| e.path()));
            }
        }
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn reads_are_verified_and_a_changed_file_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ArtifactCache::new(dir.path());
        let d = crate::sha256_digest(b"manifest");
        assert_eq!(cache.manifest(&d).unwrap(), None);
        cache.put_manifest(&d, b"manifest").unwrap();
        assert_eq!(cache.manifest(&d).unwrap().as_deref(), Some(&b"manifest"[..]));
        std::fs::write(cache.manifest_path(&d), b"changed").unwrap();
        assert_eq!(cache.manifest(&d).unwrap(), None);
        assert!(!cache.manifest_path(&d).exists());
        // A temporary file dropped uncommitted leaves nothing.
        drop(cache.temp_file().unwrap());
        assert_eq!(cache.files(), Vec::<PathBuf>::new());
    }
}
