//! How many leading blocks of a prompt each backend holds: for every backend of a small pool,
//! or for a sample of a large one (the backends holding the longest prefix, then the ones the
//! caller names), so that a decision never walks the whole fleet.
//!
//! Held blocks are whole prefixes (see the module doc of [`super`]), so along a prompt's chain
//! the set of holders only shrinks. The sets are compared as bit masks over the backends being
//! measured (at most 128 at a time): the chain's ends are read, and it is bisected only where
//! the set changes — O(k log n) lookups for k distinct depths.

use super::{Inner, PrefixIndex};

/// `slot_of` for a backend not being measured.
pub(super) const NOT_MEASURED: u8 = u8::MAX;

/// Backends one mask covers.
const GROUP: usize = 128;

impl PrefixIndex {
    /// Per backend, how many leading blocks of `hashes` it holds.
    pub fn depths(&self, hashes: &[u64]) -> Vec<u32> {
        let mut g = self.lock();
        let n = g.lanes.len();
        let all: Vec<usize> = (0..n).collect();
        let mut out = vec![0u32; n];
        for (members, out) in all.chunks(GROUP).zip(out.chunks_mut(GROUP)) {
            g.measure(hashes, members, out);
        }
        out
    }

    /// Depths for a sample of at most `max` backends (≤ 128): `pinned` first, then those
    /// holding the longest prefix any backend holds, then `random`, then the holders of the
    /// prompt's first block. Returns (backend, depth) pairs, each backend once.
    pub fn sampled_depths(
        &self,
        hashes: &[u64],
        pinned: &[usize],
        random: &[usize],
        max: usize,
    ) -> Vec<(usize, u32)> {
        let max = max.min(GROUP);
        let mut g = self.lock();
        let deepest = g.deepest(hashes);
        let mut order = pinned.to_vec();
        if deepest > 0 {
            g.push_holders(hashes[deepest - 1], &mut order);
        }
        order.extend_from_slice(random);
        // Last, to catch backends holding a shorter part of the prefix.
        if deepest > 1 {
            g.push_holders(hashes[0], &mut order);
        }
        let mut members: Vec<usize> = Vec::with_capacity(max);
        for b in order {
            if members.len() < max && g.slot_of[b] == NOT_MEASURED {
                g.slot_of[b] = 0;
                members.push(b);
            }
        }
        for &b in &members {
            g.slot_of[b] = NOT_MEASURED;
        }
        let mut out = vec![0u32; members.len()];
        g.measure(hashes, &members, &mut out);
        members.into_iter().zip(out).collect()
    }
}

impl Inner {
    /// How many leading blocks of `hashes` the best-placed backend holds.
    fn deepest(&self, hashes: &[u64]) -> usize {
        let any = |i: usize| self.table.find(hashes[i], &self.nodes.keys).is_some();
        let n = hashes.len();
        if n == 0 || !any(0) {
            return 0;
        }
        if any(n - 1) {
            return n;
        }
        // The first `lo` blocks are held somewhere, block `hi - 1` nowhere.
        let (mut lo, mut hi) = (1, n);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if any(mid - 1) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn push_holders(&self, key: u64, out: &mut Vec<usize>) {
        if let Some(pos) = self.table.find(key, &self.nodes.keys) {
            self.each_holder(pos, |b| out.push(b));
        }
    }

    /// Which of `members` hold block `hashes[i]`, as a mask over their positions.
    fn held_by(&self, hash: u64, all: u128) -> u128 {
        let Some(pos) = self.table.find(hash, &self.nodes.keys) else { return 0 };
        if self.saturated(pos) {
            return all;
        }
        let mut m = 0u128;
        self.each_holder(pos, |b| {
            let s = self.slot_of[b];
            if s != NOT_MEASURED {
                m |= 1 << s;
            }
        });
        m
    }

    /// Writes each of `members`' (≤ [`GROUP`]) depth into `out`.
    fn measure(&mut self, hashes: &[u64], members: &[usize], out: &mut [u32]) {
        debug_assert!(members.len() <= GROUP && out.len() == members.len());
        out.fill(0);
        if hashes.is_empty() || members.is_empty() {
            return;
        }
        for (s, &b) in members.iter().enumerate() {
            self.slot_of[b] = s as u8;
        }
        let all = if members.len() == GROUP { u128::MAX } else { (1u128 << members.len()) - 1 };
        self.bisect(hashes, all, out);
        for &b in members {
            self.slot_of[b] = NOT_MEASURED;
        }
    }

    fn bisect(&self, hashes: &[u64], all: u128, out: &mut [u32]) {
        let get = |i: usize| self.held_by(hashes[i], all);
        let s0 = get(0);
        if s0 == 0 {
            return;
        }
        let n = hashes.len();
        for_each(s0, |s| out[s] = n as u32);
        let last = n - 1;
        if last == 0 {
            return;
        }
        let mut stack = vec![(0usize, s0, last, get(last))];
        while let Some((lo, slo, hi, shi)) = stack.pop() {
            if slo == shi {
                continue;
            }
            if hi == lo + 1 {
                // Held at `lo`, not at `hi`: these hold exactly `hi` blocks.
                for_each(slo & !shi, |s| out[s] = out[s].min(hi as u32));
                continue;
            }
            let mid = lo + (hi - lo) / 2;
            let smid = get(mid);
            stack.push((lo, slo, mid, smid));
            stack.push((mid, smid, hi, shi));
        }
    }
}

fn for_each(mut m: u128, mut f: impl FnMut(usize)) {
    while m != 0 {
        f(m.trailing_zeros() as usize);
        m &= m - 1;
    }
}
