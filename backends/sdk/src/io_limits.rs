//! The I/O limits a VolumeAttributesClass sets (CSI `mutable_parameters`, at CreateVolume and
//! ControllerModifyVolume), with the same keys in every backend that limits I/O: each key given
//! sets its limit, a key not given leaves its limit as it is (the spec: no change from the
//! absence of a key), `0` lifts it. [`parse`] checks every key before anything changes and names
//! the first one refused; which keys a backend refuses as immutable (its StorageClass
//! parameters) is the backend's to say.
use crate::types::{Error, IoLimits};

/// Read operations per second (0: unlimited).
pub const READ_IOPS: &str = "readIOPS";
/// Write operations per second (0: unlimited).
pub const WRITE_IOPS: &str = "writeIOPS";
/// Bytes read per second (0: unlimited); a plain number or a quantity (`100Mi`, `1G`).
pub const READ_BPS: &str = "readBytesPerSecond";
/// Bytes written per second (0: unlimited); a plain number or a quantity.
pub const WRITE_BPS: &str = "writeBytesPerSecond";

/// The keys of the I/O limits.
pub const KEYS: &[&str] = &[READ_IOPS, WRITE_IOPS, READ_BPS, WRITE_BPS];

/// What a set of mutable parameters changes: each limit given, `None` where it stays.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Modification {
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    pub read_bytes_per_second: Option<u64>,
    pub write_bytes_per_second: Option<u64>,
}

impl Modification {
    /// Whether it changes anything.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// `current` with what this sets.
    pub fn applied_to(&self, current: IoLimits) -> IoLimits {
        IoLimits {
            read_iops: self.read_iops.unwrap_or(current.read_iops),
            write_iops: self.write_iops.unwrap_or(current.write_iops),
            read_bytes_per_second: self.read_bytes_per_second.unwrap_or(current.read_bytes_per_second),
            write_bytes_per_second: self.write_bytes_per_second.unwrap_or(current.write_bytes_per_second),
        }
    }
}

/// Parses mutable parameters. A key in `immutable` (a StorageClass parameter of the backend) or
/// any other key but [`KEYS`] is invalid-argument naming it, and nothing is to change then.
pub fn parse<'a>(
    params: impl IntoIterator<Item = (&'a str, &'a str)>,
    immutable: &[&str],
) -> Result<Modification, Error> {
    let mut m = Modification::default();
    for (key, value) in params {
        let slot = match key {
            READ_IOPS => &mut m.read_iops,
            WRITE_IOPS => &mut m.write_iops,
            READ_BPS => &mut m.read_bytes_per_second,
            WRITE_BPS => &mut m.write_bytes_per_second,
            other => return Err(refused(other, KEYS, immutable)),
        };
        let quantity = key == READ_BPS || key == WRITE_BPS;
        *slot = Some(number(key, value, quantity)?);
    }
    Ok(m)
}

/// Why a mutable parameter `key` that a backend does not take is refused (invalid-argument
/// naming it): one of its StorageClass parameters (`immutable`), or unknown. `takes` lists what
/// the backend does take.
pub fn refused(key: &str, takes: &[&str], immutable: &[&str]) -> Error {
    if immutable.contains(&key) {
        Error::InvalidArgument(format!(
            "mutable parameter {key:?} cannot be changed on an existing volume (this backend modifies {takes:?}); \
             set it in the StorageClass"
        ))
    } else {
        Error::InvalidArgument(format!("unknown mutable parameter {key:?} (this backend takes {takes:?})"))
    }
}

/// A non-negative whole number, or with `quantity` a Kubernetes-style quantity with a binary
/// (`Ki`, `Mi`, `Gi`, `Ti`) or decimal (`k`, `M`, `G`, `T`) suffix.
fn number(key: &str, value: &str, quantity: bool) -> Result<u64, Error> {
    let v = value.trim();
    let refuse = || {
        let form = if quantity { "a whole number of bytes, or a quantity like 100Mi" } else { "a whole number" };
        Error::InvalidArgument(format!("mutable parameter {key:?}: {value:?} is not {form} (0: unlimited)"))
    };
    let suffixes: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (digits, unit) = match suffixes.iter().find(|(s, _)| quantity && v.ends_with(s)) {
        Some((s, unit)) => (&v[..v.len() - s.len()], *unit),
        None => (v, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refuse());
    }
    digits.parse::<u64>().ok().and_then(|n| n.checked_mul(unit)).ok_or_else(refuse)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(e: Error) -> String {
        match e {
            Error::InvalidArgument(m) => m,
            other => panic!("not invalid-argument: {other:?}"),
        }
    }

    #[test]
    fn each_key_sets_its_limit_and_the_others_stay() {
        let m = parse([(WRITE_IOPS, "500"), (READ_BPS, "100Mi")], &[]).expect("valid");
        let current = IoLimits { read_iops: 7, write_iops: 1, read_bytes_per_second: 1, write_bytes_per_second: 9 };
        assert_eq!(
            m.applied_to(current),
            IoLimits { read_iops: 7, write_iops: 500, read_bytes_per_second: 100 << 20, write_bytes_per_second: 9 }
        );
        let lift = parse([(WRITE_IOPS, "0")], &[]).expect("0 lifts");
        assert_eq!(lift.applied_to(current).write_iops, 0);
        assert!(parse([], &[]).expect("nothing").is_empty());
    }

    #[test]
    fn quantities_take_binary_and_decimal_suffixes_for_bytes_only() {
        let bytes = |v: &str| parse([(WRITE_BPS, v)], &[]).map(|m| m.write_bytes_per_second);
        assert_eq!(bytes("1Gi"), Ok(Some(1 << 30)));
        assert_eq!(bytes("20M"), Ok(Some(20_000_000)));
        assert_eq!(bytes(" 4096 "), Ok(Some(4096)));
        for bad in ["", "-1", "1.5Mi", "Mi", "10Xi", "99999999999Ti"] {
            let e = message(bytes(bad).expect_err(bad));
            assert!(e.contains(WRITE_BPS) && e.contains("quantity"), "{bad}: {e:?}");
        }
        let e = message(parse([(READ_IOPS, "1k")], &[]).expect_err("operations are plain numbers"));
        assert!(e.contains(READ_IOPS), "{e:?}");
    }

    #[test]
    fn an_unknown_or_immutable_key_is_refused_by_name() {
        let e = message(parse([(WRITE_IOPS, "5"), ("colour", "red")], &["pool"]).expect_err("unknown"));
        assert!(e.contains("\"colour\"") && e.contains(WRITE_IOPS), "{e:?}");
        let e = message(parse([("pool", "other")], &["pool"]).expect_err("immutable"));
        assert!(e.contains("\"pool\"") && e.contains("StorageClass"), "{e:?}");
    }
}
