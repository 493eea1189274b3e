//! The `guard_model` check: a Llama-Guard-style classifier served by one of the policy's own
//! pools. The conversation is rendered into the guard prompt — Llama Guard 3's by default, or
//! a template file with `{role}`, `{categories}` and `{conversation}` — and sent as a completion
//! to that pool; the answer's first line is `safe` or `unsafe`, the second the violated
//! categories (`S1,S10`).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;

use super::check::{Judge, Subject, Turn};
use crate::config::{GuardConfig, Stage};

/// Completes a prompt on a pool: how the guard reaches its model (the pipeline implements it,
/// so the call is routed, balanced and retried like any request of that pool).
#[async_trait]
pub trait Complete: Send + Sync {
    async fn complete(&self, model: &str, prompt: String, max_tokens: u32) -> Result<String, String>;
}

/// Llama Guard 3's prompt (Meta's model card), without the beginning-of-text token the server
/// adds itself.
pub const LLAMA_GUARD_3: &str = "<|start_header_id|>user<|end_header_id|>\n\n\
Task: Check if there is unsafe content in '{role}' messages in conversations according our safety policy with the below categories.\n\n\
<BEGIN UNSAFE CONTENT CATEGORIES>\n{categories}<END UNSAFE CONTENT CATEGORIES>\n\n\
<BEGIN CONVERSATION>\n\n{conversation}<END CONVERSATION>\n\n\
Provide your safety assessment for ONLY THE LAST {role} message in the above conversation:\n \
- First line must read 'safe' or 'unsafe'.\n \
- If unsafe, a second line must include a comma-separated list of violated categories.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";

/// Llama Guard 3's hazard categories (MLCommons' taxonomy).
pub const LLAMA_GUARD_3_CATEGORIES: [(&str, &str); 14] = [
    ("S1", "Violent Crimes."),
    ("S2", "Non-Violent Crimes."),
    ("S3", "Sex Crimes."),
    ("S4", "Child Exploitation."),
    ("S5", "Defamation."),
    ("S6", "Specialized Advice."),
    ("S7", "Privacy."),
    ("S8", "Intellectual Property."),
    ("S9", "Indiscriminate Weapons."),
    ("S10", "Hate."),
    ("S11", "Self-Harm."),
    ("S12", "Sexual Content."),
    ("S13", "Elections."),
    ("S14", "Code Interpreter Abuse."),
];

pub struct Guard {
    pool: Arc<dyn Complete>,
    model: String,
    template: String,
    categories: String,
    /// Categories that block; empty: all.
    block: Vec<String>,
    history: usize,
}

impl Guard {
    /// `template` is the template file's text where the policy names one.
    pub fn new(c: &GuardConfig, template: Option<String>, pool: Arc<dyn Complete>) -> Guard {
        let cats: BTreeMap<&str, &str> = if c.categories.is_empty() {
            LLAMA_GUARD_3_CATEGORIES.into_iter().collect()
        } else {
            c.categories.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
        };
        // S1..S14 in numeric order, not S1, S10, S11, …
        let mut listed: Vec<(&str, &str)> = cats.into_iter().collect();
        listed.sort_by_key(|(k, _)| {
            (k.trim_start_matches(|c: char| !c.is_ascii_digit()).parse::<u32>().ok(), *k)
        });
        let categories = listed.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
        Guard {
            pool,
            model: c.model.clone(),
            template: template.unwrap_or_else(|| LLAMA_GUARD_3.to_owned()),
            categories,
            block: c.block.clone(),
            history: c.history_messages,
        }
    }

    /// The guard prompt for `subject` on `stage`: the last `history` turns of context, then the
    /// judged ones; `User` and `Agent` as Llama Guard names them.
    pub fn prompt(&self, stage: Stage, subject: &Subject) -> String {
        let role = match stage {
            Stage::Input => "User",
            Stage::Output => "Agent",
        };
        let context = &subject.context[subject.context.len().saturating_sub(self.history)..];
        let mut conversation = String::new();
        for t in context.iter().chain(&subject.judged).filter(|t| t.role != "system") {
            let who = if matches!(t.role.as_str(), "assistant") { "Agent" } else { "User" };
            conversation.push_str(&format!("{who}: {}\n\n", t.text));
        }
        self.template
            .replace("{categories}", &self.categories)
            .replace("{conversation}", &conversation)
            .replace("{role}", role)
    }
}

#[async_trait]
impl Judge for Guard {
    async fn judge(&self, stage: Stage, subject: &Subject) -> Result<Vec<String>, String> {
        if subject.judged.iter().all(|t: &Turn| t.text.trim().is_empty()) {
            return Ok(Vec::new());
        }
        let answer = self.pool.complete(&self.model, self.prompt(stage, subject), 16).await?;
        let unsafe_cats = parse(&answer)?;
        Ok(unsafe_cats.into_iter().filter(|c| self.block.is_empty() || self.block.contains(c)).collect())
    }
}

/// A guard answer: `safe` → no categories; `unsafe` → those on the next line (`unsafe` alone:
/// one category, `unsafe`). Anything else is an error.
pub fn parse(answer: &str) -> Result<Vec<String>, String> {
    let mut lines = answer.trim().lines().map(str::trim).filter(|l| !l.is_empty());
    match lines.next().map(str::to_ascii_lowercase).as_deref() {
        Some("safe") => Ok(Vec::new()),
        Some("unsafe") => {
            let cats: Vec<String> = lines
                .next()
                .map(|l| l.split(',').map(|c| c.trim().to_owned()).filter(|c| !c.is_empty()).collect())
                .unwrap_or_default();
            Ok(if cats.is_empty() { vec!["unsafe".to_owned()] } else { cats })
        }
        _ => Err(format!(
            "the guard model answered neither safe nor unsafe: {:?}",
            answer.chars().take(80).collect::<String>()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse() {
        assert_eq!(parse("safe").expect("ok"), Vec::<String>::new());
        assert_eq!(parse("\n\nsafe\n").expect("ok"), Vec::<String>::new());
        assert_eq!(parse("unsafe\nS1,S10").expect("ok"), ["S1", "S10"]);
        assert_eq!(parse("unsafe\n S9 ").expect("ok"), ["S9"]);
        assert_eq!(parse("unsafe").expect("ok"), ["unsafe"]);
        assert!(parse("I think this is fine").is_err());
        assert!(parse("").is_err());
    }

    struct Never;
    #[async_trait]
    impl Complete for Never {
        async fn complete(&self, _: &str, _: String, _: u32) -> Result<String, String> {
            Err("unused".into())
        }
    }

    #[test]
    fn the_prompt_is_llama_guard_3s() {
        let c: GuardConfig =
            toml::from_str("pool = \"g\"\nmodel = \"llama-guard-3\"\nhistory_messages = 1").expect("parses");
        let g = Guard::new(&c, None, Arc::new(Never));
        let turn = |r: &str, t: &str| Turn { role: r.into(), text: t.into() };
        let subject = Subject {
            context: Arc::new(vec![
                turn("system", "be nice"),
                turn("user", "old"),
                turn("assistant", "older answer"),
            ]),
            judged: vec![turn("user", "how do I make a bomb?")],
        };
        let p = g.prompt(Stage::Input, &subject);
        assert!(p.starts_with("<|start_header_id|>user<|end_header_id|>\n\nTask: Check if there is unsafe content in 'User' messages"), "{p}");
        assert!(
            p.contains("<BEGIN UNSAFE CONTENT CATEGORIES>\nS1: Violent Crimes.\nS2: Non-Violent Crimes.\n"),
            "{p}"
        );
        assert!(p.contains("S9: Indiscriminate Weapons.\nS10: Hate.\n"), "numeric order: {p}");
        assert!(p.contains("<BEGIN CONVERSATION>\n\nAgent: older answer\n\nUser: how do I make a bomb?\n\n<END CONVERSATION>"), "one turn of history: {p}");
        assert!(p.ends_with("categories.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"));
        assert!(g.prompt(Stage::Output, &subject).contains("ONLY THE LAST Agent message"));
    }
}
