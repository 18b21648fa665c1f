//! The backends directory as an operator sees it: `backend export` writes the components
//! bundled in this binary into one, under the names the host loads them by, and `backend ls`
//! says what the host would make of every file in one, with the same configuration `serve`
//! reads. Loading and hot reload are the runtime's registry; checking what a component does
//! is `check`.
use anyhow::Context;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use wasmcsi_runtime::wasm_engine::WasmEngineSettings;
use wasmcsi_runtime::{Runtime, RuntimeOptions};

/// The environment variable `serve` and `backend ls` both read the configuration path from.
pub const CONFIG_ENV: &str = "WASMCSI_CONFIG";
/// The environment variable `serve` and `backend ls` both read the backends directory from.
pub const BACKENDS_DIR_ENV: &str = "WASMCSI_BACKENDS_DIR";

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// Directory to write the bundled backends into, one `NAME.wasm` each (created when
    /// missing). Each file is written under a temporary name and renamed, so a host watching
    /// the directory never loads half a file.
    pub dir: PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct LsArgs {
    /// The backends directory, as `serve --backends-dir` (same environment variable).
    #[arg(long, env = BACKENDS_DIR_ENV, default_value = "/var/lib/wasmcsi/backends")]
    pub backends_dir: PathBuf,
    /// Host configuration, as `serve --config` (same environment variable): its grants
    /// decide whether a backend loads. Without one, nothing is granted beyond `log` and `kv`.
    #[arg(long, env = CONFIG_ENV)]
    pub config: Option<PathBuf>,
}

/// The first bytes of every WebAssembly binary (`\0asm`).
const WASM_MAGIC: [u8; 4] = *b"\0asm";
/// The version field of a core module (a component has `0d 00 01 00`).
const CORE_MODULE_VERSION: [u8; 4] = [1, 0, 0, 0];

/// Why a file cannot be a backend before any compiling is tried, in one line: not
/// WebAssembly at all (with its first bytes, which usually say what it is), or a core module
/// where the host takes only components. `None` when it looks like a component.
pub fn not_a_component(bytes: &[u8]) -> Option<String> {
    if bytes.get(..4) != Some(&WASM_MAGIC[..]) {
        let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        return Some(format!(
            "not a WebAssembly file: it starts with [{}], a component with [00 61 73 6d]",
            head.join(" ")
        ));
    }
    if bytes.get(4..8) == Some(&CORE_MODULE_VERSION[..]) {
        return Some(
            "a core WebAssembly module, not a component: build the backend for wasm32-wasip2 \
             (`cargo build --target wasm32-wasip2`), which makes a component"
                .to_string(),
        );
    }
    None
}

/// What `export` did with one component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exported {
    Written,
    Unchanged,
}

/// Write every bundled component into `dir` as `NAME.wasm`; a file already holding the same
/// bytes is left alone (its mtime too, so a watching host does not reload it).
pub fn export_to(dir: &Path) -> anyhow::Result<Vec<(String, Exported)>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut done = Vec::new();
    for (name, wasm) in wasmcsi_artifacts::bundled() {
        let path = dir.join(format!("{name}.wasm"));
        if std::fs::read(&path).is_ok_and(|old| old == wasm) {
            done.push((name.to_string(), Exported::Unchanged));
            continue;
        }
        // Not ending in `.wasm`: the registry never picks the temporary file up.
        let partial = dir.join(format!(".{name}.wasm.partial"));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&partial)?;
            f.write_all(wasm)?;
            f.sync_all()?;
            std::fs::rename(&partial, &path)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&partial);
            return Err(e).with_context(|| format!("writing {}", path.display()));
        }
        done.push((name.to_string(), Exported::Written));
    }
    Ok(done)
}

/// `backend export DIR`.
pub fn export(args: ExportArgs) -> anyhow::Result<()> {
    for (name, what) in export_to(&args.dir)? {
        let path = args.dir.join(format!("{name}.wasm"));
        let verb = if what == Exported::Written { "wrote" } else { "unchanged" };
        println!("{verb} {}", path.display());
    }
    Ok(())
}

/// `backend ls`: load every `.wasm` file of the directory as the host would, and say how it
/// went; returns how many were rejected (the command then exits 1).
pub async fn list(args: LsArgs) -> anyhow::Result<usize> {
    let config = crate::load_config_file(args.config.as_deref())?;
    match &args.config {
        Some(path) => println!("config: {}", path.display()),
        None => println!("config: none (${CONFIG_ENV} unset, no --config): only log and kv are granted"),
    }
    println!("backends dir: {}", args.backends_dir.display());
    let scratch = tempfile::tempdir()?;
    let runtime = Runtime::new(RuntimeOptions {
        config,
        cache_dir: None,
        store_path: scratch.path().join("ls.redb"),
        wasm_engine: WasmEngineSettings { max_instances: 8, ..Default::default() },
    })?;
    let mut entries: Vec<_> = std::fs::read_dir(&args.backends_dir)
        .with_context(|| format!("reading {}", args.backends_dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "wasm"))
        .collect();
    entries.sort();
    let mut rejected = 0;
    // CONTRACT after STATUS: scripts read STATUS as the fourth column.
    println!("{:<20} {:<14} {:<10} {:<8} {:<8} DETAIL", "NAME", "DIGEST", "VERSION", "STATUS", "CONTRACT");
    for path in entries {
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let wasm = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let digest = Runtime::digest(&wasm);
        if let Some(why) = not_a_component(&wasm) {
            rejected += 1;
            println!("{:<20} {:<14} {:<10} {:<8} {:<8} {why}", name, &digest[..12], "-", "rejected", "-");
            continue;
        }
        match runtime.load(&name, &wasm, Some(path.clone())).await {
            Ok(b) => {
                let caps: Vec<&str> = b.imports.capabilities.iter().map(|c| c.name()).collect();
                println!(
                    "{:<20} {:<14} {:<10} {:<8} {:<8} imports {} — {} features",
                    name,
                    &digest[..12],
                    b.info.version,
                    "ok",
                    b.contract.package_version(),
                    caps.join(","),
                    b.info.features.len()
                );
            }
            Err(e) => {
                rejected += 1;
                println!("{:<20} {:<14} {:<10} {:<8} {:<8} {e}", name, &digest[..12], "-", "rejected", "-");
            }
        }
    }
    Ok(rejected)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn a_file_that_is_not_a_component_is_named_for_what_it_is() {
        let text = not_a_component(b"#!/bin/sh\necho").unwrap();
        assert!(text.contains("[23 21 2f 62 69 6e 2f 73]"), "{text}");
        assert!(not_a_component(b"").unwrap().contains("starts with []"));
        let core = not_a_component(b"\0asm\x01\0\0\0\x01\x04").unwrap();
        assert!(core.contains("core WebAssembly module") && core.contains("wasm32-wasip2"), "{core}");
        for (name, wasm) in wasmcsi_artifacts::bundled() {
            assert_eq!(not_a_component(wasm), None, "{name}");
        }
    }

    #[test]
    fn export_writes_every_bundled_backend_under_its_name_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let first = export_to(dir.path()).unwrap();
        let names: Vec<&str> = first.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"nfs") && names.contains(&"hostpath"), "{names:?}");
        assert!(!names.contains(&"hostile"), "a test fixture was exported: {names:?}");
        assert!(first.iter().all(|(_, w)| *w == Exported::Written));
        for (name, wasm) in wasmcsi_artifacts::bundled() {
            assert_eq!(std::fs::read(dir.path().join(format!("{name}.wasm"))).unwrap(), wasm, "{name}");
        }
        // Nothing but the components: no temporary file left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), first.len());

        let again = export_to(dir.path()).unwrap();
        assert!(again.iter().all(|(_, w)| *w == Exported::Unchanged), "{again:?}");
        // A stale file (an older build) is replaced.
        std::fs::write(dir.path().join("nfs.wasm"), b"old").unwrap();
        let third = export_to(dir.path()).unwrap();
        assert!(third.contains(&("nfs".to_string(), Exported::Written)), "{third:?}");
    }
}
