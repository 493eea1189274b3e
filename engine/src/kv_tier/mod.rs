//! KV tiers beyond the block pool: where a block the pool no longer holds (or never computed)
//! is found again instead of recomputed.
//!
//! - [`host`]: host memory of this replica (vLLM's CPU offloading, LMCache's local tier): the
//!   blocks the pool evicts, loaded at admission.
//! - [`shared`]: a Redis the fleet shares (LMCache's remote backend): every block a replica
//!   computes is written there, and a replica receiving a prompt loads the blocks past its own
//!   cached prefix that any replica computed.

pub mod host;
mod metrics;
pub mod shared;

pub use host::{HostTier, TierStats};
pub use metrics::SharedMetrics;
pub use shared::{SharedConfig, SharedTier};

use warmpath_wire::prefix::BlockHash;

/// Where the scheduler writes the blocks it computes (the shared tier), from the step loop:
/// neither call may block.
pub trait BlockSink: Send + Sync {
    /// Whether `hash` is worth offering (it was not written lately).
    fn wants(&self, hash: BlockHash) -> bool;
    /// Queues `data`, the K/V of the block `hash`, to be written; dropped when the queue is full.
    fn offer(&self, hash: BlockHash, data: Vec<u8>);
}
