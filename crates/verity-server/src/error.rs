//! API errors, rendered as OpenAI-style bodies: `{"error": {"message", "type", "param", "code"}}`.
//!
//! Every error the server answers has such a body, protocol-level ones included (see the `transport` module):
//! clients parse errors one way.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    /// OpenAI's machine-readable `code` (e.g. `invalid_api_key`), where one applies.
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            param,
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn unsupported(message: impl Into<String>, param: &'static str) -> Self {
        ApiError {
            param: Some(param),
            ..Self::new(StatusCode::BAD_REQUEST, "unsupported_feature", message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            param: Some("model"),
            ..Self::new(StatusCode::NOT_FOUND, "model_not_found", message)
        }
    }

    pub fn overloaded() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_overloaded",
            "the request queue is full; retry shortly",
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        let headers = r.headers_mut();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert("retry-after", HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        r
    }
}
