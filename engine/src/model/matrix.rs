//! A weight matrix `[rows × cols]`, row-major: f32 (dummy presets, llama2.c checkpoints), or in
//! a quantized GGUF format, multiplied as it is stored (`crate::quant`).

use crate::math::{matmul_wt, matmul_wt_add};
use crate::quant::{self, QuantMatrix};

#[derive(Debug, Clone)]
pub enum Matrix {
    F32 { rows: usize, cols: usize, data: Vec<f32> },
    Quant(QuantMatrix),
}

impl Matrix {
    pub fn f32(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        assert_eq!(data.len(), rows * cols, "a {rows}×{cols} matrix");
        Matrix::F32 { rows, cols, data }
    }

    pub fn rows(&self) -> usize {
        match self {
            Matrix::F32 { rows, .. } => *rows,
            Matrix::Quant(q) => q.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Matrix::F32 { cols, .. } => *cols,
            Matrix::Quant(q) => q.cols,
        }
    }

    /// The values, where they are f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Matrix::F32 { data, .. } => Some(data),
            Matrix::Quant(_) => None,
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        match self {
            Matrix::F32 { cols, data, .. } => out[..*cols].copy_from_slice(&data[r * cols..(r + 1) * cols]),
            Matrix::Quant(q) => q.dequantize_row(r, out),
        }
    }

    /// `out[t × rows] = x[t × cols] · selfᵀ`.
    pub fn matmul(&self, out: &mut [f32], x: &[f32], t: usize) {
        match self {
            Matrix::F32 { rows, cols, data } => matmul_wt(out, x, data, t, *cols, *rows),
            Matrix::Quant(q) => quant::matmul(out, x, t, q),
        }
    }

    /// `out[t × rows] += x[t × cols] · selfᵀ`: a product added into a residual stream.
    pub fn matmul_add(&self, out: &mut [f32], x: &[f32], t: usize) {
        match self {
            Matrix::F32 { rows, cols, data } => matmul_wt_add(out, x, data, t, *cols, *rows),
            Matrix::Quant(q) => {
                let mut product = vec![0.0f32; t * q.rows];
                quant::matmul(&mut product, x, t, q);
                out[..t * q.rows].iter_mut().zip(&product).for_each(|(o, p)| *o += p);
            }
        }
    }

    /// Bytes as held.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::F32 { data, .. } => data.len() * 4,
            Matrix::Quant(q) => q.bytes(),
        }
    }
}
