//! Live load for `cache_aware` pools: every `scrape_interval_ms`, each backend's `/metrics`
//! (vLLM's names, which the bundled engine also exports) gives its running and waiting
//! requests and its KV capacity (`vllm:cache_config_info`), which sizes that backend's share of
//! the prefix index. The same loop publishes the index's size.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::{Pool, Router};
use crate::http::client::{get, Upstream};
use crate::observe::Metrics;

/// What one scrape found.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scraped {
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: Option<f64>,
    /// `num_gpu_blocks` and `block_size` of `vllm:cache_config_info`.
    pub kv_blocks: Option<u64>,
    pub kv_block_size: Option<u64>,
}

/// Reads the few series routing needs from Prometheus text (values summed over label sets,
/// so a multi-engine server reports its total).
pub fn parse(text: &str) -> Scraped {
    let mut s = Scraped::default();
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        let v: f64 = value.trim().parse().unwrap_or(0.0);
        match name {
            "vllm:num_requests_running" => s.running += v,
            "vllm:num_requests_waiting" => s.waiting += v,
            "vllm:kv_cache_usage_perc" => s.kv_usage = Some(s.kv_usage.unwrap_or(0.0).max(v)),
            "vllm:cache_config_info" => {
                s.kv_blocks = label(labels, "num_gpu_blocks").and_then(|x| x.parse().ok()).or(s.kv_blocks);
                s.kv_block_size =
                    label(labels, "block_size").and_then(|x| x.parse().ok()).or(s.kv_block_size);
            }
            _ => {}
        }
    }
    s
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

pub struct LoadScraper {
    pub router: Arc<Router>,
    pub metrics: Metrics,
    pub upstream: Arc<Upstream>,
}

impl LoadScraper {
    async fn scrape(&self, pool: &Pool) {
        let Some(ca) = &pool.cache_aware else { return };
        let timeout = Duration::from_millis(pool.cache_cfg.scrape_interval_ms.clamp(100, 5000));
        let reads = pool
            .backends
            .iter()
            .map(|b| async move { (b, get(&self.upstream, b, "/metrics", timeout).await) });
        for (i, (b, r)) in futures_util::future::join_all(reads).await.into_iter().enumerate() {
            let labels = [pool.name.as_str(), b.name.as_str()];
            let Ok((200, body)) = r else {
                self.metrics.load_scrapes.with_label_values(&[&pool.name, &b.name, "fail"]).inc();
                continue;
            };
            self.metrics.load_scrapes.with_label_values(&[&pool.name, &b.name, "ok"]).inc();
            let s = parse(&String::from_utf8_lossy(&body));
            b.set_reported_requests((s.running + s.waiting).max(0.0) as u32);
            if let (Some(blocks), Some(size)) = (s.kv_blocks, s.kv_block_size) {
                // The backend's blocks in the index's block size.
                let per_block = pool.canon.encoder().tokens_per_block().max(1.0);
                let capacity = ((blocks * size) as f64 / per_block).max(1.0) as usize;
                ca.index().set_capacity(i, capacity);
                self.metrics.index_capacity.with_label_values(&labels).set(capacity as i64);
            }
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
        let pools: Vec<Arc<Pool>> =
            self.router.pools().iter().filter(|p| p.cache_aware.is_some()).cloned().collect();
        let Some(every) = pools.iter().map(|p| p.cache_cfg.scrape_interval_ms).filter(|&ms| ms > 0).min()
        else {
            // Nothing to scrape: still publish the index sizes now and then.
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => pools.iter().for_each(|p| self.publish(p)),
                    _ = shutdown.changed() => return,
                }
            }
        };
        let mut tick = tokio::time::interval(Duration::from_millis(every));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            for p in &pools {
                if p.cache_cfg.scrape_interval_ms > 0 {
                    self.scrape(p).await;
                } else {
                    self.publish(p);
                }
            }
        }
    }
}

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
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"2048\"} 1.0\n\
            vllm:num_requests_running_other 100\n";
        let s = parse(text);
        assert_eq!(
            s,
            Scraped {
                running: 5.0,
                waiting: 4.0,
                kv_usage: Some(0.25),
                kv_blocks: Some(2048),
                kv_block_size: Some(16)
            }
        );
        assert_eq!(parse("garbage\n{}\n"), Scraped::default());
    }
}
