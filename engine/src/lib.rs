//! warmpath-engine: the bundled vLLM-style backend.
//!
//! An OpenAI-compatible server over a real engine: a paged KV cache with prefix caching
//! ([`block_pool`]), vLLM v1's token-budget scheduler ([`scheduler`]) with n-gram speculative
//! decoding ([`spec`], verified by [`sampler`]), and an executor that either runs a llama
//! forward pass on the CPU ([`executor::llama`]) or a timing model ([`executor::sim`]). It
//! publishes vLLM-compatible KV events ([`kv_events`]) and vLLM's metric names ([`metrics`])
//! so that routers and dashboards built for vLLM work unchanged.
//!
//! Models ([`model`]): GGUF files of the llama architecture (the quick start's SmolLM2-135M,
//! or any such file), llama2.c checkpoints, and seeded dummy presets for tests. Weights stay in
//! their file's quantized form and are multiplied as such ([`quant`]: ggml's block formats
//! against activations quantized per block, AVX2 kernels picked at run time, a portable path
//! everywhere); attention reads a half-precision paged KV cache through [`simd`] kernels. The
//! model's tokenizer and chat template come from `warmpath-wire`, the code the proxy uses.
//!
//! Data flow: HTTP handler ([`server`]) → [`core::Engine::generate`] → engine thread
//! ([`core`]) runs [`scheduler::Scheduler::step`] in a loop → per-request channel → SSE.

pub mod block_pool;
pub mod config;
pub mod core;
pub mod executor;
pub mod faults;
pub mod kv_events;
pub mod kv_tier;
pub mod kv_transfer;
mod launch;
mod math;
pub mod metrics;
pub mod model;
pub mod quant;
pub mod sampler;
pub mod scheduler;
pub mod script;
pub mod server;
pub mod simd;
pub mod spec;
pub use launch::{launch, EngineServer};
