//! The paged KV cache and causal attention over it: each sequence's K/V are read through its
//! block table. A step with a few query rows per sequence (decoding, or verifying proposals)
//! reads each cached K and V row once for all of them, with dot products from [`crate::simd`];
//! more rows (prefill) gather the sequence's K/V and multiply by sgemm.

use rayon::prelude::*;

use crate::block_pool::BlockId;
use crate::math::{gemm, View};
use crate::model::Weights;

/// K and V of every layer, `[num_blocks × block_size × kv_dim]` each, in half precision.
pub struct KvCache {
    k: Vec<Vec<u16>>,
    v: Vec<Vec<u16>>,
    block_size: usize,
    kv_dim: usize,
}

impl KvCache {
    pub fn new(n_layers: usize, num_blocks: usize, block_size: usize, kv_dim: usize) -> KvCache {
        let size = num_blocks * block_size * kv_dim;
        // vec! of zeros is calloc'd: pages are only touched when a block is first written.
        KvCache {
            k: (0..n_layers).map(|_| vec![0; size]).collect(),
            v: (0..n_layers).map(|_| vec![0; size]).collect(),
            block_size,
            kv_dim,
        }
    }

    /// Offset of position `pos` through `table`.
    fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        (table[pos / self.block_size] as usize * self.block_size + pos % self.block_size) * self.kv_dim
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Stores position `pos`'s K and V rows of `layer`.
    pub(super) fn write(&mut self, layer: usize, table: &[BlockId], pos: usize, k: &[f32], v: &[f32]) {
        let s = self.slot(table, pos);
        let to_halves = crate::simd::kernels().to_halves;
        to_halves(k, &mut self.k[layer][s..s + self.kv_dim]);
        to_halves(v, &mut self.v[layer][s..s + self.kv_dim]);
    }
}

/// Query rows up to which attention reads K/V where they lie in the paged cache, with dot
/// products (a decode step, or one verifying proposals: each row's arithmetic is then exactly a
/// one-token decode step's, so greedy speculative decoding changes no token); above it, the
/// sequence's K/V are gathered and multiplied by sgemm.
const DIRECT_ROWS: usize = crate::spec::MAX_SPECULATIVE_TOKENS + 1;

/// [`attention`] for a few query rows: each head's scores and output from dot products over
/// the cache's pages, nothing copied.
#[allow(clippy::too_many_arguments)]
fn attention_direct(
    w: &Weights,
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    out: &mut [f32],
    n: usize,
    start: usize,
    table: &[BlockId],
) {
    let c = &w.cfg;
    let (dim, hs) = (c.dim, c.head_size());
    let group = c.n_heads / c.n_kv_heads;
    let scale = 1.0 / (hs as f32).sqrt();
    let (k, v) = (&cache.k[layer], &cache.v[layer]);
    let ctx = start + n;
    let bs = cache.block_size;
    let kv_dim = cache.kv_dim;
    let simd = crate::simd::kernels();
    // One task per KV head: its query heads read each block of its K and V while it is in L1.
    let groups: Vec<Vec<Vec<f32>>> = (0..c.n_kv_heads)
        .into_par_iter()
        .map(|kvh| {
            let off = kvh * hs;
            let heads = kvh * group..(kvh + 1) * group;
            // Row i sees positions 0..=start + i; K and V are read a block at a time.
            let visible = |i: usize, p0: usize| (start + i + 1).saturating_sub(p0).min(bs);
            // Per (head, row): its scores over the context, its scaled query.
            let rows = group * n;
            let mut scores = vec![0.0f32; rows * ctx];
            let q_scaled: Vec<f32> = heads
                .clone()
                .flat_map(|h| (0..n).flat_map(move |i| q[i * dim + h * hs..i * dim + (h + 1) * hs].iter()))
                .map(|x| x * scale)
                .collect();
            // A block's rows of this head, as floats: converted once for every query row.
            let mut rows_f = vec![0.0f32; bs * hs];
            let convert = |half: &[u16], base: usize, m: usize, rows_f: &mut [f32]| {
                (simd.rows_from_halves)(&half[base..], kv_dim, hs, &mut rows_f[..m * hs]);
            };
            for (b, &block) in table.iter().enumerate().take(ctx.div_ceil(bs)) {
                let (p0, base) = (b * bs, block as usize * bs * kv_dim + off);
                convert(k, base, (ctx - p0).min(bs), &mut rows_f);
                for r in 0..rows {
                    let m = visible(r % n, p0);
                    if m > 0 {
                        let qr = &q_scaled[r * hs..(r + 1) * hs];
                        (simd.dots)(qr, &rows_f[..m * hs], &mut scores[r * ctx + p0..r * ctx + p0 + m]);
                    }
                }
            }
            for r in 0..rows {
                (simd.softmax)(&mut scores[r * ctx..r * ctx + start + r % n + 1]);
            }
            let mut out = vec![vec![0.0f32; n * hs]; group];
            for (b, &block) in table.iter().enumerate().take(ctx.div_ceil(bs)) {
                let (p0, base) = (b * bs, block as usize * bs * kv_dim + off);
                convert(v, base, (ctx - p0).min(bs), &mut rows_f);
                for r in 0..rows {
                    let (hg, i) = (r / n, r % n);
                    let m = visible(i, p0);
                    if m > 0 {
                        let w = &scores[r * ctx + p0..r * ctx + p0 + m];
                        (simd.axpys)(&mut out[hg][i * hs..(i + 1) * hs], w, &rows_f[..m * hs]);
                    }
                }
            }
            out
        })
        .collect();
    let heads: Vec<&Vec<f32>> = groups.iter().flatten().collect();
    for (h, head) in heads.iter().enumerate() {
        for (i, r) in head.chunks_exact(hs).enumerate() {
            out[i * dim + h * hs..i * dim + (h + 1) * hs].copy_from_slice(r);
        }
    }
}

/// Causal attention of `n` new query rows (at positions `start..start+n`) over positions
/// `0..start+n` of one sequence, read through its block table.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    w: &Weights,
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    out: &mut [f32],
    n: usize,
    start: usize,
    table: &[BlockId],
) {
    let c = &w.cfg;
    let (dim, kv_dim, hs) = (c.dim, c.kv_dim(), c.head_size());
    let ctx = start + n;
    if n <= DIRECT_ROWS {
        return attention_direct(w, cache, layer, q, out, n, start, table);
    }
    // Gather the sequence's K/V into contiguous rows, a block (16 positions) at a time.
    let mut kc = vec![0.0f32; ctx * kv_dim];
    let mut vc = vec![0.0f32; ctx * kv_dim];
    let bs = cache.block_size;
    for (bi, &block) in table.iter().enumerate().take(ctx.div_ceil(bs)) {
        let p0 = bi * bs;
        let len = (ctx - p0).min(bs) * kv_dim;
        let s = block as usize * bs * kv_dim;
        let from_halves = crate::simd::kernels().from_halves;
        from_halves(&cache.k[layer][s..s + len], &mut kc[p0 * kv_dim..p0 * kv_dim + len]);
        from_halves(&cache.v[layer][s..s + len], &mut vc[p0 * kv_dim..p0 * kv_dim + len]);
    }
    let group = c.n_heads / c.n_kv_heads;
    let scale = 1.0 / (hs as f32).sqrt();
    // Heads in parallel, each into its own `[n × hs]` output, then into the rows of `out`.
    let heads: Vec<Vec<f32>> = (0..c.n_heads)
        .into_par_iter()
        .map(|h| {
            let kvh = h / group;
            let mut scores = vec![0.0f32; n * ctx];
            // scores = Q_h · K_hᵀ
            gemm(
                n,
                hs,
                ctx,
                View { data: &q[h * hs..], rs: dim, cs: 1 },
                View { data: &kc[kvh * hs..], rs: 1, cs: kv_dim },
                &mut scores,
                ctx,
                0.0,
            );
            for i in 0..n {
                let visible = start + i + 1;
                let row = &mut scores[i * ctx..(i + 1) * ctx];
                row[..visible].iter_mut().for_each(|s| *s *= scale);
                (crate::simd::kernels().softmax)(&mut row[..visible]);
                row[visible..].iter_mut().for_each(|s| *s = 0.0);
            }
            // out_h = P · V_h
            let mut head = vec![0.0f32; n * hs];
            gemm(
                n,
                ctx,
                hs,
                View { data: &scores, rs: ctx, cs: 1 },
                View { data: &vc[kvh * hs..], rs: kv_dim, cs: 1 },
                &mut head,
                hs,
                0.0,
            );
            head
        })
        .collect();
    for (h, head) in heads.iter().enumerate() {
        for (i, r) in head.chunks_exact(hs).enumerate() {
            out[i * dim + h * hs..i * dim + (h + 1) * hs].copy_from_slice(r);
        }
    }
}
