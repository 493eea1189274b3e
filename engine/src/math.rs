//! The few dense kernels the llama forward pass needs. Matrix products go through
//! `matrixmultiply`'s sgemm (packed, SIMD, any strides); the rest are plain loops the compiler
//! vectorizes.
#![allow(unsafe_code)]

/// A row-major or strided matrix view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// `c = a · b + beta · c` with `a` m×k, `b` k×n, and `c` m×n at `c[i * rsc + j]`.
#[allow(clippy::too_many_arguments)] // mirrors BLAS sgemm
pub fn gemm(m: usize, k: usize, n: usize, a: View<'_>, b: View<'_>, c: &mut [f32], rsc: usize, beta: f32) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(k > 0, "gemm with k = 0");
    assert!(last(m, k, a.rs, a.cs) < a.data.len(), "gemm: a out of bounds");
    assert!(last(k, n, b.rs, b.cs) < b.data.len(), "gemm: b out of bounds");
    assert!(last(m, n, rsc, 1) < c.len(), "gemm: c out of bounds");
    // SAFETY: the asserts above keep every element sgemm touches inside the three slices, and
    // `c` is a unique borrow that aliases neither input.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

/// Below this many rows, [`matmul_wt`] streams the weight once with dot products instead of
/// calling sgemm: sgemm packs the whole weight matrix on every call, which for a decode step
/// (a few rows against a 32k × 288 classifier) costs far more than the arithmetic.
const SMALL_BATCH_ROWS: usize = 32;

/// `out[t×n] = x[t×k] · wᵀ` for a weight `w` stored `[n × k]` row-major (llama2.c layout).
pub fn matmul_wt(out: &mut [f32], x: &[f32], w: &[f32], t: usize, k: usize, n: usize) {
    if t > SMALL_BATCH_ROWS {
        gemm(t, k, n, View { data: x, rs: k, cs: 1 }, View { data: w, rs: 1, cs: k }, out, n, 0.0);
        return;
    }
    assert!(x.len() >= t * k && w.len() >= n * k && out.len() >= t * n, "matmul_wt: bad sizes");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for (checked just above).
        unsafe { rows_avx2_fma(out, x, w, t, k, n) };
        return;
    }
    rows::<false>(out, x, w, t, k, n);
}

/// `out[t×n] += x[t×k] · wᵀ`: a matrix product added into a residual stream.
pub fn matmul_wt_add(out: &mut [f32], x: &[f32], w: &[f32], t: usize, k: usize, n: usize) {
    if t > SMALL_BATCH_ROWS {
        gemm(t, k, n, View { data: x, rs: k, cs: 1 }, View { data: w, rs: 1, cs: k }, out, n, 1.0);
        return;
    }
    // Few rows: the streaming kernel into scratch (t × n floats), then add.
    let mut product = vec![0.0f32; t * n];
    matmul_wt(&mut product, x, w, t, k, n);
    out[..t * n].iter_mut().zip(&product).for_each(|(o, p)| *o += p);
}

/// [`rows`] compiled for AVX2 + FMA, picked at run time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2_fma(out: &mut [f32], x: &[f32], w: &[f32], t: usize, k: usize, n: usize) {
    rows::<true>(out, x, w, t, k, n);
}

const LANES: usize = 16;

/// Streams each weight row once against up to four input rows at a time: independent 16-lane
/// accumulators per row keep the vector units busy, and the weight is read once per block.
/// `FMA` uses fused multiply-add (only where the CPU has it: elsewhere `mul_add` is a libm call).
#[inline(always)]
fn rows<const FMA: bool>(out: &mut [f32], x: &[f32], w: &[f32], t: usize, k: usize, n: usize) {
    let body = k / LANES * LANES;
    let mut i = 0;
    while i < t {
        let r = (t - i).min(4);
        if r == 1 {
            // A lone row (decode of one sequence): no duplicated work.
            let xr = &x[i * k..(i + 1) * k];
            for (j, wrow) in w.chunks_exact(k).take(n).enumerate() {
                let mut acc = [0.0f32; LANES];
                for c in (0..body).step_by(LANES) {
                    let (wc, xc) = (&wrow[c..c + LANES], &xr[c..c + LANES]);
                    for l in 0..LANES {
                        acc[l] = if FMA { xc[l].mul_add(wc[l], acc[l]) } else { acc[l] + xc[l] * wc[l] };
                    }
                }
                let tail: f32 = xr[body..].iter().zip(&wrow[body..]).map(|(a, b)| a * b).sum();
                out[i * n + j] = acc.iter().sum::<f32>() + tail;
            }
            i += 1;
            continue;
        }
        // Fewer than four rows left: repeat the last one (its result is written once).
        let xs: [&[f32]; 4] = std::array::from_fn(|q| &x[(i + q.min(r - 1)) * k..(i + q.min(r - 1) + 1) * k]);
        for (j, wrow) in w.chunks_exact(k).take(n).enumerate() {
            let mut acc = [[0.0f32; LANES]; 4];
            for c in (0..body).step_by(LANES) {
                let wc = &wrow[c..c + LANES];
                for q in 0..4 {
                    let xc = &xs[q][c..c + LANES];
                    for l in 0..LANES {
                        acc[q][l] =
                            if FMA { xc[l].mul_add(wc[l], acc[q][l]) } else { acc[q][l] + xc[l] * wc[l] };
                    }
                }
            }
            for q in 0..r {
                let tail: f32 = xs[q][body..].iter().zip(&wrow[body..]).map(|(a, b)| a * b).sum();
                out[(i + q) * n + j] = acc[q].iter().sum::<f32>() + tail;
            }
        }
        i += r;
    }
}

/// Root-mean-square norm of each `dim`-wide row of `x`, scaled by `weight`, into `out`.
pub fn rmsnorm(out: &mut [f32], x: &[f32], weight: &[f32], dim: usize, eps: f32) {
    for (o, r) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
        let ss = r.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(r).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// Rotary position embedding on one row of `n_heads` heads, llama2.c's pairing (ggml's
/// "normal" mode, which GGUF llama models are converted for): each pair of adjacent elements of
/// a head is rotated by `pos × theta^(-i/head_size)`. `pos` may be scaled (linear rope scaling).
pub fn rope(row: &mut [f32], pos: f32, head_size: usize, theta: f32) {
    for head in row.chunks_exact_mut(head_size) {
        for i in (0..head_size).step_by(2) {
            let freq = 1.0 / theta.powf(i as f32 / head_size as f32);
            let (s, c) = (pos * freq).sin_cos();
            let (a, b) = (head[i], head[i + 1]);
            head[i] = a * c - b * s;
            head[i + 1] = a * s + b * c;
        }
    }
}

/// Σ a·b in eight independent lanes, added up in a fixed order: it vectorizes (a plain running
/// sum cannot, its order being part of its result), and gives the same bits wherever it is
/// called.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    let mut acc = [0.0f32; 8];
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv = 1.0 / exps(x, max);
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `x = e^(x − max)` in place; returns their sum.
pub fn exps(x: &mut [f32], max: f32) -> f32 {
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

/// `a = silu(a) * b`, element-wise (SwiGLU).
pub fn swiglu(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = *x / (1.0 + (-*x).exp()) * y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_naive() {
        let (t, k, n) = (3, 5, 4);
        let x: Vec<f32> = (0..t * k).map(|i| i as f32 * 0.1 - 0.7).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut out = vec![0.0; t * n];
        matmul_wt(&mut out, &x, &w, t, k, n);
        for i in 0..t {
            for j in 0..n {
                let want: f32 = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
                assert!((out[i * n + j] - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn small_and_large_batches_agree() {
        let (k, n) = (37, 19);
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let x: Vec<f32> = (0..64 * k).map(|i| (i as f32 * 0.07).sin()).collect();
        let mut big = vec![0.0; 64 * n];
        matmul_wt(&mut big, &x, &w, 64, k, n); // sgemm path
        for rows in [1, 3, 4, 6] {
            let mut small = vec![0.0; rows * n];
            matmul_wt(&mut small, &x[..rows * k], &w, rows, k, n); // streaming path
            let mut plain = vec![0.0; rows * n];
            super::rows::<false>(&mut plain, &x[..rows * k], &w, rows, k, n); // portable path
            for ((a, b), c) in small.iter().zip(&big[..rows * n]).zip(&plain) {
                assert!((a - b).abs() < 1e-4 && (c - b).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -100.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let mut r: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let orig = r.clone();
        rope(&mut r, 0.0, 4, 10000.0);
        assert_eq!(r, orig);
        rope(&mut r, 17.0, 4, 10000.0);
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((n(&r) - n(&orig)).abs() < 1e-3);
    }
}
