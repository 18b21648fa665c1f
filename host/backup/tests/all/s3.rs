//! The scenarios against S3: the RADOS Gateway of a real Ceph cluster (mon, mgr, two memstore
//! OSDs and radosgw in a private namespace, `wasmcsi_ceph::Ceph::rgw`), one bucket per test; then
//! what S3 can get wrong: credentials, a missing bucket, an unreachable endpoint, and secrets
//! that must never reach a message or a log line.

use std::sync::{Arc, Mutex};

use wasmcsi_backup::{
    BackupRequest, BackupTargets, CancellationToken, ErrorKind, MemorySource, S3Credentials, Secret, TargetConfig,
};

use crate::scenarios;
use crate::support::*;

async fn bucket_store(test: &str, bucket: &str) -> Option<wasmcsi_backup::BackupStore> {
    let rgw = rgw(test)?;
    create_bucket(&rgw, bucket).await;
    Some(s3_store(&s3_config(&rgw, bucket), None))
}

#[tokio::test]
async fn s3_full_then_incremental() {
    let Some(store) = bucket_store("s3_full_then_incremental", "incremental").await else { return };
    scenarios::full_then_incremental(&store, "replicated-block:pvc-1").await;
}

#[tokio::test]
async fn s3_dedup_across_backups() {
    let Some(store) = bucket_store("s3_dedup_across_backups", "dedup").await else { return };
    scenarios::dedup_across_backups(&store, "pvc-2").await;
}

#[tokio::test]
async fn s3_corrupt_and_missing_chunks() {
    let Some(store) = bucket_store("s3_corrupt_and_missing_chunks", "corrupt").await else { return };
    scenarios::corrupt_and_missing_chunks(&store, "pvc-3").await;
}

#[tokio::test]
async fn s3_incomplete_backup_never_listed() {
    let Some(store) = bucket_store("s3_incomplete_backup_never_listed", "incomplete").await else { return };
    scenarios::incomplete_backup_never_listed(&store, "pvc-4").await;
}

#[tokio::test]
async fn s3_gc_and_concurrent_backup() {
    let Some(store) = bucket_store("s3_gc_and_concurrent_backup", "collect").await else { return };
    scenarios::gc_and_concurrent_backup(&store, "pvc-5").await;
}

fn small_backup() -> (BackupRequest<'static>, Arc<MemorySource>) {
    (
        BackupRequest { volume: "v", backup: "b", parent: None, snapshot: None },
        Arc::new(MemorySource::new(noise(8, 4 * CHUNK as usize))),
    )
}

/// A wrong secret is refused as forbidden, and neither the error nor any log line (every level,
/// the S3 client's included) shows the secret, while the target and bucket are named.
#[tokio::test(flavor = "current_thread")]
async fn s3_wrong_credentials_are_forbidden_and_never_shown() {
    let Some(rgw) = rgw("s3_wrong_credentials_are_forbidden_and_never_shown") else { return };
    create_bucket(&rgw, "creds").await;
    let wrong = "Wr0ngSecretNeverPrinted0123456789abcdef";
    let config = s3_config(&rgw, "creds");
    let creds = S3Credentials {
        access_key_id: rgw.access_key.clone(),
        secret_access_key: Secret::new(wrong),
        session_token: None,
    };

    let logs = Arc::new(Mutex::new(Vec::new()));
    let writer = {
        let logs = Arc::clone(&logs);
        move || LogWriter(Arc::clone(&logs))
    };
    let subscriber = tracing_subscriber::fmt().with_max_level(tracing::Level::TRACE).with_writer(writer).finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let store = s3_store(&config, Some(creds.clone()));
    let (req, source) = small_backup();
    let e = store.backup(req, source, &options(), progress(), &CancellationToken::new()).await.expect_err("refused");
    assert_eq!(e.kind(), ErrorKind::Forbidden, "{e}");
    let text = format!("{e} {e:?} {store:?} {creds:?} {config:?}");
    assert!(text.contains("creds"), "the bucket is named: {text}");
    tracing::error!(error = %e, "reported");
    let logged = String::from_utf8_lossy(&logs.lock().expect("logs")).into_owned();
    assert!(logged.contains("reported"), "the capture works");
    for shown in [&text, &logged] {
        assert!(!shown.contains(wrong) && !shown.contains(&rgw.secret_key), "a secret was shown: {shown}");
    }

    // Through the configuration, with the per-call credentials replacing the configured ones.
    let targets: BackupTargets = BackupTargets([("off".to_owned(), TargetConfig::S3(config))].into_iter().collect());
    let target = targets.open("off", Some(creds)).expect("open");
    assert!(!format!("{target:?}").contains(wrong));
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn s3_missing_bucket() {
    let Some(rgw) = rgw("s3_missing_bucket") else { return };
    let store = s3_store(&s3_config(&rgw, "never-created"), None);
    let (req, source) = small_backup();
    let e = store.backup(req, source, &options(), progress(), &CancellationToken::new()).await.expect_err("no bucket");
    assert_eq!(e.kind(), ErrorKind::BucketMissing, "{e}");
    let e = store.list_backups("v").await.expect_err("no bucket");
    assert_eq!(e.kind(), ErrorKind::BucketMissing, "{e}");
    let e = wasmcsi_backup::BackupStore::manifest(&store, "v", "b").await.expect_err("no bucket");
    assert_eq!(e.kind(), ErrorKind::BucketMissing, "{e}");
}

/// Nothing listens on the endpoint (a port on loopback no one binds): unreachable, after the
/// configured retries, quickly.
#[tokio::test]
async fn s3_unreachable_endpoint() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut config = wasmcsi_backup::S3Config::new(Some(format!("http://127.0.0.1:{port}")), "b");
    config.access_key_id = Some("AK".into());
    config.secret_access_key = Some(Secret::new("SK"));
    config.max_retries = 1;
    config.retry_timeout_seconds = 3;
    config.connect_timeout_seconds = 1;
    let store = s3_store(&config, None);
    let (req, source) = small_backup();
    let t0 = std::time::Instant::now();
    let e =
        store.backup(req, source, &options(), progress(), &CancellationToken::new()).await.expect_err("unreachable");
    assert_eq!(e.kind(), ErrorKind::Unreachable, "{e}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// A bucket over its quota refuses the next chunk: the target is full, and the backup is not
/// listed.
#[tokio::test]
async fn s3_full_bucket() {
    let Some(rgw) = rgw("s3_full_bucket") else { return };
    create_bucket(&rgw, "full").await;
    let ceph = wasmcsi_ceph::Ceph::shared().expect("running");
    ceph.radosgw_admin(&["quota", "set", "--quota-scope=bucket", "--bucket=full", "--max-size=262144"]).expect("quota");
    ceph.radosgw_admin(&["quota", "enable", "--quota-scope=bucket", "--bucket=full"]).expect("enable");
    let store = s3_store(&s3_config(&rgw, "full"), None);
    let (req, _) = small_backup();
    let source = Arc::new(MemorySource::new(noise(9, 16 * CHUNK as usize)));
    let e = store.backup(req, source, &options(), progress(), &CancellationToken::new()).await.expect_err("full");
    assert_eq!(e.kind(), ErrorKind::TargetFull, "{e}");
    assert!(store.list_backups("v").await.expect("list").is_empty());
}
