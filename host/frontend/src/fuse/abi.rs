//! The FUSE wire protocol (`include/uapi/linux/fuse.h`), the subset a filesystem of one regular
//! file needs: the request header and the arguments of the operations [`super::server`] answers,
//! decoded from bytes by hand (no `unsafe`, no transmutes), and the replies encoded the same
//! way. Everything is little-endian native layout, as the kernel lays its structs out on x86-64
//! and aarch64.
//!
//! It owns bytes only: which operation gets which answer is the server's business.

/// The protocol version this server speaks (the kernel speaks the lower of its own and ours).
pub const KERNEL_VERSION: u32 = 7;
/// 7.31: every struct below has the size it has there, `FUSE_MAX_PAGES` (7.28) is known.
pub const KERNEL_MINOR: u32 = 31;

pub const IN_HEADER_LEN: usize = 40;
pub const OUT_HEADER_LEN: usize = 16;

/// Operation codes.
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

/// `fuse_init_in.flags` / `fuse_init_out.flags` bits this server asks for.
pub mod init {
    pub const ASYNC_READ: u32 = 1 << 0;
    pub const BIG_WRITES: u32 = 1 << 5;
    pub const ASYNC_DIO: u32 = 1 << 15;
    pub const MAX_PAGES: u32 = 1 << 22;
}

/// `fuse_open_out.open_flags`.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
/// `fuse_setattr_in.valid`: the size is to be set.
pub const FATTR_SIZE: u32 = 1 << 3;
/// `fuse_out_header.error` of an inode-invalidation notification.
pub const NOTIFY_INVAL_INODE: i32 = 2;

/// The header every request starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
}

/// Reads fixed-size little-endian fields off a byte slice; every read is bounds-checked.
#[derive(Debug)]
pub struct Fields<'a> {
    buf: &'a [u8],
}

impl<'a> Fields<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.buf.split_first_chunk::<N>()?;
        self.buf = rest;
        Some(*head)
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }

    pub fn skip(&mut self, n: usize) -> Option<()> {
        self.buf = self.buf.get(n..)?;
        Some(())
    }

    /// What is left.
    pub fn rest(self) -> &'a [u8] {
        self.buf
    }
}

/// Splits a request into its header and its arguments; `None` for a request shorter than its
/// header or than the length the header claims.
pub fn parse(buf: &[u8]) -> Option<(InHeader, &[u8])> {
    let mut f = Fields::new(buf);
    let header = InHeader { len: f.u32()?, opcode: f.u32()?, unique: f.u64()?, nodeid: f.u64()? };
    let len = usize::try_from(header.len).ok()?;
    if len < IN_HEADER_LEN || len > buf.len() {
        return None;
    }
    Some((header, &buf[IN_HEADER_LEN..len]))
}

/// `fuse_init_in`: the kernel's version and what it offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
}

impl InitIn {
    pub fn parse(args: &[u8]) -> Option<Self> {
        let mut f = Fields::new(args);
        Some(Self { major: f.u32()?, minor: f.u32()?, max_readahead: f.u32()?, flags: f.u32()? })
    }
}

/// What this server answers to INIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitOut {
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub max_pages: u16,
}

impl InitOut {
    /// `fuse_init_out` (64 bytes at 7.31: the kernel reads as much of it as it knows).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Out::default();
        out.u32(KERNEL_VERSION).u32(self.minor).u32(self.max_readahead).u32(self.flags);
        out.u16(self.max_background).u16(self.congestion_threshold).u32(self.max_write);
        out.u32(1); // time_gran: nanoseconds
        out.u16(self.max_pages).u16(0); // map_alignment
        out.u32(0).u32(0); // flags2, max_stack_depth
        out.zeros(6 * 4);
        out.0
    }
}

/// `fuse_read_in` and `fuse_write_in` share their first fields: fh, offset, size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoIn {
    pub offset: u64,
    pub size: u32,
}

/// Size of `fuse_write_in`, after which the data follows.
pub const WRITE_IN_LEN: usize = 40;

impl IoIn {
    pub fn parse(args: &[u8]) -> Option<Self> {
        let mut f = Fields::new(args);
        f.skip(8)?; // fh
        Some(Self { offset: f.u64()?, size: f.u32()? })
    }
}

/// `fuse_setattr_in`: which attributes to set, and the size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetattrIn {
    pub valid: u32,
    pub size: u64,
}

impl SetattrIn {
    pub fn parse(args: &[u8]) -> Option<Self> {
        let mut f = Fields::new(args);
        let valid = f.u32()?;
        f.skip(4 + 8)?; // padding, fh
        Some(Self { valid, size: f.u64()? })
    }
}

/// `fuse_fallocate_in`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FallocateIn {
    pub offset: u64,
    pub length: u64,
    pub mode: u32,
}

impl FallocateIn {
    pub fn parse(args: &[u8]) -> Option<Self> {
        let mut f = Fields::new(args);
        f.skip(8)?; // fh
        Some(Self { offset: f.u64()?, length: f.u64()?, mode: f.u32()? })
    }
}

/// `fuse_read_in` of READDIR: the offset to continue at.
pub fn readdir_offset(args: &[u8]) -> Option<u64> {
    IoIn::parse(args).map(|r| r.offset)
}

/// A little-endian encoder for reply bodies.
#[derive(Debug, Default)]
pub struct Out(pub Vec<u8>);

impl Out {
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
}

/// The header of a reply (`error` is 0 or a negated errno) or notification.
pub fn out_header(len: usize, error: i32, unique: u64) -> [u8; OUT_HEADER_LEN] {
    let mut h = [0u8; OUT_HEADER_LEN];
    // A reply is at most a header and one read's data (bounded by max_read), far below 4 GiB.
    h[..4].copy_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    h[4..8].copy_from_slice(&error.to_le_bytes());
    h[8..].copy_from_slice(&unique.to_le_bytes());
    h
}

/// The attributes of an inode (`fuse_attr`, 88 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    /// Type and permission bits, e.g. `S_IFREG | 0o600`.
    pub mode: u32,
    pub nlink: u32,
}

pub const S_IFDIR: u32 = 0o040_000;
pub const S_IFREG: u32 = 0o100_000;

impl Attr {
    fn put(&self, out: &mut Out) {
        out.u64(self.ino).u64(self.size).u64(self.size.div_ceil(512));
        out.u64(0).u64(0).u64(0); // atime, mtime, ctime: the epoch
        out.u32(0).u32(0).u32(0);
        out.u32(self.mode).u32(self.nlink).u32(0).u32(0).u32(0); // uid, gid root; rdev
        out.u32(4096).u32(0); // blksize, flags
    }

    /// `fuse_attr_out`: the attributes valid for `ttl_secs`.
    pub fn encode_attr_out(&self, ttl_secs: u64) -> Vec<u8> {
        let mut out = Out::default();
        out.u64(ttl_secs).u32(0).u32(0);
        self.put(&mut out);
        out.0
    }

    /// `fuse_entry_out`: a lookup's answer, the entry and attributes valid for `ttl_secs`.
    pub fn encode_entry_out(&self, ttl_secs: u64) -> Vec<u8> {
        let mut out = Out::default();
        out.u64(self.ino).u64(0).u64(ttl_secs).u64(ttl_secs).u32(0).u32(0);
        self.put(&mut out);
        out.0
    }
}

/// `fuse_open_out`.
pub fn encode_open_out(open_flags: u32) -> Vec<u8> {
    let mut out = Out::default();
    out.u64(0).u32(open_flags).u32(0);
    out.0
}

/// `fuse_write_out`. On the stack: it answers every write, and a vector was an allocation each.
pub fn encode_write_out(size: u32) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&size.to_le_bytes());
    out
}

/// `fuse_statfs_out`.
pub fn encode_statfs_out(blocks: u64, bsize: u32) -> Vec<u8> {
    let mut out = Out::default();
    out.u64(blocks).u64(0).u64(0).u64(2).u64(0); // blocks, bfree, bavail, files, ffree
    out.u32(bsize).u32(255).u32(bsize).u32(0); // bsize, namelen, frsize, padding
    out.zeros(6 * 4);
    out.0
}

/// One `fuse_dirent` (padded to 8 bytes) appended to `out`.
pub fn put_dirent(out: &mut Vec<u8>, ino: u64, next_offset: u64, kind: u32, name: &str) {
    let mut e = Out::default();
    // A name here is one of three short constants.
    e.u64(ino).u64(next_offset).u32(u32::try_from(name.len()).unwrap_or(0)).u32(kind);
    e.0.extend_from_slice(name.as_bytes());
    e.0.resize(e.0.len().next_multiple_of(8), 0);
    out.extend_from_slice(&e.0);
}

/// `fuse_notify_inval_inode_out`: drop the kernel's cached attributes of `ino`.
pub fn encode_inval_inode(ino: u64) -> Vec<u8> {
    let mut out = Out::default();
    // offset -1, length 0: attributes only, no page cache range.
    out.u64(ino).u64(u64::MAX).u64(0);
    out.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_split_at_its_header_and_bounded_by_its_length() {
        let mut req = Out::default();
        req.u32(44).u32(op::GETATTR).u64(7).u64(2).zeros(16).u32(0xdead_beef).u32(0x55);
        let (h, args) = parse(&req.0).expect("parsed");
        assert_eq!(h, InHeader { len: 44, opcode: op::GETATTR, unique: 7, nodeid: 2 });
        assert_eq!(args, &0xdead_beef_u32.to_le_bytes(), "the trailing byte past len is not an argument");
        assert_eq!(parse(&req.0[..43]), None, "shorter than it claims");
        assert_eq!(parse(&req.0[..10]), None, "shorter than a header");
    }

    #[test]
    fn the_structs_have_the_kernel_s_sizes() {
        let attr = Attr { ino: 2, size: 4096, mode: S_IFREG | 0o600, nlink: 1 };
        assert_eq!(attr.encode_attr_out(1).len(), 104);
        assert_eq!(attr.encode_entry_out(1).len(), 128);
        assert_eq!(encode_open_out(0).len(), 16);
        assert_eq!(encode_write_out(0).len(), 8);
        assert_eq!(encode_write_out(0x0102_0304), [4, 3, 2, 1, 0, 0, 0, 0]);
        assert_eq!(encode_statfs_out(1, 4096).len(), 80);
        assert_eq!(encode_inval_inode(2).len(), 24);
        let init = InitOut {
            minor: 31,
            max_readahead: 0,
            flags: 0,
            max_background: 0,
            congestion_threshold: 0,
            max_write: 0,
            max_pages: 0,
        };
        assert_eq!(init.encode().len(), 64);
        let mut dirents = Vec::new();
        put_dirent(&mut dirents, 1, 1, 4, ".");
        assert_eq!(dirents.len(), 32, "24 bytes of fields and the name, padded to 8");
    }

    #[test]
    fn arguments_too_short_are_refused() {
        assert_eq!(IoIn::parse(&[0; 19]), None);
        assert!(IoIn::parse(&[0; 20]).is_some());
        assert_eq!(FallocateIn::parse(&[0; 27]), None);
        assert_eq!(SetattrIn::parse(&[0; 23]), None);
    }
}
