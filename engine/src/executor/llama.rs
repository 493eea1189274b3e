//! The llama forward pass over a paged KV cache: RMSNorm, RoPE, grouped-query attention that
//! reads K/V through each sequence's block table, SwiGLU MLP; f32, all sequences of a step in
//! one batch so that every weight matrix is read once per step.
//!
//! Logits are computed only for the rows that are sampled, as in vLLM: with a 32k vocabulary the
//! output projection costs more than all layers of the tiny model together.

use super::attention::{attention, KvCache};
use super::{Executor, SeqStep};
use crate::block_pool::BlockId;
use crate::math::{rmsnorm, rope, swiglu};
use crate::model::Weights;
use crate::sampler::argmax;

/// Runs the llama model on the CPU.
pub struct LlamaExecutor {
    w: Weights,
    cache: KvCache,
    /// The threads a step's matrix products and attention heads are split over; the step itself
    /// runs on one of them, so the engine thread does not sit beside them.
    pool: rayon::ThreadPool,
}

impl LlamaExecutor {
    /// An executor using every core.
    pub fn new(weights: Weights, num_blocks: usize, block_size: usize) -> LlamaExecutor {
        LlamaExecutor::with_threads(weights, num_blocks, block_size, 0)
    }

    /// An executor on `threads` threads (0: one per core).
    pub fn with_threads(
        weights: Weights,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
    ) -> LlamaExecutor {
        let c = &weights.cfg;
        let cache = KvCache::new(c.n_layers, num_blocks, block_size, c.kv_dim());
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("engine-math-{i}"))
            .build()
            .expect("threads start");
        LlamaExecutor { w: weights, cache, pool }
    }

    pub fn weights(&self) -> &Weights {
        &self.w
    }

    /// The forward pass over entries `(tokens, start position, block table, rows)`; returns the
    /// logits (`[rows × vocab]`) of the last `rows` tokens of each entry, in batch order.
    pub fn forward(&mut self, batch: &[(&[u32], usize, &[BlockId], usize)]) -> Vec<f32> {
        let LlamaExecutor { w, cache, pool } = self;
        pool.install(|| compute(w, cache, batch))
    }

    /// Greedy decoding of `n` tokens after `prompt`, one token per step as the server decodes
    /// (blocks from 0 on; no end of text). For comparisons with other engines.
    pub fn greedy(&mut self, prompt: &[u32], n: usize) -> Vec<u32> {
        let table: Vec<BlockId> =
            (0..(prompt.len() + n).div_ceil(self.cache.block_size()) as BlockId).collect();
        let mut out = vec![argmax(&self.forward(&[(prompt, 0, &table, 1)]))];
        while out.len() < n {
            let pos = prompt.len() + out.len() - 1;
            out.push(argmax(&self.forward(&[(&out[out.len() - 1..], pos, &table, 1)])));
        }
        out
    }

    /// The greedy pick after the prompt and after every token of `forced` but the last (teacher
    /// forcing: another engine's continuation fed in, this one's choice at each position).
    pub fn teacher_forced(&mut self, prompt: &[u32], forced: &[u32]) -> Vec<u32> {
        let mut seq = prompt.to_vec();
        seq.extend_from_slice(&forced[..forced.len().saturating_sub(1)]);
        let table: Vec<BlockId> = (0..seq.len().div_ceil(self.cache.block_size()) as BlockId).collect();
        let rows = forced.len();
        let logits = self.forward(&[(&seq, 0, &table, rows)]);
        logits.chunks(self.w.cfg.vocab_size).map(argmax).collect()
    }
}

/// The forward pass on the current thread pool.
fn compute(w: &Weights, cache: &mut KvCache, batch: &[(&[u32], usize, &[BlockId], usize)]) -> Vec<f32> {
    let c = &w.cfg;
    let (dim, kv_dim, hs, hidden) = (c.dim, c.kv_dim(), c.head_size(), c.hidden_dim);
    let t: usize = batch.iter().map(|b| b.0.len()).sum();
    let mut x = vec![0.0f32; t * dim];
    let mut row = 0;
    for (tokens, ..) in batch {
        for &tok in *tokens {
            let tok = (tok as usize).min(c.vocab_size - 1);
            w.embed.row(tok, &mut x[row * dim..(row + 1) * dim]);
            row += 1;
        }
    }
    let mut xb = vec![0.0f32; t * dim];
    let mut q = vec![0.0f32; t * dim];
    let mut k = vec![0.0f32; t * kv_dim];
    let mut v = vec![0.0f32; t * kv_dim];
    let mut att = vec![0.0f32; t * dim];
    let mut h1 = vec![0.0f32; t * hidden];
    let mut h3 = vec![0.0f32; t * hidden];
    for (l, lw) in w.layers.iter().enumerate() {
        rmsnorm(&mut xb, &x, &lw.rms_att, dim, c.norm_eps);
        lw.wq.matmul(&mut q, &xb, t);
        lw.wk.matmul(&mut k, &xb, t);
        lw.wv.matmul(&mut v, &xb, t);
        // RoPE, then write this step's K/V into the pages of each sequence.
        let mut r = 0;
        for (tokens, start, table, _) in batch {
            for i in 0..tokens.len() {
                let pos = start + i;
                let p = pos as f32 * c.rope_freq_scale;
                rope(&mut q[(r + i) * dim..(r + i + 1) * dim], p, hs, c.rope_theta);
                rope(&mut k[(r + i) * kv_dim..(r + i + 1) * kv_dim], p, hs, c.rope_theta);
                let row = (r + i) * kv_dim..(r + i + 1) * kv_dim;
                cache.write(l, table, pos, &k[row.clone()], &v[row]);
            }
            r += tokens.len();
        }
        let mut r = 0;
        for (tokens, start, table, _) in batch {
            attention(w, cache, l, &q[r * dim..], &mut att[r * dim..], tokens.len(), *start, table);
            r += tokens.len();
        }
        lw.wo.matmul_add(&mut x, &att, t);
        rmsnorm(&mut xb, &x, &lw.rms_ffn, dim, c.norm_eps);
        lw.w1.matmul(&mut h1, &xb, t);
        lw.w3.matmul(&mut h3, &xb, t);
        swiglu(&mut h1, &h3);
        lw.w2.matmul_add(&mut x, &h1, t);
    }
    // Final norm and output projection, only for the rows that are sampled.
    let mut last_rows = Vec::new();
    let mut r = 0;
    for (tokens, _, _, want) in batch {
        r += tokens.len();
        last_rows.extend(r - want.min(&tokens.len())..r);
    }
    let n = last_rows.len();
    let mut xf = vec![0.0f32; n * dim];
    for (i, &r) in last_rows.iter().enumerate() {
        rmsnorm(&mut xf[i * dim..(i + 1) * dim], &x[r * dim..(r + 1) * dim], &w.rms_final, dim, c.norm_eps);
    }
    let mut logits = vec![0.0f32; n * c.vocab_size];
    w.classifier().matmul(&mut logits, &xf, n);
    logits
}

impl Executor for LlamaExecutor {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Vec<u32>> {
        let inputs: Vec<(&[u32], usize, &[BlockId], usize)> = batch
            .iter()
            .map(|s| {
                let rows = if s.sampler.is_some() { (s.num_draft + 1).min(s.tokens.len()) } else { 0 };
                (s.tokens, s.start_pos, s.block_table, rows)
            })
            .collect();
        let mut logits = self.forward(&inputs);
        let vocab = self.w.cfg.vocab_size;
        let mut rest = logits.as_mut_slice();
        batch
            .iter_mut()
            .zip(&inputs)
            .map(|(s, &(.., rows))| {
                let (mine, after) = std::mem::take(&mut rest).split_at_mut(rows * vocab);
                rest = after;
                match &mut s.sampler {
                    Some(sampler) if rows > 0 => {
                        sampler.verify(mine, &s.tokens[s.tokens.len() - (rows - 1)..])
                    }
                    _ => Vec::new(),
                }
            })
            .collect()
    }

    fn block_bytes(&self) -> usize {
        self.cache.block_bytes()
    }

    fn read_block(&self, b: BlockId, out: &mut Vec<u8>) {
        self.cache.read_block(b, out)
    }

    fn write_block(&mut self, b: BlockId, data: &[u8]) -> bool {
        self.cache.write_block(b, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_pool::BlockId;
    use crate::math::softmax;
    use crate::model::{Matrix, ModelConfig};
    use crate::quant::formats::{f16_to_f32, f32_to_f16};

    /// A straightforward single-sequence forward pass over a contiguous cache (K and V rounded
    /// to half precision, as the cache stores them), written independently of the batched,
    /// paged one: the reference it must match.
    fn reference_logits(w: &Weights, tokens: &[u32]) -> Vec<f32> {
        let c = &w.cfg;
        let (dim, kv_dim, hs) = (c.dim, c.kv_dim(), c.head_size());
        let mut kcache: Vec<Vec<Vec<f32>>> = vec![Vec::new(); c.n_layers];
        let mut vcache: Vec<Vec<Vec<f32>>> = vec![Vec::new(); c.n_layers];
        let mut last = Vec::new();
        for (pos, &tok) in tokens.iter().enumerate() {
            let mut x = vec![0.0; dim];
            w.embed.row(tok as usize, &mut x);
            for (l, lw) in w.layers.iter().enumerate() {
                let mut xb = vec![0.0; dim];
                rmsnorm(&mut xb, &x, &lw.rms_att, dim, c.norm_eps);
                let mv = |m: &Matrix, v: &[f32], n: usize| -> Vec<f32> {
                    let m = m.as_f32().expect("f32 weights");
                    (0..n).map(|i| (0..v.len()).map(|j| m[i * v.len() + j] * v[j]).sum()).collect()
                };
                let mut q = mv(&lw.wq, &xb, dim);
                let mut k = mv(&lw.wk, &xb, kv_dim);
                let v = mv(&lw.wv, &xb, kv_dim);
                rope(&mut q, pos as f32, hs, c.rope_theta);
                rope(&mut k, pos as f32, hs, c.rope_theta);
                // The cache keeps K and V in half precision.
                let half =
                    |x: Vec<f32>| -> Vec<f32> { x.into_iter().map(|v| f16_to_f32(f32_to_f16(v))).collect() };
                kcache[l].push(half(k));
                vcache[l].push(half(v));
                let mut att = vec![0.0; dim];
                for h in 0..c.n_heads {
                    let kvh = h / (c.n_heads / c.n_kv_heads);
                    let mut s: Vec<f32> = (0..=pos)
                        .map(|p| {
                            (0..hs).map(|i| q[h * hs + i] * kcache[l][p][kvh * hs + i]).sum::<f32>()
                                / (hs as f32).sqrt()
                        })
                        .collect();
                    softmax(&mut s);
                    for i in 0..hs {
                        att[h * hs + i] = (0..=pos).map(|p| s[p] * vcache[l][p][kvh * hs + i]).sum();
                    }
                }
                let o = mv(&lw.wo, &att, dim);
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                rmsnorm(&mut xb, &x, &lw.rms_ffn, dim, c.norm_eps);
                let mut a = mv(&lw.w1, &xb, c.hidden_dim);
                let b = mv(&lw.w3, &xb, c.hidden_dim);
                swiglu(&mut a, &b);
                let f = mv(&lw.w2, &a, dim);
                x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
            }
            last = x;
        }
        let mut xf = vec![0.0; dim];
        rmsnorm(&mut xf, &last, &w.rms_final, dim, c.norm_eps);
        let cls = w.classifier().as_f32().expect("f32 weights");
        (0..c.vocab_size).map(|i| (0..dim).map(|j| cls[i * dim + j] * xf[j]).sum()).collect()
    }

    fn small() -> Weights {
        let mut cfg = ModelConfig::micro();
        cfg.vocab_size = 97;
        Weights::dummy(&cfg, 11).expect("valid")
    }

    fn assert_close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-3 * (1.0 + y.abs()), "logit {i}: {x} vs {y}");
        }
    }

    #[test]
    fn paged_chunked_batched_attention_equals_contiguous_reference() {
        let w = small();
        let tokens: Vec<u32> = (0..57).map(|i| (i * 13 % 97) as u32).collect();
        let want = reference_logits(&w, &tokens);
        let mut ex = LlamaExecutor::new(w, 24, 4);
        // Scattered, out-of-order blocks, prefill in three uneven chunks (the middle one longer
        // than a decode-like step: K/V gathered), batched with an unrelated sequence that uses
        // other blocks.
        let table: Vec<BlockId> = vec![9, 2, 14, 0, 7, 11, 3, 5, 12, 1, 20, 17, 15, 16, 22];
        let other_table: Vec<BlockId> = vec![4, 6];
        let other: Vec<u32> = vec![5, 6, 7, 8, 9];
        ex.forward(&[(&tokens[..10], 0, &table, 0), (&other, 0, &other_table, 1)]);
        ex.forward(&[(&tokens[10..45], 10, &table, 0)]);
        let got = ex.forward(&[(&other[..0], 5, &other_table, 0), (&tokens[45..], 45, &table, 1)]);
        assert_close(&got, &want);
        // All at once: every row gathered.
        let mut ex = LlamaExecutor::new(small(), 24, 4);
        assert_close(&ex.forward(&[(&tokens, 0, &table, 1)]), &want);
    }

    #[test]
    fn decode_steps_equal_the_reference_at_each_position() {
        let w = small();
        let tokens: Vec<u32> = (0..20).map(|i| (i * 7 % 97) as u32).collect();
        let mut ex = LlamaExecutor::new(w.clone(), 8, 16);
        let table: Vec<BlockId> = vec![3, 1];
        ex.forward(&[(&tokens[..12], 0, &table, 0)]);
        for p in 12..20 {
            let got = ex.forward(&[(&tokens[p..p + 1], p, &table, 1)]);
            assert_close(&got, &reference_logits(&w, &tokens[..=p]));
        }
    }

    /// Past several pieces of the context that decode attention splits among its tasks (and
    /// rows that straddle a cut): each row's logits are the reference's, and a step verifying
    /// several rows gives each exactly the bits of a one-token step.
    #[test]
    fn long_contexts_split_among_tasks_equal_the_reference_and_one_token_steps() {
        let w = small();
        let tokens: Vec<u32> = (0..1032).map(|i| (i * 31 % 97) as u32).collect();
        let table: Vec<BlockId> = (0..65).rev().collect();
        let mut many = LlamaExecutor::new(w.clone(), 70, 16);
        many.forward(&[(&tokens[..1018], 0, &table, 0)]);
        let got = many.forward(&[(&tokens[1018..], 1018, &table, 14)]);
        let mut one = LlamaExecutor::new(w.clone(), 70, 16);
        one.forward(&[(&tokens[..1018], 0, &table, 0)]);
        let vocab = w.cfg.vocab_size;
        for (i, p) in (1018..1032).enumerate() {
            let step = one.forward(&[(&tokens[p..p + 1], p, &table, 1)]);
            assert_eq!(&got[i * vocab..(i + 1) * vocab], &step[..], "position {p}");
            if p % 5 == 0 {
                assert_close(&step, &reference_logits(&w, &tokens[..=p]));
            }
        }
    }

    #[test]
    fn a_step_returns_the_logits_of_each_of_its_last_rows() {
        // A verification step: positions 12..17 computed at once, logits for the last 4.
        let w = small();
        let tokens: Vec<u32> = (0..17).map(|i| (i * 5 % 97) as u32).collect();
        let mut ex = LlamaExecutor::new(w.clone(), 8, 16);
        let table: Vec<BlockId> = vec![2, 5];
        ex.forward(&[(&tokens[..12], 0, &table, 0)]);
        let got = ex.forward(&[(&tokens[12..], 12, &table, 4)]);
        let vocab = w.cfg.vocab_size;
        for (i, p) in (13..17).enumerate() {
            assert_close(&got[i * vocab..(i + 1) * vocab], &reference_logits(&w, &tokens[..=p]));
        }
    }

    #[test]
    fn sequences_in_a_batch_do_not_interfere() {
        let w = small();
        let a: Vec<u32> = (0..9).collect();
        let b: Vec<u32> = (20..31).collect();
        let mut ex = LlamaExecutor::new(w.clone(), 8, 4);
        let got = ex.forward(&[(&a, 0, &[0, 1, 2], 1), (&b, 0, &[3, 4, 5], 1)]);
        let vocab = w.cfg.vocab_size;
        assert_close(&got[..vocab], &reference_logits(&w, &a));
        assert_close(&got[vocab..], &reference_logits(&w, &b));
    }
}
