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
//!   head, written while no request is busy, is hyper's, and is replaced on its way out (see
//!   `stream::hyper_error_status`).
//! - A connection closes lingering: its write side first, then what the client still sends is read and dropped
//!   (for two seconds at most), so that an early answer (a 413 to a body still arriving) is not destroyed by the
//!   reset that closing on unread data would send.
//! - At most `max_connections` connections are served; one more is answered 503 and closed by a task of its
//!   own, so the accept loop never waits on a client.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, Response, StatusCode};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::limits::{Limits, MAX_HEAD, MAX_HEADERS};

mod stream;

use stream::{raw_response, GuardedIo};

/// Refusals (503 to a connection over the cap) in progress at once; past that, extra connections are closed
/// without a word, so a flood costs a socket each for an instant.
const MAX_REFUSALS: usize = 64;
/// How long a refusal waits for its 503 to be sent and the client's request to be drained.
const REFUSAL_GRACE: Duration = Duration::from_secs(1);

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
pub(super) enum Expiry {
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
pub(super) struct ConnState {
    clock: Mutex<Clock>,
    pub(super) limits: Limits,
}

impl ConnState {
    pub(super) fn new(limits: Limits) -> Self {
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

    pub(super) fn bytes_arrived(&self) {
        let mut c = self.clock();
        if let Phase::Waiting { .. } = c.phase {
            c.phase = Phase::Head {
                since: Instant::now(),
            };
        }
    }

    pub(super) fn busy(&self) -> bool {
        matches!(self.clock().phase, Phase::Busy { .. })
    }

    pub(super) fn begin_request(self: &Arc<Self>) -> InFlight {
        let mut c = self.clock();
        c.phase = match c.phase {
            Phase::Busy { requests } => Phase::Busy {
                requests: requests + 1,
            },
            _ => Phase::Busy { requests: 1 },
        };
        InFlight(self.clone())
    }

    pub(super) fn end_request(&self) {
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
    pub(super) fn read_deadline(&self, waker: &Waker) -> Option<(Instant, Expiry)> {
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
pub(super) struct InFlight(Arc<ConnState>);

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
