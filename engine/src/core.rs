//! The engine core: a dedicated thread that owns the scheduler and the executor and runs steps
//! while there is work, and the [`Engine`] handle through which requests enter.
//!
//! Each request gets a channel of [`RequestOutput`]s. Dropping its [`RequestStream`] (a client
//! that went away) aborts the request at the next step boundary and frees its blocks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use warmpath_wire::openai::{ApiError, FinishReason};
use warmpath_wire::prefix::BlockHash;

use crate::block_pool::BlockPool;
use crate::executor::Executor;
use crate::kv_events::KvEventSink;
use crate::metrics::Metrics;
use crate::scheduler::{SamplingParams, Scheduler, SchedulerConfig, SeqOutput, Sequence};

/// Fixed facts about an engine that the front end needs.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub model_name: String,
    pub vocab_size: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub prefix_caching: bool,
}

/// What a request receives after a step.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub token: u32,
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache (the same on every output of a request).
    pub cached_tokens: usize,
    /// The token's log-probabilities, where the request asked for them.
    pub logprobs: Option<crate::sampler::TokenLogprobs>,
}

/// How a request takes part in prefill/decode disaggregation ([`crate::kv_transfer`]).
#[derive(Debug, Default)]
pub struct Handoff {
    /// Keep the request's blocks this long after it finishes, for a decode replica to fetch.
    pub hold: Option<Duration>,
    /// K/V of the prompt's leading blocks, fetched from a prefill replica.
    pub loaded: Option<Loaded>,
}

/// K/V of a prompt's leading blocks brought from another replica.
#[derive(Debug)]
pub struct Loaded {
    /// Chained hashes of the prompt's blocks up to the last one loaded.
    pub hashes: Vec<BlockHash>,
    /// Blocks before this one were already held here (they are pinned, not loaded).
    pub first: usize,
    /// One block's bytes each, for `hashes[first..]`.
    pub blocks: Vec<Vec<u8>>,
}

impl Loaded {
    /// What arrived for the blocks `hashes[first..]`, from the first on; `None` when nothing did.
    pub fn arrived(mut hashes: Vec<BlockHash>, first: usize, blocks: Vec<Vec<u8>>) -> Option<Loaded> {
        if blocks.is_empty() {
            return None;
        }
        hashes.truncate(first + blocks.len());
        Some(Loaded { hashes, first, blocks })
    }
}

enum Command {
    Add(Box<Sequence>, mpsc::UnboundedSender<RequestOutput>, Option<Loaded>),
    Abort(u64),
    ResetPrefixCache,
    /// How many of the hashes, from the start, are cached here.
    Cached(Vec<BlockHash>, oneshot::Sender<usize>),
    /// The bytes of the blocks cached under the hashes, in order, up to the first not cached.
    Export(Vec<BlockHash>, oneshot::Sender<Vec<Vec<u8>>>),
    /// Frees the blocks held for a request.
    Release(u64),
}

/// Handle on a running engine. Cloning the `Arc` shares it; the thread stops once the handle
/// and every request stream are gone.
pub struct Engine {
    tx: std_mpsc::Sender<Command>,
    info: EngineInfo,
    next_id: AtomicU64,
    /// The engine thread; it ends by itself once every sender of commands is dropped.
    _thread: JoinHandle<()>,
    pub metrics: Arc<Metrics>,
    /// Bytes of one block's K/V (0: the executor cannot move K/V).
    block_bytes: usize,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("info", &self.info).finish()
    }
}

impl Engine {
    /// Starts the engine thread.
    pub fn start(
        info: EngineInfo,
        sched_cfg: SchedulerConfig,
        executor: Box<dyn Executor>,
        metrics: Arc<Metrics>,
        events: Option<KvEventSink>,
        tiers: crate::kv_tier::Attached,
    ) -> std::io::Result<Engine> {
        let pool = BlockPool::new(info.num_blocks, info.block_size, events.is_some());
        let block_bytes = executor.block_bytes();
        let mut sched = Scheduler::new(sched_cfg, pool);
        if info.prefix_caching && block_bytes > 0 {
            if let Some(d) = tiers.disk {
                sched.set_disk_tier(d);
            }
            if let Some(s) = tiers.shared {
                sched.set_sink(s);
            }
        }
        let (tx, rx) = std_mpsc::channel();
        let m = metrics.clone();
        let thread = std::thread::Builder::new().name("engine-core".into()).spawn(move || {
            EngineLoop { sched, exec: executor, metrics: m, events, streams: Default::default() }.run(rx)
        })?;
        Ok(Engine { tx, info, next_id: AtomicU64::new(1), _thread: thread, metrics, block_bytes })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Bytes of one block's K/V as other replicas fetch it (0: this executor's cannot move).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The chained hashes of `prompt`'s blocks that another replica or a tier may supply: its
    /// full blocks before its last token (that token is always computed).
    pub fn loadable_hashes(&self, prompt: &[u32], cache_salt: Option<&str>) -> Vec<BlockHash> {
        let bs = self.info.block_size;
        let mut hashes = warmpath_wire::prefix::block_hashes(prompt, bs, cache_salt);
        hashes.truncate(prompt.len().saturating_sub(1) / bs);
        hashes
    }

    /// Queues a request. Fails with a 400 when it cannot fit the model or the cache.
    pub fn generate(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        cache_salt: Option<String>,
    ) -> Result<RequestStream, ApiError> {
        self.generate_with(prompt, params, cache_salt, Handoff::default())
    }

    /// [`Engine::generate`] for a request that hands its K/V on or brings it along.
    pub fn generate_with(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        cache_salt: Option<String>,
        handoff: Handoff,
    ) -> Result<RequestStream, ApiError> {
        let info = &self.info;
        if prompt.is_empty() {
            return Err(ApiError::invalid_request("the prompt is empty").with_param("prompt"));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(ApiError::invalid_request(format!(
                "token id {bad} is out of vocabulary (size {})",
                info.vocab_size
            ))
            .with_param("prompt"));
        }
        if params.max_tokens == 0 {
            return Err(ApiError::invalid_request("max_tokens must be at least 1").with_param("max_tokens"));
        }
        let total = prompt.len() + params.max_tokens;
        if total > info.max_model_len {
            return Err(ApiError::invalid_request(format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens \
                 ({} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
                info.max_model_len,
                total,
                prompt.len(),
                params.max_tokens
            ))
            .with_code("context_length_exceeded"));
        }
        if total.div_ceil(info.block_size) > info.num_blocks {
            return Err(ApiError::invalid_request(format!(
                "the request needs {} KV cache blocks but the cache has {}",
                total.div_ceil(info.block_size),
                info.num_blocks
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (otx, orx) = mpsc::unbounded_channel();
        let mut seq = Sequence::new(id, prompt, params, cache_salt);
        if let Some(d) = handoff.hold {
            seq.hold_blocks_for(d);
        }
        self.tx
            .send(Command::Add(Box::new(seq), otx, handoff.loaded))
            .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
        Ok(RequestStream { id, rx: orx, tx: self.tx.clone(), done: false })
    }

    /// Forgets all cached prefixes (`POST /reset_prefix_cache`).
    pub fn reset_prefix_cache(&self) {
        let _ = self.tx.send(Command::ResetPrefixCache);
    }

    /// How many of `hashes`, from the start, this engine holds (0 if it has stopped).
    pub async fn cached_prefix(&self, hashes: Vec<BlockHash>) -> usize {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Cached(hashes, tx)).is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }

    /// The K/V bytes of the blocks cached under `hashes`, in order, up to the first that is not.
    pub async fn export(&self, hashes: Vec<BlockHash>) -> Vec<Vec<u8>> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Export(hashes, tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Frees the blocks held for request `id` (a decode replica has fetched them).
    pub fn release(&self, id: u64) {
        let _ = self.tx.send(Command::Release(id));
    }
}

/// The outputs of one request. Dropping it before the end aborts the request.
pub struct RequestStream {
    id: u64,
    rx: mpsc::UnboundedReceiver<RequestOutput>,
    tx: std_mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next output; `None` after the finishing one (or if the engine stopped).
    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.done {
            return None;
        }
        let out = self.rx.recv().await;
        if out.as_ref().is_none_or(|o| o.finish.is_some()) {
            self.done = true;
        }
        out
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

struct EngineLoop {
    sched: Scheduler,
    exec: Box<dyn Executor>,
    metrics: Arc<Metrics>,
    events: Option<KvEventSink>,
    streams: std::collections::HashMap<u64, mpsc::UnboundedSender<RequestOutput>>,
}

impl EngineLoop {
    fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        loop {
            if self.sched.expire_held(Instant::now()) > 0 {
                self.publish();
            }
            if self.sched.is_idle() {
                // Idle: wait for a command, or for the next held request's time to be up.
                let next = self.sched.next_hold_expiry();
                let wait = next.map(|t| t.saturating_duration_since(Instant::now()));
                let got = match wait {
                    Some(d) => rx.recv_timeout(d).map_err(|e| e == std_mpsc::RecvTimeoutError::Disconnected),
                    None => rx.recv().map_err(|_| true),
                };
                match got {
                    Ok(cmd) => self.handle(cmd),
                    Err(true) => break, // every handle is gone
                    Err(false) => continue,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            let started = std::time::Instant::now();
            let outputs = self.sched.step(self.exec.as_mut());
            let stepped = !outputs.is_empty() || self.sched.num_running() > 0;
            if stepped {
                self.metrics.add_busy(started.elapsed().as_secs_f64());
            }
            // Metrics first: a client that sees its last token also sees the gauges without it.
            self.publish();
            if self.deliver(outputs) {
                self.publish();
            }
            if !stepped && !self.sched.is_idle() {
                // Waiting work that cannot be admitted (only possible transiently): wait for a
                // command instead of spinning.
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => break,
                }
            }
        }
        tracing::debug!("engine loop stopped");
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add(mut seq, tx, loaded) => {
                if let Some(l) = loaded {
                    self.load(&mut seq, l);
                }
                self.streams.insert(seq.id, tx);
                self.sched.add(*seq);
            }
            Command::Cached(hashes, reply) => {
                let _ = reply.send(self.sched.pool().find_cached_prefix(&hashes, hashes.len()).len());
            }
            Command::Export(hashes, reply) => {
                let blocks = self.sched.pool().find_cached_prefix(&hashes, hashes.len());
                let out = blocks
                    .iter()
                    .map(|&b| {
                        let mut data = Vec::new();
                        self.exec.read_block(b, &mut data);
                        data
                    })
                    .collect();
                let _ = reply.send(out);
            }
            Command::Release(id) => {
                self.sched.release(id);
            }
            Command::Abort(id) => {
                self.streams.remove(&id);
                if self.sched.abort(id) {
                    tracing::debug!(id, "request aborted");
                } else if self.sched.release(id) {
                    // A prefill for a remote decode that finished in the step its client left
                    // during: nobody will fetch what it holds.
                    tracing::debug!(id, "held blocks of an abandoned prefill freed");
                }
            }
            Command::ResetPrefixCache => self.sched.reset_prefix_cache(),
        }
        self.publish();
    }

    /// Writes K/V brought from another replica into fresh blocks and makes them findable under
    /// their hashes (KV events announce them as for blocks computed here), pinned for `seq`
    /// until it is admitted, with the blocks before them already held here. Loads nothing when
    /// the blocks are not this model's or the cache has no room: the prompt is then computed.
    fn load(&mut self, seq: &mut Sequence, l: Loaded) {
        let bs = self.sched.pool().block_size();
        let tokens = seq.prompt();
        let end = l.first + l.blocks.len();
        let fits = l.hashes.len() == end
            && end * bs < tokens.len()
            && l.blocks.iter().all(|b| b.len() == self.exec.block_bytes() && !b.is_empty());
        if !fits {
            tracing::warn!(
                blocks = l.blocks.len(),
                "loaded K/V does not fit this model or prompt: computing it"
            );
            return;
        }
        let pool = self.sched.pool_mut();
        let mut pinned = pool.find_cached_prefix(&l.hashes[..l.first], l.first);
        if pinned.len() < l.first {
            // What was held here is gone since it was counted: the loaded blocks would not
            // continue a cached prefix.
            return;
        }
        pool.touch(&pinned);
        let Some(fresh) = self.sched.allocate(self.exec.as_mut(), l.blocks.len()) else {
            self.sched.pool_mut().free(&pinned);
            return;
        };
        for (&b, data) in fresh.iter().zip(&l.blocks) {
            self.exec.write_block(b, data);
        }
        let pool = self.sched.pool_mut();
        let parent = l.first.checked_sub(1).map(|p| l.hashes[p]);
        pool.cache_blocks(&fresh, &l.hashes[l.first..end], parent, &tokens[l.first * bs..end * bs]);
        pinned.extend(fresh);
        seq.pin(pinned);
    }

    /// Sends each output to its request; returns whether a request whose client is gone was
    /// aborted.
    fn deliver(&mut self, outputs: Vec<SeqOutput>) -> bool {
        let mut aborted = false;
        for o in outputs {
            if let Some(t) = o.ttft {
                self.metrics.observe_ttft(t.as_secs_f64());
            }
            if let Some(t) = o.itl {
                self.metrics.observe_itl(t.as_secs_f64());
            }
            if let (Some(reason), Some(t)) = (o.finish, &o.timings) {
                let label = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::ToolCalls => "tool_calls",
                    FinishReason::Abort => "abort",
                };
                self.metrics.observe_finished(label, t);
            }
            let Some(token) = o.token else { continue };
            let out = RequestOutput {
                token,
                finish: o.finish,
                cached_tokens: o.cached_tokens,
                logprobs: o.logprobs,
            };
            let gone = self.streams.get(&o.id).is_none_or(|tx| tx.send(out).is_err());
            if o.finish.is_some() || gone {
                self.streams.remove(&o.id);
            }
            if gone && o.finish.is_none() {
                aborted |= self.sched.abort(o.id);
            }
        }
        aborted
    }

    fn publish(&mut self) {
        self.metrics.add_stats(&self.sched.take_stats());
        let pool = self.sched.pool();
        self.metrics.set_state(self.sched.num_running(), self.sched.num_waiting(), pool.usage());
        self.metrics.set_held_blocks(self.sched.num_held_blocks());
        for (medium, blocks, st) in self.sched.tier_states() {
            self.metrics.tiers.set(medium, blocks, &st);
        }
        if let Some(sink) = &self.events {
            let events = self.sched.pool_mut().take_events();
            if !events.is_empty() {
                sink.send(events);
            }
        }
    }
}
