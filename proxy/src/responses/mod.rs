//! The Responses API, served by warmpath for any OpenAI-compatible backend: a turn (an HTTP
//! `POST /v1/responses` in `http::responses`, or a WebSocket `response.create` in `ws`) is the
//! stored conversation plus the new input items, sent as a Chat Completions request through
//! the same pipeline as every other request (canonical form, deferred tools, routing,
//! retries), and the backend's chat stream is translated back into Responses events. The
//! conversation, with the turn's output, is stored under the new response id for
//! `previous_response_id` (`crate::session`).
//!
//! - `turn`: a turn prepared from its stored conversation; `run`: run, and its result stored;
//! - `request`: the request's fields, and the chat or completion request a turn becomes;
//! - `chat`: items and tools in the Chat Completions form;
//! - `builder`: chat chunks → Responses events and the response object; `events`: what goes out;
//! - `compact`: a conversation compacted into a summary item by the pool's own model;
//! - `count`: a turn's prompt tokens counted without a backend (`input_tokens`);
//! - `list`: stored items in OpenAI's list pages;
//! - `record`: a response's events kept while it runs; background responses;
//! - `truncate`: the oldest items left out of a prompt that does not fit (`truncation: "auto"`);
//! - `translate`: the [`Downstream`](crate::pipeline::Downstream) that does it on the fly,
//!   writing to an [`EventSink`] (HTTP in `http::responses`, WebSocket in `ws`).

mod builder;
mod chat;
pub mod compact;
mod count;
pub mod events;
pub mod list;
pub mod record;
pub mod request;
mod run;
pub mod translate;
mod truncate;
mod turn;

pub use count::input_tokens;
pub use run::run;
pub use translate::{EventSink, ProxyHeaders, Translator};
pub use turn::{conversation_not_found, lookup, previous_not_found, store_op, Turn};
