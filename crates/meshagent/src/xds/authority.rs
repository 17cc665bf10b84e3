//! Accepting gRPC C-core's `:authority` on the xDS socket.
//!
//! A gRPC client dialling `unix:///etc/istio/proxy/XDS` (the bootstrap's `server_uri`, Istio's
//! exact value) sends `:authority: etc%2Fistio%2Fproxy%2FXDS`, the percent-encoded socket path.
//! Go's gRPC server (Istio's agent) ignores it; the `h2` crate under tonic rejects a `%` in the
//! host as a malformed request and resets the stream with PROTOCOL_ERROR, so grpcio's and
//! grpc-java's xDS clients could never talk to the agent.
//!
//! [`AuthorityFix`] sits between the socket and the HTTP/2 server and rewrites, in the client's
//! HEADERS blocks only, an `:authority` that is not a valid URI authority to `localhost` (what
//! gRPC itself uses for unix sockets elsewhere). Everything else passes through untouched and
//! unbuffered (DATA frames are streamed, never held). A rewritten block is HPACK-decoded with
//! the client's dynamic table ([`loona_hpack`]) and re-encoded with literals that never index,
//! so the server's decoder table stays empty and cannot drift from anything.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

const PREFACE_LEN: usize = 24;
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The HTTP/2 default SETTINGS_MAX_FRAME_SIZE (the server's, which frames sent to it obey).
const MAX_FRAME: usize = 16_384;
/// Largest header block accepted (gRPC requests carry a few hundred bytes of headers).
const MAX_BLOCK: usize = 1024 * 1024;
/// The HPACK dynamic table the decoder keeps: the HTTP/2 default SETTINGS_HEADER_TABLE_SIZE
/// (RFC 9113 §6.5.2), which the agent's server (h2) advertises by not setting it, so a
/// conforming client's encoder never uses more. A table size update above it is a
/// COMPRESSION_ERROR (RFC 7541 §4.2) and closes the connection, as h2 itself would.
pub const HEADER_TABLE_SIZE: usize = 4096;
/// Largest decoded header list re-encoded. Indexed fields expand (one byte may name a 4 KiB
/// table entry), so the decoded size is bounded on its own; 4 times the 16 KiB
/// SETTINGS_MAX_HEADER_LIST_SIZE the server (hyper) advertises, so every list the server
/// could accept still reaches it and its own error answers the rest.
pub const MAX_DECODED: usize = 64 * 1024;

static CONN_IDS: AtomicU64 = AtomicU64::new(1);

/// A fresh downstream connection number.
pub fn next_conn_id() -> u64 {
    CONN_IDS.fetch_add(1, Ordering::Relaxed)
}

/// What the xDS server learns of a request's connection (a request extension, through
/// tonic's `Connected`): its number, so streams of one client share an upstream connection
/// and no other client's, and a token that closes it (a client that stopped reading).
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub id: u64,
    pub cut: CancellationToken,
    pub uds: tonic::transport::server::UdsConnectInfo,
}

enum State {
    Preface,
    /// Expecting a frame header.
    Frame,
    /// Copying this many payload bytes of a frame that is not rewritten.
    Copy(usize),
}

/// A socket whose client→server HTTP/2 bytes get a valid `:authority` (see the module docs).
pub struct AuthorityFix<S> {
    inner: S,
    state: State,
    /// Bytes read from the socket, not yet processed.
    raw: BytesMut,
    /// Processed bytes, ready for the HTTP/2 server.
    out: BytesMut,
    /// A header block being collected: stream id, END_STREAM, fragments so far.
    block: Option<(u32, bool, BytesMut)>,
    decoder: loona_hpack::Decoder<'static>,
    eof: bool,
    id: u64,
    cut: CancellationToken,
    /// Resolves when `cut` is cancelled; then reads and writes fail and the server drops the
    /// connection.
    cut_wait: std::pin::Pin<Box<WaitForCancellationFutureOwned>>,
}

impl<S> AuthorityFix<S> {
    pub fn new(inner: S) -> AuthorityFix<S> {
        let cut = CancellationToken::new();
        AuthorityFix {
            inner,
            state: State::Preface,
            raw: BytesMut::new(),
            out: BytesMut::new(),
            block: None,
            decoder: decoder(),
            eof: false,
            id: next_conn_id(),
            cut_wait: Box::pin(cut.clone().cancelled_owned()),
            cut,
        }
    }

    /// Closes the connection: the next read or write fails.
    pub fn cut(&self) -> CancellationToken {
        self.cut.clone()
    }

    fn poll_cut(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.cut_wait.as_mut().poll(cx).is_ready() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "xDS client closed by the agent: it stopped reading",
            ));
        }
        Ok(())
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Moves what can be processed from `raw` to `out`.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.state {
                State::Preface => {
                    if self.raw.len() < PREFACE_LEN {
                        return Ok(());
                    }
                    self.out.extend_from_slice(&self.raw.split_to(PREFACE_LEN));
                    self.state = State::Frame;
                }
                State::Copy(n) => {
                    if n == 0 {
                        self.state = State::Frame;
                        continue;
                    }
                    if self.raw.is_empty() {
                        return Ok(());
                    }
                    let take = n.min(self.raw.len());
                    self.out.extend_from_slice(&self.raw.split_to(take));
                    self.state = State::Copy(n - take);
                }
                State::Frame => {
                    if self.raw.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let h = &self.raw[..FRAME_HEADER];
                    let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
                    let (kind, flags) = (h[3], h[4]);
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    let in_block = self.block.is_some();
                    if kind != HEADERS && !(in_block && kind == CONTINUATION) {
                        if in_block {
                            // RFC 9113 §6.10: nothing may interleave a header block; let the
                            // server see the violation as it was sent.
                            self.flush_block_raw();
                        }
                        self.out.extend_from_slice(&self.raw.split_to(FRAME_HEADER));
                        self.state = State::Copy(len);
                        continue;
                    }
                    if len > MAX_BLOCK {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "HTTP/2 header frame too large",
                        ));
                    }
                    if self.raw.len() < FRAME_HEADER + len {
                        return Ok(());
                    }
                    self.raw.advance(FRAME_HEADER);
                    let mut payload = self.raw.split_to(len);
                    if kind == HEADERS {
                        let mut pad = 0;
                        if flags & PADDED != 0 {
                            if payload.is_empty() {
                                return Err(bad("empty padded HEADERS frame"));
                            }
                            pad = usize::from(payload[0]);
                            payload.advance(1);
                        }
                        if flags & PRIORITY != 0 {
                            if payload.len() < 5 {
                                return Err(bad("short HEADERS priority"));
                            }
                            payload.advance(5);
                        }
                        if pad > payload.len() {
                            return Err(bad("HEADERS padding longer than the frame"));
                        }
                        payload.truncate(payload.len() - pad);
                        self.block = Some((stream, flags & END_STREAM != 0, payload));
                    } else if let Some((_, _, b)) = &mut self.block {
                        if b.len() + payload.len() > MAX_BLOCK {
                            return Err(bad("HTTP/2 header block too large"));
                        }
                        b.extend_from_slice(&payload);
                    }
                    if flags & END_HEADERS != 0
                        && let Some((stream, end_stream, b)) = self.block.take()
                    {
                        self.rewrite(stream, end_stream, &b)?;
                    }
                }
            }
        }
    }

    /// A block cut short by another frame: forwarded as collected (the server rejects it).
    fn flush_block_raw(&mut self) {
        if let Some((stream, end_stream, b)) = self.block.take() {
            let flags = if end_stream { END_STREAM } else { 0 };
            put_frame(&mut self.out, HEADERS, flags, stream, &b);
        }
    }

    fn rewrite(&mut self, stream: u32, end_stream: bool, block: &[u8]) -> io::Result<()> {
        let mut enc = BytesMut::with_capacity(block.len().min(MAX_DECODED) + 64);
        let mut too_large = false;
        self.decoder
            .decode_with_cb(block, |name, value| {
                if too_large {
                    return;
                }
                let value: &[u8] = if name.as_ref() == b":authority"
                    && http::uri::Authority::try_from(value.as_ref()).is_err()
                {
                    b"localhost"
                } else {
                    &value
                };
                // Name, value and two length prefixes of at most 5 bytes each.
                if enc.len() + 1 + name.len() + value.len() + 10 > MAX_DECODED {
                    too_large = true;
                    return;
                }
                // Literal header field without indexing, new name (RFC 7541 §6.2.2).
                enc.put_u8(0);
                put_string(&mut enc, &name);
                put_string(&mut enc, value);
            })
            .map_err(|e| bad(&format!("HPACK: {e:?}")))?;
        if too_large {
            return Err(bad("HTTP/2 header list too large"));
        }
        let mut chunks = enc.chunks(MAX_FRAME).peekable();
        let mut first = true;
        if chunks.peek().is_none() {
            let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
            put_frame(&mut self.out, HEADERS, flags, stream, &[]);
            return Ok(());
        }
        while let Some(c) = chunks.next() {
            let last = chunks.peek().is_none();
            let mut flags = if last { END_HEADERS } else { 0 };
            let kind = if first {
                if end_stream {
                    flags |= END_STREAM;
                }
                HEADERS
            } else {
                CONTINUATION
            };
            put_frame(&mut self.out, kind, flags, stream, c);
            first = false;
        }
        Ok(())
    }
}

/// An HPACK decoder whose dynamic table cannot grow past [`HEADER_TABLE_SIZE`].
fn decoder() -> loona_hpack::Decoder<'static> {
    let mut d = loona_hpack::Decoder::new();
    d.set_max_allowed_table_size(HEADER_TABLE_SIZE);
    d.set_max_table_size(HEADER_TABLE_SIZE);
    d
}

/// Feeds `data` to an [`AuthorityFix`] as one client connection (the preface is supplied when
/// `data` lacks it) and returns what the server would read, or the error that closes the
/// connection (the `xds_authority` fuzz target; never panics).
pub fn rewrite_bytes(data: &[u8]) -> io::Result<Vec<u8>> {
    let mut fix = AuthorityFix::new(tokio::io::empty());
    if !data.starts_with(b"PRI * HTTP/2.0") {
        fix.raw
            .extend_from_slice(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    }
    fix.raw.extend_from_slice(data);
    fix.process()?;
    fix.flush_block_raw();
    let mut out = fix.out.to_vec();
    out.extend_from_slice(&fix.raw);
    Ok(out)
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_owned())
}

fn put_frame(out: &mut BytesMut, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len();
    out.put_u8((len >> 16) as u8);
    out.put_u8((len >> 8) as u8);
    out.put_u8(len as u8);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
    out.extend_from_slice(payload);
}

/// An HPACK string literal without Huffman coding (RFC 7541 §5.2).
fn put_string(out: &mut BytesMut, s: &[u8]) {
    put_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// An HPACK integer with an `n`-bit prefix after `first`'s high bits (RFC 7541 §5.1).
fn put_int(out: &mut BytesMut, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.put_u8(first | v as u8);
        return;
    }
    out.put_u8(first | max as u8);
    v -= max;
    while v >= 128 {
        out.put_u8((v % 128 + 128) as u8);
        v /= 128;
    }
    out.put_u8(v as u8);
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.poll_cut(cx)?;
        loop {
            if !this.out.is_empty() {
                let n = this.out.len().min(buf.remaining());
                buf.put_slice(&this.out.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // Whatever could not be parsed goes through as it is (the server decides).
                if !this.raw.is_empty() {
                    let rest = this.raw.split();
                    this.out.extend_from_slice(&rest);
                    continue;
                }
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut tmp);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if rb.filled().is_empty() {
                        this.eof = true;
                        this.flush_block_raw();
                    } else {
                        this.raw.extend_from_slice(rb.filled());
                    }
                    this.process()?;
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_cut(cx)?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_cut(cx)?;
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for AuthorityFix<tokio::net::UnixStream> {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            id: self.id,
            cut: self.cut.clone(),
            uds: self.inner.connect_info(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn literal(name: &[u8], value: &[u8]) -> Vec<u8> {
        let mut b = BytesMut::new();
        b.put_u8(0x40); // with incremental indexing, new name
        put_string(&mut b, name);
        put_string(&mut b, value);
        b.to_vec()
    }

    async fn through(input: Vec<u8>) -> Vec<u8> {
        let (mut a, b) = tokio::io::duplex(1 << 20);
        a.write_all(&input).await.unwrap();
        drop(a);
        let mut fix = AuthorityFix::new(b);
        let mut out = Vec::new();
        fix.read_to_end(&mut out).await.unwrap();
        out
    }

    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut v = Vec::new();
        b = &b[PREFACE_LEN..];
        while b.len() >= FRAME_HEADER {
            let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    /// grpc C-core's request headers (percent-encoded socket path as authority), padded and
    /// split over a CONTINUATION, then a DATA frame and a second stream reusing the dynamic
    /// table entry by index: both come out with `localhost`, DATA untouched.
    #[tokio::test]
    async fn percent_encoded_authority_is_replaced_and_the_rest_passes() {
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        put_frame_vec(&mut input, 0x4, 0, 0, &[]); // SETTINGS
        let mut block = literal(b":path", b"/x");
        block.extend(literal(b":authority", b"etc%2Fistio%2Fproxy%2FXDS"));
        let (one, two) = block.split_at(5);
        let mut padded = vec![3u8];
        padded.extend_from_slice(one);
        padded.extend_from_slice(&[0, 0, 0]);
        put_frame_vec(&mut input, HEADERS, PADDED, 1, &padded);
        put_frame_vec(&mut input, CONTINUATION, END_HEADERS, 1, two);
        put_frame_vec(&mut input, 0x0, END_STREAM, 1, b"payload");
        // Dynamic table: index 62 is the newest entry (:authority), 63 is :path.
        put_frame_vec(&mut input, HEADERS, END_HEADERS, 3, &[0x80 | 62, 0x80 | 63]);
        let out = through(input).await;
        let f = frames(&out);
        assert_eq!(f[0].0, 0x4);
        let mut dec = loona_hpack::Decoder::new();
        let h1 = dec.decode(&f[1].3).unwrap();
        assert_eq!(f[1].1, END_HEADERS);
        assert_eq!(h1[1], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(h1[0], (b":path".to_vec(), b"/x".to_vec()));
        assert_eq!(f[2], (0x0, END_STREAM, 1, b"payload".to_vec()));
        let h2 = dec.decode(&f[3].3).unwrap();
        assert_eq!(h2[0], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(f[3].2, 3);
    }

    #[tokio::test]
    async fn valid_authority_kept_and_garbage_is_an_error_not_a_panic() {
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        put_frame_vec(
            &mut input,
            HEADERS,
            END_HEADERS | END_STREAM,
            1,
            &literal(b":authority", b"xds-grpc"),
        );
        let f = frames(&through(input).await);
        let h = loona_hpack::Decoder::new().decode(&f[0].3).unwrap();
        assert_eq!(h[0].1, b"xds-grpc");
        assert_eq!(f[0].1, END_HEADERS | END_STREAM);

        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        put_frame_vec(
            &mut input,
            HEADERS,
            END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        );
        let (mut a, b) = tokio::io::duplex(1 << 16);
        a.write_all(&input).await.unwrap();
        drop(a);
        let mut out = Vec::new();
        assert!(AuthorityFix::new(b).read_to_end(&mut out).await.is_err());
    }

    /// A HEADERS frame (END_HEADERS) of stream `id` carrying `block`.
    fn headers(id: u32, block: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        put_frame_vec(&mut v, HEADERS, END_HEADERS, id, block);
        v
    }

    /// A dynamic table size update to `size` (RFC 7541 §6.3).
    fn size_update(size: usize) -> Vec<u8> {
        let mut b = BytesMut::new();
        put_int(&mut b, 0x20, 5, size);
        b.to_vec()
    }

    #[test]
    fn hpack_table_size_update_above_the_limit_is_rejected() {
        // Down to 0 and back up to the advertised 4096 is what a conforming client may do.
        let mut ok = size_update(0);
        ok.extend(size_update(HEADER_TABLE_SIZE));
        ok.extend(literal(b":path", b"/x"));
        assert!(rewrite_bytes(&headers(1, &ok)).is_ok());
        for too_big in [HEADER_TABLE_SIZE + 1, 1 << 20, 1 << 30] {
            let mut b = size_update(too_big);
            b.extend(literal(b":path", b"/x"));
            let e = rewrite_bytes(&headers(1, &b)).expect_err("a table larger than advertised");
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        }
    }

    /// A client that raises the table size and then indexes many large literals: the table
    /// stays within 4 KiB (older entries are evicted), so memory does not grow with what the
    /// client sends; and a block of one-byte references to a large entry cannot make the
    /// decoded header list (re-encoded as literals) grow past [`MAX_DECODED`].
    #[test]
    fn hpack_indexed_literals_cannot_grow_the_table_or_the_decoded_list() {
        let mut input = Vec::new();
        for i in 0..2_000u32 {
            let mut b = if i == 0 {
                size_update(1 << 30)
            } else {
                Vec::new()
            };
            b.extend(literal(format!("x-big-{i}").as_bytes(), &[b'v'; 1000]));
            input.extend(headers(2 * i + 1, &b));
        }
        // Four 1 KiB entries fit in 4096 bytes; the 5th newest was evicted. Unbounded, it
        // (and all 2,000 entries, 2 MB) would still be there.
        let probe = |index: u8| {
            let mut v = input.clone();
            v.extend(headers(9_999, &[0x80 | index]));
            rewrite_bytes(&v)
        };
        match probe(62 + 4) {
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}"),
            Ok(_) => panic!("an entry beyond the 4 KiB table is still indexed"),
        }
        // Without the size update the same literals are accepted and only the newest kept.
        let mut plain = Vec::new();
        for i in 0..2_000u32 {
            plain.extend(headers(
                2 * i + 1,
                &literal(format!("x-big-{i}").as_bytes(), &[b'v'; 1000]),
            ));
        }
        let mut newest = plain.clone();
        newest.extend(headers(9_999, &[0x80 | 62]));
        assert!(rewrite_bytes(&newest).is_ok());
        plain.extend(headers(9_999, &[0x80 | (62 + 4)]));
        assert!(rewrite_bytes(&plain).is_err());

        // Amplification: one 4 KiB entry, then 60,000 one-byte references to it (240 MB
        // decoded) in CONTINUATION frames within the 1 MiB block limit.
        let mut amp = headers(1, &literal(b"x-amp", &[b'a'; 4000]));
        let refs = vec![0x80 | 62u8; 60_000];
        let mut chunks = refs.chunks(MAX_FRAME);
        let first = chunks.next().unwrap();
        put_frame_vec(&mut amp, HEADERS, 0, 3, first);
        let rest: Vec<&[u8]> = chunks.collect();
        for (i, c) in rest.iter().enumerate() {
            let flags = if i + 1 == rest.len() { END_HEADERS } else { 0 };
            put_frame_vec(&mut amp, CONTINUATION, flags, 3, c);
        }
        let e = rewrite_bytes(&amp).expect_err("a 240 MB header list");
        assert!(e.to_string().contains("too large"), "{e}");
    }

    fn put_frame_vec(v: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let mut b = BytesMut::new();
        put_frame(&mut b, kind, flags, stream, payload);
        v.extend_from_slice(&b);
    }
}
