//! hostpath: the example backend to copy. A volume is a directory under a root the operator
//! grants (`dir` capability); a snapshot is a copy of that directory; the node bind-mounts it.
//! Truth lives beside the data: `meta/NAME` records size and source, written last, so a retry
//! after any crash finds either nothing or a whole volume. No process-local state.
//!
//! The shape of every backend: a type implementing [`Backend`] over any [`Host`] (the
//! component's imports, or the SDK's fake in `tests.rs`), and `export!` at the end.
use wasmcsi_backend_sdk::prelude::*;

/// The backend.
pub struct HostPath;
type Res<T> = Result<T, Error>;

fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}
fn not_found(what: &str) -> Error {
    Error::NotFound(format!("{what} not found"))
}
/// The file name of a volume or snapshot under `root`: any CSI name (1-128 bytes of almost any
/// Unicode) becomes a safe path component that keeps `ROOT.FILE` within the 95-byte id. A plain
/// name (`pvc-…`) is its own file name, as before names were mapped; any other is a readable
/// part plus a hash of the whole name, the same on every call (see [`stable_name`]).
fn file_name(what: &str, root: &str, name: &str) -> Res<String> {
    check_csi_name(what, name)?;
    Ok(stable_name(name, MAX_ID_BYTES.saturating_sub(root.len() + 1), is_id_byte))
}
/// What [`file_name`] makes: `[A-Za-z0-9._-]`, not starting with '.' (nothing hidden, no `..`).
fn is_file_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= MAX_ID_BYTES && !n.starts_with('.') && n.bytes().all(is_id_byte)
}
/// Local ids are `ROOT.FILE`; root names never contain '.'.
fn split_id(id: &str) -> Res<(String, String)> {
    let parts = id.split_once('.').filter(|(_, name)| is_file_name(name));
    parts.map(|(r, n)| (r.into(), n.into())).ok_or_else(|| Error::NotFound(format!("volume {id} is not a hostpath id")))
}
/// A directory lives on one node and is no block device.
fn check_caps(caps: &[VolumeCapability]) -> Res<()> {
    match caps.iter().find(|c| c.is_block() || !c.access_mode.is_single_node()) {
        Some(c) if c.is_block() => Err(bad("hostpath serves filesystem volumes only, not block")),
        Some(_) => Err(bad("hostpath volumes live on one node: only single-node access modes")),
        None => Ok(()),
    }
}
fn root_param(h: &impl Host, params: &[Pair]) -> Res<String> {
    let roots = h.dir().roots();
    let mut root = roots.first().cloned().ok_or_else(|| Error::FailedPrecondition("no dir root granted".into()))?;
    for p in params.iter().filter(|p| !p.key.starts_with("csi.storage.k8s.io/")) {
        match p.key.as_str() {
            "root" if roots.contains(&p.value) => root = p.value.clone(),
            "root" => return Err(bad(format!("parameter root: {:?} is not a granted root", p.value))),
            k => return Err(bad(format!("unknown parameter {k:?} (hostpath takes: root)"))),
        }
    }
    Ok(root)
}
/// A metadata file (`capacity`, `source`): `meta/NAME` of a volume, `snapmeta/NAME` of a snapshot.
fn read_meta(h: &impl Host, root: &str, path: &str) -> Res<Option<(u64, String)>> {
    let Some(bytes) = h.dir().try_read_file(root, path)? else { return Ok(None) };
    let meta = Meta::decode(&bytes).context(path)?;
    Ok(Some((meta.u64("capacity").context(path)?, meta.get("source").into())))
}
fn write_meta(h: &impl Host, root: &str, path: &str, cap: u64, source: &str) -> Res<()> {
    h.dir().write_file(root, path, &Meta::default().set("capacity", cap).set("source", source).encode())
}
/// Root, name, capacity and source of a volume that exists.
fn find(h: &impl Host, id: &str) -> Res<(String, String, u64, String)> {
    let (root, name) = split_id(id)?;
    let (cap, source) = read_meta(h, &root, &format!("meta/{name}"))?.ok_or_else(|| not_found(&format!("volume {id}")))?;
    Ok((root, name, cap, source))
}
fn snapshot(h: &impl Host, root: &str, name: &str) -> Res<Option<Snapshot>> {
    let path = format!("snapmeta/{name}");
    let Some((size_bytes, source_volume_id)) = read_meta(h, root, &path)? else { return Ok(None) };
    let creation_time = h.dir().stat(root, &path)?.map_or(Timestamp { seconds: 0, nanos: 0 }, |s| s.modified);
    Ok(Some(Snapshot { snapshot_id: format!("{root}.{name}"), source_volume_id, size_bytes, creation_time, ready_to_use: true }))
}
/// `ROOT.NAME` of every entry of `dir` in every root.
fn ids_in(h: &impl Host, dir: &str) -> Res<Vec<String>> {
    let mut ids = vec![];
    for root in h.dir().roots() {
        ids.extend(h.dir().try_read_dir(&root, dir)?.unwrap_or_default().into_iter().map(|n| format!("{root}.{n}")));
    }
    Ok(ids)
}

impl Backend for HostPath {
    fn info() -> BackendInfo {
        use Feature::*;
        let features = vec![CreateDeleteVolume, CreateDeleteSnapshot, ListSnapshots, CloneVolume, ExpandVolume, OnlineExpansion, GetCapacity];
        let features = [features, vec![ListVolumes, GetVolume, VolumeCondition, SingleNodeMultiWriter, GetSnapshot]].concat();
        BackendInfo { name: "hostpath".into(), version: env!("CARGO_PKG_VERSION").into(), parameters: vec!["root".into()], features }
    }
    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Res<Volume> {
        check_csi_name("volume", &req.name)?;
        let root = root_param(h, &req.parameters)?;
        let file = file_name("volume", &root, &req.name)?;
        check_caps(&req.capabilities)?;
        let (required, limit) = (req.capacity.required_bytes, req.capacity.limit_bytes);
        let cap = Sizing::DEFAULT.resolve(required, limit)?;
        let (source, from) = match &req.content_source {
            Some(ContentSource::Snapshot(id)) => (id.as_str(), Some(split_id(id).map(|(r, n)| (r, format!("snapshots/{n}")))?)),
            Some(ContentSource::Volume(id)) => (id.as_str(), Some(split_id(id).map(|(r, n)| (r, format!("volumes/{n}")))?)),
            None => ("", None),
        };
        let (meta, data) = (format!("meta/{file}"), format!("volumes/{file}"));
        let volume = |cap| Volume { content_source: req.content_source.clone(), ..Volume::new(format!("{root}.{file}"), cap) };
        if let Some((have, src)) = read_meta(h, &root, &meta)? {
            if have < required || (limit != 0 && have > limit) || src != source {
                return Err(Error::AlreadyExists(format!("volume {} exists with {have} bytes from {src:?}", req.name)));
            }
            return Ok(volume(have));
        }
        // A new directory can never hold more than its filesystem: refuse, do not promise 8 EiB.
        let total = h.dir().fs_stats(&root)?.total_bytes;
        if cap > total {
            return Err(Error::OutOfRange(format!("{cap} bytes asked; the filesystem of root {root} has {total}")));
        }
        h.dir().mkdir(&root, "meta", 0o700)?;
        match from {
            None => h.dir().mkdir(&root, &data, 0o777)?,
            Some((from_root, _)) if from_root != root => return Err(bad("content source lives under another root")),
            Some((_, path)) if h.dir().stat(&root, &path)?.is_none() => return Err(not_found(&format!("content source {source}"))),
            Some((_, path)) => {
                h.dir().remove_all(&root, &data)?; // a half-finished copy from an earlier attempt
                h.dir().copy_tree(&root, &path, &data)?;
            }
        }
        write_meta(h, &root, &meta, cap, source)?;
        h.log().info("volume created", &[("volume", &req.name), ("bytes", &cap.to_string())]);
        Ok(volume(cap))
    }
    fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Res<()> {
        // An id that is not ours, or of a root this host does not grant, names no volume here.
        let Ok((root, name)) = split_id(&id) else { return Ok(()) };
        if !h.dir().roots().contains(&root) {
            return Ok(());
        }
        h.dir().remove_all(&root, &format!("volumes/{name}"))?;
        h.dir().remove_all(&root, &format!("meta/{name}"))
    }
    fn expand_volume(h: &impl Host, id: String, cap: CapacityRange, _: Option<VolumeCapability>, _: Vec<SecretRef>) -> Res<Expansion> {
        let (root, name, have, source) = find(h, &id)?;
        let new = grow(have, &cap)?;
        if new != have {
            write_meta(h, &root, &format!("meta/{name}"), new, &source)?;
        }
        Ok(Expansion { capacity_bytes: new, node_expansion_required: false })
    }
    fn get_volume(h: &impl Host, id: String) -> Res<VolumeStatus> {
        let (root, name, cap, _) = find(h, &id)?;
        let used = h.dir().usage(&root, &format!("volumes/{name}"))?;
        let message = if used > cap { format!("uses {used} bytes of {cap}") } else { "healthy".into() };
        Ok(VolumeStatus { volume: Volume::new(id, cap), condition: Some(VolumeCondition { abnormal: used > cap, message }) })
    }
    fn list_volumes(h: &impl Host, max: u32, token: String) -> Res<VolumePage> {
        let (ids, next_token) = page(ids_in(h, "meta")?, max, &token)?;
        Ok(VolumePage { entries: ids.into_iter().map(|id| Self::get_volume(h, id)).collect::<Res<_>>()?, next_token })
    }
    fn validate_volume_capabilities(h: &impl Host, id: String, _: Vec<Pair>, caps: Vec<VolumeCapability>, p: Vec<Pair>) -> Res<Option<String>> {
        Self::get_volume(h, id)?;
        Ok(root_param(h, &p).and(check_caps(&caps)).err().map(|e| format!("{e:?}")))
    }
    fn create_snapshot(h: &impl Host, name: String, source: String, _: Vec<Pair>, _: Vec<SecretRef>) -> Res<Snapshot> {
        check_csi_name("snapshot", &name)?;
        let (root, vol) = split_id(&source)?;
        let name = file_name("snapshot", &root, &name)?;
        match snapshot(h, &root, &name)? {
            Some(s) if s.source_volume_id == source => return Ok(s),
            Some(s) => return Err(Error::AlreadyExists(format!("snapshot {name} exists for {}", s.source_volume_id))),
            None => {}
        }
        let (_, _, cap, _) = find(h, &source)?;
        h.dir().mkdir(&root, "snapmeta", 0o700)?;
        h.dir().remove_all(&root, &format!("snapshots/{name}"))?;
        h.dir().mkdir(&root, "snapshots", 0o700)?;
        h.dir().copy_tree(&root, &format!("volumes/{vol}"), &format!("snapshots/{name}"))?;
        write_meta(h, &root, &format!("snapmeta/{name}"), cap, &source)?;
        snapshot(h, &root, &name)?.ok_or_else(|| Error::Internal("snapshot vanished".into()))
    }
    fn delete_snapshot(h: &impl Host, id: String, _: Vec<SecretRef>) -> Res<()> {
        // An id that is not ours, or of a root this host does not grant, names no volume here.
        let Ok((root, name)) = split_id(&id) else { return Ok(()) };
        if !h.dir().roots().contains(&root) {
            return Ok(());
        }
        h.dir().remove_all(&root, &format!("snapmeta/{name}"))?;
        h.dir().remove_all(&root, &format!("snapshots/{name}"))
    }
    fn list_snapshots(h: &impl Host, snap: Option<String>, vol: Option<String>, max: u32, token: String) -> Res<SnapshotPage> {
        let mut all = vec![];
        for (root, name) in ids_in(h, "snapmeta")?.iter().filter(|id| snap.as_ref().is_none_or(|s| s == *id)).filter_map(|id| split_id(id).ok()) {
            all.extend(snapshot(h, &root, &name)?.filter(|s| vol.as_ref().is_none_or(|v| v == &s.source_volume_id)));
        }
        let (entries, next_token) = page(all, max, &token)?;
        Ok(SnapshotPage { entries, next_token })
    }
    fn get_capacity(h: &impl Host, _: Vec<VolumeCapability>, params: Vec<Pair>, _: Option<Topology>) -> Res<Capacity> {
        let s = h.dir().fs_stats(&root_param(h, &params)?)?;
        Ok(Capacity { available_bytes: s.available_bytes, maximum_volume_bytes: s.available_bytes, minimum_volume_bytes: 0 })
    }
    fn attach_plan(h: &impl Host, id: String, _: Vec<Pair>, cap: VolumeCapability, _: Vec<SecretRef>) -> Res<Attachment> {
        split_id(&id)?;
        if cap.is_block() {
            return Err(Error::FailedPrecondition("hostpath volumes are directories, not block devices".into()));
        }
        let (root, name, capacity_bytes, _) = find(h, &id)?;
        Ok(Attachment::Bind(BindPlan { root, path: format!("volumes/{name}"), capacity_bytes }))
    }
    fn get_snapshot(h: &impl Host, id: String) -> Result<Snapshot, Error> {
        let page = Self::list_snapshots(h, Some(id.clone()), None, 1, String::new())?;
        page.entries.into_iter().next().ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))
    }
}

wasmcsi_backend_sdk::export!(HostPath);

#[cfg(test)]
mod tests;
