//! Helpers of the `decode` fuzz target: CRC repair of mutated inputs and the seed corpus.

use std::io;
use std::path::Path;

use wasmcsi_block::protocol::{Extent, ExtentState, Frame, Message, PROTOCOL_VERSION, Status, encode};

/// Bytes 0..20 of a frame are covered by the CRC at 20..24 together with the payload after 24.
const HEADER_LEN: usize = 24;

/// Rewrites the CRC-32 of every frame in `data` (frames delimited by their length fields, the
/// last one possibly truncated) to match the bytes, so a mutated frame is not rejected by its
/// checksum before its payload is parsed.
pub fn fix_crcs(data: &mut [u8]) {
    let mut at = 0;
    while data.len() - at >= HEADER_LEN {
        let mut len = [0; 4];
        len.copy_from_slice(&data[at + 16..at + 20]);
        let n = usize::try_from(u32::from_le_bytes(len)).unwrap_or(usize::MAX);
        let end = (at + HEADER_LEN).saturating_add(n).min(data.len());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&data[at..at + 20]);
        crc.update(&data[at + HEADER_LEN..end]);
        data[at + 20..at + 24].copy_from_slice(&crc.finalize().to_le_bytes());
        at = end;
    }
}

/// Writes a seed corpus into `dir`: one well-formed frame of each common message, and one
/// stream of all of them back to back. Made from the encoder at run time, so the seeds follow the
/// protocol as it changes. Each seed starts with the target's control byte (0: repair CRCs, feed
/// the stream byte by byte; 0x3e: feed it in 32-byte pieces).
pub fn write_seeds(dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let messages = vec![
        Message::Hello { volume_id: "pvc-1".into(), protocol_version: PROTOCOL_VERSION, revision: 3, disk: wasmcsi_block::protocol::DEFAULT_DISK.into() },
        Message::Read { offset: 4096, len: 4096 },
        Message::ReadReply { status: Status::Ok, data: vec![0xa5; 64] },
        Message::Write { offset: 8192, revision: 3, data: vec![0x5a; 64].into() },
        Message::Flush,
        Message::Unmap { offset: 0, len: 1 << 20, revision: 3 },
        Message::SetRevision { revision: 4 },
        Message::Reply { status: Status::StaleRevision },
        Message::ListExtents { offset: 0, len: 1 << 30 },
        Message::ExtentMap {
            status: Status::Ok,
            extents: vec![
                Extent { offset: 0, len: 65536, state: ExtentState::Allocated },
                Extent { offset: 1 << 20, len: 4096, state: ExtentState::Unflushed },
            ],
        },
        Message::ReadExtent { offset: 1 << 20, len: 1 << 16, revision: 4 },
        Message::Snapshot { name: "snap-1".into(), revision: 4 },
        Message::Resize { size: 2 << 30, revision: 4 },
        Message::Reinitialize { revision: 5 },
        Message::CreateReplica { volume_id: "pvc-2".into(), size: 1 << 30 },
        Message::DeleteReplica { volume_id: "pvc-2".into(), disk: wasmcsi_block::protocol::DEFAULT_DISK.into() },
        Message::NodeInfo,
        Message::CreateReplicaOn { disk: "ssd".into(), volume_id: "pvc-3".into(), size: 1 << 30 },
        Message::ListDisks,
        Message::ListSnapshotDelta { base: Some("snap-1".into()), name: "snap-2".into(), offset: 0, len: 1 << 30 },
        Message::Grant { grant: b"WCSIGRT1".iter().copied().chain([0xab; 56]).collect() },
        Message::Reply { status: Status::Denied },
    ];
    let mut stream = vec![0x3e];
    for (i, message) in messages.into_iter().enumerate() {
        let mut bytes = vec![0];
        let frame = Frame { request_id: i as u64 + 1, message };
        encode(&frame, &mut bytes).map_err(io::Error::other)?;
        stream.extend_from_slice(&bytes[1..]);
        std::fs::write(dir.join(format!("seed-frame-{i:02}")), &bytes)?;
    }
    std::fs::write(dir.join("seed-stream"), &stream)
}
