//! The capabilities: the `wasmcsi:backend` interfaces a backend may import ([`Capability`]),
//! what a component imports, sorted ([`ImportSummary`]), and the check that it imports nothing
//! beyond its operator's grants and nothing its contract version lacks
//! ([`ImportSummary::violations`]). What a capability does is `imports::NAME`; what one
//! backend was granted of each, resolved at load, is `state::Capabilities`.
use crate::config::Grants;
use crate::contract::{BLOCK_REFUSED, ContractVersion, PACKAGE};

/// A capability interface a backend may import.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capability {
    /// types only; always linked
    Types,
    /// always granted
    Log,
    /// always granted, namespaced per backend
    Kv,
    Dir,
    Nfs,
    Block,
    Rbd,
    /// since 0.3.0
    Backup,
}

impl Capability {
    pub fn from_interface(name: &str) -> Option<Self> {
        Some(match name {
            "types" => Self::Types,
            "log" => Self::Log,
            "kv" => Self::Kv,
            "dir" => Self::Dir,
            "nfs" => Self::Nfs,
            "block" => Self::Block,
            "rbd" => Self::Rbd,
            "backup" => Self::Backup,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Types => "types",
            Self::Log => "log",
            Self::Kv => "kv",
            Self::Dir => "dir",
            Self::Nfs => "nfs",
            Self::Block => "block",
            Self::Rbd => "rbd",
            Self::Backup => "backup",
        }
    }
}

/// The imports of a component, sorted into what we know.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ImportSummary {
    /// `wasmcsi:backend/*` interfaces
    pub capabilities: Vec<Capability>,
    /// the `wasmcsi:backend/*` imports as named, with their versions (`…/kv@0.1.0`)
    pub wasmcsi: Vec<String>,
    /// `wasi:*` interfaces (served deny-by-default)
    pub wasi: Vec<String>,
    /// anything else: the component cannot load
    pub unknown: Vec<String>,
}

impl ImportSummary {
    /// Sort import names like `wasmcsi:backend/dir@0.1.0` or `wasi:io/streams@0.2.6`.
    pub fn classify<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut s = Self::default();
        for name in names {
            let unversioned = name.split('@').next().unwrap_or(name);
            if let Some(iface) = unversioned.strip_prefix(PACKAGE) {
                match Capability::from_interface(iface) {
                    Some(c) => {
                        s.capabilities.push(c);
                        s.wasmcsi.push(name.to_string());
                    }
                    None => s.unknown.push(name.to_string()),
                }
            } else if unversioned.starts_with("wasi:") {
                s.wasi.push(name.to_string());
            } else {
                s.unknown.push(name.to_string());
            }
        }
        s.capabilities.sort();
        s
    }

    /// Capabilities imported but not granted, or not served at the component's contract
    /// `version`, each with the reason; empty = the component may load.
    pub fn violations(&self, grants: &Grants, version: ContractVersion) -> Vec<String> {
        let mut out: Vec<String> =
            self.unknown.iter().map(|n| format!("import {n} is not a wasmcsi or WASI interface")).collect();
        for c in &self.capabilities {
            let import = format!("{PACKAGE}{}", c.name());
            match c {
                Capability::Block if version == ContractVersion::V0_1 => {
                    out.push(format!("import {}: {}", version.interface("block"), BLOCK_REFUSED))
                }
                c if !version.has_interface(c.name()) => out.push(format!(
                    "import {}: {version} has no interface {} (it came later; rebuild the backend against wit/backend.wit)",
                    version.interface(c.name()),
                    c.name()
                )),
                Capability::Types | Capability::Log | Capability::Kv => {}
                Capability::Dir if grants.dir.is_empty() => out.push(format!(
                    "import {import} is not granted (add [backends.NAME.grants] dir = {{ ROOT = \"/path\" }})"
                )),
                Capability::Dir => {}
                Capability::Nfs if grants.nfs.is_none() => out.push(format!(
                    "import {import} is not granted (add [backends.NAME.grants] nfs = [{{ server = \"HOST\", share = \"/export\" }}])"
                )),
                Capability::Nfs => {}
                Capability::Rbd if grants.rbd.is_none() => out.push(format!(
                    "import {import} is not granted (add [backends.NAME.grants] rbd = [{{ cluster = \"NAME\", pools = [\"POOL\"] }}])"
                )),
                Capability::Rbd => {}
                Capability::Block if grants.block.as_ref().is_none_or(|b| b.is_empty()) => out.push(format!(
                    "import {import} is not granted (add [backends.NAME.grants.block] nodes = [\"HOST:9501\"] or services = [\"NAME:9501\"])"
                )),
                Capability::Block => {}
                // Granted no target, `backup` reaches nothing (every call is permission-denied):
                // a backend offers backups where the operator configured a target and works
                // without one elsewhere.
                Capability::Backup => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ungranted_imports_are_named_in_violations() {
        let s = ImportSummary::classify([
            "wasmcsi:backend/types@0.1.0",
            "wasmcsi:backend/log@0.1.0",
            "wasmcsi:backend/dir@0.1.0",
            "wasi:io/streams@0.2.6",
            "evil:net/raw",
        ]);
        assert_eq!(s.wasi, ["wasi:io/streams@0.2.6"]);
        let v = s.violations(&Grants::default(), ContractVersion::V0_1);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].contains("evil:net/raw"));
        assert!(v[1].contains("wasmcsi:backend/dir"), "{v:?}");
        let mut g = Grants::default();
        g.dir.insert("default".into(), "/srv".into());
        assert_eq!(s.violations(&g, ContractVersion::V0_1).len(), 1);
    }

    #[test]
    fn nfs_links_only_with_an_export_granted() {
        let s = ImportSummary::classify(["wasmcsi:backend/nfs@0.1.0"]);
        let v = s.violations(&Grants::default(), ContractVersion::V0_1);
        assert!(v.len() == 1 && v[0].contains("not granted"), "{v:?}");
        let mut g = Grants { nfs: Some(vec![]), ..Default::default() };
        assert!(s.violations(&g, ContractVersion::V0_1).is_empty(), "granted, no server yet");
        g.nfs = Some(vec![crate::config::NfsGrant { server: "10.0.0.1".into(), share: "/export".into() }]);
        assert!(s.violations(&g, ContractVersion::V0_1).is_empty());
        let block = ImportSummary::classify(["wasmcsi:backend/block@0.2.0"]);
        assert!(
            block.violations(&g, ContractVersion::V0_2)[0].contains("not granted"),
            "{:?}",
            block.violations(&g, ContractVersion::V0_2)
        );
        g.block =
            Some(wasmcsi_block::catalog::NodeSources { nodes: vec!["10.0.0.1:9501".into()], ..Default::default() });
        assert!(block.violations(&g, ContractVersion::V0_2).is_empty());
    }

    #[test]
    fn block_at_0_1_is_refused_even_when_granted_naming_the_version_it_needs() {
        let block = ImportSummary::classify(["wasmcsi:backend/block@0.1.0"]);
        assert_eq!(block.wasmcsi, ["wasmcsi:backend/block@0.1.0"]);
        let granted = Grants {
            block: Some(wasmcsi_block::catalog::NodeSources {
                nodes: vec!["10.0.0.1:9501".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        for grants in [Grants::default(), granted] {
            let v = block.violations(&grants, ContractVersion::V0_1);
            assert_eq!(v.len(), 1, "{v:?}");
            assert!(v[0].contains("wasmcsi:backend/block@0.1.0") && v[0].contains("@0.2.0"), "{v:?}");
        }
    }

    #[test]
    fn backup_links_without_a_target_granted_and_only_at_0_3() {
        let s = ImportSummary::classify(["wasmcsi:backend/backup@0.3.0"]);
        assert_eq!(s.capabilities, [Capability::Backup]);
        // Granted nothing it reaches nothing (every call is permission-denied), so it links.
        assert!(s.violations(&Grants::default(), ContractVersion::V0_3).is_empty());
        let g = Grants { backup: vec!["s3-main".into()], ..Default::default() };
        assert!(s.violations(&g, ContractVersion::V0_3).is_empty());
        // A component naming backup at a version without it is no backend of that version.
        let old = ImportSummary::classify(["wasmcsi:backend/backup@0.2.0"]);
        let v = old.violations(&g, ContractVersion::V0_2);
        assert!(v.len() == 1 && v[0].contains("backup@0.2.0") && v[0].contains("has no interface"), "{v:?}");
    }

    #[test]
    fn rbd_links_only_with_a_pool_granted() {
        let s = ImportSummary::classify(["wasmcsi:backend/rbd@0.1.0"]);
        let v = s.violations(&Grants::default(), ContractVersion::V0_1);
        assert!(v.len() == 1 && v[0].contains("not granted") && v[0].contains("rbd ="), "{v:?}");
        let mut g = Grants { rbd: Some(vec![]), ..Default::default() };
        assert!(s.violations(&g, ContractVersion::V0_1).is_empty(), "granted, no cluster yet");
        g.rbd = Some(vec![crate::config::RbdGrant { cluster: "c".into(), pools: vec!["p".into()] }]);
        assert!(s.violations(&g, ContractVersion::V0_1).is_empty());
    }
}
