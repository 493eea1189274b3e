//! ggml's weight formats, bit for bit: how each block lays out its scales and quants, how it
//! dequantizes (the reference every kernel is tested against), and how a row of f32 values is
//! quantized into it (activations, and the weights of test models).

use warmpath_wire::gguf::GgmlType;

/// IEEE half → single precision.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalize.
            let shift = m.leading_zeros() - 21;
            sign | ((113 - shift) << 23) | (((m << shift) & 0x3ff) << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Single → half precision, rounding to nearest even (as F16C and ggml do).
pub fn f32_to_f16(v: f32) -> u16 {
    let x = v.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let man = x & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1 << shift) - 1);
        let mut r = m >> shift;
        if rem > half || (rem == half && r & 1 == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let rem = man & 0x1fff;
    let mut r = ((e as u32) << 10) | (man >> 13);
    if rem > 0x1000 || (rem == 0x1000 && r & 1 == 1) {
        r += 1;
    }
    sign | r as u16
}

/// `v` as it comes back from a half-precision field.
pub fn round_f16(v: f32) -> f32 {
    f16_to_f32(f32_to_f16(v))
}

pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Dequantizes one row (whole blocks of `ty`) into `out`.
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    use GgmlType::*;
    let bb = ty.block_bytes();
    let be = ty.block_elements();
    for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match ty {
            F32 => o[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
            F16 => o[0] = half(blk, 0),
            BF16 => o[0] = bf16_to_f32(u16::from_le_bytes([blk[0], blk[1]])),
            Q8_0 => {
                let d = half(blk, 0);
                for (o, &q) in o.iter_mut().zip(&blk[2..34]) {
                    *o = d * f32::from(q as i8);
                }
            }
            Q4_0 => {
                let d = half(blk, 0);
                for j in 0..16 {
                    o[j] = d * (f32::from(blk[2 + j] & 0xf) - 8.0);
                    o[j + 16] = d * (f32::from(blk[2 + j] >> 4) - 8.0);
                }
            }
            Q4_1 => {
                let (d, m) = (half(blk, 0), half(blk, 2));
                for j in 0..16 {
                    o[j] = d * f32::from(blk[4 + j] & 0xf) + m;
                    o[j + 16] = d * f32::from(blk[4 + j] >> 4) + m;
                }
            }
            Q4_K => dequantize_q4_k(blk, o),
            Q5_K => dequantize_q5_k(blk, o),
            Q6_K => dequantize_q6_k(blk, o),
            Q5_0 | Q5_1 | Q8_1 | Q2_K | Q3_K | Q8_K => {
                unreachable!("{ty:?} is refused when a model is loaded")
            }
        }
    }
}

/// The weight types the engine computes with.
pub fn supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q4_K | Q5_K | Q6_K)
}

/// The 6-bit scale and min of sub-block `j` of a K-quant block's 12 scale bytes.
pub fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q4_K: d, dmin (f16), 12 scale bytes, 128 quant bytes; 8 sub-blocks of 32.
fn dequantize_q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for p in 0..4 {
        let (s1, m1) = k_scale_min(2 * p, scales);
        let (s2, m2) = k_scale_min(2 * p + 1, scales);
        let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
        let q = &qs[32 * p..32 * p + 32];
        for l in 0..32 {
            o[64 * p + l] = d1 * f32::from(q[l] & 0xf) - m1;
            o[64 * p + 32 + l] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

/// Q5_K: d, dmin, 12 scale bytes, 32 high-bit bytes, 128 quant bytes.
fn dequantize_q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for p in 0..4 {
        let (s1, m1) = k_scale_min(2 * p, scales);
        let (s2, m2) = k_scale_min(2 * p + 1, scales);
        let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
        let (u1, u2) = (1u8 << (2 * p), 2u8 << (2 * p));
        let q = &qs[32 * p..32 * p + 32];
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16.0 } else { 0.0 };
            let hi2 = if qh[l] & u2 != 0 { 16.0 } else { 0.0 };
            o[64 * p + l] = d1 * (f32::from(q[l] & 0xf) + hi1) - m1;
            o[64 * p + 32 + l] = d2 * (f32::from(q[l] >> 4) + hi2) - m2;
        }
    }
}

/// Q6_K: 128 low-bit bytes, 64 high-bit bytes, 16 signed scales, d.
fn dequantize_q6_k(b: &[u8], o: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    for n in 0..2 {
        let (ql, qh, sc, o) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..], &mut o[128 * n..]);
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            o[l] = s(0) * q1 as f32;
            o[l + 32] = s(2) * q2 as f32;
            o[l + 64] = s(4) * q3 as f32;
            o[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// Quantizes a row of f32 (a whole number of 32-blocks) into `ty`, as ggml's reference
/// quantizers do (Q8_0, Q4_0, Q4_1; others are read from files only).
pub fn quantize_row(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    use GgmlType::*;
    let mut out = Vec::with_capacity(x.len() / ty.block_elements() * ty.block_bytes());
    match ty {
        F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        F16 => x.iter().for_each(|v| out.extend_from_slice(&f32_to_f16(*v).to_le_bytes())),
        Q8_0 => {
            for b in x.chunks_exact(32) {
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        Q4_0 => {
            for b in x.chunks_exact(32) {
                let max = b.iter().copied().fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
        }
        Q4_1 => {
            for b in x.chunks_exact(32) {
                let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
                out.extend_from_slice(&f32_to_f16(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
        }
        other => unreachable!("no quantizer for {other:?}"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_round_trips() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 65504.0, 6.1e-5, 5.96e-8, 1.0e-3, 0.1, 3.25] {
            let h = f32_to_f16(v);
            let back = f16_to_f32(h);
            assert!((back - v).abs() <= v.abs() * 1e-3 + 6e-8, "{v} -> {h:#x} -> {back}");
            assert_eq!(f32_to_f16(back), h, "{v}");
        }
        assert!(f16_to_f32(f32_to_f16(1e6)).is_infinite());
        // Ties to even: 1 + 2^-11 is exactly between two halves.
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02);
    }

    #[test]
    fn quantized_rows_dequantize_close_to_the_original() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.3).collect();
        for (ty, tol) in
            [(GgmlType::Q8_0, 0.004), (GgmlType::Q4_0, 0.05), (GgmlType::Q4_1, 0.03), (GgmlType::F16, 1e-3)]
        {
            let q = quantize_row(ty, &x);
            assert_eq!(q.len(), 128 / ty.block_elements() * ty.block_bytes());
            let mut back = vec![0.0; 128];
            dequantize_row(ty, &q, &mut back);
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() <= tol, "{ty:?}: {a} vs {b}");
            }
        }
    }
}
