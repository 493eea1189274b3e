//! Observability: the metrics registry, the admin listener that serves it (and says whether
//! the process is ready, from a function the assembly gives it), and where the process is in
//! its life (serving, draining, closing; the requests being served).

mod admin;
mod disagg;
mod ids;
mod lifecycle;
mod metrics;
mod reading;
mod recent;
pub mod request_id;
pub mod trace;

pub use admin::{AdminApp, Reload, Status, Unready};
pub use lifecycle::{Active, Lifecycle};
pub use metrics::Metrics;
pub use reading::Samples;
pub use recent::{Event, Recent};
pub use trace::{Trace, Tracer};
