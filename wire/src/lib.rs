//! Types and pure functions shared by the warmpath proxy and the bundled engine.
//!
//! Everything here must give byte-identical results in both processes: the proxy tokenizes and
//! hashes prompts to route them to the replica that already holds their KV blocks, and that only
//! works when it renders, tokenizes and hashes exactly as the engine does.
//!
//! - [`openai`]: OpenAI Chat Completions / Completions wire types and the error shape.
//! - [`tokenizer`]: the built-in `wp32k` BPE tokenizer (no download) and streaming detokenizer.
//! - [`chat_template`]: the documented template that turns messages and tools into prompt text,
//!   and external models' Jinja templates ([`chat_template::jinja`]).
//! - [`prefix`]: chained prefix block hashes over token ids (xxh3), as vLLM's prefix cache keys.
//! - [`gguf`]: GGUF model files (llama.cpp's format): metadata, tensor directory, mapped data.
//! - [`models`]: the models known by name and where their files are installed.
//! - [`kv_events`]: vLLM-compatible KV cache events and their msgpack wire format.
//! - [`tool_calls`]: Hermes `<tool_call>` blocks in generated text, whole or streaming.
//! - [`sse`]: server-sent events split out of a byte stream.
//! - [`websocket`]: RFC 6455 frames (Responses WebSocket mode: the proxy, its tests, the bench).

pub mod chat_template;
pub mod gguf;
pub mod kv_events;
pub mod models;
pub mod openai;
pub mod prefix;
pub mod sse;
pub mod tokenizer;
pub mod tool_calls;
pub mod websocket;
