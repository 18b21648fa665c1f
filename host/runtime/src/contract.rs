//! The `wasmcsi:backend` package as this host serves it: its versions ([`ContractVersion`]),
//! how a component's version is told from the names it exports and imports
//! ([`ContractVersion::detect`]), and what a version does not serve ([`BLOCK_REFUSED`],
//! [`ContractVersion::has_interface`]). Names
//! only: what a version's exports answer is `compat`, which capability a component may import
//! is `capabilities`.
use std::fmt;

/// WIT package prefix of our own interfaces.
pub const PACKAGE: &str = "wasmcsi:backend/";

/// Why a 0.1.0 component importing `block` does not load.
pub const BLOCK_REFUSED: &str = "the block capability needs wasmcsi:backend@0.2.0 or later (0.1.0's block never \
     had a provider); rebuild the backend against wit/backend.wit";

/// A version of the `wasmcsi:backend` package this host serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ContractVersion {
    /// `wit/previous/0.1.0`: no provider for `block`, no `get-snapshot` / `reconcile-volume`.
    V0_1,
    /// `wit/previous/0.2.0`: `block` and `rbd` in their earlier shape, no `backup`, no
    /// `modify-volume` / group snapshots.
    V0_2,
    /// `wit/backend.wit`, the current contract.
    V0_3,
}

/// Why a component's names do not make it a backend of a version this host serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    #[error("it exports no {PACKAGE}driver, so it is no wasmcsi backend (exports: [{}])", .exports.join(", "))]
    NoDriver { exports: Vec<String> },
    #[error("it exports more than one driver ({}); a backend is built against one version", .drivers.join(", "))]
    SeveralDrivers { drivers: Vec<String> },
    #[error(
        "it names {name}; this host serves {PACKAGE} at @0.1.0, @0.2.0 and @0.3.0 (rebuild it against wit/backend.wit)"
    )]
    Unsupported { name: String },
    #[error(
        "it mixes contract versions: it exports {export} but imports {import}; \
         a backend is built against one wasmcsi:backend version"
    )]
    Mixed { export: String, import: String },
}

impl ContractVersion {
    /// The version this host's own types are.
    pub const CURRENT: Self = Self::V0_3;

    /// Every version this host serves, oldest first.
    pub const ALL: [Self; 3] = [Self::V0_1, Self::V0_2, Self::V0_3];

    /// The package version as WIT names it.
    pub fn package_version(self) -> &'static str {
        match self {
            Self::V0_1 => "0.1.0",
            Self::V0_2 => "0.2.0",
            Self::V0_3 => "0.3.0",
        }
    }

    /// Whether this version's package has the interface `name` (`backup` came with 0.3.0).
    pub fn has_interface(self, name: &str) -> bool {
        name != "backup" || self >= Self::V0_3
    }

    /// The version a semver string like `0.1.0` belongs to. Versions `0.x.y` of one `x` are
    /// compatible (wasmtime's linker resolves one to the other), so any patch release counts;
    /// pre-releases and builds do not.
    pub fn of(version: &str) -> Option<Self> {
        let (minor, patch) = version.strip_prefix("0.")?.split_once('.')?;
        if patch.is_empty() || !patch.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        match minor {
            "1" => Some(Self::V0_1),
            "2" => Some(Self::V0_2),
            "3" => Some(Self::V0_3),
            _ => None,
        }
    }

    /// `wasmcsi:backend/INTERFACE@VERSION`, the name a component of this version imports.
    pub fn interface(self, interface: &str) -> String {
        format!("{PACKAGE}{interface}@{}", self.package_version())
    }

    /// The version a component is built against, from the names it exports (exactly one
    /// `wasmcsi:backend/driver@…`) and its `wasmcsi:backend/…` imports (`ImportSummary::wasmcsi`;
    /// every one of them must be of that version).
    pub fn detect(imports: &[String], exports: &[String]) -> Result<Self, ContractError> {
        let drivers: Vec<&String> = exports
            .iter()
            .filter(|e| e.strip_prefix(PACKAGE).is_some_and(|rest| rest.split('@').next() == Some("driver")))
            .collect();
        let export = match drivers[..] {
            [] => return Err(ContractError::NoDriver { exports: exports.to_vec() }),
            [one] => one,
            _ => return Err(ContractError::SeveralDrivers { drivers: drivers.into_iter().cloned().collect() }),
        };
        let version = Self::of_name(export).ok_or_else(|| ContractError::Unsupported { name: export.clone() })?;
        match imports.iter().find(|import| Self::of_name(import) != Some(version)) {
            Some(import) => Err(ContractError::Mixed { export: export.clone(), import: import.clone() }),
            None => Ok(version),
        }
    }

    /// The version of a name like `wasmcsi:backend/kv@0.1.0`; `None` without a served one.
    fn of_name(name: &str) -> Option<Self> {
        Self::of(name.split_once('@')?.1)
    }
}

impl fmt::Display for ContractVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "wasmcsi:backend@{}", self.package_version())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn imports(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).filter(|n| n.starts_with(PACKAGE)).collect()
    }

    fn exports(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn the_version_comes_from_the_driver_export_and_every_import_must_agree() {
        let old = imports(&["wasmcsi:backend/types@0.1.0", "wasmcsi:backend/dir@0.1.0", "wasi:io/streams@0.2.6"]);
        assert_eq!(
            ContractVersion::detect(&old, &exports(&["wasmcsi:backend/driver@0.1.0"])),
            Ok(ContractVersion::V0_1)
        );
        let new = imports(&["wasmcsi:backend/block@0.2.0"]);
        assert_eq!(
            ContractVersion::detect(&new, &exports(&["wasmcsi:backend/driver@0.2.0"])),
            Ok(ContractVersion::V0_2)
        );
        let current = imports(&["wasmcsi:backend/block@0.3.0", "wasmcsi:backend/backup@0.3.0"]);
        assert_eq!(
            ContractVersion::detect(&current, &exports(&["wasmcsi:backend/driver@0.3.0"])),
            Ok(ContractVersion::V0_3)
        );
        // A patch release of a version is that version (the linker resolves it the same way).
        assert_eq!(
            ContractVersion::detect(
                &imports(&["wasmcsi:backend/kv@0.1.3"]),
                &exports(&["wasmcsi:backend/driver@0.1.0"])
            ),
            Ok(ContractVersion::V0_1)
        );
        // No wasmcsi import at all: the export decides.
        assert_eq!(
            ContractVersion::detect(&imports(&[]), &exports(&["wasmcsi:backend/driver@0.2.0"])),
            Ok(ContractVersion::V0_2)
        );
    }

    #[test]
    fn a_component_mixing_versions_is_refused_naming_both() {
        let mixed = imports(&["wasmcsi:backend/types@0.1.0", "wasmcsi:backend/kv@0.2.0"]);
        let e = ContractVersion::detect(&mixed, &exports(&["wasmcsi:backend/driver@0.1.0"])).expect_err("mixed");
        assert_eq!(
            e,
            ContractError::Mixed {
                export: "wasmcsi:backend/driver@0.1.0".into(),
                import: "wasmcsi:backend/kv@0.2.0".into()
            }
        );
        let text = e.to_string();
        assert!(text.contains("driver@0.1.0") && text.contains("kv@0.2.0"), "{text}");
    }

    #[test]
    fn a_component_without_one_driver_of_a_served_version_is_refused() {
        let none = ContractVersion::detect(&imports(&[]), &exports(&["wasi:cli/run@0.2.6"])).expect_err("no driver");
        assert!(matches!(none, ContractError::NoDriver { .. }), "{none}");
        assert!(none.to_string().contains("wasi:cli/run@0.2.6"), "{none}");
        // `driver-extra` is not `driver`.
        let lookalike = ContractVersion::detect(&imports(&[]), &exports(&["wasmcsi:backend/driver-extra@0.2.0"]));
        assert!(matches!(lookalike, Err(ContractError::NoDriver { .. })), "{lookalike:?}");
        let both = exports(&["wasmcsi:backend/driver@0.1.0", "wasmcsi:backend/driver@0.2.0"]);
        assert!(matches!(ContractVersion::detect(&imports(&[]), &both), Err(ContractError::SeveralDrivers { .. })));
        for unserved in ["0.4.0", "1.0.0", "0.3.0-rc1", "0.1", ""] {
            let driver = if unserved.is_empty() {
                "wasmcsi:backend/driver".to_string()
            } else {
                format!("wasmcsi:backend/driver@{unserved}")
            };
            let e = ContractVersion::detect(&imports(&[]), std::slice::from_ref(&driver)).expect_err("unserved");
            assert_eq!(e, ContractError::Unsupported { name: driver.clone() }, "{driver}");
            assert!(e.to_string().contains("@0.1.0, @0.2.0 and @0.3.0"), "{e}");
        }
    }

    #[test]
    fn interface_names_carry_the_package_version() {
        assert_eq!(ContractVersion::V0_1.interface("kv"), "wasmcsi:backend/kv@0.1.0");
        assert_eq!(ContractVersion::CURRENT.interface("block"), "wasmcsi:backend/block@0.3.0");
        assert_eq!(ContractVersion::V0_1.to_string(), "wasmcsi:backend@0.1.0");
    }

    #[test]
    fn backup_is_an_interface_of_0_3_only() {
        assert!(ContractVersion::V0_3.has_interface("backup"));
        assert!(!ContractVersion::V0_2.has_interface("backup") && !ContractVersion::V0_1.has_interface("backup"));
        assert!(ContractVersion::ALL.iter().all(|v| v.has_interface("rbd") && v.has_interface("block")));
        assert_eq!(ContractVersion::ALL.last(), Some(&ContractVersion::CURRENT));
    }
}
