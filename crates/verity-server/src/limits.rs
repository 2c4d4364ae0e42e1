//! How long and how large a request may be, and the middleware that bounds what reaches the handlers.
//!
//! Timeouts bound what a client sends and how long a connection may sit unused; none of them bounds the time a
//! generation takes. The connection-level clocks live in the `transport` module; this module bounds a request once
//! its head is read: the URI's length, and the body, which is read whole within [`Limits::body_timeout`] before
//! any handler runs.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CONNECTION, CONTENT_LENGTH};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::ApiError;
use crate::MAX_BODY;

/// Longest accepted request target (path and query), in bytes; longer ones are answered 414.
pub const MAX_URI: usize = 8 << 10;
/// Largest accepted request head (request line and headers), in bytes; larger ones are answered 431.
pub const MAX_HEAD: usize = 64 << 10;
/// Most headers in one request; more are answered 431.
pub const MAX_HEADERS: usize = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From the first byte of a request to the end of its head (and for a fresh connection, from the accept to
    /// its first byte).
    pub header_timeout: Duration,
    /// From the end of a request's head to the end of its body.
    pub body_timeout: Duration,
    /// How long a kept-alive connection may wait for its next request, and how long a response may make no
    /// progress towards a client that stopped reading.
    pub idle_timeout: Duration,
    /// Connections served at once; one more is answered 503 and closed.
    pub max_connections: usize,
}

impl Default for Limits {
    /// Generous for any real client on a LAN (a 4 MiB body at 1 Mbit/s takes 32 s, hence the body's 30 s being
    /// about right for the 4 MiB cap), short enough that stalled sockets do not pile up.
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 256,
        }
    }
}

/// Refuse an over-long URI, then read the whole body within the body timeout and the size cap, so that a
/// handler never waits on a client.
pub(crate) async fn bounded_request(
    State(limits): State<Limits>,
    req: Request,
    next: Next,
) -> Response {
    let uri = req.uri();
    let uri_len = uri.path_and_query().map_or(0, |p| p.as_str().len())
        + uri.authority().map_or(0, |a| a.as_str().len());
    if uri_len > MAX_URI {
        return ApiError::new(
            StatusCode::URI_TOO_LONG,
            "invalid_request_error",
            format!("the request URI has {uri_len} bytes; the limit is {MAX_URI}"),
        )
        .into_response();
    }
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return closing(too_large());
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(limits.body_timeout, Limited::new(body, MAX_BODY).collect());
    let body = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<LengthLimitError>() => return closing(too_large()),
        Ok(Err(e)) => {
            return closing(ApiError::invalid(
                format!("cannot read the request body: {e}"),
                None,
            ))
        }
        Err(_) => {
            return closing(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request body did not arrive within {} s",
                    limits.body_timeout.as_secs_f32()
                ),
            ))
        }
    };
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// An answer after which the connection closes: the rest of the body is not read, so the stream cannot carry
/// another request.
fn closing(err: ApiError) -> Response {
    let mut r = err.into_response();
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body exceeds {MAX_BODY} bytes"),
    )
}
