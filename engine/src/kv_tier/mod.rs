//! KV tiers beyond the block pool: where a block the pool no longer holds (or never computed)
//! is found again instead of recomputed.
//!
//! - [`host`]: host memory of this replica (vLLM's CPU offloading, LMCache's local tier): the
//!   blocks the pool evicts, loaded at admission.
//! - [`disk`]: local disk below it (LMCache's local disk backend): what host memory drops, or
//!   what the pool evicts where there is no host tier; kept across restarts.
//! - [`local`]: the two in order, as the scheduler uses them.
//! - [`shared`]: a Redis the fleet shares (LMCache's remote backend): every block a replica
//!   computes is written there, and a replica receiving a prompt loads the blocks past its own
//!   cached prefix that any replica computed.

pub mod disk;
pub mod host;
pub mod local;
mod lru;
mod metrics;
pub mod shared;

pub use disk::DiskTier;
pub use host::{HostTier, TierStats};
pub use local::LocalTiers;
pub use metrics::{SharedMetrics, TierMetrics};
pub use shared::{SharedConfig, SharedTier};

use warmpath_wire::prefix::BlockHash;

/// What a replica puts below its block pool besides the host tier (which the scheduler's
/// config sizes): a disk tier, and the sink of the shared tier.
#[derive(Default)]
pub struct Attached {
    pub disk: Option<DiskTier>,
    pub shared: Option<std::sync::Arc<dyn BlockSink>>,
}

/// Where the scheduler writes the blocks it computes (the shared tier), from the step loop:
/// neither call may block.
pub trait BlockSink: Send + Sync {
    /// Whether `hash` is worth offering (it was not written lately).
    fn wants(&self, hash: BlockHash) -> bool;
    /// Queues `data`, the K/V of the block `hash`, to be written; dropped when the queue is full.
    fn offer(&self, hash: BlockHash, data: Vec<u8>);
    /// Forgets which blocks were written lately (the prefix cache was reset: the tier may have
    /// been emptied too, and every block is offered again).
    fn forget(&self);
}

/// The namespace blocks are kept under in tiers that outlive a process or are shared: what
/// makes two replicas' blocks interchangeable (the model, the block size, the block's bytes).
pub fn namespace(model: &str, block_size: usize, block_bytes: usize) -> String {
    let id = format!("{model}/{block_size}/{block_bytes}");
    format!("warmpath-kv-{:016x}", xxhash_rust::xxh3::xxh3_64(id.as_bytes()))
}
