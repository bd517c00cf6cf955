//! xorshift64*: reproducible traces from a printed seed, for the property
//! tests and matrices that replay a failing seed (tests/ring_equivalence.rs,
//! tests/cold_key_batches.rs, tests/quota_leases.rs, tests/matrix*.rs).

pub struct Rng(pub u64);

impl Rng {
    /// The generator of `seed`, its bits spread (a seed and the next one
    /// start apart) and never 0 (xorshift's fixed point).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        self.in_range(lo.into(), hi.into()) as u32
    }

    /// A number in `lo..=hi`.
    pub fn in_range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True `percent` times in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// One of `xs`.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

/// The first seed of a property test's traces: the environment variable
/// `var` when set (to replay a failing run), else one drawn from the
/// process id (each run explores others).
pub fn base_seed(var: &str) -> u64 {
    std::env::var(var).ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| std::process::id() as u64 * 7919)
}

/// The number in the environment variable `name`, else `default`.
pub fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The seeds of a matrix's cases: `<PREFIX>_SEED` alone when set (to replay
/// a failing case), else `<PREFIX>_CASES` (default `cases`) seeds from `base`.
pub fn seeds(prefix: &str, base: u64, cases: u64) -> Vec<u64> {
    match std::env::var(format!("{prefix}_SEED")).ok().and_then(|s| s.parse().ok()) {
        Some(seed) => vec![seed],
        None => (0..env_or(&format!("{prefix}_CASES"), cases)).map(|i| base + i).collect(),
    }
}
