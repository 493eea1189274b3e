//! The report of a comparison: the markdown table with the references and the setup, each
//! warmpath run against the best peer, the agent workload's per-turn table, and the SVG chart.

use std::fmt::Write as _;

use super::{value_name, Args, Run, Slot};
use crate::fleet::{Counters, BLOCK_SIZE};
use crate::refs::HitRate;
use crate::replay::Outcome;
use crate::report::{self, Chart};
use crate::stats::median;
use crate::trace::TraceOpts;
use crate::workload::Request;

pub(super) struct Context<'a> {
    pub(super) a: &'a Args,
    pub(super) slots: &'a [Slot],
    pub(super) reqs: &'a [Request],
    pub(super) topts: Option<&'a TraceOpts>,
    pub(super) ws: usize,
    pub(super) kv_blocks: usize,
    pub(super) backends: usize,
    pub(super) oracle: HitRate,
    pub(super) ceiling: HitRate,
}

/// `hit / reference`, except for `direct` (the references assume the whole fleet, and one
/// engine's preempted-and-recomputed prompts hit their own blocks) and a zero reference.
fn ratio(hit: f64, reference: f64, spec: &str) -> String {
    if spec == "direct" || reference <= 0.0 {
        return "—".into();
    }
    format!("{:.3}", hit / reference.max(1e-9))
}

impl Context<'_> {
    fn setup(&self) -> String {
        let a = self.a;
        let tier = a.engine.tier_blocks(self.kv_blocks);
        let engines = format!(
            "the same {} `warmpath-engine --executor {}` replicas of {} KV blocks × {BLOCK_SIZE} tokens each \
             ({:.2}× the working set of {} blocks together){}, prefill {} µs/token, {} ms per decode step, \
             {} sequences at most",
            self.backends,
            a.engine.executor,
            self.kv_blocks,
            (self.kv_blocks * self.backends) as f64 / self.ws.max(1) as f64,
            self.ws,
            match (tier, a.engine.kv_transfer) {
                (0, true) => format!(
                    ", serving their cached K/V to each other (a fetched block costs the fetching engine {} µs)",
                    a.engine.transfer_us_per_block
                ),
                (0, false) => String::new(),
                (t, _) => format!(
                    ", each with a host-memory KV tier of {t} blocks (evicted blocks kept there and loaded at {} µs a block)",
                    a.engine.kv_load_us_per_block
                ),
            } + &match (a.engine.kv_tier_disk_factor * self.kv_blocks as f64).round() as usize {
                0 => String::new(),
                d => format!(
                    ", each with a disk KV tier of {d} blocks (a file each, {}; loaded at {} µs a block plus the read)",
                    if tier > 0 { "below the host tier" } else { "taking what the cache evicts" },
                    a.engine.kv_load_us_per_block
                ),
            } + &match (a.engine.kv_tier_shared, a.engine.kv_tier_shared_mib) {
                (false, _) => String::new(),
                (true, 0) => format!(
                    ", sharing a KV tier in one redis-server, unbounded (every computed block written there; \
                     a loaded block costs {} µs)",
                    a.engine.kv_load_us_per_block
                ),
                (true, m) => format!(
                    ", sharing a KV tier in one redis-server of {m} MiB, least recently used keys out (every \
                     computed block written there; a loaded block costs {} µs)",
                    a.engine.kv_load_us_per_block
                ),
            },
            a.engine.prefill_us_per_token,
            a.engine.itl_ms,
            a.engine.max_num_seqs,
        );
        match self.topts {
            Some(t) => {
                let span = self.reqs.last().map_or(0.0, |r| r.at.as_secs_f64());
                format!(
                    "{} requests of the Mooncake synthetic trace (lengths × {}, so a 512-token block is {} tokens; \
                     arrivals × {:.1}, {span:.0} s; output ≤ {} tokens{}), replayed open-loop (one connection per \
                     request, streaming) through each target to {engines}.",
                    self.reqs.len(),
                    t.scale,
                    ((512.0 * t.scale).round() as usize).max(1),
                    t.speedup,
                    t.max_output,
                    if t.hot_prefix_tokens > 0 {
                        format!("; every request starts with the same {}-token system prompt", t.hot_prefix_tokens)
                    } else {
                        String::new()
                    }
                )
            }
            None => format!(
                "{} agent sessions × {} turns (seed {}): a {}-token system prompt with a timestamp on its second \
                 line that changes every turn, {} tool schemas per session in a new order on every request, a \
                 history growing by a tool call and a {}-token tool result per turn; output ≤ {} tokens. Sessions \
                 run concurrently and in step (turn t + 1 starts when every session has its answer to turn t, \
                 when the target's CPU is read), streaming, to {engines}. `naive`: a new connection per turn; \
                 `http`: one keep-alive connection per session; both resend the whole conversation as a chat \
                 request. `ws`: Responses WebSocket mode, one connection per session, each turn a \
                 `response.create` with the instructions, the tools and only the new items \
                 (`previous_response_id`, `store: false`); the conversation the server keeps includes the \
                 model's own answers, so its prompts run a little longer than the scripted ones.",
                self.reqs.iter().filter_map(|r| r.session).map(|s| s.0).max().map_or(0, |m| m + 1),
                self.reqs.iter().filter_map(|r| r.session).map(|s| s.1).max().map_or(0, |m| m + 1),
                a.seed,
                a.system_tokens,
                a.tools.replace(':', "–"),
                a.result_tokens,
                a.max_output,
            ),
        }
    }

    pub(super) fn markdown(&self, runs: &[Vec<Run>]) -> String {
        let a = self.a;
        let mut md = String::new();
        let cmd: Vec<String> = std::env::args().collect();
        let title = match self.topts {
            Some(_) => format!("Trace replay, {} scenario", value_name(a.scenario)),
            None => "Agent sessions".to_owned(),
        };
        let _ = writeln!(md, "# {title} — {}\n", crate::report::date());
        let _ =
            writeln!(md, "Command: `{}` (release build; peers from `scripts/bench-peers`)\n", cmd.join(" "));
        let _ = writeln!(
            md,
            "{} Prefix caches are emptied before every run; {} round(s), runs rotating; medians over rounds.\n",
            self.setup(),
            a.rounds
        );
        let _ = writeln!(
            md,
            "References on the same prompts in the same order{}: **oracle** (one infinite cache) {:.3}; \
             **partition ceiling** (one LRU cache as large as all engines together — no router can beat it) {:.3}.\n",
            if self.topts.is_none() { " (turn by turn across sessions)" } else { "" },
            self.oracle.rate(),
            self.ceiling.rate()
        );
        if self.slots.iter().any(|s| s.spec.contains("+canon") || s.spec.contains("+defer")) {
            let _ = writeln!(
                md,
                "Targets with `+canon` or `+defer` rewrite the prompts before the engines see them, so these \
                 references (computed on the prompts as sent) do not bound them: compare their hit rate, \
                 prefilled tokens and TTFT with the same policy's as-sent row.\n"
            );
        }
        let _ = writeln!(
            md,
            "| target | hit rate | / ceiling | / oracle | prefilled tokens | TTFT p50 ms | p90 | p99 | e2e p50 ms | p99 | out tok/s | req imbalance | work imbalance | engine busy % mean / max | preemptions | client KB/req | proxy CPU µs/req | RSS MB | errors |"
        );
        let _ = writeln!(md, "| --- |{}", " ---: |".repeat(18));
        for (i, slot) in self.slots.iter().enumerate() {
            let rs = &runs[i];
            let m = |f: &dyn Fn(&Run) -> f64| median(rs.iter().map(f).collect());
            let hit = m(&|r| r.hit().rate());
            let cpu = rs
                .iter()
                .all(|r| r.proxy_cpu_ns.is_some())
                .then(|| m(&|r| r.proxy_cpu_ns.unwrap_or(0) as f64 / 1e3 / r.outcomes.len().max(1) as f64));
            let rss = rs.iter().all(|r| r.rss_mb.is_some()).then(|| m(&|r| r.rss_mb.unwrap_or(0.0)));
            let _ = writeln!(
                md,
                "| {} | {hit:.3} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.0} / {:.0} | {:.0} | {:.1} | {} | {} | {} |",
                slot.label(),
                ratio(hit, self.ceiling.rate(), &slot.spec),
                ratio(hit, self.oracle.rate(), &slot.spec),
                m(&|r| r.per_backend.iter().map(Counters::prefilled).sum()),
                m(&|r| r.pct(0.5, |o| o.ttft)),
                m(&|r| r.pct(0.9, |o| o.ttft)),
                m(&|r| r.pct(0.99, |o| o.ttft)),
                m(&|r| r.pct(0.5, |o| Some(o.e2e))),
                m(&|r| r.pct(0.99, |o| Some(o.e2e))),
                m(&|r| r.output_tps()),
                m(&|r| r.request_imbalance()),
                m(&|r| r.work_imbalance()),
                m(&|r| r.busy(false) * 100.0),
                m(&|r| r.busy(true) * 100.0),
                m(&|r| r.per_backend.iter().map(|c| c.preemptions).sum()),
                m(&|r| r.outcomes.iter().map(|o| o.bytes_sent).sum::<usize>() as f64 / 1024.0 / r.outcomes.len().max(1) as f64),
                cpu.map_or("—".into(), |c| format!("{c:.0}")),
                rss.map_or("—".into(), |c| format!("{c:.1}")),
                rs.iter().map(Run::errors).sum::<usize>(),
            );
        }
        let _ = writeln!(md);
        md.push_str(&self.against_peers(runs));
        let _ = writeln!(md, "CHART\n");
        if self.topts.is_none() {
            md.push_str(&self.per_turn(runs));
        }
        let _ = writeln!(
            md,
            "Hit rate: Σ `vllm:prefix_cache_hits_total` / Σ `vllm:prefix_cache_queries_total` over the engines \
             during the run (tokens; the last prompt token is never a hit, as in vLLM). Prefilled tokens: queries − hits \
             (recomputation after preemption included). Imbalance: max / mean over engines of requests, and of \
             prefilled tokens (work). Engine busy: `warmpath_engine_busy_seconds_total` over the run's wall time. \
             Preemptions: sequences evicted for lack of KV blocks and recomputed (their recomputed \
             prefix counts as hits). TTFT: time to the first streamed chunk with text, wall clock, on a shared \
             2-core machine where client, proxy and engines compete for the CPU. Client KB/req: bytes the client \
             wrote (request line, headers, body). Proxy CPU: the target's process tree, /proc schedstat, over the \
             run less its idle rate (measured for 2 s just before) × the run's length, ÷ requests (— for `direct`)."
        );
        md
    }

    /// Each warmpath run against the best peer of the same run (lowest TTFT p50, lowest p99,
    /// highest hit rate, each taken separately): the ratios the routing goals are stated in.
    fn against_peers(&self, runs: &[Vec<Run>]) -> String {
        let med = |i: usize, f: &dyn Fn(&Run) -> f64| median(runs[i].iter().map(f).collect());
        let is_peer = |s: &Slot| !s.spec.starts_with("warmpath") && s.spec != "direct";
        let best = |f: &dyn Fn(&Run) -> f64, lowest: bool| -> Option<(f64, String)> {
            let mut v: Vec<(f64, String)> = (0..self.slots.len())
                .filter(|&i| is_peer(&self.slots[i]) && !self.slots[i].spec.starts_with("nginx"))
                .map(|i| (med(i, f), self.slots[i].label()))
                .filter(|(x, _)| x.is_finite())
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            if lowest {
                v.into_iter().next()
            } else {
                v.pop()
            }
        };
        let p50 = best(&|r| r.pct(0.5, |o| o.ttft), true);
        let p99 = best(&|r| r.pct(0.99, |o| o.ttft), true);
        let hit = best(&|r| r.hit().rate(), false);
        let (Some(p50), Some(p99), Some(hit)) = (p50, p99, hit) else { return String::new() };
        let mut md = String::new();
        for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| s.spec.starts_with("warmpath")) {
            let _ = writeln!(
                md,
                "- {} vs the best router peer: TTFT p50 {:.2}× ({}), p99 {:.2}× ({}), hit rate {:.3}× ({})",
                s.label(),
                med(i, &|r| r.pct(0.5, |o| o.ttft)) / p50.0,
                p50.1,
                med(i, &|r| r.pct(0.99, |o| o.ttft)) / p99.0,
                p99.1,
                med(i, &|r| r.hit().rate()) / hit.0.max(1e-9),
                hit.1
            );
        }
        md.push('\n');
        md
    }

    /// Per turn of the agent workload: the prompt the engine got and what it prefilled of it
    /// (prompt − cached, from each response's usage), TTFT p50, client bytes and the target's
    /// CPU per request, for every run.
    fn per_turn(&self, runs: &[Vec<Run>]) -> String {
        let mut md =
            String::from("### Per turn (means over sessions; first round)\n\n| turn | tokens sent |");
        for s in self.slots {
            let _ =
                write!(md, " {} prompt | prefilled | TTFT p50 ms | client KB | proxy CPU µs |", s.label());
        }
        md.push_str("\n| ---: | ---: |");
        md.push_str(&" ---: | ---: | ---: | ---: | ---: |".repeat(self.slots.len()));
        md.push('\n');
        let turns = self.reqs.iter().filter_map(|r| r.session).map(|s| s.1 + 1).max().unwrap_or(0);
        for t in 0..turns {
            let idx: Vec<usize> =
                (0..self.reqs.len()).filter(|&i| self.reqs[i].session.is_some_and(|s| s.1 == t)).collect();
            let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
            let prompt = mean(idx.iter().map(|&i| self.reqs[i].tokens.len() as f64).collect());
            let _ = write!(md, "| {} | {prompt:.0} |", t + 1);
            for rs in runs {
                let Some(r) = rs.first() else {
                    md.push_str(" — | — | — | — | — |");
                    continue;
                };
                let outs: Vec<&Outcome> = idx.iter().map(|&i| &r.outcomes[i]).filter(|o| o.ok).collect();
                let prefilled = mean(
                    outs.iter()
                        .filter_map(|o| Some(o.prompt_tokens? as f64 - o.cached_tokens.unwrap_or(0) as f64))
                        .collect(),
                );
                let ttft =
                    median(outs.iter().filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1e3).collect());
                let kb = mean(outs.iter().map(|o| o.bytes_sent as f64 / 1024.0).collect());
                let prompt = mean(outs.iter().filter_map(|o| o.prompt_tokens.map(|p| p as f64)).collect());
                let cpu = r.turn_cpu_us.get(t).map_or("—".to_owned(), |c| format!("{c:.0}"));
                let _ = write!(md, " {prompt:.0} | {prefilled:.0} | {ttft:.0} | {kb:.1} | {cpu} |");
            }
            md.push('\n');
        }
        md.push('\n');
        md
    }

    pub(super) fn chart(&self, runs: &[Vec<Run>]) -> String {
        let labels: Vec<String> = self.slots.iter().map(Slot::label).collect();
        let med = |i: usize, f: &dyn Fn(&Run) -> f64| median(runs[i].iter().map(f).collect());
        let hits: Vec<f64> = (0..labels.len()).map(|i| med(i, &|r| r.hit().rate())).collect();
        let p50: Vec<f64> = (0..labels.len()).map(|i| med(i, &|r| r.pct(0.5, |o| o.ttft))).collect();
        let p99: Vec<f64> = (0..labels.len()).map(|i| med(i, &|r| r.pct(0.99, |o| o.ttft))).collect();
        report::svg(&[
            Chart {
                title: "prefix-cache hit rate (tokens)".into(),
                labels: labels.clone(),
                series: vec![("hit rate".into(), hits)],
                refs: vec![
                    ("partition ceiling".into(), self.ceiling.rate()),
                    ("oracle".into(), self.oracle.rate()),
                ],
                unit: String::new(),
            },
            Chart {
                title: "TTFT, ms".into(),
                labels,
                series: vec![("p50".into(), p50), ("p99".into(), p99)],
                refs: Vec::new(),
                unit: " ms".into(),
            },
        ])
    }
}
