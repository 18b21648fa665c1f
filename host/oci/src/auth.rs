//! Registry credentials from a docker `config.json`, the file `docker login` writes and a
//! Kubernetes `kubernetes.io/dockerconfigjson` Secret holds (mounted, its key
//! `.dockerconfigjson` is the same JSON). Only inline credentials (`auths.HOST.auth` or
//! `username`/`password`); credential helpers (`credsStore`, `credHelpers`) run programs, which a
//! CSI pod has no business doing, and are refused by name.
use crate::error::OciError;
use base64::Engine as _;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `$DOCKER_CONFIG/config.json`, else `$HOME/.docker/config.json`: docker's own lookup.
pub fn default_docker_config() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DOCKER_CONFIG") {
        return Some(PathBuf::from(dir).join("config.json"));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".docker/config.json"))
}

#[derive(Debug, Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Debug, Deserialize)]
struct AuthEntry {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    #[serde(rename = "identitytoken")]
    identity_token: Option<String>,
}

/// User and password per registry host.
#[derive(Clone, Default)]
pub struct Credentials {
    by_host: BTreeMap<String, (String, String)>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the passwords.
        f.debug_struct("Credentials").field("registries", &self.by_host.keys().collect::<Vec<_>>()).finish()
    }
}

impl Credentials {
    /// Read a docker config file. A missing file is no credentials (anonymous pulls).
    pub fn load(path: &Path) -> Result<Self, OciError> {
        let bad = |why: String| OciError::Config { what: "docker config", path: path.into(), why };
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(bad(e.to_string())),
        };
        Self::parse(&text).map_err(bad)
    }

    pub fn parse(json: &[u8]) -> Result<Self, String> {
        let config: DockerConfig = serde_json::from_slice(json).map_err(|e| e.to_string())?;
        let mut by_host = BTreeMap::new();
        for (key, entry) in config.auths {
            let pair = match (&entry.auth, &entry.username, &entry.password) {
                (Some(auth), _, _) => {
                    let raw = base64::engine::general_purpose::STANDARD
                        .decode(auth.trim())
                        .map_err(|e| format!("auths.{key}.auth: not base64: {e}"))?;
                    let raw = String::from_utf8(raw).map_err(|_| format!("auths.{key}.auth: not UTF-8"))?;
                    let (user, password) =
                        raw.split_once(':').ok_or_else(|| format!("auths.{key}.auth: not user:password"))?;
                    (user.to_string(), password.to_string())
                }
                (None, Some(u), Some(p)) => (u.clone(), p.clone()),
                _ if entry.identity_token.is_some() => {
                    return Err(format!("auths.{key}: identity tokens are not supported, only user and password"));
                }
                _ => continue,
            };
            by_host.insert(host_of(&key).to_string(), pair);
        }
        Ok(Self { by_host })
    }

    /// The auth for `registry` (`host[:port]`): basic when the file has it, else anonymous.
    pub fn for_registry(&self, registry: &str) -> oci_client::secrets::RegistryAuth {
        match self.by_host.get(registry) {
            Some((user, password)) => oci_client::secrets::RegistryAuth::Basic(user.clone(), password.clone()),
            None => oci_client::secrets::RegistryAuth::Anonymous,
        }
    }
}

/// `https://host:port/v1/` → `host:port`, as docker writes keys either way.
fn host_of(key: &str) -> &str {
    let key = key.strip_prefix("https://").or_else(|| key.strip_prefix("http://")).unwrap_or(key);
    key.split('/').next().unwrap_or(key)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use oci_client::secrets::RegistryAuth;

    #[test]
    fn inline_credentials_are_found_by_host_whichever_way_the_key_is_written() {
        let json = br#"{"auths": {
            "https://reg.example:5000/v1/": {"auth": "YWxpY2U6czNjcjN0"},
            "other.example": {"username": "bob", "password": "pw"},
            "empty.example": {}
        }}"#;
        let c = Credentials::parse(json).unwrap();
        assert!(
            matches!(c.for_registry("reg.example:5000"), RegistryAuth::Basic(u, p) if u == "alice" && p == "s3cr3t")
        );
        assert!(matches!(c.for_registry("other.example"), RegistryAuth::Basic(u, _) if u == "bob"));
        assert!(matches!(c.for_registry("empty.example"), RegistryAuth::Anonymous));
        assert!(!format!("{c:?}").contains("s3cr3t"));
        assert!(Credentials::parse(br#"{"auths": {"r": {"auth": "!!"}}}"#).is_err());
        assert!(Credentials::parse(br#"{"auths": {"r": {"identitytoken": "x"}}}"#).unwrap_err().contains("identity"));
    }

    #[test]
    fn a_missing_file_is_anonymous() {
        let c = Credentials::load(Path::new("/nonexistent/config.json")).unwrap();
        assert!(matches!(c.for_registry("r"), RegistryAuth::Anonymous));
    }
}
