//! SIGTERM, as a drain: pingora stops accepting and ends kept-alive connections after their
//! current request; this service marks the process draining (`/readyz` and `/health` answer
//! 503), tells WebSocket connections to close after their turn in flight, and waits for the
//! requests being served to finish — exiting as soon as none is left, not after the whole grace
//! period. When `[server] grace_period_secs` runs out first, streams still running end with an
//! error event (their backends' generations are cancelled), and the process exits a moment
//! later. Per-key settlements still queued go to Redis first. SIGINT stays immediate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::observe::Active;
use crate::state::AppState;

/// How often the drain looks at what is left.
const POLL: Duration = Duration::from_millis(50);
/// After the grace period, how long ended streams get to write their error events.
const LAST_WORDS: Duration = Duration::from_secs(2);

pub struct Drain {
    pub state: Arc<AppState>,
    pub grace: Duration,
    /// pingora's pid file, removed on the way out.
    pub pid_file: String,
}

#[async_trait]
impl pingora::services::background::BackgroundService for Drain {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        if shutdown.changed().await.is_err() {
            return;
        }
        let state = &self.state;
        let started = Instant::now();
        state.lifecycle.drain();
        state.ws.drain();
        tracing::info!(in_flight = Active::count(), grace_s = self.grace.as_secs(), "SIGTERM: draining");
        let mut closed_at = None;
        // Nothing left on two looks in a row (a request whose header was just read is counted
        // on the next look).
        let mut quiet = 0;
        loop {
            quiet = if Active::count() == 0 { quiet + 1 } else { 0 };
            if quiet >= 2 {
                break;
            }
            match closed_at {
                None if started.elapsed() >= self.grace => {
                    tracing::warn!(in_flight = Active::count(), "grace period over: ending what still runs");
                    state.lifecycle.close();
                    closed_at = Some(Instant::now());
                }
                Some(at) if at.elapsed() >= LAST_WORDS => break,
                _ => {}
            }
            tokio::time::sleep(POLL).await;
        }
        if let Some(fleet) = state.auth.fleet() {
            if let Err(e) = fleet.flush().await {
                tracing::warn!(error = %e, "per-key settlements not sent to Redis before exit");
            }
        }
        let _ = std::fs::remove_file(&self.pid_file);
        tracing::info!(
            after_ms = started.elapsed().as_millis() as u64,
            left = Active::count(),
            "drained; exiting"
        );
        std::process::exit(0);
    }
}
