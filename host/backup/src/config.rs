//! Backup targets as the operator names them in the host configuration, e.g.
//!
//! ```toml
//! [backup_targets.offsite]
//! kind = "s3"
//! endpoint = "https://s3.example.com"
//! bucket = "wasmcsi-backups"
//! prefix = "cluster-a"
//! region = "eu-west-1"
//! access_key_id = "AKIA…"
//! secret_access_key = "…"
//!
//! [backup_targets.nas]
//! kind = "filesystem"
//! path = "/mnt/backups"
//! ```
//!
//! [`BackupTargets`] is what the host configuration embeds (`#[serde(default)]`). Credentials may
//! also come per call ([`BackupTargets::open`]'s `credentials`: a Kubernetes Secret handed over by
//! the snapshotter), which then replace the configured ones. A secret is never printed: [`Secret`]
//! debugs as `***`, and no configuration or target type prints one.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use zeroize::Zeroizing;

use crate::error::Error;
use crate::target::{FsTarget, S3Target, Target};

/// A secret string: zeroed when dropped, `***` in every `Debug`, no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Zeroizing<String>);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(Zeroizing::new(value.into()))
    }

    /// The value, for the one place that signs requests with it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Self::new)
    }
}

/// S3 credentials: configured, or handed over per call.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Credentials {
    pub access_key_id: String,
    pub secret_access_key: Secret,
    /// For temporary credentials (STS).
    #[serde(default)]
    pub session_token: Option<Secret>,
}

/// The named targets of a host.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(transparent)]
pub struct BackupTargets(pub BTreeMap<String, TargetConfig>);

/// One target.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum TargetConfig {
    Filesystem(FsConfig),
    S3(S3Config),
}

/// A directory (an NFS mount, a local disk) the operator made.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    pub path: PathBuf,
}

/// S3-compatible object storage.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    /// `https://host[:port]` of an S3-compatible server; `None` for AWS S3 itself.
    #[serde(default)]
    pub endpoint: Option<String>,
    pub bucket: String,
    /// Everything of this target lives under this prefix of the bucket (no leading or trailing
    /// `/`; empty for the bucket's root).
    #[serde(default)]
    pub prefix: String,
    #[serde(default = "default_region")]
    pub region: String,
    /// `bucket.host/key` addressing instead of `host/bucket/key` (the default, which every
    /// S3-compatible server accepts).
    #[serde(default)]
    pub virtual_hosted_style: bool,
    #[serde(default)]
    pub access_key_id: Option<String>,
    #[serde(default)]
    pub secret_access_key: Option<Secret>,
    #[serde(default)]
    pub session_token: Option<Secret>,
    /// Seconds to wait for a connection before the attempt fails.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_seconds: u64,
    /// Seconds one request may take (a chunk is a few MiB).
    #[serde(default = "default_request_timeout")]
    pub request_timeout_seconds: u64,
    /// Retries of a failed request (transient errors only) and the time they may take in all.
    #[serde(default = "default_max_retries")]
    pub max_retries: usize,
    #[serde(default = "default_retry_timeout")]
    pub retry_timeout_seconds: u64,
}

fn default_region() -> String {
    "us-east-1".into()
}
fn default_connect_timeout() -> u64 {
    5
}
fn default_request_timeout() -> u64 {
    60
}
fn default_max_retries() -> usize {
    5
}
fn default_retry_timeout() -> u64 {
    60
}

impl S3Config {
    /// A configuration with the defaults and no credentials.
    pub fn new(endpoint: Option<String>, bucket: impl Into<String>) -> Self {
        Self {
            endpoint,
            bucket: bucket.into(),
            prefix: String::new(),
            region: default_region(),
            virtual_hosted_style: false,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            connect_timeout_seconds: default_connect_timeout(),
            request_timeout_seconds: default_request_timeout(),
            max_retries: default_max_retries(),
            retry_timeout_seconds: default_retry_timeout(),
        }
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs(self.connect_timeout_seconds)
    }

    /// The configured credentials, if both halves are there.
    pub fn credentials(&self) -> Option<S3Credentials> {
        Some(S3Credentials {
            access_key_id: self.access_key_id.clone()?,
            secret_access_key: self.secret_access_key.clone()?,
            session_token: self.session_token.clone(),
        })
    }
}

/// Written by hand: the derived form would be fine today (the secrets are [`Secret`]s), but this
/// one stays safe if a field is added.
impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("virtual_hosted_style", &self.virtual_hosted_style)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &self.secret_access_key.as_ref().map(|_| "***"))
            .field("session_token", &self.session_token.as_ref().map(|_| "***"))
            .finish_non_exhaustive()
    }
}

impl BackupTargets {
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// Opens target `name`; `credentials` (from a per-call secret) replace the configured ones
    /// of an S3 target and are refused for a filesystem target.
    pub fn open(&self, name: &str, credentials: Option<S3Credentials>) -> Result<Arc<dyn Target>, Error> {
        let config = self
            .0
            .get(name)
            .ok_or_else(|| Error::Config { name: name.to_owned(), why: "no backup target of this name".into() })?;
        config.open(name, credentials)
    }
}

impl TargetConfig {
    pub fn open(&self, name: &str, credentials: Option<S3Credentials>) -> Result<Arc<dyn Target>, Error> {
        match self {
            Self::Filesystem(fs) => {
                if credentials.is_some() {
                    return Err(Error::Config {
                        name: name.into(),
                        why: "a filesystem target takes no credentials".into(),
                    });
                }
                Ok(Arc::new(FsTarget::new(fs.path.clone())))
            }
            Self::S3(s3) => Ok(Arc::new(S3Target::open(name, s3, credentials)?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOML: &str = r#"
[offsite]
kind = "s3"
endpoint = "http://127.0.0.1:9"
bucket = "b"
prefix = "cluster-a"
access_key_id = "AKIDEXAMPLE"
secret_access_key = "wJalrXUtnFEMI-very-secret"

[nas]
kind = "filesystem"
path = "/mnt/backups"
"#;

    #[test]
    fn targets_parse_and_never_print_the_secret() {
        let t: BackupTargets = toml::from_str(TOML).expect("parse");
        assert_eq!(t.names().collect::<Vec<_>>(), ["nas", "offsite"]);
        let TargetConfig::S3(s3) = &t.0["offsite"] else { panic!("s3") };
        assert_eq!(s3.region, "us-east-1");
        assert_eq!(s3.credentials().expect("both halves").secret_access_key.expose(), "wJalrXUtnFEMI-very-secret");
        let debug = format!("{t:?} {:?}", s3.credentials());
        assert!(!debug.contains("very-secret"), "{debug}");
        assert!(debug.contains("AKIDEXAMPLE"));
        let opened = t.open("offsite", None).expect("open");
        let shown = format!("{opened:?} {}", opened.describe());
        assert!(!shown.contains("very-secret"), "{shown}");
        assert!(t.open("nas", Some(s3.credentials().expect("creds"))).is_err());
        assert!(matches!(t.open("none", None), Err(Error::Config { .. })));
    }

    #[test]
    fn unknown_fields_and_kinds_are_refused() {
        assert!(toml::from_str::<BackupTargets>("[x]\nkind = \"filesystem\"\npath = \"/a\"\nextra = 1").is_err());
        assert!(toml::from_str::<BackupTargets>("[x]\nkind = \"ftp\"\npath = \"/a\"").is_err());
    }
}
