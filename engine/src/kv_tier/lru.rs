//! The order a bounded tier drops its blocks in: least recently stored or loaded first.

use std::collections::{BTreeMap, HashMap};

use warmpath_wire::prefix::BlockHash;

/// Blocks by recency.
#[derive(Default)]
pub struct Lru {
    /// Per block, when it was last used: its place in `order`.
    at: HashMap<BlockHash, u64>,
    /// Least recently used first.
    order: BTreeMap<u64, BlockHash>,
    tick: u64,
}

impl Lru {
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn contains(&self, h: BlockHash) -> bool {
        self.at.contains_key(&h)
    }

    /// Makes `h` the most recently used, adding it where it is new.
    pub fn touch(&mut self, h: BlockHash) {
        self.tick += 1;
        if let Some(old) = self.at.insert(h, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, h);
    }

    /// Takes `h` out; false where it was not in.
    pub fn remove(&mut self, h: BlockHash) -> bool {
        match self.at.remove(&h) {
            Some(t) => self.order.remove(&t).is_some(),
            None => false,
        }
    }

    /// Takes the least recently used block out.
    pub fn pop_oldest(&mut self) -> Option<BlockHash> {
        let (_, h) = self.order.pop_first()?;
        self.at.remove(&h);
        Some(h)
    }

    /// Every block, in no order.
    pub fn blocks(&self) -> Vec<BlockHash> {
        self.at.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_touched_goes_first() {
        let mut l = Lru::default();
        for h in [1, 2, 3] {
            l.touch(h);
        }
        l.touch(1);
        assert!(l.remove(3));
        assert!(!l.remove(3));
        assert_eq!((l.pop_oldest(), l.pop_oldest(), l.pop_oldest()), (Some(2), Some(1), None));
    }
}
