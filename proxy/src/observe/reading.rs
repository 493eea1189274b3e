//! Reading the registry back: the Prometheus text `/metrics` serves, and the samples the
//! status page shows.

use prometheus::{Encoder, TextEncoder};

use super::Metrics;

/// Metric name → its samples: (label name and value pairs, value).
pub type Samples = std::collections::HashMap<String, Vec<(Vec<(String, String)>, f64)>>;

impl Metrics {
    /// Every counter and gauge as name → (labels, value) samples, labels in their names' order,
    /// read in one pass over the registry: what the status page shows of the stages' counters.
    pub fn samples(&self) -> Samples {
        let mut out = Samples::new();
        for family in self.registry.gather() {
            let counter = family.get_field_type() == prometheus::proto::MetricType::COUNTER;
            let gauge = family.get_field_type() == prometheus::proto::MetricType::GAUGE;
            if !counter && !gauge {
                continue;
            }
            let samples = family.get_metric().iter().map(|m| {
                let labels = m.get_label().iter().map(|l| (l.name().to_owned(), l.value().to_owned()));
                let value = if counter { m.get_counter().get_value() } else { m.get_gauge().get_value() };
                (labels.collect(), value)
            });
            out.insert(family.name().to_owned(), samples.collect());
        }
        out
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 << 10);
        // Encoding our own registry only fails on invalid metric families, which `new` rules out.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}
