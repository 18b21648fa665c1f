//! The one wasmtime `Engine` every backend shares, and the epoch ticker that gives calls a
//! wall-clock deadline. Each knob below says why it has the value it has.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// How often the epoch advances. A call's deadline is checked on every tick, so a runaway
/// guest is stopped within one tick of its deadline; the issue allows 100 ms of slack and
/// a tick costs one atomic increment, so 2 ms is cheap and precise.
pub const EPOCH_TICK: Duration = Duration::from_millis(2);

/// Engine-wide sizing. Per-backend limits (memory caps, deadlines) are enforced per store;
/// these are ceilings for the pooling allocator, which reserves address space up front.
#[derive(Debug, Clone)]
pub struct WasmEngineSettings {
    /// Instances alive at once across all backends (each call holds one).
    pub max_instances: u32,
    /// The largest memory cap any backend may be given.
    pub max_memory_bytes: usize,
}

impl Default for WasmEngineSettings {
    fn default() -> Self {
        Self { max_instances: 256, max_memory_bytes: 1 << 30 }
    }
}

/// Errors building the engine.
#[derive(Debug, thiserror::Error)]
#[error("configuring wasmtime: {0}")]
pub struct EngineError(String);

/// Build the shared engine.
pub fn build_engine(settings: &WasmEngineSettings) -> Result<Engine, EngineError> {
    let mut pool = PoolingAllocationConfig::new();
    // A Rust wasip2 component is one core module with a memory plus a few shim modules;
    // 16 core instances / 2 memories per component leaves room for other toolchains.
    pool.total_component_instances(settings.max_instances)
        .total_core_instances(settings.max_instances * 16)
        .total_memories(settings.max_instances * 2)
        .total_tables(settings.max_instances * 8)
        .total_stacks(settings.max_instances)
        .max_memories_per_component(2)
        .max_tables_per_component(8)
        .max_core_instances_per_component(16)
        .max_memory_size(settings.max_memory_bytes)
        // A fresh instance per call means a slot is reset per call. Resetting by madvise costs
        // a TLB shootdown plus a page fault per page touched next time (perf showed those at
        // the top of a call's profile); with these the first MiBs are reset with memset and
        // only the pages the guest really dirtied are touched (pagemap scan, Linux >= 6.7).
        .linear_memory_keep_resident(4 << 20)
        .table_keep_resident(64 << 10)
        .async_stack_keep_resident(256 << 10)
        .pagemap_scan(wasmtime::Enabled::Auto)
        .decommit_batch_size(16);

    let mut config = Config::new();
    config
        .wasm_component_model(true)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
        // Deadlines: epochs are cheaper than fuel and measure wall-clock time.
        .epoch_interruption(true)
        // Fuel is an optional per-backend budget. It must be on engine-wide to be available
        // at all; backends without a budget get u64::MAX.
        .consume_fuel(true)
        // Guest stacks: 1 MiB of wasm stack is plenty for policy code; deep recursion traps
        // cleanly instead of eating the host's stack.
        .max_wasm_stack(1 << 20)
        .async_stack_size(2 << 20);
    Engine::new(&config).map_err(|e| EngineError(format!("{e:#}")))
}

/// Advances the engine's epoch every [`EPOCH_TICK`] on a plain thread (not a tokio task:
/// it must keep ticking when every runtime worker is busy running a guest). Stops on drop.
pub struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    pub fn start(engine: Engine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("wasmcsi-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
