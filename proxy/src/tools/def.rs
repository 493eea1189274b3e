//! Tool definitions in canonical form, cached by their raw bytes: an agent sends the same
//! hundred schemas every turn, so each is parsed and re-serialized once, not once per request.

use std::sync::Arc;

use moka::sync::Cache;
use serde_json::Value;
use warmpath_wire::chat_template::tool_line;
use warmpath_wire::openai::Tool;
use xxhash_rust::xxh3::xxh3_128;

/// One tool, canonical.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonTool {
    /// The function's name (`function.name` in Chat Completions, `name` in the Responses API);
    /// for a tool without one (`{"type": "web_search"}`), its type.
    pub name: String,
    /// Keys sorted at every depth, compact.
    pub json: String,
    /// Its line in the bundled chat template's tool block.
    pub line: String,
    /// The description (empty when none).
    pub description: String,
    /// Parameter names and their descriptions, for search.
    pub params: Vec<String>,
    /// Responses API: the client asked for it to be deferred (`defer_loading: true`).
    pub defer_loading: bool,
    /// Responses API: the hosted `{"type": "tool_search"}` tool.
    pub hosted_search: bool,
}

impl CanonTool {
    pub fn parse(raw: &str) -> Result<CanonTool, String> {
        let v: Value = serde_json::from_str(raw).map_err(|e| e.to_string())?;
        if !v.is_object() {
            return Err("a tool must be an object".to_owned());
        }
        let name = v
            .pointer("/function/name")
            .or_else(|| v.get("name"))
            .or_else(|| v.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let line = match serde_json::from_value::<Tool>(v.clone()) {
            Ok(t) => tool_line(&t),
            Err(_) => v.to_string(),
        };
        let f = v.get("function").unwrap_or(&v);
        let description = f.get("description").and_then(Value::as_str).unwrap_or("").to_owned();
        let mut params = Vec::new();
        if let Some(props) = f.pointer("/parameters/properties").and_then(Value::as_object) {
            for (k, p) in props {
                params.push(k.clone());
                if let Some(d) = p.get("description").and_then(Value::as_str) {
                    params.push(d.to_owned());
                }
            }
        }
        let defer_loading =
            f.get("defer_loading").or_else(|| v.get("defer_loading")) == Some(&Value::Bool(true));
        let hosted_search =
            v.get("type").and_then(Value::as_str) == Some("tool_search") && v.get("name").is_none();
        Ok(CanonTool { name, json: v.to_string(), line, description, params, defer_loading, hosted_search })
    }
}

/// Canonical tools by the xxh3-128 of their raw bytes, bounded in bytes.
#[derive(Debug, Clone)]
pub struct ToolCache {
    cache: Cache<u128, Arc<CanonTool>>,
}

impl ToolCache {
    pub fn new(max_bytes: u64) -> ToolCache {
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_, t: &Arc<CanonTool>| {
                let params: usize = t.params.iter().map(|p| p.len() + 24).sum();
                (t.json.len() + t.line.len() + t.name.len() + t.description.len() + params + 128) as u32
            })
            .build();
        ToolCache { cache }
    }

    pub fn get(&self, raw: &str) -> Result<Arc<CanonTool>, String> {
        let key = xxh3_128(raw.as_bytes());
        if let Some(t) = self.cache.get(&key) {
            return Ok(t);
        }
        let t = Arc::new(CanonTool::parse(raw)?);
        self.cache.insert(key, t.clone());
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_and_responses_tools_have_names_and_sorted_json() {
        let chat = CanonTool::parse(
            r#"{"type":"function","function":{"parameters":{"type":"object","properties":{"b":{},"a":{}}},"name":"ls","description":"list"}}"#,
        )
        .expect("tool");
        assert_eq!(chat.name, "ls");
        assert_eq!(
            chat.json,
            r#"{"function":{"description":"list","name":"ls","parameters":{"properties":{"a":{},"b":{}},"type":"object"}},"type":"function"}"#
        );
        assert_eq!(chat.line, chat.json, "the template renders the canonical form");
        let resp = CanonTool::parse(r#"{"type":"function","name":"grep","parameters":{}}"#).expect("tool");
        assert_eq!(resp.name, "grep");
        assert_eq!(CanonTool::parse(r#"{"type":"web_search"}"#).expect("tool").name, "web_search");
        assert!(CanonTool::parse("[1]").is_err());
    }

    #[test]
    fn the_cache_returns_the_same_tool() {
        let c = ToolCache::new(1 << 20);
        let a = c.get(r#"{"type":"function","function":{"name":"x"}}"#).expect("tool");
        let b = c.get(r#"{"type":"function","function":{"name":"x"}}"#).expect("tool");
        assert!(Arc::ptr_eq(&a, &b));
    }
}
