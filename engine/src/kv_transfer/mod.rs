//! Prefill/decode disaggregation: a replica computes a prompt's K/V and holds it; another
//! fetches it block by block and decodes.
//!
//! The HTTP side speaks vLLM's protocol, so that a proxy written for vLLM P/D deployments (its
//! `toy_proxy_server`, the Rust routers, warmpath's own) drives the bundled engine unchanged:
//!
//! 1. the proxy sends the request to a prefill replica with `"kv_transfer_params":
//!    {"do_remote_decode": true, ...}`, `max_tokens: 1`, not streamed; the replica computes the
//!    prompt, keeps its blocks for `--kv-hold-s` ([`crate::scheduler::Scheduler::release`]) and
//!    answers with `"kv_transfer_params": {"do_remote_prefill": true, "remote_host": ...,
//!    "remote_port": ..., "remote_request_id": ..., "remote_block_ids": [...], ...}`;
//! 2. the proxy sends the original request, with those `kv_transfer_params`, to a decode
//!    replica, which fetches the blocks it lacks ([`fetch`]) before queueing the request; the
//!    fetched blocks become ordinary prefix-cache hits there, so only the prompt's last tokens
//!    are computed.
//!
//! Where vLLM's NIXL connector reads remote GPU memory by block id, the bundled engine moves
//! blocks over TCP ([`serve`], [`frame`]) and names them by their chained hashes (what
//! `remote_block_ids` carries): the decode side asks only for the blocks after its own longest
//! cached prefix, and a block arrives with a checksum that must match before it is used. A
//! fetch that fails part-way keeps the blocks that arrived whole and computes the rest: the
//! answer is the same, only slower, and the failure is counted
//! (`warmpath_engine_kv_transfer_failures_total`).

pub mod fetch;
pub mod frame;
mod metrics;
pub mod params;
pub mod serve;

use std::net::SocketAddr;
use std::time::Duration;

pub use metrics::TransferMetrics;
pub use params::{KvRole, Remote};

/// How this replica takes part in transfers.
#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// Where decode replicas fetch this replica's blocks (`--kv-transfer-port`); `None`: it
    /// cannot prefill for a remote decode.
    pub advertise: Option<SocketAddr>,
    /// `remote_engine_id` in the answers (`--engine-id`).
    pub engine_id: String,
    /// How long a prefilled request's blocks wait to be fetched (`--kv-hold-s`).
    pub hold: Duration,
    /// Added per block received, to model a link slower than loopback
    /// (`--kv-transfer-delay-us-per-block`; the sim executor's blocks are tiny).
    pub delay_per_block: Duration,
    /// Longest wait for the prefill replica: connecting, and between two reads.
    pub timeout: Duration,
}

impl TransferConfig {
    /// A replica that serves no blocks and fetches without delay.
    pub fn disabled(engine_id: &str) -> TransferConfig {
        TransferConfig {
            advertise: None,
            engine_id: engine_id.to_owned(),
            hold: Duration::from_secs(60),
            delay_per_block: Duration::ZERO,
            timeout: Duration::from_secs(10),
        }
    }
}
