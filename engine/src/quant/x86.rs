//! AVX2 + FMA dot products for the hot weight types, picked at run time: 32 quants of a weight
//! block against 32 activation quants in one `maddubs` (unsigned × signed bytes, pairwise
//! summed), scaled and accumulated in eight float lanes — ggml's own arithmetic, so results
//! match llama.cpp's to the last rounding of each block.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use warmpath_wire::gguf::GgmlType;

use super::dot::Kernel;
use super::formats::f16_to_f32;
use super::Acts;

/// The AVX2 kernel for `ty`, where the CPU has AVX2 and FMA and one is written for it.
pub(super) fn kernel(ty: GgmlType) -> Option<Kernel> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        return None;
    }
    // SAFETY (for each wrapper below): they are only handed out here, after the check above.
    match ty {
        GgmlType::Q8_0 => Some(|row, a, i| unsafe { q8_0(row, a, i) }),
        GgmlType::Q4_0 => Some(|row, a, i| unsafe { q4_0(row, a, i) }),
        GgmlType::Q4_1 => Some(|row, a, i| unsafe { q4_1(row, a, i) }),
        _ => None,
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Σ of u8 × i8 products as eight i32 lanes, as floats.
#[inline]
#[target_feature(enable = "avx2")]
fn mul_sum_us8(ax: __m256i, sy: __m256i) -> __m256 {
    let dot = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot))
}

/// Σ of i8 × i8 products: the first operand's signs moved onto the second.
#[inline]
#[target_feature(enable = "avx2")]
fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256 {
    mul_sum_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// 16 bytes of packed nibbles → 32 bytes: low nibbles in the first half, high in the second.
#[inline]
#[target_feature(enable = "avx2")]
fn nibbles(p: &[u8]) -> __m256i {
    // SAFETY: `p` holds at least 16 bytes (a block's quants); the load is unaligned.
    let tmp = unsafe { _mm_loadu_si128(p.as_ptr().cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(both, _mm256_set1_epi8(0xf))
}

#[inline]
#[target_feature(enable = "avx2")]
fn load32(x: &[i8]) -> __m256i {
    // SAFETY: the callers pass a block's 32 quants; the load is unaligned.
    unsafe { _mm256_loadu_si256(x.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma")]
fn q8_0(row: &[u8], a: &Acts, i: usize) -> f32 {
    let nb = a.cols / 32;
    let (xs, ds) = (&a.qs[i * a.cols..(i + 1) * a.cols], &a.d[i * nb..(i + 1) * nb]);
    let mut acc = _mm256_setzero_ps();
    for (k, blk) in row.chunks_exact(34).enumerate() {
        let d = _mm256_set1_ps(half(blk, 0) * ds[k]);
        // SAFETY: a block's 32 quants follow its 2-byte scale.
        let qw = unsafe { _mm256_loadu_si256(blk[2..].as_ptr().cast()) };
        let qx = load32(&xs[32 * k..]);
        acc = _mm256_fmadd_ps(d, mul_sum_i8(qw, qx), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma")]
fn q4_0(row: &[u8], a: &Acts, i: usize) -> f32 {
    let nb = a.cols / 32;
    let (xs, ds) = (&a.qs[i * a.cols..(i + 1) * a.cols], &a.d[i * nb..(i + 1) * nb]);
    let mut acc = _mm256_setzero_ps();
    let eight = _mm256_set1_epi8(8);
    for (k, blk) in row.chunks_exact(18).enumerate() {
        let d = _mm256_set1_ps(half(blk, 0) * ds[k]);
        let qw = _mm256_sub_epi8(nibbles(&blk[2..]), eight);
        let qx = load32(&xs[32 * k..]);
        acc = _mm256_fmadd_ps(d, mul_sum_i8(qw, qx), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma")]
fn q4_1(row: &[u8], a: &Acts, i: usize) -> f32 {
    let nb = a.cols / 32;
    let (xs, ds, ss) =
        (&a.qs[i * a.cols..(i + 1) * a.cols], &a.d[i * nb..(i + 1) * nb], &a.sums[i * nb..(i + 1) * nb]);
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0.0f32;
    for (k, blk) in row.chunks_exact(20).enumerate() {
        mins += half(blk, 2) * ss[k];
        let d = _mm256_mul_ps(_mm256_set1_ps(half(blk, 0)), _mm256_set1_ps(ds[k]));
        let qw = nibbles(&blk[4..]);
        let qx = load32(&xs[32 * k..]);
        acc = _mm256_fmadd_ps(d, mul_sum_us8(qw, qx), acc);
    }
    hsum(acc) + mins
}
