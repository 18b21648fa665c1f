//! Capacity resolution: the size a CreateVolume gets from CSI's capacity range (`required` and
//! `limit`, 0 = unset), a backend's default size and its allocation unit.
use crate::types::{CapacityRange, Error};

/// One GiB, the usual default size.
pub const GIB: u64 = 1 << 30;
/// One MiB.
pub const MIB: u64 = 1 << 20;

/// How a backend sizes volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    /// the size when the request names none (within its limit)
    pub default_bytes: u64,
    /// sizes are whole multiples of this (1 = any byte count)
    pub unit_bytes: u64,
}

impl Default for Sizing {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl Sizing {
    /// 1 GiB by default, any byte count.
    pub const DEFAULT: Sizing = Sizing { default_bytes: GIB, unit_bytes: 1 };

    /// The size to create: `required` (or the default, capped at `limit`) rounded up to the unit,
    /// within `limit` when one is set; when rounding up crosses the limit, rounded down instead
    /// if that still holds `required`. Errors: out-of-range, naming both bounds.
    ///
    /// ```
    /// use wasmcsi_backend_sdk::capacity::{Sizing, GIB, MIB};
    /// let mib = Sizing { default_bytes: GIB, unit_bytes: MIB };
    /// assert_eq!(mib.resolve(0, 0), Ok(GIB));
    /// assert_eq!(mib.resolve(MIB + 1, 0), Ok(2 * MIB));
    /// assert_eq!(mib.resolve(MIB + 1, 2 * MIB + 5), Ok(2 * MIB));
    /// assert!(mib.resolve(5, 4).is_err());
    /// ```
    pub fn resolve(&self, required: u64, limit: u64) -> Result<u64, Error> {
        if limit != 0 && required > limit {
            return Err(Error::OutOfRange(format!("required {required} bytes exceeds the limit of {limit}")));
        }
        let unit = self.unit_bytes.max(1);
        let want = match (required, limit) {
            (0, 0) => self.default_bytes,
            (0, limit) => limit.min(self.default_bytes),
            (required, _) => required,
        };
        let rounded = want
            .div_ceil(unit)
            .checked_mul(unit)
            .ok_or_else(|| Error::OutOfRange(format!("{want} bytes is too large")))?;
        if limit != 0 && rounded > limit {
            // A limit below one unit cannot be met at all.
            let down = limit / unit * unit;
            if down >= required.max(1) {
                return Ok(down);
            }
            return Err(Error::OutOfRange(format!(
                "no whole {} between {required} and {limit} bytes",
                unit_name(unit)
            )));
        }
        Ok(rounded)
    }
}

/// The size a volume of `have` bytes grows to for ControllerExpandVolume: at least
/// `required` (never smaller than now). Errors: out-of-range when `required` exceeds `limit`.
pub fn grow(have: u64, range: &CapacityRange) -> Result<u64, Error> {
    let (required, limit) = (range.required_bytes, range.limit_bytes);
    if limit != 0 && required > limit {
        return Err(Error::OutOfRange(format!("required {required} bytes exceeds the limit of {limit}")));
    }
    Ok(have.max(required))
}

fn unit_name(unit: u64) -> String {
    match unit {
        MIB => "MiB".into(),
        GIB => "GiB".into(),
        n => format!("multiple of {n} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizing_takes_the_request_or_the_default_within_the_limit() {
        let s = Sizing::DEFAULT;
        assert_eq!(s.resolve(0, 0), Ok(GIB));
        assert_eq!(s.resolve(0, MIB), Ok(MIB), "a limit below the default caps it");
        assert_eq!(s.resolve(0, 4 * GIB), Ok(GIB));
        assert_eq!(s.resolve(5, 10), Ok(5));
        assert_eq!(s.resolve(10, 10), Ok(10));
        assert!(matches!(s.resolve(11, 10), Err(Error::OutOfRange(m)) if m.contains("11") && m.contains("10")));
    }

    #[test]
    fn growing_never_shrinks_and_respects_the_limit() {
        let range = |required_bytes, limit_bytes| CapacityRange { required_bytes, limit_bytes };
        assert_eq!(grow(4, &range(8, 0)), Ok(8));
        assert_eq!(grow(8, &range(2, 0)), Ok(8));
        assert_eq!(grow(8, &range(8, 8)), Ok(8));
        assert!(matches!(grow(4, &range(9, 5)), Err(Error::OutOfRange(_))));
    }

    #[test]
    fn unit_sizing_rounds_up_or_down_within_the_limit() {
        let s = Sizing { default_bytes: GIB, unit_bytes: MIB };
        assert_eq!(s.resolve(1, 0), Ok(MIB));
        assert_eq!(s.resolve(0, 5 * MIB), Ok(5 * MIB));
        assert_eq!(s.resolve(MIB + 1, 2 * MIB + 5), Ok(2 * MIB));
        assert!(s.resolve(MIB + 1, MIB + 2).is_err(), "no whole MiB in between");
        assert!(s.resolve(0, MIB - 1).is_err(), "a limit below one unit");
        assert!(s.resolve(u64::MAX, 0).is_err(), "rounding overflows");
    }
}
