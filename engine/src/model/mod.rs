//! Llama model shapes and weights: presets with seeded dummy weights (vLLM's
//! `--load-format dummy`), a llama2.c checkpoint (`llama2c`), or a GGUF file, its weights kept
//! quantized where they lie in the mapped file (`gguf`).

mod gguf;
mod llama2c;
mod matrix;

use crate::sampler::Rng;
pub use gguf::GgufModel;
pub use matrix::Matrix;

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
    /// Positions are multiplied by this before RoPE (linear rope scaling: 1 / factor).
    pub rope_freq_scale: f32,
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
            rope_freq_scale: 1.0,
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
            rope_freq_scale: 1.0,
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

    /// Bytes of K and V for one token across all layers (half precision).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.kv_dim() * 2
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
    #[error("{path}: {message}")]
    Gguf { path: String, message: String },
}

/// One transformer layer, matrices `[out × in]` row-major.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub rms_att: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub rms_ffn: Vec<f32>,
    pub w1: Matrix,
    pub w2: Matrix,
    pub w3: Matrix,
}

/// All weights of a model.
#[derive(Debug, Clone)]
pub struct Weights {
    pub cfg: ModelConfig,
    /// `[vocab × dim]`.
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub rms_final: Vec<f32>,
    /// The output projection when not shared with `embed`.
    pub wcls: Option<Matrix>,
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
        let embed = Matrix::f32(cfg.vocab_size, d, embed);
        let mut mat = |rows: usize, cols: usize| -> Matrix {
            let a = (3.0 / cols as f32).sqrt();
            Matrix::f32(rows, cols, (0..rows * cols).map(|_| (rng.next_f32() * 2.0 - 1.0) * a).collect())
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

    /// The output projection `[vocab × dim]`.
    pub fn classifier(&self) -> &Matrix {
        self.wcls.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of the weights as held (quantized where they are).
    pub fn bytes(&self) -> usize {
        let norms = self.cfg.dim * (2 * self.cfg.n_layers + 1) * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w1, &l.w2, &l.w3].iter().map(|m| m.bytes()).sum::<usize>()
            })
            .sum();
        norms + layers + self.embed.bytes() + self.wcls.as_ref().map_or(0, Matrix::bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_advertised_sizes() {
        let tiny = ModelConfig::tiny();
        assert!((15_000_000..15_500_000).contains(&tiny.num_params()), "{}", tiny.num_params());
        assert_eq!(tiny.kv_bytes_per_token(), 6_912);
        let micro = ModelConfig::micro();
        assert_eq!(micro.kv_dim(), 32);
    }

    #[test]
    fn dummy_weights_are_seeded() {
        let cfg = ModelConfig::micro();
        let a = Weights::dummy(&cfg, 1).expect("valid");
        let b = Weights::dummy(&cfg, 1).expect("valid");
        let c = Weights::dummy(&cfg, 2).expect("valid");
        assert_eq!(a.layers[1].w2.as_f32(), b.layers[1].w2.as_f32());
        assert_ne!(a.layers[1].w2.as_f32(), c.layers[1].w2.as_f32());
        assert_eq!((a.embed.rows(), a.embed.cols()), (cfg.vocab_size, cfg.dim));
    }
}
