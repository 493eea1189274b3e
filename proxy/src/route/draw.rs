//! Cheap deterministic pseudo-random draws: the random part of a `cache_aware` sample, and the
//! pseudo-random workloads of routing's tests.

/// One step of Marsaglia's xorshift64 on `x` (never 0), returning the new value.
pub fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}
