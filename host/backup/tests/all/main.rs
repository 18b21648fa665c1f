//! Integration tests of the backup store: every scenario against a filesystem target and against
//! a real S3 server (the RADOS Gateway of a Ceph cluster started by the test process, see
//! `wasmcsi-ceph`), then what only one target kind can show.

mod filesystem;
mod s3;
mod scenarios;
mod support;
