//! MyBackend: a wasmcsi storage backend, made by `wasmcsi backend new --capability rbd`.
//!
//! A volume is an RBD image on the Ceph pool named by the StorageClass parameters `clusterID`
//! and `pool` (`rbd` capability: the operator grants the pool and configures the cluster's
//! monitors; credentials come as ceph-csi's `userID`/`userKey` secrets, which this backend only
//! ever holds as opaque handles). The record `volumes/ID` in the backend's kv store (cluster,
//! pool, size) is written last, so a retry after a crash finds either nothing or a whole
//! volume. The node maps the image with its NodeStage secrets.
//!
//! Build the component with `cargo build --release --target wasm32-wasip2`; README.md says how
//! to test it and drop it in.
use wasmcsi_backend_sdk::names::is_local_id;
use wasmcsi_backend_sdk::prelude::*;
use wasmcsi_backend_sdk::rbd::Target;

/// The backend.
pub struct MyBackend;

/// Sizes: 1 GiB by default, whole MiB.
const SIZING: Sizing = Sizing { default_bytes: GIB, unit_bytes: MIB };

/// What the kv store holds of a volume (its image is named like the id).
struct Record {
    target: Target,
    size: u64,
}

/// The pool, from StorageClass parameters: `clusterID` and `pool` (add yours here).
fn target_of(parameters: &[Pair]) -> Result<Target, Error> {
    let (mut cluster, mut pool) = (None, None);
    for p in parameters.iter().filter(|p| !p.key.starts_with("csi.storage.k8s.io/")) {
        match p.key.as_str() {
            "clusterID" => cluster = Some(p.value.clone()),
            "pool" => pool = Some(p.value.clone()),
            k => return Err(Error::InvalidArgument(format!("unknown parameter {k:?} (this backend takes clusterID and pool)"))),
        }
    }
    match (cluster, pool) {
        (Some(cluster), Some(pool)) => Ok(Target::new(cluster, pool)),
        _ => Err(Error::InvalidArgument("parameters clusterID and pool are required".into())),
    }
}

/// Why these capabilities cannot be served, if they cannot: an image is written by one node.
fn unsupported_capability(capabilities: &[VolumeCapability]) -> Option<String> {
    capabilities.iter().any(|c| !c.access_mode.is_single_node()).then(|| "an RBD volume is used by one node at a time".into())
}

/// The record of volume `id`, `None` when there is no such volume.
fn record(h: &impl Host, id: &str) -> Result<Option<Record>, Error> {
    if !is_local_id(id) || id.starts_with(['.', '-']) {
        return Ok(None);
    }
    let Some(bytes) = h.kv().get(&format!("volumes/{id}"))? else { return Ok(None) };
    let meta = Meta::decode(&bytes)?;
    Ok(Some(Record { target: Target::new(meta.get("cluster"), meta.get("pool")), size: meta.u64("capacity")? }))
}

fn find(h: &impl Host, id: &str) -> Result<Record, Error> {
    record(h, id)?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))
}

/// Every volume's id, in order.
fn ids(h: &impl Host) -> Result<Vec<String>, Error> {
    let mut ids: Vec<String> = vec![];
    loop {
        let after = ids.last().map(|id| format!("volumes/{id}"));
        let keys = h.kv().list_keys("volumes/", after.as_deref(), 1000)?;
        if keys.is_empty() {
            return Ok(ids);
        }
        ids.extend(keys.iter().map(|k| k.strip_prefix("volumes/").unwrap_or(k).to_string()));
    }
}

impl Backend for MyBackend {
    fn info() -> BackendInfo {
        let parameters = vec!["clusterID".into(), "pool".into()];
        BackendInfo {
            name: env!("CARGO_PKG_NAME").into(),
            version: env!("CARGO_PKG_VERSION").into(),
            features: vec![Feature::CreateDeleteVolume, Feature::ListVolumes],
            parameters,
        }
    }

    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
        check_csi_name("volume", &req.name)?;
        let target = target_of(&req.parameters)?;
        if let Some(why) = unsupported_capability(&req.capabilities) {
            return Err(Error::InvalidArgument(why));
        }
        if req.content_source.is_some() {
            return unsupported("creating a volume from a snapshot or a volume");
        }
        let id = local_name(&req.name, MAX_ID_BYTES);
        let (required, limit) = (req.capacity.required_bytes, req.capacity.limit_bytes);
        let size = SIZING.resolve(required, limit)?;
        if let Some(have) = record(h, &id)? {
            // The same name again is the same volume, when it fits the request.
            if have.target != target || have.size < required || (limit != 0 && have.size > limit) {
                return Err(Error::AlreadyExists(format!("volume {:?} exists with {} bytes on another pool or size", req.name, have.size)));
            }
            return Ok(Volume::new(id, have.size));
        }
        let secrets = &req.secrets;
        // An image from an earlier attempt that crashed before its record: made by us, reused.
        let made = match h.rbd().info(&target.pool(secrets), &id)? {
            Some(image) => image.size_bytes,
            None => {
                h.rbd().create(&target.pool(secrets), &id, size, &["layering".into()], None, &[("csi.name".into(), req.name.clone())])?;
                size
            }
        };
        let meta = Meta::default().set("cluster", &target.cluster).set("pool", &target.pool).set("capacity", made).encode();
        h.kv().set(&format!("volumes/{id}"), &meta)?;
        h.log().info("volume created", &[("volume", &id), ("bytes", &made.to_string())]);
        Ok(Volume::new(id, made))
    }

    fn delete_volume(h: &impl Host, id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        let Some(rec) = record(h, &id)? else { return Ok(()) }; // already gone
        // The image first: the record stays until nothing is left, so a retry finds it again.
        h.rbd().remove(&rec.target.pool(&secrets), &id)?;
        h.kv().delete(&format!("volumes/{id}"))
    }

    fn list_volumes(h: &impl Host, max_entries: u32, token: String) -> Result<VolumePage, Error> {
        let (ids, next_token) = page(ids(h)?, max_entries, &token)?;
        let mut entries = vec![];
        for id in ids {
            // One deleted since the ids were read is not listed.
            if let Some(rec) = record(h, &id)? {
                entries.push(VolumeStatus { volume: Volume::new(id, rec.size), condition: None });
            }
        }
        Ok(VolumePage { entries, next_token })
    }

    fn validate_volume_capabilities(
        h: &impl Host,
        id: String,
        _: Vec<Pair>,
        caps: Vec<VolumeCapability>,
        params: Vec<Pair>,
    ) -> Result<Option<String>, Error> {
        let rec = find(h, &id)?;
        // Parameters, when given, must name the volume's pool.
        let given = params.iter().any(|p| !p.key.starts_with("csi.storage.k8s.io/"));
        let why = match target_of(&params) {
            _ if !given => None,
            Ok(t) if t != rec.target => Some(format!("the volume lives on pool {} of {}", rec.target.pool, rec.target.cluster)),
            Ok(_) => None,
            Err(e) => Some(format!("{e:?}")),
        };
        Ok(why.or_else(|| unsupported_capability(&caps)))
    }

    fn attach_plan(h: &impl Host, id: String, _: Vec<Pair>, _: VolumeCapability, given: Vec<SecretRef>) -> Result<Attachment, Error> {
        let Record { target, .. } = find(h, &id)?;
        // ceph-csi's node-stage secret keys, by the handles of the NodeStage secrets this call
        // was given (the node resolves them by key where there are none).
        let handle = |key: &str| given.iter().find(|r| r.key == key).map_or(0, |r| r.handle);
        let secrets = ["userID", "userKey"].map(|key| SecretRef { key: key.into(), handle: handle(key) }).to_vec();
        Ok(Attachment::Rbd(RbdPlan { cluster: target.cluster, pool: target.pool, image: id, secrets, encryption: None }))
    }
}

wasmcsi_backend_sdk::export!(MyBackend);

#[cfg(test)]
mod tests;
