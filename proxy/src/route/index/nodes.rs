//! The index's one record: a node per (block, backend holding it), 24 bytes, in two parallel
//! arrays (the keys, and the links), each node on two lists at once — its backend's recency
//! list (most recent first) and its block's list of holders. Freed nodes are reused; the arrays
//! grow by a sixteenth at a time (glibc moves a large one with `mremap`, not by copying), so
//! what they allocate stays near what they hold.

pub const NIL: u32 = u32::MAX;

/// Everything of a node but its key.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    /// Neighbours on the backend's recency list.
    pub prev: u32,
    pub next: u32,
    /// The next holder of the same block, and two flags: this node heads its block's list, and
    /// (on the head) the block has more holders than are tracked.
    holder: u32,
    pub backend: u16,
    /// When the backend last touched the block: ticks of the index's clock, modulo 2^16
    /// (compared by wrapping difference; see [`age`]).
    pub at: u16,
}

const HEAD: u32 = 1 << 31;
const SATURATED: u32 = 1 << 30;
const HOLDER: u32 = SATURATED - 1;

impl Link {
    /// A node of `backend`'s, touched at `at`, on no list yet.
    pub fn new(backend: u16, at: u16) -> Link {
        Link { prev: NIL, next: NIL, holder: HOLDER, backend, at }
    }

    pub fn next_holder(&self) -> u32 {
        match self.holder & HOLDER {
            HOLDER => NIL,
            i => i,
        }
    }

    pub fn set_next_holder(&mut self, i: u32) {
        self.holder = (self.holder & !HOLDER) | (i & HOLDER);
    }

    pub fn is_head(&self) -> bool {
        self.holder & HEAD != 0
    }

    pub fn saturated(&self) -> bool {
        self.holder & SATURATED != 0
    }

    /// Makes this node its block's head, saturated or not.
    pub fn lead(&mut self, saturated: bool) {
        self.holder = (self.holder & HOLDER) | HEAD | if saturated { SATURATED } else { 0 };
    }

    /// No longer its block's head.
    pub fn follow(&mut self) {
        self.holder &= HOLDER;
    }

    pub fn set_saturated(&mut self) {
        self.holder |= SATURATED;
    }
}

/// One backend's recency list.
#[derive(Debug, Clone, Copy)]
pub struct Lane {
    pub head: u32,
    pub tail: u32,
    pub len: usize,
    pub capacity: usize,
    /// When a block was last inserted for this backend (ticks of the index's clock).
    pub last_insert: u32,
}

impl Lane {
    pub fn new(capacity: usize) -> Lane {
        Lane { head: NIL, tail: NIL, len: 0, capacity: capacity.max(1), last_insert: 0 }
    }
}

/// Ticks between `at` and `now` on the 16-bit clock.
pub fn age(now: u32, at: u16) -> u32 {
    u32::from((now as u16).wrapping_sub(at))
}

#[derive(Debug)]
pub struct Nodes {
    pub keys: Vec<u64>,
    pub links: Vec<Link>,
    /// First free node (chained through `next`), and how many are free.
    free: Option<u32>,
    free_len: usize,
    /// Most nodes (a test lowers it).
    limit: usize,
}

impl Default for Nodes {
    fn default() -> Nodes {
        Nodes { keys: Vec::new(), links: Vec::new(), free: None, free_len: 0, limit: super::table::MAX_NODES }
    }
}

impl Nodes {
    #[cfg(test)]
    pub fn with_limit(limit: usize) -> Nodes {
        Nodes { limit, ..Nodes::default() }
    }

    /// A node for `key`, or `None` when [`MAX_NODES`](super::table::MAX_NODES) are in use
    /// (2^27 held blocks, about 3.7 GiB; see [`Nodes::available`]).
    pub fn alloc(&mut self, key: u64, link: Link) -> Option<u32> {
        if let Some(i) = self.free {
            let next = self.links[i as usize].next;
            self.free = (next != NIL).then_some(next);
            self.free_len -= 1;
            self.keys[i as usize] = key;
            self.links[i as usize] = link;
            return Some(i);
        }
        let n = self.keys.len();
        if n >= self.limit {
            return None;
        }
        if n == self.keys.capacity() {
            let more = (n / 16).max(4096);
            self.keys.reserve_exact(more);
            self.links.reserve_exact(more);
        }
        self.keys.push(key);
        self.links.push(link);
        Some(n as u32)
    }

    pub fn release(&mut self, i: u32) {
        self.links[i as usize] = Link { next: self.free.unwrap_or(NIL), ..Link::new(0, 0) };
        self.free = Some(i);
        self.free_len += 1;
    }

    /// Nodes that can still be had.
    pub fn available(&self) -> usize {
        self.free_len + self.limit.saturating_sub(self.keys.len())
    }

    /// Every block's (key, head node), in storage order (what the table is rebuilt from).
    pub fn heads(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.links.iter().enumerate().filter(|(_, l)| l.is_head()).map(|(i, _)| (self.keys[i], i as u32))
    }

    pub fn bytes(&self) -> usize {
        self.keys.capacity() * size_of::<u64>() + self.links.capacity() * size_of::<Link>()
    }

    /// Puts node `i` on `lane` right behind `prev` (just less recent than it), or first when
    /// `prev` is [`NIL`].
    pub fn link_after(&mut self, lane: &mut Lane, prev: u32, i: u32) {
        let next = match prev {
            NIL => lane.head,
            p => self.links[p as usize].next,
        };
        let l = &mut self.links[i as usize];
        l.prev = prev;
        l.next = next;
        match next {
            NIL => lane.tail = i,
            n => self.links[n as usize].prev = i,
        }
        match prev {
            NIL => lane.head = i,
            p => self.links[p as usize].next = i,
        }
        lane.len += 1;
    }

    /// Moves node `i` to the front of `lane`, touched at `at`.
    pub fn touch(&mut self, lane: &mut Lane, i: u32, at: u16) {
        self.unlink(lane, i);
        self.links[i as usize].at = at;
        self.link_after(lane, NIL, i);
    }

    pub fn unlink(&mut self, lane: &mut Lane, i: u32) {
        let Link { prev, next, .. } = self.links[i as usize];
        match prev {
            NIL => lane.head = next,
            p => self.links[p as usize].next = next,
        }
        match next {
            NIL => lane.tail = prev,
            n => self.links[n as usize].prev = prev,
        }
        lane.len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(backend: u16) -> Link {
        Link::new(backend, 0)
    }

    fn order(n: &Nodes, lane: &Lane) -> Vec<u64> {
        let mut out = Vec::new();
        let mut i = lane.head;
        while i != NIL {
            out.push(n.keys[i as usize]);
            i = n.links[i as usize].next;
        }
        out
    }

    #[test]
    fn lanes_keep_recency_order_and_nodes_are_reused() {
        let mut n = Nodes::default();
        let mut lane = Lane::new(10);
        let a = n.alloc(1, link(0)).expect("room");
        let b = n.alloc(2, link(0)).expect("room");
        let c = n.alloc(3, link(0)).expect("room");
        n.link_after(&mut lane, NIL, a);
        n.link_after(&mut lane, NIL, b); // 2 1
        n.link_after(&mut lane, b, c); // 2 3 1
        assert_eq!(order(&n, &lane), vec![2, 3, 1]);
        n.unlink(&mut lane, a);
        assert_eq!((order(&n, &lane), lane.len), (vec![2, 3], 2));
        assert_eq!(n.keys[lane.tail as usize], 3);
        n.touch(&mut lane, c, 9);
        assert_eq!((order(&n, &lane), n.links[c as usize].at), (vec![3, 2], 9));
        n.links[a as usize].lead(true);
        assert_eq!(n.heads().collect::<Vec<_>>(), vec![(1, a)]);
        n.release(a);
        assert_eq!(n.heads().count(), 0, "a freed node heads nothing");
        assert_eq!(n.alloc(4, link(1)), Some(a), "freed node reused");
        assert_eq!(n.keys.len(), 3);
        let mut small = Nodes::with_limit(1);
        assert_eq!(small.available(), 1);
        assert!(small.alloc(1, link(0)).is_some() && small.alloc(2, link(0)).is_none(), "no room: none");
        assert_eq!(small.available(), 0);
        small.release(0);
        assert_eq!(small.available(), 1);
    }

    #[test]
    fn holder_links_keep_their_flags_apart() {
        let mut l = link(3);
        assert_eq!(l.next_holder(), NIL);
        l.lead(false);
        l.set_next_holder(7);
        assert!(l.is_head() && !l.saturated() && l.next_holder() == 7);
        l.set_saturated();
        l.set_next_holder(NIL);
        assert!(l.is_head() && l.saturated() && l.next_holder() == NIL);
        l.set_next_holder(9);
        l.follow();
        assert!(!l.is_head() && !l.saturated() && l.next_holder() == 9);
    }

    #[test]
    fn ages_wrap_with_the_clock() {
        assert_eq!(age(70_000, (69_990u32 as u16).wrapping_add(0)), 10);
        assert_eq!(age(65_540, 65_530u32 as u16), 10);
        assert_eq!(age(5, 5), 0);
    }
}
