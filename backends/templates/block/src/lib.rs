//! MyBackend: a wasmcsi storage backend, made by `wasmcsi backend new --capability block`.
//!
//! A volume is a replica set of the host's replicated block engine (`block` capability: the
//! operator grants the replica nodes), with [`REPLICAS`] replicas on the nodes with the most
//! free space. The set is the truth: its id is the volume's, and its metadata keeps the CSI name,
//! so a retry after a crash finds either nothing or the whole set. The node starts the
//! volume's engine and exposes it as a device (mkfs and mount for a filesystem volume).
//!
//! Build the component with `cargo build --release --target wasm32-wasip2`; README.md says how
//! to test it and drop it in.
use wasmcsi_backend_sdk::block::{Placement, ReplicaSet};
use wasmcsi_backend_sdk::names::is_local_id;
use wasmcsi_backend_sdk::prelude::*;

/// The backend.
pub struct MyBackend;

/// Replicas per volume, each on its own node.
pub const REPLICAS: usize = 2;
/// Sizes: 1 GiB by default, whole MiB (the engine needs multiples of 4096).
const SIZING: Sizing = Sizing { default_bytes: GIB, unit_bytes: MIB };

/// StorageClass parameters: this backend takes none (add yours here).
fn check_parameters(parameters: &[Pair]) -> Result<(), Error> {
    let unknown = parameters.iter().find(|p| !p.key.starts_with("csi.storage.k8s.io/"));
    unknown.map_or(Ok(()), |p| Err(Error::InvalidArgument(format!("unknown parameter {:?} (this backend takes none)", p.key))))
}

/// Why these capabilities cannot be served, if they cannot: one engine, on one node.
fn unsupported_capability(capabilities: &[VolumeCapability]) -> Option<String> {
    capabilities.iter().any(|c| !c.access_mode.is_single_node()).then(|| "a replicated volume is used by one node at a time".into())
}

/// The replica set of volume `id`.
fn find(h: &impl Host, id: &str) -> Result<ReplicaSet, Error> {
    let set = if is_local_id(id) { h.block().get(id)? } else { None };
    set.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))
}

impl Backend for MyBackend {
    fn info() -> BackendInfo {
        BackendInfo {
            name: env!("CARGO_PKG_NAME").into(),
            version: env!("CARGO_PKG_VERSION").into(),
            features: vec![Feature::CreateDeleteVolume, Feature::ListVolumes],
            parameters: vec![],
        }
    }

    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
        check_csi_name("volume", &req.name)?;
        check_parameters(&req.parameters)?;
        if let Some(why) = unsupported_capability(&req.capabilities) {
            return Err(Error::InvalidArgument(why));
        }
        if req.content_source.is_some() {
            return unsupported("creating a volume from a snapshot or a volume");
        }
        let id = local_name(&req.name, MAX_ID_BYTES);
        let (required, limit) = (req.capacity.required_bytes, req.capacity.limit_bytes);
        let size = SIZING.resolve(required, limit)?;
        if let Some(set) = h.block().get(&id)? {
            // The same name again is the same volume, when it fits the request.
            if set.size_bytes < required || (limit != 0 && set.size_bytes > limit) {
                return Err(Error::AlreadyExists(format!("volume {:?} exists with {} bytes", req.name, set.size_bytes)));
            }
            return Ok(Volume::new(id, set.size_bytes));
        }
        let mut nodes: Vec<_> = h.block().list_nodes()?.into_iter().filter(|n| n.free_bytes >= size).collect();
        if nodes.len() < REPLICAS {
            return Err(Error::ResourceExhausted(format!("{REPLICAS} nodes with {size} bytes free needed, {} have them", nodes.len())));
        }
        nodes.sort_by(|a, b| b.free_bytes.cmp(&a.free_bytes).then_with(|| a.name.cmp(&b.name)));
        let placed: Vec<String> = nodes.into_iter().take(REPLICAS).map(|n| n.name).collect();
        let placements: Vec<Placement> = placed.iter().map(Placement::on).collect();
        let set = h.block().create(&id, size, &placements, None, &[Pair { key: "csi.name".into(), value: req.name.clone() }])?;
        h.log().info("volume created", &[("volume", &id), ("nodes", &placed.join(","))]);
        Ok(Volume::new(id, set.size_bytes))
    }

    fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        if !is_local_id(&id) {
            return Ok(()); // names no volume of ours: already gone
        }
        h.block().delete(&id)
    }

    fn list_volumes(h: &impl Host, max_entries: u32, token: String) -> Result<VolumePage, Error> {
        let mut sets: Vec<ReplicaSet> = vec![];
        loop {
            let more = h.block().list_sets(sets.last().map(|s| s.id.as_str()), 1000)?;
            if more.is_empty() {
                break;
            }
            sets.extend(more);
        }
        let (sets, next_token) = page(sets, max_entries, &token)?;
        let entries = sets.into_iter().map(|s| VolumeStatus { volume: Volume::new(s.id, s.size_bytes), condition: None }).collect();
        Ok(VolumePage { entries, next_token })
    }

    fn validate_volume_capabilities(
        h: &impl Host,
        id: String,
        _: Vec<Pair>,
        caps: Vec<VolumeCapability>,
        params: Vec<Pair>,
    ) -> Result<Option<String>, Error> {
        find(h, &id)?;
        Ok(check_parameters(&params).err().map(|e| format!("{e:?}")).or_else(|| unsupported_capability(&caps)))
    }

    fn attach_plan(h: &impl Host, id: String, _: Vec<Pair>, _: VolumeCapability, _: Vec<SecretRef>) -> Result<Attachment, Error> {
        let set = find(h, &id)?;
        Ok(Attachment::ReplicatedBlock(BlockPlan {
            volume_id: set.id,
            size_bytes: set.size_bytes,
            fs_type: String::new(),
            frontend: None,
            encryption: None,
        }))
    }
}

wasmcsi_backend_sdk::export!(MyBackend);

#[cfg(test)]
mod tests;
