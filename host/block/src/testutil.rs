//! Test helpers shared by the unit tests and the simulator: a tiny seeded PRNG, so every
//! property-style test and every simulated run is reproducible from its seed without a
//! proptest/rand dependency.

/// xorshift64* — statistically fine for test input, trivially reproducible.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        // Spread small seeds and avoid the all-zero state, which xorshift never leaves.
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform-enough value in `0..n`; `n` must be non-zero.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// True with probability `percent`/100.
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}
