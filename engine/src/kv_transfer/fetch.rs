//! The decode side: brings the blocks of a prompt that a prefill replica computed.

use std::time::Instant;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use warmpath_wire::prefix::BlockHash;

use super::frame::{self, FetchRequest, Frame};
use super::{Remote, TransferConfig};
use crate::core::{Engine, Loaded};

/// Fetches the blocks of `prompt` that this engine does not hold from `remote`, up to the
/// prompt's last full block before its last token (that token is always computed). Returns
/// what to load with the request: `None` when nothing arrived. Failures are counted and end the
/// fetch where they happen: the blocks that arrived whole before are kept, the rest computed.
pub async fn fetch(
    engine: &Engine,
    cfg: &TransferConfig,
    remote: &Remote,
    prompt: &[u32],
    cache_salt: Option<&str>,
) -> Option<Loaded> {
    let started = Instant::now();
    let m = &engine.metrics.transfer;
    let mut hashes = engine.loadable_hashes(prompt, cache_salt);
    // The prefill replica names its blocks; where they differ from ours (another model or
    // template), none of them is this prompt's.
    let agree = hashes.iter().zip(&remote.hashes).take_while(|(a, b)| a == b).count();
    if !remote.hashes.is_empty() && agree < hashes.len().min(remote.hashes.len()) {
        m.failed("mismatch");
        hashes.truncate(agree);
    }
    let first = engine.cached_prefix(hashes.clone()).await;
    m.moved("skipped", first, 0);
    let blocks = match receive(cfg, remote, &hashes[first..]).await {
        Ok((blocks, None)) => blocks,
        Ok((blocks, Some(reason))) | Err((blocks, reason)) => {
            m.failed(reason);
            blocks
        }
    };
    let bytes = blocks.iter().map(Vec::len).sum();
    m.moved("received", blocks.len(), bytes);
    if !cfg.delay_per_block.is_zero() && !blocks.is_empty() {
        tokio::time::sleep(cfg.delay_per_block * blocks.len() as u32).await;
    }
    m.seconds.observe(started.elapsed().as_secs_f64());
    Loaded::arrived(hashes, first, blocks)
}

type Received = Vec<Vec<u8>>;

/// Asks for `want` (releasing the hold) and reads the frames: the blocks that arrived whole,
/// and why it stopped short, if it did.
async fn receive(
    cfg: &TransferConfig,
    remote: &Remote,
    want: &[BlockHash],
) -> Result<(Received, Option<&'static str>), (Received, &'static str)> {
    let addr = (remote.host.as_str(), remote.port);
    let stream = match tokio::time::timeout(cfg.timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(_)) | Err(_) => return Err((Vec::new(), "connect")),
    };
    let _ = stream.set_nodelay(true);
    let (r, mut w) = stream.into_split();
    let req = FetchRequest { request_id: remote.request_id, hashes: want.to_vec(), release: true };
    let mut line = serde_json::to_vec(&req).unwrap_or_default();
    line.push(b'\n');
    if w.write_all(&line).await.is_err() {
        return Err((Vec::new(), "broken"));
    }
    let mut r = BufReader::with_capacity(1 << 16, r);
    let mut blocks = Vec::with_capacity(want.len());
    for &h in want {
        let frame = match tokio::time::timeout(cfg.timeout, frame::read(&mut r, h)).await {
            Err(_) => return Err((blocks, "timeout")),
            Ok(Err(_)) => return Err((blocks, "broken")),
            Ok(Ok(f)) => f,
        };
        match frame {
            Frame::Block(data) => blocks.push(data),
            Frame::Missing => return Ok((blocks, Some("missing"))),
            Frame::WrongBlock | Frame::Corrupt => return Ok((blocks, Some("corrupt"))),
        }
    }
    Ok((blocks, None))
}
