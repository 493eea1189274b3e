//! `truncation: "auto"`: where a turn's prompt and the most it may write do not fit the pool's
//! context (`max_model_len`, where the pool counts tokens exactly), the oldest items of the
//! conversation are left out of the prompt — as few as it takes, and never so that the prompt
//! starts inside a tool exchange (it starts at a message). The stored conversation keeps them;
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

/// A prompt may start at this item: a message (not a tool call or its output).
fn starts_cleanly(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str).unwrap_or("message") == "message"
}
