//! `wasmcsi backend new`: writes a backend crate on the guest SDK, ready to build into a
//! component that passes `backend check` as it is, with unit tests against the SDK's in-memory
//! host. The sources are the workspace's templates (`backends/templates/CAPABILITY`, one per
//! capability), members of the workspace, so they are compiled, linted and unit-tested with
//! it; this module only fills in names and paths.
//!
//! It does not build the crate (cargo does, with the one command its README gives) and never
//! writes into a directory that holds anything.
use anyhow::Context;
use std::path::{Path, PathBuf};

/// The capability a new backend's volumes live on: one template each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Capability {
    /// A directory under a root the operator grants; the node bind-mounts it (hostpath-like).
    Dir,
    /// A subdirectory of a granted NFS export; the node mounts it over NFS.
    Nfs,
    /// An RBD image on a granted Ceph pool; the node maps it.
    Rbd,
    /// A replica set of the host's replicated block engine; the node starts its engine.
    Block,
}

/// One template: the crate's `src/lib.rs` and `src/tests.rs`.
struct Template {
    lib: &'static str,
    tests: &'static str,
    /// What `backend check` needs beyond the file, for the README.
    check_args: &'static str,
}

impl Capability {
    pub const ALL: [Capability; 4] = [Capability::Dir, Capability::Nfs, Capability::Rbd, Capability::Block];

    pub fn name(self) -> &'static str {
        match self {
            Capability::Dir => "dir",
            Capability::Nfs => "nfs",
            Capability::Rbd => "rbd",
            Capability::Block => "block",
        }
    }

    fn template(self) -> Template {
        macro_rules! template {
            ($dir:literal, $check_args:expr) => {
                Template {
                    lib: include_str!(concat!("../../../backends/templates/", $dir, "/src/lib.rs")),
                    tests: include_str!(concat!("../../../backends/templates/", $dir, "/src/tests.rs")),
                    check_args: $check_args,
                }
            };
        }
        match self {
            // A scratch root and scratch replica nodes come with `backend check` itself.
            Capability::Dir => template!("dir", ""),
            Capability::Block => template!("block", ""),
            Capability::Nfs => {
                template!("nfs", "--no-node --config host.toml --param server=SERVER --param share=/SHARE")
            }
            Capability::Rbd => template!(
                "rbd",
                "--no-node --config host.toml --param clusterID=CLUSTER --param pool=POOL \\\n        --secret userID=USER --secret userKey=KEY"
            ),
        }
    }
}

const CARGO_TOML: &str = include_str!("../../../backends/templates/Cargo.toml.in");
const README: &str = include_str!("../../../backends/templates/README.md.in");
const GITIGNORE: &str = include_str!("../../../backends/templates/gitignore.in");
const RUSTFMT: &str = include_str!("../../../backends/templates/rustfmt.toml");
/// The type name in the templates, replaced by the new backend's.
const TEMPLATE_TYPE: &str = "MyBackend";
/// The SDK of the checkout this binary was built from, the default `--sdk`.
const BUILT_FROM_SDK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../backends/sdk");

#[derive(clap::Args, Debug)]
pub struct NewArgs {
    /// The backend's name: 1-32 of [a-z0-9-], starting with a letter. It names the crate and
    /// the backend (the host loads it as NAME.wasm; StorageClasses say `backend: NAME`).
    pub name: String,
    /// The capability its volumes live on; each is a working template to edit.
    #[arg(long, value_enum, default_value_t = Capability::Dir)]
    pub capability: Capability,
    /// Where to write the crate (default: ./NAME). It must not exist, or be empty.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The guest SDK crate (`backends/sdk` of a wasmcsi checkout), the new crate's path
    /// dependency. Default: the checkout this binary was built from, while it exists.
    #[arg(long, env = "WASMCSI_SDK")]
    pub sdk: Option<PathBuf>,
}

/// What `new` wrote.
#[derive(Debug)]
pub struct Written {
    pub dir: PathBuf,
    /// The component `cargo build --release --target wasm32-wasip2` makes, relative to `dir`.
    pub component: PathBuf,
}

/// Cargo's rules for a package name on top of the host's for a backend name.
pub fn check_name(name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        wasmcsi_runtime::config::is_valid_name(name) && name.starts_with(|c: char| c.is_ascii_lowercase()),
        "backend name {name:?} must be 1-32 of [a-z0-9-] starting with a letter"
    );
    // Names cargo refuses for a package, or that shadow a crate every Rust program can see.
    const RESERVED: &[&str] = &["test", "std", "core", "alloc", "proc-macro", "self", "super", "crate", "build"];
    anyhow::ensure!(!RESERVED.contains(&name), "backend name {name:?} is reserved by cargo or Rust; choose another");
    Ok(())
}

/// The backend's type: the name in CamelCase, ending in `Backend` (`my-cache` → `MyCacheBackend`),
/// never a name the SDK's prelude brings in.
pub fn type_name(name: &str) -> String {
    let camel: String = name
        .split('-')
        .filter(|part| !part.is_empty())
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map(|c| c.to_ascii_uppercase().to_string() + chars.as_str()).unwrap_or_default()
        })
        .collect();
    match camel.strip_suffix("Backend") {
        Some("") => "TheBackend".to_string(),
        Some(_) => camel,
        None => camel + "Backend",
    }
}

fn fill(text: &str, pairs: &[(&str, &str)]) -> String {
    pairs.iter().fold(text.to_string(), |text, (key, value)| text.replace(&format!("{{{key}}}"), value))
}

/// Write the crate; see the module docs.
pub fn new(args: &NewArgs) -> anyhow::Result<Written> {
    check_name(&args.name)?;
    let dir = args.dir.clone().unwrap_or_else(|| PathBuf::from(&args.name));
    if dir.exists() {
        let mut entries =
            std::fs::read_dir(&dir).with_context(|| format!("{} exists and is no directory", dir.display()))?;
        anyhow::ensure!(entries.next().is_none(), "{} exists and is not empty: nothing written", dir.display());
    }
    let sdk = sdk_path(args.sdk.as_deref())?;
    let sdk_str = sdk.to_str().with_context(|| format!("the SDK path {} is not UTF-8", sdk.display()))?;
    anyhow::ensure!(!sdk_str.contains(['"', '\\', '\n']), "the SDK path {sdk_str:?} cannot be written into Cargo.toml");

    let template = args.capability.template();
    let artifact = args.name.replace('-', "_");
    let ty = type_name(&args.name);
    let pairs = [
        ("name", args.name.as_str()),
        ("capability", args.capability.name()),
        ("sdk", sdk_str),
        ("artifact", artifact.as_str()),
        ("check_args", template.check_args),
    ];
    let doc_title = format!("//! {TEMPLATE_TYPE}:");
    let lib = template.lib.replacen(&doc_title, &format!("//! `{}`:", args.name), 1).replace(TEMPLATE_TYPE, &ty);
    let files: [(&str, String); 6] = [
        ("Cargo.toml", fill(CARGO_TOML, &pairs)),
        ("README.md", fill(README, &pairs)),
        (".gitignore", GITIGNORE.to_string()),
        ("rustfmt.toml", RUSTFMT.to_string()),
        ("src/lib.rs", lib),
        ("src/tests.rs", template.tests.replace(TEMPLATE_TYPE, &ty)),
    ];
    std::fs::create_dir_all(dir.join("src")).with_context(|| format!("creating {}", dir.display()))?;
    for (path, text) in files {
        std::fs::write(dir.join(path), text).with_context(|| format!("writing {}", dir.join(path).display()))?;
    }
    // The SDK's own lock file: the new crate starts on the versions the SDK is tested with.
    if let Some(lock) = sdk.parent().and_then(Path::parent).map(|root| root.join("Cargo.lock")).filter(|l| l.is_file())
    {
        std::fs::copy(&lock, dir.join("Cargo.lock")).with_context(|| format!("copying {}", lock.display()))?;
    }
    Ok(Written { dir, component: Path::new("target/wasm32-wasip2/release").join(format!("{artifact}.wasm")) })
}

/// The SDK crate's directory, absolute (the new crate may live anywhere).
fn sdk_path(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = given.unwrap_or(Path::new(BUILT_FROM_SDK));
    let sdk = path.canonicalize().with_context(|| {
        format!("no guest SDK at {}: pass --sdk with the backends/sdk directory of a wasmcsi checkout", path.display())
    })?;
    let manifest = std::fs::read_to_string(sdk.join("Cargo.toml"))
        .with_context(|| format!("{} holds no Cargo.toml: not the guest SDK", sdk.display()))?;
    anyhow::ensure!(
        manifest.contains("name = \"wasmcsi-backend-sdk\""),
        "{} is not the guest SDK (wasmcsi-backend-sdk)",
        sdk.display()
    );
    Ok(sdk)
}

/// `wasmcsi backend new`: write the crate and say what to do next.
pub fn run(args: NewArgs) -> anyhow::Result<()> {
    let written = new(&args)?;
    println!("wrote {} ({} backend `{}`)", written.dir.display(), args.capability.name(), args.name);
    println!("next:");
    println!("  cd {}", written.dir.display());
    println!("  cargo test                                    # its policy, against the SDK's in-memory host");
    println!("  cargo build --release --target wasm32-wasip2  # the component: {}", written.component.display());
    println!("  wasmcsi backend check {}", written.component.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn type_names_are_camel_case_backends_that_clash_with_nothing() {
        assert_eq!(type_name("my-cache"), "MyCacheBackend");
        assert_eq!(type_name("hostpath"), "HostpathBackend");
        assert_eq!(type_name("volume"), "VolumeBackend");
        assert_eq!(type_name("my-backend"), "MyBackend");
        assert_eq!(type_name("backend"), "TheBackend");
        assert_eq!(type_name("a--b9"), "AB9Backend");
    }

    #[test]
    fn names_cargo_or_the_host_would_refuse_are_refused() {
        for bad in ["", "9lives", "-x", "My", "a_b", "test", "core", &"x".repeat(33)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["x", "my-backend", "s3-cache2"] {
            check_name(good).unwrap();
        }
    }

    #[test]
    fn a_crate_is_written_whole_and_never_over_anything() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("my-store");
        let args = NewArgs { name: "my-store".into(), capability: Capability::Nfs, dir: Some(dir.clone()), sdk: None };
        let written = new(&args).unwrap();
        assert_eq!(written.component, Path::new("target/wasm32-wasip2/release/my_store.wasm"));
        let read = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap();
        let manifest = read("Cargo.toml");
        assert!(manifest.contains("name = \"my-store\"") && manifest.contains("\n[workspace]\n"), "{manifest}");
        let sdk = Path::new(BUILT_FROM_SDK).canonicalize().unwrap();
        assert!(manifest.contains(&format!("path = {:?}", sdk.to_str().unwrap())), "{manifest}");
        for file in ["Cargo.toml", "README.md"] {
            let text = read(file);
            let left =
                ["{name}", "{sdk}", "{capability}", "{artifact}", "{check_args}"].iter().find(|p| text.contains(*p));
            assert!(left.is_none(), "{file}: {left:?} left in:\n{text}");
        }
        let lib = read("src/lib.rs");
        assert!(lib.starts_with("//! `my-store`:") && lib.contains("export!(MyStoreBackend)"), "{lib}");
        assert!(!lib.contains(TEMPLATE_TYPE) && !read("src/tests.rs").contains(TEMPLATE_TYPE));
        assert!(read("README.md").contains("release/my_store.wasm --no-node --config host.toml --param server=SERVER"));
        assert!(dir.join("Cargo.lock").is_file() && dir.join(".gitignore").is_file());
        let again = new(&args).unwrap_err().to_string();
        assert!(again.contains("not empty"), "{again}");
        let no_sdk = NewArgs { sdk: Some(d.path().join("nowhere")), dir: Some(d.path().join("other")), ..args };
        assert!(new(&no_sdk).unwrap_err().to_string().contains("--sdk"));
        assert!(!d.path().join("other").exists(), "nothing written without an SDK");
    }
}
