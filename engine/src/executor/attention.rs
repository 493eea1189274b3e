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

    /// Bytes of one block: K then V of every layer, `block_size × kv_dim` halves each.
    pub fn block_bytes(&self) -> usize {
        self.k.len() * 2 * self.block_size * self.kv_dim * 2
    }

    /// Appends block `b`'s K and V, layer by layer, as little-endian halves.
    pub fn read_block(&self, b: BlockId, out: &mut Vec<u8>) {
        let n = self.block_size * self.kv_dim;
        let at = b as usize * n;
        out.reserve(self.block_bytes());
        for layer in 0..self.k.len() {
            for part in [&self.k[layer], &self.v[layer]] {
                out.extend(part[at..at + n].iter().flat_map(|h| h.to_le_bytes()));
            }
        }
    }

    /// Fills block `b` from [`KvCache::read_block`]'s bytes; false when they are not one block.
    pub fn write_block(&mut self, b: BlockId, data: &[u8]) -> bool {
        if data.len() != self.block_bytes() {
            return false;
        }
        let n = self.block_size * self.kv_dim;
        let at = b as usize * n;
        let mut pieces = data.chunks_exact(n * 2);
        for layer in 0..self.k.len() {
            for part in [&mut self.k[layer], &mut self.v[layer]] {
                let Some(piece) = pieces.next() else { return false };
                for (h, pair) in part[at..at + n].iter_mut().zip(piece.chunks_exact(2)) {
                    *h = u16::from_le_bytes([pair[0], pair[1]]);
                }
            }
        }
        true
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

/// Positions per piece of the context that one task of [`attention_direct`] covers: fixed, so
/// that where the context is cut does not depend on how many rows a step computes.
const CHUNK: usize = 1024;

/// What one task of [`attention_direct`] found for its query rows over its piece of the
/// context: per row, the largest score, the sum of e^(score − largest) and the weighted sum of
/// V rows with those weights (`rows × hs`), unnormalized. A row that sees none of the piece has
/// sum 0.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
}

/// [`attention`] for a few query rows, from dot products over the cache's pages (nothing
/// gathered). Tasks are (KV head, piece of [`CHUNK`] positions) pairs, so that a long context
/// keeps every thread reading the cache even with one query row; each task converts a block's
/// K and V rows to floats once for all the query heads and rows that read them, and the pieces
/// are merged in order of position (flash-decoding). A row's arithmetic depends only on the
/// positions it sees: a step verifying proposals computes each of its rows exactly as a
/// one-token step would.
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
    let chunk = CHUNK.next_multiple_of(bs);
    let pieces = ctx.div_ceil(chunk);
    // Rows of a task: (query head in the group, row) as hg × n + i.
    let rows = group * n;
    let partials: Vec<Partial> = (0..c.n_kv_heads * pieces)
        .into_par_iter()
        .map(|task| {
            let (kvh, piece) = (task / pieces, task % pieces);
            let off = kvh * hs;
            let (c0, c1) = (piece * chunk, ((piece + 1) * chunk).min(ctx));
            // Row i sees positions 0..=start + i: here, c0..seen(i).
            let seen = |i: usize| (start + i + 1).min(c1);
            let len = c1 - c0;
            let q_scaled: Vec<f32> = (kvh * group..(kvh + 1) * group)
                .flat_map(|h| (0..n).flat_map(move |i| q[i * dim + h * hs..i * dim + (h + 1) * hs].iter()))
                .map(|x| x * scale)
                .collect();
            let mut scores = vec![0.0f32; rows * len];
            // A block's rows of this head, as floats: converted once for every query row, each
            // of which gets `f(row, its scores' offset, the rows it sees)`.
            let mut rows_f = vec![0.0f32; bs * hs];
            let mut over_blocks = |half: &[u16], f: &mut dyn FnMut(usize, usize, &[f32])| {
                let first = c0 / bs;
                for (b, &block) in table[first..c1.div_ceil(bs)].iter().enumerate() {
                    let (p0, base) = ((first + b) * bs, block as usize * bs * kv_dim + off);
                    let m_all = (c1 - p0).min(bs);
                    (simd.rows_from_halves)(&half[base..], kv_dim, hs, &mut rows_f[..m_all * hs]);
                    for r in 0..rows {
                        let m = seen(r % n).saturating_sub(p0).min(bs);
                        if m > 0 {
                            f(r, r * len + p0 - c0, &rows_f[..m * hs]);
                        }
                    }
                }
            };
            over_blocks(k, &mut |r, at, kr| {
                (simd.dots)(&q_scaled[r * hs..(r + 1) * hs], kr, &mut scores[at..at + kr.len() / hs]);
            });
            let mut part = Partial {
                max: vec![f32::NEG_INFINITY; rows],
                sum: vec![0.0; rows],
                out: vec![0.0; rows * hs],
            };
            for r in 0..rows {
                let m = seen(r % n).saturating_sub(c0);
                if m > 0 {
                    let row = &mut scores[r * len..r * len + m];
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    part.max[r] = max;
                    part.sum[r] = (simd.exps)(row, max);
                }
            }
            over_blocks(v, &mut |r, at, vr| {
                (simd.axpys)(&mut part.out[r * hs..(r + 1) * hs], &scores[at..at + vr.len() / hs], vr);
            });
            part
        })
        .collect();
    // Merge each row's pieces in order of position.
    for kvh in 0..c.n_kv_heads {
        let parts = &partials[kvh * pieces..(kvh + 1) * pieces];
        for r in 0..rows {
            let (hg, i) = (r / n, r % n);
            let h = kvh * group + hg;
            let seen = || parts.iter().filter(|p| p.sum[r] > 0.0);
            let max = seen().map(|p| p.max[r]).fold(f32::NEG_INFINITY, f32::max);
            let dst = &mut out[i * dim + h * hs..i * dim + (h + 1) * hs];
            dst.fill(0.0);
            let mut sum = 0.0f32;
            for p in seen() {
                let f = (p.max[r] - max).exp();
                sum += f * p.sum[r];
                dst.iter_mut().zip(&p.out[r * hs..(r + 1) * hs]).for_each(|(d, o)| *d += f * o);
            }
            let inv = 1.0 / sum;
            dst.iter_mut().for_each(|d| *d *= inv);
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
    let simd = crate::simd::kernels();
    let from_halves = simd.from_halves;
    for (bi, &block) in table.iter().enumerate().take(ctx.div_ceil(bs)) {
        let p0 = bi * bs;
        let len = (ctx - p0).min(bs) * kv_dim;
        let s = block as usize * bs * kv_dim;
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
                (simd.softmax)(&mut row[..visible]);
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
