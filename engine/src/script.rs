//! Test hook (`--script FILE`): scripted replies, so that a test of whatever sits in front of
//! the engine can make the model call a given tool or say a given thing. The file is a JSON
//! list of rules, `[{"when": "substring", "reply": "text"}, ...]`; a chat request whose
//! rendered prompt (or a completion whose text prompt) contains a rule's `when` gets its
//! `reply` as output tokens (the model still computes every step). Of several matching rules
//! the last one in the file wins, so specific rules go after general ones.

use std::path::Path;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub when: String,
    pub reply: String,
}

#[derive(Debug, Clone, Default)]
pub struct Script {
    rules: Vec<Rule>,
}

impl Script {
    pub fn load(path: &Path) -> Result<Script, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let rules: Vec<Rule> = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a list of rules: {e}", path.display()))?;
        Ok(Script { rules })
    }

    pub fn from_rules(rules: Vec<Rule>) -> Script {
        Script { rules }
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The reply for a prompt, if a rule matches.
    pub fn reply_for(&self, prompt: &str) -> Option<&str> {
        self.rules.iter().rev().find(|r| prompt.contains(&r.when)).map(|r| r.reply.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_matching_rule_wins() {
        let s = Script::from_rules(vec![
            Rule { when: String::new(), reply: "general".into() },
            Rule { when: "<tool_response".into(), reply: "after a tool".into() },
        ]);
        assert_eq!(s.reply_for("hello"), Some("general"));
        assert_eq!(s.reply_for("x <tool_response id=\"1\">"), Some("after a tool"));
        assert_eq!(Script::default().reply_for("x"), None);
    }
}
