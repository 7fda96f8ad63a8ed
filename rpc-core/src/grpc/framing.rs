//! gRPC's messages on HTTP/2, for the face and the gateway alike, framed
//! here rather than by tonic so that each message keeps its compressed
//! flag both ways: read from a body ([`Messages`]), written into one
//! ([`Frames`]) in the encoding its response declared ([`reencode`]),
//! and the status a response's trailers (or trailers-only headers) carry.
//! (gRPC's `PROTOCOL-HTTP2.md`: a message is a compressed flag, a 4-byte
//! big-endian length, and its bytes; one stream has one `grpc-encoding`.)

use super::codec::{metadata_from_grpc, metadata_to_grpc, to_grpc};
use crate::compression::Encoding;
use crate::streaming::Packed;
use crate::{Code, Metadata, Status};
use futures_core::Stream;
use http::HeaderMap;
use prost::bytes::{Buf, BufMut, Bytes, BytesMut};
use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

/// A message's prefix: its compressed flag and its length.
const PREFIX: usize = 5;

/// The most a body's buffer reserves ahead of the bytes that arrived.
const RESERVE_MAX: usize = 64 << 10;

/// Messages up to this size are copied after their prefix into one data
/// frame; larger ones go as two (their prefix, then their bytes as they
/// are).
const COPY_MAX: usize = 16 << 10;

/// The gRPC messages of an HTTP/2 body, each with the encoding it arrived
/// in (the stream's `grpc-encoding` if its flag says compressed), and the
/// body's trailers once it ended. A message longer than `max` (as it
/// travels) fails with `ResourceExhausted` before it is buffered; a
/// compressed one without an encoding, a flag other than 0 or 1, or a body
/// that ends inside a message fail `Internal`. After an error, the stream
/// ends.
pub(super) struct Messages<B: http_body::Body> {
    body: B,
    buf: BytesMut,
    encoding: Option<Encoding>,
    max: usize,
    trailers: Option<HeaderMap>,
    ended: bool,
    failed: bool,
    /// What a failed body means to the reader.
    on_error: fn(B::Error) -> Status,
}

impl<B> Messages<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    pub(super) fn new(
        body: B,
        encoding: Option<Encoding>,
        max: usize,
        on_error: fn(B::Error) -> Status,
    ) -> Messages<B> {
        Messages {
            body,
            buf: BytesMut::new(),
            encoding,
            max,
            trailers: None,
            ended: false,
            failed: false,
            on_error,
        }
    }

    /// The body's trailers, once it ended with them.
    pub(super) fn take_trailers(&mut self) -> Option<HeaderMap> {
        self.trailers.take()
    }

    /// The next message, awaited.
    pub(super) async fn next(&mut self) -> Option<Result<Packed, Status>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// The message wholly in the buffer, if there is one.
    fn buffered(&mut self) -> Option<Result<Packed, Status>> {
        if self.buf.len() < PREFIX {
            return None;
        }
        let flag = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]);
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > self.max {
            return Some(Err(Status::resource_exhausted(format!(
                "a gRPC message of {len} bytes, over the limit of {} bytes",
                self.max
            ))));
        }
        let encoding = match (flag, self.encoding) {
            (0, _) => None,
            (1, Some(e)) => Some(e),
            (1, None) => {
                return Some(Err(Status::internal(
                    "a gRPC message flagged compressed, in a stream without grpc-encoding",
                )));
            }
            (other, _) => {
                return Some(Err(Status::internal(format!(
                    "a gRPC message with compressed flag {other} (0 or 1 expected)"
                ))));
            }
        };
        if self.buf.len() < PREFIX + len {
            // Room for what comes next, not for what a length field
            // claims: the buffer grows as the bytes arrive.
            self.buf
                .reserve((PREFIX + len - self.buf.len()).min(RESERVE_MAX));
            return None;
        }
        self.buf.advance(PREFIX);
        let bytes = self.buf.split_to(len).freeze();
        Some(Ok(Packed { bytes, encoding }))
    }
}

impl<B> Stream for Messages<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Item = Result<Packed, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.failed {
                return Poll::Ready(None);
            }
            if let Some(message) = this.buffered() {
                this.failed = message.is_err();
                return Poll::Ready(Some(message));
            }
            if this.ended {
                if this.buf.is_empty() {
                    return Poll::Ready(None);
                }
                this.failed = true;
                return Poll::Ready(Some(Err(Status::internal(
                    "the gRPC body ended inside a message",
                ))));
            }
            match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.buf.extend_from_slice(&data),
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            this.trailers = Some(trailers);
                        }
                    }
                },
                Some(Err(e)) => {
                    this.failed = true;
                    return Poll::Ready(Some(Err((this.on_error)(e))));
                }
                None => this.ended = true,
            }
        }
    }
}

/// A body's data frames, as messages are written into it: small messages
/// gathered, after their prefixes, into one frame (hyper sends each frame
/// as a DATA frame of its own, and a flood of tiny ones is what HTTP/2
/// peers take for an attack); a large one goes as it is, after its prefix.
#[derive(Default)]
pub(super) struct Frames {
    gathered: BytesMut,
    ready: VecDeque<Bytes>,
}

impl Frames {
    /// Bytes gathered past which a body lets a frame go rather than wait
    /// for the next message.
    pub(super) const YIELD: usize = 32 << 10;

    /// Writes a message: its prefix (`compressed` flag and length) and
    /// its bytes. A message of 4 GiB or more, which gRPC's length cannot
    /// say, is `ResourceExhausted`.
    pub(super) fn push(&mut self, bytes: Bytes, compressed: bool) -> Result<(), Status> {
        let len = u32::try_from(bytes.len()).map_err(|_| {
            Status::resource_exhausted(format!(
                "a message of {} bytes: gRPC's messages are under 4 GiB",
                bytes.len()
            ))
        })?;
        self.gathered.put_u8(u8::from(compressed));
        self.gathered.put_u32(len);
        if bytes.len() <= COPY_MAX {
            self.gathered.put_slice(&bytes);
        } else {
            self.ready.push_back(self.gathered.split().freeze());
            self.ready.push_back(bytes);
        }
        Ok(())
    }

    /// Whether a frame should go now: one is ready, or enough is gathered.
    pub(super) fn full(&self) -> bool {
        !self.ready.is_empty() || self.gathered.len() >= Frames::YIELD
    }

    /// The next frame: one ready, else what is gathered.
    pub(super) fn next(&mut self) -> Option<Bytes> {
        self.ready
            .pop_front()
            .or_else(|| (!self.gathered.is_empty()).then(|| self.gathered.split().freeze()))
    }

    /// Whether nothing waits.
    pub(super) fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.gathered.is_empty()
    }
}

/// A message that `arrived` in an encoding (or as it is), as a stream
/// that `declared` one sends it: as it is if it arrived so or in the
/// declared encoding (then flagged compressed); otherwise inflated (to
/// at most `max` bytes) and compressed again in the declared one, or sent
/// as it is if none was declared. Returns its bytes and its flag.
pub(super) fn reencode(
    bytes: Bytes,
    arrived: Option<Encoding>,
    declared: Option<Encoding>,
    max: usize,
) -> Result<(Bytes, bool), Status> {
    match arrived {
        None => Ok((bytes, false)),
        Some(a) if Some(a) == declared => Ok((bytes, true)),
        Some(a) => {
            let inflated = a.decompress(&bytes, max)?;
            Ok(match declared {
                Some(d) => (d.compress(&inflated).into(), true),
                None => (inflated.into(), false),
            })
        }
    }
}

/// The trailers that end a response: gRPC's status (ours mapped), and
/// with a success, the call's trailing metadata.
pub(super) fn status_trailers(outcome: Result<Metadata, Status>) -> HeaderMap {
    match outcome {
        Ok(metadata) => {
            let mut map = metadata_to_grpc(&metadata).into_headers();
            map.insert("grpc-status", http::HeaderValue::from_static("0"));
            map
        }
        Err(status) => {
            let mut map = HeaderMap::new();
            if let Err(bad) = to_grpc(status).add_header(&mut map) {
                // A message no header can hold: the code still goes.
                map.clear();
                let _ = bad.add_header(&mut map);
            }
            map
        }
    }
}

/// The status `headers` hold (a response's trailers, or its headers if
/// it is trailers-only), with the rest of them as its metadata: `None`
/// without `grpc-status`. A malformed message or details are kept as
/// what can be read of them, never a panic.
pub(super) fn status_of(headers: &HeaderMap) -> Option<Status> {
    let code = headers.get("grpc-status")?;
    let code = code
        .to_str()
        .ok()
        .and_then(|c| c.parse::<u16>().ok())
        .map_or(Code::Unknown, Code::from_u16);
    let message = headers
        .get("grpc-message")
        .map(|m| percent_decode(m.as_bytes()))
        .unwrap_or_default();
    let rest = tonic::metadata::MetadataMap::from_headers(headers.clone());
    let details = rest
        .get_bin("grpc-status-details-bin")
        .and_then(|d| d.to_bytes().ok())
        .map(|d| d.to_vec())
        .unwrap_or_default();
    Some(Status::with_details(code, message, details).with_metadata(metadata_from_grpc(&rest)))
}

/// `grpc-message` as its text: `%XX` escapes decoded, bytes that are not
/// UTF-8 replaced.
fn percent_decode(value: &[u8]) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(value.len());
    let mut i = 0;
    while i < value.len() {
        match (
            value[i],
            value.get(i + 1).copied(),
            value.get(i + 2).copied(),
        ) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push(hex(h).unwrap_or(0) << 4 | hex(l).unwrap_or(0));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A `grpc-timeout` value for `timeout`: the finest unit whose count has
/// at most 8 digits.
pub(super) fn timeout_value(timeout: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let units: [(u128, &str); 5] = [
        (timeout.as_nanos(), "n"),
        (timeout.as_micros(), "u"),
        (timeout.as_millis(), "m"),
        (u128::from(timeout.as_secs()), "S"),
        (u128::from(timeout.as_secs() / 60), "M"),
    ];
    for (count, unit) in units {
        if count <= MAX {
            return format!("{count}{unit}");
        }
    }
    format!("{}H", (timeout.as_secs() / 3600).min(MAX as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of the given data frames, then the trailers if any.
    struct TestBody(VecDeque<Bytes>, Option<HeaderMap>);

    impl http_body::Body for TestBody {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            Poll::Ready(match self.0.pop_front() {
                Some(data) => Some(Ok(http_body::Frame::data(data))),
                None => self.1.take().map(|t| Ok(http_body::Frame::trailers(t))),
            })
        }
    }

    fn read(
        frames: Vec<Bytes>,
        encoding: Option<Encoding>,
        max: usize,
    ) -> Vec<Result<Packed, Status>> {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let mut messages = Messages::new(
            TestBody(frames.into(), Some(trailers)),
            encoding,
            max,
            |e| match e {},
        );
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut out = Vec::new();
        while let Poll::Ready(Some(m)) = Pin::new(&mut messages).poll_next(&mut cx) {
            out.push(m);
        }
        out
    }

    #[test]
    fn messages_split_across_frames_and_joined_in_one_read_back_whole() {
        let small = Bytes::from_static(b"hello");
        let large = Bytes::from(vec![7u8; COPY_MAX + 1]);
        let mut frames = Frames::default();
        frames.push(small.clone(), false).unwrap();
        frames.push(small.clone(), false).unwrap();
        assert!(!frames.full());
        frames.push(large.clone(), true).unwrap();
        assert!(frames.full());
        let queued: Vec<Bytes> = std::iter::from_fn(|| frames.next()).collect();
        assert_eq!(
            queued.len(),
            2,
            "small messages gathered, the large one as it is"
        );
        assert_eq!(queued[1], large);
        assert!(frames.is_empty());
        let wire: Vec<u8> = queued.iter().flat_map(|b| b.iter().copied()).collect();
        // Cut at every few bytes, across prefixes and messages.
        let frames: Vec<Bytes> = wire.chunks(3).map(Bytes::copy_from_slice).collect();
        let read = read(frames, Some(Encoding::Gzip), usize::MAX);
        let read: Vec<Packed> = read.into_iter().map(Result::unwrap).collect();
        assert_eq!(read.len(), 3);
        assert_eq!((&read[0].bytes, read[0].encoding), (&small, None));
        assert_eq!((&read[1].bytes, read[1].encoding), (&small, None));
        assert_eq!(
            (&read[2].bytes, read[2].encoding),
            (&large, Some(Encoding::Gzip))
        );
    }

    #[test]
    fn bad_messages_fail_with_their_codes_and_end_the_stream() {
        let over = read(vec![Bytes::from_static(&[0, 0, 0, 1, 0])], None, 255);
        assert_eq!(over.len(), 1);
        assert_eq!(
            over[0].as_ref().unwrap_err().code(),
            Code::ResourceExhausted
        );
        let unflagged = read(vec![Bytes::from_static(&[1, 0, 0, 0, 1, 9])], None, 16);
        assert_eq!(unflagged[0].as_ref().unwrap_err().code(), Code::Internal);
        let bad_flag = read(vec![Bytes::from_static(&[2, 0, 0, 0, 1, 9])], None, 16);
        assert_eq!(bad_flag[0].as_ref().unwrap_err().code(), Code::Internal);
        let cut = read(vec![Bytes::from_static(&[0, 0, 0, 0, 4, 9])], None, 16);
        assert_eq!(cut.len(), 1);
        assert_eq!(cut[0].as_ref().unwrap_err().code(), Code::Internal);
    }

    #[test]
    fn a_message_in_another_encoding_is_reencoded_in_the_declared_one() {
        let plain = Bytes::from(vec![b'a'; 4096]);
        let zstd = Bytes::from(Encoding::Zstd.compress(&plain));
        let (same, flag) = reencode(
            zstd.clone(),
            Some(Encoding::Zstd),
            Some(Encoding::Zstd),
            1 << 20,
        )
        .unwrap();
        assert_eq!((same, flag), (zstd.clone(), true));
        let (gzip, flag) = reencode(
            zstd.clone(),
            Some(Encoding::Zstd),
            Some(Encoding::Gzip),
            1 << 20,
        )
        .unwrap();
        assert!(flag);
        assert_eq!(
            Encoding::Gzip.decompress(&gzip, 1 << 20).unwrap(),
            plain.to_vec()
        );
        let (back, flag) = reencode(zstd, Some(Encoding::Zstd), None, 1 << 20).unwrap();
        assert_eq!((back, flag), (plain, false));
    }

    #[test]
    fn statuses_survive_trailers_both_ways_and_bad_ones_do_not_panic() {
        let mut metadata = Metadata::new();
        metadata.insert("x-count", "3").unwrap();
        let sent = Status::with_details(Code::Aborted, "50% done\n\u{1F600}", vec![1, 2, 3])
            .with_metadata(metadata);
        let back = status_of(&status_trailers(Err(sent))).unwrap();
        assert_eq!(back.code(), Code::Aborted);
        assert_eq!(back.message(), "50% done\n\u{1F600}");
        assert_eq!(back.details(), &[1, 2, 3]);
        assert_eq!(back.metadata().and_then(|m| m.get("x-count")), Some("3"));
        let mut bad = HeaderMap::new();
        bad.insert("grpc-status", http::HeaderValue::from_static("x"));
        bad.insert("grpc-message", http::HeaderValue::from_static("%zz%4"));
        bad.insert(
            "grpc-status-details-bin",
            http::HeaderValue::from_static("!!!"),
        );
        let status = status_of(&bad).unwrap();
        assert_eq!(status.code(), Code::Unknown);
        assert_eq!(status.message(), "%zz%4");
        assert!(status.details().is_empty());
        assert!(status_of(&HeaderMap::new()).is_none());
    }

    #[test]
    fn timeouts_take_the_finest_unit_that_fits() {
        assert_eq!(timeout_value(Duration::from_millis(250)), "250000u");
        assert_eq!(timeout_value(Duration::from_nanos(1500)), "1500n");
        assert_eq!(timeout_value(Duration::from_secs(5)), "5000000u");
        assert_eq!(timeout_value(Duration::from_secs(3600)), "3600000m");
        assert_eq!(
            timeout_value(Duration::from_secs(86_400 * 365)),
            "31536000S"
        );
        assert_eq!(timeout_value(Duration::MAX), "99999999H");
    }
}
