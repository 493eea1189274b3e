//! Tool calls in generated text, in the Hermes form the chat template renders them:
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. A model that learned the
//! template writes them this way; like vLLM's `hermes` parser, the engine turns them into
//! `tool_calls` (whole calls, in order) and leaves the rest as content. A block that does not
//! hold a valid call stays content. The proxy reads completions it asked for with token-id
//! prompts the same way.

use crate::openai::{FunctionCall, ToolCall};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A piece of parsed output.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    Text(String),
    Call(ToolCall),
}

/// Parses output as it streams in; holds back text that may be the start of a call.
#[derive(Debug)]
pub struct CallParser {
    buf: String,
    in_call: bool,
    calls: usize,
    id_prefix: String,
}

impl CallParser {
    /// `id_prefix` makes call ids unique per response (`call_{prefix}_{n}`).
    pub fn new(id_prefix: &str) -> CallParser {
        CallParser { buf: String::new(), in_call: false, calls: 0, id_prefix: id_prefix.to_owned() }
    }

    /// Calls parsed so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Parsed> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CLOSE) else { break };
                let body = self.buf[..end].to_owned();
                self.buf.drain(..end + CLOSE.len());
                self.in_call = false;
                match self.call(&body) {
                    Some(c) => out.push(Parsed::Call(c)),
                    None => out.push(Parsed::Text(format!("{OPEN}{body}{CLOSE}"))),
                }
            } else if let Some(start) = self.buf.find(OPEN) {
                if start > 0 {
                    out.push(Parsed::Text(self.buf[..start].to_owned()));
                }
                self.buf.drain(..start + OPEN.len());
                self.in_call = true;
            } else {
                // Keep back the longest tail that could begin `<tool_call>`.
                let keep = (1..OPEN.len().min(self.buf.len() + 1))
                    .rev()
                    .find(|&k| {
                        self.buf.is_char_boundary(self.buf.len() - k)
                            && OPEN.starts_with(&self.buf[self.buf.len() - k..])
                    })
                    .unwrap_or(0);
                let send = self.buf.len() - keep;
                if send > 0 {
                    out.push(Parsed::Text(self.buf[..send].to_owned()));
                    self.buf.drain(..send);
                }
                break;
            }
        }
        out
    }

    /// The end of the output: whatever is held back is text.
    pub fn finish(&mut self) -> Vec<Parsed> {
        let rest = std::mem::take(&mut self.buf);
        let text = if std::mem::replace(&mut self.in_call, false) { format!("{OPEN}{rest}") } else { rest };
        if text.is_empty() {
            Vec::new()
        } else {
            vec![Parsed::Text(text)]
        }
    }

    fn call(&mut self, body: &str) -> Option<ToolCall> {
        let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_owned();
        let arguments = match v.get("arguments") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(a) => a.to_string(),
            None => "{}".to_owned(),
        };
        let id = format!("call_{}_{}", self.id_prefix, self.calls);
        self.calls += 1;
        Some(ToolCall { id, kind: "function".into(), function: FunctionCall { name, arguments } })
    }
}

/// A whole output: its content (`None` when only calls remain) and its calls.
pub fn parse(text: &str, id_prefix: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut p = CallParser::new(id_prefix);
    let mut outs = p.push(text);
    outs.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for o in outs {
        match o {
            Parsed::Text(t) => content.push_str(&t),
            Parsed::Call(c) => calls.push(c),
        }
    }
    let content = if calls.is_empty() {
        Some(content)
    } else {
        Some(content.trim().to_owned()).filter(|c| !c.is_empty())
    };
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_calls_are_parsed_and_the_rest_is_content() {
        let text =
            "Let me look.\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {\"path\": \"/\"}}\n</tool_call>";
        let (content, calls) = parse(text, "x");
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].function.name, "ls");
        assert_eq!(calls[0].function.arguments, r#"{"path":"/"}"#);
        assert_eq!(calls[0].id, "call_x_0");
        let (content, calls) = parse("<tool_call>not json</tool_call> ok", "x");
        assert_eq!((content.as_deref(), calls.len()), (Some("<tool_call>not json</tool_call> ok"), 0));
        assert_eq!(parse("plain <tool_c", "x"), (Some("plain <tool_c".to_owned()), vec![]));
    }

    #[test]
    fn streaming_holds_back_only_what_may_start_a_call() {
        let mut p = CallParser::new("s");
        let mut outs = Vec::new();
        for piece in
            ["Hi <", "tool", "_call>\n{\"name\":", " \"f\", \"arguments\": \"{}\"}\n</tool_", "call> bye <b"]
        {
            outs.extend(p.push(piece));
        }
        outs.extend(p.finish());
        let texts: Vec<&str> = outs
            .iter()
            .filter_map(|o| if let Parsed::Text(t) = o { Some(t.as_str()) } else { None })
            .collect();
        assert_eq!(texts.concat(), "Hi  bye <b");
        assert_eq!(p.calls(), 1);
        assert!(outs
            .iter()
            .any(|o| matches!(o, Parsed::Call(c) if c.function.name == "f" && c.function.arguments == "{}")));
    }
}
