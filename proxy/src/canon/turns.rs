//! Responses turns as token ids, for pools whose backends render prompts exactly as warmpath
//! does (the bundled engine's tokenizer and chat template): the prompt is the system turn
//! (instructions with volatile lines moved out, canonical tools), the conversation's token ids
//! as stored, the new messages' ids, the note of moved lines and the generation prompt. Only
//! the new messages are rendered and tokenized; the rest is copied.

use warmpath_wire::chat_template::PromptBuilder;
use warmpath_wire::openai::ApiError;

use super::chat::render_message;
use super::{Canon, Edits};
use crate::request::MessageView;
use crate::tools::search::SearchPlan;
use crate::tools::Api;

/// A turn's prompt around its conversation: the system turn before it, the note and the
/// generation prompt after it.
#[derive(Debug)]
pub struct TokenPrompt {
    pub system: Vec<u32>,
    pub tail: Vec<u32>,
    /// Set when tools were deferred: how to answer the model's `tool_search` calls.
    pub search: Option<SearchPlan>,
}

impl TokenPrompt {
    /// The whole prompt over `conversation`.
    pub fn ids(&self, conversation: &[u32]) -> Vec<u32> {
        let mut ids = Vec::with_capacity(self.system.len() + conversation.len() + self.tail.len());
        ids.extend_from_slice(&self.system);
        ids.extend_from_slice(conversation);
        ids.extend_from_slice(&self.tail);
        ids
    }
}

impl Canon {
    /// Whether this pool's prompts can be sent as token ids: the tokenizer and template are
    /// the bundled engine's.
    pub fn token_turns(&self) -> bool {
        self.exact_ids && self.template.is_none()
    }

    /// Token ids of chat messages (JSON texts) as the template renders them, turn after turn.
    pub fn message_ids(&self, messages: &[String]) -> Result<Vec<u32>, ApiError> {
        let mut b = PromptBuilder::default();
        for (i, m) in messages.iter().enumerate() {
            let view: MessageView<'_> = serde_json::from_str(m)
                .map_err(|e| ApiError::invalid_request(format!("message {i}: {e}")))?;
            render_message(&mut b, &view);
        }
        self.encoder.ids(&b.finish()).ok_or_else(|| ApiError::internal("no tokenizer for token ids"))
    }

    /// The prompt of a turn around its conversation: the system turn from `instructions` and
    /// `tools` (Chat Completions form, JSON text; deferred behind `tool_search` as the pool's
    /// `[pools.tools]` says), then the note of the instructions' volatile lines and the
    /// generation prompt.
    pub fn token_prompt(
        &self,
        instructions: Option<&str>,
        tools: &[String],
    ) -> Result<TokenPrompt, ApiError> {
        let mut list = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let c = self
                .tools
                .get(t)
                .map_err(|e| ApiError::invalid_request(format!("tools[{i}]: {e}")).with_param("tools"))?;
            list.push(c);
        }
        if self.rewrite && self.sort_tools {
            list.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.json.cmp(&b.json)));
        }
        let mut search = None;
        if let Some(d) = self.defer.as_ref().filter(|_| self.rewrite) {
            if let Some(plan) = d.plan(&list, None, Api::Chat, &|t| self.count_tokens(t)) {
                list = plan.kept;
                search = Some(SearchPlan {
                    set: plan.set,
                    limit: d.limit,
                    max_rounds: d.max_rounds,
                    messages_end: 0,
                    form: Api::Chat,
                    native: false,
                });
            }
        }
        let moved = self.split_system(instructions, &mut Edits::default());
        let system = match &moved {
            Some(m) => Some(m.kept.as_str()),
            None => instructions,
        };
        let mut head = PromptBuilder::default();
        if system.is_some() || !list.is_empty() {
            head.system_turn(system, list.iter().map(|t| t.line.as_str()));
        }
        let system = self.encoder.ids(&head.finish()).ok_or_else(|| ApiError::internal("no tokenizer"))?;
        let mut tail = PromptBuilder::default();
        if let Some(m) = &moved {
            tail.turn(self.note_role, &m.lines.join("\n"), []);
        }
        tail.generation_prompt();
        let tail = self.encoder.ids(&tail.finish()).unwrap_or_default();
        Ok(TokenPrompt { system, tail, search })
    }
}

#[cfg(test)]
mod tests {
    use warmpath_wire::chat_template::render_tokens;
    use warmpath_wire::openai::{ChatMessage, Tool};
    use warmpath_wire::tokenizer::Tokenizer;

    use crate::config::{CanonConfig, TokenizerKind, ToolsConfig};

    use super::*;

    fn canon() -> Canon {
        let cfg = CanonConfig { enabled: true, tokenizer: TokenizerKind::Wp32k, ..CanonConfig::default() };
        Canon::new(&cfg, &ToolsConfig::default(), true, None)
    }

    /// The prompt built from stored ids equals the engine's rendering of the same chat request.
    #[test]
    fn stored_ids_plus_new_messages_are_what_the_engine_renders() {
        let c = canon();
        assert!(c.token_turns());
        let tool = r#"{"type":"function","function":{"parameters":{"properties":{"city":{"type":"string"}},"type":"object"},"name":"get_weather","description":"Weather."}}"#;
        let tools = vec![tool.to_owned()];
        let first = [r#"{"role":"user","content":"Weather in Oslo?"}"#.to_owned()];
        let output = [r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}]}"#.to_owned()];
        let next = [r#"{"role":"tool","tool_call_id":"c1","content":"sunny"}"#.to_owned()];
        let mut conversation = c.message_ids(&first).expect("ids");
        conversation.extend(c.message_ids(&output).expect("ids"));
        conversation.extend(c.message_ids(&next).expect("ids"));
        let p = c.token_prompt(Some("You are a weather agent."), &tools).expect("prompt");
        assert!(p.search.is_none());

        let msgs: Vec<ChatMessage> = serde_json::from_str(&format!(
            r#"[{{"role":"system","content":"You are a weather agent."}},{},{},{}]"#,
            first[0], output[0], next[0]
        ))
        .expect("messages");
        let chat_tools: Vec<Tool> = serde_json::from_str(r#"[{"type":"function","function":{"name":"get_weather","description":"Weather.","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#).expect("tools");
        let want = render_tokens(&Tokenizer::wp32k(), &msgs, &chat_tools, true);
        assert_eq!(p.ids(&conversation), want);
    }
}
