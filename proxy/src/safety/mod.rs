//! The safety stage: checks that decide whether a request may go out and what of an answer a
//! client may see (issue 23). So far its first check, [`rules`]: built-in detectors for
//! personal data and secrets and a policy's deny/allow patterns, pure and in-process. The
//! stage's wiring into the request path (release policies, moderation and guard-model checks,
//! the policy file's `[pools.safety]`) is not built yet.

pub mod rules;
