//! The pure policy of the nfs backend: StorageClass parameters, the `subDir` template, name and
//! path checks and volume/snapshot ids. No I/O here; everything is unit-tested natively.
//! Sizes, metadata files and paging are the SDK's (`wasmcsi_backend_sdk::{capacity, meta, page}`).
use std::collections::BTreeMap;
use wasmcsi_backend_sdk::names::{MAX_ID_BYTES, check_csi_name, stable_name};
pub use wasmcsi_backend_sdk::nfs::NfsExport;

/// A policy failure: which WIT error case it becomes is decided by the caller (parameters and
/// names are `invalid-argument`, ids that do not parse are `not-found`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// Longest file name NFS servers accept.
pub const MAX_COMPONENT: usize = 255;
/// Directory (under the share) of the per-name index: `.wasmcsi/volumes/NAME` → subDir.
pub const INDEX_DIR: &str = ".wasmcsi/volumes";
/// Staging area for copies, renamed into place when whole.
pub const STAGING_DIR: &str = ".wasmcsi/staging";
/// Snapshots area: `.snapshots/NAME/data` (the copy) and `.snapshots/NAME/meta`.
pub const SNAPSHOT_DIR: &str = ".snapshots";
/// The volume's metadata file, inside the volume directory.
pub const VOLUME_META: &str = ".wasmcsi-volume";
/// The StorageClass parameters this backend takes.
pub const PARAMETERS: &[&str] = &["server", "share", "subDir", "mountOptions", "mountPermissions", "uid", "gid", "onDelete"];

const PVC_NAME: &str = "csi.storage.k8s.io/pvc/name";
const PVC_NAMESPACE: &str = "csi.storage.k8s.io/pvc/namespace";
const PV_NAME: &str = "csi.storage.k8s.io/pv/name";

/// What happens to the directory of a deleted volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDelete {
    Delete,
    Retain,
    /// renamed to `archived-<last component>` beside it
    Archive,
}

impl OnDelete {
    pub fn as_str(self) -> &'static str {
        match self {
            OnDelete::Delete => "delete",
            OnDelete::Retain => "retain",
            OnDelete::Archive => "archive",
        }
    }
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        match s {
            "delete" => Ok(OnDelete::Delete),
            "retain" => Ok(OnDelete::Retain),
            "archive" => Ok(OnDelete::Archive),
            _ => Err(invalid(format!("parameter onDelete: {s:?} is not one of delete, retain, archive"))),
        }
    }
}

/// The StorageClass parameters, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub export: NfsExport,
    /// the `subDir` template (unrendered)
    pub sub_dir: String,
    pub mount_options: Vec<String>,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub on_delete: OnDelete,
    /// the provisioner's `csi.storage.k8s.io/…` values, for the template
    pub pvc_name: Option<String>,
    pub pvc_namespace: Option<String>,
    pub pv_name: Option<String>,
}

/// A server: a host name or IPv4 address (`[A-Za-z0-9.-]`), so it can be part of an id.
pub fn check_server(s: &str) -> Result<(), Invalid> {
    let ok = !s.is_empty() && s.len() <= 64 && !s.starts_with(['.', '-']) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b));
    if ok { Ok(()) } else { Err(invalid(format!("parameter server: {s:?} must be a host name or IPv4 address of [A-Za-z0-9.-]"))) }
}

/// A share: an absolute path whose components are `[A-Za-z0-9.-]` (never `.` or `..`), so the
/// export can be encoded in an id.
pub fn check_share(s: &str) -> Result<(), Invalid> {
    let bad = || invalid(format!("parameter share: {s:?} must be an absolute path of [A-Za-z0-9.-] components"));
    let rest = s.strip_prefix('/').ok_or_else(bad)?;
    if rest.is_empty() {
        return Ok(());
    }
    for c in rest.split('/') {
        if c.is_empty() || c == "." || c == ".." || !c.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b)) {
            return Err(bad());
        }
    }
    Ok(())
}

/// A local name (what [`local_name`] makes): a file name and the tail of an id, of
/// `[A-Za-z0-9.-]` (no `_`: it separates an id's parts), not starting with '.' or '-'.
pub fn is_local_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= MAX_ID_BYTES && !n.starts_with(['.', '-']) && n.bytes().all(is_local_byte)
}

fn is_local_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-.".contains(&b)
}

/// The local name of the CSI volume or snapshot `name` on `e`: the file name of its index entry
/// or snapshot directory and the tail of its id, so that `encode_id(e, local)` fits the 95-byte
/// id. Any CSI name (1-128 bytes of almost any Unicode) has one; a plain name (`pvc-…`) is its
/// own local name, as before names were mapped, any other is a readable part plus a hash of the
/// whole name, the same on every call. Errors: the name is not CSI-valid, or the export leaves
/// no room for a name in an id.
pub fn local_name(e: &NfsExport, what: &str, name: &str) -> Result<String, Invalid> {
    check_csi_name(what, name).map_err(|e| invalid(wasmcsi_backend_sdk::types::message(&e).to_string()))?;
    let prefix = encode_prefix(e);
    let room = MAX_ID_BYTES.saturating_sub(prefix.len());
    let local = stable_name(name, room, is_local_byte);
    encode_id(e, &local)?;
    Ok(local)
}

/// `SERVER_SHARE-COMPONENTS_`: what every id on `e` starts with.
fn encode_prefix(e: &NfsExport) -> String {
    let mut id = e.server.clone();
    for c in e.share.split('/').filter(|c| !c.is_empty()) {
        id.push('_');
        id.push_str(c);
    }
    id.push('_');
    id
}

/// One path component made from user input: no escape, no NUL, no reserved name.
pub fn check_component(what: &str, c: &str) -> Result<(), Invalid> {
    if c.is_empty() || c == "." || c == ".." {
        return Err(invalid(format!("{what}: empty, '.' or '..' path component")));
    }
    if c.contains('\0') || c.contains('/') {
        return Err(invalid(format!("{what}: path component {c:?} contains NUL or '/'")));
    }
    if c.len() > MAX_COMPONENT {
        return Err(invalid(format!("{what}: path component is {} bytes, more than {MAX_COMPONENT}", c.len())));
    }
    Ok(())
}

/// A relative path under the share that a volume may live at: checked components, and never
/// inside the backend's own areas.
pub fn check_sub_dir(p: &str) -> Result<(), Invalid> {
    if p.starts_with('/') {
        return Err(invalid(format!("parameter subDir: {p:?} must be relative to the share")));
    }
    for c in p.split('/') {
        check_component("parameter subDir", c)?;
    }
    let first = p.split('/').next().unwrap_or_default();
    if first == ".wasmcsi" || first == SNAPSHOT_DIR {
        return Err(invalid(format!("parameter subDir: {p:?} is inside the backend's reserved {first}")));
    }
    Ok(())
}

fn parse_u32(key: &str, v: &str, radix: u32) -> Result<u32, Invalid> {
    u32::from_str_radix(v, radix).map_err(|_| invalid(format!("parameter {key}: {v:?} is not a valid number")))
}

impl Params {
    /// Parse StorageClass parameters. Unknown or malformed → the error names the parameter.
    pub fn parse<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self, Invalid> {
        let mut seen = BTreeMap::new();
        for (k, v) in pairs {
            if seen.insert(k, v).is_some() {
                return Err(invalid(format!("parameter {k} given twice")));
            }
        }
        let mut p = Params {
            export: NfsExport { server: String::new(), share: String::new() },
            sub_dir: "${pv.name}".into(),
            mount_options: vec![],
            mode: 0o777,
            uid: 0,
            gid: 0,
            on_delete: OnDelete::Delete,
            pvc_name: None,
            pvc_namespace: None,
            pv_name: None,
        };
        for (&k, &v) in &seen {
            match k {
                "server" => {
                    check_server(v)?;
                    p.export.server = v.into();
                }
                "share" => {
                    check_share(v)?;
                    p.export.share = v.into();
                }
                "subDir" => {
                    if v.is_empty() {
                        return Err(invalid("parameter subDir: empty"));
                    }
                    p.sub_dir = v.into();
                }
                "mountOptions" => p.mount_options = parse_mount_options(v)?,
                "mountPermissions" => {
                    let mode = parse_u32(k, v.strip_prefix("0o").unwrap_or(v), 8)?;
                    if mode > 0o7777 {
                        return Err(invalid(format!("parameter mountPermissions: {v:?} is more than 07777")));
                    }
                    p.mode = mode;
                }
                "uid" => p.uid = parse_u32(k, v, 10)?,
                "gid" => p.gid = parse_u32(k, v, 10)?,
                "onDelete" => p.on_delete = OnDelete::parse(v)?,
                PVC_NAME => p.pvc_name = Some(v.into()),
                PVC_NAMESPACE => p.pvc_namespace = Some(v.into()),
                PV_NAME => p.pv_name = Some(v.into()),
                k if k.starts_with("csi.storage.k8s.io/") => {}
                k => return Err(invalid(format!("unknown parameter {k:?} (nfs takes: {})", PARAMETERS.join(", ")))),
            }
        }
        if p.export.server.is_empty() {
            return Err(invalid("parameter server is required"));
        }
        if p.export.share.is_empty() {
            return Err(invalid("parameter share is required"));
        }
        // Malformed templates fail at parse time, before any volume is asked for.
        template_vars(&p.sub_dir)?;
        Ok(p)
    }

    /// The `subDir` of volume `name`, rendered and checked.
    pub fn render_sub_dir(&self, name: &str) -> Result<String, Invalid> {
        let mut out = String::new();
        for piece in template_vars(&self.sub_dir)? {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(v) => {
                    let (value, param) = match v {
                        "pvc.name" => (self.pvc_name.as_deref(), PVC_NAME),
                        "pvc.namespace" => (self.pvc_namespace.as_deref(), PVC_NAMESPACE),
                        _ => (self.pv_name.as_deref().or(Some(name)), PV_NAME),
                    };
                    let value = value.ok_or_else(|| invalid(format!("parameter subDir: uses ${{{v}}} but {param} is not set")))?;
                    if value.is_empty() || value.contains('/') || value.contains('\0') || value == "." || value == ".." {
                        return Err(invalid(format!("parameter subDir: ${{{v}}} = {value:?} could escape the share")));
                    }
                    out.push_str(value);
                }
            }
        }
        check_sub_dir(&out)?;
        Ok(out)
    }
}

/// `a,b=c, d` → `["a", "b=c", "d"]`; empty items are malformed.
pub fn parse_mount_options(v: &str) -> Result<Vec<String>, Invalid> {
    let mut out = vec![];
    for o in v.split(',').map(str::trim) {
        if o.is_empty() || o.contains(char::is_whitespace) || o.contains('\0') {
            return Err(invalid(format!("parameter mountOptions: {v:?} has an empty or malformed option")));
        }
        out.push(o.to_string());
    }
    Ok(out)
}

#[derive(Debug, PartialEq, Eq)]
enum Piece<'a> {
    Text(&'a str),
    Var(&'a str),
}

/// Split a template into text and `${var}` pieces; unknown variables and stray `$` are errors.
fn template_vars(t: &str) -> Result<Vec<Piece<'_>>, Invalid> {
    let mut out = vec![];
    let mut rest = t;
    while let Some(i) = rest.find('$') {
        if i > 0 {
            out.push(Piece::Text(&rest[..i]));
        }
        let after = rest[i..].strip_prefix("${").ok_or_else(|| invalid(format!("parameter subDir: {t:?} has a '$' not starting ${{…}}")))?;
        let end = after.find('}').ok_or_else(|| invalid(format!("parameter subDir: {t:?} has an unclosed ${{")))?;
        // csi-driver-nfs spells them `pvc.metadata.name` etc.: its StorageClasses work unchanged.
        let var = match &after[..end] {
            "pvc.name" | "pvc.metadata.name" => "pvc.name",
            "pvc.namespace" | "pvc.metadata.namespace" => "pvc.namespace",
            "pv.name" | "pv.metadata.name" => "pv.name",
            var => {
                return Err(invalid(format!(
                    "parameter subDir: unknown variable ${{{var}}} (known: pvc.name, pvc.namespace, pv.name, and csi-driver-nfs's pvc.metadata.name, pvc.metadata.namespace, pv.metadata.name)"
                )));
            }
        };
        out.push(Piece::Var(var));
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest));
    }
    Ok(out)
}

/// Volume and snapshot ids: `SERVER_SHARE-COMPONENTS_NAME`, `_`-separated (none of the parts
/// contains `_`). Deterministic from the export and the name; the export is in the id because
/// the controller keeps no state of its own.
pub fn encode_id(e: &NfsExport, name: &str) -> Result<String, Invalid> {
    let mut id = encode_prefix(e);
    id.push_str(name);
    if id.len() > MAX_ID_BYTES {
        return Err(invalid(format!("volume id {id:?} would be {} bytes, more than {MAX_ID_BYTES}: use a shorter server, share or name", id.len())));
    }
    Ok(id)
}

/// The export and name of an id; `None` when it is not one of ours.
pub fn decode_id(id: &str) -> Option<(NfsExport, String)> {
    let parts: Vec<&str> = id.split('_').collect();
    if parts.len() < 2 || id.len() > MAX_ID_BYTES {
        return None;
    }
    let (server, name) = (parts[0], parts[parts.len() - 1]);
    let share = format!("/{}", parts[1..parts.len() - 1].join("/"));
    check_server(server).ok()?;
    check_share(&share).ok()?;
    is_local_name(name).then_some(())?;
    let export = NfsExport { server: server.into(), share };
    // Only the canonical spelling is ours (`h__v` would otherwise alias `h_v`).
    (encode_id(&export, name).ok()? == id).then(|| (export, name.into()))
}

/// Where `archive` moves `sub_dir`: `archived-<last component>` beside it.
pub fn archive_path(sub_dir: &str) -> String {
    match sub_dir.rsplit_once('/') {
        Some((parent, last)) => format!("{parent}/archived-{last}"),
        None => format!("archived-{sub_dir}"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn params(extra: &[(&str, &str)]) -> Result<Params, Invalid> {
        let mut all = vec![("server", "10.0.0.1"), ("share", "/export")];
        all.extend_from_slice(extra);
        Params::parse(all)
    }

    #[test]
    fn defaults_apply_when_only_server_and_share_are_given() {
        let p = params(&[]).unwrap();
        assert_eq!(p.export, NfsExport { server: "10.0.0.1".into(), share: "/export".into() });
        assert_eq!((p.mode, p.uid, p.gid, p.on_delete), (0o777, 0, 0, OnDelete::Delete));
        assert_eq!(p.render_sub_dir("pvc-1").unwrap(), "pvc-1");
    }

    #[test]
    fn csi_driver_nfs_template_spellings_render_the_same() {
        let kv = [("csi.storage.k8s.io/pvc/name", "data"), ("csi.storage.k8s.io/pvc/namespace", "team-a"), ("csi.storage.k8s.io/pv/name", "pv-1")];
        let ours = params(&[&[("subDir", "${pvc.namespace}/${pvc.name}/${pv.name}")][..], &kv[..]].concat()).unwrap();
        let theirs = params(&[&[("subDir", "${pvc.metadata.namespace}/${pvc.metadata.name}/${pv.metadata.name}")][..], &kv[..]].concat()).unwrap();
        assert_eq!(ours.render_sub_dir("x").unwrap(), "team-a/data/pv-1");
        assert_eq!(theirs.render_sub_dir("x").unwrap(), "team-a/data/pv-1");
    }

    #[test]
    fn every_parameter_parses() {
        let p = params(&[
            ("subDir", "${pvc.namespace}/${pvc.name}-x"),
            ("mountOptions", "nfsvers=4.1, hard,noatime"),
            ("mountPermissions", "2775"),
            ("uid", "1000"),
            ("gid", "2000"),
            ("onDelete", "archive"),
            ("csi.storage.k8s.io/pvc/name", "data"),
            ("csi.storage.k8s.io/pvc/namespace", "team-a"),
            ("csi.storage.k8s.io/pv/name", "pvc-123"),
            ("csi.storage.k8s.io/other", "ignored"),
        ])
        .unwrap();
        assert_eq!(p.mount_options, ["nfsvers=4.1", "hard", "noatime"]);
        assert_eq!((p.mode, p.uid, p.gid, p.on_delete), (0o2775, 1000, 2000, OnDelete::Archive));
        assert_eq!(p.render_sub_dir("ignored-name").unwrap(), "team-a/data-x");
        let pv = params(&[("csi.storage.k8s.io/pv/name", "pvc-123")]).unwrap();
        assert_eq!(pv.render_sub_dir("name").unwrap(), "pvc-123");
    }

    #[test]
    fn unknown_or_malformed_parameters_name_the_parameter() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("colour", "red")], "colour"),
            (&[("mountPermissions", "999")], "mountPermissions"),
            (&[("mountPermissions", "77777")], "mountPermissions"),
            (&[("uid", "-1")], "uid"),
            (&[("gid", "x")], "gid"),
            (&[("onDelete", "shred")], "onDelete"),
            (&[("mountOptions", "a,,b")], "mountOptions"),
            (&[("subDir", "${pvc.uid}")], "subDir"),
            (&[("subDir", "$x")], "subDir"),
            (&[("subDir", "${pv.name")], "subDir"),
            (&[("subDir", "")], "subDir"),
        ];
        for (extra, name) in cases {
            let e = params(extra).unwrap_err();
            assert!(e.0.contains(name), "{extra:?}: {e:?}");
        }
        for (k, v) in [("server", ""), ("server", "a_b"), ("share", "export"), ("share", "/a/../b"), ("share", "/a b"), ("share", "/a_b")] {
            let e = Params::parse([(k, v), (if k == "server" { "share" } else { "server" }, if k == "server" { "/e" } else { "h" })]).unwrap_err();
            assert!(e.0.contains(k), "{k}={v}: {e:?}");
        }
        assert!(Params::parse([("share", "/e")]).unwrap_err().0.contains("server"));
        assert!(Params::parse([("server", "h")]).unwrap_err().0.contains("share"));
    }

    #[test]
    fn templates_that_could_escape_are_rejected() {
        let long = "a".repeat(256);
        for (tpl, vars) in [
            ("../x", vec![]),
            ("a/../../x", vec![]),
            ("/abs", vec![]),
            ("a//b", vec![]),
            (".wasmcsi/x", vec![]),
            (".snapshots", vec![]),
            ("${pvc.name}", vec![("csi.storage.k8s.io/pvc/name", "..")]),
            ("${pvc.name}", vec![("csi.storage.k8s.io/pvc/name", "a/b")]),
            ("${pvc.name}", vec![("csi.storage.k8s.io/pvc/name", "a\0b")]),
            ("${pvc.name}", vec![("csi.storage.k8s.io/pvc/name", long.as_str())]),
            ("${pvc.namespace}", vec![]),
        ] {
            let mut extra = vec![("subDir", tpl)];
            extra.extend(vars);
            let r = params(&extra).and_then(|p| p.render_sub_dir("pvc-1"));
            assert!(r.as_ref().is_err_and(|e| e.0.contains("subDir")), "{tpl:?}: {r:?}");
        }
        assert!(check_component("c", &"a".repeat(255)).is_ok());
    }

    #[test]
    fn names_are_checked() {
        let long = "a".repeat(96);
        for bad in ["", ".x", "-x", "a/b", "a_b", "a\0", long.as_str()] {
            assert!(!is_local_name(bad), "{bad:?}");
        }
        assert!(is_local_name("pvc-0b9a1c2d-1234-5678-9abc-def012345678"));
    }

    #[test]
    fn any_csi_name_has_a_local_name_that_fits_the_id() {
        let e = NfsExport { server: "nfs.example.com".into(), share: "/srv/exports".into() };
        assert_eq!(local_name(&e, "volume", "pvc-1").unwrap(), "pvc-1", "a plain name is its own");
        let long = format!("{}✓", "ü".repeat(62));
        for name in ["a_b", ".x", "-x", "a/b", "../..", "Données ✓ 中文", "tab\there", long.as_str(), &"n".repeat(128)] {
            let local = local_name(&e, "volume", name).unwrap();
            assert!(is_local_name(&local) && local != name, "{name:?} -> {local:?}");
            let id = encode_id(&e, &local).unwrap();
            assert!(id.len() <= MAX_ID_BYTES, "{name:?} -> {id}");
            assert_eq!(decode_id(&id), Some((e.clone(), local.clone())), "{name:?}");
            assert_eq!(local_name(&e, "volume", name).unwrap(), local, "deterministic");
        }
        for bad in ["", "nul\0", "esc\u{1b}", &"n".repeat(129)] {
            assert!(local_name(&e, "volume", bad).is_err(), "{bad:?}");
        }
        let no_room = NfsExport { server: "a".repeat(64), share: format!("/{}", "b".repeat(20)) };
        assert!(local_name(&no_room, "volume", "x y").is_err(), "an export whose ids leave no room for a hash");
    }

    #[test]
    fn ids_round_trip_and_foreign_ids_do_not_parse() {
        let e = NfsExport { server: "nfs.example.com".into(), share: "/srv/exports".into() };
        let id = encode_id(&e, "pvc-1").unwrap();
        assert_eq!(id, "nfs.example.com_srv_exports_pvc-1");
        assert_eq!(decode_id(&id), Some((e, "pvc-1".into())));
        let root = NfsExport { server: "h".into(), share: "/".into() };
        assert_eq!(decode_id(&encode_id(&root, "v").unwrap()), Some((root, "v".into())));
        let long = format!("h_{}", "a".repeat(95));
        for foreign in ["", "plain", "h_..", "h_a_.x", "h__v", long.as_str()] {
            assert_eq!(decode_id(foreign), None, "{foreign:?}");
        }
        let long = NfsExport { server: "a".repeat(60), share: "/export".into() };
        assert!(encode_id(&long, &"n".repeat(40)).is_err());
    }

    #[test]
    fn archive_renames_the_last_component() {
        assert_eq!(archive_path("pvc-1"), "archived-pvc-1");
        assert_eq!(archive_path("ns/data"), "ns/archived-data");
    }
}
