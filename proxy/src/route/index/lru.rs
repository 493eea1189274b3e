//! A least-recently-used set of block keys with O(1) touch, insert and pop, on a slab of
//! nodes linked by index (no allocation per entry once the slab has grown).

use std::collections::HashMap;

use super::NoHash;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
    /// When it was last touched, in the caller's clock (seconds).
    at: u32,
}

/// Keys from most (head) to least (tail) recently touched.
#[derive(Debug, Default)]
pub struct Lru {
    slots: HashMap<u64, u32, NoHash>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Lru {
    pub fn new() -> Lru {
        Lru { head: NIL, tail: NIL, ..Lru::default() }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Marks `key` most recent; returns whether it was new.
    pub fn touch(&mut self, key: u64, at: u32) -> bool {
        if let Some(&i) = self.slots.get(&key) {
            self.unlink(i);
            self.nodes[i as usize].at = at;
            self.push_front(i);
            return false;
        }
        let i = self.alloc(Node { key, prev: NIL, next: NIL, at });
        self.slots.insert(key, i);
        self.push_front(i);
        true
    }

    pub fn contains(&self, key: u64) -> bool {
        self.slots.contains_key(&key)
    }

    /// When `key` was last touched.
    pub fn touched_at(&self, key: u64) -> Option<u32> {
        self.slots.get(&key).map(|&i| self.nodes[i as usize].at)
    }

    /// Inserts a new `key` right behind `anchor` (just less recent than it); `false` when
    /// `key` is already there or `anchor` is not.
    pub fn insert_behind(&mut self, anchor: u64, key: u64, at: u32) -> bool {
        let Some(&a) = self.slots.get(&anchor) else { return false };
        if self.slots.contains_key(&key) {
            return false;
        }
        let node = Node { key, prev: a, next: self.nodes[a as usize].next, at };
        let i = self.alloc(node);
        self.slots.insert(key, i);
        match node.next {
            NIL => self.tail = i,
            n => self.nodes[n as usize].prev = i,
        }
        self.nodes[a as usize].next = i;
        true
    }

    fn alloc(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    pub fn remove(&mut self, key: u64) -> bool {
        let Some(i) = self.slots.remove(&key) else { return false };
        self.unlink(i);
        self.free.push(i);
        true
    }

    /// The least recent key and when it was touched.
    pub fn oldest(&self) -> Option<(u64, u32)> {
        (self.tail != NIL).then(|| {
            let n = &self.nodes[self.tail as usize];
            (n.key, n.at)
        })
    }

    pub fn pop_oldest(&mut self) -> Option<u64> {
        let (key, _) = self.oldest()?;
        self.remove(key);
        Some(key)
    }

    pub fn clear(&mut self) {
        *self = Lru::new();
    }

    /// Bytes held (allocated capacity).
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * (8 + 4 + 1)
            + self.nodes.capacity() * size_of::<Node>()
            + self.free.capacity() * 4
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, i: u32) {
        let old = self.head;
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = old;
        match old {
            NIL => self.tail = i,
            o => self.nodes[o as usize].prev = i,
        }
        self.head = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_touched_first() {
        let mut l = Lru::new();
        for k in 1..=4 {
            assert!(l.touch(k, k as u32));
        }
        assert!(!l.touch(1, 9), "already there");
        assert_eq!(l.oldest(), Some((2, 2)));
        assert_eq!(l.pop_oldest(), Some(2));
        assert_eq!(l.pop_oldest(), Some(3));
        assert!(l.remove(4));
        assert!(!l.remove(4));
        assert_eq!(l.pop_oldest(), Some(1));
        assert_eq!(l.pop_oldest(), None);
        assert_eq!(l.len(), 0);
        // Slots are reused.
        l.touch(5, 0);
        assert_eq!(l.nodes.len(), 4);
    }

    #[test]
    fn insert_behind_places_a_key_just_less_recent_than_its_anchor() {
        let mut l = Lru::new();
        l.touch(1, 0);
        l.touch(2, 0); // head: 2, 1
        assert!(l.insert_behind(2, 3, 5)); // 2, 3, 1
        assert!(l.insert_behind(1, 4, 5)); // 2, 3, 1, 4 (new tail)
        assert!(!l.insert_behind(9, 5, 5), "no anchor");
        assert!(!l.insert_behind(2, 1, 5), "already there");
        assert_eq!(l.touched_at(3), Some(5));
        let order: Vec<u64> = std::iter::from_fn(|| l.pop_oldest()).collect();
        assert_eq!(order, vec![4, 1, 3, 2]);
    }
}
