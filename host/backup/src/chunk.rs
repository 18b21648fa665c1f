//! A chunk: its hash (BLAKE3 of the uncompressed bytes) and its stored form, one tag byte then the
//! bytes zstd-compressed, or raw when compression would not save anything (already compressed or
//! encrypted data costs no decompression on restore then).

use std::fmt;
use std::str::FromStr;

/// Stored form tags (the first byte of every chunk object).
const TAG_RAW: u8 = 0;
const TAG_ZSTD: u8 = 1;

/// A chunk's identity: BLAKE3 of its uncompressed bytes, written as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash([u8; 32]);

impl ChunkHash {
    pub fn of(data: &[u8]) -> Self {
        Self(*blake3::hash(data).as_bytes())
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({self})")
    }
}

impl FromStr for ChunkHash {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Lowercase only: one hash, one key.
        if s.len() != 64 || s.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(format!("not a chunk hash: {s:?}"));
        }
        let mut out = [0; 32];
        hex::decode_to_slice(s, &mut out).map_err(|e| format!("not a chunk hash: {s:?}: {e}"))?;
        Ok(Self(out))
    }
}

impl serde::Serialize for ChunkHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ChunkHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// True when every byte is zero: such a chunk is a hole, recorded by its absence, never stored.
pub fn is_zero(data: &[u8]) -> bool {
    // Compare 16-byte words: the compiler vectorizes this; a byte loop is several times slower.
    let (words, rest) = data.as_chunks::<16>();
    words.iter().all(|w| u128::from_ne_bytes(*w) == 0) && rest.iter().all(|b| *b == 0)
}

/// Bytes of each of the [`SAMPLES`] slices a chunk's compressibility is first judged on.
const SAMPLE: usize = 8 << 10;
const SAMPLES: usize = 4;

/// The stored form of `data` at zstd `level`.
///
/// Data that does not compress (already compressed files, encrypted volumes, random test data)
/// costs a compression of a 32 KiB sample, not of the whole chunk: four slices spread over the
/// chunk are compressed first, and if they save under 3 % the chunk is stored raw. On such data
/// this keeps a backup from being bound by compression on a node's spare core.
pub fn encode(data: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    let mut framed = Vec::with_capacity(1 + data.len());
    framed.push(TAG_RAW);
    framed.extend_from_slice(data);
    encode_framed(framed, level)
}

/// [`encode`] of `framed[1..]`, whose first byte is room for the tag: data stored raw is
/// returned in the same allocation, never copied.
pub fn encode_framed(framed: Vec<u8>, level: i32) -> std::io::Result<Vec<u8>> {
    let data = framed.get(1..).unwrap_or_default();
    if data.len() >= 4 * SAMPLE * SAMPLES {
        let step = data.len() / SAMPLES;
        let sample: Vec<u8> = (0..SAMPLES).flat_map(|i| &data[i * step..i * step + SAMPLE]).copied().collect();
        let n = zstd::bulk::compress(&sample, level)?.len();
        if n + n / 32 >= sample.len() {
            return Ok(raw(framed));
        }
    }
    let bound = zstd::zstd_safe::compress_bound(data.len());
    let mut out = vec![0; 1 + bound];
    out[0] = TAG_ZSTD;
    let n = zstd::bulk::compress_to_buffer(data, &mut out[1..], level)?;
    // Keep compression only where it pays for its decompression on restore.
    if n + n / 32 >= data.len() {
        return Ok(raw(framed));
    }
    out.truncate(1 + n);
    Ok(out)
}

fn raw(mut framed: Vec<u8>) -> Vec<u8> {
    if framed.is_empty() {
        framed.push(0);
    }
    framed[0] = TAG_RAW;
    framed
}

/// The largest stored form of a chunk of `len` bytes (the memory bound of the pipelines).
pub fn stored_bound(len: usize) -> usize {
    1 + zstd::zstd_safe::compress_bound(len).max(len)
}

/// The bytes back from their stored form, checked: exactly `len` bytes whose hash is `hash`.
pub fn decode(stored: &[u8], len: usize, hash: &ChunkHash) -> Result<Vec<u8>, String> {
    let (tag, body) = stored.split_first().ok_or("empty object")?;
    let data = match *tag {
        TAG_RAW => body.to_vec(),
        // The capacity bounds what a hostile object can make us allocate.
        TAG_ZSTD => zstd::bulk::decompress(body, len).map_err(|e| format!("zstd: {e}"))?,
        other => return Err(format!("unknown chunk encoding {other}")),
    };
    if data.len() != len {
        return Err(format!("{} bytes, the manifest says {len}", data.len()));
    }
    let actual = ChunkHash::of(&data);
    if actual != *hash {
        return Err(format!("content hashes to {actual}"));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_compressible_and_incompressible() {
        let text: Vec<u8> = b"wasmcsi backup ".iter().copied().cycle().take(1 << 16).collect();
        let mut noise = vec![0u8; 1 << 16];
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        for b in &mut noise {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        for (data, tag) in [(&text, TAG_ZSTD), (&noise, TAG_RAW)] {
            let stored = encode(data, 1).expect("encode");
            assert_eq!(stored[0], tag);
            assert!(stored.len() <= stored_bound(data.len()));
            let hash = ChunkHash::of(data);
            assert_eq!(&decode(&stored, data.len(), &hash).expect("decode"), data);
        }
        assert!(encode(&text, 1).expect("encode").len() < text.len() / 10);
    }

    #[test]
    fn incompressible_samples_store_raw_and_compressible_ones_compress() {
        let len = 1 << 20;
        let noise = {
            let mut x = 0x2545_f491_4f6c_dd1d_u64;
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect::<Vec<u8>>()
        };
        assert_eq!(encode(&noise, 1).expect("encode")[0], TAG_RAW);
        // Compressible everywhere but at the sample points is still judged by its samples.
        let mut text: Vec<u8> = b"0123456789abcdef".iter().copied().cycle().take(len).collect();
        let stored = encode(&text, 1).expect("encode");
        assert!(stored[0] == TAG_ZSTD && stored.len() < len / 50);
        text[..SAMPLE].copy_from_slice(&noise[..SAMPLE]);
        assert_eq!(encode(&text, 1).expect("encode")[0], TAG_ZSTD, "one noisy sample of four still compresses");
    }

    #[test]
    fn decode_rejects_a_flipped_bit_a_wrong_length_and_a_bomb() {
        let data = vec![7u8; 4096];
        let hash = ChunkHash::of(&data);
        let mut stored = encode(&data, 3).expect("encode");
        assert!(decode(&stored, 4095, &hash).is_err());
        let last = stored.len() - 1;
        stored[last] ^= 1;
        assert!(decode(&stored, 4096, &hash).is_err());
        let mut raw = vec![TAG_RAW];
        raw.extend_from_slice(&data);
        raw[100] = 8;
        assert!(decode(&raw, 4096, &hash).expect_err("flipped").contains("hashes to"));
        // 64 MiB of zeros compress to a few KiB; asking for 4 KiB must not inflate them.
        let bomb = encode(&vec![0u8; 64 << 20], 3).expect("encode");
        assert!(decode(&bomb, 4096, &hash).is_err());
    }

    #[test]
    fn zero_detection_and_hash_text() {
        assert!(is_zero(&[0; 4099]));
        let mut d = vec![0u8; 4099];
        d[4098] = 1;
        assert!(!is_zero(&d));
        d[4098] = 0;
        d[17] = 1;
        assert!(!is_zero(&d));
        let h = ChunkHash::of(b"x");
        assert_eq!(h.to_string().parse::<ChunkHash>(), Ok(h));
        assert!(h.to_string().to_uppercase().parse::<ChunkHash>().is_err());
    }
}
