//! Every kernel against the f32 product of the dequantized weights with the activations as
//! quantized, and the AVX2 kernels against the portable ones.

use super::*;

/// Deterministic values in roughly ±1, some blocks all zero.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            if (i / 32) % 7 == 3 {
                0.0
            } else {
                (s % 2001) as f32 / 1000.0 - 1.0
            }
        })
        .collect()
}

/// What a kernel must compute: the dequantized row times the activations as they were quantized
/// (dequantized back), in f64.
fn reference(w: &QuantMatrix, acts: &Acts, i: usize, r: usize) -> f64 {
    let mut row = vec![0.0f32; w.cols];
    w.dequantize_row(r, &mut row);
    let x: Vec<f32> = match acts.kind {
        dot::ActKind::F32 => acts.f[i * w.cols..(i + 1) * w.cols].to_vec(),
        dot::ActKind::Q8_0 | dot::ActKind::Q8_1 => {
            let nb = w.cols / 32;
            (0..w.cols).map(|c| acts.d[i * nb + c / 32] * f32::from(acts.qs[i * w.cols + c])).collect()
        }
        dot::ActKind::Q8K => {
            let nb = w.cols / 256;
            (0..w.cols).map(|c| acts.d[i * nb + c / 256] * f32::from(acts.qs[i * w.cols + c])).collect()
        }
    };
    let mut sum: f64 = row.iter().zip(&x).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
    if acts.kind == dot::ActKind::Q8_1 {
        // Q4_1's offsets meet the activations through their sums as Q8_1 keeps them (half
        // precision), not through the exact sums.
        for (k, blk) in w.row(r).chunks_exact(20).enumerate() {
            let m = f64::from(formats::f16_to_f32(u16::from_le_bytes([blk[2], blk[3]])));
            let exact: f64 = x[32 * k..32 * k + 32].iter().map(|v| f64::from(*v)).sum();
            sum += m * (f64::from(acts.sums[i * (w.cols / 32) + k]) - exact);
        }
    }
    sum
}

fn check(w: &QuantMatrix, t: usize) {
    let x = values(t * w.cols, 7);
    let acts = Acts::new(w.ty, &x, t, w.cols);
    let mut out = vec![0.0f32; t * w.rows];
    matmul_acts(&mut out, &acts, t, w);
    let portable = dot::portable(w.ty);
    for i in 0..t {
        for r in 0..w.rows {
            let want = reference(w, &acts, i, r);
            let got = out[i * w.rows + r];
            let tol = 1e-3 * (1.0 + want.abs());
            assert!((f64::from(got) - want).abs() < tol, "{:?} row {r} x{i}: {got} vs {want}", w.ty);
            let mut p = [0.0f32];
            portable(w.row(r), &acts, i, &mut p);
            assert!(
                (f64::from(p[0]) - want).abs() < tol,
                "{:?} portable row {r} x{i}: {} vs {want}",
                w.ty,
                p[0]
            );
        }
    }
}

#[test]
fn quantized_formats_multiply_as_their_dequantized_weights() {
    // 16 rows: whole groups of eight, repacked where the CPU has the kernels; 5: row by row.
    for (rows, cols) in [(5, 512), (16, 512)] {
        let w = values(rows * cols, 3);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::F16, GgmlType::F32] {
            let m = QuantMatrix::quantize(ty, rows, cols, &w);
            if rows == 16 && matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_1) {
                assert_eq!(m.packed.is_some(), cfg!(target_arch = "x86_64") && kernels_here());
            }
            for t in [0, 1, 6, 11] {
                check(&m, t);
            }
        }
    }
}

/// Whether this CPU runs the AVX2 kernels.
fn kernels_here() -> bool {
    #[cfg(target_arch = "x86_64")]
    return x86::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// K-quant blocks are read from files only: random bytes are valid blocks (scales, quants), so
/// the kernels are checked on those.
#[test]
fn k_quants_multiply_as_their_dequantized_weights() {
    let (rows, cols) = (3, 512);
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        let n = rows * cols / 256 * ty.block_bytes();
        let mut bytes: Vec<u8> = values(n, 11).iter().map(|v| ((v + 1.0) * 127.0) as u8).collect();
        // Small, finite half-precision scales.
        let scale_at: &[usize] = if ty == GgmlType::Q6_K { &[208] } else { &[0, 2] };
        for blk in bytes.chunks_exact_mut(ty.block_bytes()) {
            for &at in scale_at {
                blk[at..at + 2].copy_from_slice(&formats::f32_to_f16(0.01).to_le_bytes());
            }
        }
        let m = QuantMatrix::new(ty, rows, cols, Storage::Owned(bytes.into())).expect("valid");
        for t in [1, 2, 3, 4, 9] {
            check(&m, t);
        }
        // As for the other types: a row's product does not depend on the batch around it.
        let x = values(9 * cols, 9);
        let mut all = vec![0.0f32; 9 * rows];
        matmul(&mut all, &x, 9, &m);
        for i in 0..9 {
            let mut one = vec![0.0f32; rows];
            matmul(&mut one, &x[i * cols..(i + 1) * cols], 1, &m);
            assert_eq!(&all[i * rows..(i + 1) * rows], &one[..], "{ty:?}: row {i} of 9");
        }
    }
}

#[test]
fn activations_quantize_as_ggml_does() {
    // Q8_0: scale 127 / max|x| and round half to even; the scale is kept in half precision.
    let mut x = vec![0.0f32; 32];
    x[0] = 1.27;
    x[1] = 0.005; // 0.5 after scaling: rounds to 0 (even)
    x[2] = 0.015; // 1.5: rounds to 2
    x[3] = -1.27;
    let a = Acts::new(GgmlType::Q8_0, &x, 1, 32);
    assert_eq!(&a.qs[..4], &[127, 0, 2, -127]);
    assert_eq!(a.d[0], formats::round_f16(0.01));
    let a = Acts::new(GgmlType::Q4_1, &x, 1, 32);
    assert_eq!(a.sums[0], formats::round_f16(0.01 * 2.0));
}

#[test]
#[cfg(target_arch = "x86_64")]
fn the_avx2_and_portable_quantizers_agree() {
    if !x86::available() {
        return;
    }
    let x = values(4 * 256, 5);
    for kind in [dot::ActKind::Q8_0, dot::ActKind::Q8_1] {
        let a = dot::quantize_acts_with(kind, &x, 256, true);
        let b = dot::quantize_acts_with(kind, &x, 256, false);
        assert_eq!((a.qs, a.d, a.sums), (b.qs, b.d, b.sums), "{kind:?}");
    }
}

/// A row's product does not depend on how many rows are multiplied with it, or where it sits
/// among them: a step verifying proposals computes each position exactly as a one-token step
/// would (greedy speculative decoding must not change a token).
#[test]
fn each_rows_product_is_the_same_in_any_batch() {
    let (rows, cols) = (40, 512);
    let w = values(rows * cols, 5);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::F16, GgmlType::F32] {
        let m = QuantMatrix::quantize(ty, rows, cols, &w);
        for t in [2, 3, 5, 8, 9, 17] {
            let x = values(t * cols, 9);
            let mut all = vec![0.0f32; t * rows];
            matmul(&mut all, &x, t, &m);
            for i in 0..t {
                let mut one = vec![0.0f32; rows];
                matmul(&mut one, &x[i * cols..(i + 1) * cols], 1, &m);
                assert_eq!(&all[i * rows..(i + 1) * rows], &one[..], "{ty:?}: row {i} of {t}");
            }
        }
    }
}
