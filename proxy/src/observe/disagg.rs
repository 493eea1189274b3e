//! The metrics of prefill/decode disaggregation (`pipeline::disagg`).

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

#[derive(Debug, Clone)]
pub struct DisaggMetrics {
    /// `pool`, `outcome`: prefills sent to prefill backends (`ok`; or the request went whole to
    /// a decode backend: `failed`, `refused`, `unsupported`).
    pub prefills: IntCounterVec,
    /// `pool`: a prefill's time, sent to its `kv_transfer_params` in.
    pub prefill_duration: HistogramVec,
}

impl DisaggMetrics {
    pub fn register(registry: &Registry, buckets: &[f64]) -> DisaggMetrics {
        let prefills = IntCounterVec::new(
            Opts::new(
                "warmpath_prefills_total",
                "Prefills sent to a pool's prefill backends before the decode, by outcome.",
            ),
            &["pool", "outcome"],
        )
        .expect("valid metric");
        let prefill_duration = HistogramVec::new(
            HistogramOpts::new(
                "warmpath_prefill_duration_seconds",
                "Time from sending a prefill to its answer's kv_transfer_params.",
            )
            .buckets(buckets.to_vec()),
            &["pool"],
        )
        .expect("valid metric");
        registry.register(Box::new(prefills.clone())).expect("unique metric");
        registry.register(Box::new(prefill_duration.clone())).expect("unique metric");
        DisaggMetrics { prefills, prefill_duration }
    }
}
