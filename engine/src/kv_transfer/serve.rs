//! The prefill side: answers fetches of held blocks over TCP ([`super::frame`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::frame::{self, FetchRequest};
use crate::core::Engine;

/// Blocks read from the engine per command: the engine thread reads them between two steps,
/// so a long prompt's transfer does not hold up its steps for long.
const CHUNK: usize = 32;

/// Serves fetches until the listener fails; each connection on its own task.
pub async fn serve(listener: TcpListener, engine: Arc<Engine>, timeout: Duration) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: wait rather than spin.
                tracing::warn!(error = %e, "accepting a K/V fetch failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let engine = engine.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, &engine, timeout).await {
                tracing::debug!(%peer, error = %e, "K/V fetch ended early");
            }
        });
    }
}

/// Reads one request and sends its blocks. The request's hold is released once it has been
/// answered, whole or not, when it asks for that: the decode replica will not come back.
async fn answer(stream: TcpStream, engine: &Engine, timeout: Duration) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let (r, mut w) = stream.into_split();
    let mut line = Vec::new();
    let mut reader = BufReader::new(r).take(frame::MAX_REQUEST as u64);
    tokio::time::timeout(timeout, reader.read_until(b'\n', &mut line))
        .await
        .map_err(|_| std::io::ErrorKind::TimedOut)??;
    let req: FetchRequest = serde_json::from_slice(&line)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    let result = send(&mut w, engine, &req.hashes).await;
    if req.release {
        engine.release(req.request_id);
    }
    result?;
    w.shutdown().await
}

async fn send(w: &mut (impl AsyncWriteExt + Unpin), engine: &Engine, hashes: &[u64]) -> std::io::Result<()> {
    let m = &engine.metrics.transfer;
    let mut out = Vec::new();
    for chunk in hashes.chunks(CHUNK) {
        let blocks = engine.export(chunk.to_vec()).await;
        out.clear();
        for (&h, data) in chunk.iter().zip(&blocks) {
            frame::encode(h, data, &mut out);
        }
        m.moved("sent", blocks.len(), blocks.iter().map(Vec::len).sum());
        let short = blocks.len() < chunk.len();
        if short {
            frame::encode_missing(chunk[blocks.len()], &mut out);
        }
        w.write_all(&out).await?;
        if short {
            break;
        }
    }
    Ok(())
}
