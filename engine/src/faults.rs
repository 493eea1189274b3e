//! Fault knobs for tests of whatever sits in front of the engine (all off by default): fail a
//! fraction of requests with 500, delay responses, die mid-stream, or emit malformed JSON.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::Args;

use crate::sampler::Rng;

#[derive(Debug, Clone, Default, Args)]
pub struct FaultConfig {
    /// Fault: fraction of requests answered with HTTP 500 (0–1).
    #[arg(long, default_value_t = 0.0)]
    pub fault_error_rate: f64,
    /// Fault: delay before the response headers, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub fault_delay_ms: u64,
    /// Fault: drop the connection of a streaming response after this many tokens.
    #[arg(long)]
    pub fault_die_after_tokens: Option<usize>,
    /// Fault: the fraction of streaming responses `--fault-die-after-tokens` cuts (0–1).
    #[arg(long, default_value_t = 1.0)]
    pub fault_die_rate: f64,
    /// Fault: fraction of responses whose JSON (body or SSE events) is cut in half (0–1).
    #[arg(long, default_value_t = 0.0)]
    pub fault_malformed_rate: f64,
    /// Test hook: a JSON file of scripted replies, `[{"when": "...", "reply": "..."}]`: a chat
    /// prompt containing `when` gets `reply` as its output (the last matching rule wins).
    #[arg(long)]
    pub script: Option<std::path::PathBuf>,
}

impl FaultConfig {
    pub fn validate(&self) -> Result<(), String> {
        for (flag, v) in [
            ("--fault-error-rate", self.fault_error_rate),
            ("--fault-malformed-rate", self.fault_malformed_rate),
            ("--fault-die-rate", self.fault_die_rate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{flag} must be within 0..=1, got {v}"));
            }
        }
        Ok(())
    }
}

/// What faults to inject into one request, decided when it arrives.
#[derive(Debug, Clone, Default)]
pub struct RequestFaults {
    pub fail: bool,
    pub delay: Duration,
    pub die_after_tokens: Option<usize>,
    pub malformed: bool,
}

/// Draws per-request faults from the configured rates.
#[derive(Debug)]
pub struct FaultInjector {
    cfg: FaultConfig,
    counter: AtomicU64,
}

impl FaultInjector {
    pub fn new(cfg: FaultConfig) -> FaultInjector {
        FaultInjector { cfg, counter: AtomicU64::new(0) }
    }

    pub fn draw(&self) -> RequestFaults {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let mut rng = Rng::new(n.wrapping_mul(0xA24B_AED4_963E_E407));
        RequestFaults {
            fail: (rng.next_f32() as f64) < self.cfg.fault_error_rate,
            delay: Duration::from_millis(self.cfg.fault_delay_ms),
            malformed: (rng.next_f32() as f64) < self.cfg.fault_malformed_rate,
            die_after_tokens: self
                .cfg
                .fault_die_after_tokens
                .filter(|_| (rng.next_f32() as f64) < self.cfg.fault_die_rate),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_respected_roughly() {
        let f = FaultInjector::new(FaultConfig { fault_error_rate: 0.3, ..Default::default() });
        let fails = (0..1000).filter(|_| f.draw().fail).count();
        assert!((200..400).contains(&fails), "{fails}");
        let none = FaultInjector::new(FaultConfig::default());
        assert!((0..100).all(|_| {
            let d = none.draw();
            !d.fail && !d.malformed
        }));
        let some = FaultInjector::new(FaultConfig {
            fault_die_after_tokens: Some(4),
            fault_die_rate: 0.1,
            ..Default::default()
        });
        let cut = (0..1000).filter(|_| some.draw().die_after_tokens == Some(4)).count();
        assert!((50..150).contains(&cut), "{cut}");
    }
}
