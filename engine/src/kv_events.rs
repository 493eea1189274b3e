//! Publishes the block pool's KV events on a ZMQ PUB socket in vLLM's wire format (three
//! frames: topic, big-endian sequence number, msgpack batch; see `warmpath_wire::kv_events`).

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use warmpath_wire::kv_events::{encode_batch, EventBatch, KvEvent};
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Where the engine thread drops event batches; a task sends them out.
#[derive(Clone, Debug)]
pub struct KvEventSink(mpsc::UnboundedSender<Vec<KvEvent>>);

impl KvEventSink {
    pub fn send(&self, events: Vec<KvEvent>) {
        // The publisher only stops at shutdown; events after that have no reader anyway.
        let _ = self.0.send(events);
    }
}

/// Binds the PUB socket; returns the sink, the endpoint actually bound (port 0 resolved) and
/// the publishing task, which ends when every sink is dropped.
pub async fn start_publisher(
    endpoint: &str,
    topic: String,
) -> Result<(KvEventSink, String, JoinHandle<()>), zeromq::ZmqError> {
    let mut socket = zeromq::PubSocket::new();
    let bound = socket.bind(endpoint).await?.to_string();
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<KvEvent>>();
    let task = tokio::spawn(async move {
        let mut seq: u64 = 0;
        while let Some(events) = rx.recv().await {
            let batch = EventBatch { ts: unix_ts(), events, data_parallel_rank: Some(0) };
            let frames = vec![
                Bytes::from(topic.clone().into_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(encode_batch(&batch)),
            ];
            seq += 1;
            let Ok(msg) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(e) = socket.send(msg).await {
                tracing::warn!(error = %e, "publishing KV events failed");
            }
        }
        let _ = socket.close().await;
    });
    Ok((KvEventSink(tx), bound, task))
}

fn unix_ts() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
