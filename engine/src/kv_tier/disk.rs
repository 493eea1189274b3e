//! A KV tier on local disk (LMCache's local disk backend): one file per block, named by its
//! chained hash, under a directory of the model's namespace. Below the host tier where there is
//! one (what host memory drops goes here), else it takes what the pool evicts.
//!
//! Bounded (`--kv-tier-disk-blocks`), least recently used first out. Files outlive the process:
//! a replica restarted on the same directory finds its blocks again (the oldest dropped past
//! the bound). A file holds the block's hash and the xxh3 of its bytes before them, so a file
//! that is damaged, truncated or another block's is deleted and never loaded. A directory that
//! goes away or a disk that fills costs only the tier: the write fails (counted), the prompt
//! is computed.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use warmpath_wire::prefix::BlockHash;

use super::lru::Lru;
use super::shared::{pack, unpack};
use super::TierStats;

/// Blocks on disk, by hash.
pub struct DiskTier {
    dir: PathBuf,
    capacity: usize,
    /// The blocks it has files for.
    lru: Lru,
    stats: TierStats,
}

impl DiskTier {
    /// A tier of at most `capacity` blocks in `dir` (created), with the blocks already there,
    /// most recently written last.
    pub fn open(dir: &Path, capacity: usize) -> std::io::Result<DiskTier> {
        fs::create_dir_all(dir)?;
        let mut found: Vec<(std::time::SystemTime, BlockHash)> = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(hash) = name.to_str().and_then(parse_name) else { continue };
            let at = entry.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
            found.push((at, hash));
        }
        found.sort();
        let mut t =
            DiskTier { dir: dir.to_owned(), capacity, lru: Lru::default(), stats: TierStats::default() };
        let extra = found.len().saturating_sub(capacity);
        for (_, h) in &found[..extra] {
            let _ = fs::remove_file(t.path(*h));
        }
        for (_, h) in &found[extra..] {
            t.lru.touch(*h);
        }
        Ok(t)
    }

    fn path(&self, h: BlockHash) -> PathBuf {
        self.dir.join(format!("{h:016x}.kv"))
    }

    fn forget(&mut self, h: BlockHash) {
        self.lru.remove(h);
        let _ = fs::remove_file(self.path(h));
    }

    pub fn len(&self) -> usize {
        self.lru.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lru.len() == 0
    }

    pub fn contains(&self, h: BlockHash) -> bool {
        self.lru.contains(h)
    }

    /// Writes `data` under `h`, dropping the least recently used block when full; returns the
    /// blocks dropped. A write that fails (the directory gone, the disk full) is counted and
    /// leaves nothing behind.
    pub fn put(&mut self, h: BlockHash, data: &[u8]) -> Vec<BlockHash> {
        let mut dropped = Vec::new();
        if self.capacity == 0 || data.is_empty() {
            return dropped;
        }
        if self.lru.contains(h) {
            self.lru.touch(h);
            return dropped;
        }
        while self.lru.len() >= self.capacity {
            let Some(old) = self.lru.pop_oldest() else { break };
            let _ = fs::remove_file(self.path(old));
            self.stats.evicted += 1;
            dropped.push(old);
        }
        // Written whole under a temporary name, then renamed: a crash leaves no half block.
        let (tmp, path) = (self.dir.join(format!("{h:016x}.tmp")), self.path(h));
        let written = fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&pack(h, data)))
            .and_then(|()| fs::rename(&tmp, &path));
        match written {
            Ok(()) => {
                self.lru.touch(h);
                self.stats.stored += 1;
            }
            Err(e) => {
                tracing::warn!(error = %e, dir = %self.dir.display(), "disk KV tier write failed");
                let _ = fs::remove_file(&tmp);
                self.stats.failed += 1;
            }
        }
        dropped
    }

    /// The bytes kept under `h`, checked; a damaged or missing file is forgotten and `None`
    /// returned.
    pub fn get(&mut self, h: BlockHash) -> Option<Vec<u8>> {
        if !self.lru.contains(h) {
            return None;
        }
        let data = match fs::read(self.path(h)) {
            Ok(v) => unpack(h, v),
            Err(_) => {
                self.stats.failed += 1;
                self.forget(h);
                return None;
            }
        };
        match data {
            Some(d) => {
                self.lru.touch(h);
                self.stats.loaded += 1;
                Some(d)
            }
            None => {
                self.stats.corrupt += 1;
                self.forget(h);
                None
            }
        }
    }

    /// Counts since the last call.
    pub fn take_stats(&mut self) -> TierStats {
        std::mem::take(&mut self.stats)
    }

    /// Deletes every block.
    pub fn clear(&mut self) {
        for h in self.lru.blocks() {
            self.forget(h);
        }
    }
}

fn parse_name(name: &str) -> Option<BlockHash> {
    let hex = name.strip_suffix(".kv")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wp-disk-tier-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn blocks_come_back_checked_and_the_oldest_go_first() {
        let d = dir("lru");
        let mut t = DiskTier::open(&d, 2).expect("open");
        t.put(1, &[1, 1]);
        t.put(2, &[2, 2]);
        assert_eq!(t.get(1), Some(vec![1, 1]), "1 is now the newer");
        t.put(3, &[3, 3]);
        assert!(t.contains(1) && t.contains(3) && !t.contains(2));
        assert!(!d.join(format!("{:016x}.kv", 2u64)).exists(), "its file deleted");
        assert_eq!(t.take_stats(), TierStats { stored: 3, loaded: 1, evicted: 1, ..TierStats::default() });
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_damaged_file_is_deleted_never_loaded() {
        let d = dir("damaged");
        let mut t = DiskTier::open(&d, 4).expect("open");
        t.put(7, &[1, 2, 3]);
        let path = d.join(format!("{:016x}.kv", 7u64));
        let mut bytes = fs::read(&path).expect("file");
        *bytes.last_mut().expect("a byte") ^= 1;
        fs::write(&path, bytes).expect("write");
        assert_eq!(t.get(7), None);
        assert!(!t.contains(7) && !path.exists(), "forgotten and deleted");
        assert_eq!(t.take_stats().corrupt, 1);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_reopened_tier_finds_its_blocks_and_keeps_the_newest_that_fit() {
        let d = dir("reopen");
        let mut t = DiskTier::open(&d, 8).expect("open");
        for h in 1..=3u64 {
            t.put(h, &[h as u8; 4]);
            // Distinct modification times, so the reopened order is the writing order.
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        drop(t);
        let mut t = DiskTier::open(&d, 2).expect("reopen");
        assert_eq!(t.len(), 2);
        assert!(!t.contains(1), "the oldest dropped past the bound");
        assert_eq!(t.get(3), Some(vec![3; 4]));
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_directory_gone_costs_the_writes_only() {
        let d = dir("gone");
        let mut t = DiskTier::open(&d, 4).expect("open");
        t.put(1, &[1]);
        fs::remove_dir_all(&d).expect("remove");
        t.put(2, &[2]);
        assert_eq!(t.get(1), None, "its file went with the directory");
        assert!(!t.contains(2));
        let st = t.take_stats();
        assert_eq!((st.stored, st.failed), (1, 2), "{st:?}");
    }
}
