//! [`TlsMode`]: how a channel of the product treats TLS (`--tls-mode off|permissive|required`).
//!
//! `required` is what a cluster runs; `permissive` exists for the upgrade from a version that
//! spoke plaintext (servers serve both, told apart by the first byte; clients speak TLS and fall
//! back to plaintext only against a server that answers the handshake like an old one); `off` is
//! plaintext, chosen explicitly, never a default that credentials silently lead to.

use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TlsMode {
    /// Plaintext, no authentication.
    Off,
    /// TLS, and plaintext peers still served (server) or fallen back to (client).
    Permissive,
    /// Mutual TLS only.
    Required,
}

#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a TLS mode (off, permissive or required)")]
pub struct ParseTlsModeError(String);

impl FromStr for TlsMode {
    type Err = ParseTlsModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(TlsMode::Off),
            "permissive" => Ok(TlsMode::Permissive),
            "required" => Ok(TlsMode::Required),
            other => Err(ParseTlsModeError(other.to_owned())),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::Permissive => "permissive",
            TlsMode::Required => "required",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_parses_back_from_its_name_and_nothing_else_parses() {
        for mode in [TlsMode::Off, TlsMode::Permissive, TlsMode::Required] {
            assert_eq!(mode.to_string().parse::<TlsMode>().ok(), Some(mode));
        }
        for bad in ["", "on", "Required", "tls"] {
            assert!(bad.parse::<TlsMode>().is_err(), "{bad:?}");
        }
    }
}
