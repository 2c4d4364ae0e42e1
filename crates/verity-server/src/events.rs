//! A request's engine events on the HTTP side, whichever API renders them: read one by one for a whole
//! answer, or forwarded as server-sent events.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, Sse};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::worker::Event;

/// An SSE response body.
pub type SseBody = Sse<UnboundedReceiverStream<Result<SseEvent, Infallible>>>;

/// A request's events, the first one already received (so that an error before any token is an HTTP error).
pub struct Events {
    first: Option<Event>,
    rx: UnboundedReceiver<Event>,
}

impl Events {
    pub fn new(first: Event, rx: UnboundedReceiver<Event>) -> Self {
        Events {
            first: Some(first),
            rx,
        }
    }

    /// The next event; an engine that drops the request mid-answer is an internal error.
    pub async fn next(&mut self) -> Result<Event, ApiError> {
        match self.first.take() {
            Some(e) => Ok(e),
            None => self
                .rx
                .recv()
                .await
                .ok_or_else(|| ApiError::internal("the engine dropped the request")),
        }
    }

    /// The events as an SSE stream: `opening` first, then what `render` makes of each event, until it says the
    /// stream has ended. A forwarding task owns the engine's receiver: when the client goes away the SSE stream
    /// is dropped, the forwarder's sends fail, it drops the receiver, and the engine's next send fails, which
    /// cancels the generation.
    pub fn into_sse(
        mut self,
        opening: Vec<SseEvent>,
        mut render: impl FnMut(Event) -> (Vec<SseEvent>, bool) + Send + 'static,
    ) -> SseBody {
        let (out, sse_rx) = unbounded_channel::<Result<SseEvent, Infallible>>();
        tokio::spawn(async move {
            if opening.into_iter().any(|e| out.send(Ok(e)).is_err()) {
                return;
            }
            while let Ok(ev) = self.next().await {
                let (events, last) = render(ev);
                for e in events {
                    if out.send(Ok(e)).is_err() {
                        return; // client gone: dropping the receiver cancels the generation
                    }
                }
                if last {
                    return;
                }
            }
        });
        Sse::new(UnboundedReceiverStream::new(sse_rx))
    }
}
