//! Fuzz target for the replica protocol decoder: arbitrary bytes must never panic or allocate
//! beyond the frame limit, and every frame it accepts must re-encode to the very bytes it came from.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wasmcsi_block::protocol::{Decoded, FrameDecoder, decode_with_limit, encode};

const LIMIT: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    if let Ok(Decoded::Frame(frame, used)) = decode_with_limit(data, LIMIT) {
        let mut again = Vec::new();
        encode(&frame, &mut again).expect("a decoded frame encodes");
        assert_eq!(&again[..], &data[..used], "decode/encode is not a bijection");
    }
    // The streaming decoder fed in two pieces must agree with the one-shot decoder.
    let mut stream = FrameDecoder::new(LIMIT);
    let split = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    stream.push(&data[..split]);
    let _ = stream.next_frame();
    stream.push(&data[split..]);
    while let Ok(Some(_)) = stream.next_frame() {}
});
