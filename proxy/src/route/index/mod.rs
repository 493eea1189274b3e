//! Which backend holds which prefix blocks: per block its holders, and per backend a recency
//! list of its blocks bounded by its KV capacity (optionally with a TTL).
//!
//! Two writers feed it. In approximate mode warmpath records what it routed where (a backend
//! that prefilled a prompt holds its blocks until its own LRU evicts them); in precise mode the
//! backends' KV events say what they stored and removed ([`super::events`]). The index itself
//! does not care which: both are inserts and removals.
//!
//! Blocks are inserted leaf first, so a chain's root is the most recently used of its blocks
//! and eviction takes leaves before the blocks they extend, as vLLM's own free queue does.
//! That keeps each backend's held blocks a set of whole prefixes, which is what lets the depth
//! queries ([`depths`]) find every backend's matched length with a handful of lookups instead
//! of one per block.
//!
//! Sized for fleets: one 24-byte node per (block, holder) ([`nodes`]) and a 4-byte slot per
//! block ([`table`]), about 30 bytes per held block where a map of bitsets took about 100; a block
//! tracks at most [`TRACKED_HOLDERS`] holders, and one held more widely than that counts as
//! held by every backend (a system prompt the whole fleet serves), so no lookup walks more
//! than that many.

mod depths;
mod nodes;
mod table;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use nodes::{age, Lane, Link, Nodes, NIL};
use table::Table;

/// The index's clock: ticks per second. Entries keep when they were last touched in 16 bits of
/// ticks (wrapping every 4.5 hours), fine enough to tell which backend's least recent block is
/// the stalest (see [`PrefixIndex::staleness_of`]).
pub const TICKS_PER_S: u32 = 4;

/// A held chain touched this recently (ticks: 10 s) is not touched again when a request
/// extends it: an agent loop's turns refresh their history's recency at most this often.
pub const REFRESH: u32 = 10 * TICKS_PER_S;

/// Most backends one pool's index tracks (ids are 16 bits).
pub const MAX_BACKENDS: usize = crate::config::MAX_BACKENDS_PER_POOL;

/// Holders a block keeps track of; past that it is held "everywhere" (see the module doc).
pub const TRACKED_HOLDERS: usize = 64;

/// Longest TTL (seconds): entries' ages are kept modulo 2^16 ticks, and stay below that while
/// the TTL is at most half of it (see [`PrefixIndex::insert`]).
pub const MAX_TTL_S: u64 = crate::config::MAX_INDEX_TTL_S;

#[derive(Debug)]
struct Inner {
    table: Table,
    nodes: Nodes,
    lanes: Vec<Lane>,
    /// Scratch for the depth queries: each backend's place in the set being measured.
    slot_of: Vec<u8>,
}

/// One pool's prefix index.
#[derive(Debug)]
pub struct PrefixIndex {
    inner: Mutex<Inner>,
    /// In ticks.
    ttl: Option<u32>,
    epoch: Instant,
}

/// What adding a holder to a block did.
enum Added {
    /// A node for it.
    Node(u32),
    /// The backend already held it.
    Held(u32),
    /// Not tracked: the block has as many holders as are tracked (marked held everywhere
    /// instead), or the index has no node left.
    Untracked,
}

impl PrefixIndex {
    /// `capacity`: blocks each backend holds before its LRU evicts (replaced per backend by
    /// [`PrefixIndex::set_capacity`] once its real KV capacity is known).
    pub fn new(backends: usize, capacity: usize, ttl: Option<Duration>) -> PrefixIndex {
        assert!(backends <= MAX_BACKENDS, "validated: at most {MAX_BACKENDS} backends");
        let ttl = ttl.map(|t| t.as_secs().min(MAX_TTL_S) as u32 * TICKS_PER_S);
        PrefixIndex {
            inner: Mutex::new(Inner {
                table: Table::new(),
                nodes: Nodes::default(),
                lanes: vec![Lane::new(capacity); backends],
                slot_of: vec![depths::NOT_MEASURED; backends],
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
        (self.epoch.elapsed().as_millis() * u128::from(TICKS_PER_S) / 1000) as u32
    }

    pub fn set_capacity(&self, backend: usize, blocks: usize) {
        let mut g = self.lock();
        g.lanes[backend].capacity = blocks.max(1);
        g.evict(backend, None, 0);
    }

    /// `backend` holds `hashes` (a chain, root first) now; then the oldest blocks beyond its
    /// capacity or older than the TTL are evicted.
    ///
    /// The chain is touched leaf first, so each block is more recent than its descendants. When
    /// the part the backend already holds was touched within [`REFRESH`], only the new
    /// blocks are added, each right behind its parent in LRU order, which keeps that order and
    /// costs O(log n + new blocks) instead of O(n): an agent loop resending a long conversation
    /// pays for its new turn only.
    ///
    /// Ages are kept modulo 2^16 ticks. A backend with no insert for longer than the TTL has
    /// nothing left that is younger than it, so it is emptied first; otherwise every entry is
    /// younger than TTL + the time since its last insert, at most 2 × [`MAX_TTL_S`], and the
    /// 16-bit ages do not wrap.
    pub fn insert(&self, backend: usize, hashes: &[u64]) {
        self.insert_at(backend, hashes, self.now());
    }

    /// [`PrefixIndex::insert`] at tick `now` of the index's clock (16 bits of it matter).
    pub(crate) fn insert_at(&self, backend: usize, hashes: &[u64], now: u32) {
        let mut g = self.lock();
        if let Some(ttl) = self.ttl {
            if now.saturating_sub(g.lanes[backend].last_insert) > ttl {
                g.clear(backend);
            }
        }
        g.lanes[backend].last_insert = now;
        // Out of nodes (2^27 held blocks): this backend's oldest make room, and what still does
        // not fit is cut from the chain's end, so what is tracked stays a whole prefix.
        while g.nodes.available() < hashes.len() && g.lanes[backend].tail != NIL {
            let oldest = g.lanes[backend].tail;
            g.drop_node(oldest);
        }
        let hashes = &hashes[..hashes.len().min(g.nodes.available())];
        let held = g.held_prefix(backend, hashes);
        // The last held block's node (none where that block is held everywhere, untracked).
        let last = held.checked_sub(1).and_then(|k| g.node_of(hashes[k], backend));
        let fresh = held > 0 && last.is_none_or(|i| age(now, g.nodes.links[i as usize].at) < REFRESH);
        if fresh {
            let mut anchor = last.unwrap_or(NIL);
            for &h in &hashes[held..] {
                match g.add(h, backend, now) {
                    Added::Node(i) => {
                        let Inner { nodes, lanes, .. } = &mut *g;
                        nodes.link_after(&mut lanes[backend], anchor, i);
                        anchor = i;
                    }
                    Added::Held(i) => anchor = i,
                    Added::Untracked => {}
                }
            }
        } else {
            for &h in hashes.iter().rev() {
                let added = g.add(h, backend, now);
                let Inner { nodes, lanes, .. } = &mut *g;
                match added {
                    Added::Node(i) => nodes.link_after(&mut lanes[backend], NIL, i),
                    Added::Held(i) => nodes.touch(&mut lanes[backend], i, now as u16),
                    Added::Untracked => {}
                }
            }
        }
        g.evict(backend, self.ttl, now);
    }

    /// `backend` no longer holds `hashes`.
    pub fn remove(&self, backend: usize, hashes: &[u64]) {
        let mut g = self.lock();
        for &h in hashes {
            if let Some(i) = g.node_of(h, backend) {
                g.drop_node(i);
            }
        }
    }

    /// `backend` holds nothing (it cleared its cache, or its events cannot be trusted).
    pub fn clear(&self, backend: usize) {
        self.lock().clear(backend);
    }

    /// The backends tracked as holding `hash`, and whether it is held more widely than that.
    #[cfg(test)]
    fn holders(&self, hash: u64) -> (Vec<usize>, bool) {
        let g = self.lock();
        let Some(pos) = g.table.find(hash, &g.nodes.keys) else { return (Vec::new(), false) };
        let mut out = Vec::new();
        g.each_holder(pos, |b| out.push(b));
        (out, g.saturated(pos))
    }

    /// How stale what each of `backends` would evict next is: ticks since its least recent
    /// block was touched, `u32::MAX` while it has room. New blocks placed where this is largest
    /// evict what the whole fleet used least recently, as one LRU over every backend's memory
    /// would.
    pub fn staleness_of(&self, backends: &[usize]) -> Vec<u32> {
        let now = self.now();
        let g = self.lock();
        backends
            .iter()
            .map(|&b| {
                let lane = g.lanes[b];
                match lane.len < lane.capacity || lane.tail == NIL {
                    true => u32::MAX,
                    false => age(now, g.nodes.links[lane.tail as usize].at),
                }
            })
            .collect()
    }

    /// Blocks held per backend.
    pub fn blocks(&self) -> Vec<usize> {
        self.lock().lanes.iter().map(|l| l.len).collect()
    }

    /// Distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.lock().table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the index holds (allocated capacity of its tables).
    pub fn bytes(&self) -> usize {
        let g = self.lock();
        g.table.bytes() + g.nodes.bytes() + g.lanes.capacity() * size_of::<Lane>() + g.slot_of.capacity()
    }
}

impl Inner {
    /// `backend`'s node for block `key`.
    fn node_of(&self, key: u64, backend: usize) -> Option<u32> {
        let pos = self.table.find(key, &self.nodes.keys)?;
        let mut i = self.table.head(pos);
        while i != NIL {
            let l = &self.nodes.links[i as usize];
            if usize::from(l.backend) == backend {
                return Some(i);
            }
            i = l.next_holder();
        }
        None
    }

    /// Whether the block in slot `pos` has more holders than are tracked.
    fn saturated(&self, pos: usize) -> bool {
        self.nodes.links[self.table.head(pos) as usize].saturated()
    }

    /// Whether `backend` holds `key` as far as routing can tell: tracked, or held everywhere.
    fn holds(&self, key: u64, backend: usize) -> bool {
        match self.table.find(key, &self.nodes.keys) {
            None => false,
            Some(pos) => self.saturated(pos) || self.node_of(key, backend).is_some(),
        }
    }

    fn each_holder(&self, pos: usize, mut f: impl FnMut(usize)) {
        let mut i = self.table.head(pos);
        while i != NIL {
            let l = &self.nodes.links[i as usize];
            f(usize::from(l.backend));
            i = l.next_holder();
        }
    }

    /// Makes `backend` a holder of `key` (not yet on its recency list).
    fn add(&mut self, key: u64, backend: usize, now: u32) -> Added {
        let link = Link::new(backend as u16, now as u16);
        let Some(pos) = self.table.find(key, &self.nodes.keys) else {
            if self.table.full() {
                self.table.rebuild(self.nodes.heads(), &self.nodes.keys);
            }
            let Some(i) = self.nodes.alloc(key, link) else { return Added::Untracked };
            self.nodes.links[i as usize].lead(false);
            self.table.insert(key, i, &self.nodes.keys);
            return Added::Node(i);
        };
        let head = self.table.head(pos);
        let mut count = 0;
        let mut i = head;
        while i != NIL {
            let l = &self.nodes.links[i as usize];
            if usize::from(l.backend) == backend {
                return Added::Held(i);
            }
            count += 1;
            i = l.next_holder();
        }
        if count >= TRACKED_HOLDERS {
            self.nodes.links[head as usize].set_saturated();
            return Added::Untracked;
        }
        // The new node heads the list from now on.
        let saturated = self.nodes.links[head as usize].saturated();
        let Some(i) = self.nodes.alloc(key, link) else { return Added::Untracked };
        let l = &mut self.nodes.links[i as usize];
        l.lead(saturated);
        l.set_next_holder(head);
        self.nodes.links[head as usize].follow();
        self.table.set_head(pos, i);
        Added::Node(i)
    }

    /// Removes node `i` from its backend's recency list and its block's holders.
    fn drop_node(&mut self, i: u32) {
        let link = self.nodes.links[i as usize];
        let key = self.nodes.keys[i as usize];
        self.nodes.unlink(&mut self.lanes[usize::from(link.backend)], i);
        let pos = self.table.find(key, &self.nodes.keys).expect("a held block is in the table");
        let head = self.table.head(pos);
        if head == i {
            match link.next_holder() {
                NIL => self.table.remove(pos, &self.nodes.keys),
                next => {
                    self.nodes.links[next as usize].lead(link.saturated());
                    self.table.set_head(pos, next);
                }
            }
        } else {
            let mut p = head;
            while self.nodes.links[p as usize].next_holder() != i {
                p = self.nodes.links[p as usize].next_holder();
            }
            self.nodes.links[p as usize].set_next_holder(link.next_holder());
        }
        self.nodes.release(i);
    }

    fn clear(&mut self, backend: usize) {
        while self.lanes[backend].tail != NIL {
            self.drop_node(self.lanes[backend].tail);
        }
    }

    /// Evicts `backend`'s oldest blocks beyond its capacity, and those older than `ttl` ticks.
    fn evict(&mut self, backend: usize, ttl: Option<u32>, now: u32) {
        loop {
            let lane = self.lanes[backend];
            if lane.tail == NIL {
                break;
            }
            let over = lane.len > lane.capacity;
            let expired = ttl.is_some_and(|ttl| age(now, self.nodes.links[lane.tail as usize].at) > ttl);
            if !(over || expired) {
                break;
            }
            self.drop_node(lane.tail);
        }
    }

    /// How many leading blocks of `hashes` `backend` holds, by bisection (held blocks are whole
    /// prefixes, see the module doc).
    fn held_prefix(&self, backend: usize, hashes: &[u64]) -> usize {
        let (mut lo, mut hi) = (0, hashes.len());
        if hi > 0 && self.holds(hashes[hi - 1], backend) {
            return hi;
        }
        // Invariant: the first `lo` are held, the first `hi` are not all held.
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if self.holds(hashes[mid - 1], backend) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests;
