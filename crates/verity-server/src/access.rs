//! Who may drive the server: an API key, the Host a request names, the Origin a browser sends, and the
//! Content-Type of a POST.
//!
//! Why each: any web page the user opens can send requests to a loopback server. A "simple" cross-origin POST
//! (`text/plain`, no preflight) goes out without the browser asking anyone, and DNS rebinding makes a page's own
//! name resolve to 127.0.0.1. So a POST must declare `application/json` (which a simple request cannot), a
//! request that carries an `Origin` is refused unless that origin was allowed, and on a loopback bind a request
//! must name a loopback Host (a rebound page names its own). Clients that are not browsers (curl, the SDKs) send
//! no Origin and are unaffected.
//!
//! Invariants: with an API key, every path but `/health` needs it (CORS preflights carry no credentials and are
//! answered, for allowed origins only); a network bind without a key is refused unless explicitly allowed
//! ([`AccessConfig::resolve`]).

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD,
    AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN, VARY,
};
use axum::http::uri::Authority;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Host names a loopback bind always answers to.
const LOOPBACK_HOSTS: &[&str] = &["localhost", "127.0.0.1", "[::1]"];

/// Access settings as given on the command line.
#[derive(Debug, Clone, Default)]
pub struct AccessConfig {
    /// Required as `Authorization: Bearer KEY` on every path but `/health`.
    pub api_key: Option<String>,
    /// Host names accepted besides the loopback ones. Given any, the Host check also runs on a network bind.
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`, or `*` for any) whose pages may call the server.
    pub cors_origins: Vec<String>,
    /// Serve a network bind without an API key (with a warning).
    pub allow_no_api_key: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error(
        "refusing to listen on {addr} without an API key: anyone who can reach it could run generations and \
         reset the cache. Set --api-key (or VERITY_API_KEY), bind to 127.0.0.1, or pass --allow-no-api-key to \
         accept the risk"
    )]
    OpenWithoutKey { addr: SocketAddr },
    #[error("the API key is empty")]
    EmptyKey,
    #[error("--cors-origin {0:?} is not an origin: scheme://host[:port], or *")]
    BadOrigin(String),
    #[error("--allowed-host {0:?} is not a host name (host or host:port)")]
    BadHost(String),
}

/// Who can reach the bound address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposure {
    /// Only this machine.
    Loopback,
    /// The network, with or without an API key.
    Network { keyed: bool },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Origins {
    Any,
    Listed(Vec<String>),
}

/// Validated access rules for one bind.
#[derive(Debug, Clone)]
pub struct Access {
    key: Option<Vec<u8>>,
    /// `None`: any Host (a network bind without `--allowed-host`).
    hosts: Option<Vec<String>>,
    origins: Origins,
    exposure: Exposure,
}

impl AccessConfig {
    /// Check the settings against the addresses to bind: a network address without a key is refused unless
    /// `allow_no_api_key`.
    pub fn resolve(self, bind: &[SocketAddr]) -> Result<Access, AccessError> {
        if self.api_key.as_deref() == Some("") {
            return Err(AccessError::EmptyKey);
        }
        let keyed = self.api_key.is_some();
        let exposure = match bind.iter().find(|a| !a.ip().is_loopback()) {
            None => Exposure::Loopback,
            Some(&addr) if !keyed && !self.allow_no_api_key => {
                return Err(AccessError::OpenWithoutKey { addr })
            }
            Some(_) => Exposure::Network { keyed },
        };
        let mut extra = Vec::with_capacity(self.allowed_hosts.len());
        for h in &self.allowed_hosts {
            extra.push(host_of(h).ok_or_else(|| AccessError::BadHost(h.clone()))?);
        }
        let hosts = (exposure == Exposure::Loopback || !extra.is_empty()).then(|| {
            let mut all: Vec<String> = LOOPBACK_HOSTS.iter().map(|h| h.to_string()).collect();
            all.extend(extra);
            all
        });
        let origins = if self.cors_origins.iter().any(|o| o == "*") {
            Origins::Any
        } else {
            let mut listed = Vec::with_capacity(self.cors_origins.len());
            for o in &self.cors_origins {
                listed.push(origin_of(o).ok_or_else(|| AccessError::BadOrigin(o.clone()))?);
            }
            Origins::Listed(listed)
        };
        Ok(Access {
            key: self.api_key.map(String::into_bytes),
            hosts,
            origins,
            exposure,
        })
    }
}

impl Access {
    pub fn exposure(&self) -> Exposure {
        self.exposure
    }

    /// A request must name an accepted host, in its Host header and in an absolute-form target alike. A request
    /// without a Host (HTTP/1.0) passes: browsers always send one.
    fn check_host(&self, headers: &HeaderMap, uri: &Uri) -> Result<(), ApiError> {
        let Some(hosts) = &self.hosts else {
            return Ok(());
        };
        let header = match headers.get(HOST) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(host_of)
                    .ok_or_else(|| ApiError::invalid("malformed Host header", None))?,
            ),
        };
        let target = uri.authority().and_then(|a| host_of(a.as_str()));
        for named in header.iter().chain(target.iter()) {
            if !hosts.contains(named) {
                return Err(ApiError::new(
                    StatusCode::MISDIRECTED_REQUEST,
                    "invalid_request_error",
                    format!(
                        "host {named:?} is not served here (allowed: {}; add names with --allowed-host)",
                        hosts.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The `Access-Control-Allow-Origin` value for an allowed origin, `None` for a refused one.
    fn allow_origin(&self, origin: &HeaderValue) -> Option<HeaderValue> {
        match &self.origins {
            Origins::Any => Some(HeaderValue::from_static("*")),
            Origins::Listed(list) => {
                let o = origin.to_str().ok()?.to_ascii_lowercase();
                list.contains(&o).then(|| origin.clone())
            }
        }
    }

    fn check_key(&self, req: &Request) -> Result<(), ApiError> {
        let Some(key) = &self.key else {
            return Ok(());
        };
        if req.uri().path() == "/health" {
            return Ok(());
        }
        // OpenAI clients send `Authorization: Bearer <key>`, Anthropic clients `x-api-key: <key>`.
        let bearer = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        let given = bearer.or_else(|| {
            req.headers()
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        });
        match given {
            Some(token) if same_secret(token.as_bytes(), key) => Ok(()),
            Some(_) => Err(unauthorized("the API key is not valid")),
            None => Err(unauthorized(
                "this server needs an API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
            )),
        }
    }
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        .with_code("invalid_api_key")
}

/// Compare a presented key with the real one in time that does not depend on where they differ (only on the
/// length, which is no help in guessing the key).
fn same_secret(given: &[u8], key: &[u8]) -> bool {
    if given.len() != key.len() {
        return false;
    }
    let diff = given.iter().zip(key).fold(0u8, |d, (a, b)| d | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// The host part of `host[:port]`, lower-cased; IPv6 keeps its brackets.
fn host_of(authority: &str) -> Option<String> {
    let a = Authority::from_str(authority.trim()).ok()?;
    if a.as_str().contains('@') || a.host().is_empty() {
        return None;
    }
    Some(a.host().to_ascii_lowercase())
}

/// An origin as browsers serialize it: `scheme://host[:port]`, lower-cased, without a path.
fn origin_of(origin: &str) -> Option<String> {
    let trimmed = origin.trim().trim_end_matches('/');
    let uri = Uri::from_str(trimmed).ok()?;
    let ok = uri.scheme().is_some()
        && uri.authority().is_some_and(|a| !a.host().is_empty())
        && uri.path_and_query().is_none_or(|p| p.as_str() == "/");
    ok.then(|| trimmed.to_ascii_lowercase())
}

/// `application/json`, with or without parameters such as `; charset=utf-8`.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

/// Apply the rules in order: Host, Origin (answering preflights), API key, Content-Type of a POST.
pub(crate) async fn enforce(
    State(access): State<Arc<Access>>,
    req: Request,
    next: Next,
) -> Response {
    // Refusals in the shape of the API the request came for.
    let messages_api = req.uri().path() == "/v1/messages";
    let refuse = |e: ApiError| {
        if messages_api {
            crate::anthropic::error_response(&e)
        } else {
            e.into_response()
        }
    };
    if let Err(e) = access.check_host(req.headers(), req.uri()) {
        return refuse(e);
    }
    let allowed = match req.headers().get(ORIGIN) {
        None => None,
        Some(origin) => match access.allow_origin(origin) {
            Some(allowed) => Some(allowed),
            None => {
                return refuse(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "invalid_request_error",
                    format!(
                        "cross-origin requests from {origin:?} are not allowed (allow them with --cors-origin)"
                    ),
                ))
            }
        },
    };
    let preflight = req.method() == Method::OPTIONS
        && req.headers().contains_key(ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = match (&allowed, preflight) {
        (Some(_), true) => preflight_answer(req.headers()),
        _ => match access
            .check_key(&req)
            .and_then(|()| check_content_type(&req))
        {
            Ok(()) => next.run(req).await,
            Err(e) => refuse(e),
        },
    };
    if let Some(allowed) = allowed {
        let headers = response.headers_mut();
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
        headers.append(VARY, HeaderValue::from_static("origin"));
    }
    response
}

fn check_content_type(req: &Request) -> Result<(), ApiError> {
    if req.method() != Method::POST || is_json(req.headers()) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        "request bodies must be JSON, sent with Content-Type: application/json",
    ))
}

/// A CORS preflight for an allowed origin: the methods served and the headers asked for.
fn preflight_answer(headers: &HeaderMap) -> Response {
    let asked = headers
        .get(ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or(HeaderValue::from_static("authorization, content-type"));
    let mut r = StatusCode::NO_CONTENT.into_response();
    let h = r.headers_mut();
    h.insert(
        ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    h.insert(ACCESS_CONTROL_ALLOW_HEADERS, asked);
    h.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    h.insert(
        VARY,
        HeaderValue::from_static("access-control-request-method, access-control-request-headers"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback() -> Vec<SocketAddr> {
        vec!["127.0.0.1:0".parse().unwrap()]
    }

    fn any_interface() -> Vec<SocketAddr> {
        vec!["0.0.0.0:0".parse().unwrap()]
    }

    #[test]
    fn a_network_bind_needs_a_key_or_an_explicit_waiver() {
        let open = AccessConfig::default().resolve(&any_interface());
        assert!(matches!(open, Err(AccessError::OpenWithoutKey { .. })));
        let waived = AccessConfig {
            allow_no_api_key: true,
            ..Default::default()
        };
        assert_eq!(
            waived.resolve(&any_interface()).unwrap().exposure(),
            Exposure::Network { keyed: false }
        );
        let keyed = AccessConfig {
            api_key: Some("k".into()),
            ..Default::default()
        };
        assert_eq!(
            keyed.resolve(&any_interface()).unwrap().exposure(),
            Exposure::Network { keyed: true }
        );
        let local = AccessConfig::default().resolve(&loopback()).unwrap();
        assert_eq!(local.exposure(), Exposure::Loopback);
        let empty = AccessConfig {
            api_key: Some(String::new()),
            ..Default::default()
        };
        assert!(matches!(
            empty.resolve(&loopback()),
            Err(AccessError::EmptyKey)
        ));
    }

    fn host_ok(access: &Access, host: &str) -> bool {
        let mut h = HeaderMap::new();
        h.insert(HOST, HeaderValue::from_str(host).unwrap());
        access
            .check_host(&h, &Uri::from_static("/v1/models"))
            .is_ok()
    }

    #[test]
    fn a_loopback_bind_answers_only_loopback_and_listed_host_names() {
        let access = AccessConfig {
            allowed_hosts: vec!["myhost.lan:8080".into()],
            ..Default::default()
        }
        .resolve(&loopback())
        .unwrap();
        for ok in [
            "localhost",
            "LOCALHOST:8080",
            "127.0.0.1:1",
            "[::1]",
            "[::1]:8080",
            "myhost.lan",
        ] {
            assert!(host_ok(&access, ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "127.0.0.2",
            "localhost.evil",
        ] {
            assert!(!host_ok(&access, bad), "{bad}");
        }
        let absolute = Uri::from_static("http://evil.example/v1/models");
        let mut h = HeaderMap::new();
        h.insert(HOST, HeaderValue::from_static("localhost"));
        assert!(access.check_host(&h, &absolute).is_err());
        // A network bind without --allowed-host answers to any name.
        let network = AccessConfig {
            api_key: Some("k".into()),
            ..Default::default()
        }
        .resolve(&any_interface())
        .unwrap();
        assert!(host_ok(&network, "evil.example"));
    }

    #[test]
    fn origins_are_allowed_only_when_listed_and_are_validated() {
        let access = AccessConfig {
            cors_origins: vec!["http://localhost:3000/".into()],
            ..Default::default()
        }
        .resolve(&loopback())
        .unwrap();
        let allowed = access.allow_origin(&HeaderValue::from_static("http://localhost:3000"));
        assert_eq!(allowed.unwrap(), "http://localhost:3000");
        assert!(access
            .allow_origin(&HeaderValue::from_static("http://evil.example"))
            .is_none());
        let any = AccessConfig {
            cors_origins: vec!["*".into()],
            ..Default::default()
        }
        .resolve(&loopback())
        .unwrap();
        assert_eq!(
            any.allow_origin(&HeaderValue::from_static("http://x"))
                .unwrap(),
            "*"
        );
        for bad in ["localhost:3000", "http://", "http://x/path"] {
            let r = AccessConfig {
                cors_origins: vec![bad.into()],
                ..Default::default()
            }
            .resolve(&loopback());
            assert!(matches!(r, Err(AccessError::BadOrigin(_))), "{bad}");
        }
    }

    #[test]
    fn keys_compare_by_content_and_length() {
        assert!(same_secret(b"secret", b"secret"));
        assert!(!same_secret(b"secreT", b"secret"));
        assert!(!same_secret(b"secret1", b"secret"));
        assert!(!same_secret(b"", b"secret"));
    }

    #[test]
    fn json_content_types_may_carry_parameters() {
        let mut h = HeaderMap::new();
        for (v, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/plain", false),
            ("application/jsonx", false),
            ("application/x-www-form-urlencoded", false),
        ] {
            h.insert(CONTENT_TYPE, HeaderValue::from_static(v));
            assert_eq!(is_json(&h), ok, "{v}");
        }
        assert!(!is_json(&HeaderMap::new()));
    }
}
