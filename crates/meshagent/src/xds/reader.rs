//! The upstream side of an ADS stream: istiod's responses deframed here, not by tonic's
//! `Streaming`.
//!
//! tonic reads a stream into one `BytesMut` and reserves each message's length in it
//! (tonic 0.14 `codec/decode.rs` `decode_chunk`), so the buffer of a stream keeps the
//! allocation of a large message after it was forwarded: with [`super::codec::RawDecoder`]
//! until the next message arrives, which on a quiet mesh is never. After a 10,000-cluster
//! push that was a 3.8 MiB CDS response resident for the stream's life (Istio's agent, in
//! Go, lets the collector take it back). Here each message gets a buffer of exactly its
//! length, which is the forwarded `Bytes` itself: once Envoy has it and the agent has
//! dropped it, nothing of it stays. A message that arrived within one HTTP/2 DATA frame is
//! sliced out of that frame without a copy.
//!
//! The request side, the headers and the call itself stay tonic's: [`TakeBody`] wraps the
//! channel, lets tonic check the response headers as it always does (HTTP status,
//! `grpc-encoding`, a trailers-only `grpc-status`), and hands the body to [`MessageReader`]
//! in place of tonic's decoder. The end-of-stream rules are tonic's (`infer_grpc_status`),
//! so a stream ends with the same `Status` as before.
//!
//! The same holds for the requests a server reads from Envoy: Envoy's first request on
//! each stream carries its node with the extension list (~70 KiB), and tonic's buffer for
//! the stream kept that capacity for the stream's life (heaptrack of a settled sidecar: two
//! SDS streams and the ADS stream, ~220 KiB). [`MessageReader::request`] reads a request
//! body; the ADS server hands it its body directly, the tonic-generated SDS server gets it
//! through [`TakeRequestBody`].

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use tonic::Status;
use tonic::body::Body;

/// The gRPC message prefix: compressed flag and big-endian u32 length.
const PREFIX: usize = 5;

/// What [`TakeBody`] took from the response of its call.
pub struct Taken {
    status: http::StatusCode,
    /// The headers carried no `grpc-status`: the status comes in trailers (tonic's
    /// `expect_additional_trailers`).
    expect_trailers: bool,
    body: Body,
}

/// A channel whose response body goes to the caller, not to tonic's decoder: tonic gets
/// the response's headers and an empty body (its `Streaming` is dropped unread).
#[derive(Clone)]
pub struct TakeBody {
    inner: tonic::transport::Channel,
    slot: Arc<Mutex<Option<Taken>>>,
}

impl TakeBody {
    pub fn new(inner: tonic::transport::Channel) -> TakeBody {
        TakeBody {
            inner,
            slot: Arc::default(),
        }
    }

    /// The body of the call made through this service, once tonic has accepted the response.
    pub fn reader(&self) -> Result<MessageReader, Status> {
        let taken = self
            .slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .ok_or_else(|| Status::internal("the upstream response body was not taken"))?;
        Ok(MessageReader::new(taken))
    }
}

impl tower::Service<http::Request<Body>> for TakeBody {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = BoxFuture<'static, Result<http::Response<Body>, tonic::transport::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let call = self.inner.call(req);
        let slot = self.slot.clone();
        Box::pin(async move {
            let resp = call.await?;
            let (parts, body) = resp.into_parts();
            let taken = Taken {
                status: parts.status,
                expect_trailers: Status::from_header_map(&parts.headers).is_none(),
                body,
            };
            *slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(taken);
            Ok(http::Response::from_parts(parts, Body::empty()))
        })
    }
}

/// A request's body, taken out before a tonic-generated server builds its `Streaming`:
/// found in the request's extensions by the handler, which reads it with
/// [`MessageReader::request`]. tonic decodes an empty body in its place.
#[derive(Clone)]
pub struct TakenBody(Arc<Mutex<Option<Body>>>);

impl TakenBody {
    pub fn new(body: Body) -> TakenBody {
        TakenBody(Arc::new(Mutex::new(Some(body))))
    }

    /// The body, once (`None` when already taken).
    pub fn take(&self) -> Option<Body> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// The layer that puts each request's body into its extensions as a [`TakenBody`].
#[derive(Clone, Copy, Debug, Default)]
pub struct TakeRequestBody;

impl<S> tower::Layer<S> for TakeRequestBody {
    type Service = TakeRequestBodyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TakeRequestBodyService { inner }
    }
}

/// See [`TakeRequestBody`].
#[derive(Clone, Debug)]
pub struct TakeRequestBodyService<S> {
    inner: S,
}

impl<S> tower::Service<http::Request<Body>> for TakeRequestBodyService<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        parts.extensions.insert(TakenBody::new(body));
        self.inner
            .call(http::Request::from_parts(parts, Body::empty()))
    }
}

/// Reads gRPC messages off a response or request body, each into a buffer of its own length.
pub struct MessageReader {
    body: Body,
    status: http::StatusCode,
    expect_trailers: bool,
    /// A request body (a server reading its client), not a response: tonic's request rules.
    request: bool,
    /// The largest message accepted (tonic's `max_decoding_message_size`).
    limit: usize,
    /// The unread rest of the last DATA frame.
    chunk: Bytes,
    prefix: [u8; PREFIX],
    prefix_len: usize,
    /// The message being assembled across frames, and its length.
    partial: Option<(BytesMut, usize)>,
    trailers: Option<http::HeaderMap>,
    done: bool,
}

impl MessageReader {
    fn new(t: Taken) -> MessageReader {
        MessageReader {
            body: t.body,
            status: t.status,
            expect_trailers: t.expect_trailers,
            request: false,
            // No agent-side limit on istiod's messages: Envoy's own is the one that matters
            // (istio#52815); a length is at most u32::MAX by the framing.
            limit: usize::MAX,
            chunk: Bytes::new(),
            prefix: [0; PREFIX],
            prefix_len: 0,
            partial: None,
            trailers: None,
            done: false,
        }
    }

    /// A server's reader of its client's messages (tonic's `Streaming::new_request`): the
    /// stream ends with the body (trailers and a client's cancel included), and a message
    /// over `limit` bytes is refused with tonic's `OutOfRange` and wording.
    pub fn request(body: Body, limit: usize) -> MessageReader {
        MessageReader {
            request: true,
            limit,
            ..MessageReader::new(Taken {
                status: http::StatusCode::OK,
                expect_trailers: false,
                body,
            })
        }
    }

    /// The next message; `Ok(None)` when the stream ended with an OK status, `Err` with the
    /// status it ended with otherwise (both once; `Ok(None)` after that).
    pub async fn message(&mut self) -> Result<Option<Bytes>, Status> {
        if self.done {
            return Ok(None);
        }
        loop {
            match self.take_message() {
                Ok(Some(m)) => return Ok(Some(m)),
                Ok(None) => {}
                Err(s) => {
                    self.done = true;
                    return Err(s);
                }
            }
            match self.body.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.chunk = data,
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            match &mut self.trailers {
                                Some(have) => have.extend(t),
                                None => self.trailers = Some(t),
                            }
                            return self.end();
                        }
                    }
                },
                // A client that cancels its request stream ends it (tonic: `poll_frame`).
                Some(Err(s)) if self.request && s.code() == tonic::Code::Cancelled => {
                    self.done = true;
                    return Ok(None);
                }
                Some(Err(s)) => {
                    self.done = true;
                    return Err(s);
                }
                None => {
                    if self.prefix_len > 0 || self.partial.is_some() {
                        self.done = true;
                        // tonic's words for it (`codec/decode.rs` `poll_frame`).
                        return Err(Status::internal("Unexpected EOF decoding stream."));
                    }
                    return self.end();
                }
            }
        }
    }

    /// A message complete in what has been read, consuming it from [`Self::chunk`].
    fn take_message(&mut self) -> Result<Option<Bytes>, Status> {
        loop {
            if let Some((buf, len)) = &mut self.partial {
                let n = (*len - buf.len()).min(self.chunk.len());
                buf.extend_from_slice(&self.chunk[..n]);
                self.chunk.advance(n);
                if buf.len() < *len {
                    return Ok(None);
                }
                let msg = std::mem::take(buf).freeze();
                self.partial = None;
                self.prefix_len = 0;
                return Ok(Some(msg));
            }
            if self.prefix_len < PREFIX {
                let n = (PREFIX - self.prefix_len).min(self.chunk.len());
                self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&self.chunk[..n]);
                self.chunk.advance(n);
                self.prefix_len += n;
                if self.prefix_len < PREFIX {
                    return Ok(None);
                }
            }
            match self.prefix[0] {
                0 => {}
                // The agent accepts no compression, so tonic has no encoding here either.
                1 => {
                    return Err(Status::internal(
                        "protocol error: received message with compressed-flag but no grpc-encoding was specified",
                    ));
                }
                f if self.request => {
                    return Err(Status::internal(format!(
                        "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1), while sending request"
                    )));
                }
                f => {
                    return Err(Status::internal(format!(
                        "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1) while receiving response with status: {}",
                        self.status
                    )));
                }
            }
            let len = u32::from_be_bytes([
                self.prefix[1],
                self.prefix[2],
                self.prefix[3],
                self.prefix[4],
            ]) as usize;
            if len > self.limit {
                return Err(Status::out_of_range(format!(
                    "Error, decoded message length too large: found {len} bytes, the limit is: {} bytes",
                    self.limit
                )));
            }
            if self.chunk.len() >= len {
                self.prefix_len = 0;
                return Ok(Some(self.chunk.split_to(len)));
            }
            self.partial = Some((BytesMut::with_capacity(len), len));
        }
    }

    /// The end of the body: tonic's `infer_grpc_status` (`status.rs`), as `Streaming` applies
    /// it to a response.
    fn end(&mut self) -> Result<Option<Bytes>, Status> {
        self.done = true;
        if !self.expect_trailers {
            return Ok(None);
        }
        if let Some(s) = self.trailers.as_ref().and_then(Status::from_header_map) {
            return if s.code() == tonic::Code::Ok {
                Ok(None)
            } else {
                Err(s)
            };
        }
        use http::StatusCode as H;
        let code = match self.status {
            H::BAD_REQUEST => tonic::Code::Internal,
            H::UNAUTHORIZED => tonic::Code::Unauthenticated,
            H::FORBIDDEN => tonic::Code::PermissionDenied,
            H::NOT_FOUND => tonic::Code::Unimplemented,
            H::TOO_MANY_REQUESTS | H::BAD_GATEWAY | H::SERVICE_UNAVAILABLE | H::GATEWAY_TIMEOUT => {
                tonic::Code::Unavailable
            }
            H::OK => {
                return Err(Status::unknown(
                    "protocol error: missing grpc-status trailer, stream was terminated without a final status (possible truncation by a proxy or load balancer)",
                ));
            }
            _ => tonic::Code::Unknown,
        };
        Err(Status::new(
            code,
            format!(
                "grpc-status header missing, mapped from HTTP status code {}",
                self.status.as_u16()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::convert::Infallible;

    /// A reader over the given frames (data, then optional trailers).
    fn reader(
        status: http::StatusCode,
        data: Vec<Vec<u8>>,
        trailers: Option<(&str, &str)>,
    ) -> MessageReader {
        let mut frames: Vec<Result<http_body::Frame<Bytes>, Status>> = data
            .into_iter()
            .map(|d| Ok(http_body::Frame::data(Bytes::from(d))))
            .collect();
        if let Some((code, msg)) = trailers {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-status", code.parse().unwrap());
            if !msg.is_empty() {
                h.insert("grpc-message", msg.parse().unwrap());
            }
            frames.push(Ok(http_body::Frame::trailers(h)));
        }
        MessageReader::new(Taken {
            status,
            expect_trailers: true,
            body: frames_body(frames),
        })
    }

    fn framed(msgs: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in msgs {
            out.push(0);
            out.extend_from_slice(&(m.len() as u32).to_be_bytes());
            out.extend_from_slice(m);
        }
        out
    }

    async fn all(r: &mut MessageReader) -> (Vec<Bytes>, Result<(), Status>) {
        let mut out = Vec::new();
        loop {
            match r.message().await {
                Ok(Some(m)) => out.push(m),
                Ok(None) => return (out, Ok(())),
                Err(s) => return (out, Err(s)),
            }
        }
    }

    #[tokio::test]
    async fn messages_split_anywhere_across_frames_come_out_whole() {
        let big = vec![7u8; 100_000];
        let msgs: [&[u8]; 4] = [b"one", b"", &big, b"four"];
        let wire = framed(&msgs);
        // Every split point of the first 40 bytes, and frames of 16 KiB after it.
        for cut in 0..40 {
            let mut frames = vec![wire[..cut].to_vec()];
            frames.extend(wire[cut..].chunks(16 * 1024).map(<[u8]>::to_vec));
            let mut r = reader(http::StatusCode::OK, frames, Some(("0", "")));
            let (got, end) = all(&mut r).await;
            assert!(end.is_ok(), "cut {cut}: {end:?}");
            assert_eq!(got.len(), 4, "cut {cut}");
            for (g, m) in got.iter().zip(msgs) {
                assert_eq!(&g[..], m, "cut {cut}");
            }
            // Ended: the same answer again, no panic.
            assert!(r.message().await.unwrap().is_none());
        }
    }

    /// The point of the reader: a large message owns a buffer of exactly its length (nothing
    /// shared with a stream buffer that outlives it), so dropping it frees it.
    #[tokio::test]
    async fn a_large_message_is_its_own_allocation() {
        let big = vec![1u8; 1 << 20];
        let wire = framed(&[&big, b"x"]);
        let frames = wire.chunks(16 * 1024).map(<[u8]>::to_vec).collect();
        let mut r = reader(http::StatusCode::OK, frames, Some(("0", "")));
        let m = r.message().await.unwrap().unwrap();
        assert_eq!(m.len(), 1 << 20);
        // Unique and exactly sized: converting back to a BytesMut does not copy and its
        // capacity is the message's.
        let back = m
            .try_into_mut()
            .expect("the message's buffer is not shared");
        assert_eq!(back.capacity(), 1 << 20);
        assert_eq!(&r.message().await.unwrap().unwrap()[..], b"x");
    }

    #[tokio::test]
    async fn ends_as_tonic_ends_a_response() {
        // grpc-status in trailers.
        let mut r = reader(
            http::StatusCode::OK,
            vec![framed(&[b"a"])],
            Some(("14", "upstream gone")),
        );
        let (got, end) = all(&mut r).await;
        assert_eq!(got.len(), 1);
        let s = end.unwrap_err();
        assert_eq!(
            (s.code(), s.message()),
            (tonic::Code::Unavailable, "upstream gone")
        );
        // No trailers on a 200: tonic's Unknown.
        let mut r = reader(http::StatusCode::OK, vec![framed(&[b"a"])], None);
        let s = all(&mut r).await.1.unwrap_err();
        assert_eq!(s.code(), tonic::Code::Unknown);
        assert!(s.message().contains("missing grpc-status trailer"), "{s:?}");
        // No trailers on a 503: mapped from the HTTP status.
        let mut r = reader(http::StatusCode::SERVICE_UNAVAILABLE, vec![], None);
        let s = all(&mut r).await.1.unwrap_err();
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(
            s.message(),
            "grpc-status header missing, mapped from HTTP status code 503"
        );
        // A body cut inside a message.
        let mut wire = framed(&[b"abcdef"]);
        wire.truncate(8);
        let mut r = reader(http::StatusCode::OK, vec![wire], None);
        let s = all(&mut r).await.1.unwrap_err();
        assert_eq!(
            (s.code(), s.message()),
            (tonic::Code::Internal, "Unexpected EOF decoding stream.")
        );
        // A compressed message the agent never negotiated.
        let mut wire = framed(&[b"z"]);
        wire[0] = 1;
        let mut r = reader(http::StatusCode::OK, vec![wire], Some(("0", "")));
        let s = all(&mut r).await.1.unwrap_err();
        assert_eq!(s.code(), tonic::Code::Internal);
        assert!(s.message().contains("compressed-flag"), "{s:?}");
        // A trailers-only OK response (grpc-status in the headers): an empty stream.
        let mut r = reader(http::StatusCode::OK, vec![], None);
        r.expect_trailers = false;
        assert!(r.message().await.unwrap().is_none());
    }

    /// Frames (data, or trailers, or an error) as a body.
    fn frames_body(frames: Vec<Result<http_body::Frame<Bytes>, Status>>) -> Body {
        Body::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )))
    }

    /// The reader of a server's requests against tonic's own (`Streaming::new_request` with
    /// the raw decoder the ADS server used): the same messages and the same end, status code
    /// and text, for each way a request stream can go.
    #[tokio::test]
    async fn reads_requests_as_tonic_reads_them() {
        let data = |b: Vec<u8>| Ok(http_body::Frame::data(Bytes::from(b)));
        let trailers = || Ok(http_body::Frame::trailers(http::HeaderMap::new()));
        let big = vec![3u8; 70_000];
        let mut flagged = framed(&[b"a"]);
        flagged[0] = 7;
        let mut compressed = framed(&[b"a"]);
        compressed[0] = 1;
        let mut cut = framed(&[b"abcdef"]);
        cut.truncate(8);
        type Frames = Vec<Result<http_body::Frame<Bytes>, Status>>;
        type Case<'a> = (&'static str, Box<dyn Fn() -> Frames + 'a>);
        let cases: Vec<Case<'_>> = vec![
            (
                "half-closed",
                Box::new(|| vec![data(framed(&[b"one", b"", b"two"]))]),
            ),
            (
                "split",
                Box::new(move || {
                    framed(&[&big, b"x"])
                        .chunks(16 * 1024)
                        .map(|c| data(c.to_vec()))
                        .collect()
                }),
            ),
            (
                "trailers",
                Box::new(move || vec![data(framed(&[b"a"])), trailers()]),
            ),
            (
                "trailers inside a message",
                Box::new(|| {
                    let mut w = framed(&[b"abcdef"]);
                    w.truncate(8);
                    vec![data(w), trailers()]
                }),
            ),
            (
                "cancelled",
                Box::new(|| vec![data(framed(&[b"a"])), Err(Status::cancelled("gone"))]),
            ),
            (
                "reset",
                Box::new(|| {
                    vec![
                        data(framed(&[b"a"])),
                        Err(Status::unknown("error reading a body from connection")),
                    ]
                }),
            ),
            (
                "over the limit",
                Box::new(|| vec![data(framed(&[b"a", &[0u8; 100]]))]),
            ),
            (
                "cut inside a message",
                Box::new(move || vec![data(cut.clone())]),
            ),
            (
                "invalid flag",
                Box::new(move || vec![data(flagged.clone())]),
            ),
            (
                "compressed",
                Box::new(move || vec![data(compressed.clone())]),
            ),
        ];
        const LIMIT: usize = 64;
        for (name, frames) in &cases {
            let limit = if *name == "over the limit" {
                LIMIT
            } else {
                1 << 20
            };
            let mut ours = MessageReader::request(frames_body(frames()), limit);
            let (got, end) = all(&mut ours).await;
            let mut theirs = tonic::codec::Streaming::new_request(
                super::super::codec::RawDecoder::default(),
                frames_body(frames()),
                None,
                Some(limit),
            );
            let mut want = Vec::new();
            let want_end = loop {
                match theirs.message().await {
                    Ok(Some(m)) => want.push(m),
                    Ok(None) => break Ok(()),
                    Err(s) => break Err(s),
                }
            };
            assert_eq!(got, want, "{name}: messages");
            match (&end, &want_end) {
                (Ok(()), Ok(())) => {}
                (Err(a), Err(b)) => assert_eq!(
                    (a.code(), a.message()),
                    (b.code(), b.message()),
                    "{name}: end"
                ),
                _ => panic!("{name}: ours ended {end:?}, tonic's {want_end:?}"),
            }
        }
    }

    /// A request over the limit is refused before its bytes are buffered.
    #[tokio::test]
    async fn a_request_over_the_limit_is_refused_with_tonics_words() {
        let mut r = MessageReader::request(
            frames_body(vec![Ok(http_body::Frame::data(Bytes::from(framed(&[
                &[0u8; 65],
            ]))))]),
            64,
        );
        let s = r.message().await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::OutOfRange);
        assert_eq!(
            s.message(),
            "Error, decoded message length too large: found 65 bytes, the limit is: 64 bytes"
        );
    }

    /// The layer takes the body out and leaves tonic an empty one; the handler finds it once.
    #[tokio::test]
    async fn the_layer_hands_the_body_to_the_handler() {
        use tower::{Layer, Service, ServiceExt};
        let inner = tower::service_fn(|req: http::Request<Body>| async move {
            let (parts, body) = req.into_parts();
            // What tonic would decode: nothing.
            assert!(http_body::Body::is_end_stream(&body));
            let taken = parts.extensions.get::<TakenBody>().unwrap();
            let mut r = MessageReader::request(taken.take().unwrap(), 1 << 20);
            assert!(taken.take().is_none(), "taken once");
            let (got, end) = all(&mut r).await;
            assert!(end.is_ok());
            Ok::<_, Infallible>(got)
        });
        let mut svc = TakeRequestBody.layer(inner);
        let req = http::Request::new(frames_body(vec![Ok(http_body::Frame::data(Bytes::from(
            framed(&[b"hello"]),
        )))]));
        let got = svc.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(got, vec![Bytes::from_static(b"hello")]);
    }
}
