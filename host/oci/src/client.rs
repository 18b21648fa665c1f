//! The registry client: the ORAS project's `oci-client` with credentials from a docker config,
//! TLS with the system roots and an operator's CA file, and every request bounded in time
//! (connect, between bytes, and the whole request) and every blob in size. It checks every
//! digest itself: a registry is trusted for nothing but availability.
use crate::artifact::{Descriptor, MEDIA_TYPE_OCI_MANIFEST};
use crate::auth::Credentials;
use crate::error::OciError;
use crate::source::Source;
use futures::StreamExt as _;
use oci_client::RegistryOperation;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use sha2::Digest as _;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::AsyncWriteExt as _;

/// How a client reaches registries.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// PEM CA certificates trusted beside the system's (a private registry's CA).
    pub ca_file: Option<PathBuf>,
    /// A docker `config.json` with the registries' credentials; none: anonymous.
    pub docker_config: Option<PathBuf>,
    /// Bound of each registry request, and of the silence between two chunks of a blob.
    pub request_timeout: Duration,
    /// The largest layer pulled; a larger one is refused before its first byte.
    pub max_layer_bytes: u64,
}

/// A signature manifest or payload is a few hundred bytes; this is generous.
pub const MAX_SMALL_BLOB: u64 = 1 << 20;

impl Default for ClientOptions {
    fn default() -> Self {
        Self { ca_file: None, docker_config: None, request_timeout: Duration::from_secs(30), max_layer_bytes: 64 << 20 }
    }
}

pub struct RegistryClient {
    client: oci_client::Client,
    credentials: Credentials,
    options: ClientOptions,
}

impl RegistryClient {
    pub fn new(options: ClientOptions) -> Result<Self, OciError> {
        // reqwest is built without a bundled provider (see the workspace manifest): ring, as the
        // rest of the process uses. A provider installed already (by another client) stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut extra_root_certificates = vec![];
        if let Some(path) = &options.ca_file {
            let data = std::fs::read(path).map_err(|e| OciError::Config {
                what: "CA file",
                path: path.clone(),
                why: e.to_string(),
            })?;
            extra_root_certificates.push(Certificate { encoding: CertificateEncoding::Pem, data });
        }
        let credentials = match &options.docker_config {
            Some(path) => Credentials::load(path)?,
            None => Credentials::default(),
        };
        let config = ClientConfig {
            extra_root_certificates,
            // No image index is ever followed to a platform: a backend is one component.
            platform_resolver: None,
            read_timeout: Some(options.request_timeout),
            connect_timeout: Some(options.request_timeout),
            user_agent: concat!("wasmcsi/", env!("CARGO_PKG_VERSION")),
            ..Default::default()
        };
        // `Client::new` would fall back to a default configuration (no CA) on error.
        let client = oci_client::Client::try_from(config).map_err(|e| OciError::Config {
            what: "CA file",
            path: options.ca_file.clone().unwrap_or_default(),
            why: e.to_string(),
        })?;
        Ok(Self { client, credentials, options })
    }

    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    /// Run one registry request under the request bound, its error naming the operation.
    async fn bounded<T>(
        &self,
        operation: &'static str,
        source: &Source,
        request: impl Future<Output = Result<T, OciDistributionError>>,
    ) -> Result<T, OciError> {
        match tokio::time::timeout(self.options.request_timeout, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(registry_error(operation, source, &e)),
            Err(_) => Err(OciError::Timeout {
                operation,
                reference: source.to_string(),
                timeout_ms: u64::try_from(self.options.request_timeout.as_millis()).unwrap_or(u64::MAX),
            }),
        }
    }

    async fn authenticate(&self, source: &Source, operation: RegistryOperation) -> Result<(), OciError> {
        let auth = self.credentials.for_registry(&source.registry);
        self.bounded("authentication", source, self.client.auth(&source.reference(), &auth, operation)).await?;
        Ok(())
    }

    /// The manifest `source` names (a digest or a tag), with its digest as computed from its
    /// bytes. A digest-pinned source whose bytes hash otherwise is a [`OciError::DigestMismatch`].
    pub async fn manifest(&self, source: &Source) -> Result<(Vec<u8>, String), OciError> {
        self.manifest_if_any(source).await?.ok_or_else(|| OciError::Registry {
            operation: "manifest pull",
            reference: source.to_string(),
            message: "no such manifest".into(),
        })
    }

    /// As [`Self::manifest`], `None` when the registry has no such manifest (an unsigned
    /// artifact's signature tag).
    pub async fn manifest_if_any(&self, source: &Source) -> Result<Option<(Vec<u8>, String)>, OciError> {
        let auth = self.credentials.for_registry(&source.registry);
        let reference = source.reference();
        let pulled = tokio::time::timeout(
            self.options.request_timeout,
            self.client.pull_manifest_raw(&reference, &auth, &[MEDIA_TYPE_OCI_MANIFEST]),
        )
        .await;
        let body = match pulled {
            Ok(Ok((body, _registry_digest))) => body,
            Ok(Err(e)) if is_not_found(&e) => return Ok(None),
            // oci-client checks a pinned digest too; ours below names what mismatched.
            Ok(Err(OciDistributionError::DigestError(e))) => {
                return Err(OciError::DigestMismatch {
                    what: "manifest",
                    reference: source.to_string(),
                    expected: source.digest.clone().unwrap_or_default(),
                    actual: e.to_string(),
                });
            }
            Ok(Err(e)) => return Err(registry_error("manifest pull", source, &e)),
            Err(_) => {
                return Err(OciError::Timeout {
                    operation: "manifest pull",
                    reference: source.to_string(),
                    timeout_ms: u64::try_from(self.options.request_timeout.as_millis()).unwrap_or(u64::MAX),
                });
            }
        };
        let digest = crate::sha256_digest(&body);
        if let Some(expected) = &source.digest
            && *expected != digest
        {
            return Err(OciError::DigestMismatch {
                what: "manifest",
                reference: source.to_string(),
                expected: expected.clone(),
                actual: digest,
            });
        }
        Ok(Some((body.to_vec(), digest)))
    }

    /// Stream the blob `descriptor` names into `out`, refusing it when it is larger than
    /// `limit` (before the first byte when the descriptor says so, else as soon as it grows
    /// past) and when its bytes do not hash to its digest. `out` then holds garbage: callers
    /// write into a temporary file they drop.
    pub async fn blob_into(
        &self,
        source: &Source,
        descriptor: &Descriptor,
        limit: u64,
        out: &mut (impl tokio::io::AsyncWrite + Unpin),
    ) -> Result<u64, OciError> {
        let too_large = |size| OciError::TooLarge { reference: source.to_string(), size, limit };
        if descriptor.size > limit {
            return Err(too_large(descriptor.size));
        }
        self.authenticate(source, RegistryOperation::Pull).await?;
        let layer = oci_client::manifest::OciDescriptor {
            media_type: descriptor.media_type.clone(),
            digest: descriptor.digest.clone(),
            size: i64::try_from(descriptor.size).unwrap_or(i64::MAX),
            ..Default::default()
        };
        let reference = source.reference();
        let mut stream =
            self.bounded("blob pull", source, self.client.pull_blob_stream(&reference, &layer)).await?.stream;
        let mut hasher = sha2::Sha256::new();
        let mut written = 0u64;
        // Between two chunks, the client's read timeout bounds the silence.
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| OciError::Registry {
                operation: "blob pull",
                reference: source.to_string(),
                message: e.to_string(),
            })?;
            written = written.saturating_add(chunk.len() as u64);
            if written > descriptor.size.min(limit) {
                return Err(if written > limit {
                    too_large(written)
                } else {
                    OciError::DigestMismatch {
                        what: "layer",
                        reference: source.to_string(),
                        expected: format!("{} of {} bytes", descriptor.digest, descriptor.size),
                        actual: format!("more than {} bytes", descriptor.size),
                    }
                });
            }
            hasher.update(&chunk);
            out.write_all(&chunk)
                .await
                .map_err(|e| OciError::Cache { path: PathBuf::from("(layer being written)"), source: e })?;
        }
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != descriptor.digest || written != descriptor.size {
            return Err(OciError::DigestMismatch {
                what: "layer",
                reference: source.to_string(),
                expected: descriptor.digest.clone(),
                actual,
            });
        }
        Ok(written)
    }

    /// A small blob (a signature payload) in memory, verified.
    pub async fn small_blob(&self, source: &Source, descriptor: &Descriptor) -> Result<Vec<u8>, OciError> {
        let mut out = Vec::new();
        self.blob_into(source, descriptor, MAX_SMALL_BLOB, &mut out).await?;
        Ok(out)
    }

    /// Push one blob unless the registry has it.
    pub async fn push_blob(&self, source: &Source, bytes: &[u8], digest: &str) -> Result<(), OciError> {
        self.authenticate(source, RegistryOperation::Push).await?;
        let reference = source.reference();
        if self.bounded("blob check", source, self.client.blob_exists(&reference, digest)).await? {
            return Ok(());
        }
        self.bounded("blob push", source, self.client.push_blob(&reference, bytes.to_vec(), digest)).await?;
        Ok(())
    }

    /// Push a manifest under `source`'s tag (or digest); its digest.
    pub async fn push_manifest(&self, source: &Source, manifest: &[u8]) -> Result<String, OciError> {
        self.authenticate(source, RegistryOperation::Push).await?;
        let content_type = http_header(MEDIA_TYPE_OCI_MANIFEST);
        self.bounded(
            "manifest push",
            source,
            self.client.push_manifest_raw(&source.reference(), manifest.to_vec(), content_type),
        )
        .await?;
        Ok(crate::sha256_digest(manifest))
    }
}

fn http_header(value: &'static str) -> http::HeaderValue {
    http::HeaderValue::from_static(value)
}

fn is_not_found(e: &OciDistributionError) -> bool {
    match e {
        OciDistributionError::ImageManifestNotFoundError(_) => true,
        OciDistributionError::RegistryError { envelope, .. } => {
            envelope.errors.iter().any(|e| matches!(e.code, OciErrorCode::ManifestUnknown | OciErrorCode::NotFound))
        }
        OciDistributionError::ServerError { code, .. } => *code == 404,
        _ => false,
    }
}

fn registry_error(operation: &'static str, source: &Source, e: &OciDistributionError) -> OciError {
    // reqwest's Display is "error sending request"; the cause (refused, TLS, timeout) is below.
    let mut message = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        message.push_str(": ");
        message.push_str(&c.to_string());
        cause = c.source();
    }
    OciError::Registry { operation, reference: source.to_string(), message }
}
