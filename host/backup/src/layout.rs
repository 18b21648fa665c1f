//! Where everything lives on a target, relative to the target's root (a bucket + prefix, or a
//! directory). Each volume owns one prefix, and every operation on a volume lists only inside it:
//!
//! ```text
//! volumes/<volume>/backups/<backup>.json   one manifest per complete backup (written last)
//! volumes/<volume>/chunks/<hh>/<hash>      a chunk: 1 tag byte + zstd (or raw) data
//! volumes/<volume>/leases/<backup>.json    a backup in progress (renewed while it runs)
//! volumes/<volume>/gc.lock                 a garbage collection in progress (renewed)
//! ```
//!
//! `<volume>` is the volume's id with every byte outside `[A-Za-z0-9.-]` written `_xx` (hex), so
//! any CSI id (`replicated-block:pvc-…`) is one safe path component on every target, and the
//! encoding is reversible. `<hh>` is the hash's first byte: no directory of a filesystem target
//! grows past a few thousand entries.

use crate::chunk::ChunkHash;
use crate::error::Error;

/// The longest volume id or backup id accepted (encoded names stay under common 255-byte limits).
pub const MAX_NAME_LEN: usize = 80;

/// A volume id encoded as one path component (see the module docs).
pub fn encode_volume(volume: &str) -> Result<String, Error> {
    if volume.is_empty() || volume.len() > MAX_NAME_LEN {
        return Err(Error::Invalid(format!("volume id of {} bytes (1..={MAX_NAME_LEN})", volume.len())));
    }
    let mut out = String::with_capacity(volume.len());
    for b in volume.bytes() {
        if b.is_ascii_alphanumeric() || b == b'.' || b == b'-' {
            out.push(char::from(b));
        } else {
            out.push('_');
            out.push_str(&hex::encode([b]));
        }
    }
    // "." and ".." are path components with a meaning of their own.
    if out.bytes().all(|b| b == b'.') {
        return Err(Error::Invalid(format!("volume id {volume:?}")));
    }
    Ok(out)
}

/// The volume id back from its path component; `None` if it is not one [`encode_volume`] made.
pub fn decode_volume(component: &str) -> Option<String> {
    let bytes = component.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'_' {
            let pair = component.get(i + 1..i + 3)?;
            out.push(hex::decode(pair).ok()?.first().copied()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Checks a backup id: 1..=80 bytes of `[A-Za-z0-9._-]`, not starting with `.` (it names files).
pub fn check_backup_id(id: &str) -> Result<(), Error> {
    let ok = !id.is_empty()
        && id.len() <= MAX_NAME_LEN
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(Error::Invalid(format!("backup id {id:?}: 1..={MAX_NAME_LEN} of [A-Za-z0-9._-]"))) }
}

/// The keys of one volume.
#[derive(Clone, Debug)]
pub struct VolumeKeys {
    root: String,
}

pub const VOLUMES: &str = "volumes/";

impl VolumeKeys {
    pub fn new(volume: &str) -> Result<Self, Error> {
        Ok(Self { root: format!("{VOLUMES}{}/", encode_volume(volume)?) })
    }

    pub fn backups(&self) -> String {
        format!("{}backups/", self.root)
    }

    pub fn manifest(&self, backup: &str) -> String {
        format!("{}backups/{backup}.json", self.root)
    }

    /// The backup id of a key under [`Self::backups`].
    pub fn backup_of(&self, key: &str) -> Option<String> {
        let id = key.strip_prefix(&self.backups())?.strip_suffix(".json")?;
        check_backup_id(id).ok().map(|()| id.to_owned())
    }

    pub fn chunks(&self) -> String {
        format!("{}chunks/", self.root)
    }

    pub fn chunk(&self, hash: &ChunkHash) -> String {
        let hex = hash.to_string();
        format!("{}chunks/{}/{hex}", self.root, &hex[..2])
    }

    /// The hash of a key under [`Self::chunks`].
    pub fn chunk_of(&self, key: &str) -> Option<ChunkHash> {
        let rest = key.strip_prefix(&self.chunks())?;
        let (dir, name) = rest.split_once('/')?;
        let hash: ChunkHash = name.parse().ok()?;
        (name.get(..2) == Some(dir)).then_some(hash)
    }

    pub fn leases(&self) -> String {
        format!("{}leases/", self.root)
    }

    pub fn lease(&self, backup: &str) -> String {
        format!("{}leases/{backup}.json", self.root)
    }

    pub fn gc_lock(&self) -> String {
        format!("{}gc.lock", self.root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_encode_to_one_safe_component_and_back() {
        for id in ["pvc-1", "replicated-block:pvc-9f/x", "a_b", "ünï", "..x"] {
            let enc = encode_volume(id).expect("valid");
            assert!(enc.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)), "{enc}");
            assert_eq!(decode_volume(&enc).as_deref(), Some(id));
        }
        assert_eq!(encode_volume("replicated-block:pvc-1").expect("valid"), "replicated-block_3apvc-1");
        assert!(encode_volume("").is_err());
        assert!(encode_volume("..").is_err());
        assert!(encode_volume(&"x".repeat(81)).is_err());
    }

    #[test]
    fn keys_parse_back_and_reject_foreign_names() {
        let k = VolumeKeys::new("v:1").expect("valid");
        let h = ChunkHash::of(b"data");
        assert_eq!(k.chunk_of(&k.chunk(&h)), Some(h));
        assert_eq!(k.chunk_of(&format!("{}zz/{h}", k.chunks())), None);
        assert_eq!(k.backup_of(&k.manifest("b-1")).as_deref(), Some("b-1"));
        assert_eq!(k.backup_of(&format!("{}.tmp.json", k.backups())), None);
        assert!(check_backup_id("a/b").is_err());
        assert!(check_backup_id(".hidden").is_err());
    }
}
