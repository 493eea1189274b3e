//! `/v1/conversations`: conversations created, read, updated (metadata) and deleted, and their
//! items added, listed (paged), read and removed, from warmpath's conversation store
//! (`crate::session`, scoped per API key: another key's conversation is a 404, exactly as an
//! unknown id). A response with `conversation` reads its items as history and appends its own
//! (`crate::responses`).

use pingora::proxy::Session;
use serde_json::{json, Map, Value};
use warmpath_wire::openai::ApiError;

use super::body::read_client_body;
use super::query;
use crate::request::head::Head;
use crate::responses::events::{give_id, new_id};
use crate::responses::list::{shown, ListQuery};
use crate::responses::request::check_items;
use crate::responses::{conversation_not_found, store_op};
use crate::session::{tenant, Thread, ThreadMeta};
use crate::state::{AppState, RequestCtx};

/// Items one call may add, as OpenAI's API allows.
const MAX_ADDED: usize = 20;

/// Which conversations route a request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConversationRoute {
    Create,
    Retrieve(String),
    Update(String),
    Delete(String),
    AddItems(String),
    ListItems(String),
    Item(String, String),
    RemoveItem(String, String),
}

impl ConversationRoute {
    /// The route of `method path`: `None` when the path is not one of these, `Err(allow)`
    /// when the method is not one the path takes.
    pub fn of(method: &http::Method, path: &str) -> Option<Result<ConversationRoute, &'static str>> {
        let rest = path.strip_prefix("/v1/conversations")?;
        let (get, post, delete) =
            (method == http::Method::GET, method == http::Method::POST, method == http::Method::DELETE);
        let parts: Vec<&str> = rest.split('/').collect();
        if parts.iter().skip(1).any(|p| p.is_empty()) {
            return None;
        }
        let own = |s: &str| s.to_owned();
        Some(match parts[..] {
            [""] if post => Ok(ConversationRoute::Create),
            [""] => Err("POST"),
            ["", id] if get => Ok(ConversationRoute::Retrieve(own(id))),
            ["", id] if post => Ok(ConversationRoute::Update(own(id))),
            ["", id] if delete => Ok(ConversationRoute::Delete(own(id))),
            ["", _] => Err("GET, POST, DELETE"),
            ["", id, "items"] if post => Ok(ConversationRoute::AddItems(own(id))),
            ["", id, "items"] if get => Ok(ConversationRoute::ListItems(own(id))),
            ["", _, "items"] => Err("GET, POST"),
            ["", id, "items", item] if get => Ok(ConversationRoute::Item(own(id), own(item))),
            ["", id, "items", item] if delete => Ok(ConversationRoute::RemoveItem(own(id), own(item))),
            ["", _, "items", _] => Err("GET, DELETE"),
            _ => return None,
        })
    }

    /// Whether the route reads a request body.
    pub fn reads_body(&self) -> bool {
        matches!(
            self,
            ConversationRoute::Create | ConversationRoute::Update(_) | ConversationRoute::AddItems(_)
        )
    }
}

/// Answers one conversations route.
pub async fn serve(
    state: &AppState,
    session: &mut Session,
    ctx: &mut RequestCtx,
    route: ConversationRoute,
) -> pingora::Result<()> {
    let head = Head::of(session.req_header()).with_key(ctx.key.clone());
    let tenant = tenant(head.owner());
    let pairs = query::pairs(session.req_header().uri.query());
    let list = || ListQuery::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let body = if route.reads_body() {
        let Some(b) = read_client_body(state, session, ctx).await? else { return Ok(()) };
        Some(b)
    } else {
        None
    };
    let fields = || body_fields(body.as_deref().unwrap_or(b"{}"));
    let threads = &state.sessions.threads;
    let answer: Result<Value, ApiError> = async {
        match &route {
            ConversationRoute::Create => {
                let mut f = fields()?;
                let metadata = metadata(f.remove("metadata"))?;
                let items = items(f.remove("items"), "items", false)?;
                let meta = ThreadMeta { id: new_id("conv_"), created_at: now(), metadata };
                store_op(state, "create", threads.create(tenant, meta.clone(), items).await)?;
                Ok(meta.object())
            }
            ConversationRoute::Retrieve(id) => Ok(thread(state, tenant, id).await?.meta.object()),
            ConversationRoute::Update(id) => {
                let mut f = fields()?;
                if !f.contains_key("metadata") {
                    return Err(ApiError::invalid_param("`metadata` is required", "metadata"));
                }
                let md = metadata(f.remove("metadata"))?;
                if !store_op(state, "update", threads.update(tenant, id, Some(md)).await)? {
                    return Err(conversation_not_found(id, 404));
                }
                Ok(thread(state, tenant, id).await?.meta.object())
            }
            ConversationRoute::Delete(id) => {
                if !store_op(state, "delete", threads.update(tenant, id, None).await)? {
                    return Err(conversation_not_found(id, 404));
                }
                Ok(json!({"id": id, "object": "conversation.deleted", "deleted": true}))
            }
            ConversationRoute::AddItems(id) => {
                list()?;
                let added = items(fields()?.remove("items"), "items", true)?;
                if !store_op(state, "append", threads.append(tenant, id, &added, None).await)? {
                    return Err(conversation_not_found(id, 404));
                }
                let refs: Vec<&Value> = added.iter().collect();
                ListQuery { after: None, limit: MAX_ADDED, ascending: true }.page(&refs)
            }
            ConversationRoute::ListItems(id) => {
                let q = list()?;
                let t = thread(state, tenant, id).await?;
                q.page(&t.items.iter().collect::<Vec<_>>())
            }
            ConversationRoute::Item(id, item) => {
                let t = thread(state, tenant, id).await?;
                let found = t.items.iter().find(|i| i["id"].as_str() == Some(item.as_str()));
                found.map(shown).ok_or_else(|| item_not_found(item))
            }
            ConversationRoute::RemoveItem(id, item) => {
                match store_op(state, "remove_item", threads.remove_item(tenant, id, item).await)? {
                    None => Err(conversation_not_found(id, 404)),
                    Some(false) => Err(item_not_found(item)),
                    Some(true) => Ok(thread(state, tenant, id).await?.meta.object()),
                }
            }
        }
    }
    .await;
    super::reply(session, ctx, answer.map(|v| v.to_string())).await
}

async fn thread(state: &AppState, tenant: u64, id: &str) -> Result<Thread, ApiError> {
    let found = store_op(state, "get", state.sessions.threads.get(tenant, id).await)?;
    found.ok_or_else(|| conversation_not_found(id, 404))
}

fn item_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("Item with id '{id}' not found.")).with_code("item_not_found")
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The body's top-level fields (an empty body is no fields).
fn body_fields(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::invalid_request("the body must be a JSON object").with_code("invalid_json")),
        Err(e) => Err(ApiError::invalid_request(format!("invalid JSON: {e}")).with_code("invalid_json")),
    }
}

/// `metadata`: at most 16 pairs, keys up to 64 characters, string values up to 512.
fn metadata(v: Option<Value>) -> Result<Value, ApiError> {
    let bad = |m: &str| ApiError::invalid_param(m, "metadata");
    match v {
        None | Some(Value::Null) => Ok(json!({})),
        Some(Value::Object(o)) => {
            if o.len() > 16 {
                return Err(bad("`metadata` holds at most 16 pairs"));
            }
            for (k, v) in &o {
                match v {
                    Value::String(s) if k.chars().count() <= 64 && s.chars().count() <= 512 => {}
                    Value::String(_) => {
                        return Err(bad("`metadata` keys are at most 64 characters, values at most 512"))
                    }
                    _ => return Err(bad("`metadata` values must be strings")),
                }
            }
            Ok(Value::Object(o))
        }
        Some(_) => Err(bad("`metadata` must be an object")),
    }
}

/// Items to add: an array of at most 20 items a turn could take, each given an `id`.
fn items(v: Option<Value>, param: &str, required: bool) -> Result<Vec<Value>, ApiError> {
    let mut list = match v {
        None | Some(Value::Null) if !required => Vec::new(),
        Some(Value::Array(a)) if !a.is_empty() || !required => a,
        _ => {
            return Err(ApiError::invalid_param(
                format!("`{param}` must be a non-empty array of items"),
                param,
            ))
        }
    };
    if list.len() > MAX_ADDED {
        return Err(ApiError::invalid_param(
            format!("at most {MAX_ADDED} items may be added at a time"),
            param,
        ));
    }
    check_items(&list, param)?;
    for item in &mut list {
        if let Some(o) = item.as_object_mut() {
            o.entry("type").or_insert(json!("message"));
        }
        give_id(item);
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_methods_map_to_routes() {
        use ConversationRoute as R;
        let (get, post, del) = (&http::Method::GET, &http::Method::POST, &http::Method::DELETE);
        assert_eq!(R::of(post, "/v1/conversations"), Some(Ok(R::Create)));
        assert_eq!(R::of(get, "/v1/conversations"), Some(Err("POST")));
        assert_eq!(R::of(get, "/v1/conversations/c1"), Some(Ok(R::Retrieve("c1".into()))));
        assert_eq!(R::of(post, "/v1/conversations/c1"), Some(Ok(R::Update("c1".into()))));
        assert_eq!(
            R::of(del, "/v1/conversations/c1/items/i1"),
            Some(Ok(R::RemoveItem("c1".into(), "i1".into())))
        );
        assert_eq!(R::of(&http::Method::PUT, "/v1/conversations/c1/items"), Some(Err("GET, POST")));
        assert_eq!(R::of(get, "/v1/conversations/c1/x"), None);
        assert_eq!(R::of(get, "/v1/conversations//items"), None);
        assert_eq!(R::of(get, "/v1/conversationsx"), None);
    }

    #[test]
    fn metadata_and_items_are_checked() {
        assert!(metadata(Some(json!({"a": "b"}))).is_ok());
        assert!(metadata(Some(json!({"a": 1}))).is_err());
        assert!(metadata(Some(json!({"a": "x".repeat(513)}))).is_err());
        let many: Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert!(metadata(Some(Value::Object(many))).is_err());
        let one = items(Some(json!([{"role": "user", "content": "hi"}])), "items", true).expect("items");
        assert_eq!(one[0]["type"], "message");
        assert!(one[0]["id"].as_str().is_some_and(|i| i.starts_with("msg_")));
        assert!(items(Some(json!([])), "items", true).is_err());
        assert!(items(None, "items", false).expect("none").is_empty());
        assert!(items(Some(json!([{"role": "robot", "content": "x"}])), "items", true).is_err());
        let too_many: Vec<Value> = (0..21).map(|_| json!({"role": "user", "content": "x"})).collect();
        assert!(items(Some(Value::Array(too_many)), "items", true).is_err());
    }
}
