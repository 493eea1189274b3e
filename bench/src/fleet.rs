//! The backends of a comparison: N `warmpath-engine` processes on loopback (the `sim` executor
//! with a finite KV cache, so routing decides hit rates; or `llama` for small real runs), and
//! what the benchmark reads from them: vLLM's counters, and a prefix-cache reset between targets.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::targets::{self, Target};

/// How every engine of the fleet is started.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineOpts {
    /// Engine executor: `sim` (timing model) or `llama` (the real forward pass; small runs only).
    #[arg(long, default_value = "sim")]
    pub executor: String,
    /// Engine model for `--executor llama`: `tiny` (dummy weights) or `smollm2-135m-instruct`
    /// (the real model scripts/ensure-deps installs); the sim executor tokenizes with tiny's.
    #[arg(long, default_value = "tiny")]
    pub engine_model: String,
    /// KV cache blocks per engine (16 tokens each); default: `--kv-fraction` of the working set.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// KV capacity of each engine as a fraction of the workload's working set (distinct blocks).
    #[arg(long, default_value_t = 0.15)]
    pub kv_fraction: f64,
    /// sim: prefill time per uncached token, µs.
    #[arg(long, default_value_t = 60.0)]
    pub prefill_us_per_token: f64,
    /// sim: time per decode step, ms.
    #[arg(long, default_value_t = 5.0)]
    pub itl_ms: f64,
    /// Most sequences running at once per engine.
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    /// Token budget of one scheduler step (chunked prefill).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// A host-memory KV tier on every engine of this many times its KV blocks (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub kv_tier_factor: f64,
    /// A disk KV tier on every engine of this many times its KV blocks (0: none), in its run
    /// directory (emptied at start), below the host tier where there is one.
    #[arg(long, default_value_t = 0.0)]
    pub kv_tier_disk_factor: f64,
    /// sim: time to load a block from the tier, µs (80: a 2 MiB block over PCIe at 25 GB/s).
    #[arg(long, default_value_t = 80.0)]
    pub kv_load_us_per_block: f64,
    /// Every engine serves its cached K/V to the others (a transfer port each, named to
    /// warmpath as `kv_transfer`): `cache_aware` may have a busy holder's prefix fetched.
    #[arg(long)]
    pub kv_transfer: bool,
    /// Time a decode engine spends per K/V block it fetches from another, µs.
    #[arg(long, default_value_t = 80.0)]
    pub transfer_us_per_block: f64,
    /// A KV tier the engines share: a `redis-server` of the fleet's own, each engine started
    /// with `--kv-tier-shared` and named to warmpath as `shared_kv_tier` (emptied between
    /// targets, as the caches are).
    #[arg(long)]
    pub kv_tier_shared: bool,
    /// The shared tier's Redis `maxmemory` in MiB, least recently used out (0: unbounded).
    #[arg(long, default_value_t = 0)]
    pub kv_tier_shared_mib: u64,
}

impl EngineOpts {
    /// Tier blocks per engine of `kv_blocks`.
    pub fn tier_blocks(&self, kv_blocks: usize) -> usize {
        (kv_blocks as f64 * self.kv_tier_factor.max(0.0)).round() as usize
    }
}

pub struct Fleet {
    pub engines: Vec<Target>,
    /// Each engine's KV event endpoint (ZMQ), for routers that follow them.
    pub kv_events: Vec<String>,
    /// Each engine's K/V transfer address, where `--kv-transfer` gave them one.
    pub kv_transfer: Vec<String>,
    /// The shared KV tier's Redis, where `--kv-tier-shared` started one.
    pub shared: Option<Target>,
}

pub const BLOCK_SIZE: usize = 16;

impl Fleet {
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.engines.iter().map(|e| e.addr).collect()
    }

    /// The lines of each engine's table in a warmpath policy: its KV event endpoint, and its
    /// K/V transfer address where it has one.
    pub fn backend_toml(&self) -> Vec<String> {
        (0..self.engines.len())
            .map(|i| {
                let mut t = format!("kv_events = \"{}\"\n", self.kv_events[i]);
                if let Some(k) = self.kv_transfer.get(i) {
                    t.push_str(&format!("kv_transfer = \"{k}\"\n"));
                }
                if self.shared.is_some() {
                    t.push_str("shared_kv_tier = true\n");
                }
                t
            })
            .collect()
    }

    /// Starts `n` engines serving `model`, each with `kv_blocks` blocks and room for prompts of
    /// `max_model_len` tokens.
    pub async fn start(
        n: usize,
        o: &EngineOpts,
        kv_blocks: usize,
        max_model_len: usize,
        model: &str,
    ) -> anyhow::Result<Fleet> {
        Fleet::start_with(n, o, kv_blocks, max_model_len, model, &|_| Vec::new()).await
    }

    /// [`Fleet::start`], engine `i` with the extra flags `extra(i)`.
    pub async fn start_with(
        n: usize,
        o: &EngineOpts,
        kv_blocks: usize,
        max_model_len: usize,
        model: &str,
        extra: &dyn Fn(usize) -> Vec<String>,
    ) -> anyhow::Result<Fleet> {
        let bin = targets::sibling("warmpath-engine")?;
        let shared = match o.kv_tier_shared {
            true => Some(start_redis(o.kv_tier_shared_mib).await?),
            false => None,
        };
        let mut engines = Vec::new();
        let mut kv_events = Vec::new();
        let mut kv_transfer = Vec::new();
        for i in 0..n {
            let addr = targets::free_addr()?;
            let kv = format!("tcp://{}", targets::free_addr()?);
            let mut cmd = Command::new(&bin);
            cmd.args(["--executor", &o.executor, "--model", &o.engine_model, "--served-model-name", model])
                .args(["--port", &addr.port().to_string(), "--engine-id", &i.to_string()])
                .args(["--kv-blocks", &kv_blocks.to_string(), "--block-size", &BLOCK_SIZE.to_string()])
                .args(["--max-model-len", &max_model_len.to_string()])
                .args(["--max-num-seqs", &o.max_num_seqs.to_string()])
                .args(["--max-num-batched-tokens", &o.max_num_batched_tokens.to_string()])
                .args(["--sim-prefill-us-per-token", &o.prefill_us_per_token.to_string()])
                .args(["--sim-itl-ms", &o.itl_ms.to_string()])
                .args(["--weight-seed", "0"])
                .args(["--kv-events-endpoint", &kv])
                .args(extra(i));
            if o.kv_transfer {
                let t = targets::free_addr()?;
                cmd.args(["--kv-transfer-port", &t.port().to_string()]);
                cmd.args(["--kv-transfer-delay-us-per-block", &o.transfer_us_per_block.to_string()]);
                kv_transfer.push(t.to_string());
            }
            let tier = o.tier_blocks(kv_blocks);
            if tier > 0 {
                cmd.args(["--kv-tier-blocks", &tier.to_string()]);
            }
            if let Some(r) = &shared {
                cmd.args(["--kv-tier-shared", &format!("redis://{}", r.addr)]);
            }
            let disk = (kv_blocks as f64 * o.kv_tier_disk_factor.max(0.0)).round() as usize;
            if disk > 0 {
                let dir = targets::work_dir(&format!("engine-{i}"))?.join("kv-disk");
                let _ = std::fs::remove_dir_all(&dir);
                cmd.args(["--kv-tier-disk", &dir.display().to_string()]);
                cmd.args(["--kv-tier-disk-blocks", &disk.to_string()]);
            }
            if (tier > 0 || disk > 0 || shared.is_some()) && o.executor == "sim" {
                cmd.args(["--sim-kv-load-us-per-block", &o.kv_load_us_per_block.to_string()]);
            }
            engines.push(targets::spawn(&format!("engine-{i}"), &mut cmd, addr)?);
            kv_events.push(kv);
        }
        let fleet = Fleet { engines, kv_events, kv_transfer, shared };
        let deadline = Instant::now() + Duration::from_secs(60);
        for e in &fleet.engines {
            while !matches!(get(e.addr, "/health").await, Ok((200, _))) {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{} did not start (bench/.peers/run/{}/log.txt)",
                    e.name,
                    e.name
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(fleet)
    }

    pub async fn counters(&self) -> anyhow::Result<Vec<Counters>> {
        let mut v = Vec::new();
        for e in &self.engines {
            let (_, text) = get(e.addr, "/metrics").await?;
            v.push(Counters::parse(&text));
        }
        Ok(v)
    }

    /// Empties every engine's prefix cache (between targets, so each starts cold).
    pub async fn reset(&self) -> anyhow::Result<()> {
        for e in &self.engines {
            let (s, body) = post(e.addr, "/reset_prefix_cache").await?;
            anyhow::ensure!(s == 200, "{}: reset_prefix_cache answered {s}: {body}", e.name);
        }
        if let Some(r) = &self.shared {
            redis_command(r.addr, "FLUSHALL").await?;
        }
        Ok(())
    }
}

/// A `redis-server` of the fleet's own on loopback, nothing persisted; `mib` > 0 bounds it
/// (least recently used keys out).
async fn start_redis(mib: u64) -> anyhow::Result<Target> {
    let addr = targets::free_addr()?;
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &addr.port().to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    if mib > 0 {
        cmd.args(["--maxmemory", &format!("{mib}mb"), "--maxmemory-policy", "allkeys-lru"]);
    }
    let redis = targets::spawn("redis", &mut cmd, addr)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis_command(addr, "PING").await.is_err() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "redis-server did not start (bench/.peers/run/redis/log.txt)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(redis)
}

/// Sends one inline command to the Redis at `addr`; fails unless it answers `+OK`/`+PONG`.
async fn redis_command(addr: SocketAddr, cmd: &str) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("{cmd}\r\n").as_bytes()).await?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).await?;
    anyhow::ensure!(
        buf[..n].starts_with(b"+"),
        "redis answered {cmd} with {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    Ok(())
}

/// The engine counters a report needs (sums over label sets).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub prefix_queries: f64,
    pub prefix_hits: f64,
    pub requests: f64,
    pub preemptions: f64,
    /// Seconds spent executing steps (`warmpath_engine_busy_seconds_total`).
    pub busy_s: f64,
}

impl Counters {
    pub fn parse(text: &str) -> Counters {
        let mut c = Counters::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
            match name {
                "vllm:prefix_cache_queries_total" => c.prefix_queries += v,
                "vllm:prefix_cache_hits_total" => c.prefix_hits += v,
                "vllm:request_success_total" => c.requests += v,
                "vllm:num_preemptions_total" => c.preemptions += v,
                "warmpath_engine_busy_seconds_total" => c.busy_s += v,
                _ => {}
            }
        }
        c
    }

    pub fn minus(&self, o: &Counters) -> Counters {
        Counters {
            prefix_queries: self.prefix_queries - o.prefix_queries,
            prefix_hits: self.prefix_hits - o.prefix_hits,
            requests: self.requests - o.requests,
            preemptions: self.preemptions - o.preemptions,
            busy_s: self.busy_s - o.busy_s,
        }
    }

    /// Tokens actually prefilled (recomputation after preemption included).
    pub fn prefilled(&self) -> f64 {
        self.prefix_queries - self.prefix_hits
    }
}

async fn request(addr: SocketAddr, req: hyper::Request<Full<Bytes>>) -> anyhow::Result<(u16, String)> {
    let mut sender = crate::load::connect(addr).await?;
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req)).await??;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let req = hyper::Request::get(path).header("host", addr.to_string()).body(Full::new(Bytes::new()))?;
    request(addr, req).await
}

/// A JSON request body to `path`.
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> anyhow::Result<(u16, String)> {
    let req = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    request(addr, req).await
}

pub async fn post(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let req = hyper::Request::post(path).header("host", addr.to_string()).body(Full::new(Bytes::new()))?;
    request(addr, req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_over_labels() {
        let text = "# HELP x\nvllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 40\n\
                    vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 100\n\
                    vllm:request_success_total{engine=\"0\",finished_reason=\"length\"} 2\n\
                    vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"} 3\n\
                    vllm:prefix_cache_hits_created 5\n";
        let c = Counters::parse(text);
        assert_eq!(
            c,
            Counters {
                prefix_queries: 100.0,
                prefix_hits: 40.0,
                requests: 5.0,
                preemptions: 0.0,
                busy_s: 0.0
            }
        );
        assert_eq!(c.prefilled(), 60.0);
    }
}
