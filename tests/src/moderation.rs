//! A moderation service on 127.0.0.1 speaking OpenAI's `POST /v1/moderations`, for the safety
//! stage's tests: it flags a text holding a trigger word under the word's category (score
//! 0.95; every other category 0.01), and can be made slow, broken or garbled while it runs.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::scripted::read_request;

/// How the service answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// OpenAI's shape, after `delay_ms`.
    Answer { delay_ms: u64 },
    /// 500 with an error body.
    Fail,
    /// 200 with a body that is not JSON.
    Garbage,
}

/// Trigger words and their categories.
pub const TRIGGERS: [(&str, &str); 2] = [("attack", "violence"), ("slur", "hate")];

pub struct ModerationServer {
    pub addr: SocketAddr,
    pub behaviour: Arc<Mutex<Behaviour>>,
    /// Requests received.
    pub calls: Arc<AtomicU64>,
    /// Their `input` lists.
    pub inputs: Arc<Mutex<Vec<Vec<String>>>>,
}

impl ModerationServer {
    pub fn start(behaviour: Behaviour) -> ModerationServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = ModerationServer {
            addr,
            behaviour: Arc::new(Mutex::new(behaviour)),
            calls: Arc::default(),
            inputs: Arc::default(),
        };
        let (b, calls, inputs) = (server.behaviour.clone(), server.calls.clone(), server.inputs.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (b, calls, inputs) = (b.clone(), calls.clone(), inputs.clone());
                std::thread::spawn(move || serve(conn, &b, &calls, &inputs));
            }
        });
        server
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, b: Behaviour) {
        *self.behaviour.lock().expect("lock") = b;
    }

    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

fn serve(mut conn: TcpStream, b: &Mutex<Behaviour>, calls: &AtomicU64, inputs: &Mutex<Vec<Vec<String>>>) {
    while let Some((_, body)) = read_request(&mut conn) {
        calls.fetch_add(1, Ordering::SeqCst);
        let texts: Vec<String> = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["input"].as_array().cloned())
            .map(|a| a.iter().filter_map(|t| t.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        inputs.lock().expect("lock").push(texts.clone());
        let behaviour = *b.lock().expect("lock");
        let (status, body) = match behaviour {
            Behaviour::Answer { delay_ms } => {
                std::thread::sleep(Duration::from_millis(delay_ms));
                (200, answer(&texts).to_string())
            }
            Behaviour::Fail => {
                (500, r#"{"error":{"message":"moderation down","type":"server_error"}}"#.to_owned())
            }
            Behaviour::Garbage => (200, "<html>not a moderation answer</html>".to_owned()),
        };
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        if conn.write_all(head.as_bytes()).and_then(|_| conn.write_all(body.as_bytes())).is_err() {
            return;
        }
    }
}

/// OpenAI's answer shape for `texts`.
fn answer(texts: &[String]) -> Value {
    let results: Vec<Value> = texts
        .iter()
        .map(|t| {
            let lower = t.to_lowercase();
            let mut categories = serde_json::Map::new();
            let mut scores = serde_json::Map::new();
            for (word, cat) in TRIGGERS {
                let hit = lower.contains(word);
                categories.insert(cat.into(), json!(hit));
                scores.insert(cat.into(), json!(if hit { 0.95 } else { 0.01 }));
            }
            let flagged = categories.values().any(|v| v == &json!(true));
            json!({"flagged": flagged, "categories": categories, "category_scores": scores})
        })
        .collect();
    json!({"id": "modr-test", "model": "test-moderation", "results": results})
}
