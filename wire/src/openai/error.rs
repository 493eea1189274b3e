//! The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`. The SDKs map the
//! HTTP status to an exception class, so every error also carries its status.

use serde::{Deserialize, Serialize};

/// The body of an error response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// An error with the HTTP status it is answered with.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub body: ErrorResponse,
}

impl ApiError {
    fn new(status: u16, kind: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: ErrorResponse {
                error: ErrorDetail {
                    message: message.into(),
                    kind: kind.to_owned(),
                    param: None,
                    code: None,
                },
            },
        }
    }

    /// 400 `invalid_request_error`.
    pub fn invalid_request(message: impl Into<String>) -> ApiError {
        Self::new(400, "invalid_request_error", message)
    }

    /// 400: the request field `param` is wrong, as `message` says.
    pub fn invalid_param(message: impl Into<String>, param: &str) -> ApiError {
        ApiError::invalid_request(message).with_param(param)
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> ApiError {
        Self::new(404, "invalid_request_error", format!("The model `{model}` does not exist."))
            .with_param("model")
            .with_code("model_not_found")
    }

    /// 404 for an unknown route.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        Self::new(404, "invalid_request_error", message)
    }

    /// 413: the body is over the size limit.
    pub fn too_large(limit: usize) -> ApiError {
        Self::new(413, "invalid_request_error", format!("request body exceeds {limit} bytes"))
    }

    /// 503: the server cannot take the request now; a retry elsewhere is safe.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        Self::new(503, "server_error", message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(500, "server_error", message)
    }

    pub fn with_param(mut self, param: &str) -> ApiError {
        self.body.error.param = Some(param.to_owned());
        self
    }

    pub fn with_code(mut self, code: &str) -> ApiError {
        self.body.error.code = Some(code.to_owned());
        self
    }

    pub fn message(&self) -> &str {
        &self.body.error.message
    }

    /// The JSON body.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.body).unwrap_or_else(|_| {
            r#"{"error":{"message":"unserializable error","type":"server_error","param":null,"code":null}}"#
                .to_owned()
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.body.error.message)
    }
}

impl std::error::Error for ApiError {}

/// Parses a JSON request body, turning serde's message into a 400 in the OpenAI shape.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() { "invalid JSON" } else { "invalid request" };
        ApiError::invalid_request(format!("{what}: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_has_the_openai_shape() {
        let e = ApiError::model_not_found("gpt-x");
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).expect("json");
        assert_eq!(e.status, 404);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
        assert!(v["error"]["message"].as_str().expect("str").contains("gpt-x"));
    }

    #[test]
    fn parse_errors_are_400() {
        let e = parse_body::<crate::openai::ChatCompletionRequest>(b"{not json").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message().starts_with("invalid JSON"));
        let e = parse_body::<crate::openai::ChatCompletionRequest>(br#"{"model": 3}"#).unwrap_err();
        assert!(e.message().starts_with("invalid request"), "{}", e.message());
    }
}
