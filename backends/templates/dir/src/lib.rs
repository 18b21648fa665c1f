//! MyBackend: a wasmcsi storage backend, made by `wasmcsi backend new --capability dir`.
//!
//! A volume is the directory `volumes/ID` under the first root the operator grants (`dir`
//! capability); its size is recorded in `meta/ID`, written last, so a retry after a crash finds
//! either nothing or a whole volume. The node bind-mounts the directory. Every call runs in a
//! fresh instance: the truth lives beside the data, never in memory.
//!
//! Build the component with `cargo build --release --target wasm32-wasip2`; README.md says how
//! to test it and drop it in.
use wasmcsi_backend_sdk::names::is_local_id;
use wasmcsi_backend_sdk::prelude::*;

/// The backend.
pub struct MyBackend;
type Res<T> = Result<T, Error>;

/// The root volumes live under: the first one granted.
fn root(h: &impl Host) -> Res<String> {
    h.dir().roots().into_iter().next().ok_or_else(|| Error::FailedPrecondition("no dir root granted".into()))
}

/// Whether `id` can be one of ours: ids come back from outside and become paths.
fn is_ours(id: &str) -> bool {
    is_local_id(id) && !id.starts_with(['.', '-'])
}

/// The recorded size of volume `id`, `None` when there is no such volume.
fn size_of(h: &impl Host, root: &str, id: &str) -> Res<Option<u64>> {
    if !is_ours(id) {
        return Ok(None);
    }
    let Some(bytes) = h.dir().try_read_file(root, &format!("meta/{id}"))? else { return Ok(None) };
    Meta::decode(&bytes)?.u64("capacity").map(Some)
}

/// Root and size of a volume that exists.
fn find(h: &impl Host, id: &str) -> Res<(String, u64)> {
    let root = root(h)?;
    let size = size_of(h, &root, id)?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
    Ok((root, size))
}

/// StorageClass parameters: this backend takes none (add yours here).
fn check_parameters(parameters: &[Pair]) -> Res<()> {
    let unknown = parameters.iter().find(|p| !p.key.starts_with("csi.storage.k8s.io/"));
    unknown.map_or(Ok(()), |p| Err(Error::InvalidArgument(format!("unknown parameter {:?} (this backend takes none)", p.key))))
}

/// Why a directory cannot serve these capabilities, if it cannot: it lives on one node and is
/// no block device.
fn unsupported_capability(capabilities: &[VolumeCapability]) -> Option<String> {
    match capabilities.iter().find(|c| c.is_block() || !c.access_mode.is_single_node()) {
        Some(c) if c.is_block() => Some("a directory volume is no block device".into()),
        Some(_) => Some("a directory volume lives on one node: single-node access modes only".into()),
        None => None,
    }
}

impl Backend for MyBackend {
    fn info() -> BackendInfo {
        let features = vec![Feature::CreateDeleteVolume, Feature::ListVolumes, Feature::ExpandVolume, Feature::OnlineExpansion, Feature::GetCapacity];
        BackendInfo { name: env!("CARGO_PKG_NAME").into(), version: env!("CARGO_PKG_VERSION").into(), features, parameters: vec![] }
    }

    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Res<Volume> {
        check_csi_name("volume", &req.name)?;
        check_parameters(&req.parameters)?;
        if let Some(why) = unsupported_capability(&req.capabilities) {
            return Err(Error::InvalidArgument(why));
        }
        if req.content_source.is_some() {
            return unsupported("creating a volume from a snapshot or a volume");
        }
        let (root, id) = (root(h)?, local_name(&req.name, MAX_ID_BYTES));
        let (required, limit) = (req.capacity.required_bytes, req.capacity.limit_bytes);
        let size = Sizing::DEFAULT.resolve(required, limit)?;
        if let Some(have) = size_of(h, &root, &id)? {
            // The same name again is the same volume, when it fits the request.
            if have < required || (limit != 0 && have > limit) {
                return Err(Error::AlreadyExists(format!("volume {:?} exists with {have} bytes", req.name)));
            }
            return Ok(Volume::new(id, have));
        }
        let total = h.dir().fs_stats(&root)?.total_bytes;
        if size > total {
            return Err(Error::OutOfRange(format!("{size} bytes asked; the filesystem of root {root} has {total}")));
        }
        h.dir().mkdir(&root, &format!("volumes/{id}"), 0o777)?;
        h.dir().mkdir(&root, "meta", 0o700)?;
        h.dir().write_file(&root, &format!("meta/{id}"), &Meta::default().set("capacity", size).encode())?;
        h.log().info("volume created", &[("volume", &id), ("bytes", &size.to_string())]);
        Ok(Volume::new(id, size))
    }

    fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Res<()> {
        if !is_ours(&id) {
            return Ok(()); // names no volume of ours: already gone
        }
        // The record first: after a crash half-way the volume is gone for every call, and a retry removes the rest.
        let root = root(h)?;
        h.dir().remove_all(&root, &format!("meta/{id}"))?;
        h.dir().remove_all(&root, &format!("volumes/{id}"))
    }

    fn expand_volume(h: &impl Host, id: String, range: CapacityRange, _: Option<VolumeCapability>, _: Vec<SecretRef>) -> Res<Expansion> {
        let (root, have) = find(h, &id)?;
        let size = grow(have, &range)?;
        if size != have {
            h.dir().write_file(&root, &format!("meta/{id}"), &Meta::default().set("capacity", size).encode())?;
        }
        Ok(Expansion { capacity_bytes: size, node_expansion_required: false })
    }

    fn list_volumes(h: &impl Host, max_entries: u32, token: String) -> Res<VolumePage> {
        let root = root(h)?;
        let (ids, next_token) = page(h.dir().try_read_dir(&root, "meta")?.unwrap_or_default(), max_entries, &token)?;
        let mut entries = vec![];
        for id in ids {
            // One deleted since the directory was read is not listed.
            if let Some(size) = size_of(h, &root, &id)? {
                entries.push(VolumeStatus { volume: Volume::new(id, size), condition: None });
            }
        }
        Ok(VolumePage { entries, next_token })
    }

    fn validate_volume_capabilities(h: &impl Host, id: String, _: Vec<Pair>, caps: Vec<VolumeCapability>, params: Vec<Pair>) -> Res<Option<String>> {
        find(h, &id)?;
        Ok(check_parameters(&params).err().map(|e| format!("{e:?}")).or_else(|| unsupported_capability(&caps)))
    }

    fn get_capacity(h: &impl Host, _: Vec<VolumeCapability>, params: Vec<Pair>, _: Option<Topology>) -> Res<Capacity> {
        check_parameters(&params)?;
        let space = h.dir().fs_stats(&root(h)?)?;
        Ok(Capacity { available_bytes: space.available_bytes, maximum_volume_bytes: space.available_bytes, minimum_volume_bytes: 0 })
    }

    fn attach_plan(h: &impl Host, id: String, _: Vec<Pair>, cap: VolumeCapability, _: Vec<SecretRef>) -> Res<Attachment> {
        let (root, capacity_bytes) = find(h, &id)?;
        if cap.is_block() {
            return Err(Error::FailedPrecondition("a directory volume is no block device".into()));
        }
        Ok(Attachment::Bind(BindPlan { root, path: format!("volumes/{id}"), capacity_bytes }))
    }
}

wasmcsi_backend_sdk::export!(MyBackend);

#[cfg(test)]
mod tests;
