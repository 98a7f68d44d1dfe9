//! A response body that holds a guard until it has been sent or dropped.

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A body that holds `G` until it has been sent whole or dropped.
pub struct Holding<G> {
    inner: axum::body::Body,
    _guard: G,
}

impl<G> Holding<G> {
    pub fn new(inner: axum::body::Body, guard: G) -> Holding<G> {
        Holding {
            inner,
            _guard: guard,
        }
    }
}

impl<G: Unpin> HttpBody for Holding<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
