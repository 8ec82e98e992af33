//! The request body of a quota stream as the service reads it: read ahead by a task of its own
//! ([`read_ahead`]), then Envoy's bytes through the [`Splitter`], its tallies counted in the
//! metrics and, the first time one of its reports loses a usage, logged once for the stream.
//!
//! Why read ahead: Envoy sends each new bucket's report alone, one small HTTP/2 DATA frame each,
//! and the HTTP/2 server (h2) closes a connection that holds too many small frames its
//! application has not read yet (GOAWAY `too_many_data_frames`, about 2,700 frames of 60 bytes).
//! A burst of new clients while the stream's session was busy closed the stream that way.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::sync::{mpsc, Notify};

use super::split::{Splitter, Tally};
use crate::metrics::Metrics;

/// A body whose gRPC messages were re-framed by a [`Splitter`].
pub struct SplitReports<B> {
    inner: B,
    splitter: Splitter,
    out: VecDeque<Bytes>,
    /// What was counted in the metrics so far.
    counted: Tally,
    metrics: Arc<Metrics>,
    warned: bool,
    done: bool,
}

impl<B> SplitReports<B> {
    pub fn new(inner: B, splitter: Splitter, metrics: Arc<Metrics>) -> Self {
        Self {
            inner,
            splitter,
            out: VecDeque::new(),
            counted: Tally::default(),
            metrics,
            warned: false,
            done: false,
        }
    }

    fn count(&mut self) {
        let now = self.splitter.tally();
        let was = std::mem::replace(&mut self.counted, now);
        let m = &self.metrics;
        m.count_rlqs_reports("whole", now.whole - was.whole);
        m.count_rlqs_reports("split", now.split - was.split);
        m.count_rlqs_usages_dropped("too_large", now.too_large - was.too_large);
        m.count_rlqs_usages_dropped("unreadable", now.unreadable - was.unreadable);
        if !self.warned && (now.too_large > 0 || now.unreadable > 0) {
            self.warned = true;
            tracing::warn!(
                too_large = now.too_large,
                unreadable = now.unreadable,
                "rlqs: a usage report held bucket usages larger than any valid bucket id (or than \
                 --max-body-bytes allows), or could not be read to its end: those buckets get no \
                 assignment (ratelimit_rlqs_usages_dropped_total; logged once per stream)"
            );
        }
    }
}

impl<B> Body for SplitReports<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        loop {
            if let Some(bytes) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                None => this.done = true,
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let mut out = Vec::new();
                        this.splitter.push(data, &mut out);
                        this.out.extend(out);
                        this.count();
                    }
                    // Trailers pass as they are.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.out.is_empty() && (self.done || self.inner.is_end_stream())
    }
}

/// What a [`ReadAhead`] holds: the bytes taken from the connection and not read yet.
#[derive(Default)]
struct Queued {
    bytes: AtomicUsize,
    drained: Notify,
}

/// A request body read by a task of its own as fast as the connection delivers it, up to
/// `max_queued_bytes` not read yet (then the task waits: the connection's flow control holds
/// the rest).
pub struct ReadAhead<E> {
    rx: mpsc::UnboundedReceiver<Result<Frame<Bytes>, E>>,
    queued: Arc<Queued>,
}

/// Starts reading `body` ahead (see [`ReadAhead`]); the task ends with the body, or when the
/// [`ReadAhead`] is dropped.
pub fn read_ahead<B>(mut body: B, max_queued_bytes: usize) -> ReadAhead<B::Error>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let queued = Arc::new(Queued::default());
    let q = queued.clone();
    tokio::spawn(async move {
        loop {
            while q.bytes.load(Ordering::Acquire) > max_queued_bytes {
                let drained = q.drained.notified();
                if q.bytes.load(Ordering::Acquire) <= max_queued_bytes {
                    break;
                }
                tokio::select! {
                    _ = drained => {}
                    _ = tx.closed() => return,
                }
            }
            let frame = tokio::select! {
                frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)) => frame,
                _ = tx.closed() => return,
            };
            let Some(frame) = frame else { return };
            // An error ends the body: it is passed on, and nothing is read after it (a body may
            // repeat its error at once, which would keep this task busy for ever).
            let (n, last) = match &frame {
                Ok(f) => (f.data_ref().map_or(0, Bytes::len), false),
                Err(_) => (0, true),
            };
            q.bytes.fetch_add(n, Ordering::AcqRel);
            if tx.send(frame).is_err() || last {
                return;
            }
        }
    });
    ReadAhead { rx, queued }
}

impl<E> Body for ReadAhead<E> {
    type Data = Bytes;
    type Error = E;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, E>>> {
        let frame = ready!(self.rx.poll_recv(cx));
        if let Some(Ok(f)) = &frame {
            let n = f.data_ref().map_or(0, Bytes::len);
            self.queued.bytes.fetch_sub(n, Ordering::AcqRel);
            self.queued.drained.notify_one();
        }
        Poll::Ready(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of `frames`, ready at once.
    struct Frames(VecDeque<Bytes>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }

    async fn next(body: &mut ReadAhead<std::convert::Infallible>) -> Option<Bytes> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx))
            .await
            .map(|f| f.unwrap().into_data().unwrap())
    }

    /// A body that fails, and fails again if polled again.
    struct Failing;

    impl Body for Failing {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(Some(Err("reset")))
        }
    }

    #[tokio::test]
    async fn a_body_that_fails_is_read_no_further() {
        let mut body = read_ahead(Failing, 1024);
        let first = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        assert!(matches!(first, Some(Err("reset"))));
        let after = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        assert!(after.is_none(), "the task ended after the error");
    }

    #[tokio::test]
    async fn a_body_is_read_ahead_up_to_its_bound_and_delivered_in_order() {
        let frames: VecDeque<Bytes> = (0..10u8).map(|i| Bytes::from(vec![i; 100])).collect();
        let mut body = read_ahead(Frames(frames), 250);
        // The task reads ahead until more than 250 bytes wait: three frames, not ten.
        while body.queued.bytes.load(Ordering::Acquire) <= 250 {
            tokio::task::yield_now().await;
        }
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(body.queued.bytes.load(Ordering::Acquire), 300);
        for i in 0..10u8 {
            assert_eq!(next(&mut body).await, Some(Bytes::from(vec![i; 100])));
        }
        assert_eq!(next(&mut body).await, None);
        assert_eq!(body.queued.bytes.load(Ordering::Acquire), 0);
    }
}
