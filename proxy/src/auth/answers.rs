//! What the auth stage answers, in OpenAI's shapes: 401 `invalid_api_key`, 403
//! `model_not_allowed`, 429 `rate_limit_exceeded` (or `insufficient_quota`) with OpenAI's
//! `x-ratelimit-*`, `retry-after` and `retry-after-ms` headers, so clients' own backoff works.

use std::time::Duration;

use warmpath_wire::openai::ApiError;

use super::limiter::{Limited, Meter, Verdict};

/// The response headers a limited or admitted request carries.
pub type LimitHeaders = Vec<(&'static str, String)>;

/// A refused request: the error and the rate-limit headers that go with it.
#[derive(Debug)]
pub struct Refusal {
    pub error: Box<ApiError>,
    pub headers: LimitHeaders,
}

impl Refusal {
    pub fn bare(error: ApiError) -> Refusal {
        Refusal { error: Box::new(error), headers: Vec::new() }
    }
}

/// OpenAI's rate-limit headers for the meters of `v`.
pub fn limit_headers(v: &Verdict) -> LimitHeaders {
    let mut h = Vec::new();
    let mut add = |m: &Option<Meter>, names: [&'static str; 3]| {
        if let Some(m) = m {
            h.push((names[0], m.limit.to_string()));
            h.push((names[1], m.remaining.to_string()));
            h.push((names[2], span(m.reset)));
        }
    };
    add(
        &v.requests,
        ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"],
    );
    add(&v.tokens, ["x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]);
    h
}

/// The 429 for `limited`, for a request that asked for `estimate` tokens.
pub fn limited(l: Limited, v: &Verdict, estimate: u64) -> Refusal {
    let e = match l {
        Limited::Concurrent { max } => {
            rate_limited("requests", format!("Too many requests in flight for this key: limit {max}."))
        }
        Limited::Requests { limit, wait } => rate_limited(
            "requests",
            format!("Rate limit reached for requests: limit {limit} per minute. Please try again in {}.", span(wait)),
        ),
        Limited::Tokens { limit, wait } => rate_limited(
            "tokens",
            format!(
                "Rate limit reached for tokens: limit {limit} per minute, requested {estimate}. Please try again in {}.",
                span(wait)
            ),
        ),
        Limited::TooLarge { limit } => rate_limited(
            "tokens",
            format!("Request too large: it may use {estimate} tokens, more than this key's {limit} per minute. Lower max_tokens or the prompt."),
        ),
        Limited::Daily { limit, .. } => {
            rate_limited("tokens", format!("This key's daily budget of {limit} tokens is spent."))
                .with_code("insufficient_quota")
        }
        Limited::Sockets { max } => {
            rate_limited("requests", format!("Too many WebSocket connections for this key: limit {max}."))
        }
    };
    let mut headers = limit_headers(v);
    match l.wait() {
        Some(w) => {
            headers.push(("retry-after", w.as_secs_f64().ceil().max(1.0).to_string()));
            headers.push(("retry-after-ms", (w.as_millis().max(1)).to_string()));
        }
        // Waiting would not help: the openai SDKs do not retry on this header.
        None => headers.push(("x-should-retry", "false".to_owned())),
    }
    Refusal { error: Box::new(e), headers }
}

/// A duration as OpenAI writes resets: `20ms`, `1.5s`, `6m0s`.
pub fn span(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = d.as_secs_f64();
    if s < 60.0 {
        let t = format!("{:.3}", s);
        let t = t.trim_end_matches('0').trim_end_matches('.');
        return format!("{t}s");
    }
    let whole = d.as_secs();
    let (h, m, sec) = (whole / 3600, whole % 3600 / 60, whole % 60);
    if h > 0 {
        format!("{h}h{m}m{sec}s")
    } else {
        format!("{m}m{sec}s")
    }
}

/// A key as an error may show it: its first characters and its last four.
pub fn redacted(key: &[u8]) -> String {
    let k = String::from_utf8_lossy(key);
    let chars: Vec<char> = k.chars().collect();
    if chars.len() <= 10 {
        return "***".into();
    }
    let head: String = chars[..3].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}***{tail}")
}

pub fn invalid_key(message: &str) -> ApiError {
    let mut e = ApiError::invalid_request(message.to_owned()).with_code("invalid_api_key");
    e.status = 401;
    e
}

pub fn forbidden_model(model: &str) -> ApiError {
    let mut e = ApiError::invalid_request(format!("This API key may not use the model `{model}`."))
        .with_code("model_not_allowed");
    e.status = 403;
    e.body.error.kind = "permission_error".into();
    e
}

fn rate_limited(kind: &str, message: String) -> ApiError {
    let mut e = ApiError::invalid_request(message).with_code("rate_limit_exceeded");
    e.status = 429;
    e.body.error.kind = kind.to_owned();
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_read_as_openai_writes_them() {
        assert_eq!(span(Duration::from_millis(20)), "20ms");
        assert_eq!(span(Duration::from_millis(1500)), "1.5s");
        assert_eq!(span(Duration::from_secs(1)), "1s");
        assert_eq!(span(Duration::from_secs(360)), "6m0s");
        assert_eq!(span(Duration::from_secs(3700)), "1h1m40s");
    }
}
