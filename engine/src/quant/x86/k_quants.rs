//! AVX2 dot products of the K-quants (Q4_K, Q5_K, Q6_K: 256-value blocks of 16 or 32-value
//! sub-blocks with their own integer scales) with Q8_K activations. Per block, the quants of a
//! sub-block meet 32 activation bytes in one `maddubs` and the sub-block's scale in one `madd`,
//! summed exactly in eight 32-bit lanes; the block's float scales are applied once. Offsets
//! (Q4_K/Q5_K mins, Q6_K's −32) are applied through the activations' sums per 16, as ggml does.

use std::arch::x86_64::*;

use super::super::formats::k_scale_min;
use super::super::Acts;
use super::{half_at, hsum, load};

/// Checks once what the unchecked reads rely on: `row` is whole blocks of `bytes`, activation
/// rows `i..i + n` are there with their scales and sums. Returns the number of blocks.
fn check(row: &[u8], bytes: usize, a: &Acts, i: usize, n: usize) -> usize {
    let nb = a.cols / 256;
    assert_eq!(row.len(), nb * bytes, "a weight row of the activations' width");
    assert!((i + n) * a.cols <= a.qs.len() && (i + n) * nb <= a.d.len(), "activation rows");
    assert!((i + n) * nb * 16 <= a.sums.len(), "activation sums");
    nb
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_k(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_rows!(q4_k_n, row, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k_n<const N: usize>(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    k4_5::<N, false>(row, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_k(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_rows!(q5_k_n, row, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_k_n<const N: usize>(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    k4_5::<N, true>(row, a, i, out)
}

/// Q4_K (`FIVE` false: d, dmin, 12 scale bytes, 128 quant bytes) and Q5_K (`FIVE`: the fifth
/// bits, 32 bytes, before the quants): 8 sub-blocks of 32, sub-block 2p in the low nibbles of
/// quant bytes 32p.., 2p + 1 in their high nibbles; the fifth bit of sub-block j's quant l is
/// bit j of `qh[l]`. Quants ≤ 31 × activations ≤ 127, two per 16-bit lane: no overflow.
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_5<const N: usize, const FIVE: bool>(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    let (bytes, qs_at) = if FIVE { (176, 48) } else { (144, 16) };
    let nb = check(row, bytes, a, i, N);
    let (w, qs, ds, ss) = (row.as_ptr(), a.qs.as_ptr().cast::<u8>(), a.d.as_ptr(), a.sums.as_ptr());
    let (low, sixteen) = (_mm256_set1_epi8(0xf), _mm256_set1_epi8(16));
    let mut acc = [_mm256_setzero_ps(); N];
    let mut mins = [0.0f32; N];
    for k in 0..nb {
        // SAFETY: `check` bounds block k of the row and of each activation row.
        unsafe {
            let blk = w.add(bytes * k);
            let (d, dmin) = (half_at(blk), half_at(blk.add(2)));
            let scales = std::slice::from_raw_parts(blk.add(4), 12);
            let (mut sc, mut m) = ([0i16; 8], [0i32; 8]);
            for j in 0..8 {
                let (s, mn) = k_scale_min(j, scales);
                (sc[j], m[j]) = (i16::from(s), i32::from(mn));
            }
            let qh = if FIVE { load(blk.add(16)) } else { _mm256_setzero_si256() };
            let fifth = |j: usize| {
                let bit = _mm256_set1_epi8((1u8 << j) as i8);
                _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), sixteen)
            };
            let mut sumi = [_mm256_setzero_si256(); N];
            for p in 0..4 {
                let raw = load(blk.add(qs_at + 32 * p));
                let mut lo = _mm256_and_si256(raw, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                if FIVE {
                    lo = _mm256_add_epi8(lo, fifth(2 * p));
                    hi = _mm256_add_epi8(hi, fifth(2 * p + 1));
                }
                let (s_lo, s_hi) = (_mm256_set1_epi16(sc[2 * p]), _mm256_set1_epi16(sc[2 * p + 1]));
                for (j, sumi) in sumi.iter_mut().enumerate() {
                    let x = qs.add((i + j) * a.cols + 256 * k + 64 * p);
                    let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(x)), s_lo);
                    let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(x.add(32))), s_hi);
                    *sumi = _mm256_add_epi32(*sumi, _mm256_add_epi32(plo, phi));
                }
            }
            for j in 0..N {
                let r = i + j;
                let dx = *ds.add(r * nb + k);
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
                let bs = ss.add((r * nb + k) * 16);
                let summ: i32 = (0..8).map(|q| m[q] * (*bs.add(2 * q) + *bs.add(2 * q + 1)) as i32).sum();
                mins[j] += dmin * dx * summ as f32;
            }
        }
    }
    for j in 0..N {
        out[j] = hsum(acc[j]) - mins[j];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6_k(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_rows!(q6_k_n, row, a, i, out)
}

/// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales (one per 16 quants),
/// d; two halves of 128 values, each four runs of 32 (`ql` low/high nibbles of bytes 0..32 and
/// 32..64 with bit pairs 0–1, 2–3, 4–5, 6–7 of `qh`). Quants are taken unsigned (0..63) and the
/// −32 applied through the activations' sums per 16.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k_n<const N: usize>(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    let nb = check(row, 210, a, i, N);
    let (w, qs, ds, ss) = (row.as_ptr(), a.qs.as_ptr().cast::<u8>(), a.d.as_ptr(), a.sums.as_ptr());
    let low = _mm256_set1_epi8(0xf);
    let bits = |m: u8| _mm256_set1_epi8(m as i8);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut offsets = [0.0f32; N];
    for k in 0..nb {
        // SAFETY: `check` bounds block k of the row and of each activation row.
        unsafe {
            let blk = w.add(210 * k);
            let d = half_at(blk.add(208));
            let sc = std::slice::from_raw_parts(blk.add(192).cast::<i8>(), 16);
            let mut sumi = [_mm256_setzero_si256(); N];
            for n in 0..2 {
                let (ql0, ql1, qh) =
                    (load(blk.add(64 * n)), load(blk.add(64 * n + 32)), load(blk.add(128 + 32 * n)));
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, low),
                        _mm256_slli_epi16(_mm256_and_si256(qh, bits(0x03)), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, low),
                        _mm256_slli_epi16(_mm256_and_si256(qh, bits(0x0c)), 2),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                        _mm256_and_si256(qh, bits(0x30)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                        _mm256_srli_epi16(_mm256_and_si256(qh, bits(0xc0)), 2),
                    ),
                ];
                // Run c's first 16 quants take scale 2c, the next 16 scale 2c + 1.
                let scale = |c: usize| {
                    let (s0, s1) = (i16::from(sc[8 * n + 2 * c]), i16::from(sc[8 * n + 2 * c + 1]));
                    _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0))
                };
                let scales = [scale(0), scale(1), scale(2), scale(3)];
                for (j, sumi) in sumi.iter_mut().enumerate() {
                    let x = qs.add((i + j) * a.cols + 256 * k + 128 * n);
                    for c in 0..4 {
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], load(x.add(32 * c))), scales[c]);
                        *sumi = _mm256_add_epi32(*sumi, p);
                    }
                }
            }
            for j in 0..N {
                let r = i + j;
                let dx = *ds.add(r * nb + k);
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
                let bs = ss.add((r * nb + k) * 16);
                let off: i32 = (0..16).map(|g| i32::from(sc[g]) * *bs.add(g) as i32).sum();
                offsets[j] += d * dx * (32 * off) as f32;
            }
        }
    }
    for j in 0..N {
        out[j] = hsum(acc[j]) - offsets[j];
    }
}
