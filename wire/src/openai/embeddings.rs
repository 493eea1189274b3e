//! Embeddings request.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `POST /v1/embeddings` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingRequest {
    pub model: String,
    /// A string, a list of strings, token ids, or lists of token ids.
    pub input: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding_format: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}
