//! `kv`: the backend's private namespace in the host's metadata store, within its quota
//! (`resource-exhausted` beyond it); every write shows the new usage in the metrics.
//!
//! Its host functions see a [`KvCtxView`]: the backend's [`KvCtx`], nothing of the call.
use crate::bindings::types::Error;
use crate::bindings::wasmcsi::backend::kv::{self as wit, Host};
use crate::local_io::local_io;
use crate::metadata::{KvQuota, MetaStore, MetadataError};
use crate::metrics::Metrics;
use std::sync::Arc;
use wasmtime::component::{HasData, LinkerInstance};

/// What `kv` needs of one backend, resolved at load and shared by its calls.
pub struct KvCtx {
    /// the backend, whose name is its namespace
    pub backend: String,
    pub metadata: Arc<MetaStore>,
    /// how much of the store the namespace may use
    pub quota: KvQuota,
    /// where each write shows the namespace's usage
    pub metrics: Arc<Metrics>,
}

/// What `kv` sees of a call.
pub struct KvCtxView<'a> {
    pub ctx: &'a KvCtx,
}

/// A store whose calls can reach `kv`: it lends `kv` its view.
pub trait KvView: Send {
    fn kv(&mut self) -> KvCtxView<'_>;
}

/// `kv` for the linker: its host functions get a [`KvCtxView`].
pub struct Kv;

impl HasData for Kv {
    type Data<'a> = KvCtxView<'a>;
}

/// Link `kv`'s host functions into `instance` (named as the component's contract version
/// names the interface).
pub fn add_to_instance<T: KvView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Kv>(instance, T::kv)
}

fn to_wit(e: MetadataError) -> Error {
    match e {
        MetadataError::KeyTooLarge(_) | MetadataError::ValueTooLarge(_) => Error::InvalidArgument(e.to_string()),
        MetadataError::QuotaExceeded { .. } => Error::ResourceExhausted(e.to_string()),
        MetadataError::Db(_) => Error::Internal(e.to_string()),
    }
}

impl KvCtx {
    /// Show the backend's usage after a write (a failed read only leaves the gauge behind).
    fn written<T>(&self, result: Result<T, MetadataError>) -> Result<T, Error> {
        if let Ok(usage) = self.metadata.kv_usage(&self.backend) {
            self.metrics.kv_usage(&self.backend, usage);
        }
        result.map_err(to_wit)
    }
}

impl Host for KvCtxView<'_> {
    #[tracing::instrument(name = "import.kv.get", skip_all, fields(backend = %self.ctx.backend))]
    async fn get(&mut self, key: String) -> Result<Option<Vec<u8>>, Error> {
        let c = self.ctx;
        local_io(|| c.metadata.kv_get(&c.backend, &key).map_err(to_wit))
    }

    #[tracing::instrument(name = "import.kv.set", skip_all, fields(backend = %self.ctx.backend))]
    async fn set(&mut self, key: String, value: Vec<u8>) -> Result<(), Error> {
        let c = self.ctx;
        c.written(local_io(|| c.metadata.kv_set(&c.backend, &key, &value, c.quota)))
    }

    #[tracing::instrument(name = "import.kv.delete", skip_all, fields(backend = %self.ctx.backend))]
    async fn delete(&mut self, key: String) -> Result<(), Error> {
        let c = self.ctx;
        c.written(local_io(|| c.metadata.kv_delete(&c.backend, &key)))
    }

    #[tracing::instrument(name = "import.kv.compare_and_swap", skip_all, fields(backend = %self.ctx.backend))]
    async fn compare_and_swap(
        &mut self,
        key: String,
        expected: Option<Vec<u8>>,
        new: Option<Vec<u8>>,
    ) -> Result<bool, Error> {
        let c = self.ctx;
        let swapped =
            local_io(|| c.metadata.kv_compare_and_swap(&c.backend, &key, expected.as_deref(), new.as_deref(), c.quota));
        c.written(swapped)
    }

    #[tracing::instrument(name = "import.kv.list_keys", skip_all, fields(backend = %self.ctx.backend))]
    async fn list_keys(
        &mut self,
        prefix: String,
        start_after: Option<String>,
        limit: u32,
    ) -> Result<Vec<String>, Error> {
        let c = self.ctx;
        local_io(|| c.metadata.kv_list(&c.backend, &prefix, start_after.as_deref(), limit.min(10_000)).map_err(to_wit))
    }
}
