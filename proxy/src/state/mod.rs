//! What every entry point and stage shares: the process's state ([`AppState`]), each pool with
//! every stage's part of it ([`Pools`]), and one request's context ([`RequestCtx`]). It sits
//! below the entry points (`http`, `ws`) and the stages they call, so that they share it
//! without importing each other; `server.rs` builds it at start-up.

mod ctx;
mod pools;

use std::sync::Arc;

pub use ctx::RequestCtx;
pub use pools::{Pool, Pools};

use crate::auth::Auth;
use crate::config::Config;
use crate::limits::Connections;
use crate::observe::{Lifecycle, Metrics};
use crate::route::Fleet;
use crate::session::Store;
use crate::upstream::Upstream;

/// What every request handler reads.
pub struct AppState {
    pub cfg: Config,
    pub pools: Pools,
    /// Every pool's routing state, for the background services.
    pub fleet: Arc<Fleet>,
    pub metrics: Metrics,
    pub upstream: Arc<Upstream>,
    /// Stored Responses conversations.
    pub sessions: Arc<Store>,
    /// Open WebSocket connections.
    pub ws: Connections,
    /// API keys and their limits.
    pub auth: Arc<Auth>,
    /// Serving, draining or closing.
    pub lifecycle: Arc<Lifecycle>,
}
