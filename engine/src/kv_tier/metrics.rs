//! Metrics of the shared KV tier, registered beside the engine's own.

use prometheus::{CounterVec, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, Opts, Registry};

const SECONDS_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Counters of what the shared tier did.
pub struct SharedMetrics {
    model: String,
    engine: String,
    blocks: CounterVec,
    /// How long a request waited for the tier before it was queued.
    pub seconds: Histogram,
    /// 1 while the tier answers, 0 after a call failed (until one succeeds).
    pub up: Gauge,
}

impl SharedMetrics {
    pub fn register(registry: &Registry, model: &str, engine: &str) -> prometheus::Result<SharedMetrics> {
        let labels = ["model_name", "engine"];
        let blocks = CounterVec::new(
            Opts::new(
                "warmpath_engine_kv_shared_tier_blocks_total",
                "KV blocks of the shared tier (Redis): written (computed here), loaded (into a prompt), \
                 corrupt (failed their check: deleted, computed), dropped (the write queue was full), \
                 rejected (Redis was full), failed (Redis down or slow: not written or not read)",
            ),
            &["model_name", "engine", "event"],
        )?;
        registry.register(Box::new(blocks.clone()))?;
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "warmpath_engine_kv_shared_tier_seconds",
                "Time a request spent looking its prompt's blocks up in the shared tier and reading them",
            )
            .buckets(SECONDS_BUCKETS.to_vec()),
            &labels,
        )?;
        registry.register(Box::new(seconds.clone()))?;
        let up = GaugeVec::new(
            Opts::new(
                "warmpath_engine_kv_shared_tier_up",
                "1 while the shared KV tier (Redis) answers, else 0",
            ),
            &labels,
        )?;
        registry.register(Box::new(up.clone()))?;
        Ok(SharedMetrics {
            blocks,
            seconds: seconds.with_label_values(&[model, engine]),
            up: up.with_label_values(&[model, engine]),
            model: model.to_owned(),
            engine: engine.to_owned(),
        })
    }

    /// `n` blocks had `event` (`written`, `loaded`, `corrupt`, `dropped`, `rejected`, `failed`).
    pub fn count(&self, event: &str, n: usize) {
        if n > 0 {
            self.blocks
                .with_label_values(&[self.model.as_str(), self.engine.as_str(), event])
                .inc_by(n as f64);
        }
    }
}
