//! llama2.c checkpoints (`run.c` format), read and written: the f32 weights of the small
//! models the tests and the quick-start presets use.

use std::path::Path;

use super::{LayerWeights, Matrix, ModelConfig, ModelError, Weights};

impl Weights {
    /// Reads a llama2.c checkpoint (`run.c` format: seven i32 header fields, then f32 arrays;
    /// a negative vocab size means an unshared output projection follows).
    pub fn load_llama2c(path: &Path) -> Result<Weights, ModelError> {
        let p = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io { path: p.clone(), source })?;
        let truncated = || ModelError::Truncated(p.clone());
        if bytes.len() < 28 {
            return Err(truncated());
        }
        let header: Vec<i32> =
            bytes[..28].chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        if header.iter().enumerate().any(|(i, &v)| v <= 0 && i != 5) || header[5] == 0 {
            return Err(truncated());
        }
        let cfg = ModelConfig {
            dim: header[0] as usize,
            hidden_dim: header[1] as usize,
            n_layers: header[2] as usize,
            n_heads: header[3] as usize,
            n_kv_heads: header[4] as usize,
            vocab_size: header[5].unsigned_abs() as usize,
            rope_theta: 10_000.0,
            rope_freq_scale: 1.0,
            norm_eps: 1e-5,
        };
        cfg.validate()?;
        let shared = header[5] > 0;
        let seq_len = header[6] as usize;
        let floats: Vec<f32> =
            bytes[28..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<Vec<f32>, ModelError> {
            let s = floats.get(at..at + n).ok_or_else(truncated)?.to_vec();
            at += n;
            Ok(s)
        };
        let (d, h, kv, l) = (cfg.dim, cfg.hidden_dim, cfg.kv_dim(), cfg.n_layers);
        let embed = Matrix::f32(cfg.vocab_size, d, take(cfg.vocab_size * d)?);
        // Arrays are stored all layers at a time: split each into per-layer slices.
        let mut split = |per: usize| -> Result<Vec<Vec<f32>>, ModelError> {
            Ok(take(per * l)?.chunks_exact(per).map(<[f32]>::to_vec).collect())
        };
        let rms_att = split(d)?;
        let wq = split(d * d)?;
        let wk = split(kv * d)?;
        let wv = split(kv * d)?;
        let wo = split(d * d)?;
        let rms_ffn = split(d)?;
        let w1 = split(h * d)?;
        let w2 = split(d * h)?;
        let w3 = split(h * d)?;
        let rms_final = take(d)?;
        take(seq_len * cfg.head_size())?; // precomputed RoPE tables (real + imag halves): unused
        let wcls =
            if shared { None } else { Some(Matrix::f32(cfg.vocab_size, d, take(cfg.vocab_size * d)?)) };
        let m = |rows: usize, cols: usize, v: &[Vec<f32>], i: usize| Matrix::f32(rows, cols, v[i].clone());
        let layers = (0..l)
            .map(|i| LayerWeights {
                rms_att: rms_att[i].clone(),
                wq: m(d, d, &wq, i),
                wk: m(kv, d, &wk, i),
                wv: m(kv, d, &wv, i),
                wo: m(d, d, &wo, i),
                rms_ffn: rms_ffn[i].clone(),
                w1: m(h, d, &w1, i),
                w2: m(d, h, &w2, i),
                w3: m(h, d, &w3, i),
            })
            .collect();
        Ok(Weights { cfg, embed, layers, rms_final, wcls })
    }

    /// Writes f32 weights as a llama2.c checkpoint (for tests and for sharing dummy models).
    pub fn save_llama2c(&self, path: &Path, seq_len: usize) -> std::io::Result<()> {
        let f32s = |m: &Matrix| -> std::io::Result<Vec<f32>> {
            m.as_f32()
                .map(<[f32]>::to_vec)
                .ok_or_else(|| std::io::Error::other("llama2.c checkpoints hold f32 weights"))
        };
        let c = &self.cfg;
        let vocab = if self.wcls.is_some() { -(c.vocab_size as i32) } else { c.vocab_size as i32 };
        let header = [c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads]
            .map(|v| v as i32)
            .into_iter()
            .chain([vocab, seq_len as i32]);
        let mut out = Vec::with_capacity(28 + 4 * c.num_params());
        header.for_each(|v| out.extend(v.to_le_bytes()));
        let mut put = |v: &[f32]| v.iter().for_each(|x| out.extend(x.to_le_bytes()));
        put(&f32s(&self.embed)?);
        for l in &self.layers {
            put(&l.rms_att);
        }
        fn pick(l: &LayerWeights, k: usize) -> &Matrix {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.w1, &l.w2, &l.w3][k]
        }
        for k in 0..4 {
            for l in &self.layers {
                put(&f32s(pick(l, k))?);
            }
        }
        for l in &self.layers {
            put(&l.rms_ffn);
        }
        for k in 4..7 {
            for l in &self.layers {
                put(&f32s(pick(l, k))?);
            }
        }
        put(&self.rms_final);
        put(&vec![0.0; seq_len * c.head_size()]);
        if let Some(w) = &self.wcls {
            put(&f32s(w)?);
        }
        std::fs::write(path, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama2c_checkpoints_round_trip() {
        let mut cfg = ModelConfig::micro();
        cfg.vocab_size = 300;
        let mut w = Weights::dummy(&cfg, 5).expect("valid");
        w.wcls = Some(Matrix::f32(300, cfg.dim, vec![0.5; 300 * cfg.dim]));
        let dir = std::env::temp_dir().join(format!("wp-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("m.bin");
        w.save_llama2c(&path, 64).expect("write");
        let r = Weights::load_llama2c(&path).expect("read");
        assert_eq!(r.cfg, cfg);
        assert_eq!(r.layers[1].w3.as_f32(), w.layers[1].w3.as_f32());
        assert_eq!(r.wcls.as_ref().and_then(Matrix::as_f32), w.wcls.as_ref().and_then(Matrix::as_f32));
        std::fs::write(&path, &std::fs::read(&path).expect("read")[..1000]).expect("write");
        assert!(matches!(Weights::load_llama2c(&path), Err(ModelError::Truncated(_))));
        let _ = std::fs::remove_dir_all(dir);
    }
}
