//! Kernels for attention over the KV cache, picked once at run time: AVX2 + FMA + F16C where
//! the CPU has them, portable code otherwise. The cache keeps its rows in half precision (as
//! llama.cpp keeps them: half the bytes to read per step); attention converts a KV block's rows
//! to floats once and runs every query row that sees it over them, so a kernel covers a run of
//! rows and the choice costs one indirect call per block, not per row. Whichever is picked, a
//! row's result does not depend on how many rows are computed with it, nor where a run starts.
#![allow(unsafe_code)]

use std::sync::OnceLock;

use crate::quant::formats::{f16_to_f32, f32_to_f16};

/// `out[p] = q · rows[p × q.len()..][..q.len()]` for each `p < out.len()` (contiguous rows).
pub type Dots = fn(q: &[f32], rows: &[f32], out: &mut [f32]);
/// `acc += Σ_p w[p] × rows[p × acc.len()..][..acc.len()]`, in order of `p` (contiguous rows).
pub type Axpys = fn(acc: &mut [f32], w: &[f32], rows: &[f32]);
/// `x = softmax(x)` in place.
pub type Softmax = fn(x: &mut [f32]);
/// `x = e^(x − max)` in place; returns their sum (added in a fixed order).
pub type Exps = fn(x: &mut [f32], max: f32) -> f32;
/// Floats to halves (round to nearest even), `out.len() == x.len()`.
pub type ToHalves = fn(x: &[f32], out: &mut [u16]);
/// Halves to floats, `out.len() == x.len()`.
pub type FromHalves = fn(x: &[u16], out: &mut [f32]);
/// Rows of halves `stride` apart to contiguous rows of floats: `out` holds `out.len() / width`
/// rows of `width`, row p from `x[p × stride..][..width]`.
pub type RowsFromHalves = fn(x: &[u16], stride: usize, width: usize, out: &mut [f32]);

pub struct Kernels {
    pub dots: Dots,
    pub axpys: Axpys,
    pub softmax: Softmax,
    pub exps: Exps,
    pub to_halves: ToHalves,
    pub from_halves: FromHalves,
    pub rows_from_halves: RowsFromHalves,
    /// `avx2` or `portable`.
    pub name: &'static str,
}

/// The kernels for this CPU.
pub fn kernels() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Kernels {
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
                dots: |q, rows, out| {
                    check(q.len(), rows, out.len());
                    unsafe { x86::dots(q, rows, out) }
                },
                // SAFETY: as above.
                axpys: |acc, w, rows| {
                    check(acc.len(), rows, w.len());
                    unsafe { x86::axpys(acc, w, rows) }
                },
                // SAFETY: as above.
                softmax: |x| unsafe { x86::softmax(x) },
                // SAFETY: as above.
                exps: |x, max| unsafe { x86::exps(x, max) },
                // SAFETY: as above.
                to_halves: |x, out| unsafe { x86::to_halves(x, out) },
                // SAFETY: as above.
                from_halves: |x, out| unsafe { x86::from_halves(x, out) },
                // SAFETY: as above; the rows are checked here.
                rows_from_halves: |x, stride, width, out| {
                    check_halves(x, stride, width, out.len());
                    unsafe { x86::rows_from_halves(x, stride, width, out) }
                },
                name: "avx2",
            };
        }
        portable()
    })
}

/// The portable kernels.
pub fn portable() -> Kernels {
    Kernels {
        dots: |q, rows, out| {
            check(q.len(), rows, out.len());
            for (p, o) in out.iter_mut().enumerate() {
                *o = crate::math::dot(q, &rows[p * q.len()..(p + 1) * q.len()]);
            }
        },
        axpys: |acc, w, rows| {
            check(acc.len(), rows, w.len());
            let width = acc.len();
            for (p, &wp) in w.iter().enumerate() {
                acc.iter_mut().zip(&rows[p * width..(p + 1) * width]).for_each(|(a, r)| *a += wp * r);
            }
        },
        softmax: crate::math::softmax,
        exps: crate::math::exps,
        to_halves: |x, out| {
            out.iter_mut().zip(x).for_each(|(o, v)| *o = f32_to_f16(*v));
        },
        from_halves: halves,
        rows_from_halves: |x, stride, width, out| {
            check_halves(x, stride, width, out.len());
            for (p, row) in out.chunks_exact_mut(width).enumerate() {
                halves(&x[p * stride..p * stride + width], row);
            }
        },
        name: "portable",
    }
}

fn halves(x: &[u16], out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, h)| *o = f16_to_f32(*h));
}

/// `out_len / width` rows of `width` halves, `stride` apart, fit in `x`.
fn check_halves(x: &[u16], stride: usize, width: usize, out_len: usize) {
    assert!(width > 0 && out_len % width == 0, "whole rows");
    let n = out_len / width;
    assert!(n == 0 || (n - 1) * stride + width <= x.len(), "rows out of bounds");
}

/// `n` contiguous rows of `width` fit in `rows`.
fn check(width: usize, rows: &[f32], n: usize) {
    assert!(n * width <= rows.len(), "rows out of bounds");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Eight halves at `p` as floats.
    ///
    /// # Safety
    /// `p..p + 8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: the caller's promise; the read is unaligned.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    /// # Safety
    /// The CPU must have F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn to_halves(x: &[f32], out: &mut [u16]) {
        assert_eq!(x.len(), out.len(), "halves for every float");
        let full = x.len() / 8 * 8;
        for c in (0..full).step_by(8) {
            // SAFETY: c + 8 <= full, in both slices.
            unsafe {
                let h = _mm256_cvtps_ph(_mm256_loadu_ps(x.as_ptr().add(c)), _MM_FROUND_TO_NEAREST_INT);
                _mm_storeu_si128(out.as_mut_ptr().add(c).cast(), h);
            }
        }
        for c in full..x.len() {
            out[c] = super::f32_to_f16(x[c]);
        }
    }

    /// # Safety
    /// The CPU must have F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn from_halves(x: &[u16], out: &mut [f32]) {
        assert_eq!(x.len(), out.len(), "a float for every half");
        let full = x.len() / 8 * 8;
        for c in (0..full).step_by(8) {
            // SAFETY: c + 8 <= full, in both slices.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c), load8(x.as_ptr().add(c))) };
        }
        for c in full..x.len() {
            out[c] = super::f16_to_f32(x[c]);
        }
    }

    /// # Safety
    /// The rows must be in bounds (`super::check_halves`); the CPU must have F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn rows_from_halves(x: &[u16], stride: usize, width: usize, out: &mut [f32]) {
        let full = width / 8 * 8;
        for (p, row) in out.chunks_exact_mut(width).enumerate() {
            let src = &x[p * stride..p * stride + width];
            for c in (0..full).step_by(8) {
                // SAFETY: c + 8 <= full <= width, in both rows.
                unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(c), load8(src.as_ptr().add(c))) };
            }
            for c in full..width {
                row[c] = super::f16_to_f32(src[c]);
            }
        }
    }

    /// The sums of eight vectors' lanes, as one vector: lane j holds the sum of `a[j]`, added
    /// in a fixed order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sums8(a: &[__m256; 8]) -> __m256 {
        let (t0, t1) = (_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let (t2, t3) = (_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        let (u0, u1) = (_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
        _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))
    }

    /// # Safety
    /// The rows must be in bounds (`super::check`).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(q: &[f32], rows: &[f32], out: &mut [f32]) {
        let w = q.len();
        if w % 8 != 0 {
            for (p, o) in out.iter_mut().enumerate() {
                *o = crate::math::dot(q, &rows[p * w..(p + 1) * w]);
            }
            return;
        }
        let (qp, rp, n) = (q.as_ptr(), rows.as_ptr(), out.len());
        // Eight rows at a time, one accumulator each, their lanes summed together; a last run
        // of fewer rows the same way (missing rows as zeros), so that a row's bits do not
        // depend on where a run of rows ends.
        for p in (0..n).step_by(8) {
            let m = (n - p).min(8);
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..w).step_by(8) {
                // SAFETY: rows p..p + m are in bounds by the caller's promise; c + 8 <= w.
                unsafe {
                    let qv = _mm256_loadu_ps(qp.add(c));
                    for (j, a) in acc.iter_mut().enumerate().take(m) {
                        *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rp.add((p + j) * w + c)), *a);
                    }
                }
            }
            let mut s = [0.0f32; 8];
            // SAFETY: eight floats into eight slots.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr(), sums8(&acc)) };
            out[p..p + m].copy_from_slice(&s[..m]);
        }
    }

    /// # Safety
    /// The rows must be in bounds (`super::check`).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpys(acc: &mut [f32], w: &[f32], rows: &[f32]) {
        let (width, rp) = (acc.len(), rows.as_ptr());
        // 32 outputs at a time held in registers over all the rows.
        let mut c = 0;
        while c + 32 <= width {
            // SAFETY: outputs c..c + 32 are in `acc`; row p's are in bounds by the caller's promise.
            unsafe {
                let ap = acc.as_mut_ptr().add(c);
                let mut r: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(ap.add(8 * j)));
                for (p, &wp) in w.iter().enumerate() {
                    let (wv, row) = (_mm256_set1_ps(wp), rp.add(p * width + c));
                    for (j, r) in r.iter_mut().enumerate() {
                        *r = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * j)), *r);
                    }
                }
                for (j, r) in r.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(8 * j), *r);
                }
            }
            c += 32;
        }
        for (p, &wp) in w.iter().enumerate() {
            let row = &rows[p * width..(p + 1) * width];
            for k in c..width {
                acc[k] = wp.mul_add(row[k], acc[k]);
            }
        }
    }

    /// e^x for eight lanes (Cephes' polynomial, as ggml's vectorized expf: about 1 ulp); lanes
    /// below −87.3 give 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3), _CMP_LT_OQ);
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.3));
        // x = n ln 2 + r, |r| ≤ ln 2 / 2.
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT,
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        // × 2^n through the exponent bits.
        let scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)))
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(x: &mut [f32]) {
        if x.is_empty() {
            return;
        }
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // SAFETY: the caller's promise.
        let inv = 1.0 / unsafe { exps(x, max) };
        x.iter_mut().for_each(|v| *v *= inv);
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exps(x: &mut [f32], max: f32) -> f32 {
        let (mv, mut sum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
        // Eight at a time; the last few through a padded copy (their missing lanes are 0).
        let full = x.len() / 8 * 8;
        for c in (0..full).step_by(8) {
            // SAFETY: c + 8 <= full.
            unsafe {
                let at = x.as_mut_ptr().add(c);
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(at), mv));
                sum = _mm256_add_ps(sum, e);
                _mm256_storeu_ps(at, e);
            }
        }
        if full < x.len() {
            let chunk = &mut x[full..];
            let mut buf = [f32::NEG_INFINITY; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            // SAFETY: eight floats from and into eight slots.
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv));
                sum = _mm256_add_ps(sum, e);
                _mm256_storeu_ps(buf.as_mut_ptr(), e);
            }
            let n = chunk.len();
            chunk.copy_from_slice(&buf[..n]);
        }
        hsum(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_agree_with_plain_arithmetic() {
        for width in [64, 40, 7] {
            // Values exact in half precision.
            let rows: Vec<f32> = (0..width * 19).map(|i| ((i * 37) % 101) as f32 / 64.0 - 1.0).collect();
            let mut half = vec![0u16; rows.len()];
            (kernels().to_halves)(&rows, &mut half);
            let mut back = vec![0.0f32; rows.len()];
            (portable().from_halves)(&half, &mut back);
            assert_eq!(back, rows, "exact values survive the round trip");
            let q: Vec<f32> = (0..width).map(|i| ((i * 13) % 17) as f32 / 8.0 - 1.0).collect();
            let w: Vec<f32> = (0..19).map(|p| p as f32 / 19.0).collect();
            for k in [kernels(), &portable()] {
                let mut out = vec![0.0f32; 19];
                (k.dots)(&q, &rows, &mut out);
                let mut acc = vec![1.0f32; width];
                (k.axpys)(&mut acc, &w, &rows);
                for p in 0..19 {
                    let want: f32 = q.iter().zip(&rows[p * width..]).map(|(a, b)| a * b).sum();
                    assert!((out[p] - want).abs() < 1e-4, "{} dot {p}: {} vs {want}", k.name, out[p]);
                    // A row's dot product is the same wherever a run of rows starts or ends.
                    let mut one = [0.0f32];
                    (k.dots)(&q, &rows[p * width..(p + 1) * width], &mut one);
                    assert_eq!(one[0].to_bits(), out[p].to_bits(), "{} dot {p} alone", k.name);
                }
                for c in 0..width {
                    let want: f32 = 1.0 + (0..19).map(|p| w[p] * rows[p * width + c]).sum::<f32>();
                    assert!((acc[c] - want).abs() < 1e-4, "{} axpy {c}", k.name);
                }
            }
        }
    }

    #[test]
    fn softmax_matches_the_plain_one() {
        for len in [1, 7, 8, 9, 100, 1581] {
            let x: Vec<f32> = (0..len).map(|i| ((i * 7919) % 211) as f32 / 7.0 - 15.0).collect();
            let mut want = x.clone();
            crate::math::softmax(&mut want);
            let mut got = x.clone();
            (kernels().softmax)(&mut got);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= 2e-6 * b.max(1e-3), "{len}: {a} vs {b}");
            }
            assert!((got.iter().sum::<f32>() - 1.0).abs() < 1e-4);
        }
        // Far below the maximum: exactly zero, never NaN.
        let mut x = vec![0.0, -200.0, f32::NEG_INFINITY];
        (kernels().softmax)(&mut x);
        assert_eq!(x, [1.0, 0.0, 0.0]);
    }

    #[test]
    fn halves_round_to_nearest_even_on_every_path() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.123_456_7 + 1e-4).collect();
        let (mut a, mut b) = (vec![0u16; 37], vec![0u16; 37]);
        (kernels().to_halves)(&x, &mut a);
        (portable().to_halves)(&x, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn rows_out_of_bounds_are_refused() {
        let mut out = [0.0f32; 3];
        (kernels().dots)(&[1.0; 8], &[0.0; 20], &mut out);
    }
}
