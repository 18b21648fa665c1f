//! Fuzz target for the replica protocol decoder: arbitrary bytes must never panic or allocate
//! beyond the frame limit, every frame it accepts must re-encode to the very bytes it came from,
//! and the streaming decoder fed the same bytes in arbitrary pieces must yield the same frames and
//! fail exactly when the one-shot decoder fails.
//!
//! Input layout: one control byte, then the stream. Bit 0 clear (the common case) rewrites the
//! CRC of every frame in the stream before decoding, so that mutated payloads reach the payload
//! parsers instead of all dying at the checksum; bit 0 set leaves the bytes as they are (the
//! checksum check itself). Bits 1..8 give the size of the pieces the streaming decoder is fed.
//!
//! With `WASMCSI_FUZZ_SEEDS=DIR` set, the target first writes a seed corpus of well-formed frames
//! into DIR (libFuzzer reads its corpus directories after this init runs; `scripts/test` passes
//! the same DIR as the corpus).
#![no_main]

use libfuzzer_sys::fuzz_target;
use wasmcsi_block::protocol::{Decoded, FrameDecoder, decode_with_limit, encode};
use wasmcsi_block_fuzz::{fix_crcs, write_seeds};

const LIMIT: usize = 1 << 16;

fuzz_target!(
    init: {
        if let Some(dir) = std::env::var_os("WASMCSI_FUZZ_SEEDS") {
            write_seeds(dir.as_ref()).expect("writing the seed corpus");
        }
    },
    |input: &[u8]| {
    let Some((&control, rest)) = input.split_first() else { return };
    let mut data = rest.to_vec();
    if control & 1 == 0 {
        fix_crcs(&mut data);
    }

    // One-shot: decode frame after frame from the front until more bytes are needed or an error.
    let mut frames = Vec::new();
    let mut at = 0;
    let failed = loop {
        match decode_with_limit(&data[at..], LIMIT) {
            Ok(Decoded::Frame(frame, used)) => {
                assert!(used > 0 && used <= data.len() - at, "frame used {used} of {} bytes", data.len() - at);
                let mut again = Vec::new();
                encode(&frame, &mut again).expect("a decoded frame encodes");
                assert_eq!(&again[..], &data[at..at + used], "decode/encode is not a bijection");
                frames.push(frame);
                at += used;
            }
            Ok(Decoded::NeedMore(n)) => {
                assert!(n > data.len() - at, "asked for {n} bytes with {} buffered", data.len() - at);
                break false;
            }
            Err(_) => break true,
        }
    };

    // Streaming, in pieces: the same frames, and an error iff the one-shot decoder erred.
    let piece = usize::from(control >> 1) + 1;
    let mut stream = FrameDecoder::new(LIMIT);
    let mut streamed = Vec::new();
    let mut stream_failed = false;
    'feed: for chunk in data.chunks(piece) {
        stream.push(chunk);
        loop {
            match stream.next_frame() {
                Ok(Some(frame)) => streamed.push(frame),
                Ok(None) => break,
                Err(_) => {
                    stream_failed = true;
                    break 'feed;
                }
            }
        }
    }
    assert_eq!(streamed, frames, "streaming and one-shot decoding disagree on the frames");
    assert_eq!(stream_failed, failed, "streaming and one-shot decoding disagree on failing");
    if stream_failed {
        assert!(stream.next_frame().is_err(), "a failed stream must stay failed");
    }
}
);
