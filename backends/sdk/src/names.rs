//! Names and ids. CSI names (a PV, a VolumeSnapshot) are up to 128 bytes of almost any Unicode;
//! a backend's own ids travel as `BACKEND:ID` within CSI's 128 bytes, so an id is at most
//! [`MAX_ID_BYTES`] of `[A-Za-z0-9._-]` (the WIT's `volume` record says so and the host checks
//! it). [`local_name`] maps any CSI-valid name onto such a string: a readable, sanitized part
//! of the name plus a hash of all of it; [`stable_name`] does the same but keeps a name that is
//! already a safe local name as it is (backends whose ids and paths predate the mapping).
use crate::types::Error;
use sha2::{Digest, Sha256};

/// CSI's limit on a name (and on an id).
pub const MAX_NAME_BYTES: usize = 128;
/// Longest backend-local id: `BACKEND:ID` must fit CSI's 128 bytes.
pub const MAX_ID_BYTES: usize = 95;
/// Hex digits of [`name_hash`]: 64 bits, so two names meeting is negligible (about one in
/// 10^19 per pair; a billion names give one chance in 30 million).
pub const HASH_HEX: usize = 16;

/// Whether CSI allows `c` in a name: the spec bans the C0 and C1 control characters except
/// tab, line feed and carriage return (U+0000–U+0008, U+000B, U+000C, U+000E–U+001F,
/// U+007F–U+009F).
pub fn is_csi_char(c: char) -> bool {
    !matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{7f}'..='\u{9f}')
}

/// A CSI name: 1 to 128 bytes of allowed characters. Errors: invalid-argument naming `what`.
pub fn check_csi_name(what: &str, name: &str) -> Result<(), Error> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(Error::InvalidArgument(format!(
            "{what} name is {} bytes; CSI allows 1 to {MAX_NAME_BYTES}",
            name.len()
        )));
    }
    if let Some(c) = name.chars().find(|c| !is_csi_char(*c)) {
        return Err(Error::InvalidArgument(format!(
            "{what} name {name:?} contains control character U+{:04X}",
            c as u32
        )));
    }
    Ok(())
}

/// Whether a byte may appear in a backend-local id.
pub fn is_id_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// A backend-local id: 1 to [`MAX_ID_BYTES`] of `[A-Za-z0-9._-]`.
pub fn is_local_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_BYTES && id.bytes().all(is_id_byte)
}

/// The first [`HASH_HEX`] hex digits (lowercase) of sha256(`name`).
pub fn name_hash(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    digest.iter().take(HASH_HEX / 2).map(|b| format!("{b:02x}")).collect()
}

/// A deterministic backend-local name for any CSI name: `READABLE-HASH`, at most `max_bytes`
/// (at least [`HASH_HEX`] are always used) of `[A-Za-z0-9._-]`, starting with a letter, digit
/// or `_` (never `.` or `-`: no hidden file, no `..`, nothing a command line reads as an
/// option). READABLE is the name with every run of other characters turned into one `-`,
/// cut to fit; HASH is [`name_hash`] of the whole name, so names that read alike (`a/b`, `a:b`)
/// still differ. Every name is mapped, valid ids too: a name can never meet another's output.
///
/// ```
/// use wasmcsi_backend_sdk::names::{local_name, MAX_ID_BYTES};
/// let n = local_name("pvc-0b9a1c2d/Données ✓", MAX_ID_BYTES);
/// assert!(n.starts_with("pvc-0b9a1c2d-Donn-es-"), "{n}");
/// assert_eq!(n, local_name("pvc-0b9a1c2d/Données ✓", MAX_ID_BYTES));
/// assert_ne!(n, local_name("pvc-0b9a1c2d:Données ✓", MAX_ID_BYTES));
/// ```
pub fn local_name(name: &str, max_bytes: usize) -> String {
    local_name_in(name, max_bytes, is_id_byte)
}

/// [`local_name`] over a narrower alphabet: READABLE keeps only the ASCII bytes `keep` accepts
/// (a subset of [`is_id_byte`]; e.g. without `_` where a backend separates id parts with it).
pub fn local_name_in(name: &str, max_bytes: usize, keep: fn(u8) -> bool) -> String {
    let hash = name_hash(name);
    let mut readable = String::with_capacity(name.len());
    for c in name.chars() {
        if c.is_ascii() && is_id_byte(c as u8) && keep(c as u8) {
            readable.push(c);
        } else if !readable.ends_with('-') {
            readable.push('-');
        }
    }
    // One byte goes to the separator.
    let room = max_bytes.max(HASH_HEX).saturating_sub(HASH_HEX + 1);
    let readable = readable.trim_start_matches(['.', '-']);
    // ASCII only: any byte index is a char boundary.
    let readable = readable[..readable.len().min(room)].trim_end_matches(['.', '-']);
    if readable.is_empty() { hash } else { format!("{readable}-{hash}") }
}

/// Whether `s` has the shape of a hashed name: [`HASH_HEX`] lowercase hex digits, alone or
/// after a `-`.
fn is_hash_shaped(s: &str) -> bool {
    let b = s.as_bytes();
    let Some(at) = b.len().checked_sub(HASH_HEX) else { return false };
    let hex = b[at..].iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c));
    hex && (at == 0 || b[at - 1] == b'-')
}

/// A deterministic backend-local name that keeps plain names: a name of 1 to `max_bytes` bytes
/// that `keep` accepts (a subset of [`is_id_byte`]), not starting with `.` or `-` and not
/// shaped like a hashed name, is its own local name; any other name gets
/// [`local_name_in`]`(name, max_bytes, keep)`. Hashed names always end in [`HASH_HEX`] hex
/// digits alone or after a `-` and plain names never do, so no two names meet. For backends
/// that named directories and ids after the CSI name before any name was allowed: every name
/// they accepted then maps to itself now.
///
/// ```
/// use wasmcsi_backend_sdk::names::{is_id_byte, name_hash, stable_name, MAX_ID_BYTES};
/// assert_eq!(stable_name("pvc-0b9a1c2d", MAX_ID_BYTES, is_id_byte), "pvc-0b9a1c2d");
/// let n = stable_name("Données", MAX_ID_BYTES, is_id_byte);
/// assert_eq!(n, format!("Donn-es-{}", name_hash("Données")));
/// // A plain name shaped like a hashed one is hashed too.
/// assert_ne!(stable_name(&n, MAX_ID_BYTES, is_id_byte), n);
/// ```
pub fn stable_name(name: &str, max_bytes: usize, keep: fn(u8) -> bool) -> String {
    let plain = !name.is_empty()
        && name.len() <= max_bytes
        && !name.starts_with(['.', '-'])
        && name.bytes().all(|b| is_id_byte(b) && keep(b))
        && !is_hash_shaped(name);
    if plain { name.to_owned() } else { local_name_in(name, max_bytes, keep) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A small deterministic generator (xorshift64*): the same names on every run.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Characters from every class that matters: the id alphabet, separators and punctuation
    /// that sanitize alike, the control characters CSI allows, Latin-1, CJK, emoji.
    const ALPHABET: &[char] = &[
        'a',
        'b',
        'Z',
        '0',
        '9',
        '.',
        '_',
        '-',
        '/',
        ':',
        ' ',
        '@',
        '%',
        '\t',
        '\n',
        '\r',
        'é',
        'ß',
        '中',
        '文',
        '✓',
        '🦀',
        '\u{a0}',
        '\u{200b}',
        '\u{10ffff}',
    ];

    fn random_name(rng: &mut Rng) -> String {
        let mut s = String::new();
        let len = 1 + rng.below(60);
        while s.chars().count() < len {
            let c = ALPHABET[rng.below(ALPHABET.len())];
            if s.len() + c.len_utf8() > MAX_NAME_BYTES {
                break;
            }
            s.push(c);
        }
        s
    }

    fn assert_valid(name: &str, out: &str, max: usize) {
        assert!(out.len() <= max.max(HASH_HEX), "{name:?} -> {out:?}: {} bytes", out.len());
        assert!(!out.is_empty() && out.bytes().all(is_id_byte), "{name:?} -> {out:?}");
        assert!(!out.starts_with(['.', '-']), "{name:?} -> {out:?}");
        assert!(out.ends_with(&name_hash(name)), "{name:?} -> {out:?}");
    }

    #[test]
    fn many_names_map_to_valid_distinct_deterministic_ids() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        // (max_bytes, output) -> the name that produced it
        let mut seen: HashMap<(usize, String), String> = HashMap::new();
        let mut names = std::collections::HashSet::new();
        for i in 0..40_000 {
            let name = match i % 5 {
                // names that sanitize to the same readable part
                0 => format!("pvc{}x{}", ["/", ":", " ", "é", "🦀", "//", "\t"][rng.below(7)], rng.below(1000)),
                _ => random_name(&mut rng),
            };
            check_csi_name("volume", &name).expect("generated names are CSI-valid");
            for max in [MAX_ID_BYTES, 48, HASH_HEX + 2, HASH_HEX] {
                let out = local_name(&name, max);
                assert_valid(&name, &out, max);
                assert_eq!(out, local_name(&name, max), "deterministic");
                if max == MAX_ID_BYTES {
                    assert!(is_local_id(&out), "{name:?} -> {out:?}");
                }
                if let Some(other) = seen.insert((max, out.clone()), name.clone()) {
                    assert_eq!(other, name, "{other:?} and {name:?} both map to {out:?}");
                }
            }
            names.insert(name);
        }
        assert!(names.len() > 30_000, "the generator repeats itself too much: {}", names.len());
    }

    #[test]
    fn readable_part_keeps_the_safe_characters_and_fits() {
        let long = "a".repeat(MAX_NAME_BYTES);
        let out = local_name(&long, MAX_ID_BYTES);
        assert_eq!(out.len(), MAX_ID_BYTES);
        assert_eq!(out, format!("{}-{}", "a".repeat(MAX_ID_BYTES - HASH_HEX - 1), name_hash(&long)));
        assert_eq!(local_name("pvc-1", MAX_ID_BYTES), format!("pvc-1-{}", name_hash("pvc-1")));
        assert_eq!(local_name("..", MAX_ID_BYTES), name_hash(".."), "nothing readable is left");
        assert_eq!(local_name("-rf /", MAX_ID_BYTES), format!("rf-{}", name_hash("-rf /")));
        assert_eq!(local_name("中文", MAX_ID_BYTES), name_hash("中文"));
        assert_eq!(local_name("pvc-1", HASH_HEX + 1), name_hash("pvc-1"), "no room for more than the hash");
        assert_eq!(local_name("pvc-1", 0), name_hash("pvc-1"), "the hash is always whole");
    }

    #[test]
    fn csi_names_are_checked_for_length_and_control_characters() {
        for ok in ["a", "pvc-1", "tab\there", "line\nfeed", "cr\r", "中文", &"a".repeat(128)] {
            assert!(check_csi_name("volume", ok).is_ok(), "{ok:?}");
        }
        let too_long = "a".repeat(129);
        for bad in
            ["", too_long.as_str(), "nul\0", "bell\u{7}", "vt\u{b}", "ff\u{c}", "esc\u{1b}", "del\u{7f}", "c1\u{9f}"]
        {
            assert!(matches!(check_csi_name("volume", bad), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
        assert!(is_csi_char('\u{a0}'), "U+00A0 is past the C1 block");
    }

    #[test]
    fn stable_names_keep_plain_names_and_never_meet_hashed_ones() {
        let no_underscore = |b: u8| b != b'_';
        assert_eq!(stable_name("pvc-1", MAX_ID_BYTES, is_id_byte), "pvc-1");
        assert_eq!(stable_name("a_b", MAX_ID_BYTES, is_id_byte), "a_b");
        assert_eq!(stable_name("a_b", MAX_ID_BYTES, no_underscore), format!("a-b-{}", name_hash("a_b")));
        let long = "a".repeat(MAX_ID_BYTES + 1);
        assert_eq!(stable_name(&long, MAX_ID_BYTES, is_id_byte), local_name(&long, MAX_ID_BYTES));
        for hashed in [".x", "-x", "a b", "中文", "x-0123456789abcdef", "0123456789abcdef"] {
            let out = stable_name(hashed, MAX_ID_BYTES, is_id_byte);
            assert_ne!(out, hashed, "{hashed:?} is not plain");
            assert!(out.ends_with(&name_hash(hashed)), "{hashed:?} -> {out:?}");
        }
        // Not hash-shaped: uppercase hex, a hash without its dash, fewer digits.
        for plain in ["x-0123456789ABCDEF", "x0123456789abcdef", "x-0123456789abcde"] {
            assert_eq!(stable_name(plain, MAX_ID_BYTES, is_id_byte), plain);
        }
        // Whatever a name maps to, no other name maps there too.
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut seen: HashMap<String, String> = HashMap::new();
        for i in 0..20_000 {
            let name = match i % 4 {
                0 => format!("pvc-{}", rng.below(5000)),
                // a plain name that is some other name's hashed output
                1 => local_name(&format!("n{}", rng.below(5000)), MAX_ID_BYTES),
                _ => random_name(&mut rng),
            };
            for (max, keep) in [(MAX_ID_BYTES, is_id_byte as fn(u8) -> bool), (40, no_underscore)] {
                let out = stable_name(&name, max, keep);
                assert!(is_local_id(&out) && out.len() <= max.max(HASH_HEX), "{name:?} -> {out:?}");
                assert!(out.bytes().all(keep) && !out.starts_with(['.', '-']), "{name:?} -> {out:?}");
                if let Some(other) = seen.insert(format!("{max}/{out}"), name.clone()) {
                    assert_eq!(other, name, "{other:?} and {name:?} both map to {out:?}");
                }
            }
        }
    }

    #[test]
    fn hashes_are_sha256_prefixes() {
        // sha256("abc") = ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad
        assert_eq!(name_hash("abc"), "ba7816bf8f01cfea");
        assert!(is_local_id(&name_hash("")));
        assert!(!is_local_id("") && !is_local_id("a b") && !is_local_id(&"a".repeat(96)));
    }
}
