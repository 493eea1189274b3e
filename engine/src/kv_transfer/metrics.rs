//! Metrics of K/V transfers, registered beside the engine's own.

use prometheus::{CounterVec, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, Opts, Registry};

const SECONDS_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Counters and gauges of prefill/decode transfers.
pub struct TransferMetrics {
    model: String,
    engine: String,
    blocks: CounterVec,
    bytes: CounterVec,
    failures: CounterVec,
    /// How long decode requests waited for their blocks.
    pub seconds: Histogram,
    /// Blocks held for decode replicas to fetch.
    pub held: Gauge,
}

impl TransferMetrics {
    pub fn register(registry: &Registry, model: &str, engine: &str) -> prometheus::Result<TransferMetrics> {
        let counter = |name: &str, help: &str, label: &str| -> prometheus::Result<CounterVec> {
            let c = CounterVec::new(Opts::new(name, help), &["model_name", "engine", label])?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "warmpath_engine_kv_transfer_seconds",
                "Time a decode request spent fetching its prompt's K/V from the prefill replica",
            )
            .buckets(SECONDS_BUCKETS.to_vec()),
            &["model_name", "engine"],
        )?;
        registry.register(Box::new(seconds.clone()))?;
        let held = GaugeVec::new(
            Opts::new(
                "warmpath_engine_kv_held_blocks",
                "KV blocks of prefilled requests waiting to be fetched",
            ),
            &["model_name", "engine"],
        )?;
        registry.register(Box::new(held.clone()))?;
        Ok(TransferMetrics {
            blocks: counter(
                "warmpath_engine_kv_transfer_blocks_total",
                "KV blocks moved between replicas: sent, received, or skipped (already held by the decode replica)",
                "direction",
            )?,
            bytes: counter(
                "warmpath_engine_kv_transfer_bytes_total",
                "K/V bytes moved between replicas, sent or received",
                "direction",
            )?,
            failures: counter(
                "warmpath_engine_kv_transfer_failures_total",
                "Fetches that did not bring every block asked for (the rest was computed), by reason",
                "reason",
            )?,
            seconds: seconds.with_label_values(&[model, engine]),
            held: held.with_label_values(&[model, engine]),
            model: model.to_owned(),
            engine: engine.to_owned(),
        })
    }

    /// `n` blocks of `bytes` in all went `direction` (`sent`, `received`, `skipped`).
    pub fn moved(&self, direction: &str, n: usize, bytes: usize) {
        let labels = [self.model.as_str(), self.engine.as_str(), direction];
        self.blocks.with_label_values(&labels).inc_by(n as f64);
        if bytes > 0 {
            self.bytes.with_label_values(&labels).inc_by(bytes as f64);
        }
    }

    /// A fetch ended short for `reason`.
    pub fn failed(&self, reason: &str) {
        self.failures.with_label_values(&[self.model.as_str(), self.engine.as_str(), reason]).inc();
    }
}
