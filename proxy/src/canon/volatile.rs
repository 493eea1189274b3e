//! Volatile lines: a timestamp or request id near the top of a system prompt changes every
//! request and so ends every prefix-cache hit right there. Lines that a rule matches move out of
//! the system prompt into a note placed after the last message, where the model still reads
//! them but the prefix before them stays byte-stable.

use regex::Regex;

use crate::config::{BuiltinRule, CanonConfig};

const MONTHS: &str = "(?:jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\\.?";

fn builtin_pattern(rule: BuiltinRule) -> String {
    match rule {
        BuiltinRule::Date => format!(
            "(?i)\\b\\d{{4}}-\\d{{2}}-\\d{{2}}(?:\\b|T)|\\b\\d{{1,2}}/\\d{{1,2}}/\\d{{2,4}}\\b\
             |\\b{MONTHS} \\d{{1,2}},? \\d{{4}}\\b|\\b\\d{{1,2}} {MONTHS},? \\d{{4}}\\b"
        ),
        BuiltinRule::Time => {
            "(?i)\\b\\d{1,2}:\\d{2}:\\d{2}\\b|\\b\\d{1,2}:\\d{2} ?[ap]\\.?m\\b|\\dT\\d{2}:\\d{2}\
                              |\\b1[5-9]\\d{8}(?:\\d{3})?\\b"
                .to_owned()
        }
        BuiltinRule::RequestId => "(?i)\\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\\b\
                                   |\\b(?:request|req|trace|run)[ _-]?id\\b\\s*[:=]"
            .to_owned(),
    }
}

fn builtin_name(rule: BuiltinRule) -> &'static str {
    match rule {
        BuiltinRule::Date => "date",
        BuiltinRule::Time => "time",
        BuiltinRule::RequestId => "request_id",
    }
}

/// The rules of one pool.
#[derive(Debug, Clone)]
pub struct Volatile {
    rules: Vec<(String, Regex)>,
    max_line: usize,
}

/// A system prompt with its volatile lines taken out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    /// The prompt without the moved lines (every other byte kept).
    pub kept: String,
    /// The moved lines, without their line ends, in order.
    pub lines: Vec<String>,
    /// Per moved line, the index of the rule that matched it first.
    pub rule_of: Vec<usize>,
}

impl Volatile {
    pub fn new(cfg: &CanonConfig) -> Volatile {
        let mut rules = Vec::new();
        for &b in &cfg.volatile {
            let re = Regex::new(&builtin_pattern(b)).expect("built-in patterns compile");
            rules.push((builtin_name(b).to_owned(), re));
        }
        for r in cfg.rules.iter().filter(|r| r.enabled) {
            rules.push((r.name.clone(), r.pattern.0.clone()));
        }
        Volatile { rules, max_line: cfg.max_moved_line_bytes }
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    pub fn rule_name(&self, i: usize) -> &str {
        &self.rules[i].0
    }

    /// `text` with every line that a rule matches (and that is at most the line limit long)
    /// taken out; `None` when no line moves.
    pub fn split(&self, text: &str) -> Option<Moved> {
        if self.rules.is_empty() {
            return None;
        }
        let mut moved: Option<Moved> = None;
        let mut offset = 0;
        for line in text.split_inclusive('\n') {
            let bare = line.strip_suffix('\n').unwrap_or(line);
            let bare = bare.strip_suffix('\r').unwrap_or(bare);
            let hit = (bare.len() <= self.max_line && !bare.trim().is_empty())
                .then(|| self.rules.iter().position(|(_, re)| re.is_match(bare)))
                .flatten();
            match (hit, &mut moved) {
                (Some(rule), m) => {
                    let m = m.get_or_insert_with(|| Moved {
                        kept: text[..offset].to_owned(),
                        lines: Vec::new(),
                        rule_of: Vec::new(),
                    });
                    m.lines.push(bare.to_owned());
                    m.rule_of.push(rule);
                }
                (None, Some(m)) => m.kept.push_str(line),
                (None, None) => {}
            }
            offset += line.len();
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Pattern, RuleConfig};

    fn rules(extra: &[(&str, &str)]) -> Volatile {
        let mut cfg = CanonConfig::default();
        for (name, pat) in extra {
            cfg.rules.push(RuleConfig {
                name: (*name).to_owned(),
                pattern: Pattern(Regex::new(pat).expect("pattern")),
                enabled: true,
            });
        }
        Volatile::new(&cfg)
    }

    #[test]
    fn stamps_move_and_everything_else_stays() {
        let v = rules(&[]);
        let text =
            "You are a coding agent.\nCurrent time: 2026-12-03T10:42:07Z\nBe brief.\nRequest ID: abc\n";
        let m = v.split(text).expect("moves");
        assert_eq!(m.kept, "You are a coding agent.\nBe brief.\n");
        assert_eq!(m.lines, ["Current time: 2026-12-03T10:42:07Z", "Request ID: abc"]);
        assert_eq!(v.rule_name(m.rule_of[0]), "date");
        assert_eq!(v.rule_name(m.rule_of[1]), "request_id");
        assert_eq!(v.split(&m.kept), None, "idempotent");
    }

    #[test]
    fn common_stamp_spellings_match() {
        let v = rules(&[]);
        for line in [
            "Today is Dec 3, 2026.",
            "Date: 3 December 2026",
            "It is 10:42 PM.",
            "now=1764758527",
            "trace_id=77",
            "session 123e4567-e89b-12d3-a456-426614174000",
            "12/03/2026",
        ] {
            assert!(v.split(line).is_some(), "{line}");
        }
        for line in ["Read John 3:16 aloud.", "Use version 2.4 of the API.", "Limit: 1000 tokens"] {
            assert!(v.split(line).is_none(), "{line}");
        }
    }

    #[test]
    fn long_lines_and_switched_off_rules_stay() {
        let v = rules(&[]);
        let long = format!("On 2026-12-03 {}", "word ".repeat(60));
        assert!(v.split(&long).is_none(), "a paragraph that mentions a date is content");
        let mut cfg = CanonConfig::default();
        cfg.volatile.clear();
        assert!(Volatile::new(&cfg).split("Current time: 2026-12-03").is_none());
        let user = rules(&[("build", "^Build: ")]);
        let m = user.split("a\nBuild: 77f3\nb").expect("user rule");
        assert_eq!((m.kept.as_str(), user.rule_name(m.rule_of[0])), ("a\nb", "build"));
    }
}
