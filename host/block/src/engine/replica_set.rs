//! A set of replicas as one machine word. Every replicated write builds two of them (the
//! replicas still to answer, those that acknowledged) and one more when it completes; as
//! `BTreeSet`s that was three allocations per write, as bits it is none.

use super::ReplicaId;

/// The most replicas a volume can have: one bit each. The replicated-block backend allows 16;
/// a volume configured with more is refused before an engine is made (see `volume::driver`).
pub const MAX_REPLICAS: usize = u64::BITS as usize;

/// A set of [`ReplicaId`]s below [`MAX_REPLICAS`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaSet(u64);

impl ReplicaSet {
    pub const fn new() -> Self {
        Self(0)
    }

    /// Adds `r`. An id at or above [`MAX_REPLICAS`] cannot be in a volume (refused at start),
    /// so it is a bug; it is ignored rather than aliased onto another replica.
    pub fn insert(&mut self, r: ReplicaId) {
        debug_assert!(r < MAX_REPLICAS, "replica {r} beyond MAX_REPLICAS");
        if r < MAX_REPLICAS {
            self.0 |= 1 << r;
        }
    }

    pub fn remove(&mut self, r: ReplicaId) {
        if r < MAX_REPLICAS {
            self.0 &= !(1 << r);
        }
    }

    pub fn contains(&self, r: ReplicaId) -> bool {
        r < MAX_REPLICAS && self.0 & (1 << r) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    pub fn len(&self) -> usize {
        self.0.count_ones() as usize
    }

    /// The members in ascending order.
    pub fn iter(&self) -> Iter {
        Iter(self.0)
    }

    /// The lowest member.
    pub fn first(&self) -> Option<ReplicaId> {
        self.iter().next()
    }

    /// The members of both.
    pub fn intersection(&self, other: ReplicaSet) -> ReplicaSet {
        ReplicaSet(self.0 & other.0)
    }

    /// True when every member of `self` is in `other`.
    pub fn is_subset(&self, other: ReplicaSet) -> bool {
        self.0 & !other.0 == 0
    }
}

/// The members of a [`ReplicaSet`], ascending.
pub struct Iter(u64);

impl Iterator for Iter {
    type Item = ReplicaId;

    fn next(&mut self) -> Option<ReplicaId> {
        if self.0 == 0 {
            return None;
        }
        let r = self.0.trailing_zeros() as ReplicaId;
        self.0 &= self.0 - 1;
        Some(r)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.0.count_ones() as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Iter {}

impl IntoIterator for &ReplicaSet {
    type Item = ReplicaId;
    type IntoIter = Iter;

    fn into_iter(self) -> Iter {
        self.iter()
    }
}

impl FromIterator<ReplicaId> for ReplicaSet {
    fn from_iter<I: IntoIterator<Item = ReplicaId>>(iter: I) -> Self {
        let mut set = Self::new();
        set.extend(iter);
        set
    }
}

impl Extend<ReplicaId> for ReplicaSet {
    fn extend<I: IntoIterator<Item = ReplicaId>>(&mut self, iter: I) {
        for r in iter {
            self.insert(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_holds_what_was_inserted_and_not_what_was_removed_in_ascending_order() {
        let mut s: ReplicaSet = [5, 0, 63, 2].into_iter().collect();
        s.remove(2);
        s.remove(7);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 5, 63]);
        assert_eq!(s.len(), 3);
        assert!(s.contains(63) && s.contains(0) && !s.contains(2) && !s.contains(64));
        assert_eq!(s.first(), Some(0));
        assert_eq!(s.intersection([5, 6].into_iter().collect()).iter().collect::<Vec<_>>(), vec![5]);
        assert!(ReplicaSet::from_iter([0, 63]).is_subset(s));
        assert!(!ReplicaSet::from_iter([1]).is_subset(s));
        assert!(ReplicaSet::new().is_empty() && ReplicaSet::new().first().is_none());
    }
}
