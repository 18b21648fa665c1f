//! Accepting gRPC clients that send the unix socket's path as HTTP/2 `:authority`.
//!
//! gRPC's C core (Python's grpcio, and tools built on it) and grpc-java put the socket path,
//! percent-encoded, in `:authority` (`tmp%2Fcsi%2Fcsi.sock`); h2, under tonic, refuses such a
//! request with PROTOCOL_ERROR before any of our code sees it, and has no switch for that. Go
//! clients (kubelet, the sidecars) send `localhost`. On a unix socket the authority names
//! nothing, so this layer sits between an accepted connection and the HTTP/2 server and
//! replaces an `:authority` h2 would refuse with [`REPLACEMENT`], what Go clients send.
//!
//! A field cannot be changed inside a header block in place: HPACK blocks refer to the
//! entries earlier blocks added to the connection's dynamic table, and the field must stay
//! where it is (a pseudo-header after a regular one is refused too). So every header block
//! the client sends is decoded with the client's table state (`loona-hpack`) and encoded again
//! with every field a literal that is never indexed into the table: the server's dynamic table
//! stays empty and cannot disagree with what the client meant. Only the client's HEADERS and
//! CONTINUATION frames are touched; every other frame, and the whole server-to-client
//! direction, passes through. What it does not understand (not HTTP/2, a malformed frame or
//! header block) is passed on unchanged from then on, and h2 answers it as it would have (a
//! dynamic-table reference then finds nothing and h2 closes the connection). The rewriting is
//! sans-I/O ([`Rewriter`]); [`AuthorityFix`] is the connection wrapper that feeds it.
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What the server gets instead of an `:authority` it would refuse: what Go clients send.
pub const REPLACEMENT: &[u8] = b"localhost";
const AUTHORITY: &[u8] = b":authority";
/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Frames we emit stay within the smallest SETTINGS_MAX_FRAME_SIZE a peer may set (RFC 9113
/// §4.2), so the server takes them whatever it advertised.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is passed on as it came (h2 refuses it by its own limit).
const MAX_BLOCK: usize = 1 << 20;
/// The largest dynamic table a client may ask for: h2's SETTINGS_HEADER_TABLE_SIZE, which
/// tonic leaves at HPACK's default (RFC 7541 §4.2). It bounds what the decoder keeps.
const MAX_TABLE: usize = 4096;

/// A header block that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed HPACK header block: {0}")]
pub struct Malformed(String);

/// The client's side of one connection's HPACK state, and the re-encoding of its blocks.
pub struct Recoder {
    decoder: loona_hpack::Decoder<'static>,
}

impl Default for Recoder {
    fn default() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        Self { decoder }
    }
}

impl Recoder {
    /// Decode one header block (all its frames' fragments, in order) and encode it again:
    /// the same fields in the same order, each a literal without indexing (RFC 7541 §6.2.2),
    /// an `:authority` h2 would refuse replaced by [`REPLACEMENT`].
    pub fn recode(&mut self, block: &[u8]) -> Result<Vec<u8>, Malformed> {
        let mut out = Vec::with_capacity(block.len() * 2 + 16);
        self.decoder
            .decode_with_cb(block, |name, value| {
                let value: &[u8] =
                    if *name == *AUTHORITY && !acceptable_authority(&value) { REPLACEMENT } else { &value };
                literal(&mut out, &name, value);
            })
            .map_err(|e| Malformed(format!("{e:?}")))?;
        Ok(out)
    }
}

/// Whether h2 takes this `:authority` (it builds the request's URI from it).
pub fn acceptable_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// A field as a literal without indexing, new name, both strings plain (RFC 7541 §6.2.2).
fn literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    for s in [name, value] {
        integer(out, s.len(), 7);
        out.extend_from_slice(s);
    }
}

/// An HPACK integer with an N-bit prefix whose other bits are 0 (RFC 7541 §5.1).
fn integer(out: &mut Vec<u8>, mut value: usize, prefix: u32) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(value as u8);
        return;
    }
    out.push(max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A HEADERS frame and its CONTINUATIONs, gathered until END_HEADERS.
struct Pending {
    /// The frames as they came, passed on when the block is left alone.
    raw: Vec<u8>,
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

enum State {
    /// How many bytes of the connection preface have been seen.
    Preface(usize),
    /// Frame by frame: `skip` payload bytes of a passed-on frame still to come.
    Frames { skip: usize, pending: Option<Pending> },
    /// Not understood: everything from here on goes to the server untouched.
    Passthrough,
}

/// The client-to-server byte stream of one connection, header blocks re-encoded. Sans-I/O: bytes
/// in with [`Rewriter::feed`], bytes for the server out.
pub struct Rewriter {
    state: State,
    input: Vec<u8>,
    recoder: Recoder,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self { state: State::Preface(0), input: Vec::new(), recoder: Recoder::default() }
    }
}

impl Rewriter {
    /// Take bytes the client sent; append to `out` what the server gets.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        self.input.extend_from_slice(data);
        self.process(out);
    }

    /// The client closed its side: pass on whatever is still held, as it came.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        if let State::Frames { pending: Some(p), .. } = &mut self.state {
            out.append(&mut p.raw);
        }
        out.append(&mut self.input);
        self.state = State::Passthrough;
    }

    /// Give up on the connection: what is held goes on raw, and so does everything after.
    fn pass_through(&mut self, out: &mut Vec<u8>) {
        if let State::Frames { pending: Some(p), .. } = &mut self.state {
            out.append(&mut p.raw);
        }
        self.state = State::Passthrough;
    }

    fn process(&mut self, out: &mut Vec<u8>) {
        loop {
            match &mut self.state {
                State::Passthrough => {
                    out.append(&mut self.input);
                    return;
                }
                State::Preface(seen) => {
                    let n = (PREFACE.len() - *seen).min(self.input.len());
                    if self.input[..n] != PREFACE[*seen..*seen + n] {
                        self.state = State::Passthrough;
                        continue;
                    }
                    out.extend(self.input.drain(..n));
                    *seen += n;
                    if *seen < PREFACE.len() {
                        return;
                    }
                    self.state = State::Frames { skip: 0, pending: None };
                }
                State::Frames { skip, pending } => {
                    if *skip > 0 {
                        let n = (*skip).min(self.input.len());
                        out.extend(self.input.drain(..n));
                        *skip -= n;
                        if *skip > 0 {
                            return;
                        }
                        continue;
                    }
                    if self.input.len() < FRAME_HEADER {
                        return;
                    }
                    let len =
                        usize::from(self.input[0]) << 16 | usize::from(self.input[1]) << 8 | usize::from(self.input[2]);
                    let kind = self.input[3];
                    if kind != HEADERS && kind != CONTINUATION {
                        if pending.is_some() {
                            // Only CONTINUATION may follow an open header block: h2 says so.
                            self.pass_through(out);
                            continue;
                        }
                        out.extend(self.input.drain(..FRAME_HEADER));
                        *skip = len;
                        continue;
                    }
                    if len > MAX_BLOCK {
                        self.pass_through(out);
                        continue;
                    }
                    if self.input.len() < FRAME_HEADER + len {
                        return;
                    }
                    let frame: Vec<u8> = self.input.drain(..FRAME_HEADER + len).collect();
                    if !self.header_frame(frame, out) {
                        self.pass_through(out);
                    }
                }
            }
        }
    }

    /// One HEADERS or CONTINUATION frame; `false` when the connection must be passed through
    /// (the frame is then already in `out` or in the pending raw bytes).
    fn header_frame(&mut self, frame: Vec<u8>, out: &mut Vec<u8>) -> bool {
        let State::Frames { pending, .. } = &mut self.state else { return false };
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER..];
        match (kind, pending.as_mut()) {
            (HEADERS, None) => {
                let Some((priority, fragment)) = headers_fragment(flags, payload) else {
                    out.extend_from_slice(&frame);
                    return false;
                };
                let block = fragment.to_vec();
                *pending = Some(Pending { raw: frame, stream, flags, priority, block });
            }
            (CONTINUATION, Some(p)) if p.stream == stream && p.block.len() + payload.len() <= MAX_BLOCK => {
                p.block.extend_from_slice(payload);
                p.raw.extend_from_slice(&frame);
            }
            (_, Some(p)) => {
                p.raw.extend_from_slice(&frame);
                return false;
            }
            (_, None) => {
                out.extend_from_slice(&frame);
                return false;
            }
        }
        if flags & END_HEADERS == 0 {
            return true;
        }
        let Some(p) = pending.take() else { return false };
        match self.recoder.recode(&p.block) {
            Ok(block) => {
                emit(&p, &block, out);
                true
            }
            Err(_) => {
                out.extend_from_slice(&p.raw);
                false
            }
        }
    }
}

/// A HEADERS payload's priority fields and header block fragment, padding removed.
fn headers_fragment(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut body = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*body.first()?);
        body = &body[1..];
    }
    let priority = if flags & PRIORITY != 0 {
        let p: [u8; 5] = body.get(..5)?.try_into().ok()?;
        body = &body[5..];
        Some(p)
    } else {
        None
    };
    let end = body.len().checked_sub(pad)?;
    Some((priority, &body[..end]))
}

/// The rewritten block as a HEADERS frame (END_STREAM and priority kept, padding dropped)
/// and as many CONTINUATIONs as it needs.
fn emit(p: &Pending, block: &[u8], out: &mut Vec<u8>) {
    let mut frame = |kind: u8, flags: u8, head: &[u8], body: &[u8]| {
        let len = head.len() + body.len();
        out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        out.extend_from_slice(&p.stream.to_be_bytes());
        out.extend_from_slice(head);
        out.extend_from_slice(body);
    };
    let priority: &[u8] = p.priority.as_ref().map_or(&[], |x| x.as_slice());
    let first = block.len().min(MAX_FRAME - priority.len());
    let (head, mut rest) = block.split_at(first);
    let mut flags = p.flags & (END_STREAM | PRIORITY);
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    frame(HEADERS, flags, priority, head);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
        rest = tail;
        frame(CONTINUATION, if rest.is_empty() { END_HEADERS } else { 0 }, &[], chunk);
    }
}

/// An accepted connection whose client-to-server bytes go through a [`Rewriter`].
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    ready: Vec<u8>,
    at: usize,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    pub fn new(inner: S) -> Self {
        Self { inner, rewriter: Rewriter::default(), ready: Vec::new(), at: 0, eof: false }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.at < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.at);
                buf.put_slice(&this.ready[this.at..this.at + n]);
                this.at += n;
                if this.at == this.ready.len() {
                    this.ready.clear();
                    this.at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                this.rewriter.finish(&mut this.ready);
            } else {
                this.rewriter.feed(read.filled(), &mut this.ready);
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for AuthorityFix<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    /// A literal string, not Huffman-coded.
    fn value(s: &[u8]) -> Vec<u8> {
        let mut v = vec![s.len() as u8];
        v.extend_from_slice(s);
        v
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn fields(list: &[(&str, &str)]) -> Fields {
        list.iter().map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec())).collect()
    }

    /// The blocks as the server decodes them, one decoder for the connection.
    fn served(blocks: &[Vec<u8>]) -> Vec<Fields> {
        let mut server = loona_hpack::Decoder::new();
        blocks.iter().map(|b| server.decode(b).unwrap()).collect()
    }

    const PATH_AUTHORITY: &[u8] = b"tmp%2Fcsi%2Fcsi.sock";

    #[test]
    fn a_socket_path_authority_is_replaced_in_every_literal_form_and_the_order_is_kept() {
        // :method POST (static 3), :authority in each literal form naming static index 1
        // (with incremental indexing, without indexing, never indexed), :path / (static 4).
        for kind in [0x41u8, 0x01, 0x11] {
            let mut block = vec![0x83, kind];
            block.extend_from_slice(&value(PATH_AUTHORITY));
            block.push(0x84);
            let out = Recoder::default().recode(&block).unwrap();
            let want = fields(&[(":method", "POST"), (":authority", "localhost"), (":path", "/")]);
            assert_eq!(served(&[out]), vec![want], "kind {kind:#x}");
        }
        // A literal name ":authority" (index 0).
        let mut block = vec![0x40];
        block.extend_from_slice(&value(AUTHORITY));
        block.extend_from_slice(&value(b"/run/csi.sock"));
        let out = Recoder::default().recode(&block).unwrap();
        assert_eq!(served(&[out]), vec![fields(&[(":authority", "localhost")])]);
    }

    #[test]
    fn a_huffman_coded_authority_is_decoded_and_replaced() {
        // "/" Huffman-coded: 011000 and the EOS padding 11 (RFC 7541 Appendix B).
        let block = [0x41, 0x81, 0x63];
        assert_eq!(served(&[block.to_vec()]), vec![fields(&[(":authority", "/")])]);
        let out = Recoder::default().recode(&block).unwrap();
        assert_eq!(served(&[out]), vec![fields(&[(":authority", "localhost")])]);
    }

    #[test]
    fn an_acceptable_authority_and_every_other_field_are_kept() {
        // :authority localhost:50051, a Huffman-coded value ("a": 00011 + padding), te trailers.
        let mut block = vec![0x41];
        block.extend_from_slice(&value(b"localhost:50051"));
        block.extend_from_slice(&[0x00, 0x01, b'x', 0x81, 0x1f]);
        block.push(0x00);
        block.extend_from_slice(&value(b"te"));
        block.extend_from_slice(&value(b"trailers"));
        let out = Recoder::default().recode(&block).unwrap();
        let want = fields(&[(":authority", "localhost:50051"), ("x", "a"), ("te", "trailers")]);
        assert_eq!(served(&[out]), vec![want]);
    }

    #[test]
    fn the_clients_dynamic_table_is_followed_across_blocks() {
        // Block 1 adds :authority (the path) then x-a: 1 to the client's table: 62 is x-a,
        // 63 is :authority.
        let mut first = vec![0x41];
        first.extend_from_slice(&value(PATH_AUTHORITY));
        first.push(0x40);
        first.extend_from_slice(&value(b"x-a"));
        first.extend_from_slice(&value(b"1"));
        // Block 2 refers to both entries, and names entry 63 for a new value.
        let mut second = vec![0xbf, 0xbe, 0x7f, 0x00];
        second.extend_from_slice(&value(b"other.host"));
        let mut recoder = Recoder::default();
        let out = vec![recoder.recode(&first).unwrap(), recoder.recode(&second).unwrap()];
        // The server never had an entry in its table: both blocks decode on their own.
        for block in &out {
            served(std::slice::from_ref(block));
        }
        assert_eq!(
            served(&out),
            vec![
                fields(&[(":authority", "localhost"), ("x-a", "1")]),
                fields(&[(":authority", "localhost"), ("x-a", "1"), (":authority", "other.host")]),
            ]
        );
    }

    #[test]
    fn a_malformed_block_is_an_error_not_a_panic() {
        let mut too_big = vec![0x3f, 0xe1, 0x3f]; // table size update to 8192 > 4096
        too_big.push(0x82);
        for bad in [&[0x41u8, 0x05, b'a'][..], &[0x7f], &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff], &[0xbe], &too_big] {
            assert!(Recoder::default().recode(bad).is_err(), "{bad:x?}");
        }
    }

    #[test]
    fn integers_are_encoded_as_hpack_says() {
        for prefix in [4u32, 5, 6, 7] {
            for v in [0usize, 1, 14, 15, 16, 30, 31, 62, 63, 126, 127, 128, 1337, 16_384, 1 << 20] {
                let mut ours = Vec::new();
                integer(&mut ours, v, prefix);
                assert_eq!(ours, loona_hpack::encoder::encode_integer(v, prefix as u8), "{v} with {prefix} bits");
            }
        }
    }

    fn run(chunks: &[&[u8]]) -> Vec<u8> {
        let mut r = Rewriter::default();
        let mut out = Vec::new();
        for c in chunks {
            r.feed(c, &mut out);
        }
        r.finish(&mut out);
        out
    }

    #[test]
    fn a_connection_gets_its_headers_rewritten_whatever_the_chunking() {
        let settings = frame(0x4, 0, 0, &[]);
        let mut block = vec![0x83, 0x41];
        block.extend_from_slice(&value(PATH_AUTHORITY));
        // HEADERS padded (2 bytes) with priority, split into a CONTINUATION.
        let mut payload = vec![2, 0, 0, 0, 0, 16];
        payload.extend_from_slice(&block[..3]);
        payload.extend_from_slice(&[0, 0]);
        let headers = frame(HEADERS, PADDED | PRIORITY, 1, &payload);
        let cont = frame(CONTINUATION, END_HEADERS, 1, &block[3..]);
        let data = frame(0x0, END_STREAM, 1, b"\0\0\0\0\0");
        let input = [PREFACE, &settings, &headers, &cont, &data].concat();

        let fixed_block = Recoder::default().recode(&block).unwrap();
        assert_eq!(
            served(std::slice::from_ref(&fixed_block)),
            vec![fields(&[(":method", "POST"), (":authority", "localhost")])]
        );
        let mut fixed_payload = vec![0, 0, 0, 0, 16];
        fixed_payload.extend_from_slice(&fixed_block);
        let want = [PREFACE, &settings, &frame(HEADERS, PRIORITY | END_HEADERS, 1, &fixed_payload), &data].concat();

        assert_eq!(run(&[&input]), want);
        let bytewise: Vec<&[u8]> = input.chunks(1).collect();
        assert_eq!(run(&bytewise), want);
    }

    #[test]
    fn a_big_block_is_split_into_frames_the_server_accepts() {
        // Many fields with Huffman-coded values ("a" x 100 fits in 63 bytes): the block fits
        // one frame as sent, and needs two once its values are written plain.
        let mut block = vec![0x41];
        block.extend_from_slice(&value(PATH_AUTHORITY));
        let mut huffman_a = vec![0x80 | 63];
        huffman_a.extend_from_slice(&[0x18, 0xc6, 0x31, 0x8c, 0x63].repeat(12));
        huffman_a.extend_from_slice(&[0x18, 0xc6, 0x3f]);
        while block.len() + 67 < MAX_FRAME {
            block.extend_from_slice(&[0x00, 1, b'x']);
            block.extend_from_slice(&huffman_a);
        }
        let decoded = served(&[block.clone()]).remove(0);
        assert_eq!(decoded[1].1.len(), 100, "the Huffman value is 100 bytes of 'a'");
        let headers = frame(HEADERS, END_HEADERS | END_STREAM, 3, &block);
        let out = run(&[PREFACE, &headers]);
        let mut at = PREFACE.len();
        let mut gathered = Vec::new();
        let mut kinds = Vec::new();
        while at < out.len() {
            let len = usize::from(out[at]) << 16 | usize::from(out[at + 1]) << 8 | usize::from(out[at + 2]);
            assert!(len <= MAX_FRAME);
            kinds.push((out[at + 3], out[at + 4]));
            gathered.extend_from_slice(&out[at + FRAME_HEADER..at + FRAME_HEADER + len]);
            at += FRAME_HEADER + len;
        }
        assert_eq!(kinds.first(), Some(&(HEADERS, END_STREAM)));
        assert_eq!(kinds.last(), Some(&(CONTINUATION, END_HEADERS)));
        assert!(kinds.len() >= 2);
        let mut want = decoded;
        want[0].1 = REPLACEMENT.to_vec();
        assert_eq!(served(&[gathered]), vec![want]);
    }

    #[test]
    fn anything_not_understood_passes_through_unchanged() {
        // Not HTTP/2 at all.
        let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(run(&[http1]), http1);
        // A CONTINUATION with no HEADERS before it, then a frame with authority: from the
        // protocol error on, nothing is touched.
        let mut block = vec![0x41];
        block.extend_from_slice(&value(PATH_AUTHORITY));
        let input =
            [PREFACE, &frame(CONTINUATION, END_HEADERS, 1, b"\x82"), &frame(HEADERS, END_HEADERS, 3, &block)].concat();
        assert_eq!(run(&[&input]), input);
        // A truncated header block at the end of the stream goes on as it came.
        let cut = [PREFACE, &frame(HEADERS, 0, 1, &block)[..12]].concat();
        assert_eq!(run(&[&cut]), cut);
        // A block that does not decode goes on as it came, and so does what follows.
        let bad = frame(HEADERS, END_HEADERS, 1, &[0xbe]);
        let after = frame(HEADERS, END_HEADERS, 3, &block);
        let input = [PREFACE, &bad, &after].concat();
        assert_eq!(run(&[&input]), input);
    }
}
