//! One operation per volume (or name) at a time. A second concurrent call for the same key
//! gets ABORTED, as the CSI spec asks, instead of racing the first.
use crate::error::CsiError;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

#[derive(Default, Clone)]
pub struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
}

/// Held for the duration of one operation; releases the key on drop (also on panic).
pub struct OperationGuard {
    keys: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl InFlight {
    pub fn try_start(&self, key: String) -> Result<OperationGuard, CsiError> {
        let mut keys = self.keys.lock().map_err(|_| CsiError::Internal("in-flight table poisoned".into()))?;
        if !keys.insert(key.clone()) {
            return Err(CsiError::InProgress(key));
        }
        Ok(OperationGuard { keys: self.keys.clone(), key })
    }
}

impl Drop for OperationGuard {
    fn drop(&mut self) {
        if let Ok(mut keys) = self.keys.lock() {
            keys.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_operation_on_a_key_is_refused_until_the_first_ends() {
        let f = InFlight::default();
        let g = f.try_start("v".into()).expect("first");
        assert!(matches!(f.try_start("v".into()), Err(CsiError::InProgress(_))));
        assert!(f.try_start("w".into()).is_ok());
        drop(g);
        assert!(f.try_start("v".into()).is_ok());
    }
}
