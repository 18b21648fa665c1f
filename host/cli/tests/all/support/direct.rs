//! `O_DIRECT` I/O for tests that check what reached a device, bypassing the page cache.

/// The alignment `O_DIRECT` asks of buffers, offsets and lengths on our devices.
pub const ALIGN: usize = 4096;

/// A zeroed buffer of `len` bytes aligned to [`ALIGN`], without `unsafe`: a larger vector and
/// the aligned window inside it.
pub struct Aligned {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    pub fn new(len: usize) -> Self {
        let mem = vec![0; len + ALIGN];
        let start = (ALIGN - (mem.as_ptr() as usize) % ALIGN) % ALIGN;
        Self { mem, start, len }
    }

    pub fn get(&mut self) -> &mut [u8] {
        &mut self.mem[self.start..self.start + self.len]
    }
}
