//! Block key → the first node of the block's holders: Robin Hood open addressing over `u32`
//! slots. The key itself is read from the node (every holder node of a block carries its key),
//! so a slot costs 4 bytes where a `HashMap<u64, u32>` entry takes 16 with its padding.
//!
//! Each slot keeps, beside the node index, how far the entry sits from its home slot. That is
//! what makes the table cheap when its keys live elsewhere (every key read is a cache miss):
//! a lookup compares keys only with entries from the same home slot and stops as soon as it
//! passes where its key would be; an insert displaces richer entries without reading their
//! keys; a removal shifts the entries behind the hole back one slot, again without reading a
//! key. The table grows by half at 80 % load (so it is 53–80 % full, 5–7.5 bytes per block),
//! rebuilt from the nodes in the order they are stored; a key's home slot is its hash scaled to
//! the table's size.

/// A free slot.
const EMPTY: u32 = u32::MAX;
/// Where a slot keeps its entry's distance from home (capped: the top value means "this far
/// or further, ask the key").
const DIST_SHIFT: u32 = 27;
const DIST_CAP: u32 = (1 << (32 - DIST_SHIFT)) - 1;
/// The node index in a slot.
const NODE: u32 = (1 << DIST_SHIFT) - 1;
/// Nodes a table can point to (the all-ones index is part of [`EMPTY`]).
pub const MAX_NODES: usize = NODE as usize;

#[derive(Debug)]
pub struct Table {
    slots: Vec<u32>,
    len: usize,
}

impl Table {
    pub fn new() -> Table {
        Table { slots: vec![EMPTY; 16], len: 0 }
    }

    /// Block keys are xxh3 outputs, already uniform: the home slot is the key scaled to the
    /// table's size (its high bits decide).
    fn home(&self, key: u64) -> usize {
        ((u128::from(key) * self.slots.len() as u128) >> 64) as usize
    }

    fn next(&self, pos: usize) -> usize {
        if pos + 1 == self.slots.len() {
            0
        } else {
            pos + 1
        }
    }

    /// How far the entry in slot `pos` sits from its home.
    fn dist(&self, pos: usize, keys: &[u64]) -> u32 {
        let v = self.slots[pos];
        match v >> DIST_SHIFT {
            DIST_CAP => {
                let home = self.home(keys[(v & NODE) as usize]);
                ((pos + self.slots.len() - home) % self.slots.len()) as u32
            }
            d => d,
        }
    }

    fn pack(node: u32, dist: u32) -> u32 {
        node | dist.min(DIST_CAP) << DIST_SHIFT
    }

    /// The slot holding `key`, if any.
    pub fn find(&self, key: u64, keys: &[u64]) -> Option<usize> {
        let mut pos = self.home(key);
        let mut d = 0;
        loop {
            let v = self.slots[pos];
            if v == EMPTY {
                return None;
            }
            let here = self.dist(pos, keys);
            if here < d {
                // `key` would have displaced this entry: it is not in the table.
                return None;
            }
            if here == d && keys[(v & NODE) as usize] == key {
                return Some(pos);
            }
            pos = self.next(pos);
            d += 1;
        }
    }

    /// The first holder node of the block in slot `pos`.
    pub fn head(&self, pos: usize) -> u32 {
        self.slots[pos] & NODE
    }

    pub fn set_head(&mut self, pos: usize, node: u32) {
        self.slots[pos] = (self.slots[pos] & !NODE) | node;
    }

    /// Whether the next insert must first rebuild the table larger ([`Table::rebuild`]).
    pub fn full(&self) -> bool {
        (self.len + 1) * 5 > self.slots.len() * 4
    }

    /// Adds `key` (not present) with `head` as its first holder node; `keys[head]` is `key`.
    pub fn insert(&mut self, key: u64, head: u32, keys: &[u64]) {
        debug_assert!(!self.full() && (head as usize) < MAX_NODES);
        let mut pos = self.home(key);
        let (mut node, mut d) = (head, 0);
        loop {
            if self.slots[pos] == EMPTY {
                self.slots[pos] = Table::pack(node, d);
                self.len += 1;
                return;
            }
            let here = self.dist(pos, keys);
            if here < d {
                // Robin Hood: the entry nearer its home gives way and moves on.
                let v = self.slots[pos];
                self.slots[pos] = Table::pack(node, d);
                (node, d) = (v & NODE, here);
            }
            pos = self.next(pos);
            d += 1;
        }
    }

    /// Empties slot `pos`, shifting the entries behind it back until one is at its home.
    pub fn remove(&mut self, pos: usize, keys: &[u64]) {
        let mut hole = pos;
        loop {
            let j = self.next(hole);
            if self.slots[j] == EMPTY || self.dist(j, keys) == 0 {
                break;
            }
            self.slots[hole] = Table::pack(self.slots[j] & NODE, self.dist(j, keys) - 1);
            hole = j;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    /// Rebuilds the table half as large again, from `heads`: every block's (key, first holder
    /// node), in any order.
    pub fn rebuild(&mut self, heads: impl Iterator<Item = (u64, u32)>, keys: &[u64]) {
        let size = (self.slots.len() + self.slots.len() / 2).max(16);
        self.slots = vec![EMPTY; size];
        self.len = 0;
        for (key, head) in heads {
            self.insert(key, head, keys);
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn bytes(&self) -> usize {
        self.slots.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(keys: &[u64]) -> Table {
        let mut t = Table::new();
        for (i, &k) in keys.iter().enumerate() {
            if t.full() {
                let heads: Vec<(u64, u32)> =
                    keys[..i].iter().enumerate().map(|(j, &k)| (k, j as u32)).collect();
                t.rebuild(heads.into_iter(), keys);
            }
            t.insert(k, i as u32, keys);
        }
        t
    }

    #[test]
    fn finds_what_was_inserted_and_nothing_after_removal_even_in_long_runs() {
        // Keys that all share their high bits collide into one run, past the capped distance;
        // removing from its middle must leave every other key findable.
        let keys: Vec<u64> = (0..200u64).map(|i| (5 << 56) | i).collect();
        let mut t = table(&keys);
        assert_eq!(t.len(), 200);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(t.head(t.find(k, &keys).expect("present")), i as u32);
        }
        for &k in keys.iter().step_by(3) {
            let pos = t.find(k, &keys).expect("present");
            t.remove(pos, &keys);
        }
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(t.find(k, &keys).is_some(), i % 3 != 0, "key {i}");
        }
        assert_eq!(t.len(), 200 - 67);
        assert!(t.find(5 << 56 | 999, &keys).is_none());
    }

    #[test]
    fn removal_keeps_wrapped_runs_findable() {
        // A run that wraps from the table's end to its start (16 slots: the top 4 bits are
        // the home slot).
        let at = |slot: u64, i: u64| (slot << 60) | i;
        let keys: Vec<u64> = vec![at(15, 0), at(15, 1), at(15, 2), at(14, 0), at(14, 1), at(0, 0)];
        let mut t = table(&keys);
        let pos = t.find(keys[3], &keys).expect("present");
        t.remove(pos, &keys);
        for k in [0, 1, 2, 4, 5] {
            assert!(t.find(keys[k], &keys).is_some(), "{k}");
        }
        assert!(t.find(keys[3], &keys).is_none());
    }

    #[test]
    fn random_keys_survive_growth_and_churn() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let keys: Vec<u64> = (0..5000).map(|_| crate::route::draw::xorshift(&mut x)).collect();
        let mut t = table(&keys);
        for &k in keys.iter().skip(1).step_by(2) {
            let pos = t.find(k, &keys).expect("present");
            t.remove(pos, &keys);
        }
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(t.find(k, &keys).map(|p| t.head(p)), (i % 2 == 0).then_some(i as u32), "key {i}");
        }
    }
}
