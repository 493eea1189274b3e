//! The agent workload as a Responses WebSocket client: one connection per session, each turn a
//! `response.create` event with only the items that are new since the previous turn
//! (`previous_response_id` names the rest), as `client.responses.connect()` sends them. The
//! instructions (system prompt) and tools go with every turn: the Responses API does not carry
//! them over.

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What a client connection reads next.
#[derive(Debug)]
pub enum Incoming {
    Text(String),
    /// The server's close frame and its code (none when the frame had no body).
    Close(Option<u16>),
    /// The connection ended without a close frame.
    End,
}

/// A client connection (RFC 6455, client side: masked frames) and the bytes written to it.
pub struct WsClient {
    stream: TcpStream,
    buf: Vec<u8>,
    pub written: usize,
    mask: u32,
}

impl WsClient {
    pub async fn connect(addr: std::net::SocketAddr) -> anyhow::Result<WsClient> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let head = format!(
            "GET /v1/responses HTTP/1.1\r\nhost: {addr}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
             sec-websocket-key: d2FybXBhdGgtYmVuY2gtMQ==\r\nsec-websocket-version: 13\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let end = loop {
            let n = stream.read(&mut chunk).await?;
            anyhow::ensure!(n > 0, "the server closed during the upgrade");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        let status = String::from_utf8_lossy(&buf[..end]).lines().next().unwrap_or("").to_owned();
        anyhow::ensure!(status.contains(" 101 "), "upgrade refused: {status}");
        buf.drain(..end);
        Ok(WsClient { stream, buf, written: head.len(), mask: 0x5eed_1234 })
    }

    pub async fn send_text(&mut self, text: &str) -> anyhow::Result<()> {
        self.mask = self.mask.rotate_left(7) ^ 0x9e37_79b9;
        let out = warmpath_wire::websocket::masked(true, 0x1, text.as_bytes(), self.mask.to_be_bytes());
        self.stream.write_all(&out).await?;
        self.written += out.len();
        Ok(())
    }

    /// The next text message (pings answered on the way); `None` when the connection ends.
    pub async fn next_text(&mut self) -> anyhow::Result<Option<String>> {
        Ok(match self.next_incoming().await? {
            Incoming::Text(t) => Some(t),
            Incoming::Close(_) | Incoming::End => None,
        })
    }

    /// The next text message, the server's close frame (with its code), or the end of the
    /// connection without one; pings are answered on the way.
    pub async fn next_incoming(&mut self) -> anyhow::Result<Incoming> {
        loop {
            if let Some((op, payload)) = self.frame() {
                match op {
                    1 => return Ok(Incoming::Text(String::from_utf8(payload)?)),
                    8 => {
                        return Ok(Incoming::Close(
                            payload.get(..2).map(|c| u16::from_be_bytes([c[0], c[1]])),
                        ))
                    }
                    9 => {
                        let mut pong = vec![0x8A, 0x80 | payload.len() as u8, 0, 0, 0, 0];
                        pong.extend_from_slice(&payload);
                        self.stream.write_all(&pong).await?;
                    }
                    _ => {}
                }
                continue;
            }
            let mut chunk = [0u8; 16384];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(Incoming::End);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Closes with 1000 and waits (up to a second) for the server's close frame.
    pub async fn close(mut self) {
        let frame = warmpath_wire::websocket::masked(true, 0x8, &1000u16.to_be_bytes(), [1, 2, 3, 4]);
        if self.stream.write_all(&frame).await.is_ok() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
                while let Ok(Incoming::Text(_)) = self.next_incoming().await {}
            })
            .await;
        }
    }

    fn frame(&mut self) -> Option<(u8, Vec<u8>)> {
        let b = &self.buf;
        if b.len() < 2 {
            return None;
        }
        let (len, at) = match b[1] & 0x7F {
            126 if b.len() >= 4 => (u16::from_be_bytes([b[2], b[3]]) as usize, 4),
            127 if b.len() >= 10 => (u64::from_be_bytes(b[2..10].try_into().ok()?) as usize, 10),
            126 | 127 => return None,
            n => (n as usize, 2),
        };
        if b.len() < at + len {
            return None;
        }
        let op = b[0] & 0x0F;
        let payload = b[at..at + len].to_vec();
        self.buf.drain(..at + len);
        Some((op, payload))
    }
}

/// Chat messages → Responses input items.
fn items(messages: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    for m in messages {
        match m["role"].as_str() {
            Some("assistant") => {
                if let Some(text) = m["content"].as_str().filter(|t| !t.is_empty()) {
                    out.push(json!({"type": "message", "role": "assistant", "content": text}));
                }
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    out.push(
                        json!({"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                                    "arguments": c["function"]["arguments"]}),
                    );
                }
            }
            Some("tool") => out.push(
                json!({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}),
            ),
            Some(role) => out.push(json!({"type": "message", "role": role, "content": m["content"]})),
            None => {}
        }
    }
    out
}

/// The `response.create` event for a chat request body: its system message as instructions,
/// its tools in the Responses form, and of its other messages those after the first
/// `sent` (the conversation the server already holds under `previous`). Also returns how many
/// messages the body has past the system message.
pub fn response_create(body: &[u8], sent: usize, previous: Option<&str>) -> anyhow::Result<(String, usize)> {
    let v: Value = serde_json::from_slice(body)?;
    let messages = v["messages"].as_array().cloned().unwrap_or_default();
    let (system, rest): (Vec<&Value>, Vec<&Value>) =
        messages.iter().partition(|m| m["role"].as_str() == Some("system"));
    let rest: Vec<Value> = rest.into_iter().cloned().collect();
    let tools: Vec<Value> = v["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let f = &t["function"];
            json!({"type": "function", "name": f["name"], "description": f["description"], "parameters": f["parameters"]})
        })
        .collect();
    let mut event = json!({
        "type": "response.create",
        "model": v["model"],
        "input": items(&rest[sent.min(rest.len())..]),
        "tools": tools,
        "store": false,
        "max_output_tokens": v["max_tokens"],
    });
    if let Some(s) = system.first() {
        event["instructions"] = s["content"].clone();
    }
    if let Some(p) = previous {
        event["previous_response_id"] = json!(p);
    }
    Ok((event.to_string(), rest.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_sends_only_what_is_new() {
        let body = json!({"model": "m", "max_tokens": 8, "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "result"}],
            "tools": [{"type": "function", "function": {"name": "read", "description": "d", "parameters": {}}}]});
        let bytes = body.to_string();
        let (first, n) = response_create(bytes.as_bytes(), 0, None).expect("event");
        let first: Value = serde_json::from_str(&first).expect("json");
        assert_eq!((first["input"].as_array().map(Vec::len), n), (Some(3), 3));
        assert_eq!(first["instructions"], "sys");
        assert_eq!(first["tools"][0]["name"], "read");
        let (next, _) = response_create(bytes.as_bytes(), 1, Some("resp_1")).expect("event");
        let next: Value = serde_json::from_str(&next).expect("json");
        assert_eq!(next["previous_response_id"], "resp_1");
        let kinds: Vec<&str> =
            next["input"].as_array().expect("items").iter().filter_map(|i| i["type"].as_str()).collect();
        assert_eq!(kinds, ["function_call", "function_call_output"]);
    }
}
