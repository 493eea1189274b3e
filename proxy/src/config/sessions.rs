//! `[session]` (the conversation store of the Responses API) and `[websocket]` (Responses
//! WebSocket mode).

use serde::Deserialize;

use super::RedisUrl;

/// `[session]`: the conversation store behind `previous_response_id` (Responses over HTTP and
/// WebSocket).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConversationConfig {
    pub store: StoreKind,
    /// Memory store: bytes of conversations kept, in MiB.
    pub max_mib: u64,
    /// Seconds a stored response can be continued after it was made.
    pub ttl_s: u64,
    /// Seconds a conversation (`/v1/conversations`) is kept after its last use.
    pub conversation_ttl_s: u64,
    /// Background responses (`background: true`) one API key may have running at once.
    pub max_background_per_key: usize,
    /// Redis store: `redis://[:password@]host:port[/db]`.
    pub redis_url: Option<RedisUrl>,
    /// Redis store: the most a command may take, connecting included.
    pub redis_timeout_ms: u64,
}

impl Default for ConversationConfig {
    fn default() -> Self {
        ConversationConfig {
            store: StoreKind::Memory,
            max_mib: 256,
            ttl_s: 3600,
            conversation_ttl_s: 30 * 86_400,
            max_background_per_key: 32,
            redis_url: None,
            redis_timeout_ms: 1000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// In this process (moka, bounded by bytes).
    Memory,
    /// A Redis server every warmpath replica shares: a client may continue on any of them.
    Redis,
}

/// `[websocket]`: Responses WebSocket mode on `GET /v1/responses`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebSocketConfig {
    pub enabled: bool,
    /// Largest client message (after reassembling fragments), in KiB; larger ones close the
    /// connection with 1009.
    pub max_message_kib: u64,
    /// Open connections at most; more are refused with 503 before the upgrade.
    pub max_connections: usize,
    /// A connection with no client message for this long is closed (1000, "idle").
    pub idle_timeout_s: u64,
    /// A connection is closed after this long (1000, `websocket_connection_limit_reached`),
    /// after its response in flight.
    pub max_age_s: u64,
    /// Seconds between the server's pings.
    pub ping_interval_s: u64,
    /// `response.create` events waiting behind the one in flight on a lane (`stream_id`); one
    /// more is refused with an error event.
    pub max_queued: usize,
    /// Lanes (`stream_id`) of one connection running or waiting at once.
    pub max_streams: usize,
}

impl Default for WebSocketConfig {
    fn default() -> Self {
        WebSocketConfig {
            enabled: true,
            max_message_kib: 16 << 10,
            max_connections: 10_000,
            idle_timeout_s: 900,
            max_age_s: 3600,
            ping_interval_s: 30,
            max_queued: 16,
            max_streams: 16,
        }
    }
}
