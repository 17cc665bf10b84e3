//! gzip and zstd of the status port's answers, as Istio's status server wraps its whole mux in
//! `gzhttp.GzipHandler` (`pilot/cmd/pilot-agent/status/server.go`; the rules are those of
//! klauspost/compress `gzhttp/compress.go`, the version Istio pins):
//!
//! * every answer gets `Vary: Accept-Encoding`, compressed or not;
//! * `HEAD` is never compressed;
//! * `Accept-Encoding` is read for `gzip` and `zstd` only (case-insensitive names, the first
//!   entry of each counts): an entry without `q` is 1, `q=` is clamped to 0..1 and a `q` that
//!   is not a number is 0; `q=0` refuses the coding. `identity` and `*` are not looked at: a
//!   client that lists only them gets identity. With both accepted the higher `q` wins, zstd on
//!   a tie;
//! * an answer that already has `Content-Encoding` or `Content-Range`, or whose Content-Type is
//!   a compressed format (audio, video, JPEG, archives), stays as it is;
//! * an answer shorter than [`MIN_SIZE`] bytes stays as it is: with its length known this is
//!   decided at once, else the first [`MIN_SIZE`] bytes are held until they arrived (or the
//!   body ended);
//! * compressing drops `Content-Length` and `Accept-Ranges`; gzip at the default level, zstd
//!   at its fastest level with a 128 KiB window (gzhttp's `zstdkp` writer).
//!
//! The encoders are streamed: the body (the metrics merge's, 100k+ lines) goes through them
//! chunk by chunk as it is produced, never collected whole.

use async_compression::Level;
use async_compression::tokio::bufread::{GzipEncoder, ZstdEncoder};
use async_compression::zstd::CParameter;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use http_body::Body as _;
use http_body_util::BodyExt;

/// Answers shorter than this are not compressed (gzhttp's `DefaultMinSize`).
pub const MIN_SIZE: usize = 1024;
/// zstd window: gzhttp's `zstdkp` writer uses `WithWindowSize(128<<10)`.
const ZSTD_WINDOW_LOG: u32 = 17;
/// Compressed output is handed on in chunks of at most this size.
const OUT_CHUNK: usize = 16 * 1024;

/// A content coding the status server can answer with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Zstd,
}

impl Coding {
    pub fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Zstd => "zstd",
        }
    }
}

/// The coding for a request (gzhttp `selectEncoding`): `None` for identity.
pub fn select(method: &Method, accept_encoding: Option<&str>) -> Option<Coding> {
    if method == Method::HEAD {
        return None;
    }
    let ae = accept_encoding?;
    let gzip = qvalue(ae, "gzip");
    let zstd = qvalue(ae, "zstd");
    // `!(q > 0)`, not `q <= 0`: a NaN q is "accepted" in gzhttp (its `q <= 0` is false).
    match (gzip > 0.0 || gzip.is_nan(), zstd > 0.0 || zstd.is_nan()) {
        (false, false) => None,
        (true, false) => Some(Coding::Gzip),
        (false, true) => Some(Coding::Zstd),
        (true, true) if gzip > zstd => Some(Coding::Gzip),
        (true, true) => Some(Coding::Zstd),
    }
}

/// The q-value of the first `Accept-Encoding` entry naming `coding`, 0 when none does
/// (gzhttp `parseEncodingQValue` and `parseCoding`).
fn qvalue(header: &str, coding: &str) -> f64 {
    for entry in header.trim().split(',') {
        let mut parts = entry.split(';');
        let name = parts.next().unwrap_or("").trim();
        if !name.eq_ignore_ascii_case(coding) {
            continue;
        }
        let mut q = 1.0;
        for p in parts {
            // Only a lower-case `q=` right after the `;` (and blanks) is a q-value there.
            if let Some(v) = p.trim().strip_prefix("q=") {
                q = v.parse::<f64>().unwrap_or(0.0).clamp(0.0, 1.0);
            }
        }
        return q;
    }
    0.0
}

/// gzhttp `DefaultContentTypeFilter`: compressed audio, video and archive formats are sent as
/// they are.
fn compressible_type(ct: &str) -> bool {
    let ct = ct.trim().to_ascii_lowercase();
    const CONTAINS: [&str; 8] = [
        "compress", "zip", "snappy", "lzma", "xz", "zstd", "brotli", "stuffit",
    ];
    const PREFIX: [&str; 3] = ["video/", "audio/", "image/jp"];
    !CONTAINS.iter().any(|s| ct.contains(s)) && !PREFIX.iter().any(|p| ct.starts_with(p))
}

/// The middleware: `axum::middleware::from_fn(compress::layer)` around the status router.
pub async fn layer(req: Request, next: Next) -> Response {
    let coding = select(
        req.method(),
        req.headers()
            .get(header::ACCEPT_ENCODING)
            .and_then(|v| v.to_str().ok()),
    );
    let mut resp = next.run(req).await;
    resp.headers_mut()
        .append(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    let Some(coding) = coding else {
        return resp;
    };
    let h = resp.headers();
    if h.contains_key(header::CONTENT_ENCODING)
        || h.contains_key(header::CONTENT_RANGE)
        || h.get(header::CONTENT_TYPE)
            .is_some_and(|ct| !compressible_type(ct.to_str().unwrap_or("")))
    {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let data: futures::stream::BoxStream<'static, Result<Bytes, std::io::Error>> =
        match body.size_hint().exact() {
            Some(n) if n < MIN_SIZE as u64 => return Response::from_parts(parts, body),
            Some(_) => body.into_data_stream().map(|r| r.map_err(io_error)).boxed(),
            None => {
                let mut body = body;
                let mut held: Vec<Bytes> = Vec::new();
                let mut len = 0usize;
                let mut error = None;
                while len < MIN_SIZE {
                    match body.frame().await {
                        None => break,
                        Some(Err(e)) => {
                            error = Some(io_error(e));
                            break;
                        }
                        Some(Ok(f)) => {
                            if let Ok(d) = f.into_data() {
                                len += d.len();
                                held.push(d);
                            }
                        }
                    }
                }
                if len < MIN_SIZE && error.is_none() {
                    // Ended short: sent as it is.
                    return Response::from_parts(parts, Body::from(held.concat()));
                }
                let head = futures::stream::iter(held.into_iter().map(Ok));
                match error {
                    Some(e) => head.chain(futures::stream::once(async { Err(e) })).boxed(),
                    None => head
                        .chain(body.into_data_stream().map(|r| r.map_err(io_error)))
                        .boxed(),
                }
            }
        };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(header::ACCEPT_RANGES);
    parts.headers.insert(
        header::CONTENT_ENCODING,
        HeaderValue::from_static(coding.name()),
    );
    let reader = tokio_util::io::StreamReader::new(data);
    let body = match coding {
        Coding::Gzip => Body::from_stream(tokio_util::io::ReaderStream::with_capacity(
            GzipEncoder::with_quality(reader, Level::Default),
            OUT_CHUNK,
        )),
        Coding::Zstd => Body::from_stream(tokio_util::io::ReaderStream::with_capacity(
            ZstdEncoder::with_quality_and_params(
                reader,
                Level::Precise(1),
                &[CParameter::window_log(ZSTD_WINDOW_LOG)],
            ),
            OUT_CHUNK,
        )),
    };
    Response::from_parts(parts, body)
}

fn io_error(e: axum::Error) -> std::io::Error {
    std::io::Error::other(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(ae: &str) -> Option<Coding> {
        select(&Method::GET, Some(ae))
    }

    #[test]
    fn negotiation_follows_gzhttp() {
        use Coding::*;
        assert_eq!(select(&Method::GET, None), None);
        assert_eq!(select(&Method::HEAD, Some("gzip")), None);
        assert_eq!(sel(""), None);
        assert_eq!(sel("gzip"), Some(Gzip));
        assert_eq!(sel("GZIP"), Some(Gzip));
        assert_eq!(sel("zstd"), Some(Zstd));
        assert_eq!(sel("gzip, deflate, br, zstd"), Some(Zstd));
        assert_eq!(sel("gzip;q=1.0, zstd;q=0.5"), Some(Gzip));
        assert_eq!(sel("gzip;q=0.4, zstd;q=0.5"), Some(Zstd));
        assert_eq!(sel("gzip;q=0, zstd;q=0"), None);
        assert_eq!(sel("gzip;q=0, zstd"), Some(Zstd));
        assert_eq!(sel("gzip ; q=0.2"), Some(Gzip));
        // q clamped to 0..1: 2 ties with zstd's 1 and zstd wins the tie.
        assert_eq!(sel("gzip;q=2, zstd"), Some(Zstd));
        // Not a number: 0. Upper-case Q: not a q-value, so 1.
        assert_eq!(sel("gzip;q=x"), None);
        assert_eq!(sel("gzip;Q=0"), Some(Gzip));
        // identity and * are not looked at.
        assert_eq!(sel("identity"), None);
        assert_eq!(sel("*"), None);
        assert_eq!(sel("identity;q=1, gzip;q=0.1"), Some(Gzip));
        // The first entry of a coding counts.
        assert_eq!(sel("gzip;q=0, gzip"), None);
        assert_eq!(sel("br, deflate"), None);
        assert_eq!(sel(",,gzip,"), Some(Gzip));
    }

    #[test]
    fn compressed_types_are_left_alone() {
        assert!(compressible_type(
            "text/plain; version=0.0.4; charset=utf-8"
        ));
        assert!(compressible_type("application/json"));
        assert!(compressible_type(""));
        assert!(!compressible_type("application/zstd"));
        assert!(!compressible_type("application/x-gzip"));
        assert!(!compressible_type("image/jpeg"));
        assert!(!compressible_type("Video/mp4"));
    }
}
