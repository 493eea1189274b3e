//! AVX2 + FMA dot products for the hot weight types (the K-quants in `k_quants`), picked at
//! run time: 32 quants of a weight block against 32 activation quants in one `maddubs`
//! (unsigned × signed bytes, pairwise summed), scaled and accumulated in eight float lanes — ggml's own arithmetic, so results
//! match llama.cpp's to the last rounding of each block. Each weight block is unpacked once for
//! up to four activation rows (a batch's tokens), and half-precision scales are converted by
//! F16C.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use warmpath_wire::gguf::GgmlType;

use super::{Acts, Kernel};

/// The CPU has what these kernels need: AVX2, FMA, F16C.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// The AVX2 kernel for `ty`, where the CPU has AVX2, FMA and F16C and one is written for it.
pub(super) fn kernel(ty: GgmlType) -> Option<Kernel> {
    if !available() {
        return None;
    }
    // SAFETY (for each wrapper below): they are only handed out here, after the check above.
    match ty {
        GgmlType::Q8_0 => Some(|row, a, i, out| unsafe { q8_0(row, a, i, out) }),
        GgmlType::Q4_0 => Some(|row, a, i, out| unsafe { q4_0(row, a, i, out) }),
        GgmlType::Q4_1 => Some(|row, a, i, out| unsafe { q4_1(row, a, i, out) }),
        GgmlType::Q4_K => Some(|row, a, i, out| unsafe { k_quants::q4_k(row, a, i, out) }),
        GgmlType::Q5_K => Some(|row, a, i, out| unsafe { k_quants::q5_k(row, a, i, out) }),
        GgmlType::Q6_K => Some(|row, a, i, out| unsafe { k_quants::q6_k(row, a, i, out) }),
        _ => None,
    }
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

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Calls `$f::<N>` for `N = out.len()` (1 to 4): each row count gets its own unrolled kernel.
macro_rules! by_rows {
    ($f:ident, $row:expr, $a:expr, $i:expr, $out:expr) => {
        match $out.len() {
            1 => $f::<1>($row, $a, $i, $out),
            2 => $f::<2>($row, $a, $i, $out),
            3 => $f::<3>($row, $a, $i, $out),
            _ => $f::<4>($row, $a, $i, $out),
        }
    };
}

/// Checks once what the unchecked reads of a kernel then rely on: `row` is whole blocks of
/// `bytes` for the activations' width, and activation rows `i..i + n` are there (with their
/// sums where `sums`). Returns the number of blocks.
fn check(row: &[u8], bytes: usize, a: &Acts, i: usize, n: usize, sums: bool) -> usize {
    let nb = a.cols / 32;
    assert_eq!(row.len(), nb * bytes, "a weight row of the activations' width");
    assert!((i + n) * a.cols <= a.qs.len() && (i + n) * nb <= a.d.len(), "activation rows");
    assert!(!sums || (i + n) * nb <= a.sums.len(), "activation sums");
    nb
}

/// 32 bytes at `p`, unaligned.
///
/// # Safety
/// `p..p + 32` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the caller's promise.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// 16 bytes of packed nibbles at `p` → 32 bytes: low nibbles first, then high.
///
/// # Safety
/// `p..p + 16` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles_at(p: *const u8) -> __m256i {
    // SAFETY: the caller's promise.
    let tmp = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(both, _mm256_set1_epi8(0xf))
}

/// The half at `p`, by F16C.
///
/// # Safety
/// `p..p + 2` must be readable.
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn half_at(p: *const u8) -> f32 {
    // SAFETY: the caller's promise; the read is unaligned.
    let h = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le(h)))))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_rows!(q8_0_n, row, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_n<const N: usize>(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    let nb = check(row, 34, a, i, N, false);
    let (w, qs, ds) = (row.as_ptr(), a.qs.as_ptr().cast::<u8>(), a.d.as_ptr());
    let mut acc = [_mm256_setzero_ps(); N];
    for k in 0..nb {
        // SAFETY: `check` bounds block k of the row and of each activation row.
        unsafe {
            let blk = w.add(34 * k);
            let dw = half_at(blk);
            let qw = load(blk.add(2));
            for (j, acc) in acc.iter_mut().enumerate() {
                let r = i + j;
                let prod = mul_sum_i8(qw, load(qs.add(r * a.cols + 32 * k)));
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * *ds.add(r * nb + k)), prod, *acc);
            }
        }
    }
    for j in 0..N {
        out[j] = hsum(acc[j]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_rows!(q4_0_n, row, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0_n<const N: usize>(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    let nb = check(row, 18, a, i, N, false);
    let (w, qs, ds) = (row.as_ptr(), a.qs.as_ptr().cast::<u8>(), a.d.as_ptr());
    let mut acc = [_mm256_setzero_ps(); N];
    let eight = _mm256_set1_epi8(8);
    for k in 0..nb {
        // SAFETY: `check` bounds block k of the row and of each activation row.
        unsafe {
            let blk = w.add(18 * k);
            let dw = half_at(blk);
            let qw = _mm256_sub_epi8(nibbles_at(blk.add(2)), eight);
            // The weights' signs, moved onto each activation row in turn.
            let aw = _mm256_sign_epi8(qw, qw);
            for (j, acc) in acc.iter_mut().enumerate() {
                let r = i + j;
                let prod = mul_sum_us8(aw, _mm256_sign_epi8(load(qs.add(r * a.cols + 32 * k)), qw));
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * *ds.add(r * nb + k)), prod, *acc);
            }
        }
    }
    for j in 0..N {
        out[j] = hsum(acc[j]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_rows!(q4_1_n, row, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1_n<const N: usize>(row: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    let nb = check(row, 20, a, i, N, true);
    let (w, qs, ds, ss) = (row.as_ptr(), a.qs.as_ptr().cast::<u8>(), a.d.as_ptr(), a.sums.as_ptr());
    let mut acc = [_mm256_setzero_ps(); N];
    let mut mins = [0.0f32; N];
    for k in 0..nb {
        // SAFETY: `check` bounds block k of the row and of each activation row.
        unsafe {
            let blk = w.add(20 * k);
            let (dw, mw) = (half_at(blk), half_at(blk.add(2)));
            let qw = nibbles_at(blk.add(4));
            for j in 0..N {
                let r = i + j;
                mins[j] += mw * *ss.add(r * nb + k);
                let dd = _mm256_set1_ps(dw * *ds.add(r * nb + k));
                acc[j] = _mm256_fmadd_ps(dd, mul_sum_us8(qw, load(qs.add(r * a.cols + 32 * k))), acc[j]);
            }
        }
    }
    for j in 0..N {
        out[j] = hsum(acc[j]) + mins[j];
    }
}

/// The kernel over eight-row groups ([`super::packed`]) for `ty`, where the CPU has AVX2, FMA
/// and F16C and one is written for it: `out[8j + lane]` is row `lane` of the group times
/// activation row `i + j`, for `j < out.len() / 8` (one to four rows).
pub(super) fn packed_kernel(ty: GgmlType) -> Option<Kernel> {
    if !available() {
        return None;
    }
    // SAFETY (for each wrapper below): they are only handed out here, after the check above.
    match ty {
        GgmlType::Q4_1 => Some(|g, a, i, out| unsafe { q4_1x8(g, a, i, out) }),
        GgmlType::Q8_0 => Some(|g, a, i, out| unsafe { q8_0x8(g, a, i, out) }),
        _ => None,
    }
}

/// Calls `$f::<N>` for `N = out.len() / 8` (1 to 4).
macro_rules! by_groups {
    ($f:ident, $g:expr, $a:expr, $i:expr, $out:expr) => {
        match $out.len() / 8 {
            1 => $f::<1>($g, $a, $i, $out),
            2 => $f::<2>($g, $a, $i, $out),
            3 => $f::<3>($g, $a, $i, $out),
            _ => $f::<4>($g, $a, $i, $out),
        }
    };
}

/// Four activation bytes at `p`, in every lane.
///
/// # Safety
/// `p..p + 4` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn broadcast4(p: *const u8) -> __m256i {
    // SAFETY: the caller's promise; the read is unaligned.
    _mm256_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

/// Eight halves at `p` as floats.
///
/// # Safety
/// `p..p + 16` must be readable.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn halves8(p: *const u8) -> __m256 {
    // SAFETY: the caller's promise; the read is unaligned.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// Checks once what a group kernel's unchecked reads rely on; returns the number of blocks.
fn check_group(g: &[u8], ty: GgmlType, a: &Acts, i: usize, n: usize, sums: bool) -> usize {
    let (_, block) = super::packed::block_layout(ty).expect("a repacked type");
    let nb = a.cols / 32;
    assert_eq!(g.len(), nb * block, "a group of the activations' width");
    assert!((1..=4).contains(&n), "one to four activation rows");
    assert!((i + n) * a.cols <= a.qs.len() && (i + n) * nb <= a.d.len(), "activation rows");
    assert!(!sums || (i + n) * nb <= a.sums.len(), "activation sums");
    nb
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1x8(g: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_groups!(q4_1x8_n, g, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1x8_n<const N: usize>(g: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    let nb = check_group(g, GgmlType::Q4_1, a, i, N, true);
    let (w, qs, ds, ss) = (g.as_ptr(), a.qs.as_ptr().cast::<u8>(), a.d.as_ptr(), a.sums.as_ptr());
    let (mask, ones) = (_mm256_set1_epi8(0xf), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); N];
    let mut mins = [_mm256_setzero_ps(); N];
    for k in 0..nb {
        // SAFETY: `check_group` bounds block k of the group and of each activation row.
        unsafe {
            let blk = w.add(160 * k);
            let (dw, mw) = (halves8(blk), halves8(blk.add(16)));
            // Per activation row, the eight rows' products in 16-bit lanes: at most
            // 8 × 2 × 15 × 127 = 30,480, no overflow.
            let mut s16 = [_mm256_setzero_si256(); N];
            for c in 0..4 {
                let raw = load(blk.add(32 + 32 * c));
                let lo = _mm256_and_si256(raw, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                for (j, s) in s16.iter_mut().enumerate() {
                    let ap = qs.add((i + j) * a.cols + 32 * k);
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, broadcast4(ap.add(4 * c))),
                        _mm256_maddubs_epi16(hi, broadcast4(ap.add(16 + 4 * c))),
                    );
                    *s = _mm256_add_epi16(*s, p);
                }
            }
            for j in 0..N {
                let r = i + j;
                let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[j], ones));
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*ds.add(r * nb + k)));
                acc[j] = _mm256_fmadd_ps(dot, scale, acc[j]);
                mins[j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*ss.add(r * nb + k)), mins[j]);
            }
        }
    }
    for j in 0..N {
        let mut v = [0.0f32; 8];
        // SAFETY: eight floats into eight slots.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), _mm256_add_ps(acc[j], mins[j])) };
        out[8 * j..8 * j + 8].copy_from_slice(&v);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0x8(g: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    by_groups!(q8_0x8_n, g, a, i, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0x8_n<const N: usize>(g: &[u8], a: &Acts, i: usize, out: &mut [f32]) {
    let nb = check_group(g, GgmlType::Q8_0, a, i, N, false);
    let (w, qs, ds) = (g.as_ptr(), a.qs.as_ptr().cast::<u8>(), a.d.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    for k in 0..nb {
        // SAFETY: `check_group` bounds block k of the group and of each activation row.
        unsafe {
            let blk = w.add(272 * k);
            let dw = halves8(blk);
            let mut s32 = [_mm256_setzero_si256(); N];
            for c in 0..8 {
                let qw = load(blk.add(16 + 32 * c));
                // The weights' signs moved onto the activations (maddubs multiplies unsigned
                // by signed bytes).
                let aw = _mm256_sign_epi8(qw, qw);
                for (j, s) in s32.iter_mut().enumerate() {
                    let av = broadcast4(qs.add((i + j) * a.cols + 32 * k + 4 * c));
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(av, qw)), ones);
                    *s = _mm256_add_epi32(*s, p);
                }
            }
            for j in 0..N {
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*ds.add((i + j) * nb + k)));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[j]), scale, acc[j]);
            }
        }
    }
    for j in 0..N {
        let mut v = [0.0f32; 8];
        // SAFETY: eight floats into eight slots.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), acc[j]) };
        out[8 * j..8 * j + 8].copy_from_slice(&v);
    }
}

/// Quantizes `x` (whole 32-blocks) as ggml's AVX2 `quantize_row_q8_0`/`q8_1` do: scale
/// 127 / max|x|, rounded half to even; pushes quants, scales (half-precision rounded) and, for
/// Q8_1, scale × Σ quants.
pub(super) fn quantize_q8(x: &[f32], qs: &mut Vec<i8>, d: &mut Vec<f32>, sums: Option<&mut Vec<f32>>) {
    assert!(available(), "AVX2, FMA and F16C");
    // SAFETY: the CPU has the features (asserted above).
    unsafe { quantize_q8_avx2(x, qs, d, sums) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_q8_avx2(x: &[f32], qs: &mut Vec<i8>, d: &mut Vec<f32>, mut sums: Option<&mut Vec<f32>>) {
    let sign = _mm256_set1_ps(-0.0);
    for b in x.chunks_exact(32) {
        let v: [__m256; 4] = std::array::from_fn(|q| {
            // SAFETY: `b` holds 32 floats; each load takes 8 of them, unaligned.
            unsafe { _mm256_loadu_ps(b[8 * q..].as_ptr()) }
        });
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for vq in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vq));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        let scale = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let mut sum = 0i32;
        let mut out = [0i32; 32];
        for (q, vq) in v.iter().enumerate() {
            let r = _mm256_round_ps(_mm256_mul_ps(*vq, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            let n = _mm256_cvtps_epi32(r);
            // SAFETY: eight i32 into eight slots of `out`.
            unsafe { _mm256_storeu_si256(out[8 * q..].as_mut_ptr().cast(), n) };
        }
        for n in out {
            sum += n;
            qs.push(n as i8);
        }
        let dh = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(scale), _MM_FROUND_TO_NEAREST_INT)));
        d.push(dh);
        if let Some(s) = sums.as_deref_mut() {
            let v = scale * sum as f32;
            s.push(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT))));
        }
    }
}

mod k_quants;
