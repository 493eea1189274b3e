//! Observability: the metrics registry, and the admin listener that serves it (and says
//! whether the process is ready, from a function the assembly gives it).

mod admin;
mod metrics;

pub use admin::{AdminApp, Unready};
pub use metrics::Metrics;
