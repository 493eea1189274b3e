//! warmpath: a cache-aware sidecar proxy for OpenAI-compatible LLM servers, on pingora.
//!
//! The modules form layers; each imports only from the layers below it (`docs/ARCHITECTURE.md`
//! draws them):
//!
//! 1. foundations: [`config`] (the policy file, plain data), [`request`] (the parsed request),
//!    [`observe`] (metrics; the admin listener), [`limits`], [`tls`] (listener certificates),
//!    [`upstream`] (connections to backends), [`shared`] (the Redis a fleet shares);
//! 2. stages, each owning its state: [`tools`] (deferred tools), [`safety`] (checks),
//!    [`canon`] (stable prefixes), [`cache`] (response cache), [`session`] (conversation
//!    store), [`route`] (pools, policies, health, prefix index), [`auth`] (API keys and
//!    per-key limits); and [`embedded`] (bundled engine replicas);
//! 3. [`state`]: the process's shared state, each pool with every stage's part, the request
//!    context;
//! 4. [`pipeline`]: one LLM request through the stages, in order;
//! 5. [`responses`]: a Responses turn over the pipeline;
//! 6. entry points, siblings: [`http`] (the HTTP routes) and [`ws`] (WebSocket mode);
//! 7. [`entry`] (pingora's `ProxyHttp`: which entry point a request goes to), [`shutdown`] (the
//!    drain on SIGTERM), [`server`] (the assembly: everything built from the policy file, in
//!    one place) and [`cli`].

pub mod auth;
pub mod build;
pub mod cache;
pub mod canon;
pub mod cli;
pub mod config;
pub mod embedded;
pub mod entry;
pub mod http;
pub mod limits;
pub mod observe;
pub mod otlp;
pub mod pipeline;
pub mod policy;
pub mod reload;
pub mod request;
pub mod responses;
pub mod route;
pub mod safety;
pub mod server;
pub mod session;
pub mod shared;
pub mod shutdown;
pub mod state;
pub mod tls;
pub mod tools;
pub mod upstream;
pub mod ws;
