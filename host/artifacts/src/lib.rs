//! The components this workspace builds: the bundled backends, the example backend and the
//! hostile test fixtures, as bytes. `ALL` lists them with the file stem the host would load
//! them as (`hostpath.wasm` → backend `hostpath`). Building them is `build.rs`'s job; this
//! crate holds no logic.
include!(concat!(env!("OUT_DIR"), "/artifacts.rs"));
