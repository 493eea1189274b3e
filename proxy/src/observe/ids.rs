//! Unique ids without a system call each: 128 bits hashed from a per-process random seed and a
//! counter (unique within the process; across processes as likely to meet as two random
//! 128-bit numbers). Request ids and trace and span ids come from here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// `N` (at most 16) bytes of a fresh id, never all zero.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    static SEED: OnceLock<[u8; 16]> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let seed = SEED.get_or_init(|| {
        let mut s = [0u8; 16];
        if getrandom::getrandom(&mut s).is_err() {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            s.copy_from_slice(&(t.as_nanos() ^ u128::from(std::process::id())).to_le_bytes());
        }
        s
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut input = [0u8; 24];
    input[..16].copy_from_slice(seed);
    input[16..].copy_from_slice(&n.to_le_bytes());
    let h = xxhash_rust::xxh3::xxh3_128(&input).to_le_bytes();
    let mut out = [0u8; N];
    out.copy_from_slice(&h[..N]);
    if out.iter().all(|b| *b == 0) {
        out[0] = 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_distinct_and_never_zero() {
        let ids: std::collections::HashSet<[u8; 8]> = (0..10_000).map(|_| random_bytes::<8>()).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(!ids.contains(&[0u8; 8]));
    }
}
