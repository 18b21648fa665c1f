//! `wasmcsi backend compose`: a backend wrapped into one component that the plain `wasmtime run`
//! checks, with no wasmcsi host. Three components, wired by their WIT names with `wasm-compose`
//! (`wasmcsi:testkit` in `wit/testkit/` declares the worlds):
//!
//! ```text
//!   testkit capabilities ──wasmcsi:backend/{types,log,kv,dir,nfs,rbd,block}──▶ backend
//!        │ types                                                               │ driver
//!        └────────────────────────────▶ testkit checks ◀───────────────────────┘
//!                                            │ wasi:cli/run (the composed component's export)
//! ```
//!
//! Every `wasmcsi:backend` import of the backend is satisfied inside; WASI imports (of all three)
//! stay imports, for `wasmtime run` to give (`--dir ROOT::/` is the `dir` root). It checks the
//! backend's shape (a component, the current contract's `driver` export, no unknown `wasmcsi`
//! import) before composing; what the checks do is `wasmcsi-testkit-checks`'s.
use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use wasm_compose::graph::{CompositionGraph, EncodeOptions, ImportIndex, InstanceId};
use wasmcsi_runtime::ContractVersion;

/// The interfaces of the contract the test kit speaks.
const CONTRACT_PACKAGE: &str = "wasmcsi:backend/";
const DRIVER: &str = "driver";
const TYPES: &str = "types";

#[derive(clap::Args, Debug)]
pub struct ComposeArgs {
    /// The backend component (`NAME.wasm`, built for the current contract).
    pub file: PathBuf,
    /// Where to write the test component [default: NAME-test.wasm beside FILE].
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

/// `wasmcsi:backend/NAME@VERSION` of the current contract.
fn contract_name(interface: &str) -> String {
    format!("{CONTRACT_PACKAGE}{interface}@{}", ContractVersion::CURRENT.package_version())
}

/// The test component's path for `file` when none is given: `NAME-test.wasm` beside it.
pub fn default_output(file: &Path) -> PathBuf {
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("backend");
    file.with_file_name(format!("{stem}-test.wasm"))
}

/// Compose `backend` (a component's bytes) with the test kit; the test component's bytes.
pub fn compose(backend: &[u8]) -> anyhow::Result<Vec<u8>> {
    if let Some(why) = crate::backend_dir::not_a_component(backend) {
        bail!("{why}");
    }
    let mut validator = wasmparser::Validator::new();
    let mut graph = CompositionGraph::new();
    let part = |validator: &mut wasmparser::Validator, name: &str, bytes: &[u8]| {
        wasm_compose::graph::Component::from_bytes(validator, name, bytes.to_vec())
            .with_context(|| format!("reading the {name} component"))
    };
    let capabilities =
        graph.add_component(part(&mut validator, "capabilities", wasmcsi_artifacts::TESTKIT_CAPABILITIES)?)?;
    let backend = graph.add_component(part(&mut validator, "backend", backend)?)?;
    let checks = graph.add_component(part(&mut validator, "checks", wasmcsi_artifacts::TESTKIT_CHECKS)?)?;

    let driver = contract_name(DRIVER);
    let (driver_export, _, _) =
        graph.get_component(backend).and_then(|c| c.export_by_name(&driver)).with_context(|| {
            format!("the backend does not export {driver} (the current contract); compose tests only that")
        })?;

    let capabilities = graph.instantiate(capabilities)?;
    let backend = graph.instantiate(backend)?;
    let checks = graph.instantiate(checks)?;
    connect_contract_imports(&mut graph, capabilities, backend, "the backend")?;
    connect_contract_imports(&mut graph, capabilities, checks, "the checks")?;
    let (driver_import, _) = graph
        .get_component_of_instance(checks)
        .and_then(|(_, c)| c.import_by_name(&driver))
        .with_context(|| format!("the test kit's checks do not import {driver}"))?;
    graph.connect(backend, Some(driver_export), checks, driver_import)?;

    graph
        .encode(EncodeOptions { define_components: true, export: Some(checks), validate: true })
        .context("encoding the composed test component")
}

/// Give every `wasmcsi:backend` import of `target` (but `driver`, the backend's) from the test
/// kit's capabilities; an import of another contract version or an unknown interface is an
/// error naming it. Other imports (WASI) are left to the composed component's imports.
fn connect_contract_imports(
    graph: &mut CompositionGraph,
    capabilities: InstanceId,
    target: InstanceId,
    what: &str,
) -> anyhow::Result<()> {
    let driver = contract_name(DRIVER);
    let wanted: Vec<(ImportIndex, String)> = {
        let (_, component) = graph.get_component_of_instance(target).context("instance without component")?;
        component
            .imports()
            .filter(|(_, name, _)| name.starts_with(CONTRACT_PACKAGE) && *name != driver)
            .map(|(index, name, _)| (index, name.to_owned()))
            .collect()
    };
    for (import, name) in wanted {
        let (_, provider) = graph.get_component_of_instance(capabilities).context("instance without component")?;
        let Some((export, _, _)) = provider.export_by_name(&name) else {
            let types = contract_name(TYPES);
            let version = ContractVersion::CURRENT.package_version();
            bail!(
                "{what} imports {name}, which the test kit does not provide (it provides {types} and the capabilities of contract {version})"
            );
        };
        graph
            .connect(capabilities, Some(export), target, import)
            .with_context(|| format!("giving {name} to {what}"))?;
    }
    Ok(())
}

/// The command.
pub fn run(args: ComposeArgs) -> anyhow::Result<()> {
    let backend = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let composed = compose(&backend).with_context(|| format!("composing {}", args.file.display()))?;
    let output = args.output.unwrap_or_else(|| default_output(&args.file));
    std::fs::write(&output, &composed).with_context(|| format!("writing {}", output.display()))?;
    println!("wrote {} ({} bytes)", output.display(), composed.len());
    println!(
        "run the checks: wasmtime run --dir ROOT::/ {} [--param KEY=VALUE]... [--secret KEY]...",
        output.display()
    );
    println!("(ROOT: an empty directory, the `dir` capability's root `default`)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_output_defaults_to_name_test_beside_the_file() {
        assert_eq!(default_output(Path::new("/x/hostpath.wasm")), PathBuf::from("/x/hostpath-test.wasm"));
    }

    #[test]
    fn a_bundled_backend_composes_into_a_command() {
        let composed = compose(wasmcsi_artifacts::HOSTPATH).expect("composes");
        // The outer component's exports only: nested components and modules open with a
        // `Version` payload and close with an `End` one.
        let (mut exports, mut depth) = (Vec::new(), 0);
        for payload in wasmparser::Parser::new(0).parse_all(&composed) {
            match payload.expect("parses") {
                wasmparser::Payload::Version { .. } => depth += 1,
                wasmparser::Payload::End(_) => depth -= 1,
                wasmparser::Payload::ComponentExportSection(section) if depth == 1 => {
                    exports.extend(section.into_iter().map(|e| e.expect("export").name.name.to_owned()));
                }
                _ => {}
            }
        }
        assert!(exports.iter().any(|e| e.starts_with("wasi:cli/run@")), "exports: {exports:?}");
        assert!(!exports.iter().any(|e| e.starts_with(CONTRACT_PACKAGE)), "exports: {exports:?}");
    }

    #[test]
    fn what_is_not_a_backend_of_the_current_contract_is_refused() {
        let e = compose(b"not wasm").expect_err("not a component");
        assert!(!e.to_string().is_empty());
        let e = compose(wasmcsi_artifacts::HOSTPATH_V0_1).expect_err("previous contract");
        assert!(format!("{e:#}").contains("driver@0.3.0"), "{e:#}");
    }
}
