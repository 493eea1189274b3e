//! The pools: each `[[pools]]` entry with every stage's part of it (its canonicalizer, its
//! response cache, its routing state), and which pool serves which model.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cache::ResponseCache;
use crate::canon::Canon;
use crate::config::{ResponsesMode, Tenants};
use crate::route;

/// One pool, as the stages of a request see it.
#[derive(Debug)]
pub struct Pool {
    pub name: String,
    /// Backends, policy, retry budget.
    pub route: Arc<route::Pool>,
    /// Its prefill-only backends (role `prefill`), where it has any: each request's prefill
    /// goes to one of them first, and its decode to `route`.
    pub prefill: Option<Arc<route::Pool>>,
    /// `[pools.disagg]`: which requests `prefill` takes.
    pub disagg: crate::config::DisaggConfig,
    /// How its requests are canonicalized and cut into prefix blocks.
    pub canon: Canon,
    /// `[pools.response_cache]`, where enabled.
    pub response_cache: Option<ResponseCache>,
    /// `responses`: translated by warmpath, or the backends' own.
    pub responses: ResponsesMode,
    /// `responses_tokens`: translated turns as token-id completions where the pool can.
    pub responses_tokens: bool,
    /// `[pools.safety]`: the checks its requests go through, where any are configured.
    pub safety: Option<Arc<crate::safety::Safety>>,
    /// With API keys: whose requests share the backends' prefix cache.
    pub tenants: Tenants,
    /// With API keys: answers carry warmpath's routing headers.
    pub route_headers: bool,
    /// The backends' context length, checked before a request leaves where tokens are
    /// counted exactly.
    pub max_model_len: Option<usize>,
}

/// Every pool, and which pool serves which model.
#[derive(Debug, Default)]
pub struct Pools {
    list: Vec<Arc<Pool>>,
    by_model: HashMap<String, usize>,
    wildcard: Option<usize>,
}

impl Pools {
    /// `pools` with the models each serves (`"*"`: every model no other pool names).
    pub fn new(pools: Vec<(Pool, Vec<String>)>) -> Pools {
        let mut out = Pools::default();
        for (i, (pool, models)) in pools.into_iter().enumerate() {
            for m in models {
                if m == "*" {
                    out.wildcard = Some(i);
                } else {
                    out.by_model.insert(m, i);
                }
            }
            out.list.push(Arc::new(pool));
        }
        out
    }

    /// The pool that serves `model`.
    pub fn for_model(&self, model: &str) -> Option<&Arc<Pool>> {
        self.by_model.get(model).or(self.wildcard.as_ref()).map(|&i| &self.list[i])
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.list.iter()
    }

    /// The pool named `name`.
    pub fn named(&self, name: &str) -> Option<&Arc<Pool>> {
        self.list.iter().find(|p| p.name == name)
    }
}
