//! Publishes the block pool's KV events on a ZMQ PUB socket in vLLM's wire format (three
//! frames: topic, big-endian sequence number, msgpack batch; see `warmpath_wire::kv_events`),
//! and, where a replay endpoint is bound, answers replay requests for recent batches on a
//! ROUTER socket as vLLM's publisher does (a subscriber that reconnected, or saw a gap in the
//! sequence, asks for everything from a sequence number on).

use std::collections::VecDeque;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use warmpath_wire::kv_events::{encode_batch, EventBatch, KvEvent, REPLAY_END};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where the engine thread drops event batches; a task sends them out.
#[derive(Clone, Debug)]
pub struct KvEventSink(mpsc::UnboundedSender<Vec<KvEvent>>);

impl KvEventSink {
    pub fn send(&self, events: Vec<KvEvent>) {
        // The publisher only stops at shutdown; events after that have no reader anyway.
        let _ = self.0.send(events);
    }
}

/// A started publisher.
pub struct Publisher {
    pub sink: KvEventSink,
    /// The PUB endpoint actually bound (port 0 resolved).
    pub endpoint: String,
    /// The replay endpoint actually bound.
    pub replay_endpoint: Option<String>,
    /// Ends when every sink is dropped.
    pub task: JoinHandle<()>,
}

/// Binds the PUB socket, and the replay ROUTER socket where `replay` names one (with the
/// number of recent batches it keeps).
pub async fn start_publisher(
    endpoint: &str,
    topic: String,
    replay: Option<(&str, usize)>,
) -> Result<Publisher, zeromq::ZmqError> {
    let mut socket = zeromq::PubSocket::new();
    let bound = socket.bind(endpoint).await?.to_string();
    let (mut router, replay_endpoint, keep) = match replay {
        Some((ep, keep)) => {
            let mut r = zeromq::RouterSocket::new();
            let b = r.bind(ep).await?.to_string();
            (Some(r), Some(b), keep)
        }
        None => (None, None, 0),
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<KvEvent>>();
    let task = tokio::spawn(async move {
        let mut seq: u64 = 0;
        let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::with_capacity(keep.min(1 << 16));
        loop {
            let events = tokio::select! {
                e = rx.recv() => match e {
                    Some(e) => e,
                    None => break,
                },
                req = recv_replay(&mut router) => {
                    if let (Some(r), Ok(req)) = (router.as_mut(), req) {
                        serve_replay(r, req, &buffer).await;
                    }
                    continue;
                }
            };
            let batch = EventBatch { ts: unix_ts(), events, data_parallel_rank: Some(0) };
            let payload = Bytes::from(encode_batch(&batch));
            let frames = vec![
                Bytes::from(topic.clone().into_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if keep > 0 {
                if buffer.len() == keep {
                    buffer.pop_front();
                }
                buffer.push_back((seq, payload));
            }
            seq += 1;
            let Ok(msg) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(e) = socket.send(msg).await {
                tracing::warn!(error = %e, "publishing KV events failed");
            }
        }
        let _ = socket.close().await;
        if let Some(r) = router {
            let _ = r.close().await;
        }
    });
    Ok(Publisher { sink: KvEventSink(tx), endpoint: bound, replay_endpoint, task })
}

/// The next replay request, or never without a replay socket.
async fn recv_replay(router: &mut Option<zeromq::RouterSocket>) -> Result<ZmqMessage, zeromq::ZmqError> {
    match router {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

/// Answers one request `[identity, "", start_seq]`: every kept batch from `start_seq` on, then
/// the end marker. Malformed requests are dropped, as vLLM does.
async fn serve_replay(router: &mut zeromq::RouterSocket, req: ZmqMessage, buffer: &VecDeque<(u64, Bytes)>) {
    let frames = req.into_vec();
    let [id, _, start] = frames.as_slice() else {
        tracing::debug!(frames = frames.len(), "malformed KV event replay request");
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else { return };
    let reply = |seq: &[u8], payload: Bytes| {
        ZmqMessage::try_from(vec![id.clone(), Bytes::new(), Bytes::copy_from_slice(seq), payload])
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        let Ok(msg) = reply(&seq.to_be_bytes(), payload.clone()) else { return };
        if router.send(msg).await.is_err() {
            return;
        }
    }
    if let Ok(end) = reply(&REPLAY_END, Bytes::new()) {
        let _ = router.send(end).await;
    }
}

fn unix_ts() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
