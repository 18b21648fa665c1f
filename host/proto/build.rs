//! Compiles `proto/csi.proto` (the CSI spec) and `proto/authority.proto` (the controller's
//! authority endpoint) into Rust without `protoc`.
//!
//! protox parses the file (it bundles the `google/protobuf/*.proto`
//! well-known types the spec imports), tonic-prost-build generates the
//! prost messages plus tonic clients and servers, and the encoded
//! `FileDescriptorSet` is written to `OUT_DIR` for gRPC reflection.
//!
//! The `Compiler` is driven directly (exactly what `protox::compile` does)
//! because the encoded set must keep the spec's custom options
//! (`csi_secret`, `alpha_*`): `prost_types` drops extension fields, so
//! re-encoding the `prost_types::FileDescriptorSet` would lose them.

use std::env;
use std::error::Error;
use std::fs;
use std::path::PathBuf;

/// File name, under `OUT_DIR`, of the encoded descriptor set.
const DESCRIPTOR_SET_FILE: &str = "csi_v1_descriptor_set.bin";

fn main() -> Result<(), Box<dyn Error>> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let proto_dir = manifest_dir.join("..").join("..").join("proto");
    let proto_file = proto_dir.join("csi.proto");
    println!("cargo:rerun-if-changed={}", proto_file.display());
    println!("cargo:rerun-if-changed=build.rs");

    let mut compiler = protox::Compiler::new([&proto_dir])?;
    compiler.include_source_info(true).include_imports(true).open_file("csi.proto")?;

    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(out_dir.join(DESCRIPTOR_SET_FILE), compiler.encode_file_descriptor_set())?;

    let fds = compiler.file_descriptor_set();

    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;

    // Our own service: no custom options to keep, so protox's set is used as it is.
    let authority = proto_dir.join("authority.proto");
    println!("cargo:rerun-if-changed={}", authority.display());
    let fds = protox::compile(["authority.proto"], [&proto_dir])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
