//! `kv`: the small metadata store the host keeps for this backend alone (journals, name → id
//! maps; keys ≤ 512 bytes, values ≤ 64 KiB). [`Kv`] is the capability, [`KvImport`] the
//! component's import of it.
use crate::types::Error;
use crate::wit::wasmcsi::backend::kv as wit;

/// Longest key the host accepts.
pub const MAX_KEY_BYTES: usize = 512;
/// Largest value the host accepts.
pub const MAX_VALUE_BYTES: usize = 64 << 10;
/// Keys one [`Kv::keys`] page asks for.
const PAGE: u32 = 1000;

/// The `kv` capability (one method per WIT function, same errors), plus [`Kv::keys`].
pub trait Kv {
    /// A key's value, `None` when absent.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Error>;
    /// Write a key. Errors: invalid-argument (sizes), internal.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), Error>;
    /// Remove a key; absent succeeds.
    fn delete(&self, key: &str) -> Result<(), Error>;
    /// Replace `key` if it equals `expected` (`None` = absent); `new = None` deletes.
    /// Whether the swap happened.
    fn compare_and_swap(&self, key: &str, expected: Option<&[u8]>, new: Option<&[u8]>) -> Result<bool, Error>;
    /// Keys starting with `prefix`, in order, at most `limit`, strictly after `start_after`.
    fn list_keys(&self, prefix: &str, start_after: Option<&str>, limit: u32) -> Result<Vec<String>, Error>;

    /// Every key starting with `prefix`, in order (paging through [`Kv::list_keys`]).
    fn keys(&self, prefix: &str) -> Result<Vec<String>, Error> {
        let mut all: Vec<String> = Vec::new();
        loop {
            let page = self.list_keys(prefix, all.last().map(String::as_str), PAGE)?;
            let full = page.len() >= PAGE as usize;
            all.extend(page);
            if !full {
                return Ok(all);
            }
        }
    }
}

/// The component's `kv` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvImport;

impl Kv for KvImport {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        wit::get(key)
    }
    fn set(&self, key: &str, value: &[u8]) -> Result<(), Error> {
        wit::set(key, value)
    }
    fn delete(&self, key: &str) -> Result<(), Error> {
        wit::delete(key)
    }
    fn compare_and_swap(&self, key: &str, expected: Option<&[u8]>, new: Option<&[u8]>) -> Result<bool, Error> {
        wit::compare_and_swap(key, expected, new)
    }
    fn list_keys(&self, prefix: &str, start_after: Option<&str>, limit: u32) -> Result<Vec<String>, Error> {
        wit::list_keys(prefix, start_after, limit)
    }
}
