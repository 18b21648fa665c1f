//! The `nfs` backend: a volume is a subdirectory of an NFS export, driven through the host's
//! userspace NFS client (`wasmcsi:backend/nfs`), so the controller needs no privileged mount.
//!
//! Where the truth lives (the controller keeps none of its own):
//! - `SUBDIR/.wasmcsi-volume`: the volume's metadata (name, size, source, subDir, mount options,
//!   onDelete), written atomically with `write-file`.
//! - `.wasmcsi/volumes/NAME`: the index from the name to its subDir (the subDir comes from a
//!   template, the id only from the name), written last: it is the commit point of a create, so
//!   a retry after any crash finds either nothing or a whole volume.
//! - `.snapshots/NAME/data` (a server-side `copy-tree` of the volume) and `.snapshots/NAME/meta`
//!   (written last). Snapshots are independent copies: a volume with snapshots can be deleted.
//!
//! NAME is the CSI name's local name ([`policy::local_name`]): the name itself when it is plain
//! (`pvc-…`), else a readable part plus a hash of it, so any CSI name fits a file name and the
//! id; the metadata keeps the CSI name.
//! - kv `exports/SERVER_SHARE`: the exports volumes were created on, so an unfiltered
//!   ListSnapshots knows where to look (the `nfs` capability does not list its grants).
//!
//! Ids are `SERVER_SHARE-COMPONENTS_NAME` (see [`policy::encode_id`]). What this crate does
//! not do: mount anything (the node executes the `nfs` attach plan) or enforce sizes (the
//! recorded size is reported against usage as the volume condition).
pub mod policy;
#[cfg(test)]
mod tests;

use policy::{Invalid, NfsExport, OnDelete, Params};
use wasmcsi_backend_sdk::prelude::*;
use wasmcsi_backend_sdk::targets::KnownTargets;

/// The backend.
pub struct Nfs;

/// The exports volumes were ever created on (the `nfs` capability does not list its grants),
/// each keyed by the id a volume `x` on it would have (decoded with [`policy::decode_id`]).
const EXPORTS: KnownTargets = KnownTargets::new("exports/");

fn bad(e: Invalid) -> Error {
    Error::InvalidArgument(e.0)
}
fn internal(what: &str) -> impl Fn(Invalid) -> Error + '_ {
    move |e| Error::Internal(format!("{what}: {}", e.0))
}
/// Sizes: the request's, 1 GiB by default; any byte count (nothing rounds a directory).
const SIZING: Sizing = Sizing::DEFAULT;
fn params(pairs: &[Pair]) -> Result<Params, Error> {
    Params::parse(pairs.iter().map(|p| (p.key.as_str(), p.value.as_str()))).map_err(bad)
}
fn not_ours(id: &str) -> Error {
    Error::NotFound(format!("{id} is not an nfs volume or snapshot id"))
}
fn index_path(name: &str) -> String {
    format!("{}/{name}", policy::INDEX_DIR)
}
fn meta_path(sub_dir: &str) -> String {
    format!("{sub_dir}/{}", policy::VOLUME_META)
}
fn snap_dir(name: &str) -> String {
    format!("{}/{name}", policy::SNAPSHOT_DIR)
}
/// The exports volumes were ever created on, decoded from their [`EXPORTS`] keys.
fn known_exports(h: &impl Host) -> Result<Vec<NfsExport>, Error> {
    Ok(EXPORTS.list(h.kv())?.iter().filter_map(|k| policy::decode_id(k)).map(|(e, _)| e).collect())
}

/// One volume as found on the export.
struct Found {
    export: NfsExport,
    name: String,
    sub_dir: String,
    meta: Meta,
}

impl Found {
    fn capacity(&self) -> Result<u64, Error> {
        self.meta.u64("capacity").context(&self.sub_dir)
    }
    fn volume(&self) -> Result<Volume, Error> {
        let context = [
            ("server", self.export.server.as_str()),
            ("share", &self.export.share),
            ("subDir", &self.sub_dir),
            ("mountOptions", self.meta.get("mountOptions")),
        ];
        Ok(Volume {
            volume_id: policy::encode_id(&self.export, &self.name).map_err(bad)?,
            capacity_bytes: self.capacity()?,
            volume_context: context.iter().map(|(k, v)| Pair { key: (*k).into(), value: (*v).into() }).collect(),
            content_source: content_source(self.meta.get("source")),
            accessible_topology: vec![],
        })
    }
}

fn content_source(s: &str) -> Option<ContentSource> {
    if let Some(id) = s.strip_prefix("snapshot:") {
        Some(ContentSource::Snapshot(id.into()))
    } else {
        s.strip_prefix("volume:").map(|id| ContentSource::Volume(id.into()))
    }
}
fn source_key(s: &Option<ContentSource>) -> String {
    match s {
        Some(ContentSource::Snapshot(id)) => format!("snapshot:{id}"),
        Some(ContentSource::Volume(id)) => format!("volume:{id}"),
        None => String::new(),
    }
}

fn read_meta(h: &impl Host, e: &NfsExport, path: &str) -> Result<Option<Meta>, Error> {
    if h.nfs().stat(e, path)?.is_none() {
        return Ok(None);
    }
    match h.nfs().read_file(e, path) {
        Ok(b) => Meta::decode(&b).map(Some).context(path),
        Err(Error::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The subDir the index gives for `name` on `e`, and the metadata there (`None` when the
/// directory or its metadata is gone, e.g. after an interrupted delete).
fn find_index(h: &impl Host, e: &NfsExport, name: &str) -> Result<Option<(String, Option<Meta>)>, Error> {
    let Some(index) = read_meta(h, e, &index_path(name))? else { return Ok(None) };
    let sub_dir = index.get("subDir").to_string();
    policy::check_sub_dir(&sub_dir).map_err(internal(&index_path(name)))?;
    let meta = read_meta(h, e, &meta_path(&sub_dir))?;
    Ok(Some((sub_dir, meta)))
}

/// The committed volume `name` on `e`, or `None`.
fn find(h: &impl Host, e: &NfsExport, name: &str) -> Result<Option<Found>, Error> {
    let Some((sub_dir, meta)) = find_index(h, e, name)? else { return Ok(None) };
    let meta = meta.ok_or_else(|| Error::Internal(format!("volume {name}: index names {sub_dir} but its metadata is missing")))?;
    Ok(Some(Found { export: e.clone(), name: name.into(), sub_dir, meta }))
}
fn find_id(h: &impl Host, id: &str) -> Result<Found, Error> {
    let (e, name) = policy::decode_id(id).ok_or_else(|| not_ours(id))?;
    find(h, &e, &name)?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))
}

fn check_caps(caps: &[VolumeCapability]) -> Result<(), Error> {
    if caps.iter().any(|c| matches!(c.access_type, AccessType::Block)) {
        return Err(Error::InvalidArgument("nfs serves filesystem volumes only, not block".into()));
    }
    Ok(())
}

fn snapshot(h: &impl Host, e: &NfsExport, name: &str) -> Result<Option<Snapshot>, Error> {
    let path = format!("{}/meta", snap_dir(name));
    let Some(meta) = read_meta(h, e, &path)? else { return Ok(None) };
    snapshot_of(e, name, &meta).map(Some)
}

fn snapshot_of(e: &NfsExport, name: &str, meta: &Meta) -> Result<Snapshot, Error> {
    let path = format!("{}/meta", snap_dir(name));
    let nanos = meta.u64("createdNanos").context(&path)?;
    Ok(Snapshot {
        snapshot_id: policy::encode_id(e, name).map_err(bad)?,
        source_volume_id: meta.get("source").into(),
        size_bytes: meta.u64("capacity").context(&path)?,
        creation_time: Timestamp { seconds: (nanos / 1_000_000_000) as i64, nanos: (nanos % 1_000_000_000) as u32 },
        // Written `false` before the copy starts, `true` when it is whole.
        ready_to_use: meta.get("ready") == "true",
    })
}

/// Copy `from` into a staging directory, write the new volume's metadata there, then rename it
/// to `to`: `to` appears whole and already naming its volume, or not at all. The copy runs in
/// the host's background and outlives this call: until it is done the call fails `aborted`
/// (CSI's "an operation is pending for this volume"), and the provisioner's retry finds it
/// further along, instead of starting over like a copy bound to one call's deadline would.
fn copy_into_place(h: &impl Host, e: &NfsExport, from: &str, to: &str, name: &str, meta: &Meta) -> Result<(), Error> {
    let staging = format!("{}/{name}", policy::STAGING_DIR);
    let (marker, data) = (format!("{staging}/source"), format!("{staging}/data"));
    h.nfs().mkdir(e, policy::STAGING_DIR, 0o700, 0, 0)?;
    h.nfs().mkdir(e, &staging, 0o700, 0, 0)?;
    // A staging copy left by an earlier request of this name from another source is not ours.
    if read_meta(h, e, &marker)?.is_some_and(|m| m.get("from") != from) {
        h.nfs().cancel_copy(e, &data);
        h.nfs().remove_all(e, &staging)?;
    }
    h.nfs().mkdir(e, &staging, 0o700, 0, 0)?;
    let mut m = Meta::default();
    m.set("from", from);
    h.nfs().write_file(e, &marker, &m.encode())?;
    let p = h.nfs().copy_tree_background(e, from, &data)?;
    if !p.done {
        return Err(Error::Aborted(format!("volume {name}: copying {from}, {} bytes so far; retry to follow it", p.bytes)));
    }
    h.nfs().write_file(e, &meta_path(&data), &meta.encode())?;
    if let Some((parent, _)) = to.rsplit_once('/') {
        h.nfs().mkdir(e, parent, 0o755, 0, 0)?;
    }
    h.nfs().rename(e, &data, to)?;
    h.nfs().remove_all(e, &staging)
}

/// The driver, over any [`Host`]: the [`Backend`] methods below call these.
fn create_volume(h: &impl Host, req: &CreateVolumeRequest) -> Result<Volume, Error> {
    check_csi_name("volume", &req.name)?;
    let p = params(&req.parameters)?;
    check_caps(&req.capabilities)?;
    let cap = SIZING.resolve(req.capacity.required_bytes, req.capacity.limit_bytes)?;
    // The CSI name as a file name and id tail; the metadata keeps the name itself.
    let local = policy::local_name(&p.export, "volume", &req.name).map_err(bad)?;
    let sub_dir = p.render_sub_dir(&local).map_err(bad)?;
    let id = policy::encode_id(&p.export, &local).map_err(bad)?;
    let source = source_key(&req.content_source);
    let e = &p.export;
    if let Some(f) = find(h, e, &local)? {
        let have = f.capacity()?;
        if have != cap || f.meta.get("source") != source || f.sub_dir != sub_dir {
            return Err(Error::AlreadyExists(format!(
                "volume {} exists with {have} bytes at {} from {:?}",
                req.name,
                f.sub_dir,
                f.meta.get("source")
            )));
        }
        return f.volume();
    }
    let mut meta = Meta::default();
    meta.set("name", &req.name)
        .set("capacity", cap)
        .set("source", &source)
        .set("subDir", &sub_dir)
        .set("mountOptions", p.mount_options.join(","))
        .set("onDelete", p.on_delete.as_str());
    // Not committed. A directory already there is ours only if its metadata names this volume
    // (an interrupted create); anything else (another volume, a retained one) is not touched.
    let existing = h.nfs().stat(e, &sub_dir)?;
    if existing.is_some() {
        match read_meta(h, e, &meta_path(&sub_dir))? {
            Some(m) if m.get("name") == req.name => {}
            Some(m) => return Err(Error::AlreadyExists(format!("subDir {sub_dir} holds volume {:?}", m.get("name")))),
            None if req.content_source.is_some() => {
                return Err(Error::AlreadyExists(format!("subDir {sub_dir} exists; a volume from a content source needs a new directory")));
            }
            None => {}
        }
    }
    if existing.is_none() {
        match &req.content_source {
            None => h.nfs().mkdir(e, &sub_dir, p.mode, p.uid, p.gid)?,
            Some(ContentSource::Snapshot(sid)) => {
                let (se, sname) = policy::decode_id(sid).ok_or_else(|| Error::NotFound(format!("snapshot {sid} not found")))?;
                if &se != e {
                    return Err(Error::InvalidArgument(format!("snapshot {sid} lives on another export than {}:{}", e.server, e.share)));
                }
                let snap = snapshot(h, e, &sname)?.ok_or_else(|| Error::NotFound(format!("snapshot {sid} not found")))?;
                if !snap.ready_to_use {
                    return Err(Error::Aborted(format!("snapshot {sid} is still being copied; retry")));
                }
                copy_into_place(h, e, &format!("{}/data", snap_dir(&sname)), &sub_dir, &local, &meta)?;
            }
            Some(ContentSource::Volume(vid)) => {
                let (ve, _) = policy::decode_id(vid).ok_or_else(|| Error::NotFound(format!("volume {vid} not found")))?;
                if &ve != e {
                    return Err(Error::InvalidArgument(format!("volume {vid} lives on another export than {}:{}", e.server, e.share)));
                }
                let src = find_id(h, vid)?;
                copy_into_place(h, e, &src.sub_dir, &sub_dir, &local, &meta)?;
            }
        }
    }
    h.nfs().write_file(e, &meta_path(&sub_dir), &meta.encode())?;
    EXPORTS.remember(h.kv(), &policy::encode_id(e, "x").map_err(bad)?)?;
    h.nfs().mkdir(e, policy::INDEX_DIR, 0o700, 0, 0)?;
    let mut index = Meta::default();
    index.set("subDir", &sub_dir);
    h.nfs().write_file(e, &index_path(&local), &index.encode())?;
    h.log().info("volume created", &[("volume", &id), ("bytes", &cap.to_string()), ("subDir", &sub_dir)]);
    Found { export: e.clone(), name: local, sub_dir, meta }.volume()
}

fn delete_volume(h: &impl Host, id: &str) -> Result<(), Error> {
    let Some((e, name)) = policy::decode_id(id) else { return Ok(()) };
    let Some((sub_dir, meta)) = find_index(h, &e, &name)? else { return Ok(()) };
    // Metadata gone: an earlier attempt already removed or moved the directory.
    let on_delete = meta.as_ref().map(|m| OnDelete::parse(m.get("onDelete")).unwrap_or(OnDelete::Delete));
    match on_delete {
        None | Some(OnDelete::Retain) => {}
        Some(OnDelete::Delete) => h.nfs().remove_all(&e, &sub_dir)?,
        Some(OnDelete::Archive) => {
            let to = policy::archive_path(&sub_dir);
            match h.nfs().rename(&e, &sub_dir, &to) {
                Ok(()) => {}
                Err(Error::AlreadyExists(_)) => {
                    return Err(Error::FailedPrecondition(format!("cannot archive {sub_dir} to {to}: {to} exists")));
                }
                Err(err) => return Err(err),
            }
        }
    }
    h.nfs().remove_all(&e, &index_path(&name))?;
    let how = on_delete.map(OnDelete::as_str).unwrap_or("already gone");
    h.log().info("volume deleted", &[("volume", id), ("onDelete", how)]);
    Ok(())
}

fn expand_volume(h: &impl Host, id: &str, cap: &CapacityRange) -> Result<Expansion, Error> {
    let mut f = find_id(h, id)?;
    let have = f.capacity()?;
    let new = grow(have, cap)?;
    if new != have {
        f.meta.set("capacity", new);
        h.nfs().write_file(&f.export, &meta_path(&f.sub_dir), &f.meta.encode())?;
    }
    Ok(Expansion { capacity_bytes: new, node_expansion_required: false })
}

fn get_volume(h: &impl Host, id: &str) -> Result<VolumeStatus, Error> {
    let f = find_id(h, id)?;
    let cap = f.capacity()?;
    let used = h.nfs().usage(&f.export, &f.sub_dir)?;
    let (abnormal, message) = if used > cap { (true, format!("uses {used} bytes of {cap}")) } else { (false, "healthy".into()) };
    Ok(VolumeStatus { volume: f.volume()?, condition: Some(VolumeCondition { abnormal, message }) })
}

/// A snapshot is a copy of the volume's tree, made in the host's background: the first call
/// records it (`ready = false`) and starts the copy, every retry reports `ready_to_use = false`
/// until the copy is whole, then marks it ready. The external-snapshotter retries exactly so.
fn create_snapshot(h: &impl Host, csi_name: &str, source: &str) -> Result<Snapshot, Error> {
    check_csi_name("snapshot", csi_name)?;
    let (e, _) = policy::decode_id(source).ok_or_else(|| Error::NotFound(format!("volume {source} not found")))?;
    let local = policy::local_name(&e, "snapshot", csi_name).map_err(bad)?;
    let name = local.as_str();
    let dir = snap_dir(name);
    let meta_file = format!("{dir}/meta");
    let mut meta = match read_meta(h, &e, &meta_file)? {
        Some(m) if m.get("source") != source => {
            return Err(Error::AlreadyExists(format!("snapshot {name} exists for {}", m.get("source"))));
        }
        Some(m) if m.get("ready") == "true" => return snapshot_of(&e, name, &m),
        Some(m) => m,
        None => {
            let f = find_id(h, source)?;
            h.nfs().mkdir(&e, policy::SNAPSHOT_DIR, 0o700, 0, 0)?;
            h.nfs().mkdir(&e, &dir, 0o700, 0, 0)?;
            // The server's clock at the cut, kept: the meta file is rewritten when ready.
            let t = h.nfs().stat(&e, &dir)?.map(|s| s.modified).ok_or_else(|| Error::Internal(format!("{dir} vanished")))?;
            let nanos = (t.seconds.max(0) as u64) * 1_000_000_000 + u64::from(t.nanos);
            let mut m = Meta::default();
            m.set("name", csi_name).set("source", source).set("capacity", f.capacity()?).set("createdNanos", nanos).set("ready", "false");
            h.nfs().write_file(&e, &meta_file, &m.encode())?;
            m
        }
    };
    let f = find_id(h, source)?;
    let p = h.nfs().copy_tree_background(&e, &f.sub_dir, &format!("{dir}/data"))?;
    if p.done {
        meta.set("ready", "true");
        h.nfs().write_file(&e, &meta_file, &meta.encode())?;
    } else {
        h.log().info("snapshot copying", &[("snapshot", name), ("bytes", &p.bytes.to_string())]);
    }
    snapshot_of(&e, name, &meta)
}

fn delete_snapshot(h: &impl Host, id: &str) -> Result<(), Error> {
    let Some((e, name)) = policy::decode_id(id) else { return Ok(()) };
    h.nfs().cancel_copy(&e, &format!("{}/data", snap_dir(&name)));
    // meta first: a half-deleted snapshot is not listed
    h.nfs().remove_all(&e, &format!("{}/meta", snap_dir(&name)))?;
    h.nfs().remove_all(&e, &snap_dir(&name))
}

fn list_snapshots(h: &impl Host, snap: Option<&str>, vol: Option<&str>, max: u32, token: &str) -> Result<SnapshotPage, Error> {
    let mut all = vec![];
    if let Some(sid) = snap {
        if let Some((e, name)) = policy::decode_id(sid) {
            all.extend(snapshot(h, &e, &name)?);
        }
    } else {
        let exports: Vec<NfsExport> = match vol {
            Some(v) => policy::decode_id(v).map(|(e, _)| e).into_iter().collect(),
            None => known_exports(h)?,
        };
        for e in exports {
            if h.nfs().stat(&e, policy::SNAPSHOT_DIR)?.is_none() {
                continue;
            }
            for name in h.nfs().read_dir(&e, policy::SNAPSHOT_DIR)? {
                if policy::is_local_name(&name) {
                    all.extend(snapshot(h, &e, &name)?);
                }
            }
        }
    }
    all.retain(|s| vol.is_none_or(|v| v == s.source_volume_id));
    all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
    let (entries, next_token) = page(all, max, token)?;
    Ok(SnapshotPage { entries, next_token })
}

/// Every committed volume on every known export, by id. Conditions are left out: usage walks
/// the whole tree of a volume, which GetVolume does for one volume and a listing must not do
/// for all of them.
fn list_volumes(h: &impl Host, max: u32, token: &str) -> Result<VolumePage, Error> {
    let mut all = vec![];
    for e in known_exports(h)? {
        if h.nfs().stat(&e, policy::INDEX_DIR)?.is_none() {
            continue;
        }
        for name in h.nfs().read_dir(&e, policy::INDEX_DIR)? {
            if !policy::is_local_name(&name) {
                continue;
            }
            // An index whose metadata is gone is a delete in progress, not a volume.
            if let Some((sub_dir, Some(meta))) = find_index(h, &e, &name)? {
                all.push(VolumeStatus { volume: Found { export: e.clone(), name, sub_dir, meta }.volume()?, condition: None });
            }
        }
    }
    all.sort_by(|a, b| a.volume.volume_id.cmp(&b.volume.volume_id));
    let (entries, next_token) = page(all, max, token)?;
    Ok(VolumePage { entries, next_token })
}

fn get_capacity(h: &impl Host, parameters: &[Pair]) -> Result<Capacity, Error> {
    let p = params(parameters)?;
    let s = h.nfs().fs_stats(&p.export)?;
    Ok(Capacity { available_bytes: s.available_bytes, maximum_volume_bytes: s.available_bytes, minimum_volume_bytes: 0 })
}

fn attach_plan(h: &impl Host, id: &str, context: &[Pair], cap: &VolumeCapability) -> Result<Attachment, Error> {
    let (e, name) = policy::decode_id(id).ok_or_else(|| not_ours(id))?;
    if matches!(cap.access_type, AccessType::Block) {
        return Err(Error::FailedPrecondition("nfs volumes are directories, not block devices".into()));
    }
    let ctx = |k: &str| context.iter().find(|p| p.key == k).map(|p| p.value.as_str());
    // The context the volume was created with carries everything: no NFS traffic on the node.
    let (sub_dir, options) = match (ctx("server"), ctx("share"), ctx("subDir")) {
        (Some(server), Some(share), Some(sub_dir)) => {
            if server != e.server || share != e.share {
                return Err(Error::InvalidArgument(format!("volume context names {server}:{share}, the id {}:{}", e.server, e.share)));
            }
            policy::check_sub_dir(sub_dir).map_err(bad)?;
            let options = match ctx("mountOptions") {
                Some("") | None => vec![],
                Some(o) => policy::parse_mount_options(o).map_err(bad)?,
            };
            (sub_dir.to_string(), options)
        }
        _ => {
            let f = find(h, &e, &name)?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
            let options = match f.meta.get("mountOptions") {
                "" => vec![],
                o => policy::parse_mount_options(o).map_err(internal(&f.sub_dir))?,
            };
            (f.sub_dir, options)
        }
    };
    Ok(Attachment::Nfs(NfsPlan { server: e.server, share: e.share, path: sub_dir, mount_options: options }))
}

impl Backend for Nfs {
    fn info() -> BackendInfo {
        use Feature::*;
        BackendInfo {
            name: "nfs".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            parameters: policy::PARAMETERS.iter().map(|p| (*p).into()).collect(),
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
                GetSnapshot,
            ],
        }
    }
    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
        create_volume(h, &req)
    }
    fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        delete_volume(h, &id)
    }
    fn expand_volume(h: &impl Host, id: String, cap: CapacityRange, _: Option<VolumeCapability>, _: Vec<SecretRef>) -> Result<Expansion, Error> {
        expand_volume(h, &id, &cap)
    }
    fn get_volume(h: &impl Host, id: String) -> Result<VolumeStatus, Error> {
        get_volume(h, &id)
    }
    fn list_volumes(h: &impl Host, max: u32, token: String) -> Result<VolumePage, Error> {
        list_volumes(h, max, &token)
    }
    fn validate_volume_capabilities(
        h: &impl Host,
        id: String,
        _: Vec<Pair>,
        caps: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
    ) -> Result<Option<String>, Error> {
        find_id(h, &id)?;
        let params_ok = if parameters.is_empty() { Ok(()) } else { params(&parameters).map(|_| ()) };
        Ok(params_ok.and(check_caps(&caps)).err().map(|e| format!("{e:?}")))
    }
    fn create_snapshot(h: &impl Host, name: String, source: String, _: Vec<Pair>, _: Vec<SecretRef>) -> Result<Snapshot, Error> {
        create_snapshot(h, &name, &source)
    }
    fn delete_snapshot(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        delete_snapshot(h, &id)
    }
    fn list_snapshots(h: &impl Host, snap: Option<String>, vol: Option<String>, max: u32, token: String) -> Result<SnapshotPage, Error> {
        list_snapshots(h, snap.as_deref(), vol.as_deref(), max, &token)
    }
    fn get_capacity(h: &impl Host, _: Vec<VolumeCapability>, parameters: Vec<Pair>, _: Option<Topology>) -> Result<Capacity, Error> {
        get_capacity(h, &parameters)
    }
    fn attach_plan(h: &impl Host, id: String, context: Vec<Pair>, cap: VolumeCapability, _: Vec<SecretRef>) -> Result<Attachment, Error> {
        attach_plan(h, &id, &context, &cap)
    }
    fn get_snapshot(h: &impl Host, id: String) -> Result<Snapshot, Error> {
        let page = Self::list_snapshots(h, Some(id.clone()), None, 1, String::new())?;
        page.entries.into_iter().next().ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))
    }
}

wasmcsi_backend_sdk::export!(Nfs);
