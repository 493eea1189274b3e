//! What every entry point and stage shares: the process's state ([`AppState`]), each pool with
//! every stage's part of it ([`Pools`]), and one request's context ([`RequestCtx`]). It sits
//! below the entry points (`http`, `ws`) and the stages they call, so that they share it
//! without importing each other; `server.rs` builds it at start-up and again on a policy
//! reload, swapping it whole in [`Live`].

mod ctx;
mod pools;
mod status;

use std::sync::{Arc, RwLock};

pub use ctx::RequestCtx;
pub use pools::{Pool, Pools};

use crate::auth::Auth;
use crate::config::Config;
use crate::limits::{Buffered, Connections};
use crate::observe::{Lifecycle, Metrics};
use crate::route::Fleet;
use crate::session::Store;
use crate::upstream::dns::Resolved;
use crate::upstream::Upstream;

/// What every request handler reads.
pub struct AppState {
    pub cfg: Config,
    pub pools: Pools,
    /// Every pool's routing state, for the background services.
    pub fleet: Arc<Fleet>,
    pub metrics: Metrics,
    pub upstream: Arc<Upstream>,
    /// The addresses the backends' names resolved to when this state was built.
    pub resolved: Arc<Resolved>,
    /// Stored Responses conversations.
    pub sessions: Arc<Store>,
    /// Open WebSocket connections (the same across reloads).
    pub ws: Arc<Connections>,
    /// The bytes of bodies and messages held (the same across reloads).
    pub buffered: Arc<Buffered>,
    /// API keys and their limits.
    pub auth: Arc<Auth>,
    /// Serving, draining or closing.
    pub lifecycle: Arc<Lifecycle>,
}

impl AppState {
    /// What keeps the process from serving (`/readyz`, `/health`): pools with no backend up,
    /// and API keys not read yet (kept in Redis, which has not answered).
    pub fn unready(&self) -> Vec<String> {
        let mut out: Vec<String> =
            self.fleet.unready().into_iter().map(|p| format!("no backend up in {p}")).collect();
        if !self.auth.ready() {
            out.push("API keys not read yet (Redis has not answered)".to_owned());
        }
        out
    }
}

/// The state new requests are served with: swapped whole by a policy reload. A request (and a
/// WebSocket turn) keeps the state it started with to its end.
pub struct Live(RwLock<Arc<AppState>>);

impl Live {
    pub fn new(state: Arc<AppState>) -> Live {
        Live(RwLock::new(state))
    }

    pub fn load(&self) -> Arc<AppState> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Serves `state` from now on; the state it replaces.
    pub fn swap(&self, state: Arc<AppState>) -> Arc<AppState> {
        std::mem::replace(&mut *self.0.write().unwrap_or_else(|p| p.into_inner()), state)
    }
}

impl crate::route::Current for Live {
    fn fleet(&self) -> Arc<Fleet> {
        self.load().fleet.clone()
    }

    fn health(&self) -> crate::config::HealthConfig {
        self.load().cfg.health.clone()
    }

    fn upstream(&self) -> Arc<Upstream> {
        self.load().upstream.clone()
    }
}
