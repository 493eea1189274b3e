//! Active health checks: every `interval_ms`, `GET {path}` on each backend; thresholds of
//! consecutive results mark it down or up (see [`super::Backend::record_probe`]). A probe left
//! unanswered by a backend that has requests in flight counts as busy, not as a failure (an
//! engine tokenizing a huge prompt answers its probes late; its requests' own failures still
//! eject it). The same loop keeps the `warmpath_backend_up` gauges true as ejections run out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::{Current, Fleet};
use crate::config::HealthConfig;
use crate::observe::Metrics;
use crate::upstream::get;

pub struct HealthChecker {
    /// The fleet, settings and connector of the moment (a reload swaps them).
    pub current: Arc<dyn Current>,
    pub metrics: Metrics,
}

impl HealthChecker {
    async fn probe_all(&self, fleet: &Fleet, cfg: &HealthConfig) {
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let upstream = self.current.upstream();
        let upstream = &upstream;
        let probes = fleet.backends().map(|b| {
            let b = b.clone();
            async move {
                // Why a probe failed (a refused connection, a certificate that does not verify,
                // a status) is what the operator needs in the log.
                let started = Instant::now();
                let why = match get(upstream, &b.peer, &cfg.path, timeout).await {
                    Ok((200..=299, _)) => None,
                    Ok((status, _)) => Some(format!("status {status}")),
                    Err(e) => Some(e),
                };
                // A probe that got no answer in time from a backend with requests in flight:
                // busy (a long prompt being tokenized, a full batch), not dead.
                let busy = why.is_some() && started.elapsed() >= timeout && b.inflight() > 0;
                (b, why, busy)
            }
        });
        for (b, why, busy) in futures_util::future::join_all(probes).await {
            if busy {
                self.metrics.health_checks.with_label_values(&[&b.pool, &b.name, "busy"]).inc();
                tracing::debug!(backend = %b.name, "health check unanswered while serving: busy, not down");
                continue;
            }
            let ok = why.is_none();
            let result = if ok { "ok" } else { "fail" };
            self.metrics.health_checks.with_label_values(&[&b.pool, &b.name, result]).inc();
            match b.record_probe(ok, cfg) {
                Some(true) => tracing::info!(backend = %b.name, "health check passed: backend is up"),
                Some(false) => {
                    let why = why.unwrap_or_default();
                    tracing::warn!(backend = %b.name, path = %cfg.path, error = %why, "health check failed: backend is down")
                }
                None => {}
            }
        }
    }
}

#[async_trait]
impl BackgroundService for HealthChecker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            // Read each round: a reload may change the interval, the path or the backends.
            let cfg = self.current.health();
            let fleet = self.current.fleet();
            if cfg.enabled {
                self.probe_all(&fleet, &cfg).await;
            }
            let now = Instant::now();
            for b in fleet.backends() {
                b.refresh_gauge(now);
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(cfg.interval_ms)) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
