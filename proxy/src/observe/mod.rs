//! Observability: the metrics registry and the admin listener that serves it.

mod admin;
mod metrics;

pub use admin::AdminApp;
pub use metrics::Metrics;
