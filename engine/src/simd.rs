//! Kernels for attention over the KV cache, whose rows are kept in half precision (as
//! llama.cpp keeps them: half the bytes to read per step), picked once at run time: AVX2 + FMA +
//! F16C where the CPU has them, portable code otherwise. A kernel covers a run of cached rows
//! (a KV block), so that the choice costs one indirect call per block, not per row. Whichever is
//! picked, a row's result does not depend on how many rows are computed with it.
#![allow(unsafe_code)]

use std::sync::OnceLock;

use crate::quant::formats::{f16_to_f32, f32_to_f16};

/// `out[p] = q · rows[p × stride..][..q.len()]` for each `p < out.len()` (rows of halves).
pub type Dots = fn(q: &[f32], rows: &[u16], stride: usize, out: &mut [f32]);
/// `acc += Σ_p w[p] × rows[p × stride..][..acc.len()]`, in order of `p` (rows of halves).
pub type Axpys = fn(acc: &mut [f32], w: &[f32], rows: &[u16], stride: usize);
/// Floats to halves (round to nearest even), `out.len() == x.len()`.
pub type ToHalves = fn(x: &[f32], out: &mut [u16]);
/// Halves to floats, `out.len() == x.len()`.
pub type FromHalves = fn(x: &[u16], out: &mut [f32]);

pub struct Kernels {
    pub dots: Dots,
    pub axpys: Axpys,
    pub to_halves: ToHalves,
    pub from_halves: FromHalves,
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
                dots: |q, rows, stride, out| {
                    check(q.len(), rows, stride, out.len());
                    unsafe { x86::dots(q, rows, stride, out) }
                },
                // SAFETY: as above.
                axpys: |acc, w, rows, stride| {
                    check(acc.len(), rows, stride, w.len());
                    unsafe { x86::axpys(acc, w, rows, stride) }
                },
                // SAFETY: as above.
                to_halves: |x, out| unsafe { x86::to_halves(x, out) },
                // SAFETY: as above.
                from_halves: |x, out| unsafe { x86::from_halves(x, out) },
                name: "avx2",
            };
        }
        portable()
    })
}

/// The portable kernels.
pub fn portable() -> Kernels {
    Kernels {
        dots: |q, rows, stride, out| {
            check(q.len(), rows, stride, out.len());
            let mut row = vec![0.0f32; q.len()];
            for (p, o) in out.iter_mut().enumerate() {
                halves(&rows[p * stride..p * stride + q.len()], &mut row);
                *o = crate::math::dot(q, &row);
            }
        },
        axpys: |acc, w, rows, stride| {
            check(acc.len(), rows, stride, w.len());
            let mut row = vec![0.0f32; acc.len()];
            for (p, &wp) in w.iter().enumerate() {
                halves(&rows[p * stride..p * stride + acc.len()], &mut row);
                acc.iter_mut().zip(&row).for_each(|(a, r)| *a += wp * r);
            }
        },
        to_halves: |x, out| {
            out.iter_mut().zip(x).for_each(|(o, v)| *o = f32_to_f16(*v));
        },
        from_halves: halves,
        name: "portable",
    }
}

fn halves(x: &[u16], out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, h)| *o = f16_to_f32(*h));
}

/// `n` rows of `width`, `stride` apart, fit in `rows`.
fn check(width: usize, rows: &[u16], stride: usize, n: usize) {
    assert!(n == 0 || (n - 1) * stride + width <= rows.len(), "rows out of bounds");
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
    /// The rows must be in bounds (`super::check`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots(q: &[f32], rows: &[u16], stride: usize, out: &mut [f32]) {
        let (w, full) = (q.len(), q.len() / 8 * 8);
        let (qp, rp) = (q.as_ptr(), rows.as_ptr());
        for (p, o) in out.iter_mut().enumerate() {
            // SAFETY: row p is `w` floats from p × stride, in bounds by the caller's promise.
            unsafe {
                let row = rp.add(p * stride);
                let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut c = 0;
                while c + 16 <= full {
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), load8(row.add(c)), a);
                    b = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c + 8)), load8(row.add(c + 8)), b);
                    c += 16;
                }
                if c < full {
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), load8(row.add(c)), a);
                }
                let mut s = hsum(_mm256_add_ps(a, b));
                for c in full..w {
                    s += *qp.add(c) * super::f16_to_f32(*row.add(c));
                }
                *o = s;
            }
        }
    }

    /// # Safety
    /// The rows must be in bounds (`super::check`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpys(acc: &mut [f32], w: &[f32], rows: &[u16], stride: usize) {
        let (width, rp) = (acc.len(), rows.as_ptr());
        // 32 outputs at a time held in registers over all the rows.
        let mut c = 0;
        while c + 32 <= width {
            // SAFETY: outputs c..c + 32 are in `acc`; row p's are in bounds by the caller's promise.
            unsafe {
                let ap = acc.as_mut_ptr().add(c);
                let mut r: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(ap.add(8 * j)));
                for (p, &wp) in w.iter().enumerate() {
                    let (wv, row) = (_mm256_set1_ps(wp), rp.add(p * stride + c));
                    for (j, r) in r.iter_mut().enumerate() {
                        *r = _mm256_fmadd_ps(wv, load8(row.add(8 * j)), *r);
                    }
                }
                for (j, r) in r.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(8 * j), *r);
                }
            }
            c += 32;
        }
        for (p, &wp) in w.iter().enumerate() {
            let row = &rows[p * stride..];
            for k in c..width {
                acc[k] = wp.mul_add(super::f16_to_f32(row[k]), acc[k]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_agree_with_plain_arithmetic() {
        for width in [64, 40, 7] {
            let stride = width + 5;
            // Values exact in half precision.
            let rows: Vec<f32> = (0..stride * 9).map(|i| ((i * 37) % 101) as f32 / 64.0 - 1.0).collect();
            let mut half = vec![0u16; rows.len()];
            (kernels().to_halves)(&rows, &mut half);
            let mut back = vec![0.0f32; rows.len()];
            (portable().from_halves)(&half, &mut back);
            assert_eq!(back, rows, "exact values survive the round trip");
            let q: Vec<f32> = (0..width).map(|i| ((i * 13) % 17) as f32 / 8.0 - 1.0).collect();
            let w: Vec<f32> = (0..9).map(|p| p as f32 / 9.0).collect();
            for k in [kernels(), &portable()] {
                let mut out = vec![0.0f32; 9];
                (k.dots)(&q, &half, stride, &mut out);
                let mut acc = vec![1.0f32; width];
                (k.axpys)(&mut acc, &w, &half, stride);
                for p in 0..9 {
                    let want: f32 = q.iter().zip(&rows[p * stride..]).map(|(a, b)| a * b).sum();
                    assert!((out[p] - want).abs() < 1e-4, "{} dot {p}: {} vs {want}", k.name, out[p]);
                }
                for c in 0..width {
                    let want: f32 = 1.0 + (0..9).map(|p| w[p] * rows[p * stride + c]).sum::<f32>();
                    assert!((acc[c] - want).abs() < 1e-4, "{} axpy {c}", k.name);
                }
            }
        }
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
        (kernels().dots)(&[1.0; 8], &[0; 20], 8, &mut out);
    }
}
