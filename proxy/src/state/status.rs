//! What the admin listener's status page shows (`GET /status.json`, drawn by `GET /`): each
//! pool and backend as routing sees it now, the last routing decisions and refusals, the
//! WebSockets, and what the safety and limit stages have done since the start.

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::{json, Value};

use super::AppState;
use crate::observe::Samples;
use crate::route::Backend;

impl AppState {
    pub fn status(&self) -> Value {
        let now = Instant::now();
        let pools: Vec<Value> = self
            .pools
            .iter()
            .map(|p| {
                let route = &p.route;
                let blocks = route.cache_aware.as_ref().map(|ca| ca.index().blocks());
                let backends: Vec<Value> = route
                    .backends
                    .iter()
                    .enumerate()
                    .map(|(i, b)| backend(b, now, blocks.as_ref().and_then(|v| v.get(i).copied())))
                    .collect();
                json!({
                    "name": p.name,
                    "policy": route.policy.name(),
                    "max_inflight_per_backend": route.max_inflight,
                    "queued": route.queue.depth(),
                    "backends": backends,
                })
            })
            .collect();
        let m = &self.metrics;
        let all = m.samples();
        let by = |name: &str, labels: &[&str]| by(&all, name, labels);
        let first = |name: &str| all.get(name).and_then(|s| s.first());
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "draining": self.lifecycle.draining(),
            "listen": self.cfg.server.listen.to_string(),
            "policy_sha256": all.get("warmpath_config_info").and_then(|s| s.iter().find(|s| s.1 > 0.0))
                .and_then(|s| s.0.iter().find(|l| l.0 == "sha256").map(|l| l.1.clone())),
            "connections_open": first("warmpath_connections_open").map_or(0.0, |s| s.1),
            "buffered_bytes": self.buffered.used(),
            "inflight": m.inflight_total.get(),
            "pools": pools,
            "recent": m.recent.events(),
            "websockets": {
                "open": self.ws.count(),
                "turns": by("warmpath_responses_turns_total", &["transport", "outcome"]),
                "closed": by("warmpath_websocket_closed_total", &["code"]),
            },
            "refused": by("warmpath_rejections_total", &["reason"]),
            "safety": {
                "checks": by("warmpath_safety_checks_total", &["pool", "check", "stage", "verdict"]),
                "findings": by("warmpath_safety_findings_total", &["pool", "check", "category", "action"]),
            },
            "limits": {
                "keys": by("warmpath_key_requests_total", &["key", "outcome"]),
                "limited": by("warmpath_key_limited_total", &["key", "limit"]),
                "queue_refused": by("warmpath_queue_rejected_total", &["pool", "reason"]),
            },
        })
    }
}

fn backend(b: &Backend, now: Instant, index_blocks: Option<usize>) -> Value {
    let state = match (b.probed_up(), b.is_up(now)) {
        (false, _) => "down",
        (true, false) => "ejected",
        (true, true) => "up",
    };
    let scraped = b.scraped();
    let hit_rate = scraped.and_then(|s| match (s.prefix_hits, s.prefix_queries) {
        (Some(h), Some(q)) if q > 0.0 => Some(h / q),
        _ => None,
    });
    json!({
        "name": b.name,
        "url": b.peer.url.to_string(),
        "state": state,
        "inflight": b.inflight(),
        "running_reported": scraped.map(|s| s.running),
        "waiting_reported": scraped.map(|s| s.waiting),
        "kv_usage": scraped.and_then(|s| s.kv_usage),
        "prefix_hit_rate": hit_rate,
        "index_blocks": index_blocks,
    })
}

/// A metric's samples summed by `labels`, keyed `a / b / c`, for the page's small tables.
fn by(all: &Samples, name: &str, labels: &[&str]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (ls, v) in all.get(name).into_iter().flatten() {
        let key: Vec<&str> = labels
            .iter()
            .map(|want| ls.iter().find(|(k, _)| k == want).map_or("", |(_, v)| v.as_str()))
            .collect();
        *out.entry(key.join(" / ")).or_insert(0.0) += *v;
    }
    out
}
