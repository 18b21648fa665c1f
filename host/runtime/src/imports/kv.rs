//! `kv`: the backend's private namespace in the host's metadata store, within its quota
//! (`resource-exhausted` beyond it); every write shows the new usage in the metrics.
use crate::bindings::types::Error;
use crate::bindings::wasmcsi::backend::kv::Host;
use crate::capabilities::local_io;
use crate::metadata::StoreError;
use crate::state::CallState;

fn to_wit(e: StoreError) -> Error {
    match e {
        StoreError::KeyTooLarge(_) | StoreError::ValueTooLarge(_) => Error::InvalidArgument(e.to_string()),
        StoreError::QuotaExceeded { .. } => Error::ResourceExhausted(e.to_string()),
        StoreError::Db(_) => Error::Internal(e.to_string()),
    }
}

impl CallState {
    /// Show the backend's usage after a write (a failed read only leaves the gauge behind).
    fn kv_written<T>(&self, result: Result<T, StoreError>) -> Result<T, Error> {
        let c = &self.caps;
        if let Ok(usage) = c.metadata.kv_usage(&c.backend) {
            c.metrics.kv_usage(&c.backend, usage);
        }
        result.map_err(to_wit)
    }
}

impl Host for CallState {
    #[tracing::instrument(name = "import.kv.get", skip_all, fields(backend = %self.caps.backend))]
    async fn get(&mut self, key: String) -> Result<Option<Vec<u8>>, Error> {
        let c = &self.caps;
        local_io(|| c.metadata.kv_get(&c.backend, &key).map_err(to_wit))
    }

    #[tracing::instrument(name = "import.kv.set", skip_all, fields(backend = %self.caps.backend))]
    async fn set(&mut self, key: String, value: Vec<u8>) -> Result<(), Error> {
        let c = &self.caps;
        self.kv_written(local_io(|| c.metadata.kv_set(&c.backend, &key, &value, c.kv_quota)))
    }

    #[tracing::instrument(name = "import.kv.delete", skip_all, fields(backend = %self.caps.backend))]
    async fn delete(&mut self, key: String) -> Result<(), Error> {
        let c = &self.caps;
        self.kv_written(local_io(|| c.metadata.kv_delete(&c.backend, &key)))
    }

    #[tracing::instrument(name = "import.kv.compare_and_swap", skip_all, fields(backend = %self.caps.backend))]
    async fn compare_and_swap(
        &mut self,
        key: String,
        expected: Option<Vec<u8>>,
        new: Option<Vec<u8>>,
    ) -> Result<bool, Error> {
        let c = &self.caps;
        let swapped = local_io(|| {
            c.metadata.kv_compare_and_swap(&c.backend, &key, expected.as_deref(), new.as_deref(), c.kv_quota)
        });
        self.kv_written(swapped)
    }

    #[tracing::instrument(name = "import.kv.list_keys", skip_all, fields(backend = %self.caps.backend))]
    async fn list_keys(
        &mut self,
        prefix: String,
        start_after: Option<String>,
        limit: u32,
    ) -> Result<Vec<String>, Error> {
        let c = &self.caps;
        local_io(|| c.metadata.kv_list(&c.backend, &prefix, start_after.as_deref(), limit.min(10_000)).map_err(to_wit))
    }
}
