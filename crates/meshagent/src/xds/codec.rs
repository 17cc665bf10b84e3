//! A gRPC codec over raw bytes, so xDS messages pass through the agent without being decoded
//! and re-encoded: the bytes Envoy or istiod sent are the bytes the other side receives.

use bytes::{Buf, BufMut, Bytes};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// Encodes and decodes `Bytes` as the gRPC message payload, unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawDecoder::default()
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // tonic frames into its own buffer; this is the one copy the framing needs.
        dst.put(item);
        Ok(())
    }
}

/// Decodes a message as the bytes tonic read, without a copy.
///
/// It also keeps a reference to the last message until the next one is decoded. tonic's
/// decoder reads into one `BytesMut` per stream and reserves each message's length in it
/// (tonic 0.14 `codec/decode.rs`, `decode_chunk`); a message split off that buffer shares its
/// allocation, and once the message is dropped the buffer is unique again and `reserve` reuses
/// it, so the largest message a stream ever carried (a 5 MiB CDS push) stayed allocated for the
/// stream's life. While this reference is held the allocation is shared at the next `reserve`,
/// so tonic moves to a buffer sized for the next message and the old one is freed when the
/// reference is replaced: a stream keeps at most its last message, not its largest.
#[derive(Default)]
pub struct RawDecoder {
    last: Option<Bytes>,
}

impl Decoder for RawDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        // `copy_to_bytes` on tonic's BytesMut-backed buffer splits it: no copy.
        let n = src.remaining();
        let msg = src.copy_to_bytes(n);
        self.last = Some(msg.clone());
        Ok(Some(msg))
    }
}

/// The response body of a downstream ADS stream, framed by hand so a forwarded message is
/// handed to HTTP/2 as the very `Bytes` read from upstream: tonic's server encoder would copy
/// each message into its encode buffer, doubling the memory a large push needs (a 20 MiB CDS
/// response would briefly cost 40 MiB). A large message becomes a 5-byte gRPC prefix frame
/// plus the message frame; one of at most [`COALESCE`] bytes (most pushes: an EDS update is a
/// few hundred) is copied behind its prefix into a single frame, as tonic would frame it, so
/// h2 schedules, flow-controls and encodes one DATA frame per message instead of two. The
/// stream ends with `grpc-status` trailers (OK when the sender is dropped, else the given
/// status).
pub struct ResponseBody {
    rx: tokio::sync::mpsc::Receiver<Result<Bytes, Status>>,
    pending: Option<Bytes>,
    done: bool,
}

impl ResponseBody {
    pub fn new(rx: tokio::sync::mpsc::Receiver<Result<Bytes, Status>>) -> ResponseBody {
        ResponseBody {
            rx,
            pending: None,
            done: false,
        }
    }

    fn trailers(&mut self, status: &Status) -> http_body::Frame<Bytes> {
        self.done = true;
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
        if !status.message().is_empty()
            && let Ok(v) = http::HeaderValue::from_str(&grpc_message(status.message()))
        {
            h.insert("grpc-message", v);
        }
        http_body::Frame::trailers(h)
    }
}

/// `grpc-message` encoding per the gRPC HTTP/2 spec: only bytes outside printable ASCII and
/// `%` itself are percent-encoded. (tonic also encodes spaces, and Envoy logs the message
/// without decoding it, so its logs would read `agent%20could%20not...`.)
pub fn grpc_message(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    for b in msg.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Messages up to this size are copied behind their prefix into one DATA frame; larger ones
/// are passed on as they are (the copy would cost more than the extra frame).
pub const COALESCE: usize = 16 * 1024;

/// The gRPC length prefix: uncompressed flag + big-endian u32 length.
fn prefix_bytes(len: usize) -> Result<[u8; 5], Status> {
    let len = u32::try_from(len)
        .map_err(|_| Status::resource_exhausted("message larger than gRPC framing allows"))?;
    let mut p = [0u8; 5];
    p[1..].copy_from_slice(&len.to_be_bytes());
    Ok(p)
}

/// The gRPC length prefix as its own buffer.
pub fn grpc_prefix(len: usize) -> Result<Bytes, Status> {
    prefix_bytes(len).map(|p| Bytes::copy_from_slice(&p))
}

/// A small message with its gRPC prefix in one buffer.
fn framed(msg: &[u8]) -> Result<Bytes, Status> {
    let p = prefix_bytes(msg.len())?;
    let mut out = bytes::BytesMut::with_capacity(p.len() + msg.len());
    out.extend_from_slice(&p);
    out.extend_from_slice(msg);
    Ok(out.freeze())
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        use std::task::Poll;
        if let Some(msg) = self.pending.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(msg))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(msg))) if msg.len() <= COALESCE => match framed(&msg) {
                Ok(frame) => Poll::Ready(Some(Ok(http_body::Frame::data(frame)))),
                Err(s) => Poll::Ready(Some(Ok(self.trailers(&s)))),
            },
            Poll::Ready(Some(Ok(msg))) => match grpc_prefix(msg.len()) {
                Ok(prefix) => {
                    self.pending = Some(msg);
                    Poll::Ready(Some(Ok(http_body::Frame::data(prefix))))
                }
                Err(s) => Poll::Ready(Some(Ok(self.trailers(&s)))),
            },
            Poll::Ready(Some(Err(s))) => Poll::Ready(Some(Ok(self.trailers(&s)))),
            Poll::Ready(None) => Poll::Ready(Some(Ok(self.trailers(&Status::ok(""))))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.pending.is_none()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use http_body::Body as _;

    async fn frames(mut b: ResponseBody) -> Vec<http_body::Frame<Bytes>> {
        let mut out = Vec::new();
        while let Some(f) =
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut b).poll_frame(cx)).await
        {
            out.push(f.unwrap());
        }
        assert!(b.is_end_stream());
        out
    }

    #[tokio::test]
    async fn response_body_frames_messages_without_copying_and_ends_with_status() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let small = Bytes::from_static(b"hello");
        let large = Bytes::from(vec![7u8; COALESCE + 1]);
        tx.send(Ok(small.clone())).await.unwrap();
        tx.send(Ok(large.clone())).await.unwrap();
        tx.send(Err(Status::unavailable("upstream gone")))
            .await
            .unwrap();
        let f = frames(ResponseBody::new(rx)).await;
        assert_eq!(f.len(), 4);
        // A small message: prefix and message in one frame.
        assert_eq!(f[0].data_ref().unwrap().as_ref(), b"\0\0\0\0\x05hello");
        // A large one: its own prefix, then the very same buffer (no copy).
        let len = u32::try_from(COALESCE + 1).unwrap().to_be_bytes();
        assert_eq!(
            f[1].data_ref().unwrap().as_ref(),
            &[0, len[0], len[1], len[2], len[3]]
        );
        assert_eq!(f[2].data_ref().unwrap().as_ptr(), large.as_ptr());
        let t = f[3].trailers_ref().unwrap();
        assert_eq!(t["grpc-status"], "14");
        assert_eq!(t["grpc-message"], "upstream gone");
        assert_eq!(grpc_message("50% é\n"), "50%25 %C3%A9%0A");
    }

    #[tokio::test]
    async fn response_body_ends_ok_when_the_sender_is_dropped() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Status>>(1);
        drop(tx);
        let f = frames(ResponseBody::new(rx)).await;
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].trailers_ref().unwrap()["grpc-status"], "0");
    }
}
