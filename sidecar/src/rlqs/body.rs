//! The request body of a quota stream as the service reads it: Envoy's bytes through the
//! [`Splitter`], its tallies counted in the metrics and, the first time one of its reports loses
//! a usage, logged once for the stream.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};

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
