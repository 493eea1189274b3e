//! A model's chat format: its tokenizer, the template its chat prompts are rendered with, and the
//! tokens that end its turns. The bundled engine and the proxy both render and tokenize through
//! it, so that the prefix blocks the proxy routes on are the engine's own.
//!
//! Two templates: the built-in ChatML with Hermes tools (`wp32k`, the dummy presets; template
//! text and content are tokenized apart, so content cannot forge a turn), or the model's own
//! Jinja template (`tokenizer.chat_template` of a GGUF file, rendered as transformers and vLLM
//! render it, the prompt then tokenized with its special tokens).

use std::sync::Arc;

use super::jinja::{self, JinjaTemplate, TemplateValue};
use super::render_tokens;
use crate::gguf::Gguf;
use crate::openai::{ChatMessage, Tool};
use crate::tokenizer::{Tokenizer, EOS, IM_END};

/// How chat prompts are rendered.
#[derive(Debug, Clone)]
pub enum Template {
    /// The built-in ChatML layout with Hermes tool blocks.
    Builtin,
    Jinja(Arc<JinjaTemplate>),
}

#[derive(Debug, Clone)]
pub struct ChatFormat {
    pub tokenizer: Tokenizer,
    pub template: Template,
    /// Tokens that end generation: end of text, end of turn.
    pub stop_ids: Vec<u32>,
    /// Prepended to a raw completion prompt (where the model asks for it).
    pub bos: Option<u32>,
}

impl ChatFormat {
    /// The built-in tokenizer and template.
    pub fn builtin() -> ChatFormat {
        let tokenizer = Tokenizer::wp32k();
        let stop_ids = [EOS, IM_END].iter().filter_map(|s| tokenizer.special_id(s)).collect();
        ChatFormat { tokenizer, template: Template::Builtin, stop_ids, bos: None }
    }

    /// The tokenizer, chat template and end tokens a GGUF file's metadata carries.
    pub fn from_gguf(name: &str, g: &Gguf) -> Result<ChatFormat, String> {
        let tokenizer = Tokenizer::from_gguf(name, g).map_err(|e| e.to_string())?;
        let token = |key: &str| g.get(key).and_then(|v| v.as_u64()).map(|id| id as u32);
        let text = |id: Option<u32>| {
            id.and_then(|id| tokenizer.decode_bytes(&[id]).ok())
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default()
        };
        let template = match g.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
            Some(src) => {
                let bos = text(token("tokenizer.ggml.bos_token_id"));
                let eos = text(token("tokenizer.ggml.eos_token_id"));
                let t =
                    JinjaTemplate::new(src.to_owned(), bos, eos, format!("{name}: tokenizer.chat_template"))?;
                Template::Jinja(Arc::new(t))
            }
            None => return Err(format!("{name}: no tokenizer.chat_template")),
        };
        let mut stop_ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| token(k))
            .collect();
        stop_ids.dedup();
        if stop_ids.is_empty() {
            return Err(format!("{name}: no tokenizer.ggml.eos_token_id"));
        }
        let add_bos = g.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        let bos = token("tokenizer.ggml.bos_token_id").filter(|_| add_bos);
        Ok(ChatFormat { tokenizer, template, stop_ids, bos })
    }

    /// A chat prompt's token ids.
    pub fn render_tokens(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, String> {
        Ok(match &self.template {
            Template::Builtin => render_tokens(&self.tokenizer, messages, tools, add_generation_prompt),
            Template::Jinja(t) => {
                let text = self.render_jinja(t, messages, tools, add_generation_prompt)?;
                self.tokenizer.encode_with_special(&text)
            }
        })
    }

    /// A chat prompt's text.
    pub fn render_text(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        match &self.template {
            Template::Builtin => Ok(super::render_text(messages, tools, add_generation_prompt)),
            Template::Jinja(t) => self.render_jinja(t, messages, tools, add_generation_prompt),
        }
    }

    fn render_jinja(
        &self,
        t: &JinjaTemplate,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let values = |v: serde_json::Value| -> Result<Vec<TemplateValue>, String> {
            let text = v.to_string();
            let parsed = jinja::parse(&text).ok_or("a message that is not JSON")?;
            Ok(parsed.try_iter().map_err(|e| e.to_string())?.collect())
        };
        let msgs = values(serde_json::to_value(messages).map_err(|e| e.to_string())?)?;
        let tools = (!tools.is_empty())
            .then(|| values(serde_json::to_value(tools).unwrap_or_default()))
            .transpose()?;
        t.render(&msgs, tools.as_deref(), add_generation_prompt, None)
    }

    /// A raw completion prompt's token ids. Special-token strings in it are the special tokens,
    /// as vLLM (Hugging Face tokenizers split on added tokens) and llama.cpp's server
    /// (`parse_special`) read a completion prompt: a prompt rendered from a chat template by the
    /// client (a guard model's classifier prompt) reaches the model as the template meant it.
    pub fn prompt_ids(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        ids.extend(self.bos);
        ids.extend(self.tokenizer.encode_with_special(text));
        ids
    }

    /// Whether templates render token by token exactly as the proxy's turn-by-turn rendering
    /// assumes (the built-in layout).
    pub fn is_builtin(&self) -> bool {
        matches!(self.template, Template::Builtin)
    }
}
