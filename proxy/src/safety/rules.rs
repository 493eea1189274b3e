//! The `rules` check: built-in detectors for personal data and secrets, and the policy's own
//! deny and allow patterns, over a text in microseconds.
//!
//! Detectors, each a category: `email`, `phone` (international with `+`, or North American
//! with separators), `payment_card` (13–19 digits, Luhn-checked), `iban` (mod-97 checked),
//! `us_ssn` (the SSA's never-issued ranges excluded), `private_key` (PEM private-key blocks),
//! `api_key` (OpenAI `sk-`, AWS `AKIA`/`ASIA`, GitHub `gh?_`, Slack `xox?-`, and JWTs). A deny
//! pattern is a finding of its own category (its name). A finding whose text an allow pattern
//! matches is dropped (e.g. addresses `@example\.com$`). Where findings overlap, the earlier
//! (then the longer) one stands.
//!
//! Per category the policy says what happens: [`Action::Block`], [`Action::Redact`] (the span
//! replaced by `[CATEGORY]`), or [`Action::Log`] (counted, nothing changed).

use std::collections::HashMap;

use regex::Regex;

/// What a finding of a category does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Block,
    Redact,
    Log,
}

/// A span of the text a detector or pattern matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub category: String,
    /// Byte range in the text.
    pub start: usize,
    pub end: usize,
}

/// What the rules make of a text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Every finding, in order of position.
    pub findings: Vec<Finding>,
    /// The first finding whose category blocks, if any.
    pub blocked_by: Option<String>,
    /// The text with every redacting finding replaced, where any redacts (and none blocks).
    pub redacted: Option<String>,
}

/// A detector: its category, its pattern, and a check of what the pattern matched.
struct Detector {
    category: String,
    re: Regex,
    valid: fn(&str) -> bool,
}

/// The rules of one policy, compiled.
pub struct Rules {
    detectors: Vec<Detector>,
    allow: Vec<Regex>,
    actions: HashMap<String, Action>,
    /// The action of a category the policy does not name.
    default_action: Action,
}

/// The built-in detectors' categories.
pub const CATEGORIES: [&str; 7] =
    ["email", "phone", "payment_card", "iban", "us_ssn", "private_key", "api_key"];

/// A policy's rules as its file gives them, before compiling.
#[derive(Debug, Clone, Default)]
pub struct RulesSpec {
    /// Built-in categories to run (empty: all of them).
    pub detect: Vec<String>,
    /// (name, pattern): the name is the finding's category.
    pub deny: Vec<(String, String)>,
    pub allow: Vec<String>,
    /// Category → action.
    pub actions: Vec<(String, Action)>,
    pub default_action: Option<Action>,
}

fn always(_: &str) -> bool {
    true
}

fn digits(s: &str) -> Vec<u32> {
    s.chars().filter_map(|c| c.to_digit(10)).collect()
}

/// The Luhn checksum of a card number.
pub fn luhn(number: &str) -> bool {
    let d = digits(number);
    if !(13..=19).contains(&d.len()) {
        return false;
    }
    let sum: u32 = d
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &x)| {
            if i % 2 == 1 {
                if x * 2 > 9 {
                    x * 2 - 9
                } else {
                    x * 2
                }
            } else {
                x
            }
        })
        .sum();
    sum % 10 == 0
}

/// ISO 13616's mod-97 check of an IBAN (spaces allowed).
pub fn iban_valid(iban: &str) -> bool {
    let s: String = iban.chars().filter(|c| !c.is_whitespace()).collect();
    if !(15..=34).contains(&s.len()) || !s.is_ascii() {
        return false;
    }
    let (head, tail) = s.split_at(4);
    let mut rem = 0u32;
    for c in tail.chars().chain(head.chars()) {
        let v = match c {
            '0'..='9' => c as u32 - '0' as u32,
            'A'..='Z' => c as u32 - 'A' as u32 + 10,
            _ => return false,
        };
        rem = if v >= 10 { (rem * 100 + v) % 97 } else { (rem * 10 + v) % 97 };
    }
    rem == 1
}

/// A US social security number outside the ranges never issued (area 000, 666, 900–999; group
/// 00; serial 0000).
fn ssn_valid(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let [area, group, serial] = parts[..] else { return false };
    area != "000" && area != "666" && !area.starts_with('9') && group != "00" && serial != "0000"
}

/// A phone number: 8 to 15 digits (E.164's range).
fn phone_valid(s: &str) -> bool {
    (8..=15).contains(&digits(s).len())
}

/// A detector's pattern and the check of what it matched.
type Builtin = (&'static str, fn(&str) -> bool);

fn builtin(category: &str) -> Vec<Builtin> {
    match category {
        "email" => vec![(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}", always)],
        "phone" => vec![
            (r"\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}\d", phone_valid),
            (r"(?:\(\d{3}\)\s?|\b\d{3}[ .-])\d{3}[ .-]\d{4}\b", phone_valid),
        ],
        "payment_card" => vec![(r"\b\d(?:[ -]?\d){12,18}\b", luhn)],
        "iban" => vec![(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b", iban_valid)],
        "us_ssn" => vec![(r"\b\d{3}-\d{2}-\d{4}\b", ssn_valid)],
        "private_key" => vec![(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----(?:[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----)?",
            always,
        )],
        "api_key" => vec![
            (r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}", always),
            (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", always),
            (r"\bgh[pousr]_[A-Za-z0-9]{36,}\b", always),
            (r"\bxox[abposr]-[A-Za-z0-9-]{10,}", always),
            (r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{10,}", always),
        ],
        _ => Vec::new(),
    }
}

impl Rules {
    /// Compiles a policy's rules; an unknown category or a pattern that does not compile is an
    /// error naming it.
    pub fn new(spec: &RulesSpec) -> Result<Rules, String> {
        let wanted: Vec<&str> = if spec.detect.is_empty() {
            CATEGORIES.to_vec()
        } else {
            spec.detect.iter().map(String::as_str).collect()
        };
        let mut detectors = Vec::new();
        for cat in wanted {
            let b = builtin(cat);
            if b.is_empty() {
                return Err(format!("unknown detector {cat:?} (known: {})", CATEGORIES.join(", ")));
            }
            for (pattern, valid) in b {
                let re = Regex::new(pattern).map_err(|e| format!("detector {cat}: {e}"))?;
                detectors.push(Detector { category: cat.to_owned(), re, valid });
            }
        }
        for (name, pattern) in &spec.deny {
            let re = Regex::new(pattern).map_err(|e| format!("deny pattern {name:?}: {e}"))?;
            detectors.push(Detector { category: name.clone(), re, valid: always });
        }
        let allow = spec
            .allow
            .iter()
            .map(|p| Regex::new(p).map_err(|e| format!("allow pattern {p:?}: {e}")))
            .collect::<Result<_, _>>()?;
        Ok(Rules {
            detectors,
            allow,
            actions: spec.actions.iter().cloned().collect(),
            default_action: spec.default_action.unwrap_or(Action::Log),
        })
    }

    /// What a finding of `category` does.
    pub fn action(&self, category: &str) -> Action {
        self.actions.get(category).copied().unwrap_or(self.default_action)
    }

    /// Every finding in `text`, in order of position, overlaps resolved.
    pub fn scan(&self, text: &str) -> Vec<Finding> {
        let mut all: Vec<Finding> = Vec::new();
        for d in &self.detectors {
            for m in d.re.find_iter(text) {
                let s = m.as_str();
                if (d.valid)(s) && !self.allow.iter().any(|a| a.is_match(s)) {
                    all.push(Finding { category: d.category.clone(), start: m.start(), end: m.end() });
                }
            }
        }
        all.sort_by(|a, b| a.start.cmp(&b.start).then(b.end.cmp(&a.end)));
        let mut out: Vec<Finding> = Vec::with_capacity(all.len());
        for f in all {
            if out.last().is_none_or(|l| f.start >= l.end) {
                out.push(f);
            }
        }
        out
    }

    /// The verdict on `text`: findings, whether one blocks, the text redacted.
    pub fn check(&self, text: &str) -> Verdict {
        let findings = self.scan(text);
        let blocked_by =
            findings.iter().find(|f| self.action(&f.category) == Action::Block).map(|f| f.category.clone());
        let redacting: Vec<&Finding> =
            findings.iter().filter(|f| self.action(&f.category) == Action::Redact).collect();
        let redacted = (blocked_by.is_none() && !redacting.is_empty()).then(|| redact(text, &redacting));
        Verdict { findings, blocked_by, redacted }
    }
}

/// `text` with each finding's span replaced by `[CATEGORY]`.
pub fn redact(text: &str, findings: &[&Finding]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for f in findings {
        out.push_str(&text[at..f.start]);
        out.push('[');
        out.push_str(&f.category.to_uppercase());
        out.push(']');
        at = f.end;
    }
    out.push_str(&text[at..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(spec: RulesSpec) -> Rules {
        Rules::new(&spec).expect("compiles")
    }

    fn categories(r: &Rules, text: &str) -> Vec<String> {
        r.scan(text).into_iter().map(|f| f.category).collect()
    }

    #[test]
    fn checksums() {
        assert!(luhn("4111 1111 1111 1111"));
        assert!(luhn("5500-0000-0000-0004"));
        assert!(!luhn("4111 1111 1111 1112"));
        assert!(!luhn("1234"));
        assert!(iban_valid("GB82 WEST 1234 5698 7654 32"));
        assert!(iban_valid("DE89370400440532013000"));
        assert!(!iban_valid("DE89370400440532013001"));
    }

    #[test]
    fn each_detector_finds_its_kind_and_not_lookalikes() {
        let r = rules(RulesSpec::default());
        let cases: [(&str, &[&str]); 14] = [
            ("mail me at jane.doe+x@mail.example.org today", &["email"]),
            ("call +44 20 7946 0958 or (415) 555-0132", &["phone", "phone"]),
            ("card 4111 1111 1111 1111 exp 12/29", &["payment_card"]),
            ("card 4111 1111 1111 1112 is a typo", &[]),
            ("pay to GB82 WEST 1234 5698 7654 32 please", &["iban"]),
            ("ssn 123-45-6789", &["us_ssn"]),
            ("ssn 666-45-6789 was never issued", &[]),
            ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", &["private_key"]),
            ("key sk-proj-abcdefghijklmnopqrstuvwxyz0123", &["api_key"]),
            ("aws AKIAIOSFODNN7EXAMPLE here", &["api_key"]),
            ("token ghp_0123456789abcdefghijklmnopqrstuvwxyzAB", &["api_key"]),
            ("slack xoxb-1234567890-abcdef", &["api_key"]),
            ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", &["api_key"]),
            ("version 1.2.3, order 12345, the year 2026, port 8080", &[]),
        ];
        for (text, want) in cases {
            assert_eq!(categories(&r, text), *want, "{text:?}");
        }
    }

    #[test]
    fn policy_patterns_actions_and_redaction() {
        let r = rules(RulesSpec {
            detect: vec!["email".into(), "api_key".into()],
            deny: vec![("project_falcon".into(), r"(?i)\bproject falcon\b".into())],
            allow: vec![r"@example\.com$".into()],
            actions: vec![("email".into(), Action::Redact), ("project_falcon".into(), Action::Block)],
            default_action: Some(Action::Log),
        });
        let v = r.check("write to ops@corp.io and dev@example.com");
        assert_eq!(v.findings.len(), 1, "the allowed address is not a finding");
        assert_eq!(v.redacted.as_deref(), Some("write to [EMAIL] and dev@example.com"));
        assert_eq!(v.blocked_by, None);
        let v = r.check("about Project Falcon: mail ops@corp.io");
        assert_eq!(v.blocked_by.as_deref(), Some("project_falcon"));
        assert_eq!(v.redacted, None, "a block wins over redaction");
        // Logged only: a finding, nothing changed.
        let v = r.check("sk-abcdefghijklmnopqrstuvwxyz");
        assert_eq!((v.findings.len(), v.blocked_by, v.redacted), (1, None, None));
    }

    #[test]
    fn bad_policies_are_refused_with_the_reason() {
        let refused = |spec: RulesSpec| match Rules::new(&spec) {
            Ok(_) => panic!("accepted"),
            Err(e) => e,
        };
        let e = refused(RulesSpec { detect: vec!["dna".into()], ..Default::default() });
        assert!(e.contains("unknown detector \"dna\""), "{e}");
        let e = refused(RulesSpec { deny: vec![("x".into(), "(".into())], ..Default::default() });
        assert!(e.contains("deny pattern \"x\""), "{e}");
    }

    #[test]
    fn overlapping_findings_keep_the_earlier_longer_one() {
        let r = rules(RulesSpec { deny: vec![("word".into(), "sk-abc".into())], ..Default::default() });
        let f = r.scan("x sk-abcdefghijklmnopqrstuvwxyz y");
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].category, "api_key");
    }
}
