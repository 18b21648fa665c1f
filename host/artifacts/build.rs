//! Builds every guest in the workspace into a `wasm32-wasip2` component, so a plain
//! `cargo build` / `cargo test` has them; no extra tool or manual step.
//!
//! The guests are rlibs (native unit tests link them); the component comes from
//! `cargo rustc --crate-type cdylib` in a target dir of our own under OUT_DIR, because the
//! outer cargo holds the lock on the workspace target dir.
use std::{env, fmt::Write as _, fs, path::PathBuf, process::Command};

/// (package, constant name, file stem the host loads it as)
const GUESTS: &[(&str, &str, &str)] = &[
    ("wasmcsi-backend-hostpath", "HOSTPATH", "hostpath"),
    ("wasmcsi-backend-nfs", "NFS", "nfs"),
    ("wasmcsi-backend-ceph-rbd-shim", "CEPH_RBD_SHIM", "ceph-rbd-shim"),
    ("wasmcsi-backend-replicated-block", "REPLICATED_BLOCK", "replicated-block"),
    ("wasmcsi-fixture-hostile", "HOSTILE", "hostile"),
    ("wasmcsi-fixture-hostpath-v0-1", "HOSTPATH_V0_1", "hostpath-v0-1"),
    ("wasmcsi-fixture-block-v0-1", "BLOCK_V0_1", "block-v0-1"),
    ("wasmcsi-fixture-rbd-v0-2", "RBD_V0_2", "rbd-v0-2"),
];

/// The test kit's parts that `wasmcsi backend compose` puts around a backend: (package,
/// constant name, whether it is a command, i.e. a `[[bin]]` whose `main` is `wasi:cli/run`).
/// Not backends: they are not in `ALL`.
const TESTKIT: &[(&str, &str, bool)] = &[
    ("wasmcsi-testkit-capabilities", "TESTKIT_CAPABILITIES", false),
    ("wasmcsi-testkit-checks", "TESTKIT_CHECKS", true),
];

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest.join("../..").canonicalize().expect("workspace root exists");
    let cargo = env::var_os("CARGO").expect("cargo sets CARGO");
    let target_dir = out.join("guests");
    println!("cargo:rerun-if-changed={}", workspace.join("wit").display());

    let mut consts = String::new();
    let mut table = String::from("pub const ALL: &[(&str, &[u8])] = &[\n");
    for (package, constant, stem) in GUESTS {
        let wasm = build_guest(&cargo, &workspace, &target_dir, package, false);
        writeln!(
            consts,
            "/// The `{stem}` component.\npub const {constant}: &[u8] = include_bytes!({:?});",
            wasm.display()
        )
        .expect("write to string");
        writeln!(table, "    ({stem:?}, {constant}),").expect("write to string");
    }
    for (package, constant, command) in TESTKIT {
        let wasm = build_guest(&cargo, &workspace, &target_dir, package, *command);
        writeln!(
            consts,
            "/// The test kit's `{package}` component.\npub const {constant}: &[u8] = include_bytes!({:?});",
            wasm.display()
        )
        .expect("write to string");
    }
    table.push_str("];\n");
    fs::write(out.join("artifacts.rs"), consts + &table).expect("write artifacts.rs");
}

/// Build one guest for wasm32-wasip2 (a library as a `cdylib`, a command as its `[[bin]]` of the
/// package's name) and return the component's path.
fn build_guest(
    cargo: &std::ffi::OsStr,
    workspace: &std::path::Path,
    target_dir: &std::path::Path,
    package: &str,
    command: bool,
) -> PathBuf {
    let kind: &[&str] = if command { &["--bin", package] } else { &["--crate-type", "cdylib"] };
    let status = Command::new(cargo)
        .current_dir(workspace)
        .args(["rustc", "--quiet", "--profile", "guest", "--target", "wasm32-wasip2"])
        .args(kind)
        .args(["-p", package])
        .env("CARGO_TARGET_DIR", target_dir)
        // Flags meant for the host build (coverage, sanitizers, clippy) must not reach guests.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_PRIMARY_PACKAGE")
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building guest {package} for wasm32-wasip2 failed");

    // A library's component is named after the crate (`_` for `-`), a command's after its bin.
    let artifact = if command { package.to_owned() } else { package.replace('-', "_") };
    let dir = target_dir.join("wasm32-wasip2/guest");
    let wasm = dir.join(format!("{artifact}.wasm"));
    // Rebuild when any source file of the guest changes (cargo's own dep-info).
    if let Ok(depinfo) = fs::read_to_string(dir.join(format!("{artifact}.d"))) {
        for dep in depinfo.split_once(':').map(|(_, d)| d).unwrap_or("").split_whitespace() {
            if dep.starts_with(workspace.to_str().unwrap_or("/")) {
                println!("cargo:rerun-if-changed={dep}");
            }
        }
    }
    wasm
}
