//! The `moderation` check: a service speaking OpenAI's `POST /v1/moderations` (OpenAI's own, or
//! a self-hosted one). The judged texts go out as one `input` list; a result blocks where its
//! score for a category reaches the policy's threshold for it, or — with no thresholds — where
//! the service says `flagged`.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use serde_json::{json, Value};

use super::check::{Judge, Subject};
use crate::config::{ModerationConfig, Stage};
use crate::upstream::{self, Peer, Upstream};

pub struct Moderation {
    upstream: Arc<Upstream>,
    peer: Peer,
    model: Option<String>,
    key: Option<String>,
    thresholds: BTreeMap<String, f64>,
}

impl Moderation {
    pub fn new(c: &ModerationConfig, services: &super::Services) -> Result<Moderation, String> {
        let key = match &c.api_key_env {
            Some(var) => Some(std::env::var(var).map_err(|_| format!("api_key_env: ${var} is not set"))?),
            None => None,
        };
        Ok(Moderation {
            upstream: services.upstream.clone(),
            peer: Peer::new(c.url.clone(), services.resolved.first(&c.url)?, &services.upstream_cfg)?,
            model: c.model.clone(),
            key,
            thresholds: c.thresholds.clone(),
        })
    }
}

#[async_trait]
impl Judge for Moderation {
    async fn judge(&self, _: Stage, subject: &Subject) -> Result<Vec<String>, String> {
        let texts: Vec<&str> =
            subject.judged.iter().map(|t| t.text.as_str()).filter(|t| !t.trim().is_empty()).collect();
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let mut body = json!({ "input": texts });
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        let body = Bytes::from(body.to_string());
        let (status, answer) =
            upstream::post_json(&self.upstream, &self.peer, "/v1/moderations", body, self.key.as_deref())
                .await?;
        if status != 200 {
            let head = String::from_utf8_lossy(&answer[..answer.len().min(200)]).into_owned();
            return Err(format!("moderation service answered {status}: {head}"));
        }
        flagged(&answer, &self.thresholds)
    }
}

/// The blocking categories of a moderation answer, in order of first appearance.
pub fn flagged(answer: &[u8], thresholds: &BTreeMap<String, f64>) -> Result<Vec<String>, String> {
    let v: Value =
        serde_json::from_slice(answer).map_err(|e| format!("moderation answer is not JSON: {e}"))?;
    let results =
        v.get("results").and_then(Value::as_array).ok_or("moderation answer has no results list")?;
    let mut out: Vec<String> = Vec::new();
    let mut add = |c: &str| {
        if !out.iter().any(|o| o == c) {
            out.push(c.to_owned());
        }
    };
    for r in results {
        if thresholds.is_empty() {
            let flagged =
                r.get("flagged").and_then(Value::as_bool).ok_or("a result has no flagged boolean")?;
            if !flagged {
                continue;
            }
            let cats: Vec<&str> = r
                .get("categories")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter().filter(|(_, v)| v.as_bool() == Some(true)).map(|(k, _)| k.as_str()).collect()
                })
                .unwrap_or_default();
            if cats.is_empty() {
                add("flagged");
            }
            cats.into_iter().for_each(&mut add);
        } else {
            let scores = r
                .get("category_scores")
                .and_then(Value::as_object)
                .ok_or("a result has no category_scores")?;
            for (cat, limit) in thresholds {
                if scores.get(cat).and_then(Value::as_f64).is_some_and(|s| s >= *limit) {
                    add(cat);
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_by_the_service_or_by_thresholds() {
        let answer = br#"{"id":"modr-1","model":"m","results":[
            {"flagged":false,"categories":{"violence":false},"category_scores":{"violence":0.2,"hate":0.01}},
            {"flagged":true,"categories":{"violence":true,"hate":false},"category_scores":{"violence":0.91,"hate":0.3}}]}"#;
        assert_eq!(flagged(answer, &BTreeMap::new()).expect("ok"), ["violence"]);
        let t = |pairs: &[(&str, f64)]| pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        assert_eq!(flagged(answer, &t(&[("hate", 0.25)])).expect("ok"), ["hate"]);
        assert_eq!(flagged(answer, &t(&[("violence", 0.1), ("hate", 0.5)])).expect("ok"), ["violence"]);
        assert!(flagged(answer, &t(&[("violence", 0.95)])).expect("ok").is_empty());
        // Flagged with no category named: still a block.
        assert_eq!(flagged(br#"{"results":[{"flagged":true}]}"#, &BTreeMap::new()).expect("ok"), ["flagged"]);
        // Garbage is an error (decided by on_error), not a pass.
        assert!(flagged(b"<html>", &BTreeMap::new()).is_err());
        assert!(flagged(br#"{"results":[{"categories":{}}]}"#, &BTreeMap::new()).is_err());
        assert!(flagged(br#"{"error":{"message":"x"}}"#, &BTreeMap::new()).is_err());
    }
}
