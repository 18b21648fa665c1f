//! `DirtyMap`: a fixed-region bitset over a volume recording which regions a replica that is out
//! of the set lacks (the engine keeps one per out-of-sync replica). It owns only the bit arithmetic and its persisted byte form;
//! deciding when to mark, merge or clear it is the job of the [`crate::engine`].

use thiserror::Error;

/// One bit per `region_size` bytes of the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyMap {
    region_size: u64,
    regions: u64,
    bits: Vec<u64>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DirtyMapError {
    #[error("persisted dirty map is truncated or has the wrong length")]
    BadLength,
    #[error("region size {0} is not a positive power of two")]
    BadRegionSize(u64),
}

impl DirtyMap {
    /// A clean map for a volume of `size` bytes. `region_size` must be a power of two so region
    /// arithmetic is shifts, and so replica extents line up with regions.
    pub fn new(size: u64, region_size: u64) -> Result<Self, DirtyMapError> {
        if region_size == 0 || !region_size.is_power_of_two() {
            return Err(DirtyMapError::BadRegionSize(region_size));
        }
        let regions = size.div_ceil(region_size);
        Ok(Self { region_size, regions, bits: vec![0; regions.div_ceil(64) as usize] })
    }

    /// A map of `size` bytes with every region marked: what a replica the engine knows nothing
    /// about lacks (a full rebuild).
    pub fn full(size: u64, region_size: u64) -> Result<Self, DirtyMapError> {
        let mut m = Self::new(size, region_size)?;
        m.mark_all();
        Ok(m)
    }

    pub fn region_size(&self) -> u64 {
        self.region_size
    }

    pub fn regions(&self) -> u64 {
        self.regions
    }

    /// The regions `[first, last)` that `[offset, offset + len)` touches (empty when none).
    pub fn region_span(&self, offset: u64, len: u64) -> (u64, u64) {
        if len == 0 || offset >= self.regions * self.region_size {
            return (0, 0);
        }
        let first = offset / self.region_size;
        let last = ((offset.saturating_add(len) - 1) / self.region_size).min(self.regions - 1);
        (first, last + 1)
    }

    /// Marks every region touched by `[offset, offset + len)`; true if any bit was newly set
    /// (i.e. the persisted copy is now out of date).
    pub fn mark(&mut self, offset: u64, len: u64) -> bool {
        if len == 0 || offset >= self.regions * self.region_size {
            return false;
        }
        let first = offset / self.region_size;
        let last = ((offset.saturating_add(len) - 1) / self.region_size).min(self.regions - 1);
        let mut changed = false;
        for r in first..=last {
            let (w, b) = ((r / 64) as usize, r % 64);
            changed |= self.bits[w] & (1 << b) == 0;
            self.bits[w] |= 1 << b;
        }
        changed
    }

    pub fn is_marked(&self, region: u64) -> bool {
        region < self.regions && self.bits[(region / 64) as usize] & (1 << (region % 64)) != 0
    }

    /// Adds every region of `other` (same geometry); true if any bit was newly set.
    pub fn merge(&mut self, other: &DirtyMap) -> bool {
        let mut changed = false;
        for (a, b) in self.bits.iter_mut().zip(&other.bits) {
            changed |= *b & !*a != 0;
            *a |= *b;
        }
        changed
    }

    pub fn mark_all(&mut self) {
        let regions = self.regions;
        for (i, w) in self.bits.iter_mut().enumerate() {
            let first = i as u64 * 64;
            // The last word keeps its bits past the last region clear, so `count` stays exact.
            *w = if regions - first >= 64 { u64::MAX } else { (1u64 << (regions - first)) - 1 };
        }
    }

    /// Clears one region (a rebuild copied it durably); true if it was marked.
    pub fn clear_region(&mut self, region: u64) -> bool {
        if !self.is_marked(region) {
            return false;
        }
        self.bits[(region / 64) as usize] &= !(1 << (region % 64));
        true
    }

    /// Grows the map to cover a volume of `size` bytes (online expansion), keeping every mark;
    /// the new regions start clean. A smaller size changes nothing: volumes never shrink.
    pub fn grow(&mut self, size: u64) {
        let regions = size.div_ceil(self.region_size);
        if regions <= self.regions {
            return;
        }
        self.regions = regions;
        self.bits.resize(regions.div_ceil(64) as usize, 0);
    }

    pub fn clear(&mut self) {
        self.bits.iter_mut().for_each(|w| *w = 0);
    }

    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|w| *w == 0)
    }

    pub fn count(&self) -> u64 {
        self.bits.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Marked region indices, ascending.
    pub fn marked(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.regions).filter(|r| self.is_marked(*r))
    }

    /// Byte range `(offset, len)` of a region, the last one clipped to `size`.
    pub fn region_range(&self, region: u64, size: u64) -> (u64, u64) {
        let offset = region * self.region_size;
        (offset, self.region_size.min(size.saturating_sub(offset)))
    }

    /// Persisted form: region size, region count, then the words, all little-endian.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.bits.len() * 8);
        out.extend_from_slice(&self.region_size.to_le_bytes());
        out.extend_from_slice(&self.regions.to_le_bytes());
        self.bits.iter().for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DirtyMapError> {
        let word = |i: usize| -> Result<u64, DirtyMapError> {
            let b = bytes.get(i * 8..i * 8 + 8).ok_or(DirtyMapError::BadLength)?;
            let mut a = [0; 8];
            a.copy_from_slice(b);
            Ok(u64::from_le_bytes(a))
        };
        let region_size = word(0)?;
        let regions = word(1)?;
        if region_size == 0 || !region_size.is_power_of_two() {
            return Err(DirtyMapError::BadRegionSize(region_size));
        }
        let words = regions.div_ceil(64);
        if (bytes.len() as u64 - 16) / 8 != words || !bytes.len().is_multiple_of(8) {
            return Err(DirtyMapError::BadLength);
        }
        let bits = (0..words as usize).map(|i| word(i + 2)).collect::<Result<_, _>>()?;
        Ok(Self { region_size, regions, bits })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mark_covers_every_region_a_range_touches() {
        let mut m = DirtyMap::new(10 * 4096, 4096).expect("valid");
        assert!(m.mark(4095, 2));
        assert_eq!(m.marked().collect::<Vec<_>>(), vec![0, 1]);
        assert!(!m.mark(4096, 10), "already marked: nothing new to persist");
        assert!(!m.mark(0, 0));
        assert!(m.mark(9 * 4096, u64::MAX), "a range past the end is clipped, not a panic");
        assert_eq!(m.count(), 3);
    }

    #[test]
    fn merge_reports_only_new_bits() {
        let mut a = DirtyMap::new(1 << 20, 4096).expect("valid");
        let mut b = a.clone();
        b.mark(8192, 1);
        assert!(a.merge(&b));
        assert!(!a.merge(&b));
        a.clear();
        assert!(a.is_empty());
    }

    #[test]
    fn persisted_form_round_trips_and_rejects_truncation() {
        let mut m = DirtyMap::new(1000 * 4096 + 5, 4096).expect("valid");
        m.mark(0, 1);
        m.mark(999 * 4096, 4096);
        let bytes = m.to_bytes();
        assert_eq!(DirtyMap::from_bytes(&bytes), Ok(m));
        assert_eq!(DirtyMap::from_bytes(&bytes[..bytes.len() - 1]), Err(DirtyMapError::BadLength));
        assert!(DirtyMap::from_bytes(&[]).is_err());
    }

    #[test]
    fn grow_keeps_marks_and_adds_clean_regions() {
        let mut m = DirtyMap::new(70 * 4096, 4096).expect("valid");
        m.mark(0, 1);
        m.mark(69 * 4096, 1);
        m.grow(200 * 4096 + 1);
        assert_eq!(m.regions(), 201);
        assert_eq!(m.marked().collect::<Vec<_>>(), vec![0, 69]);
        m.grow(10);
        assert_eq!(m.regions(), 201, "never shrinks");
        let round = DirtyMap::from_bytes(&m.to_bytes()).expect("round trip");
        assert_eq!(round, m);
    }

    #[test]
    fn full_map_marks_exactly_every_region_and_regions_clear_one_by_one() {
        let mut m = DirtyMap::full(130 * 4096 - 1, 4096).expect("valid");
        assert_eq!(m.count(), 130);
        assert!(m.clear_region(129));
        assert!(!m.clear_region(129));
        assert!(!m.clear_region(500), "out of range is a no-op");
        assert_eq!(m.count(), 129);
        m.grow(140 * 4096);
        assert_eq!(m.count(), 129, "growing a full map adds clean regions only");
    }

    #[test]
    fn region_size_must_be_a_power_of_two() {
        assert_eq!(DirtyMap::new(100, 3), Err(DirtyMapError::BadRegionSize(3)));
    }
}
