//! A credentials directory in the layout of a Kubernetes TLS Secret (as cert-manager writes it):
//! `ca.crt`, `tls.crt`, `tls.key`. Reading is bounded (a file larger than [`MAX_FILE_LEN`] is
//! refused before it is read); writing replaces the three files as one set.
//!
//! The set is replaced the way the kubelet updates a mounted Secret, so a directory we write and a
//! mounted Secret look and change alike:
//!
//! ```text
//! DIR/ca.crt  -> ..data/ca.crt        (symlinks, made once)
//! DIR/tls.crt -> ..data/tls.crt
//! DIR/tls.key -> ..data/tls.key
//! DIR/..data  -> ..2026_11_28_10_00_00.123456789_ab12   (replaced by one rename)
//! DIR/..2026_11_28_10_00_00.123456789_ab12/{ca.crt,tls.crt,tls.key}
//! ```
//!
//! A reader opening the three names one after another can still see two generations (the swap
//! can fall between two opens); the loader catches a mismatched key and certificate, and the
//! reloader reads again once the files settle.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, symlink};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use sha2::{Digest as _, Sha256};
use zeroize::Zeroizing;

pub const CA_FILE: &str = "ca.crt";
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";
/// The three files of a set, in the order they are read and hashed.
pub const FILES: [&str; 3] = [CA_FILE, CERT_FILE, KEY_FILE];
/// The largest file read: a CA bundle of a few dozen certificates fits many times over.
pub const MAX_FILE_LEN: u64 = 1 << 20;

/// The symlink naming the current generation, as the kubelet names it.
const DATA_LINK: &str = "..data";

#[derive(Debug, thiserror::Error)]
pub enum SecretDirError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path} is {len} bytes, more than the {MAX_FILE_LEN} a credentials file may be")]
    TooLarge { path: PathBuf, len: u64 },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

/// The contents of one set. The key's bytes are wiped when the set is dropped.
pub struct SecretFiles {
    pub ca: Vec<u8>,
    pub cert: Vec<u8>,
    pub key: Zeroizing<Vec<u8>>,
}

impl SecretFiles {
    /// SHA-256 over the three files, each length-prefixed (so moving bytes from one file to the
    /// next changes it).
    pub fn hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for part in [&self.ca[..], &self.cert[..], &self.key[..]] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.finalize().into()
    }
}

/// What `stat` says of the three files (through their symlinks): device, inode, size and
/// modification time of each. A changed fingerprint is the reloader's cue to read the contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint([(u64, u64, u64, i64, i64); 3]);

pub fn fingerprint(dir: &Path) -> Result<Fingerprint, SecretDirError> {
    let mut out = [(0, 0, 0, 0, 0); 3];
    for (slot, name) in out.iter_mut().zip(FILES) {
        let path = dir.join(name);
        let m = fs::metadata(&path).map_err(|source| SecretDirError::Read { path, source })?;
        *slot = (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec());
    }
    Ok(Fingerprint(out))
}

/// Reads the three files of `dir`.
pub fn read(dir: &Path) -> Result<SecretFiles, SecretDirError> {
    Ok(SecretFiles {
        ca: read_bounded(&dir.join(CA_FILE))?,
        cert: read_bounded(&dir.join(CERT_FILE))?,
        key: Zeroizing::new(read_bounded(&dir.join(KEY_FILE))?),
    })
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, SecretDirError> {
    let read_err = |source| SecretDirError::Read { path: path.to_owned(), source };
    let file = File::open(path).map_err(read_err)?;
    let len = file.metadata().map_err(read_err)?.len();
    if len > MAX_FILE_LEN {
        return Err(SecretDirError::TooLarge { path: path.to_owned(), len });
    }
    let mut buf = Vec::with_capacity(len as usize);
    // The file may grow between the stat and the read: never read past the bound.
    file.take(MAX_FILE_LEN + 1).read_to_end(&mut buf).map_err(read_err)?;
    if buf.len() as u64 > MAX_FILE_LEN {
        return Err(SecretDirError::TooLarge { path: path.to_owned(), len: buf.len() as u64 });
    }
    Ok(buf)
}

/// Writes `files` into `dir` as one set (see the module doc), creating `dir` (mode 0700) if
/// needed. `tls.key` is created with mode 0600 and never exists with wider permissions; the
/// certificates are 0644. Earlier generations are removed once the new one is in place.
pub fn write(dir: &Path, files: &SecretFiles) -> Result<(), SecretDirError> {
    let werr = |path: &Path| {
        let path = path.to_owned();
        move |source| SecretDirError::Write { path, source }
    };
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(werr(dir))?;

    let generation = generation_name();
    let gen_dir = dir.join(&generation);
    fs::DirBuilder::new().mode(0o755).create(&gen_dir).map_err(werr(&gen_dir))?;
    for (name, contents, mode) in
        [(CA_FILE, &files.ca[..], 0o644), (CERT_FILE, &files.cert[..], 0o644), (KEY_FILE, &files.key[..], 0o600)]
    {
        let path = gen_dir.join(name);
        let mut f = OpenOptions::new().write(true).create_new(true).mode(mode).open(&path).map_err(werr(&path))?;
        f.write_all(contents).map_err(werr(&path))?;
        f.sync_all().map_err(werr(&path))?;
    }
    File::open(&gen_dir).and_then(|d| d.sync_all()).map_err(werr(&gen_dir))?;

    // The one step that switches every reader to the new set.
    replace_with_symlink(dir, DATA_LINK, Path::new(&generation))?;
    for name in FILES {
        let target = Path::new(DATA_LINK).join(name);
        let current = dir.join(name);
        if fs::read_link(&current).is_ok_and(|t| t == target) {
            continue;
        }
        replace_with_symlink(dir, name, &target)?;
    }
    File::open(dir).and_then(|d| d.sync_all()).map_err(werr(dir))?;

    // Earlier generations: every `..NAME` directory but the current one.
    let entries = fs::read_dir(dir).map_err(werr(dir))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && name.starts_with("..") && name != generation {
            let path = entry.path();
            fs::remove_dir_all(&path).map_err(werr(&path))?;
        }
    }
    Ok(())
}

/// Points `dir/name` at `target` atomically: a symlink made beside it, renamed over it.
fn replace_with_symlink(dir: &Path, name: &str, target: &Path) -> Result<(), SecretDirError> {
    let tmp = dir.join(format!("{name}.tmp-link"));
    let werr = |path: &Path| {
        let path = path.to_owned();
        move |source| SecretDirError::Write { path, source }
    };
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(werr(&tmp)(e)),
    }
    symlink(target, &tmp).map_err(werr(&tmp))?;
    let path = dir.join(name);
    fs::rename(&tmp, &path).map_err(werr(&path))
}

/// `..YYYY_MM_DD_HH_MM_SS.NANOS_RAND`: sortable like the kubelet's and unique per call.
fn generation_name() -> String {
    let t = time::OffsetDateTime::from(SystemTime::now());
    let mut rand = [0u8; 4];
    // A failed random fill only makes the name less unique; the nanoseconds already are.
    let _ = crate::provider::provider().secure_random.fill(&mut rand);
    format!(
        "..{:04}_{:02}_{:02}_{:02}_{:02}_{:02}.{:09}_{:08x}",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.nanosecond(),
        u32::from_le_bytes(rand)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn set(tag: &str) -> SecretFiles {
        SecretFiles {
            ca: format!("ca {tag}").into_bytes(),
            cert: format!("cert {tag}").into_bytes(),
            key: Zeroizing::new(format!("key {tag}").into_bytes()),
        }
    }

    #[test]
    fn a_written_set_reads_back_with_the_key_private() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("creds");
        write(&dir, &set("one")).expect("write");
        let back = read(&dir).expect("read");
        assert_eq!(back.hash(), set("one").hash());
        let key_mode = fs::metadata(dir.join(KEY_FILE)).expect("stat").permissions().mode() & 0o777;
        assert_eq!(key_mode, 0o600);
        let cert_mode = fs::metadata(dir.join(CERT_FILE)).expect("stat").permissions().mode() & 0o777;
        assert_eq!(cert_mode, 0o644);
        assert_eq!(fs::metadata(&dir).expect("stat").permissions().mode() & 0o777, 0o700);
    }

    #[test]
    fn rewriting_swaps_the_set_and_removes_the_old_generation() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        write(dir, &set("one")).expect("write");
        let before = fingerprint(dir).expect("fingerprint");
        write(dir, &set("two")).expect("rewrite");
        assert_ne!(fingerprint(dir).expect("fingerprint"), before);
        assert_eq!(read(dir).expect("read").hash(), set("two").hash());
        let generations: Vec<String> = fs::read_dir(dir)
            .expect("list")
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        assert_eq!(generations.len(), 1, "{generations:?}");
        for name in FILES {
            assert_eq!(fs::read_link(dir.join(name)).expect("symlink"), Path::new(DATA_LINK).join(name));
        }
    }

    #[test]
    fn plain_files_are_replaced_by_the_symlinked_layout() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for name in FILES {
            fs::write(tmp.path().join(name), b"old").expect("plain file");
        }
        write(tmp.path(), &set("new")).expect("write over plain files");
        assert_eq!(read(tmp.path()).expect("read").hash(), set("new").hash());
    }

    #[test]
    fn an_oversized_file_is_refused_unread() {
        let tmp = tempfile::tempdir().expect("tempdir");
        write(tmp.path(), &set("x")).expect("write");
        let big = tmp.path().join("big");
        fs::write(&big, vec![b'a'; MAX_FILE_LEN as usize + 1]).expect("big file");
        assert!(matches!(read_bounded(&big), Err(SecretDirError::TooLarge { .. })));
    }

    #[test]
    fn hash_tells_apart_bytes_moved_between_files() {
        let a = SecretFiles { ca: b"ab".to_vec(), cert: b"c".to_vec(), key: Zeroizing::new(Vec::new()) };
        let b = SecretFiles { ca: b"a".to_vec(), cert: b"bc".to_vec(), key: Zeroizing::new(Vec::new()) };
        assert_ne!(a.hash(), b.hash());
    }

    #[test]
    fn a_missing_file_names_its_path() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let err = read(tmp.path()).err().expect("nothing there");
        assert!(err.to_string().contains("ca.crt"), "{err}");
    }
}
