//! Metrics of the KV tiers, registered beside the engine's own: the replica's own (host
//! memory, disk: one series per `medium`) and the shared one.

use prometheus::{
    Counter, CounterVec, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, Opts, Registry,
};

use super::TierStats;

/// Gauges and counters of the replica's own tiers, by medium (`cpu`, `disk`).
pub struct TierMetrics {
    model: String,
    engine: String,
    blocks: GaugeVec,
    capacity: GaugeVec,
    events: CounterVec,
    /// Prompt tokens loaded from them instead of computed.
    pub hits: Counter,
}

impl TierMetrics {
    pub fn register(registry: &Registry, model: &str, engine: &str) -> prometheus::Result<TierMetrics> {
        let by_medium = ["model_name", "engine", "medium"];
        let gauge = |name: &str, help: &str| -> prometheus::Result<GaugeVec> {
            let g = GaugeVec::new(Opts::new(name, help), &by_medium)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let events = CounterVec::new(
            Opts::new(
                "warmpath_engine_kv_tier_events_total",
                "Blocks of the replica's KV tiers: stored (evicted from the pool, or from host memory to \
                 disk), loaded (into a prompt), evicted (dropped for room), corrupt (failed their checksum, \
                 never loaded), failed (the medium failed: not written or not read)",
            ),
            &["model_name", "engine", "medium", "event"],
        )?;
        registry.register(Box::new(events.clone()))?;
        let hits = CounterVec::new(
            Opts::new(
                "warmpath_engine_kv_tier_hit_tokens_total",
                "Prompt tokens loaded from the replica's KV tiers instead of computed (also counted in \
                 vllm:prefix_cache_hits_total)",
            ),
            &["model_name", "engine"],
        )?;
        registry.register(Box::new(hits.clone()))?;
        Ok(TierMetrics {
            blocks: gauge("warmpath_engine_kv_tier_blocks", "Blocks held in the replica's KV tier, by medium")?,
            capacity: gauge(
                "warmpath_engine_kv_tier_capacity_blocks",
                "Blocks the replica's KV tier holds at most, by medium (routers add them to the cache's capacity)",
            )?,
            events,
            hits: hits.with_label_values(&[model, engine]),
            model: model.to_owned(),
            engine: engine.to_owned(),
        })
    }

    /// The tier on `medium` holds `blocks` at most.
    pub fn set_capacity(&self, medium: &str, blocks: usize) {
        self.capacity
            .with_label_values(&[self.model.as_str(), self.engine.as_str(), medium])
            .set(blocks as f64);
    }

    /// The tier on `medium`: its size, and what it did since the last call.
    pub fn set(&self, medium: &str, blocks: usize, st: &TierStats) {
        let labels = [self.model.as_str(), self.engine.as_str(), medium];
        self.blocks.with_label_values(&labels).set(blocks as f64);
        let counts = [
            ("stored", st.stored),
            ("loaded", st.loaded),
            ("evicted", st.evicted),
            ("corrupt", st.corrupt),
            ("failed", st.failed),
        ];
        for (event, n) in counts.into_iter().filter(|&(_, n)| n > 0) {
            let l = [labels[0], labels[1], labels[2], event];
            self.events.with_label_values(&l).inc_by(n as f64);
        }
    }
}

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
