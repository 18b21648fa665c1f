//! The on-disk cache of compiled components, so a restart does not recompile. Keyed by the
//! sha256 of the `.wasm` and the engine's compatibility hash (wasmtime version, target,
//! settings): a different engine never picks up an artifact it cannot run.
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use wasmtime::Engine;
use wasmtime::component::Component;

/// A directory of `.cwasm` files this process writes and trusts.
#[derive(Clone)]
pub struct CompileCache {
    dir: Option<PathBuf>,
    engine_key: String,
}

impl CompileCache {
    /// `None` disables caching (every load compiles).
    pub fn new(engine: &Engine, dir: Option<PathBuf>) -> Self {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        Self { dir, engine_key: format!("{:016x}", h.finish()) }
    }

    fn path_for(&self, dir: &Path, digest: &str) -> PathBuf {
        dir.join(format!("{digest}-{}.cwasm", self.engine_key))
    }

    /// The compiled component for `wasm` (whose sha256 is `digest`): from the cache when
    /// present and valid, otherwise compiled and stored. Returns whether it was a cache hit.
    pub fn load(&self, engine: &Engine, digest: &str, wasm: &[u8]) -> wasmtime::Result<(Component, bool)> {
        let Some(dir) = &self.dir else { return Ok((Component::new(engine, wasm)?, false)) };
        let path = self.path_for(dir, digest);
        if path.exists() {
            // SAFETY-relevant: deserialising runs native code produced by wasmtime. The file
            // was written by this process into a directory only the host controls, and its
            // name binds it to this exact wasm and engine; wasmtime still checks its header.
            match deserialize(engine, &path) {
                Ok(c) => return Ok((c, true)),
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "compiled artifact unusable; recompiling"),
            }
        }
        let component = Component::new(engine, wasm)?;
        if let Err(e) = store(dir, &path, &component) {
            tracing::warn!(path = %path.display(), error = %e, "could not write compile cache");
        }
        Ok((component, false))
    }
}

#[allow(unsafe_code, reason = "loading a precompiled artifact this process wrote itself")]
fn deserialize(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    // SAFETY: see `CompileCache::load`: the file is our own output, bound to this engine.
    unsafe { Component::deserialize_file(engine, path) }
}

fn store(dir: &Path, path: &Path, component: &Component) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let bytes = component.serialize().map_err(|e| std::io::Error::other(e.to_string()))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
