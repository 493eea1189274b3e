//! Active health checks: every `interval_ms`, `GET {path}` on each backend; thresholds of
//! consecutive results mark it down or up (see [`super::Backend::record_probe`]). The same loop keeps
//! the `warmpath_backend_up` gauges true as ejections run out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::Fleet;
use crate::config::HealthConfig;
use crate::observe::Metrics;
use crate::upstream::{get, Upstream};

pub struct HealthChecker {
    pub fleet: Arc<Fleet>,
    pub cfg: HealthConfig,
    pub metrics: Metrics,
    pub upstream: Arc<Upstream>,
}

impl HealthChecker {
    async fn probe_all(&self) {
        let timeout = Duration::from_millis(self.cfg.timeout_ms);
        let probes = self.fleet.backends().map(|b| {
            let b = b.clone();
            async move {
                // Why a probe failed (a refused connection, a certificate that does not verify,
                // a status) is what the operator needs in the log.
                let why = match get(&self.upstream, &b.peer, &self.cfg.path, timeout).await {
                    Ok((200..=299, _)) => None,
                    Ok((status, _)) => Some(format!("status {status}")),
                    Err(e) => Some(e),
                };
                (b, why)
            }
        });
        for (b, why) in futures_util::future::join_all(probes).await {
            let ok = why.is_none();
            let result = if ok { "ok" } else { "fail" };
            self.metrics.health_checks.with_label_values(&[&b.pool, &b.name, result]).inc();
            match b.record_probe(ok, &self.cfg) {
                Some(true) => tracing::info!(backend = %b.name, "health check passed: backend is up"),
                Some(false) => {
                    let why = why.unwrap_or_default();
                    tracing::warn!(backend = %b.name, path = %self.cfg.path, error = %why, "health check failed: backend is down")
                }
                None => {}
            }
        }
    }
}

#[async_trait]
impl BackgroundService for HealthChecker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(Duration::from_millis(self.cfg.interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            if self.cfg.enabled {
                self.probe_all().await;
            }
            let now = Instant::now();
            for b in self.fleet.backends() {
                b.refresh_gauge(now);
            }
        }
    }
}
