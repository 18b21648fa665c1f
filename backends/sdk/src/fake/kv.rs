//! The fake `kv`: a sorted map with the host's size limits.
use super::Journal;
use crate::kv::{Kv, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use crate::types::Error;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Bound;

#[derive(Debug, Default)]
pub struct FakeKv {
    map: RefCell<BTreeMap<String, Vec<u8>>>,
    pub journal: Journal,
}

fn check(key: &str, value: Option<&[u8]>) -> Result<(), Error> {
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::InvalidArgument(format!("kv key of {} bytes is over {MAX_KEY_BYTES}", key.len())));
    }
    match value {
        Some(v) if v.len() > MAX_VALUE_BYTES => {
            Err(Error::InvalidArgument(format!("kv value of {} bytes is over {MAX_VALUE_BYTES}", v.len())))
        }
        _ => Ok(()),
    }
}

impl FakeKv {
    /// Every key and value, for assertions.
    pub fn entries(&self) -> BTreeMap<String, Vec<u8>> {
        self.map.borrow().clone()
    }
    pub fn fail_next(&self, op: &str, error: Error) {
        self.journal.fail_next(op, error)
    }
}

impl Kv for FakeKv {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        self.journal.enter("get")?;
        Ok(self.map.borrow().get(key).cloned())
    }
    fn set(&self, key: &str, value: &[u8]) -> Result<(), Error> {
        self.journal.enter("set")?;
        check(key, Some(value))?;
        self.map.borrow_mut().insert(key.to_owned(), value.to_vec());
        Ok(())
    }
    fn delete(&self, key: &str) -> Result<(), Error> {
        self.journal.enter("delete")?;
        self.map.borrow_mut().remove(key);
        Ok(())
    }
    fn compare_and_swap(&self, key: &str, expected: Option<&[u8]>, new: Option<&[u8]>) -> Result<bool, Error> {
        self.journal.enter("compare_and_swap")?;
        check(key, new)?;
        let mut map = self.map.borrow_mut();
        if map.get(key).map(Vec::as_slice) != expected {
            return Ok(false);
        }
        match new {
            Some(v) => map.insert(key.to_owned(), v.to_vec()),
            None => map.remove(key),
        };
        Ok(true)
    }
    fn list_keys(&self, prefix: &str, start_after: Option<&str>, limit: u32) -> Result<Vec<String>, Error> {
        self.journal.enter("list_keys")?;
        let map = self.map.borrow();
        let from = match start_after {
            Some(s) => Bound::Excluded(s.to_owned()),
            None => Bound::Included(prefix.to_owned()),
        };
        Ok(map
            .range((from, Bound::Unbounded))
            .map(|(k, _)| k)
            .skip_while(|k| !k.starts_with(prefix) && k.as_str() < prefix)
            .take_while(|k| k.starts_with(prefix))
            .take(limit as usize)
            .cloned()
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_page_in_order_and_swaps_compare() {
        let kv = FakeKv::default();
        for i in 0..2500 {
            kv.set(&format!("p/{i:05}"), b"").expect("set");
        }
        kv.set("q", b"other prefix").expect("set");
        kv.set("o", b"before the prefix").expect("set");
        let keys = kv.keys("p/").expect("keys");
        assert_eq!(keys.len(), 2500);
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(kv.list_keys("p/", Some("p/00001"), 2).expect("page"), ["p/00002", "p/00003"]);
        assert_eq!(kv.list_keys("p/", Some("a"), 1).expect("start before the prefix"), ["p/00000"]);
        assert!(kv.compare_and_swap("k", None, Some(b"1")).expect("absent = none"));
        assert!(!kv.compare_and_swap("k", None, Some(b"2")).expect("no longer absent"));
        assert!(kv.compare_and_swap("k", Some(b"1"), None).expect("delete"));
        assert_eq!(kv.get("k"), Ok(None));
        assert!(matches!(kv.set(&"k".repeat(513), b""), Err(Error::InvalidArgument(_))));
        assert!(matches!(kv.set("k", &vec![0; (64 << 10) + 1]), Err(Error::InvalidArgument(_))));
        kv.fail_next("get", Error::Internal("disk".into()));
        assert_eq!(kv.get("q"), Err(Error::Internal("disk".into())));
        assert_eq!(kv.get("q"), Ok(Some(b"other prefix".to_vec())), "a fault fires once");
    }
}
