//! A blocking WebSocket client (RFC 6455, client side), to see exactly what warmpath sends in
//! Responses WebSocket mode.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::client::{parse_response, Resp};

/// A blocking WebSocket client (RFC 6455, client side), to see exactly what warmpath sends.
pub struct Ws {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

/// A server frame: opcode and payload.
#[derive(Debug, Clone, PartialEq)]
pub struct WsFrame {
    pub opcode: u8,
    pub payload: Vec<u8>,
}

impl WsFrame {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload)
            .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&self.payload)))
    }

    /// A close frame's code.
    pub fn close_code(&self) -> Option<u16> {
        (self.opcode == 8 && self.payload.len() >= 2)
            .then(|| u16::from_be_bytes([self.payload[0], self.payload[1]]))
    }
}

impl Ws {
    /// Connects and upgrades; panics unless the answer is 101 with the right accept key.
    pub fn connect(addr: SocketAddr, headers: &[(&str, &str)]) -> Ws {
        Ws::try_connect(addr, headers)
            .unwrap_or_else(|r| panic!("upgrade refused: {} {}", r.status, r.text()))
    }

    /// Connects; the refusal's response if the server does not upgrade.
    pub fn try_connect(addr: SocketAddr, headers: &[(&str, &str)]) -> Result<Ws, Resp> {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        let key = "dGhlIHNhbXBsZSBub25jZQ==";
        let mut head = format!(
            "GET /v1/responses HTTP/1.1\r\nhost: {addr}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
             sec-websocket-key: {key}\r\n"
        );
        if !headers.iter().any(|(k, _)| *k == "sec-websocket-version") {
            head.push_str("sec-websocket-version: 13\r\n");
        }
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).expect("write");
        // Read the response head byte by byte: frames may follow it at once.
        let mut raw = Vec::new();
        let mut b = [0u8; 1];
        while !raw.ends_with(b"\r\n\r\n") {
            if s.read(&mut b).unwrap_or(0) == 0 {
                break;
            }
            raw.push(b[0]);
        }
        let r = parse_response(&raw);
        if r.status != 101 {
            // The refusal's body follows its head.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            raw.extend(rest);
            return Err(parse_response(&raw));
        }
        assert_eq!(r.header("sec-websocket-accept"), Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="));
        Ok(Ws { stream: s, buf: Vec::new() })
    }

    /// Sends one masked frame.
    pub fn send_frame(&mut self, fin: bool, opcode: u8, payload: &[u8]) {
        let out = warmpath_wire::websocket::masked(fin, opcode, payload, [0x5a, 0x13, 0xc4, 0x7e]);
        self.stream.write_all(&out).expect("send frame");
    }

    pub fn send_json(&mut self, v: &serde_json::Value) {
        self.send_frame(true, 1, v.to_string().as_bytes());
    }

    /// The next frame; `None` when the connection ends.
    pub fn read_frame(&mut self) -> Option<WsFrame> {
        loop {
            if self.buf.len() >= 2 {
                let (op, b1) = (self.buf[0] & 0x0F, self.buf[1]);
                assert_eq!(b1 & 0x80, 0, "server frames are not masked");
                let (len, at) = match b1 & 0x7F {
                    126 if self.buf.len() >= 4 => {
                        (u16::from_be_bytes([self.buf[2], self.buf[3]]) as usize, 4)
                    }
                    127 if self.buf.len() >= 10 => {
                        (u64::from_be_bytes(self.buf[2..10].try_into().expect("8")) as usize, 10)
                    }
                    126 | 127 => (usize::MAX, 0),
                    n => (n as usize, 2),
                };
                if len != usize::MAX && self.buf.len() >= at + len {
                    let payload = self.buf[at..at + len].to_vec();
                    self.buf.drain(..at + len);
                    return Some(WsFrame { opcode: op, payload });
                }
            }
            let mut chunk = [0u8; 16384];
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// The next text message's JSON, answering pings on the way.
    pub fn next_event(&mut self) -> Option<serde_json::Value> {
        loop {
            let f = self.read_frame()?;
            match f.opcode {
                1 => return Some(f.json()),
                9 => self.send_frame(true, 10, &f.payload),
                8 => return None,
                _ => {}
            }
        }
    }

    /// Events up to and including the next terminal one (`response.completed`, `.incomplete`,
    /// `.failed`, or `error`).
    pub fn turn(&mut self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event() {
            let t = e["type"].as_str().unwrap_or("").to_owned();
            out.push(e);
            if matches!(
                t.as_str(),
                "response.completed" | "response.incomplete" | "response.failed" | "error"
            ) {
                break;
            }
        }
        out
    }
}
