//! warmpath: a cache-aware sidecar proxy for OpenAI-compatible LLM servers, on pingora.
//!
//! A request goes through the stages in this order, each a module that owns its state:
//! [`http`] (pingora phases: read and parse the body, relay the answer) → [`route`] (model →
//! pool → policy → backend, health, retries) → the backend → [`http::relay`] back to the
//! client, with [`observe`] counting along the way; [`cache`] answers repeated deterministic
//! requests without a backend. [`config`] is the policy file,
//! [`responses`] serves the Responses API over any chat backend (over HTTP, and [`ws`] for
//! WebSocket mode), with conversations in [`session`], [`embedded`] starts bundled engine replicas, [`limits`] holds the connection-level limits
//! pingora lacks, and [`server`] assembles the process. See `docs/ARCHITECTURE.md`.

pub mod cache;
pub mod canon;
pub mod cli;
pub mod config;
pub mod embedded;
pub mod http;
pub mod limits;
pub mod observe;
pub mod responses;
pub mod route;
pub mod server;
pub mod session;
pub mod tools;
pub mod ws;
