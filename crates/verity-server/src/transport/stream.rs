//! A connection's byte stream: the clocks of its phase, a stall clock on writes, the replacement of hyper's
//! bodiless error heads by JSON answers, and the lingering close.
//!
//! Invariant: answers of our own (a 408, or a JSON error standing in for hyper's) go out whole and before
//! anything else hyper writes; after one, the reader sees the end of the stream.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::{ConnState, Expiry};
use crate::error::ApiError;
use crate::limits::{MAX_HEAD, MAX_HEADERS};

/// How long a closing connection keeps reading what the client still sends, and how much it reads at most.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 4 * crate::MAX_BODY;

/// A complete HTTP/1.1 response carrying `err`, for answers written to the socket directly, after which the
/// connection closes.
pub(super) fn raw_response(err: &ApiError) -> Vec<u8> {
    let body = err.body().to_string();
    let retry = if err.status == StatusCode::SERVICE_UNAVAILABLE {
        "retry-after: 1\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{retry}connection: close\r\n\r\n{body}",
        err.status.as_u16(),
        err.status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

/// The status of an automatic error response of hyper's (a head without Content-Type for 400, 414 or 431), or
/// `None` for anything else.
fn hyper_error_status(buf: &[u8]) -> Option<StatusCode> {
    let rest = buf
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| buf.strip_prefix(b"HTTP/1.0 "))?;
    let status = match rest.get(..4)? {
        b"400 " => StatusCode::BAD_REQUEST,
        b"414 " => StatusCode::URI_TOO_LONG,
        b"431 " => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        _ => return None,
    };
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let typed = buf[..end]
        .split(|&b| b == b'\n')
        .any(|line| line.len() >= 13 && line[..13].eq_ignore_ascii_case(b"content-type:"));
    (!typed).then_some(status)
}

/// The JSON answer standing in for hyper's bodiless one.
fn protocol_error(status: StatusCode) -> ApiError {
    let message = match status {
        StatusCode::URI_TOO_LONG => "the request URI is too long".to_string(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => format!(
            "the request head is too large (at most {MAX_HEAD} bytes and {MAX_HEADERS} headers)"
        ),
        _ => "malformed HTTP/1.1 request: a bad request line or header, or a missing, invalid or \
              conflicting Content-Length or Transfer-Encoding"
            .to_string(),
    };
    ApiError::new(status, "invalid_request_error", message)
}

/// A connection's byte stream with its clocks: the read clock of the phase, a stall clock on writes, and an
/// outbox for answers of our own (a 408, or the JSON replacing one of hyper's error heads), which goes out
/// before anything else.
pub(super) struct GuardedIo<T> {
    inner: T,
    conn: Arc<ConnState>,
    read_clock: Pin<Box<Sleep>>,
    stall_clock: Pin<Box<Sleep>>,
    /// Whether `stall_clock` runs: set when a write finds the socket full, cleared by any progress.
    stalled: bool,
    stall_limit: Duration,
    outbox: Vec<u8>,
    sent: usize,
    /// After a timeout the reader sees the end of the stream.
    read_closed: bool,
    /// Closing: the write side is shut and input is drained until this deadline.
    linger: Option<Instant>,
    lingered: usize,
}

impl<T: AsyncRead + AsyncWrite + Unpin> GuardedIo<T> {
    pub(super) fn new(inner: T, conn: Arc<ConnState>, stall_limit: Duration) -> Self {
        GuardedIo {
            inner,
            conn,
            read_clock: Box::pin(tokio::time::sleep(Duration::ZERO)),
            stall_clock: Box::pin(tokio::time::sleep(Duration::ZERO)),
            stalled: false,
            stall_limit,
            outbox: Vec::new(),
            sent: 0,
            read_closed: false,
            linger: None,
            lingered: 0,
        }
    }

    /// Read and drop input until the client closes, [`LINGER`] passes or [`LINGER_BYTES`] came.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut scratch = [0u8; 8192];
        while self.lingered < LINGER_BYTES {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    self.lingered += buf.filled().len()
                }
                Poll::Ready(_) => return Poll::Ready(()),
                Poll::Pending => return self.read_clock.as_mut().poll(cx),
            }
        }
        Poll::Ready(())
    }

    /// A write found the socket full: pending until the stall clock runs out, then an error.
    fn stall<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        if !self.stalled {
            self.stalled = true;
            let deadline = Instant::now() + self.stall_limit;
            self.stall_clock.as_mut().reset(deadline);
        }
        ready!(self.stall_clock.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client stopped reading",
        )))
    }

    fn poll_outbox(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.outbox.len() {
            match Pin::new(&mut self.inner).poll_write(cx, &self.outbox[self.sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    self.stalled = false;
                    self.sent += n;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return self.stall(cx),
            }
        }
        Poll::Ready(Ok(()))
    }

    fn send_own(&mut self, err: &ApiError) {
        self.outbox = raw_response(err);
        self.sent = 0;
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for GuardedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.read_closed {
            ready!(this.poll_outbox(cx))?;
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.conn.bytes_arrived();
                }
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
        let Some((deadline, expiry)) = this.conn.read_deadline(cx.waker()) else {
            return Poll::Pending;
        };
        if this.read_clock.deadline() != deadline {
            this.read_clock.as_mut().reset(deadline);
        }
        ready!(this.read_clock.as_mut().poll(cx));
        this.read_closed = true;
        if expiry == Expiry::RequestTimeout {
            let limit = this.conn.limits.header_timeout;
            this.send_own(&ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request head did not arrive within {} s",
                    limit.as_secs_f32()
                ),
            ));
        }
        ready!(this.poll_outbox(cx))?;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for GuardedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_outbox(cx))?;
        if !this.conn.busy() {
            if let Some(status) = hyper_error_status(buf) {
                this.send_own(&protocol_error(status));
                // hyper closes the connection after its error; the reader must not wait for another request.
                this.read_closed = true;
                return Poll::Ready(Ok(buf.len()));
            }
        }
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Pending => this.stall(cx),
            done => {
                this.stalled = false;
                done
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_outbox(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.linger.is_none() {
            ready!(this.poll_outbox(cx))?;
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            let deadline = Instant::now() + LINGER;
            this.linger = Some(deadline);
            this.read_clock.as_mut().reset(deadline);
        }
        this.poll_linger(cx).map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::Limits;
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt};

    fn limits(ms: u64) -> Limits {
        Limits {
            header_timeout: Duration::from_millis(ms),
            body_timeout: Duration::from_millis(ms),
            idle_timeout: Duration::from_millis(ms),
            max_connections: 1,
        }
    }

    #[test]
    fn only_bodiless_error_heads_are_hypers() {
        let hyper_400 = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        assert_eq!(hyper_error_status(hyper_400), Some(StatusCode::BAD_REQUEST));
        let hyper_431 =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(
            hyper_error_status(hyper_431),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        let ours = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(hyper_error_status(ours), None);
        assert_eq!(hyper_error_status(b"HTTP/1.1 200 OK\r\n\r\n"), None);
        assert_eq!(hyper_error_status(b"HTTP/1.1 400 Bad"), None);
        assert_eq!(hyper_error_status(b"data: HTTP/1.1 400 \r\n\r\n"), None);
    }

    #[tokio::test]
    async fn a_head_that_does_not_complete_in_time_is_answered_408() {
        let (mut client, server) = duplex(1 << 16);
        let conn = Arc::new(ConnState::new(limits(100)));
        let mut io = GuardedIo::new(server, conn, Duration::from_secs(5));
        client.write_all(b"GET / HT").await.unwrap();
        let mut buf = vec![0u8; 64];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"GET / HT");
        // The rest never comes: the server side sees the end and the client a 408.
        assert_eq!(io.read(&mut buf).await.unwrap(), 0);
        drop(io);
        let mut answer = String::new();
        client.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
        assert!(answer.contains("\"request_timeout\""), "{answer}");
    }

    #[tokio::test]
    async fn an_idle_connection_is_closed_silently_and_a_busy_one_never() {
        let (mut client, server) = duplex(1 << 16);
        let conn = Arc::new(ConnState::new(limits(100)));
        let mut io = GuardedIo::new(server, conn.clone(), Duration::from_secs(5));
        let busy = conn.begin_request();
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(Duration::from_millis(400), io.read(&mut buf)).await;
        assert!(read.is_err(), "a busy connection was timed out");
        drop(busy);
        let t = std::time::Instant::now();
        assert_eq!(io.read(&mut buf).await.unwrap(), 0);
        assert!(t.elapsed() >= Duration::from_millis(90));
        drop(io);
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert!(answer.is_empty());
    }

    #[tokio::test]
    async fn hypers_error_heads_go_out_as_json() {
        let (mut client, server) = duplex(1 << 16);
        let conn = Arc::new(ConnState::new(limits(1000)));
        let mut io = GuardedIo::new(server, conn, Duration::from_secs(5));
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n";
        let peer = tokio::spawn(async move {
            let mut answer = String::new();
            client.read_to_string(&mut answer).await.unwrap();
            answer
        });
        io.write_all(head).await.unwrap();
        io.shutdown().await.unwrap();
        let answer = peer.await.unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 "), "{answer}");
        assert!(head.contains("content-type: application/json"), "{answer}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }

    #[tokio::test]
    async fn closing_drains_what_the_client_still_sends_until_it_closes() {
        let (mut client, server) = duplex(1 << 20);
        let conn = Arc::new(ConnState::new(limits(1000)));
        let mut io = GuardedIo::new(server, conn, Duration::from_secs(5));
        client.write_all(&[b'x'; 100_000]).await.unwrap();
        let peer = tokio::spawn(async move {
            // The client sees the end of the answer, then hangs up.
            let mut rest = Vec::new();
            client.read_to_end(&mut rest).await.unwrap();
        });
        let t = std::time::Instant::now();
        io.shutdown().await.unwrap();
        assert!(t.elapsed() < LINGER / 2, "{:?}", t.elapsed());
        assert_eq!(io.lingered, 100_000);
        peer.await.unwrap();
    }

    #[tokio::test]
    async fn a_response_the_client_never_reads_is_cut_after_the_stall_limit() {
        let (_client, server) = duplex(1024);
        let conn = Arc::new(ConnState::new(limits(1000)));
        let _busy = conn.begin_request();
        let mut io = GuardedIo::new(server, conn, Duration::from_millis(100));
        let e = io.write_all(&[b'x'; 4096]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }
}
