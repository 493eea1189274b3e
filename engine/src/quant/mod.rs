//! Weights in their quantized form, and the matrix product over them, as the best CPU engines
//! compute it: the activations are quantized per block to 8 bits (Q8_0, Q8_1 or Q8_K, whichever
//! the weight type pairs with, exactly as ggml does), and each output is a sum over blocks of
//! integer dot products times the two blocks' scales. Nothing is dequantized to f32 at load.
//!
//! `formats` holds the block layouts (and the f32 reference each kernel is tested against),
//! `dot` the per-block dot products: portable ones for every type, AVX2 ones for the hot types
//! picked at run time (`x86`). Where the CPU has AVX2, Q4_1 and Q8_0 matrices are also kept
//! repacked eight rows at a time (`packed`), and multiplied by kernels that compute eight rows
//! in the lanes of one register.

mod dot;
pub mod formats;
mod packed;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::ops::Range;
use std::sync::Arc;

use warmpath_wire::gguf::{GgmlType, Gguf};

pub use formats::{dequantize_row, quantize_row};

/// Where a matrix's bytes are: its own, or a range of a mapped model file.
#[derive(Clone)]
pub enum Storage {
    Owned(Arc<[u8]>),
    Mapped(Arc<Gguf>, Range<usize>),
}

impl Storage {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Owned(b) => b,
            Storage::Mapped(f, r) => &f.data()[r.clone()],
        }
    }
}

/// A weight matrix `[rows × cols]`, each row whole blocks of `ty`.
#[derive(Clone)]
pub struct QuantMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: Storage,
    row_bytes: usize,
    /// The rows in groups of eight, with the kernel for them, where the CPU has one.
    packed: Option<(Arc<[u8]>, Kernel)>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantMatrix({:?}, {}×{})", self.ty, self.rows, self.cols)
    }
}

impl QuantMatrix {
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Storage) -> Result<QuantMatrix, String> {
        if !formats::supported(ty) {
            return Err(format!("weight type {ty:?} is not supported"));
        }
        if cols % ty.block_elements() != 0 {
            return Err(format!("rows of {cols} are not whole {ty:?} blocks"));
        }
        let row_bytes = cols / ty.block_elements() * ty.block_bytes();
        if data.bytes().len() != rows * row_bytes {
            return Err(format!(
                "{rows}×{cols} {ty:?} needs {} bytes, not {}",
                rows * row_bytes,
                data.bytes().len()
            ));
        }
        #[cfg(target_arch = "x86_64")]
        let packed = x86::packed_kernel(ty)
            .and_then(|k| Some((Arc::from(packed::pack(ty, rows, row_bytes, data.bytes())?), k)));
        #[cfg(not(target_arch = "x86_64"))]
        let packed = None;
        Ok(QuantMatrix { ty, rows, cols, data, row_bytes, packed })
    }

    /// `w` (`[rows × cols]` f32, row-major) quantized to `ty`.
    pub fn quantize(ty: GgmlType, rows: usize, cols: usize, w: &[f32]) -> QuantMatrix {
        let bytes: Vec<u8> = w.chunks_exact(cols).flat_map(|r| quantize_row(ty, r)).collect();
        QuantMatrix::new(ty, rows, cols, Storage::Owned(bytes.into())).expect("quantized whole rows")
    }

    pub fn row(&self, r: usize) -> &[u8] {
        &self.data.bytes()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.row(r), &mut out[..self.cols]);
    }

    /// Bytes of the weights.
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// A weight row's dot products with activation rows `i..i + out.len()` (one to four).
pub(crate) type Kernel = fn(&[u8], &Acts, usize, &mut [f32]);

/// Activations `[t × cols]` in the form the weight type's dot product takes.
pub struct Acts {
    kind: dot::ActKind,
    cols: usize,
    /// Quants (8-bit kinds), `t × cols`.
    qs: Vec<i8>,
    /// Per block: its scale.
    d: Vec<f32>,
    /// Per block: Q8_1, scale × Σ quants; Q8_K, per 16: Σ quants.
    sums: Vec<f32>,
    /// f32 kind: the values.
    f: Vec<f32>,
}

impl Acts {
    /// `x` (`t` rows of `cols`) quantized for weights of type `ty`.
    pub fn new(ty: GgmlType, x: &[f32], t: usize, cols: usize) -> Acts {
        dot::quantize_acts(dot::ActKind::of(ty), &x[..t * cols], cols)
    }
}

/// `out[t × w.rows] = x[t × w.cols] · wᵀ`.
pub fn matmul(out: &mut [f32], x: &[f32], t: usize, w: &QuantMatrix) {
    let acts = Acts::new(w.ty, x, t, w.cols);
    matmul_acts(out, &acts, t, w);
}

/// Weight rows per parallel task when a few activation rows (decode) are split by weight rows.
const ROWS_PER_TASK: usize = 16;
/// Activation rows per parallel task when many (prefill) are split by activation rows.
const TOKENS_PER_TASK: usize = 4;

/// [`matmul`] with the activations already quantized (several matrices reading one input). The
/// work is split among rayon's threads: by activation rows where there are many (each task
/// streams the whole weight through its cache, four rows at a time), by weight rows where there
/// are few (a decode step). Each weight block is unpacked once for up to four activation rows.
pub fn matmul_acts(out: &mut [f32], acts: &Acts, t: usize, w: &QuantMatrix) {
    use rayon::prelude::*;
    assert!(out.len() >= t * w.rows, "matmul: output too small");
    assert_eq!(acts.cols, w.cols, "matmul: activations of another width");
    assert_eq!(acts.kind, dot::ActKind::of(w.ty), "matmul: activations quantized for another type");
    let (kernel, rows) = (dot::kernel(w.ty), w.rows);
    if t == 0 {
        return;
    }
    if let Some((groups, kernel)) = &w.packed {
        return matmul_groups(out, acts, t, w, groups, *kernel);
    }
    if t >= 2 * TOKENS_PER_TASK {
        out[..t * rows].par_chunks_mut(TOKENS_PER_TASK * rows).enumerate().for_each(|(c, dst)| {
            let (i0, n) = (c * TOKENS_PER_TASK, dst.len() / rows);
            let mut products = [0.0f32; TOKENS_PER_TASK];
            for r in 0..rows {
                kernel(w.row(r), acts, i0, &mut products[..n]);
                for (j, p) in products[..n].iter().enumerate() {
                    dst[j * rows + r] = *p;
                }
            }
        });
        return;
    }
    // Rows `r0..` into `dst`, `t` outputs per weight row.
    let task = |r0: usize, dst: &mut [f32]| {
        for (k, d) in dst.chunks_exact_mut(t).enumerate() {
            for (c, part) in d.chunks_mut(TOKENS_PER_TASK).enumerate() {
                kernel(w.row(r0 + k), acts, c * TOKENS_PER_TASK, part);
            }
        }
    };
    if t == 1 {
        out[..rows].par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, d)| task(c * ROWS_PER_TASK, d));
        return;
    }
    let mut by_row = vec![0.0f32; rows * t];
    by_row.par_chunks_mut(ROWS_PER_TASK * t).enumerate().for_each(|(c, d)| task(c * ROWS_PER_TASK, d));
    for (r, products) in by_row.chunks_exact(t).enumerate() {
        for (i, p) in products.iter().enumerate() {
            out[i * rows + r] = *p;
        }
    }
}

/// Groups of eight weight rows per parallel task when few activation rows are split by rows.
const GROUPS_PER_TASK: usize = 4;

/// [`matmul_acts`] over eight-row groups. Many activation rows (prefill) are split into one
/// contiguous share per task, each of which walks every weight group once and multiplies it,
/// while it sits in the L1 cache, with all its activation rows four at a time; few (a decode
/// step) are split by weight groups.
fn matmul_groups(out: &mut [f32], acts: &Acts, t: usize, w: &QuantMatrix, groups: &[u8], kernel: Kernel) {
    use rayon::prelude::*;
    let rows = w.rows;
    let group_bytes = groups.len() / (rows / packed::ROWS);
    let group = |g: usize| &groups[g * group_bytes..(g + 1) * group_bytes];
    if t >= 2 * TOKENS_PER_TASK {
        // Shares of whole fours, about two per thread.
        let per = t.div_ceil(2 * rayon::current_num_threads()).next_multiple_of(TOKENS_PER_TASK);
        out[..t * rows].par_chunks_mut(per * rows).enumerate().for_each(|(c, dst)| {
            let (i0, n) = (c * per, dst.len() / rows);
            let mut products = [0.0f32; 8 * TOKENS_PER_TASK];
            for g in 0..rows / packed::ROWS {
                for j0 in (0..n).step_by(TOKENS_PER_TASK) {
                    let m = (n - j0).min(TOKENS_PER_TASK);
                    kernel(group(g), acts, i0 + j0, &mut products[..8 * m]);
                    for (j, p) in products[..8 * m].chunks_exact(8).enumerate() {
                        dst[(j0 + j) * rows + 8 * g..][..8].copy_from_slice(p);
                    }
                }
            }
        });
        return;
    }
    // Per group, `t` rows of eight products.
    let task = |g0: usize, dst: &mut [f32]| {
        for (k, d) in dst.chunks_exact_mut(8 * t).enumerate() {
            for (c, part) in d.chunks_mut(8 * TOKENS_PER_TASK).enumerate() {
                kernel(group(g0 + k), acts, c * TOKENS_PER_TASK, part);
            }
        }
    };
    let per_task = 8 * GROUPS_PER_TASK * t;
    if t == 1 {
        out[..rows].par_chunks_mut(per_task).enumerate().for_each(|(c, d)| task(c * GROUPS_PER_TASK, d));
        return;
    }
    let mut by_group = vec![0.0f32; rows * t];
    by_group.par_chunks_mut(per_task).enumerate().for_each(|(c, d)| task(c * GROUPS_PER_TASK, d));
    for (g, products) in by_group.chunks_exact(8 * t).enumerate() {
        for (j, p) in products.chunks_exact(8).enumerate() {
            out[j * rows + 8 * g..][..8].copy_from_slice(p);
        }
    }
}

#[cfg(test)]
mod tests;
