//! A stored response: status, replayable headers and body, packed into one allocation.
//!
//! Every completed record holds one of these for as long as its TTL, so its shape is the
//! store's memory: a list of header pairs with a `String` and a `Bytes` each, plus the body, was
//! six to eight allocations per record for a typical API answer, each one a cache line to touch
//! when it is written and a free when it expires. Here the headers and the body share one
//! buffer, written once by [`ResponseBuilder`] as the backend's answer streams through:
//!
//! ```text
//!   per header: name length (u32 LE) | value length (u32 LE) | name | value
//!   then:       body (to the end)
//! ```

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};

/// Bytes a header takes in the packed buffer besides its name and value: two `u32` lengths.
const HEADER_PREFIX: usize = 8;

/// Most headers a stored response has: a backend's answer with more is refused before it is
/// relayed, so a record read back with more was not written by idemgate (another tool under the
/// prefix, a hand-written dead-letter line). Replaying it would also fail: `http`'s header map
/// panics past 24,576 names.
pub const MAX_HEADERS: usize = 256;

/// Whether a record may hold this status: the only ones `cache_statuses` can name (200-599).
/// Another (a 1xx, a 101) would replay as an interim or upgrade answer.
pub fn is_stored_status(status: u16) -> bool {
    (200..=599).contains(&status)
}

/// A response as stored for replay: status, end-to-end headers and body, byte for byte.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// The packed headers, then the body (see the module docs).
    data: Bytes,
    /// Where the body starts in `data`.
    body_at: usize,
    header_count: usize,
}

impl StoredResponse {
    /// An empty header list, for [`StoredResponse::new`].
    pub const NO_HEADERS: [(&'static str, &'static [u8]); 0] = [];

    /// A response with these headers (lower-case names, in order) and body; copies them into
    /// one buffer of exactly their size.
    pub fn new<N, V>(
        status: u16,
        headers: impl IntoIterator<Item = (N, V)> + Clone,
        body: impl AsRef<[u8]>,
    ) -> Self
    where
        N: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let body = body.as_ref();
        let mut builder = ResponseBuilder::sized(status, || headers.clone(), body.len());
        builder.push_body(body);
        builder.finish()
    }

    /// The headers, in the order they were stored: lower-case name and raw value.
    pub fn headers(&self) -> Headers<'_> {
        Headers {
            rest: &self.data[..self.body_at],
            left: self.header_count,
        }
    }

    /// The headers as [`StoredResponse::headers`] yields them, each value a `Bytes` sharing this
    /// response's buffer (no copy): what a replay hands to the response it writes.
    pub fn shared_headers(&self) -> impl Iterator<Item = (&str, Bytes)> + '_ {
        self.headers()
            .map(|(name, value)| (name, self.data.slice_ref(value)))
    }

    /// How many headers are stored.
    pub fn header_count(&self) -> usize {
        self.header_count
    }

    /// The whole response body.
    pub fn body(&self) -> &[u8] {
        &self.data[self.body_at..]
    }

    /// The body as a `Bytes` sharing this response's buffer (no copy).
    pub fn body_bytes(&self) -> Bytes {
        self.data.slice(self.body_at..)
    }

    /// Heap the response occupies, for capacity accounting: the `Arc` it is shared in (two
    /// counters and the response itself), its one buffer, which is allocated at exactly its
    /// length (see [`ResponseBuilder::finish`]), and the buffer's shared-ownership header
    /// (pointer, capacity, count), which `bytes` allocates the first time a replay slices the
    /// buffer and which then lives as long as the response.
    pub fn size_bytes(&self) -> usize {
        const SHARED: usize = 2 * std::mem::size_of::<usize>()
            + std::mem::size_of::<StoredResponse>()
            + 3 * std::mem::size_of::<usize>();
        self.data.len() + SHARED
    }
}

impl fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredResponse")
            .field("status", &self.status)
            .field(
                "headers",
                &self
                    .headers()
                    .map(|(n, v)| (n, String::from_utf8_lossy(v)))
                    .collect::<Vec<_>>(),
            )
            .field("body", &Bytes::copy_from_slice(self.body()))
            .finish()
    }
}

/// Iterator over a stored response's headers: `(name, value)`.
#[derive(Clone)]
pub struct Headers<'a> {
    rest: &'a [u8],
    left: usize,
}

impl<'a> Iterator for Headers<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The builder wrote this buffer and nothing else does: the lengths are in bounds and the
        // names are `str`s. The checks only keep a bug from turning into a panic.
        let name_len = read_u32(self.rest.get(..4)?)?;
        let value_len = read_u32(self.rest.get(4..8)?)?;
        let rest = self.rest.get(HEADER_PREFIX..)?;
        let (name, rest) = rest.split_at_checked(name_len)?;
        let (value, rest) = rest.split_at_checked(value_len)?;
        self.rest = rest;
        Some((std::str::from_utf8(name).ok()?, value))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.left))
    }
}

fn read_u32(bytes: &[u8]) -> Option<usize> {
    let word: [u8; 4] = bytes.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(word)).ok()
}

/// Most body bytes [`ResponseBuilder::new`] makes room for before they arrive.
const MAX_BODY_HINT: usize = 256 << 10;

/// Writes a [`StoredResponse`] as its body arrives: the headers first, then each body chunk,
/// into one buffer sized up front for the headers and the expected body.
pub struct ResponseBuilder {
    status: u16,
    buf: BytesMut,
    body_at: usize,
    header_count: usize,
    /// The whole response's length as expected (the headers and the declared body): once the
    /// body outgrows the room taken up front, the buffer grows toward it.
    expected: usize,
}

impl ResponseBuilder {
    /// Starts a response with the headers `headers` yields (called twice: once to size the
    /// buffer, once to fill it); `body_hint` is the body length expected (the declared
    /// `Content-Length`, or 0 when unknown). Room for at most [`MAX_BODY_HINT`] of it is taken
    /// up front: a length is only what a backend says, and one that declares a large body and
    /// stalls must not make every request it answers hold that much before a byte has come
    /// (memory that, on a host that does not overcommit, is taken for real). Once the body
    /// outgrows that room, the buffer grows toward the declared length as the body comes, and
    /// still ends exact.
    pub fn new<I, N, V>(status: u16, headers: impl Fn() -> I, body_hint: usize) -> Self
    where
        I: IntoIterator<Item = (N, V)>,
        N: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let mut builder = Self::sized(status, headers, body_hint.min(MAX_BODY_HINT));
        builder.expected = builder.body_at.saturating_add(body_hint);
        builder
    }

    /// [`ResponseBuilder::new`] for a body of `body_len` bytes already in hand.
    fn sized<I, N, V>(status: u16, headers: impl Fn() -> I, body_len: usize) -> Self
    where
        I: IntoIterator<Item = (N, V)>,
        N: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let header_bytes: usize = headers()
            .into_iter()
            .map(|(n, v)| Self::header_size(n.as_ref(), v.as_ref()))
            .sum();
        let mut builder = Self::with_capacity(status, header_bytes.saturating_add(body_len));
        for (name, value) in headers() {
            builder.push_header(name.as_ref(), value.as_ref());
        }
        builder
    }

    /// Starts a response in a buffer of `capacity` bytes: the [`Self::header_size`] of every
    /// header to come plus the body length expected.
    pub fn with_capacity(status: u16, capacity: usize) -> Self {
        ResponseBuilder {
            status,
            buf: BytesMut::with_capacity(capacity),
            body_at: 0,
            header_count: 0,
            expected: capacity,
        }
    }

    /// Bytes a header takes in the buffer.
    pub fn header_size(name: &str, value: &[u8]) -> usize {
        HEADER_PREFIX + name.len() + value.len()
    }

    /// Appends a header; headers come before the body. A header pushed after a body chunk, or
    /// one whose name or value is longer than `u32::MAX` bytes (no HTTP parser accepts one), is
    /// left out.
    pub fn push_header(&mut self, name: &str, value: &[u8]) {
        debug_assert_eq!(self.body_len(), 0, "headers come before the body");
        let (Ok(name_len), Ok(value_len)) = (u32::try_from(name.len()), u32::try_from(value.len()))
        else {
            return;
        };
        if self.body_len() != 0 {
            return;
        }
        self.buf.put_u32_le(name_len);
        self.buf.put_u32_le(value_len);
        self.buf.put_slice(name.as_bytes());
        self.buf.put_slice(value);
        self.header_count += 1;
        self.body_at = self.buf.len();
    }

    /// Body bytes pushed so far.
    pub fn body_len(&self) -> usize {
        self.buf.len() - self.body_at
    }

    /// Appends a body chunk.
    pub fn push_body(&mut self, chunk: &[u8]) {
        let needed = self.buf.len().saturating_add(chunk.len());
        let room = self.buf.capacity();
        if needed > room && self.expected > room {
            // Toward the declared length as the body really comes: doubling, the last step
            // landing on it exactly, so the buffer ends exact without a copy, and a backend that
            // declares a large body and stalls partway holds at most twice what it sent.
            let target = self
                .expected
                .min(needed.max(room.saturating_mul(2)))
                .max(needed);
            let mut grown = BytesMut::with_capacity(target);
            grown.extend_from_slice(&self.buf);
            self.buf = grown;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// The finished response. Its buffer is exactly its length (copied once if the body came
    /// out longer or shorter than `body_hint`), which is what the store's accounting charges.
    pub fn finish(self) -> StoredResponse {
        let data = if self.buf.len() == self.buf.capacity() {
            self.buf.freeze()
        } else {
            Bytes::copy_from_slice(&self.buf)
        };
        StoredResponse {
            status: self.status,
            data,
            body_at: self.body_at,
            header_count: self.header_count,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_response_is_charged_96_bytes_around_its_buffer() {
        // The README's figure.
        let r = StoredResponse::new(201, [("a", &b"b"[..])], b"body");
        assert_eq!(r.size_bytes() - r.data.len(), 96);
    }

    #[test]
    fn headers_and_body_come_back_in_order_byte_for_byte() {
        let r = StoredResponse::new(
            201,
            [
                ("content-type", &b"application/json"[..]),
                ("x-empty", b""),
                ("x-bin", b"\x00\xFF\r\n"),
                ("x-empty", b""),
            ],
            b"{\"id\":1}",
        );
        assert_eq!(r.status, 201);
        assert_eq!(r.header_count(), 4);
        let headers: Vec<_> = r.headers().collect();
        assert_eq!(
            headers,
            [
                ("content-type", &b"application/json"[..]),
                ("x-empty", b""),
                ("x-bin", b"\x00\xFF\r\n"),
                ("x-empty", b""),
            ]
        );
        assert_eq!(r.body(), b"{\"id\":1}");
        assert_eq!(r.body_bytes(), Bytes::from_static(b"{\"id\":1}"));
        // The shared values are the same bytes, in the response's own buffer.
        for ((name, shared), (same_name, value)) in r.shared_headers().zip(r.headers()) {
            assert_eq!((name, &shared[..]), (same_name, value));
            if !value.is_empty() {
                assert_eq!(shared.as_ptr(), value.as_ptr(), "{name} was copied");
            }
        }
    }

    #[test]
    fn no_headers_and_no_body() {
        let r = StoredResponse::new(204, StoredResponse::NO_HEADERS, b"");
        assert_eq!(r.headers().count(), 0);
        assert!(r.body().is_empty());
    }

    #[test]
    fn a_streamed_body_ends_in_an_exact_buffer_whatever_the_hint() {
        for hint in [0, 3, 6, 100] {
            let mut b = ResponseBuilder::new(200, || [("x", "1")], hint);
            b.push_body(b"abc");
            assert_eq!(b.body_len(), 3);
            b.push_body(b"def");
            let r = b.finish();
            assert_eq!(r.body(), b"abcdef");
            assert_eq!(r.data.len(), HEADER_PREFIX + 2 + 6);
            // What the accounting charges is the buffer as allocated (no spare capacity), the
            // `Arc` around the response, and the buffer's shared header a replay's slice makes.
            assert_eq!(
                r.size_bytes(),
                r.data.len() + 16 + std::mem::size_of::<StoredResponse>() + 24
            );
        }
    }

    /// A declared length is room taken up front only up to MAX_BODY_HINT: a backend that
    /// declares a gigabyte and stalls costs a request no more than that.
    #[test]
    fn a_large_declared_length_is_not_taken_up_front() {
        let mut b = ResponseBuilder::new(200, || [("x", "1")], 1 << 30);
        assert!(b.buf.capacity() < 2 * MAX_BODY_HINT, "{}", b.buf.capacity());
        let body = vec![7u8; 3 * MAX_BODY_HINT + 5];
        for chunk in body.chunks(16 << 10) {
            b.push_body(chunk);
        }
        let r = b.finish();
        assert_eq!(r.body(), &body[..]);
        // A true length past the room taken up front: the buffer doubles toward it as the body
        // comes (256 KiB, 512 KiB, then the length), and ends exact without a copy.
        let mut b = ResponseBuilder::new(200, || [("x", "1")], body.len());
        let mut grown = 0;
        for chunk in body.chunks(16 << 10) {
            let before = b.buf.capacity();
            b.push_body(chunk);
            grown += usize::from(b.buf.capacity() != before);
            assert!(b.buf.capacity() <= 2 * b.buf.len().max(MAX_BODY_HINT));
        }
        assert_eq!(grown, 2);
        assert_eq!(b.buf.capacity(), b.buf.len());
        let r = b.finish();
        assert_eq!(r.body(), &body[..]);
        assert_eq!(r.data.len(), HEADER_PREFIX + 2 + body.len());
        assert_eq!(
            r.size_bytes(),
            r.data.len() + 16 + std::mem::size_of::<StoredResponse>() + 24
        );
    }

    #[test]
    fn equal_contents_compare_equal() {
        let a = StoredResponse::new(200, [("a", "1")], b"x");
        let mut b = ResponseBuilder::new(200, || [("a", "1")], 0);
        b.push_body(b"x");
        assert_eq!(a, b.finish());
        assert_ne!(a, StoredResponse::new(200, [("a", "2")], b"x"));
        assert_ne!(a, StoredResponse::new(201, [("a", "1")], b"x"));
    }
}
