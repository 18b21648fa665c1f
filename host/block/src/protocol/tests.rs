//! Round trips, hostile input and the streaming decoder's buffer handling.

use super::decode::{FIRST_READ, MIN_READ};
use super::encode::checksum;
use super::*;
use crate::testutil::Rng;

pub(crate) fn random_message(rng: &mut Rng) -> Message {
    let name = |rng: &mut Rng| -> String {
        let n = rng.below(12) as usize;
        (0..n).map(|_| char::from(b'a' + rng.below(26) as u8)).collect()
    };
    let data = |rng: &mut Rng| -> Vec<u8> {
        let n = rng.below(300) as usize;
        (0..n).map(|_| rng.next() as u8).collect()
    };
    let status = |rng: &mut Rng| Status::from_wire(rng.below(12) as u16).unwrap_or(Status::Ok);
    // Half on the default disk (the bytes of the version before disks), half on another.
    let disk = |rng: &mut Rng| if rng.below(2) == 0 { DEFAULT_DISK.to_owned() } else { format!("d{}", name(rng)) };
    match rng.below(36) {
        0 => Message::Hello {
            volume_id: name(rng),
            protocol_version: rng.next() as u16,
            revision: rng.next(),
            disk: disk(rng),
        },
        1 => Message::HelloReply {
            status: status(rng),
            header: ReplicaHeader {
                volume_id: name(rng),
                size: rng.next(),
                revision: rng.next(),
                snapshots: (0..rng.below(4))
                    .map(|_| SnapshotInfo { name: name(rng), revision: rng.next(), created_ns: rng.next() })
                    .collect(),
                dirty: rng.below(2) == 1,
            },
        },
        2 => Message::Read { offset: rng.next(), len: rng.next() as u32 },
        3 => Message::ReadReply { status: status(rng), data: data(rng) },
        4 => Message::Write { offset: rng.next(), revision: rng.next(), data: data(rng).into() },
        5 => Message::Flush,
        6 => Message::Unmap { offset: rng.next(), len: rng.next(), revision: rng.next() },
        7 => Message::Snapshot { name: name(rng), revision: rng.next() },
        8 => Message::SetRevision { revision: rng.next() },
        9 => Message::Reply { status: status(rng) },
        10 => Message::ListExtents { offset: rng.next(), len: rng.next() },
        11 => Message::ExtentMap {
            status: status(rng),
            extents: (0..rng.below(5))
                .map(|_| Extent {
                    offset: rng.next(),
                    len: rng.next(),
                    state: if rng.below(2) == 0 { ExtentState::Allocated } else { ExtentState::Unflushed },
                })
                .collect(),
        },
        12 => Message::ReadExtent { offset: rng.next(), len: rng.next() as u32, revision: rng.next() },
        13 => Message::Resize { size: rng.next(), revision: rng.next() },
        14 => Message::DeleteSnapshot { name: name(rng), revision: rng.next() },
        15 => Message::Revert { name: name(rng), revision: rng.next() },
        16 => Message::ReadSnapshot { name: name(rng), offset: rng.next(), len: rng.next() as u32 },
        17 => Message::ListSnapshotExtents { name: name(rng), offset: rng.next(), len: rng.next() },
        18 => Message::CreateReplica { volume_id: name(rng), size: rng.next() },
        19 => Message::DeleteReplica { volume_id: name(rng), disk: disk(rng) },
        20 => Message::NodeInfo,
        21 => Message::Reinitialize { revision: rng.next() },
        22 => Message::Claim { epoch: rng.next() },
        23 => Message::Describe { volume_id: name(rng), disk: disk(rng) },
        24 => Message::Description {
            status: status(rng),
            header: ReplicaHeader {
                volume_id: name(rng),
                size: rng.next(),
                revision: rng.next(),
                snapshots: (0..rng.below(3))
                    .map(|_| SnapshotInfo { name: name(rng), revision: rng.next(), created_ns: rng.next() })
                    .collect(),
                dirty: rng.below(2) == 1,
            },
            record: RecordInfo { version: rng.next(), epoch: rng.next(), data: data(rng) },
        },
        25 => Message::SetRecord {
            volume_id: name(rng),
            version: rng.next(),
            epoch: rng.next(),
            data: data(rng),
            disk: disk(rng),
        },
        26 => Message::Identify,
        27 => Message::Identity {
            status: status(rng),
            node: name(rng),
            labels: (0..rng.below(4)).map(|_| (name(rng), name(rng))).collect(),
        },
        28 => Message::EngineCall { volume_id: name(rng), request: data(rng) },
        29 => Message::EngineReply { status: status(rng), reply: data(rng) },
        30 => Message::Grant { grant: data(rng) },
        31 => Message::CreateReplicaOn { disk: name(rng), volume_id: name(rng), size: rng.next() },
        32 => Message::ListDisks,
        33 => Message::DiskList {
            status: status(rng),
            disks: (0..rng.below(4))
                .map(|_| DiskSummary {
                    name: name(rng),
                    capacity: rng.next(),
                    available: rng.next(),
                    volumes: (0..rng.below(4)).map(|_| name(rng)).collect(),
                })
                .collect(),
        },
        34 => Message::ListSnapshotDelta {
            base: rng.chance(50).then(|| name(rng)),
            name: name(rng),
            offset: rng.next(),
            len: rng.next(),
        },
        _ => Message::NodeInfoReply {
            status: status(rng),
            capacity: rng.next(),
            available: rng.next(),
            replicas: (0..rng.below(4))
                .map(|_| ReplicaSummary {
                    volume_id: name(rng),
                    size: rng.next(),
                    revision: rng.next(),
                    dirty: rng.below(2) == 1,
                    allocated: rng.next(),
                })
                .collect(),
        },
    }
}

fn encoded(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    encode(frame, &mut out).expect("encodable");
    out
}

#[test]
fn every_message_kind_round_trips() {
    let mut rng = Rng::new(1);
    let mut kinds = std::collections::HashSet::new();
    for i in 0..2000 {
        let frame = Frame { request_id: i, message: random_message(&mut rng) };
        kinds.insert(frame.message.kind());
        let bytes = encoded(&frame);
        assert_eq!(decode(&bytes), Ok(Decoded::Frame(frame, bytes.len())));
    }
    assert_eq!(kinds.len(), 37, "the generator covers every kind");
}

#[test]
fn header_layout_is_little_endian_with_magic_and_version() {
    let bytes = encoded(&Frame { request_id: 0x0102_0304_0506_0708, message: Message::Flush });
    assert_eq!(&bytes[0..4], b"WCSB");
    assert_eq!(&bytes[4..6], &[1, 0]);
    assert_eq!(&bytes[6..8], &[6, 0]);
    assert_eq!(&bytes[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
    assert_eq!(&bytes[16..20], &[0, 0, 0, 0]);
    assert_eq!(bytes.len(), HEADER_LEN);
}

#[test]
fn every_strict_prefix_of_a_frame_needs_more() {
    let mut rng = Rng::new(2);
    for i in 0..200 {
        let bytes = encoded(&Frame { request_id: i, message: random_message(&mut rng) });
        for cut in 0..bytes.len() {
            match decode(&bytes[..cut]) {
                Ok(Decoded::NeedMore(n)) => assert!(n > cut && n <= bytes.len()),
                other => panic!("prefix of {cut}/{} bytes gave {other:?}", bytes.len()),
            }
        }
    }
}

#[test]
fn any_single_flipped_bit_is_rejected_or_needs_more() {
    let mut rng = Rng::new(3);
    for i in 0..300 {
        let frame = Frame { request_id: i, message: random_message(&mut rng) };
        let mut bytes = encoded(&frame);
        let bit = rng.below(bytes.len() as u64 * 8) as usize;
        bytes[bit / 8] ^= 1 << (bit % 8);
        // A flipped length may make the frame look longer (NeedMore) but never yields a frame.
        match decode(&bytes) {
            Err(_) | Ok(Decoded::NeedMore(_)) => {}
            Ok(Decoded::Frame(f, _)) => panic!("corrupted frame accepted: {f:?}"),
        }
    }
}

#[test]
fn random_garbage_never_panics_and_never_over_allocates() {
    let mut rng = Rng::new(4);
    for _ in 0..20_000 {
        let n = rng.below(64) as usize;
        let mut bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        // Half the time start with a valid header prefix so the deeper paths get exercised.
        if rng.below(2) == 0 && bytes.len() >= 8 {
            bytes[..4].copy_from_slice(&MAGIC);
            bytes[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        }
        let _ = decode_with_limit(&bytes, 1 << 20);
    }
}

#[test]
fn oversized_frame_is_rejected_from_the_header_alone() {
    let mut header = Vec::new();
    encode(&Frame { request_id: 9, message: Message::Flush }, &mut header).expect("encodable");
    header[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode_with_limit(&header, 4096), Err(DecodeError::FrameTooLarge { len: u32::MAX as usize, max: 4096 }));
}

#[test]
fn encoder_refuses_a_payload_over_the_limit() {
    let frame = Frame { request_id: 1, message: Message::Write { offset: 0, revision: 0, data: vec![0; 100].into() } };
    let mut out = vec![7];
    assert_eq!(encode_with_limit(&frame, &mut out, 50), Err(EncodeError::TooLarge { len: 116, max: 50 }));
    assert_eq!(out, vec![7], "a failed encode leaves the buffer as it was");
}

#[test]
fn wrong_magic_is_rejected_after_the_first_byte() {
    assert_eq!(decode(b"X"), Err(DecodeError::BadMagic([b'X', 0, 0, 0])));
    assert_eq!(decode(b""), Ok(Decoded::NeedMore(HEADER_LEN)));
}

#[test]
fn other_protocol_version_is_rejected() {
    let mut bytes = encoded(&Frame { request_id: 1, message: Message::Flush });
    bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
    assert_eq!(decode(&bytes), Err(DecodeError::UnsupportedVersion(2)));
}

#[test]
fn trailing_bytes_inside_a_payload_are_malformed() {
    let mut bytes = encoded(&Frame { request_id: 1, message: Message::SetRevision { revision: 5 } });
    bytes.push(0);
    bytes[16..20].copy_from_slice(&9u32.to_le_bytes());
    let crc = checksum(&bytes[..20], &bytes[HEADER_LEN..]);
    bytes[20..24].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(decode(&bytes), Err(DecodeError::Malformed { kind: 9, .. })));
}

#[test]
fn stream_decoder_reassembles_frames_split_at_random_points() {
    let mut rng = Rng::new(5);
    let frames: Vec<Frame> = (0..500).map(|i| Frame { request_id: i, message: random_message(&mut rng) }).collect();
    let mut stream = Vec::new();
    for f in &frames {
        encode(f, &mut stream).expect("encodable");
    }
    let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
    let mut got = Vec::new();
    let mut pos = 0;
    while pos < stream.len() {
        let n = (rng.below(100) as usize + 1).min(stream.len() - pos);
        dec.push(&stream[pos..pos + n]);
        pos += n;
        while let Some(f) = dec.next_frame().expect("valid stream") {
            got.push(f);
        }
    }
    assert_eq!(got, frames);
}

/// A large write encoded in two pieces (header, shared payload) is the same bytes as the
/// one-piece encoding, and decodes from a stream split anywhere, also around small frames.
#[test]
fn split_encoding_of_large_writes_matches_and_round_trips_through_the_stream_decoder() {
    let mut rng = Rng::new(11);
    let mut frames = Vec::new();
    for i in 0..40u64 {
        let len = [SPLIT_MIN - 1, SPLIT_MIN, SPLIT_MIN + 4096, 1 << 20, 4096][i as usize % 5];
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let write = Message::Write { offset: rng.next(), revision: i, data: data.into() };
        frames.push(Frame { request_id: 2 * i, message: write });
        frames.push(Frame { request_id: 2 * i + 1, message: Message::Read { offset: i, len: 4096 } });
    }
    let mut stream = Vec::new();
    let mut crc = PayloadCrc::default();
    for f in &frames {
        let mut whole = Vec::new();
        encode(f, &mut whole).expect("encodable");
        // Twice, as for two replicas (the second checksum comes from the cache), and once
        // more under another request id with the payload still cached.
        for _ in 0..2 {
            let mut head = Vec::new();
            let tail = encode_split(f, &mut head, DEFAULT_MAX_PAYLOAD, &mut crc).expect("encodable");
            head.extend_from_slice(tail.as_deref().unwrap_or_default());
            assert_eq!(head, whole, "frame {}", f.request_id);
        }
        let other = Frame { request_id: f.request_id + 1000, message: f.message.clone() };
        let (mut plain, mut head) = (Vec::new(), Vec::new());
        encode(&other, &mut plain).expect("encodable");
        let tail = encode_split(&other, &mut head, DEFAULT_MAX_PAYLOAD, &mut crc).expect("encodable");
        head.extend_from_slice(tail.as_deref().unwrap_or_default());
        assert_eq!(head, plain, "frame {} again", f.request_id);
        stream.extend_from_slice(&whole);
    }
    let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
    let mut got = Vec::new();
    let mut pos = 0;
    while pos < stream.len() {
        let n = (rng.below(300_000) as usize + 1).min(stream.len() - pos);
        dec.push(&stream[pos..pos + n]);
        pos += n;
        while let Some(f) = dec.next_frame().expect("valid stream") {
            got.push(f);
        }
    }
    assert_eq!(got, frames);
    let mut small = Vec::new();
    let frame =
        Frame { request_id: 1, message: Message::Write { offset: 0, revision: 0, data: vec![0; 4 << 20].into() } };
    assert!(matches!(encode_split(&frame, &mut small, 1 << 20, &mut crc), Err(EncodeError::TooLarge { .. })));
    assert!(small.is_empty());
}

/// While a large frame is incomplete, a read through `read_buffer` stops at its end, so the
/// next frame's bytes never share the buffer the large write's data is a view into.
#[test]
fn read_buffer_ends_at_a_large_frame_and_not_before_small_ones() {
    use bytes::BufMut as _;
    let data = vec![7u8; 1 << 20];
    let big = Frame { request_id: 1, message: Message::Write { offset: 0, revision: 0, data: data.into() } };
    let small = Frame { request_id: 2, message: Message::Flush };
    let mut stream = Vec::new();
    encode(&big, &mut stream).expect("encodable");
    encode(&small, &mut stream).expect("encodable");
    let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
    dec.push(&stream[..100]);
    assert_eq!(dec.next_frame(), Ok(None));
    let room = dec.read_buffer().remaining_mut();
    assert_eq!(room, HEADER_LEN + 16 + (1 << 20) - 100);
    let mut pos = 100;
    while pos < stream.len() {
        let mut room = dec.read_buffer();
        let n = room.remaining_mut().min(stream.len() - pos);
        room.put_slice(&stream[pos..pos + n]);
        pos += n;
        if let Some(f) = dec.next_frame().expect("valid") {
            assert_eq!(f, [&big, &small][f.request_id as usize - 1].clone());
        }
    }
    for _ in 0..5 {
        dec.read_buffer();
    }
    assert!(dec.read_buffer().chunk_mut().len() >= MIN_READ);
}

#[test]
fn a_decoders_read_room_starts_small_and_grows_with_the_reads() {
    use bytes::BufMut as _;
    // What a connection that has sent nothing yet holds: an idle peer costs no more.
    let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
    let first = dec.read_buffer().chunk_mut().len();
    assert!((FIRST_READ..64 * 1024).contains(&first), "{first}");
    let mut rooms = Vec::new();
    for _ in 0..8 {
        let mut room = dec.read_buffer();
        rooms.push(room.chunk_mut().len());
        room.put_slice(&[0; 8]);
    }
    assert!(*rooms.last().expect("eight") >= MIN_READ, "{rooms:?}");
}

#[test]
fn stream_decoder_stays_failed_after_corruption() {
    let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
    dec.push(b"nope, not a frame at all");
    assert!(dec.next_frame().is_err());
    let mut good = Vec::new();
    encode(&Frame { request_id: 1, message: Message::Flush }, &mut good).expect("encodable");
    dec.push(&good);
    assert!(dec.next_frame().is_err());
}

#[test]
fn a_grant_is_kind_32_its_refusal_status_11_and_an_oversized_grant_malformed() {
    let bytes = encoded(&Frame { request_id: 1, message: Message::Grant { grant: vec![7; MAX_GRANT_LEN] } });
    assert_eq!(&bytes[6..8], &[32, 0]);
    assert!(matches!(decode(&bytes), Ok(Decoded::Frame(..))));
    let denied = encoded(&Frame { request_id: 1, message: Message::Reply { status: Status::Denied } });
    assert_eq!(&denied[HEADER_LEN..], &[11, 0]);
    let too_long = encoded(&Frame { request_id: 1, message: Message::Grant { grant: vec![7; MAX_GRANT_LEN + 1] } });
    assert_eq!(decode(&too_long), Err(DecodeError::Malformed { kind: 32, what: "grant too long" }));
}

#[test]
fn a_request_on_the_default_disk_is_the_bytes_of_the_version_before_disks_and_others_name_theirs() {
    // Hello as a peer of the version before disks wrote it: volume, protocol version, revision.
    let mut old = Vec::new();
    old.extend_from_slice(&1u16.to_le_bytes());
    old.push(b'v');
    old.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    old.extend_from_slice(&7u64.to_le_bytes());
    let hello = |disk: &str| Message::Hello {
        volume_id: "v".into(),
        protocol_version: PROTOCOL_VERSION,
        revision: 7,
        disk: disk.into(),
    };
    let bytes = encoded(&Frame { request_id: 1, message: hello(DEFAULT_DISK) });
    assert_eq!(&bytes[HEADER_LEN..], &old[..], "no disk on the wire for the default one");
    let on_ssd = encoded(&Frame { request_id: 1, message: hello("ssd") });
    assert_eq!(&on_ssd[HEADER_LEN + old.len()..], &[3, 0, b's', b's', b'd']);
    assert!(matches!(decode(&on_ssd), Ok(Decoded::Frame(f, _)) if f.message == hello("ssd")));
    // A record on another disk is kind 37 (the record runs to the end); the default's stays 27.
    let record = |disk: &str| Message::SetRecord {
        volume_id: "v".into(),
        version: 2,
        epoch: 3,
        data: b"{}".to_vec(),
        disk: disk.into(),
    };
    assert_eq!(&encoded(&Frame { request_id: 1, message: record(DEFAULT_DISK) })[6..8], &[27, 0]);
    let other = encoded(&Frame { request_id: 1, message: record("ssd") });
    assert_eq!(&other[6..8], &[37, 0]);
    assert!(matches!(decode(&other), Ok(Decoded::Frame(f, _)) if f.message == record("ssd")));
}

#[test]
fn the_default_disk_spelled_out_is_malformed() {
    let mut frame =
        encoded(&Frame { request_id: 1, message: Message::Describe { volume_id: "v".into(), disk: "xxxxxxx".into() } });
    let at = frame.len() - DEFAULT_DISK.len();
    frame[at..].copy_from_slice(DEFAULT_DISK.as_bytes());
    // Re-seal the frame's checksum over the edited payload.
    let crc = checksum(&frame[..HEADER_LEN - 4], &frame[HEADER_LEN..]);
    frame[HEADER_LEN - 4..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(decode(&frame), Err(DecodeError::Malformed { kind: 25, .. })), "{:?}", decode(&frame));
}
