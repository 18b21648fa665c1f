//! hostpath: the example backend to copy. A volume is a directory under a root the operator
//! grants (`dir` capability); a snapshot is a copy of that directory; the node bind-mounts it.
//! Truth lives beside the data: `meta/NAME` records size and source, written last, so a retry
//! after any crash finds either nothing or a whole volume. No process-local state.
#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code, reason = "wit-bindgen expands to unsafe glue")]
mod bindings {
    wit_bindgen::generate!({ path: "../../wit", world: "backend" });
}
use bindings::exports::wasmcsi::backend::driver::*;
use bindings::wasmcsi::backend::types::{AccessMode, AccessType, Pair};
use bindings::wasmcsi::backend::{dir, log};
#[cfg(not(target_arch = "wasm32"))]
use wasmcsi_runtime::native::guest_bindings as bindings;

const GIB: u64 = 1 << 30;
/// The backend (natively: `wasmcsi_runtime::native::NativeDriver::of::<HostPath>()`).
pub struct HostPath;
#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code, reason = "export! expands to the unsafe canonical-ABI entry points")]
mod export {
    use super::HostPath;
    crate::bindings::export!(HostPath with_types_in crate::bindings);
}

fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}
/// Names become path components: keep them to a safe alphabet so nothing escapes the root.
fn check_name(n: &str) -> Result<(), Error> {
    let ok = !n.is_empty() && n.len() <= 80 && !n.starts_with('.') && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if ok { Ok(()) } else { Err(bad(format!("name {n:?} must be 1-80 of [A-Za-z0-9._-], not starting with '.'"))) }
}
/// Local ids are `ROOT.NAME`; root names never contain '.'.
fn split_id(id: &str) -> Result<(String, String), Error> {
    let (root, name) = id.split_once('.').ok_or_else(|| Error::NotFound(format!("volume {id} is not a hostpath id")))?;
    check_name(name).map_err(|_| Error::NotFound(format!("volume {id} is not a hostpath id")))?;
    Ok((root.into(), name.into()))
}
/// A directory lives on one node and is no block device.
fn check_caps(caps: &[VolumeCapability]) -> Result<(), Error> {
    use AccessMode::*;
    for c in caps {
        if matches!(c.access_type, AccessType::Block) {
            return Err(bad("hostpath serves filesystem volumes only, not block"));
        }
        if !matches!(c.access_mode, SingleNodeWriter | SingleNodeReaderOnly | SingleNodeSingleWriter | SingleNodeMultiWriter) {
            return Err(bad("hostpath volumes live on one node: only single-node access modes"));
        }
    }
    Ok(())
}
fn root_param(params: &[Pair]) -> Result<String, Error> {
    let mut root = dir::roots().into_iter().next().ok_or_else(|| Error::FailedPrecondition("no dir root granted".into()))?;
    for p in params {
        match p.key.as_str() {
            "root" if dir::roots().contains(&p.value) => root = p.value.clone(),
            "root" => return Err(bad(format!("parameter root: {:?} is not a granted root", p.value))),
            k if k.starts_with("csi.storage.k8s.io/") => {}
            k => return Err(bad(format!("unknown parameter {k:?} (hostpath takes: root)"))),
        }
    }
    Ok(root)
}
/// Metadata file: `capacity=N` and `source=ID` lines.
fn read_meta(root: &str, path: &str) -> Result<Option<(u64, String)>, Error> {
    if dir::stat(root, path)?.is_none() {
        return Ok(None);
    }
    let text = String::from_utf8(dir::read_file(root, path)?).map_err(|_| Error::Internal(format!("{path}: not utf-8")))?;
    let field = |k: &str| text.lines().find_map(|l| l.strip_prefix(k)).unwrap_or_default().to_string();
    let cap = field("capacity=").parse().map_err(|_| Error::Internal(format!("{path}: bad capacity")))?;
    Ok(Some((cap, field("source="))))
}
fn write_meta(root: &str, path: &str, cap: u64, source: &str) -> Result<(), Error> {
    dir::write_file(root, path, format!("capacity={cap}\nsource={source}\n").as_bytes())
}
fn volume(root: &str, name: &str, cap: u64) -> Volume {
    Volume { volume_id: format!("{root}.{name}"), capacity_bytes: cap, volume_context: vec![], content_source: None, accessible_topology: vec![] }
}
fn snapshot(root: &str, name: &str) -> Result<Option<Snapshot>, Error> {
    let Some((size, source)) = read_meta(root, &format!("snapmeta/{name}"))? else { return Ok(None) };
    let created = dir::stat(root, &format!("snapmeta/{name}"))?
        .map(|s| s.modified)
        .unwrap_or(bindings::wasmcsi::backend::types::Timestamp { seconds: 0, nanos: 0 });
    Ok(Some(Snapshot {
        snapshot_id: format!("{root}.{name}"),
        source_volume_id: source,
        size_bytes: size,
        creation_time: created,
        ready_to_use: true,
    }))
}
/// Offset-token paging over a sorted directory listing.
fn page<T>(names: Vec<String>, max: u32, token: &str, f: impl Fn(&str) -> Result<Option<T>, Error>) -> Result<(Vec<T>, String), Error> {
    let start: usize = if token.is_empty() { 0 } else { token.parse().map_err(|_| Error::Aborted(format!("invalid starting token {token:?}")))? };
    if start > names.len() {
        return Err(Error::Aborted(format!("starting token {token} is past the end")));
    }
    let end = if max == 0 { names.len() } else { names.len().min(start + max as usize) };
    let entries = names[start..end].iter().map(|n| f(n)).collect::<Result<Vec<_>, _>>()?.into_iter().flatten().collect();
    Ok((entries, if end < names.len() { end.to_string() } else { String::new() }))
}

impl Guest for HostPath {
    fn info() -> BackendInfo {
        use Feature::*;
        BackendInfo {
            name: "hostpath".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            parameters: vec!["root".into()],
            features: vec![
                CreateDeleteVolume,
                CreateDeleteSnapshot,
                ListSnapshots,
                CloneVolume,
                ExpandVolume,
                OnlineExpansion,
                GetCapacity,
                ListVolumes,
                GetVolume,
                VolumeCondition,
                SingleNodeMultiWriter,
            ],
        }
    }
    fn create_volume(req: CreateVolumeRequest) -> Result<Volume, Error> {
        check_name(&req.name)?;
        let root = root_param(&req.parameters)?;
        check_caps(&req.capabilities)?;
        let (req_b, lim) = (req.capacity.required_bytes, req.capacity.limit_bytes);
        let cap = if req_b == 0 { if lim != 0 && lim < GIB { lim } else { GIB } } else { req_b };
        if lim != 0 && cap > lim {
            return Err(Error::OutOfRange(format!("required {req_b} exceeds limit {lim}")));
        }
        let source = match &req.content_source {
            Some(ContentSource::Snapshot(id)) => {
                let (r, n) = split_id(id)?;
                (r, format!("snapshots/{n}"), id.clone())
            }
            Some(ContentSource::Volume(id)) => {
                let (r, n) = split_id(id)?;
                (r, format!("volumes/{n}"), id.clone())
            }
            None => (root.clone(), String::new(), String::new()),
        };
        let (meta, data) = (format!("meta/{}", req.name), format!("volumes/{}", req.name));
        if let Some((have, src)) = read_meta(&root, &meta)? {
            if have < req_b || (lim != 0 && have > lim) || src != source.2 {
                return Err(Error::AlreadyExists(format!("volume {} exists with {have} bytes from {src:?}", req.name)));
            }
            return Ok(Volume { content_source: req.content_source, ..volume(&root, &req.name, have) });
        }
        dir::mkdir(&root, "meta", 0o700)?;
        if source.2.is_empty() {
            dir::mkdir(&root, &data, 0o777)?;
        } else {
            if source.0 != root {
                return Err(bad("content source lives under another root"));
            }
            if dir::stat(&root, &source.1)?.is_none() {
                return Err(Error::NotFound(format!("content source {} not found", source.2)));
            }
            dir::remove_all(&root, &data)?; // a half-finished copy from an earlier attempt
            dir::copy_tree(&root, &source.1, &data)?;
        }
        write_meta(&root, &meta, cap, &source.2)?;
        log::log(log::Level::Info, "volume created", &[("volume".into(), req.name.clone()), ("bytes".into(), cap.to_string())]);
        Ok(Volume { content_source: req.content_source, ..volume(&root, &req.name, cap) })
    }
    fn delete_volume(id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        let Ok((root, name)) = split_id(&id) else { return Ok(()) };
        dir::remove_all(&root, &format!("volumes/{name}"))?;
        dir::remove_all(&root, &format!("meta/{name}"))
    }
    fn expand_volume(id: String, cap: CapacityRange, _: Option<VolumeCapability>, _: Vec<SecretRef>) -> Result<Expansion, Error> {
        let (root, name) = split_id(&id)?;
        let (have, src) = read_meta(&root, &format!("meta/{name}"))?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
        if cap.limit_bytes != 0 && cap.required_bytes > cap.limit_bytes {
            return Err(Error::OutOfRange("required exceeds limit".into()));
        }
        let new = have.max(cap.required_bytes);
        if new != have {
            write_meta(&root, &format!("meta/{name}"), new, &src)?;
        }
        Ok(Expansion { capacity_bytes: new, node_expansion_required: false })
    }
    fn get_volume(id: String) -> Result<VolumeStatus, Error> {
        let (root, name) = split_id(&id)?;
        let (cap, _) = read_meta(&root, &format!("meta/{name}"))?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
        let used = dir::usage(&root, &format!("volumes/{name}"))?;
        let message = if used > cap { format!("uses {used} bytes of {cap}") } else { "healthy".into() };
        Ok(VolumeStatus { volume: volume(&root, &name, cap), condition: Some(VolumeCondition { abnormal: used > cap, message }) })
    }
    fn list_volumes(max: u32, token: String) -> Result<VolumePage, Error> {
        let mut names = vec![];
        for root in dir::roots() {
            if dir::stat(&root, "meta")?.is_some() {
                names.extend(dir::read_dir(&root, "meta")?.into_iter().map(|n| format!("{root}.{n}")));
            }
        }
        let (entries, next_token) = page(names, max, &token, |id| Self::get_volume(id.into()).map(Some))?;
        Ok(VolumePage { entries, next_token })
    }
    fn validate_volume_capabilities(id: String, _: Vec<Pair>, caps: Vec<VolumeCapability>, params: Vec<Pair>) -> Result<Option<String>, Error> {
        Self::get_volume(id.clone())?;
        Ok(root_param(&params).and(check_caps(&caps)).err().map(|e| format!("{e:?}")))
    }
    fn create_snapshot(name: String, source: String, _: Vec<Pair>, _: Vec<SecretRef>) -> Result<Snapshot, Error> {
        check_name(&name)?;
        let (root, vol) = split_id(&source)?;
        if let Some(s) = snapshot(&root, &name)? {
            return if s.source_volume_id == source {
                Ok(s)
            } else {
                Err(Error::AlreadyExists(format!("snapshot {name} exists for {}", s.source_volume_id)))
            };
        }
        let (cap, _) = read_meta(&root, &format!("meta/{vol}"))?.ok_or_else(|| Error::NotFound(format!("volume {source} not found")))?;
        dir::mkdir(&root, "snapmeta", 0o700)?;
        dir::remove_all(&root, &format!("snapshots/{name}"))?;
        dir::mkdir(&root, "snapshots", 0o700)?;
        dir::copy_tree(&root, &format!("volumes/{vol}"), &format!("snapshots/{name}"))?;
        write_meta(&root, &format!("snapmeta/{name}"), cap, &source)?;
        snapshot(&root, &name)?.ok_or_else(|| Error::Internal("snapshot vanished".into()))
    }
    fn delete_snapshot(id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        let Ok((root, name)) = split_id(&id) else { return Ok(()) };
        dir::remove_all(&root, &format!("snapmeta/{name}"))?;
        dir::remove_all(&root, &format!("snapshots/{name}"))
    }
    fn list_snapshots(snap: Option<String>, vol: Option<String>, max: u32, token: String) -> Result<SnapshotPage, Error> {
        let mut ids = vec![];
        for root in dir::roots() {
            if dir::stat(&root, "snapmeta")?.is_some() {
                ids.extend(dir::read_dir(&root, "snapmeta")?.into_iter().map(|n| format!("{root}.{n}")));
            }
        }
        ids.retain(|id| snap.as_ref().is_none_or(|s| s == id));
        let all: Vec<Snapshot> = ids
            .iter()
            .filter_map(|id| split_id(id).ok())
            .map(|(r, n)| snapshot(&r, &n))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .flatten()
            .filter(|s| vol.as_ref().is_none_or(|v| v == &s.source_volume_id))
            .collect();
        let ids = all.iter().map(|s| s.snapshot_id.clone()).collect();
        let (entries, next_token) = page(ids, max, &token, |id| Ok(all.iter().find(|s| s.snapshot_id == id).cloned()))?;
        Ok(SnapshotPage { entries, next_token })
    }
    fn get_capacity(_: Vec<VolumeCapability>, params: Vec<Pair>, _: Option<Topology>) -> Result<Capacity, Error> {
        let s = dir::fs_stats(&root_param(&params)?)?;
        Ok(Capacity { available_bytes: s.available_bytes, maximum_volume_bytes: s.available_bytes, minimum_volume_bytes: 0 })
    }
    fn attach_plan(id: String, _: Vec<Pair>, cap: VolumeCapability) -> Result<Attachment, Error> {
        let (root, name) = split_id(&id)?;
        if matches!(cap.access_type, AccessType::Block) {
            return Err(Error::FailedPrecondition("hostpath volumes are directories, not block devices".into()));
        }
        let (capacity_bytes, _) = read_meta(&root, &format!("meta/{name}"))?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
        Ok(Attachment::Bind(BindPlan { root, path: format!("volumes/{name}"), capacity_bytes }))
    }
    fn get_snapshot(id: String) -> Result<Snapshot, Error> {
        let page = Self::list_snapshots(Some(id.clone()), None, 1, String::new())?;
        page.entries.into_iter().next().ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))
    }
    fn reconcile_volume(_: String) -> Result<(), Error> {
        // Nothing to repair: the backend does not advertise self-healing.
        Ok(())
    }
}
