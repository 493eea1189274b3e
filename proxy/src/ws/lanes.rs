//! The lanes of one connection (`stream_id` on `response.create`, as OpenAI's WebSocket mode
//! multiplexes): responses of one lane run one at a time, in order; lanes run side by side.
//! Every event of a lane's responses carries its `stream_id`. A lane keeps its latest
//! response, which any lane may continue without a store lookup — a new lane that continues
//! another's response forks the conversation. Requests without a `stream_id` share one lane.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::task::JoinHandle;
use warmpath_wire::openai::ApiError;

use crate::responses::request::ResponsesRequest;
use crate::session::Conversation;

/// Lanes kept past which idle ones (their latest responses) are forgotten; the store still
/// has those.
const MAX_LANES: usize = 64;

/// A lane's `stream_id` (`None`: the lane of requests that name none).
pub type LaneKey = Option<Arc<str>>;

/// A response running on a lane.
pub struct Running {
    pub task: JoinHandle<()>,
    /// The response it continues, forgotten if the turn fails.
    pub previous: Option<String>,
}

#[derive(Default)]
struct Lane {
    queue: VecDeque<ResponsesRequest>,
    turn: Option<Running>,
    last: Option<Arc<Conversation>>,
}

impl Lane {
    fn busy(&self) -> bool {
        self.turn.is_some() || !self.queue.is_empty()
    }
}

/// Every lane of a connection.
#[derive(Default)]
pub struct Lanes {
    map: HashMap<LaneKey, Lane>,
}

impl Lanes {
    /// A response runs or waits on some lane.
    pub fn busy(&self) -> bool {
        self.map.values().any(Lane::busy)
    }

    /// A response runs on some lane.
    pub fn running(&self) -> bool {
        self.map.values().any(|l| l.turn.is_some())
    }

    /// Drops every waiting request (the connection is closing after what runs).
    pub fn clear_queues(&mut self) {
        for l in self.map.values_mut() {
            l.queue.clear();
        }
    }

    /// Aborts every running response (the client left: their backend calls are dropped).
    pub fn abort_all(&mut self) {
        for l in self.map.values_mut() {
            if let Some(t) = l.turn.take() {
                t.task.abort();
            }
        }
    }

    /// A request for `lane`: `Some` to start it now, `None` when it waits behind the lane's
    /// running one; an error when the lane's queue is full (`max_queued`) or it would be one
    /// lane too many at work (`max_streams`).
    pub fn admit(
        &mut self,
        lane: LaneKey,
        req: ResponsesRequest,
        max_queued: usize,
        max_streams: usize,
    ) -> Result<Option<ResponsesRequest>, ApiError> {
        let at_work = self.map.values().filter(|l| l.busy()).count();
        let entry = self.map.get(&lane);
        if !entry.is_some_and(Lane::busy) && at_work >= max_streams {
            let mut e = ApiError::invalid_request(format!(
                "{at_work} streams are at work on this connection, the most allowed"
            ))
            .with_param("stream_id")
            .with_code("too_many_streams");
            e.status = 429;
            return Err(e);
        }
        let l = self.map.entry(lane).or_default();
        if l.turn.is_none() {
            return Ok(Some(req));
        }
        if l.queue.len() >= max_queued {
            let mut e = ApiError::invalid_request(format!(
                "{} responses are already waiting on this stream",
                l.queue.len()
            ))
            .with_code("too_many_queued_responses");
            e.status = 429;
            return Err(e);
        }
        l.queue.push_back(req);
        Ok(None)
    }

    /// The latest response of any lane with this id: continued without a store lookup.
    pub fn cached(&self, id: Option<&str>) -> Option<Arc<Conversation>> {
        let id = id?;
        self.map.values().filter_map(|l| l.last.as_ref()).find(|c| c.id == id).cloned()
    }

    pub fn started(&mut self, lane: LaneKey, running: Running) {
        self.map.entry(lane).or_default().turn = Some(running);
    }

    /// A lane's response ended (`done`: the conversation after it, where it succeeded); the
    /// lane's next request, to start.
    pub fn finished(&mut self, lane: &LaneKey, done: Option<Arc<Conversation>>) -> Option<ResponsesRequest> {
        let l = self.map.get_mut(lane)?;
        let t = l.turn.take()?;
        match done {
            Some(c) => l.last = Some(c),
            // A failed turn drops the state it referenced (as OpenAI's): the client starts over
            // from the store, or from scratch.
            None if t.previous.is_some() && l.last.as_ref().map(|c| &c.id) == t.previous.as_ref() => {
                l.last = None
            }
            None => {}
        }
        let next = l.queue.pop_front();
        if next.is_none() && l.last.is_none() {
            self.map.remove(lane);
        }
        // Idle lanes are kept for their latest response, a bounded number of them.
        if self.map.len() > MAX_LANES {
            self.map.retain(|k, l| k == lane || l.busy());
        }
        next
    }
}

/// An event's JSON with its lane's `stream_id` (as the first field), where it has one.
pub fn tagged<'a>(json: &'a str, lane: &LaneKey) -> Cow<'a, str> {
    match (lane, json.strip_prefix('{')) {
        (Some(id), Some(rest)) => {
            let id = serde_json::Value::String(id.to_string()).to_string();
            let sep = if rest.trim_start().starts_with('}') { "" } else { "," };
            Cow::Owned(format!("{{\"stream_id\":{id}{sep}{rest}"))
        }
        _ => Cow::Borrowed(json),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prev: Option<&str>) -> ResponsesRequest {
        let body = serde_json::json!({"model": "m", "previous_response_id": prev});
        let fields = crate::responses::request::raw_fields(body.to_string().as_bytes()).expect("fields");
        ResponsesRequest::from_fields(fields, true).expect("request")
    }

    fn running() -> Running {
        Running { task: tokio::spawn(async {}), previous: None }
    }

    #[tokio::test]
    async fn lanes_run_side_by_side_and_in_order_within_each() {
        let mut lanes = Lanes::default();
        let (a, b): (LaneKey, LaneKey) = (Some("a".into()), Some("b".into()));
        assert!(lanes.admit(a.clone(), req(None), 1, 2).expect("admit").is_some(), "a starts");
        lanes.started(a.clone(), running());
        assert!(lanes.admit(b.clone(), req(None), 1, 2).expect("admit").is_some(), "b starts beside it");
        lanes.started(b.clone(), running());
        assert!(lanes.admit(a.clone(), req(None), 1, 2).expect("admit").is_none(), "a's next waits");
        let full = lanes.admit(a.clone(), req(None), 1, 2).expect_err("a's queue is full");
        assert_eq!(full.body.error.code.as_deref(), Some("too_many_queued_responses"));
        let third = lanes.admit(Some("c".into()), req(None), 1, 2).expect_err("two lanes at work");
        assert_eq!(third.body.error.code.as_deref(), Some("too_many_streams"));
        let c = Arc::new(Conversation::new("resp_1".into(), 0, "m".into(), None, Vec::new()));
        assert!(lanes.finished(&a, Some(c)).is_some(), "a's waiting request starts");
        assert_eq!(
            lanes.cached(Some("resp_1")).map(|c| c.id.clone()).as_deref(),
            Some("resp_1"),
            "any lane may fork it"
        );
        assert!(lanes.running() && lanes.busy());
    }

    #[test]
    fn events_carry_their_lane() {
        assert_eq!(tagged(r#"{"type":"x"}"#, &Some("s1".into())), r#"{"stream_id":"s1","type":"x"}"#);
        assert_eq!(tagged(r#"{"type":"x"}"#, &None), r#"{"type":"x"}"#);
        assert_eq!(tagged("{}", &Some("q\"".into())), r#"{"stream_id":"q\""}"#);
    }
}
