//! warmpath's end-to-end test harness, shared by the proxy's and the engine's integration
//! suites (`use warmpath_tests::*;`): real `warmpath-engine`, `warmpath` and `redis-server`
//! processes on 127.0.0.1 ([`process`]), Redis as one server, a cluster or under Sentinel
//! ([`redis`]), a small blocking HTTP/1.1 client that shows exactly
//! what went over the wire ([`client`]), a WebSocket client ([`ws`]), a scripted upstream for
//! byte-level checks ([`scripted`]), a moderation service ([`moderation`]), Prometheus text
//! ([`metrics`]) and fixtures ([`fixtures`]).

pub mod client;
pub mod fixtures;
pub mod metrics;
pub mod moderation;
pub mod process;
pub mod redis;
pub mod scripted;
pub mod tls;
pub mod ws;

pub use client::*;
pub use fixtures::*;
pub use metrics::*;
pub use moderation::*;
pub use process::*;
pub use redis::*;
pub use scripted::*;
pub use tls::{CertFiles, TestCa};
pub use ws::*;
