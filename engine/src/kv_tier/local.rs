//! A replica's own tiers below its block pool, in order: host memory, then local disk. What the
//! pool evicts goes to the first; what host memory drops goes to disk; a lookup tries both.
//! Where blocks came and went is kept for KV events ([`LocalTiers::take_changes`]: vLLM's
//! `medium` `CPU` and `DISK`), so that a router following them knows what a tier holds.

use warmpath_wire::prefix::BlockHash;

use super::{DiskTier, HostTier, TierStats};

/// vLLM's names of the media, as KV events carry them.
pub const CPU: &str = "CPU";
pub const DISK: &str = "DISK";

/// Blocks that entered (`stored`) or left one medium.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub medium: &'static str,
    pub stored: bool,
    pub hashes: Vec<BlockHash>,
}

/// Host memory and/or disk; at least one.
pub struct LocalTiers {
    host: Option<HostTier>,
    host_capacity: usize,
    disk: Option<DiskTier>,
    changes: Vec<Change>,
}

impl LocalTiers {
    /// `None` when there is neither.
    pub fn new(host_capacity: usize, disk: Option<DiskTier>) -> Option<LocalTiers> {
        let host = (host_capacity > 0).then(|| HostTier::new(host_capacity));
        (host.is_some() || disk.is_some()).then_some(LocalTiers {
            host,
            host_capacity,
            disk,
            changes: Vec::new(),
        })
    }

    pub fn contains(&self, h: BlockHash) -> bool {
        self.host.as_ref().is_some_and(|t| t.contains(h)) || self.disk.as_ref().is_some_and(|t| t.contains(h))
    }

    /// Keeps a block the pool evicted.
    pub fn put(&mut self, h: BlockHash, data: Vec<u8>) {
        match (&mut self.host, &mut self.disk) {
            (Some(host), _) => {
                let dropped = host.put(h, data);
                let stored = host.contains(h);
                for (old, bytes) in dropped {
                    self.note(CPU, false, old);
                    self.put_disk(old, &bytes);
                }
                if stored {
                    self.note(CPU, true, h);
                }
            }
            (None, Some(_)) => self.put_disk(h, &data),
            (None, None) => {}
        }
    }

    fn put_disk(&mut self, h: BlockHash, data: &[u8]) {
        let Some(disk) = &mut self.disk else { return };
        let dropped = disk.put(h, data);
        let stored = disk.contains(h);
        for old in dropped {
            self.note(DISK, false, old);
        }
        if stored {
            self.note(DISK, true, h);
        }
    }

    /// Records that `h` entered or left `medium`, joined to the last change where it is alike.
    fn note(&mut self, medium: &'static str, stored: bool, h: BlockHash) {
        match self.changes.last_mut() {
            Some(c) if c.medium == medium && c.stored == stored => c.hashes.push(h),
            _ => self.changes.push(Change { medium, stored, hashes: vec![h] }),
        }
    }

    /// What entered and left each medium since the last call, in order.
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// Hands the bytes kept under `h`, checked, to `write`; false when no tier has them whole
    /// or `write` refused them.
    pub fn load(&mut self, h: BlockHash, write: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        if let Some(data) = self.host.as_mut().and_then(|t| t.get(h)) {
            return write(data);
        }
        match self.disk.as_mut().and_then(|t| t.get(h)) {
            Some(data) => write(&data),
            None => false,
        }
    }

    /// Per medium (`cpu`, `disk`): blocks held and what it did since the last call.
    pub fn states(&mut self) -> Vec<(&'static str, usize, TierStats)> {
        let mut v = Vec::new();
        if let Some(t) = &mut self.host {
            v.push(("cpu", t.len(), t.take_stats()));
        }
        if let Some(t) = &mut self.disk {
            v.push(("disk", t.len(), t.take_stats()));
        }
        v
    }

    /// Test hook: flips a bit of the host tier's block `hash`.
    #[cfg(test)]
    pub fn damage(&mut self, hash: BlockHash) {
        if let Some(t) = &mut self.host {
            t.damage(hash);
        }
    }

    /// Forgets every block (the prefix cache was reset).
    pub fn reset(&mut self) {
        if self.host.is_some() {
            self.host = Some(HostTier::new(self.host_capacity));
        }
        if let Some(d) = &mut self.disk {
            d.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_host_memory_drops_goes_to_disk_and_comes_back() {
        let dir = std::env::temp_dir().join(format!("wp-local-tiers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let disk = DiskTier::open(&dir, 8).expect("open");
        let mut t = LocalTiers::new(1, Some(disk)).expect("tiers");
        t.put(1, vec![1, 1]);
        t.put(2, vec![2, 2]);
        assert!(t.contains(1) && t.contains(2), "1 went to disk");
        let mut got = Vec::new();
        assert!(t.load(1, &mut |d| {
            got = d.to_vec();
            true
        }));
        assert_eq!(got, vec![1, 1]);
        let states = t.states();
        assert_eq!(states.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>(), vec![("cpu", 1), ("disk", 1)]);
        let change = |medium, stored, hashes: &[u64]| Change { medium, stored, hashes: hashes.to_vec() };
        assert_eq!(
            t.take_changes(),
            vec![
                change(CPU, true, &[1]),
                change(CPU, false, &[1]),
                change(DISK, true, &[1]),
                change(CPU, true, &[2])
            ],
            "for KV events"
        );
        assert_eq!((states[1].2.stored, states[1].2.loaded), (1, 1));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
