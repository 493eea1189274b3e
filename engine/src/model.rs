//! Llama model shapes and weights: presets with seeded dummy weights (vLLM's
//! `--load-format dummy`), or a llama2.c checkpoint read from a path.

use std::path::Path;

use crate::sampler::Rng;

/// The shape of a llama-architecture model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub dim: usize,
    pub hidden_dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
}

impl ModelConfig {
    /// `tiny`: llama2.c's stories15M shape (dim 288, 6 layers, 6 heads, vocab 32000), 15.2M
    /// parameters.
    pub fn tiny() -> ModelConfig {
        ModelConfig {
            dim: 288,
            hidden_dim: 768,
            n_layers: 6,
            n_heads: 6,
            n_kv_heads: 6,
            vocab_size: 32_000,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
        }
    }

    /// `micro`: a 2-layer, dim-64 model with grouped-query attention (4 query heads over 2 KV
    /// heads) for fast tests; 2.1M parameters, almost all of them the embedding.
    pub fn micro() -> ModelConfig {
        ModelConfig {
            dim: 64,
            hidden_dim: 176,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            vocab_size: 32_000,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
        }
    }

    pub fn preset(name: &str) -> Option<ModelConfig> {
        match name {
            "tiny" => Some(Self::tiny()),
            "micro" => Some(Self::micro()),
            _ => None,
        }
    }

    pub fn head_size(&self) -> usize {
        self.dim / self.n_heads
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_size()
    }

    /// Parameter count (embedding shared with the output projection).
    pub fn num_params(&self) -> usize {
        let (d, h, kv) = (self.dim, self.hidden_dim, self.kv_dim());
        self.vocab_size * d + self.n_layers * (2 * d + 2 * d * d + 2 * d * kv + 3 * d * h) + d
    }

    /// Bytes of K and V for one token across all layers (f32).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.kv_dim() * 4
    }

    fn validate(&self) -> Result<(), ModelError> {
        let ok = self.dim > 0
            && self.n_heads > 0
            && self.dim % self.n_heads == 0
            && self.head_size() % 2 == 0
            && self.n_kv_heads > 0
            && self.n_heads % self.n_kv_heads == 0
            && self.n_layers > 0
            && self.hidden_dim > 0
            && self.vocab_size > 0;
        if ok {
            Ok(())
        } else {
            Err(ModelError::Shape(format!("{self:?}")))
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unsupported model shape: {0}")]
    Shape(String),
    #[error("reading checkpoint {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("checkpoint {0} is truncated or has a bad header")]
    Truncated(String),
}

/// One transformer layer, matrices `[out × in]` row-major as in llama2.c.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub rms_att: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub wo: Vec<f32>,
    pub rms_ffn: Vec<f32>,
    pub w1: Vec<f32>,
    pub w2: Vec<f32>,
    pub w3: Vec<f32>,
}

/// All weights of a model.
#[derive(Debug, Clone)]
pub struct Weights {
    pub cfg: ModelConfig,
    pub embed: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    pub rms_final: Vec<f32>,
    /// The output projection when not shared with `embed`.
    pub wcls: Option<Vec<f32>>,
}

impl Weights {
    /// Seeded random weights: uniform with variance 1/fan-in for matrices, ones for norms, so
    /// activations stay in range and outputs are deterministic per seed.
    pub fn dummy(cfg: &ModelConfig, seed: u64) -> Result<Weights, ModelError> {
        cfg.validate()?;
        let (d, h, kv) = (cfg.dim, cfg.hidden_dim, cfg.kv_dim());
        let mut rng = Rng::new(seed);
        // Embeddings have variance ~1/3 (not fan-in scaled): RMSNorm rescales them anyway.
        let embed: Vec<f32> = (0..cfg.vocab_size * d).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
        let mut mat = |rows: usize, cols: usize| -> Vec<f32> {
            let a = (3.0 / cols as f32).sqrt();
            (0..rows * cols).map(|_| (rng.next_f32() * 2.0 - 1.0) * a).collect()
        };
        let layers = (0..cfg.n_layers)
            .map(|_| LayerWeights {
                rms_att: vec![1.0; d],
                wq: mat(d, d),
                wk: mat(kv, d),
                wv: mat(kv, d),
                wo: mat(d, d),
                rms_ffn: vec![1.0; d],
                w1: mat(h, d),
                w2: mat(d, h),
                w3: mat(h, d),
            })
            .collect();
        Ok(Weights { cfg: cfg.clone(), embed, layers, rms_final: vec![1.0; d], wcls: None })
    }

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
        let embed = take(cfg.vocab_size * d)?;
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
        let wcls = if shared { None } else { Some(take(cfg.vocab_size * d)?) };
        let layers = (0..l)
            .map(|i| LayerWeights {
                rms_att: rms_att[i].clone(),
                wq: wq[i].clone(),
                wk: wk[i].clone(),
                wv: wv[i].clone(),
                wo: wo[i].clone(),
                rms_ffn: rms_ffn[i].clone(),
                w1: w1[i].clone(),
                w2: w2[i].clone(),
                w3: w3[i].clone(),
            })
            .collect();
        Ok(Weights { cfg, embed, layers, rms_final, wcls })
    }

    /// Writes the weights as a llama2.c checkpoint (for tests and for sharing dummy models).
    pub fn save_llama2c(&self, path: &Path, seq_len: usize) -> std::io::Result<()> {
        let c = &self.cfg;
        let vocab = if self.wcls.is_some() { -(c.vocab_size as i32) } else { c.vocab_size as i32 };
        let header = [c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads]
            .map(|v| v as i32)
            .into_iter()
            .chain([vocab, seq_len as i32]);
        let mut out = Vec::with_capacity(28 + 4 * c.num_params());
        header.for_each(|v| out.extend(v.to_le_bytes()));
        let mut put = |v: &[f32]| v.iter().for_each(|x| out.extend(x.to_le_bytes()));
        put(&self.embed);
        for f in [
            |l: &LayerWeights| l.rms_att.clone(),
            |l: &LayerWeights| l.wq.clone(),
            |l: &LayerWeights| l.wk.clone(),
            |l: &LayerWeights| l.wv.clone(),
            |l: &LayerWeights| l.wo.clone(),
            |l: &LayerWeights| l.rms_ffn.clone(),
            |l: &LayerWeights| l.w1.clone(),
            |l: &LayerWeights| l.w2.clone(),
            |l: &LayerWeights| l.w3.clone(),
        ] {
            for l in &self.layers {
                put(&f(l));
            }
        }
        put(&self.rms_final);
        put(&vec![0.0; seq_len * c.head_size()]);
        if let Some(w) = &self.wcls {
            put(w);
        }
        std::fs::write(path, out)
    }

    /// The output projection `[vocab × dim]`.
    pub fn classifier(&self) -> &[f32] {
        self.wcls.as_deref().unwrap_or(&self.embed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_advertised_sizes() {
        let tiny = ModelConfig::tiny();
        assert!((15_000_000..15_500_000).contains(&tiny.num_params()), "{}", tiny.num_params());
        assert_eq!(tiny.kv_bytes_per_token(), 13_824);
        let micro = ModelConfig::micro();
        assert_eq!(micro.kv_dim(), 32);
    }

    #[test]
    fn dummy_weights_are_seeded() {
        let cfg = ModelConfig::micro();
        let a = Weights::dummy(&cfg, 1).expect("valid");
        let b = Weights::dummy(&cfg, 1).expect("valid");
        let c = Weights::dummy(&cfg, 2).expect("valid");
        assert_eq!(a.layers[1].w2, b.layers[1].w2);
        assert_ne!(a.layers[1].w2, c.layers[1].w2);
        assert_eq!(a.embed.len(), cfg.vocab_size * cfg.dim);
    }

    #[test]
    fn llama2c_checkpoints_round_trip() {
        let mut cfg = ModelConfig::micro();
        cfg.vocab_size = 300;
        let mut w = Weights::dummy(&cfg, 5).expect("valid");
        w.wcls = Some(vec![0.5; 300 * cfg.dim]);
        let dir = std::env::temp_dir().join(format!("wp-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("m.bin");
        w.save_llama2c(&path, 64).expect("write");
        let r = Weights::load_llama2c(&path).expect("read");
        assert_eq!(r.cfg, cfg);
        assert_eq!(r.layers[1].w3, w.layers[1].w3);
        assert_eq!(r.wcls, w.wcls);
        std::fs::write(&path, &std::fs::read(&path).expect("read")[..1000]).expect("write");
        assert!(matches!(Weights::load_llama2c(&path), Err(ModelError::Truncated(_))));
        let _ = std::fs::remove_dir_all(dir);
    }
}
