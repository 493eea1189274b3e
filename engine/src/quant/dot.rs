//! Dot products of one weight row with one row of quantized activations, per weight type: the
//! activations' 8-bit form for each (ggml's pairing: Q4_0 and Q8_0 with Q8_0, Q4_1 with Q8_1, the
//! K-quants with Q8_K, floats with f32), their quantization, and the portable kernels. AVX2
//! kernels for the hot types replace the portable ones where the CPU has AVX2 and FMA.

use warmpath_wire::gguf::GgmlType;

use super::formats::{bf16_to_f32, f16_to_f32, k_scale_min, round_f16};
use super::{Acts, Kernel};

/// The activations' form a weight type's dot product takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ActKind {
    /// 32-blocks, scale as half precision.
    Q8_0,
    /// Q8_0 plus scale × Σ quants (half precision), for weights with an offset (Q4_1).
    Q8_1,
    /// 256-blocks, scale as f32, Σ quants per 16 (K-quants).
    Q8K,
    F32,
}

impl ActKind {
    pub fn of(ty: GgmlType) -> ActKind {
        use GgmlType::*;
        match ty {
            Q4_0 | Q8_0 => ActKind::Q8_0,
            Q4_1 => ActKind::Q8_1,
            Q4_K | Q5_K | Q6_K => ActKind::Q8K,
            _ => ActKind::F32,
        }
    }
}

/// ggml's `nearest_int`: round half to even.
fn nearest(v: f32) -> i32 {
    v.round_ties_even() as i32
}

pub(super) fn quantize_acts(kind: ActKind, x: &[f32], cols: usize) -> Acts {
    #[cfg(target_arch = "x86_64")]
    let simd = super::x86::available();
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    quantize_acts_with(kind, x, cols, simd)
}

/// [`quantize_acts`], with the AVX2 quantizer (`simd`, where the CPU has it) or the portable one.
pub(super) fn quantize_acts_with(kind: ActKind, x: &[f32], cols: usize, simd: bool) -> Acts {
    let mut a = Acts { kind, cols, qs: Vec::new(), d: Vec::new(), sums: Vec::new(), f: Vec::new() };
    match kind {
        ActKind::F32 => a.f = x.to_vec(),
        ActKind::Q8_0 | ActKind::Q8_1 => {
            a.qs.reserve(x.len());
            #[cfg(target_arch = "x86_64")]
            if simd {
                let sums = (kind == ActKind::Q8_1).then_some(&mut a.sums);
                super::x86::quantize_q8(x, &mut a.qs, &mut a.d, sums);
                return a;
            }
            for b in x.chunks_exact(32) {
                // As ggml's AVX2 quantizer: scale 127 / max|x|, round half to even.
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                let d = round_f16(amax / 127.0);
                let mut sum = 0i32;
                for v in b {
                    let q = nearest(v * id);
                    sum += q;
                    a.qs.push(q as i8);
                }
                a.d.push(d);
                if kind == ActKind::Q8_1 {
                    a.sums.push(round_f16(amax / 127.0 * sum as f32));
                }
            }
        }
        ActKind::Q8K => {
            a.qs.reserve(x.len());
            for b in x.chunks_exact(256) {
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &v in b {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                if amax == 0.0 {
                    a.qs.extend(std::iter::repeat_n(0i8, 256));
                    a.d.push(0.0);
                    a.sums.extend(std::iter::repeat_n(0.0, 16));
                    continue;
                }
                let iscale = -127.0 / max;
                let start = a.qs.len();
                a.qs.extend(b.iter().map(|v| nearest(iscale * v).min(127) as i8));
                for g in a.qs[start..].chunks_exact(16) {
                    a.sums.push(g.iter().map(|&q| i32::from(q)).sum::<i32>() as f32);
                }
                a.d.push(1.0 / iscale);
            }
        }
    }
    let _ = (cols, simd);
    a
}

/// One weight row's dot product with one activation row.
type One = fn(&[u8], &Acts, usize) -> f32;

/// The kernel for `ty`: AVX2 where the CPU has it, portable otherwise.
pub(super) fn kernel(ty: GgmlType) -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if let Some(k) = super::x86::kernel(ty) {
        return k;
    }
    portable(ty)
}

pub(super) fn portable(ty: GgmlType) -> Kernel {
    macro_rules! each {
        ($one:expr) => {
            |row, a, i, out| {
                let one: One = $one;
                for (j, o) in out.iter_mut().enumerate() {
                    *o = one(row, a, i + j);
                }
            }
        };
    }
    use GgmlType::*;
    match ty {
        Q8_0 => each!(q8_0),
        Q4_0 => each!(q4_0),
        Q4_1 => each!(q4_1),
        Q4_K => each!(q4_k),
        Q5_K => each!(q5_k),
        Q6_K => each!(q6_k),
        F32 => each!(f32_row),
        F16 => each!(f16_row),
        BF16 => each!(bf16_row),
        other => unreachable!("{other:?} is refused when a model is loaded"),
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Block `k` of activation row `i` (32-blocks): its quants.
fn q8(a: &Acts, i: usize, k: usize) -> &[i8] {
    let at = i * a.cols + k * 32;
    &a.qs[at..at + 32]
}

fn q8_0(row: &[u8], a: &Acts, i: usize) -> f32 {
    let nb = a.cols / 32;
    let mut sum = 0.0f32;
    for (k, blk) in row.chunks_exact(34).enumerate() {
        let s: i32 =
            blk[2..34].iter().zip(q8(a, i, k)).map(|(&w, &x)| i32::from(w as i8) * i32::from(x)).sum();
        sum += half(blk, 0) * a.d[i * nb + k] * s as f32;
    }
    sum
}

fn q4_0(row: &[u8], a: &Acts, i: usize) -> f32 {
    let nb = a.cols / 32;
    let mut sum = 0.0f32;
    for (k, blk) in row.chunks_exact(18).enumerate() {
        let x = q8(a, i, k);
        let mut s = 0i32;
        for j in 0..16 {
            s += (i32::from(blk[2 + j] & 0xf) - 8) * i32::from(x[j]);
            s += (i32::from(blk[2 + j] >> 4) - 8) * i32::from(x[j + 16]);
        }
        sum += half(blk, 0) * a.d[i * nb + k] * s as f32;
    }
    sum
}

fn q4_1(row: &[u8], a: &Acts, i: usize) -> f32 {
    let nb = a.cols / 32;
    let (mut sum, mut mins) = (0.0f32, 0.0f32);
    for (k, blk) in row.chunks_exact(20).enumerate() {
        let x = q8(a, i, k);
        let mut s = 0i32;
        for j in 0..16 {
            s += i32::from(blk[4 + j] & 0xf) * i32::from(x[j]);
            s += i32::from(blk[4 + j] >> 4) * i32::from(x[j + 16]);
        }
        sum += half(blk, 0) * a.d[i * nb + k] * s as f32;
        mins += half(blk, 2) * a.sums[i * nb + k];
    }
    sum + mins
}

/// Activation row `i`'s 256-block `k`: quants, scale, sums of each 16.
fn q8k(a: &Acts, i: usize, k: usize) -> (&[i8], f32, &[f32]) {
    let nb = a.cols / 256;
    let at = i * a.cols + k * 256;
    (&a.qs[at..at + 256], a.d[i * nb + k], &a.sums[(i * nb + k) * 16..(i * nb + k + 1) * 16])
}

/// Q4_K and Q5_K: 8 sub-blocks of 32 with a 6-bit scale and min each; `hi` gives a quant's
/// fifth bit (Q5_K) or nothing.
fn k4_5(
    row: &[u8],
    a: &Acts,
    i: usize,
    bytes: usize,
    qs_at: usize,
    hi: impl Fn(&[u8], usize, usize) -> i32,
) -> f32 {
    let mut sum = 0.0f32;
    for (k, blk) in row.chunks_exact(bytes).enumerate() {
        let (x, dx, bsums) = q8k(a, i, k);
        let (d, dmin, scales, qs) = (half(blk, 0), half(blk, 2), &blk[4..16], &blk[qs_at..qs_at + 128]);
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = k_scale_min(j, scales);
            let (p, shift) = (j / 2, if j % 2 == 0 { 0 } else { 4 });
            let mut s = 0i32;
            for l in 0..32 {
                let q = i32::from((qs[32 * p + l] >> shift) & 0xf) + hi(blk, j, l);
                s += q * i32::from(x[32 * j + l]);
            }
            sumi += i32::from(sc) * s;
            summ += i32::from(m) * (bsums[2 * j] + bsums[2 * j + 1]) as i32;
        }
        sum += d * dx * sumi as f32 - dmin * dx * summ as f32;
    }
    sum
}

fn q4_k(row: &[u8], a: &Acts, i: usize) -> f32 {
    k4_5(row, a, i, 144, 16, |_, _, _| 0)
}

fn q5_k(row: &[u8], a: &Acts, i: usize) -> f32 {
    // The fifth bit of sub-block j's quant l is bit j of qh[l].
    k4_5(row, a, i, 176, 48, |blk, j, l| if blk[16 + l] & (1 << j) != 0 { 16 } else { 0 })
}

fn q6_k(row: &[u8], a: &Acts, i: usize) -> f32 {
    let mut sum = 0.0f32;
    for (k, blk) in row.chunks_exact(210).enumerate() {
        let (x, dx, _) = q8k(a, i, k);
        let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
        let d = half(blk, 208);
        let mut sumi = 0i32;
        for n in 0..2 {
            let (ql, qh, sc, x) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..], &x[128 * n..]);
            let mut part = [0i32; 8];
            for l in 0..32 {
                let is = l / 16;
                let q1 = i32::from((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
                let q2 = i32::from((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                part[is] += q1 * i32::from(x[l]);
                part[is + 2] += q2 * i32::from(x[l + 32]);
                part[is + 4] += q3 * i32::from(x[l + 64]);
                part[is + 6] += q4 * i32::from(x[l + 96]);
            }
            for (g, p) in part.iter().enumerate() {
                sumi += i32::from(sc[g] as i8) * p;
            }
        }
        sum += d * dx * sumi as f32;
    }
    sum
}

fn f32_row(row: &[u8], a: &Acts, i: usize) -> f32 {
    let x = &a.f[i * a.cols..(i + 1) * a.cols];
    row.chunks_exact(4).zip(x).map(|(b, x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x).sum()
}

fn f16_row(row: &[u8], a: &Acts, i: usize) -> f32 {
    let x = &a.f[i * a.cols..(i + 1) * a.cols];
    row.chunks_exact(2).zip(x).map(|(b, x)| f16_to_f32(u16::from_le_bytes([b[0], b[1]])) * x).sum()
}

fn bf16_row(row: &[u8], a: &Acts, i: usize) -> f32 {
    let x = &a.f[i * a.cols..(i + 1) * a.cols];
    row.chunks_exact(2).zip(x).map(|(b, x)| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) * x).sum()
}
