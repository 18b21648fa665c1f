//! [`Meta`]: a small `key=value`-per-line file, the format backends keep metadata in beside
//! their data (hostpath's `meta/NAME`, nfs's `.wasmcsi-volume`). Keys are sorted when written,
//! values never contain a newline; reading is strict (a line without `=` is an error), so a
//! torn or foreign file is noticed, not misread.
use crate::types::Error;
use std::collections::BTreeMap;

/// A metadata file's fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta(pub BTreeMap<String, String>);

impl Meta {
    /// Set a field (newlines in the value become spaces).
    pub fn set(&mut self, key: &str, value: impl ToString) -> &mut Self {
        self.0.insert(key.into(), value.to_string().replace('\n', " "));
        self
    }

    /// A field, empty when absent.
    pub fn get(&self, key: &str) -> &str {
        self.0.get(key).map(String::as_str).unwrap_or_default()
    }

    /// A numeric field. Errors: internal (absent or not a number).
    pub fn u64(&self, key: &str) -> Result<u64, Error> {
        self.get(key)
            .parse()
            .map_err(|_| Error::Internal(format!("metadata field {key}: {:?} is not a number", self.get(key))))
    }

    pub fn encode(&self) -> Vec<u8> {
        self.0.iter().map(|(k, v)| format!("{k}={v}\n")).collect::<String>().into_bytes()
    }

    /// Errors: internal (not UTF-8, a line without `=`).
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let text = std::str::from_utf8(bytes).map_err(|_| Error::Internal("metadata is not utf-8".into()))?;
        let mut m = Meta::default();
        for line in text.lines().filter(|l| !l.is_empty()) {
            let (k, v) =
                line.split_once('=').ok_or_else(|| Error::Internal(format!("metadata line {line:?} has no '='")))?;
            m.0.insert(k.into(), v.into());
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_rejects_garbage() {
        let mut m = Meta::default();
        m.set("source", "").set("capacity", 5u64).set("subdir", "a/b").set("note", "two\nlines");
        let bytes = m.encode();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            "capacity=5\nnote=two lines\nsource=\nsubdir=a/b\n",
            "sorted, one line each"
        );
        let back = Meta::decode(&bytes).expect("own output decodes");
        assert_eq!(back, m);
        assert_eq!(back.u64("capacity"), Ok(5));
        assert!(matches!(back.u64("subdir"), Err(Error::Internal(_))));
        assert!(matches!(back.u64("absent"), Err(Error::Internal(_))));
        assert!(Meta::decode(b"nonsense").is_err());
        assert!(Meta::decode(&[0xff, b'=', b'1']).is_err());
    }
}
