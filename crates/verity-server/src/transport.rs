//! Connections: accepting under a cap, hyper's HTTP/1 on each, and the clocks that close a connection which
//! does not move.
//!
//! Invariants:
//! - A connection is always in one of three phases. *Waiting* for a request: closed silently after the header
//!   timeout when fresh, after the idle timeout when kept alive. *Reading a head*: answered 408 and closed when
//!   the head is not complete within the header timeout of its first byte (however slowly it dribbles in).
//!   *Busy*: a request is in the app, where [`crate::limits`] bounds its body; nothing here bounds the time a
//!   generation takes. Only a response that makes no progress for the idle timeout (a client that stopped
//!   reading) is cut.
//! - Every error response has a JSON body. hyper answers requests it cannot parse (400, 414, 431) by itself,
//!   with an empty body and no Content-Type; the app never sends an error without a Content-Type, so such a
//!   head, written while no request is busy, is hyper's, and is replaced on its way out ([`hyper_error_status`]).
//! - A connection closes lingering: its write side first, then what the client still sends is read and
//!   dropped (for [`LINGER`] at most), so that an early answer (a 413 to a body still arriving) is not destroyed
//!   by the reset that closing on unread data would send.
//! - At most `max_connections` connections are served; one more is answered 503 and closed by a task of its
//!   own, so the accept loop never waits on a client.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, Response, StatusCode};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::error::ApiError;
use crate::limits::{Limits, MAX_HEAD, MAX_HEADERS};

/// Refusals (503 to a connection over the cap) in progress at once; past that, extra connections are closed
/// without a word, so a flood costs a socket each for an instant.
const MAX_REFUSALS: usize = 64;
/// How long a refusal waits for its 503 to be sent and the client's request to be drained.
const REFUSAL_GRACE: Duration = Duration::from_secs(1);
/// How long a closing connection keeps reading what the client still sends, and how much it reads at most.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 4 * crate::MAX_BODY;

/// Accept connections until `shutdown` resolves, then let the connections in progress finish.
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS));
    let mut http = http1::Builder::new();
    http.keep_alive(true)
        // The clocks are ours (`GuardedIo`): hyper's header timeout would also run while a connection idles.
        .header_read_timeout(None)
        .max_header_size(MAX_HEAD)
        .max_headers(MAX_HEADERS)
        // One flat buffer per write, so that hyper's own error heads arrive whole in one `poll_write`.
        .writev(false);
    let (stop, stopped) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait for connections to close instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                let (app, http, stopped) = (app.clone(), http.clone(), stopped.clone());
                tokio::spawn(async move {
                    serve_connection(stream, app, http, limits, stopped).await;
                    drop(slot);
                });
            }
            Err(_) => {
                if let Ok(turn) = refusals.clone().try_acquire_owned() {
                    tokio::spawn(async move {
                        refuse(stream).await;
                        drop(turn);
                    });
                }
            }
        }
    }
    let _ = stop.send(true);
    // Every connection holds a slot until it ends.
    let _ = slots.acquire_many(limits.max_connections as u32).await;
    Ok(())
}

async fn serve_connection(
    stream: TcpStream,
    app: Router,
    http: http1::Builder,
    limits: Limits,
    mut stopped: watch::Receiver<bool>,
) {
    // Tokens go out as they come: no Nagle delay on small SSE chunks.
    let _ = stream.set_nodelay(true);
    let conn = Arc::new(ConnState::new(limits));
    let io = TokioIo::new(GuardedIo::new(stream, conn.clone(), limits.idle_timeout));
    let service = Tracked {
        app: TowerToHyperService::new(app),
        conn,
    };
    let served = http.serve_connection(io, service);
    tokio::pin!(served);
    let stopping = async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    let result = tokio::select! {
        r = served.as_mut() => r,
        () = stopping => {
            served.as_mut().graceful_shutdown();
            served.await
        }
    };
    if let Err(e) = result {
        tracing::debug!("connection ended: {e}");
    }
}

/// Answer a connection over the cap with a 503 and close it, draining what the client sent so that the answer
/// is read rather than lost to a reset.
async fn refuse(mut stream: TcpStream) {
    let err = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_overloaded",
        "too many open connections; retry shortly",
    );
    let _ = tokio::time::timeout(REFUSAL_GRACE, async {
        stream.write_all(&raw_response(&err)).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// A complete HTTP/1.1 response carrying `err`, for answers written to the socket directly, after which the
/// connection closes.
fn raw_response(err: &ApiError) -> Vec<u8> {
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No byte of the next request yet; closed silently after `limit`.
    Waiting { since: Instant, limit: Duration },
    /// Part of a head has arrived; answered 408 after the header timeout.
    Head { since: Instant },
    /// `requests` are in the app or being answered.
    Busy { requests: usize },
}

/// What a connection's read clock does when it runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Close,
    RequestTimeout,
}

struct Clock {
    phase: Phase,
    /// The task reading the connection, woken when a request ends so that it arms the idle clock.
    reader: Option<Waker>,
}

/// The phase of one connection, shared by its IO (bytes arriving), its service (requests starting) and its
/// response bodies (requests ending).
struct ConnState {
    clock: Mutex<Clock>,
    limits: Limits,
}

impl ConnState {
    fn new(limits: Limits) -> Self {
        ConnState {
            clock: Mutex::new(Clock {
                phase: Phase::Waiting {
                    since: Instant::now(),
                    limit: limits.header_timeout,
                },
                reader: None,
            }),
            limits,
        }
    }

    fn clock(&self) -> std::sync::MutexGuard<'_, Clock> {
        // A panic while holding this lock leaves a phase that is still valid.
        self.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bytes_arrived(&self) {
        let mut c = self.clock();
        if let Phase::Waiting { .. } = c.phase {
            c.phase = Phase::Head {
                since: Instant::now(),
            };
        }
    }

    fn busy(&self) -> bool {
        matches!(self.clock().phase, Phase::Busy { .. })
    }

    fn begin_request(self: &Arc<Self>) -> InFlight {
        let mut c = self.clock();
        c.phase = match c.phase {
            Phase::Busy { requests } => Phase::Busy {
                requests: requests + 1,
            },
            _ => Phase::Busy { requests: 1 },
        };
        InFlight(self.clone())
    }

    fn end_request(&self) {
        let mut c = self.clock();
        if let Phase::Busy { requests } = c.phase {
            c.phase = if requests > 1 {
                Phase::Busy {
                    requests: requests - 1,
                }
            } else {
                Phase::Waiting {
                    since: Instant::now(),
                    limit: self.limits.idle_timeout,
                }
            };
            if let Some(w) = c.reader.take() {
                w.wake();
            }
        }
    }

    /// When the read clock runs out and what happens then; `None` while busy. Remembers `waker` to re-arm the
    /// clock when the phase changes.
    fn read_deadline(&self, waker: &Waker) -> Option<(Instant, Expiry)> {
        let mut c = self.clock();
        c.reader = Some(waker.clone());
        match c.phase {
            Phase::Waiting { since, limit } => Some((since + limit, Expiry::Close)),
            Phase::Head { since } => {
                Some((since + self.limits.header_timeout, Expiry::RequestTimeout))
            }
            Phase::Busy { .. } => None,
        }
    }
}

/// A request in progress; dropping it (when its response body is done or abandoned) ends the request.
struct InFlight(Arc<ConnState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end_request();
    }
}

/// The app as hyper's service, marking each request busy until its response body is dropped.
struct Tracked {
    app: TowerToHyperService<Router>,
    conn: Arc<ConnState>,
}

type Answer = Result<Response<TrackedBody>, Infallible>;

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Answer> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let in_flight = self.conn.begin_request();
        let answer = self.app.call(req);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| TrackedBody {
                body,
                _in_flight: in_flight,
            }))
        })
    }
}

struct TrackedBody {
    body: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A connection's byte stream with its clocks: the read clock of the phase, a stall clock on writes, and an
/// outbox for answers of our own (a 408, or the JSON replacing one of hyper's error heads), which goes out
/// before anything else.
struct GuardedIo<T> {
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
    fn new(inner: T, conn: Arc<ConnState>, stall_limit: Duration) -> Self {
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
    use tokio::io::duplex;

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
