//! `truncation: "auto"`: where a turn's prompt and the most it may write do not fit the pool's
//! context (`max_model_len`, where the pool counts tokens exactly), the oldest items of the
//! conversation are left out of the prompt — as few as it takes, and never so that the prompt
//! starts inside a tool exchange (it starts at a message). A prompt whose bytes alone show it
//! fits is not counted. The stored conversation keeps them;
//! the response says how many were left out (`metadata.warmpath_truncated_items`).

use serde_json::Value;
use warmpath_wire::openai::ApiError;

use super::count::prompt_tokens;
use super::turn::Turn;
use crate::state::Pool;

/// The turn with the fewest oldest items left out so that it fits, `None` when it fits whole
/// or the pool's context is not known exactly. When even the turn's own input does not fit,
/// as many as there are are left out and the backend's length check answers.
pub fn fit(pool: &Pool, turn: &Turn) -> Result<Option<Turn>, ApiError> {
    let Some(max) = pool.max_model_len.filter(|_| pool.canon.encoder().exact_tokens()) else {
        return Ok(None);
    };
    let reserve = turn.req.max_output_tokens.unwrap_or(0) as usize;
    if bytes_bound(turn) + reserve <= max {
        return Ok(None);
    }
    let fits = |t: &Turn| -> Result<bool, ApiError> { Ok(prompt_tokens(pool, t)? + reserve <= max) };
    if fits(turn)? {
        return Ok(None);
    }
    let history = turn.history();
    if history.is_empty() {
        return Ok(None);
    }
    // Places the prompt may start: after each message boundary that is not inside a tool
    // exchange, the last being all of the history left out.
    let starts: Vec<usize> =
        (1..=history.len()).filter(|&i| i == history.len() || starts_cleanly(history[i])).collect();
    let mut trial = turn.clone();
    let (mut lo, mut hi) = (0, starts.len() - 1);
    // The fewest left out that fit: prompts shrink as more is left out.
    while lo < hi {
        let mid = (lo + hi) / 2;
        trial.skip = starts[mid];
        if fits(&trial)? {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    trial.skip = starts[lo];
    Ok(Some(trial))
}

/// Tokens a chat template adds beyond the JSON of what it renders (system preambles, tool
/// instructions, the generation prompt), with room to spare.
const TEMPLATE_MARGIN: usize = 512;

/// An upper bound of the turn's prompt in tokens, from bytes alone: no token is shorter than a
/// byte, a message's JSON (its keys, quotes and id) is longer than the few tokens that mark it
/// in a template, and a template that writes JSON with spaces after its separators adds less
/// than a quarter. A prompt under it fits without being counted.
fn bytes_bound(turn: &Turn) -> usize {
    let history = turn.previous.as_ref().map_or(0, |p| p.bytes);
    let input: usize = turn.req.input.iter().map(|i| i.to_string().len()).sum();
    let tools: usize = turn.req.tools.iter().map(|t| t.get().len()).sum();
    let system = turn.req.instructions.as_ref().map_or(0, String::len) + tools;
    (history + input + system) * 5 / 4 + TEMPLATE_MARGIN
}

/// A prompt may start at this item: a message (not a tool call or its output).
fn starts_cleanly(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str).unwrap_or("message") == "message"
}
