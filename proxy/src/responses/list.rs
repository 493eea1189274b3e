//! Lists of stored items in OpenAI's page shape (`{"object": "list", "data", "first_id",
//! "last_id", "has_more"}`), paged by item id (`after`), `limit` (1–100, 20 by default) and
//! `order` (`desc` by default), as `GET /v1/responses/{id}/input_items` and the conversation
//! items routes take them; and items in the form those routes show them.

use serde_json::{json, Value};
use warmpath_wire::openai::ApiError;

use super::request::INCLUDABLE;

/// A page request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    pub after: Option<String>,
    pub limit: usize,
    /// Oldest first.
    pub ascending: bool,
}

impl ListQuery {
    /// From a query string's pairs (decoded). An unknown `include` value, a `limit` out of
    /// 1..=100 or an `order` other than `asc`/`desc` is a 400 naming the parameter.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<ListQuery, ApiError> {
        let mut q = ListQuery { after: None, limit: 20, ascending: false };
        for (k, v) in pairs {
            match k {
                "after" if !v.is_empty() => q.after = Some(v.to_owned()),
                "limit" => {
                    q.limit = v.parse().ok().filter(|n| (1..=100).contains(n)).ok_or_else(|| {
                        ApiError::invalid_param("`limit` must be an integer from 1 to 100", "limit")
                    })?
                }
                "order" => {
                    q.ascending = match v {
                        "asc" => true,
                        "desc" => false,
                        _ => return Err(ApiError::invalid_param("`order` must be `asc` or `desc`", "order")),
                    }
                }
                "include" | "include[]" if !INCLUDABLE.contains(&v) => {
                    return Err(ApiError::invalid_param(
                        format!("`include` value {v:?} is not one warmpath knows"),
                        "include",
                    ));
                }
                _ => {}
            }
        }
        Ok(q)
    }

    /// One page of `items` (oldest first, each with an `id`), as the list object.
    pub fn page(&self, items: &[&Value]) -> Result<Value, ApiError> {
        let ordered: Vec<&Value> =
            if self.ascending { items.to_vec() } else { items.iter().rev().copied().collect() };
        let start = match &self.after {
            None => 0,
            Some(after) => {
                let at = ordered.iter().position(|i| i["id"].as_str() == Some(after)).ok_or_else(|| {
                    ApiError::invalid_param(format!("No item with id '{after}' in this list."), "after")
                })?;
                at + 1
            }
        };
        let rest = &ordered[start..];
        let data: Vec<Value> = rest.iter().take(self.limit).map(|i| shown(i)).collect();
        let id = |v: Option<&Value>| v.and_then(|i| i["id"].as_str()).map(str::to_owned);
        Ok(json!({
            "object": "list",
            "data": data,
            "first_id": id(data.first()),
            "last_id": id(data.last()),
            "has_more": rest.len() > self.limit,
        }))
    }
}

/// An item as the item routes show it: a message's string content as one text part
/// (`input_text`, or `output_text` from the assistant), `type` and `status` filled in.
pub fn shown(item: &Value) -> Value {
    let mut v = item.clone();
    let Some(o) = v.as_object_mut() else { return v };
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("message").to_owned();
    o.insert("type".into(), json!(kind));
    if kind == "message" {
        let part = if o.get("role").and_then(Value::as_str) == Some("assistant") {
            "output_text"
        } else {
            "input_text"
        };
        if let Some(Value::String(text)) = o.get("content") {
            let mut p = json!({"type": part, "text": text});
            if part == "output_text" {
                p["annotations"] = json!([]);
            }
            o.insert("content".into(), json!([p]));
        }
    }
    if matches!(kind.as_str(), "message" | "function_call" | "function_call_output") {
        o.entry("status").or_insert(json!("completed"));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(n: usize) -> Vec<Value> {
        (0..n)
            .map(|i| json!({"id": format!("msg_{i}"), "role": "user", "content": format!("m{i}")}))
            .collect()
    }

    fn ids(page: &Value) -> Vec<&str> {
        page["data"].as_array().expect("data").iter().map(|i| i["id"].as_str().expect("id")).collect()
    }

    #[test]
    fn pages_run_newest_first_by_default_and_follow_after() {
        let all = items(5);
        let refs: Vec<&Value> = all.iter().collect();
        let q = ListQuery::from_pairs([("limit", "2")]).expect("query");
        let p = q.page(&refs).expect("page");
        assert_eq!(ids(&p), ["msg_4", "msg_3"]);
        assert_eq!(
            (p["first_id"].as_str(), p["last_id"].as_str(), p["has_more"].as_bool()),
            (Some("msg_4"), Some("msg_3"), Some(true))
        );
        let q = ListQuery::from_pairs([("limit", "2"), ("after", "msg_3")]).expect("query");
        assert_eq!(ids(&q.page(&refs).expect("page")), ["msg_2", "msg_1"]);
        let q = ListQuery::from_pairs([("after", "msg_1")]).expect("query");
        let p = q.page(&refs).expect("page");
        assert_eq!((ids(&p), p["has_more"].as_bool()), (vec!["msg_0"], Some(false)));
        let q = ListQuery::from_pairs([("order", "asc"), ("limit", "100")]).expect("query");
        assert_eq!(ids(&q.page(&refs).expect("page")), ["msg_0", "msg_1", "msg_2", "msg_3", "msg_4"]);
        let empty = ListQuery::from_pairs([]).expect("query").page(&[]).expect("page");
        assert_eq!(
            empty,
            json!({"object": "list", "data": [], "first_id": null, "last_id": null, "has_more": false})
        );
    }

    #[test]
    fn bad_parameters_are_400s_that_name_them() {
        for (k, v) in
            [("limit", "0"), ("limit", "101"), ("limit", "x"), ("order", "up"), ("include", "everything")]
        {
            let e = ListQuery::from_pairs([(k, v)]).expect_err(k);
            assert_eq!((e.status, e.body.error.param.as_deref()), (400, Some(k)), "{k}={v}");
        }
        let all = items(2);
        let refs: Vec<&Value> = all.iter().collect();
        let e = ListQuery::from_pairs([("after", "msg_9")]).expect("query").page(&refs).expect_err("unknown");
        assert_eq!(e.body.error.param.as_deref(), Some("after"));
        assert!(ListQuery::from_pairs([("include", "message.output_text.logprobs")]).is_ok());
    }

    #[test]
    fn string_content_is_shown_as_parts() {
        let user = shown(&json!({"id": "msg_1", "role": "user", "content": "hi"}));
        assert_eq!(
            user,
            json!({"id": "msg_1", "type": "message", "role": "user", "status": "completed",
                                "content": [{"type": "input_text", "text": "hi"}]})
        );
        let me = shown(&json!({"id": "msg_2", "type": "message", "role": "assistant", "content": "yes"}));
        assert_eq!(me["content"], json!([{"type": "output_text", "text": "yes", "annotations": []}]));
        let out =
            shown(&json!({"id": "fco_1", "type": "function_call_output", "call_id": "c", "output": "x"}));
        assert_eq!(out["status"], "completed");
    }
}
