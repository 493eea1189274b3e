//! Llama-architecture models from GGUF files (SmolLM2, Llama 2 and 3, Mistral, TinyLlama…): the
//! shape from `llama.*` metadata, each weight matrix kept in its file format where it lies in the
//! mapped file, the norms read as f32, and the chat format (tokenizer, template, end tokens)
//! from `tokenizer.*`. What is not a llama model this engine can run is refused with the reason.

use std::path::Path;
use std::sync::Arc;

use warmpath_wire::chat_template::ChatFormat;
use warmpath_wire::gguf::{GgmlType, Gguf};

use super::{LayerWeights, Matrix, ModelConfig, ModelError, Weights};
use crate::quant::{self, QuantMatrix, Storage};

/// A model loaded from a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufModel {
    pub weights: Weights,
    pub format: ChatFormat,
    /// `general.name`, or the file's stem.
    pub name: String,
    /// The context the model was trained for (`llama.context_length`).
    pub context_length: usize,
}

impl GgufModel {
    pub fn load(path: &Path) -> Result<GgufModel, ModelError> {
        let p = path.display().to_string();
        let err = |message: String| ModelError::Gguf { path: p.clone(), message };
        let g = Arc::new(Gguf::open(path).map_err(|e| err(e.to_string()))?);
        let arch = g.architecture().map_err(|e| err(e.to_string()))?;
        if arch != "llama" {
            return Err(err(format!("architecture {arch:?} is not supported (llama is)")));
        }
        let key = |k: &str| format!("llama.{k}");
        let u = |k: &str| g.u64(&key(k)).map(|v| v as usize).map_err(|e| err(e.to_string()));
        let f = |k: &str, default: f32| g.get(&key(k)).and_then(|v| v.as_f32()).unwrap_or(default);
        let (emb, _) = g
            .tensor_info("token_embd.weight")
            .map(|t| (t.clone(), ()))
            .ok_or_else(|| err("tensor token_embd.weight is missing".into()))?;
        let n_heads = u("attention.head_count")?;
        let cfg = ModelConfig {
            dim: u("embedding_length")?,
            hidden_dim: u("feed_forward_length")?,
            n_layers: u("block_count")?,
            n_heads,
            n_kv_heads: g
                .get(&key("attention.head_count_kv"))
                .and_then(|v| v.as_u64())
                .map_or(n_heads, |v| v as usize),
            vocab_size: emb.dims.get(1).copied().unwrap_or(0) as usize,
            rope_theta: f("rope.freq_base", 10_000.0),
            rope_freq_scale: rope_freq_scale(&g).map_err(err)?,
            norm_eps: f("attention.layer_norm_rms_epsilon", 1e-5),
        };
        cfg.validate()?;
        if let Some(n) = g.get(&key("rope.dimension_count")).and_then(|v| v.as_u64()) {
            if n as usize != cfg.head_size() {
                return Err(err(format!(
                    "partial RoPE ({n} of {} dimensions) is not supported",
                    cfg.head_size()
                )));
            }
        }
        let loader = Loader { g: &g, path: &p };
        let (d, h, kv) = (cfg.dim, cfg.hidden_dim, cfg.kv_dim());
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let t = |name: &str| format!("blk.{i}.{name}.weight");
            layers.push(LayerWeights {
                rms_att: loader.vector(&t("attn_norm"), d)?,
                wq: loader.matrix(&t("attn_q"), d, d)?,
                wk: loader.matrix(&t("attn_k"), kv, d)?,
                wv: loader.matrix(&t("attn_v"), kv, d)?,
                wo: loader.matrix(&t("attn_output"), d, d)?,
                rms_ffn: loader.vector(&t("ffn_norm"), d)?,
                w1: loader.matrix(&t("ffn_gate"), h, d)?,
                w2: loader.matrix(&t("ffn_down"), d, h)?,
                w3: loader.matrix(&t("ffn_up"), h, d)?,
            });
        }
        let embed = loader.matrix("token_embd.weight", cfg.vocab_size, d)?;
        let wcls = match g.tensor_info("output.weight") {
            Some(_) => Some(loader.matrix("output.weight", cfg.vocab_size, d)?),
            None => None,
        };
        let rms_final = loader.vector("output_norm.weight", d)?;
        let name = g.get("general.name").and_then(|v| v.as_str()).map(str::to_owned).unwrap_or_else(|| {
            path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
        });
        let format = ChatFormat::from_gguf(&name, &g).map_err(err)?;
        if format.tokenizer.vocab_size() > cfg.vocab_size {
            return Err(err(format!(
                "the tokenizer has {} ids, the embedding {}",
                format.tokenizer.vocab_size(),
                cfg.vocab_size
            )));
        }
        let context_length = u("context_length").unwrap_or(4096);
        let weights = Weights { cfg, embed, layers, rms_final, wcls };
        Ok(GgufModel { weights, format, name, context_length })
    }
}

/// Positions' scale for RoPE: `1 / factor` with linear rope scaling, 1 without.
fn rope_freq_scale(g: &Gguf) -> Result<f32, String> {
    let factor = |k: &str| g.get(k).and_then(|v| v.as_f32());
    match g.get("llama.rope.scaling.type").and_then(|v| v.as_str()) {
        None | Some("none") => Ok(factor("llama.rope.scale_linear").map_or(1.0, |s| 1.0 / s)),
        Some("linear") => Ok(1.0 / factor("llama.rope.scaling.factor").unwrap_or(1.0)),
        Some(other) => Err(format!("rope scaling {other:?} is not supported (linear is)")),
    }
}

/// Reads tensors out of the file, checking names, shapes and types.
struct Loader<'a> {
    g: &'a Arc<Gguf>,
    path: &'a str,
}

impl Loader<'_> {
    fn err(&self, message: String) -> ModelError {
        ModelError::Gguf { path: self.path.to_owned(), message }
    }

    /// A `[rows × cols]` weight, kept in the file.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let (info, range) =
            self.g.tensor_range(name).ok_or_else(|| self.err(format!("tensor {name} is missing")))?;
        if info.dims != [cols as u64, rows as u64] {
            return Err(self.err(format!("tensor {name} is {:?}, not [{cols}, {rows}]", info.dims)));
        }
        QuantMatrix::new(info.ty, rows, cols, Storage::Mapped(self.g.clone(), range))
            .map(Matrix::Quant)
            .map_err(|e| self.err(format!("tensor {name}: {e}")))
    }

    /// A norm's weights, as f32.
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let (info, data) =
            self.g.tensor(name).ok_or_else(|| self.err(format!("tensor {name} is missing")))?;
        if info.dims != [n as u64] {
            return Err(self.err(format!("tensor {name} is {:?}, not [{n}]", info.dims)));
        }
        if !matches!(info.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(self.err(format!("tensor {name}: a norm in {:?}", info.ty)));
        }
        let mut out = vec![0.0; n];
        quant::dequantize_row(info.ty, data, &mut out);
        Ok(out)
    }
}
