//! An external model's tokenizer and chat template (`[pools.canon] tokenizer_file`,
//! `chat_template`): loaded from their files at start-up, and the prompt blocks they give.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use warmpath_wire::chat_template::jinja::{self, JinjaTemplate, TemplateValue};
use warmpath_wire::chat_template::{ChatFormat, Piece, Template};
use warmpath_wire::gguf::Gguf;
use warmpath_wire::prefix::Blocks;
use warmpath_wire::tokenizer::Tokenizer;

use super::{salt_of, Canon, Encoder, Lookups};
use crate::config::CanonConfig;
use crate::request::LlmRequest;

/// An external model's tokenizer and chat template.
#[derive(Debug, Clone)]
pub struct External {
    pub tokenizer: Tokenizer,
    /// `None`: the built-in ChatML layout.
    pub template: Option<Arc<JinjaTemplate>>,
}

impl External {
    /// Loads the files `cfg` names, relative to `dir`; `None` when it names none. An error names
    /// the key whose file does not load.
    pub fn load(cfg: &CanonConfig, dir: &Path) -> Result<Option<External>, (&'static str, String)> {
        let Some(file) = &cfg.tokenizer_file else { return Ok(None) };
        let file = dir.join(file);
        // A GGUF model file: its own tokenizer and chat template, as llama.cpp serves it.
        let (tokenizer, own_template) = if file.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            let e = Self::of_gguf(&file.display().to_string(), &file).map_err(|e| ("tokenizer_file", e))?;
            (e.tokenizer, Some(e.template))
        } else {
            let t = Tokenizer::from_file(&file)
                .map_err(|e| ("tokenizer_file", format!("{}: {e}", file.display())))?;
            (t, None)
        };
        let template = match (&cfg.chat_template, own_template) {
            (Some(t), _) => {
                Some(Arc::new(JinjaTemplate::load(&dir.join(t)).map_err(|e| ("chat_template", e))?))
            }
            (None, Some(own)) => own,
            (None, None) => match JinjaTemplate::beside(&file) {
                None => None,
                Some(t) => Some(Arc::new(JinjaTemplate::load(&t).map_err(|e| ("chat_template", e))?)),
            },
        };
        Ok(Some(External { tokenizer, template }))
    }

    /// The tokenizer and chat template of the GGUF model an embedded pool serves, as the
    /// bundled engine renders and tokenizes with them; `None` where `model` names no GGUF file.
    pub fn of_embedded(model: &str) -> Result<Option<External>, String> {
        let Some(path) = warmpath_wire::models::gguf_of(model) else { return Ok(None) };
        if !path.is_file() {
            return Err(format!("{} is not installed: scripts/ensure-deps installs it", path.display()));
        }
        Self::of_gguf(model, &path).map(Some)
    }

    /// The tokenizer and chat template a GGUF file carries (the built-in layout where it has no
    /// template).
    fn of_gguf(model: &str, path: &Path) -> Result<External, String> {
        let g = Gguf::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let f = ChatFormat::from_gguf(model, &g)?;
        let template = match f.template {
            Template::Jinja(t) => Some(t),
            Template::Builtin => None,
        };
        Ok(External { tokenizer: f.tokenizer, template })
    }
}

impl Canon {
    /// Blocks of the prompt an external chat template renders from `body` (the request's own
    /// when not rewriting); `None` when the template fails, which falls back to the built-in
    /// layout. The stable prefix is the render of the leading system message with the tools,
    /// cut back to where the tokenizer surely splits.
    pub(super) fn template_blocks(
        &self,
        t: &JinjaTemplate,
        body: Option<&[u8]>,
        req: &LlmRequest<'_>,
        n: &mut Lookups,
    ) -> Option<Blocks> {
        let Encoder::Tokens { tok, .. } = &self.encoder else { return None };
        #[derive(Deserialize)]
        struct Input {
            messages: Vec<TemplateValue>,
            tools: Option<Vec<TemplateValue>>,
            chat_template_kwargs: Option<TemplateValue>,
        }
        let input = match body {
            Some(b) => serde_json::from_slice::<Input>(b).ok()?,
            None => Input {
                messages: req.raw_messages().iter().filter_map(|r| jinja::parse(r.get())).collect(),
                tools: req.tools().map(|l| l.iter().filter_map(|r| jinja::parse(r.get())).collect()),
                chat_template_kwargs: req
                    .extra_raw("chat_template_kwargs")
                    .and_then(|r| jinja::parse(r.get())),
            },
        };
        let kwargs = input.chat_template_kwargs.as_ref();
        let tools = input.tools.as_deref();
        let full = t
            .render(&input.messages, tools, true, kwargs)
            .map_err(|e| tracing::debug!(template = %t.source, "chat template failed: {e}"))
            .ok()?;
        let lead = input.messages.first().filter(|m| {
            m.get_attr("role").ok().is_some_and(|r| matches!(r.as_str(), Some("system" | "developer")))
        });
        let stable = match lead {
            Some(m) => t.render(std::slice::from_ref(m), tools, false, kwargs).ok()?,
            None => String::new(),
        };
        let mut cut = full.bytes().zip(stable.bytes()).take_while(|(a, b)| a == b).count();
        while !tok.splits_at(&full, cut) {
            cut -= 1;
        }
        let (a, b) = full.split_at(cut);
        let salt = salt_of(req);
        Some(self.encoder.blocks_counted(
            &[Piece::Rendered(a.to_owned())],
            &[Piece::Rendered(b.to_owned())],
            salt.as_deref(),
            n,
        ))
    }
}
