//! What the scenarios share: volume contents, sources that fail or wait on cue, the stores of
//! both targets (a directory; the RADOS Gateway of a real Ceph cluster), bucket creation over S3.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use wasmcsi_backup::{
    BackupOptions, BackupStore, Changes, FileSink, LeaseOptions, Progress, RestoreOptions, S3Config, S3Credentials,
    S3Target, Secret, Source, StoreOptions, Target,
};

/// Chunks of the tests: small, so a volume of a few MiB has dozens of them (and the gateway's
/// in-memory OSDs stay small).
pub const CHUNK: u64 = 64 << 10;

pub fn options() -> BackupOptions {
    BackupOptions { chunk_size: CHUNK, uploads_in_flight: 4, compression_level: 1 }
}

/// Leases that expire in seconds, renewed several times a second; no grace period (the tests
/// check what the leases alone protect).
pub fn store_options() -> StoreOptions {
    StoreOptions {
        lease: LeaseOptions { ttl: Duration::from_secs(3), renew_every: Duration::from_millis(250) },
        gc_grace: Duration::ZERO,
    }
}

/// Deterministic bytes that do not compress.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A volume of `chunks` chunks: noise, with holes (chunks 3, 4 and the last two) and chunk 9 a
/// copy of chunk 1 (deduplicated within the backup), and a compressible chunk 6.
pub fn volume(chunks: u64, seed: u64) -> Vec<u8> {
    let c = CHUNK as usize;
    let mut data = noise(seed, c * chunks as usize);
    for hole in [3, 4, chunks - 1, chunks - 2] {
        data[hole as usize * c..(hole as usize + 1) * c].fill(0);
    }
    let one = data[c..2 * c].to_vec();
    data[9 * c..10 * c].copy_from_slice(&one);
    let text: Vec<u8> = b"compressible ".iter().copied().cycle().take(c).collect();
    data[6 * c..7 * c].copy_from_slice(&text);
    data
}

/// The chunks of `data` that hold data, distinct by content.
pub fn distinct_data_chunks(data: &[u8]) -> usize {
    let mut seen = std::collections::HashSet::new();
    data.chunks(CHUNK as usize).filter(|c| c.iter().any(|b| *b != 0)).for_each(|c| {
        seen.insert(c.to_vec());
    });
    seen.len()
}

pub fn progress() -> Arc<Progress> {
    Arc::new(Progress::default())
}

/// Restores `backup` into a fresh file and returns its bytes (and the file's allocated bytes).
pub async fn restore(store: &BackupStore, volume: &str, backup: &str) -> Result<(Vec<u8>, u64), wasmcsi_backup::Error> {
    use std::os::unix::fs::MetadataExt as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("restored");
    let m = store.manifest(volume, backup).await?;
    let sink = Arc::new(FileSink::create(&path, m.size).expect("sink"));
    let cancel = wasmcsi_backup::CancellationToken::new();
    store.restore(volume, backup, sink, &RestoreOptions { downloads_in_flight: 4 }, progress(), &cancel).await?;
    let meta = std::fs::metadata(&path).expect("stat");
    Ok((std::fs::read(&path).expect("read"), meta.blocks() * 512))
}

/// A source that reads through to `inner` but fails every read after the first `ok_reads`.
pub struct FailingSource<S> {
    pub inner: S,
    pub ok_reads: u64,
    pub reads: AtomicU64,
}

impl<S: Source> Source for FailingSource<S> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn changes(&self, since: Option<&str>) -> io::Result<Changes> {
        self.inner.changes(since)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if self.reads.fetch_add(1, Ordering::SeqCst) >= self.ok_reads {
            return Err(io::Error::other("injected read error"));
        }
        self.inner.read_at(offset, buf)
    }
}

/// A source whose reads past the first `free_reads` wait until [`Gate::open`].
pub struct GatedSource<S> {
    pub inner: S,
    pub free_reads: u64,
    pub reads: AtomicU64,
    pub gate: Arc<Gate>,
}

#[derive(Default)]
pub struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
    /// Reads that reached the gate.
    pub waiting: AtomicU64,
}

impl Gate {
    pub fn open(&self) {
        *self.open.lock().expect("gate") = true;
        self.cv.notify_all();
    }
}

impl<S: Source> Source for GatedSource<S> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn changes(&self, since: Option<&str>) -> io::Result<Changes> {
        self.inner.changes(since)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if self.reads.fetch_add(1, Ordering::SeqCst) >= self.free_reads {
            self.gate.waiting.fetch_add(1, Ordering::SeqCst);
            let mut open = self.gate.open.lock().expect("gate");
            while !*open {
                open = self.gate.cv.wait(open).expect("gate");
            }
        }
        self.inner.read_at(offset, buf)
    }
}

pub fn fs_store() -> (tempfile::TempDir, BackupStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let target: Arc<dyn Target> = Arc::new(wasmcsi_backup::FsTarget::new(dir.path()));
    (dir, BackupStore::new(target, store_options()))
}

/// The RADOS Gateway of this test process's Ceph cluster, or `None` (said on stderr) where Ceph
/// cannot run and that is allowed (`WASMCSI_CEPH_TESTS=require` makes it a failure).
pub fn rgw(test: &str) -> Option<wasmcsi_ceph::Rgw> {
    if let Some(why) = wasmcsi_ceph::unavailable() {
        assert!(!wasmcsi_ceph::required(), "{}=require but Ceph cannot run here: {why}", wasmcsi_ceph::MODE_ENV);
        eprintln!("skipped {test}: {why}");
        return None;
    }
    let ceph = wasmcsi_ceph::Ceph::shared()?;
    Some(ceph.rgw().expect("start the RADOS Gateway"))
}

pub fn s3_config(rgw: &wasmcsi_ceph::Rgw, bucket: &str) -> S3Config {
    let mut c = S3Config::new(Some(rgw.endpoint.clone()), bucket);
    c.prefix = "cluster-a".into();
    c.access_key_id = Some(rgw.access_key.clone());
    c.secret_access_key = Some(Secret::new(rgw.secret_key.clone()));
    c.max_retries = 1;
    c.retry_timeout_seconds = 5;
    c.connect_timeout_seconds = 2;
    c
}

pub fn s3_store(config: &S3Config, credentials: Option<S3Credentials>) -> BackupStore {
    let target: Arc<dyn Target> = Arc::new(S3Target::open("test", config, credentials).expect("open"));
    BackupStore::new(target, store_options())
}

/// Creates `bucket` on the gateway with a signed `PUT /bucket` (object_store makes no buckets).
pub async fn create_bucket(rgw: &wasmcsi_ceph::Rgw, bucket: &str) {
    use object_store::aws::{AwsAuthorizer, AwsCredential};
    use object_store::client::HttpRequestBody;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = format!("{}/{bucket}", rgw.endpoint);
    let mut req = http::Request::builder().method("PUT").uri(&url).body(HttpRequestBody::empty()).expect("request");
    let cred = AwsCredential { key_id: rgw.access_key.clone(), secret_key: rgw.secret_key.clone(), token: None };
    AwsAuthorizer::new(&cred, "s3", "us-east-1").try_authorize(&mut req, None).expect("sign");
    let resp = reqwest::Client::new().put(&url).headers(req.headers().clone()).send().await.expect("PUT bucket");
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    assert!(status.is_success() || body.contains("BucketAlreadyOwnedByYou"), "create bucket {bucket}: {status} {body}");
}
