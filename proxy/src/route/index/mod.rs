//! Which backend holds which prefix blocks: block key → set of backends, and per backend an LRU
//! of its blocks bounded by its KV capacity (optionally with a TTL).
//!
//! Two writers feed it. In approximate mode warmpath records what it routed where (a backend
//! that prefilled a prompt holds its blocks until its own LRU evicts them); in precise mode the
//! backends' KV events say what they stored and removed ([`super::events`]). The index itself
//! does not care which: both are inserts and removals.
//!
//! Blocks are inserted leaf first, so a chain's root is the most recently used of its blocks
//! and eviction takes leaves before the blocks they extend, as vLLM's own free queue does.
//! That keeps each backend's held blocks a set of whole prefixes, which is what lets
//! [`PrefixIndex::depths`] find every backend's matched length with a handful of lookups
//! instead of one per block.

mod lru;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lru::Lru;

/// A held chain touched this recently (seconds) is not touched again when a request extends
/// it: an agent loop's turns refresh their history's recency at most this often.
pub const REFRESH_S: u32 = 10;

/// Most backends one pool's index tracks.
pub const MAX_BACKENDS: usize = 256;

/// A set of backend indices below [`MAX_BACKENDS`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackendSet([u64; MAX_BACKENDS / 64]);

impl BackendSet {
    pub fn insert(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    pub fn remove(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }
    pub fn contains(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
    /// Members of `self` not in `other`.
    pub fn minus(&self, other: &BackendSet) -> BackendSet {
        let mut out = *self;
        for (o, w) in out.0.iter_mut().zip(other.0) {
            *o &= !w;
        }
        out
    }
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().enumerate().flat_map(|(k, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                (w != 0).then(|| {
                    let b = w.trailing_zeros() as usize;
                    w &= w - 1;
                    k * 64 + b
                })
            })
        })
    }
}

/// Block keys are xxh3 outputs already: hashing them again is wasted work.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHash;

impl BuildHasher for NoHash {
    type Hasher = Identity;
    fn build_hasher(&self) -> Identity {
        Identity(0)
    }
}

#[derive(Debug, Default)]
pub struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Debug)]
struct Inner {
    holders: HashMap<u64, BackendSet, NoHash>,
    lrus: Vec<Lru>,
    capacity: Vec<usize>,
}

/// One pool's prefix index.
#[derive(Debug)]
pub struct PrefixIndex {
    inner: Mutex<Inner>,
    ttl: Option<Duration>,
    epoch: Instant,
}

impl PrefixIndex {
    /// `capacity`: blocks each backend holds before its LRU evicts (replaced per backend by
    /// [`PrefixIndex::set_capacity`] once its real KV capacity is known).
    pub fn new(backends: usize, capacity: usize, ttl: Option<Duration>) -> PrefixIndex {
        assert!(backends <= MAX_BACKENDS, "validated: at most {MAX_BACKENDS} backends");
        PrefixIndex {
            inner: Mutex::new(Inner {
                holders: HashMap::with_hasher(NoHash),
                lrus: (0..backends).map(|_| Lru::new()).collect(),
                capacity: vec![capacity.max(1); backends],
            }),
            ttl,
            epoch: Instant::now(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The index holds no invariant a panic elsewhere could break half-way that matters more
        // than routing on: keep using it.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now(&self) -> u32 {
        self.epoch.elapsed().as_secs() as u32
    }

    pub fn set_capacity(&self, backend: usize, blocks: usize) {
        let mut g = self.lock();
        g.capacity[backend] = blocks.max(1);
        g.evict(backend, None, 0);
    }

    /// `backend` holds `hashes` (a chain, root first) now; then the oldest blocks beyond its
    /// capacity or older than the TTL are evicted.
    ///
    /// The chain is touched leaf first, so each block is more recent than its descendants. When
    /// the part the backend already holds was touched within [`REFRESH_S`], only the new
    /// blocks are added, each right behind its parent in LRU order, which keeps that order and
    /// costs O(log n + new blocks) instead of O(n): an agent loop resending a long conversation
    /// pays for its new turn only.
    pub fn insert(&self, backend: usize, hashes: &[u64]) {
        let now = self.now();
        let mut g = self.lock();
        let Inner { holders, lrus, .. } = &mut *g;
        let lru = &mut lrus[backend];
        let held = held_prefix(lru, hashes);
        let fresh =
            held > 0 && lru.touched_at(hashes[held - 1]).is_some_and(|at| now.saturating_sub(at) < REFRESH_S);
        if fresh {
            for k in held..hashes.len() {
                if lru.insert_behind(hashes[k - 1], hashes[k], now) {
                    holders.entry(hashes[k]).or_default().insert(backend);
                }
            }
        } else {
            for &h in hashes.iter().rev() {
                if lru.touch(h, now) {
                    holders.entry(h).or_default().insert(backend);
                }
            }
        }
        let ttl = self.ttl.map(|t| t.as_secs() as u32);
        g.evict(backend, ttl, now);
    }

    /// `backend` no longer holds `hashes`.
    pub fn remove(&self, backend: usize, hashes: &[u64]) {
        let mut g = self.lock();
        for &h in hashes {
            if g.lrus[backend].remove(h) {
                g.unhold(h, backend);
            }
        }
    }

    /// `backend` holds nothing (it cleared its cache, or its events cannot be trusted).
    pub fn clear(&self, backend: usize) {
        let mut g = self.lock();
        while let Some(h) = g.lrus[backend].pop_oldest() {
            g.unhold(h, backend);
        }
        g.lrus[backend].clear();
    }

    /// The backends holding `hash`.
    pub fn holders(&self, hash: u64) -> BackendSet {
        self.lock().holders.get(&hash).copied().unwrap_or_default()
    }

    /// Per backend, how many leading blocks of `hashes` it holds. Reads the ends of the chain and
    /// bisects only where the set of holders changes: O(k log n) lookups for k distinct depths.
    pub fn depths(&self, hashes: &[u64]) -> Vec<u32> {
        let g = self.lock();
        let mut out = vec![0u32; g.lrus.len()];
        let Some(&first) = hashes.first() else { return out };
        let get = |i: usize| g.holders.get(&hashes[i]).copied().unwrap_or_default();
        let s0 = g.holders.get(&first).copied().unwrap_or_default();
        if s0.is_empty() {
            return out;
        }
        let n = hashes.len();
        for b in s0.iter() {
            out[b] = n as u32;
        }
        let last = n - 1;
        if last == 0 {
            return out;
        }
        let mut stack = vec![(0usize, s0, last, get(last))];
        while let Some((lo, slo, hi, shi)) = stack.pop() {
            if slo == shi {
                continue;
            }
            if hi == lo + 1 {
                // Held at `lo`, not at `hi`: these backends hold exactly `hi` blocks.
                for b in slo.minus(&shi).iter() {
                    out[b] = out[b].min(hi as u32);
                }
                continue;
            }
            let mid = lo + (hi - lo) / 2;
            let smid = get(mid);
            stack.push((lo, slo, mid, smid));
            stack.push((mid, smid, hi, shi));
        }
        out
    }

    /// Blocks held per backend.
    pub fn blocks(&self) -> Vec<usize> {
        self.lock().lrus.iter().map(Lru::len).collect()
    }

    /// Distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.lock().holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the index holds (allocated capacity of its tables).
    pub fn bytes(&self) -> usize {
        let g = self.lock();
        let entry = 8 + size_of::<BackendSet>() + 1;
        g.holders.capacity() * entry + g.lrus.iter().map(Lru::bytes).sum::<usize>()
    }
}

/// How many leading blocks of `hashes` `lru` holds, by bisection (held blocks are whole
/// prefixes, see the module doc).
fn held_prefix(lru: &Lru, hashes: &[u64]) -> usize {
    let (mut lo, mut hi) = (0, hashes.len());
    if hi > 0 && lru.contains(hashes[hi - 1]) {
        return hi;
    }
    // Invariant: the first `lo` are held, the first `hi` are not all held.
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if lru.contains(hashes[mid - 1]) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

impl Inner {
    fn unhold(&mut self, h: u64, backend: usize) {
        if let Some(set) = self.holders.get_mut(&h) {
            set.remove(backend);
            if set.is_empty() {
                self.holders.remove(&h);
            }
        }
    }

    /// Evicts `backend`'s oldest blocks beyond its capacity, and those older than `ttl` seconds.
    fn evict(&mut self, backend: usize, ttl: Option<u32>, now: u32) {
        loop {
            let over = self.lrus[backend].len() > self.capacity[backend];
            let expired = match (ttl, self.lrus[backend].oldest()) {
                (Some(ttl), Some((_, at))) => now.saturating_sub(at) > ttl,
                _ => false,
            };
            if !(over || expired) {
                break;
            }
            let Some(h) = self.lrus[backend].pop_oldest() else { break };
            self.unhold(h, backend);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(root: u64, n: usize) -> Vec<u64> {
        (0..n as u64).map(|i| xxhash_rust::xxh3::xxh3_64(&[root, i].map(u64::to_le_bytes).concat())).collect()
    }

    #[test]
    fn depths_are_each_backends_matched_prefix() {
        let idx = PrefixIndex::new(4, 1000, None);
        let c = chain(1, 100);
        idx.insert(0, &c[..100]);
        idx.insert(1, &c[..37]);
        idx.insert(2, &c[..1]);
        assert_eq!(idx.depths(&c), vec![100, 37, 1, 0]);
        // A request that extends the chain: backend 0 holds its first 100 blocks.
        let mut longer = c.clone();
        longer.extend(chain(2, 50));
        assert_eq!(idx.depths(&longer), vec![100, 37, 1, 0]);
        assert_eq!(idx.depths(&chain(3, 10)), vec![0; 4]);
        assert_eq!(idx.depths(&[]), vec![0; 4]);
        assert_eq!(idx.depths(&c[..1]), vec![1, 1, 1, 0]);
    }

    #[test]
    fn depths_match_a_linear_walk_on_random_chains() {
        // Many backends at many depths of one chain, checked against the obvious walk.
        let idx = PrefixIndex::new(64, 10_000, None);
        let c = chain(9, 500);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut want = vec![0u32; 64];
        for (b, w) in want.iter_mut().enumerate() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let d = if b % 5 == 0 { 0 } else { (seed % 501) as usize };
            idx.insert(b, &c[..d]);
            *w = d as u32;
        }
        assert_eq!(idx.depths(&c), want);
    }

    #[test]
    fn lru_eviction_takes_leaves_first_and_bounds_memory() {
        let idx = PrefixIndex::new(2, 10, None);
        let a = chain(1, 8);
        let b = chain(2, 8);
        idx.insert(0, &a);
        idx.insert(0, &b);
        // 16 blocks into 10: the oldest chain lost its 6 deepest blocks, not its root.
        assert_eq!(idx.blocks()[0], 10);
        assert_eq!(idx.depths(&a)[0], 2);
        assert_eq!(idx.depths(&b)[0], 8);
        assert_eq!(idx.len(), 10);
        idx.set_capacity(0, 4);
        assert_eq!(idx.depths(&b)[0], 4);
        assert_eq!(idx.depths(&a)[0], 0);
        idx.remove(0, &b[2..]);
        assert_eq!(idx.depths(&b)[0], 2);
        idx.clear(0);
        assert_eq!(idx.len(), 0);
        assert_eq!(idx.blocks(), vec![0, 0]);
    }

    #[test]
    fn a_resent_conversation_adds_its_turn_behind_its_history() {
        // Within REFRESH_S the held part is not touched again; new blocks go right behind
        // their parents, so eviction still takes the newest turn's blocks before the history.
        let idx = PrefixIndex::new(1, 12, None);
        let history = chain(1, 8);
        idx.insert(0, &history);
        let mut turn = history.clone();
        turn.extend(chain(2, 3));
        idx.insert(0, &turn);
        assert_eq!(idx.depths(&turn)[0], 11);
        let other = chain(3, 3);
        idx.insert(0, &other); // 14 blocks into 12: two go
        assert_eq!(idx.blocks()[0], 12);
        let d = idx.depths(&turn)[0];
        assert!((8..11).contains(&d), "leaves of the old chain went first, its history stayed: {d}");
        assert_eq!(idx.depths(&other)[0], 3);
        assert_eq!(held_prefix(&idx.lock().lrus[0], &turn), d as usize);
    }

    #[test]
    fn held_prefix_bisects() {
        let mut l = Lru::new();
        let c = chain(5, 10);
        assert_eq!(held_prefix(&l, &c), 0);
        for (k, &h) in c.iter().take(1).enumerate() {
            l.touch(h, k as u32);
        }
        assert_eq!(held_prefix(&l, &c), 1);
        for &h in &c[..7] {
            l.touch(h, 0);
        }
        assert_eq!(held_prefix(&l, &c), 7);
        for &h in &c {
            l.touch(h, 0);
        }
        assert_eq!(held_prefix(&l, &c), 10);
        assert_eq!(held_prefix(&l, &[]), 0);
    }

    #[test]
    fn entries_older_than_the_ttl_expire() {
        let idx = PrefixIndex::new(1, 100, Some(Duration::from_secs(0)));
        let a = chain(1, 4);
        idx.insert(0, &a);
        // Same second: still there (age 0 is not over a TTL of 0 s).
        assert_eq!(idx.depths(&a)[0], 4);
        let mut g = idx.lock();
        g.evict(0, Some(0), 2);
        drop(g);
        assert_eq!(idx.depths(&a)[0], 0);
    }

    #[test]
    fn backend_sets() {
        let mut s = BackendSet::default();
        for i in [0, 63, 64, 200, 255] {
            s.insert(i);
        }
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 63, 64, 200, 255]);
        let mut t = s;
        t.remove(64);
        assert_eq!(s.minus(&t).iter().collect::<Vec<_>>(), vec![64]);
        assert!(s.contains(200) && !t.contains(64) && BackendSet::default().is_empty());
    }
}
