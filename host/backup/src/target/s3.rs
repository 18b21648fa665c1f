//! An S3-compatible target through `object_store` (the Arrow project's client): single-request
//! puts (a chunk is a few MiB, under any multipart threshold), listings by prefix (ListObjectsV2,
//! paginated by the client), and errors classified from the server's answer.
//!
//! Credentials live in the client's signer only: this type's `Debug` and [`Target::describe`]
//! name the endpoint, bucket and prefix, and the client's errors carry the URL and the server's
//! error code, never a key. No credential is ever looked up elsewhere (environment, instance
//! metadata): a target without credentials is a configuration error.

use std::error::Error as _;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt as _};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt as _, PutPayload, RetryConfig};

use super::{ObjectInfo, Target};
use crate::config::{S3Config, S3Credentials};
use crate::error::{Error, TargetError, TargetErrorKind};

pub struct S3Target {
    store: AmazonS3,
    /// The prefix inside the bucket, `""` or ending in `/`.
    prefix: String,
    name: String,
}

impl fmt::Debug for S3Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Target").field("target", &self.name).finish_non_exhaustive()
    }
}

impl S3Target {
    /// A client for `config` (named `name` in errors), signing with `credentials` if given, else
    /// with the configured ones. Makes no request.
    pub fn open(name: &str, config: &S3Config, credentials: Option<S3Credentials>) -> Result<Self, Error> {
        let bad = |why: String| Error::Config { name: name.to_owned(), why };
        let credentials = credentials
            .or_else(|| config.credentials())
            .ok_or_else(|| bad("no credentials (access_key_id and secret_access_key)".into()))?;
        let prefix = config.prefix.trim_matches('/');
        if !prefix.is_empty() && prefix.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
            return Err(bad(format!("prefix {prefix:?}")));
        }
        // reqwest is built without a bundled TLS provider (no aws-lc): ring, as everywhere in the
        // host. An error means another provider is already the process default, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let endpoint = config.endpoint.clone();
        let client = ClientOptions::new()
            .with_allow_http(endpoint.as_deref().is_some_and(|e| e.starts_with("http://")))
            .with_connect_timeout(config.connect_timeout())
            .with_timeout(Duration::from_secs(config.request_timeout_seconds));
        let retry = RetryConfig {
            max_retries: config.max_retries,
            retry_timeout: Duration::from_secs(config.retry_timeout_seconds),
            ..RetryConfig::default()
        };
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_virtual_hosted_style_request(config.virtual_hosted_style)
            .with_access_key_id(&credentials.access_key_id)
            .with_secret_access_key(credentials.secret_access_key.expose())
            .with_client_options(client)
            .with_retry(retry);
        if let Some(token) = &credentials.session_token {
            builder = builder.with_token(token.expose());
        }
        if let Some(e) = &endpoint {
            builder = builder.with_endpoint(e);
        }
        let store = builder.build().map_err(|e| bad(e.to_string()))?;
        let at = endpoint.as_deref().unwrap_or("AWS");
        Ok(Self {
            store,
            prefix: if prefix.is_empty() { String::new() } else { format!("{prefix}/") },
            name: format!("s3://{}/{prefix} at {at}", config.bucket),
        })
    }

    fn path(&self, key: &str) -> Path {
        Path::from(format!("{}{key}", self.prefix))
    }

    fn key_of(&self, path: &Path) -> String {
        let full = path.as_ref();
        full.strip_prefix(&self.prefix).unwrap_or(full).to_owned()
    }

    fn error(&self, op: &'static str, key: &str, e: &object_store::Error) -> TargetError {
        let (kind, message) = classify(e);
        TargetError { kind, op, key: key.to_owned(), target: self.name.clone(), message }
    }
}

/// The kind of an `object_store` error, from its variant, the S3 error code in the server's
/// answer and the transport error underneath; and a message of bounded length.
fn classify(e: &object_store::Error) -> (TargetErrorKind, String) {
    let mut text = e.to_string();
    let mut unreachable = false;
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(http) = s.downcast_ref::<object_store::client::HttpError>() {
            use object_store::client::HttpErrorKind as K;
            unreachable |= matches!(http.kind(), K::Connect | K::Timeout);
        }
        source = s.source();
        if let Some(next) = source {
            text.push_str(": ");
            text.push_str(&next.to_string());
        }
    }
    let has = |code: &str| text.contains(code);
    let kind = if has("NoSuchBucket") {
        TargetErrorKind::BucketMissing
    } else if has("QuotaExceeded") || has("InsufficientStorage") || has("507 Insufficient") {
        TargetErrorKind::Full
    } else {
        match e {
            object_store::Error::NotFound { .. } => TargetErrorKind::NotFound,
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
                TargetErrorKind::Forbidden
            }
            _ if has("InvalidAccessKeyId") || has("SignatureDoesNotMatch") || has("AccessDenied") => {
                TargetErrorKind::Forbidden
            }
            _ if unreachable => TargetErrorKind::Unreachable,
            _ => TargetErrorKind::Other,
        }
    };
    const MAX: usize = 600;
    if text.len() > MAX {
        let mut cut = MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    (kind, text)
}

#[async_trait]
impl Target for S3Target {
    fn describe(&self) -> &str {
        &self.name
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<(), TargetError> {
        self.store.put(&self.path(key), PutPayload::from_bytes(data)).await.map_err(|e| self.error("put", key, &e))?;
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Bytes, TargetError> {
        let got = self.store.get(&self.path(key)).await.map_err(|e| self.error("get", key, &e))?;
        got.bytes().await.map_err(|e| self.error("get", key, &e))
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, TargetError> {
        match self.store.head(&self.path(key)).await {
            Ok(m) => Ok(Some(ObjectInfo { key: key.to_owned(), size: m.size, modified: m.last_modified.into() })),
            // A HEAD answer has no body, so a missing bucket looks like a missing object here;
            // the lease every backup and collection puts first reports a missing bucket.
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("head", key, &e)),
        }
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxStream<'a, Result<ObjectInfo, TargetError>> {
        let path = self.path(prefix.trim_end_matches('/'));
        self.store
            .list(Some(&path))
            .map(move |r| match r {
                Ok(m) => {
                    Ok(ObjectInfo { key: self.key_of(&m.location), size: m.size, modified: m.last_modified.into() })
                }
                Err(e) => Err(self.error("list", prefix, &e)),
            })
            .boxed()
    }

    async fn folders(&self, prefix: &str) -> Result<Vec<String>, TargetError> {
        let path = self.path(prefix.trim_end_matches('/'));
        let listed = self.store.list_with_delimiter(Some(&path)).await.map_err(|e| self.error("list", prefix, &e))?;
        Ok(listed.common_prefixes.iter().filter_map(|p| p.filename().map(str::to_owned)).collect())
    }

    async fn delete(&self, key: &str) -> Result<(), TargetError> {
        match self.store.delete(&self.path(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("delete", key, &e)),
        }
    }
}
