//! MyBackend: a wasmcsi storage backend, made by `wasmcsi backend new --capability nfs`.
//!
//! A volume is the directory `volumes/ID` on the NFS export named by the StorageClass
//! parameters `server` and `share`, made through the host's userspace NFS client (`nfs`
//! capability: the controller mounts nothing; the operator grants the export). The record
//! `volumes/ID` in the backend's kv store (export and size) is written last, so a retry after a
//! crash finds either nothing or a whole volume. The node mounts `server:/share/volumes/ID`.
//!
//! Build the component with `cargo build --release --target wasm32-wasip2`; README.md says how
//! to test it and drop it in.
use wasmcsi_backend_sdk::names::is_local_id;
use wasmcsi_backend_sdk::nfs::NfsExport;
use wasmcsi_backend_sdk::prelude::*;

/// The backend.
pub struct MyBackend;

/// What the kv store holds of a volume.
struct Record {
    export: NfsExport,
    size: u64,
}

/// The export, from StorageClass parameters: `server` and `share` (add yours here).
fn export_of(parameters: &[Pair]) -> Result<NfsExport, Error> {
    let (mut server, mut share) = (None, None);
    for p in parameters.iter().filter(|p| !p.key.starts_with("csi.storage.k8s.io/")) {
        match p.key.as_str() {
            "server" => server = Some(p.value.clone()),
            "share" => share = Some(p.value.clone()),
            k => return Err(Error::InvalidArgument(format!("unknown parameter {k:?} (this backend takes server and share)"))),
        }
    }
    match (server, share) {
        (Some(server), Some(share)) => Ok(NfsExport { server, share }),
        _ => Err(Error::InvalidArgument("parameters server and share are required".into())),
    }
}

/// Why these capabilities cannot be served, if they cannot: a directory is no block device.
fn unsupported_capability(capabilities: &[VolumeCapability]) -> Option<String> {
    capabilities.iter().any(|c| c.is_block()).then(|| "an NFS volume is no block device".into())
}

/// The record of volume `id`, `None` when there is no such volume.
fn record(h: &impl Host, id: &str) -> Result<Option<Record>, Error> {
    // Ids come back from outside and become paths: only ours are looked up.
    if !is_local_id(id) || id.starts_with(['.', '-']) {
        return Ok(None);
    }
    let Some(bytes) = h.kv().get(&format!("volumes/{id}"))? else { return Ok(None) };
    let meta = Meta::decode(&bytes)?;
    Ok(Some(Record { export: NfsExport { server: meta.get("server").into(), share: meta.get("share").into() }, size: meta.u64("capacity")? }))
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
        let parameters = vec!["server".into(), "share".into()];
        BackendInfo {
            name: env!("CARGO_PKG_NAME").into(),
            version: env!("CARGO_PKG_VERSION").into(),
            features: vec![Feature::CreateDeleteVolume, Feature::ListVolumes],
            parameters,
        }
    }

    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
        check_csi_name("volume", &req.name)?;
        let export = export_of(&req.parameters)?;
        if let Some(why) = unsupported_capability(&req.capabilities) {
            return Err(Error::InvalidArgument(why));
        }
        if req.content_source.is_some() {
            return unsupported("creating a volume from a snapshot or a volume");
        }
        let id = local_name(&req.name, MAX_ID_BYTES);
        let (required, limit) = (req.capacity.required_bytes, req.capacity.limit_bytes);
        let size = Sizing::DEFAULT.resolve(required, limit)?;
        if let Some(have) = record(h, &id)? {
            // The same name again is the same volume, when it fits the request.
            if have.export != export || have.size < required || (limit != 0 && have.size > limit) {
                return Err(Error::AlreadyExists(format!(
                    "volume {:?} exists on {}:{} with {} bytes",
                    req.name, have.export.server, have.export.share, have.size
                )));
            }
            return Ok(Volume::new(id, have.size));
        }
        h.nfs().mkdir(&export, &format!("volumes/{id}"), 0o777, 0, 0)?;
        let meta = Meta::default().set("server", &export.server).set("share", &export.share).set("capacity", size).encode();
        h.kv().set(&format!("volumes/{id}"), &meta)?;
        h.log().info("volume created", &[("volume", &id), ("bytes", &size.to_string())]);
        Ok(Volume::new(id, size))
    }

    fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        let Some(rec) = record(h, &id)? else { return Ok(()) }; // already gone
        // The data first: the record stays until nothing is left, so a retry finds it again.
        h.nfs().remove_all(&rec.export, &format!("volumes/{id}"))?;
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
        // Parameters, when given, must name the volume's export.
        let given = params.iter().any(|p| !p.key.starts_with("csi.storage.k8s.io/"));
        let why = match export_of(&params) {
            _ if !given => None,
            Ok(e) if e != rec.export => Some(format!("the volume lives on {}:{}", rec.export.server, rec.export.share)),
            Ok(_) => None,
            Err(e) => Some(format!("{e:?}")),
        };
        Ok(why.or_else(|| unsupported_capability(&caps)))
    }

    fn attach_plan(h: &impl Host, id: String, _: Vec<Pair>, cap: VolumeCapability, _: Vec<SecretRef>) -> Result<Attachment, Error> {
        let Record { export, .. } = find(h, &id)?;
        if cap.is_block() {
            return Err(Error::FailedPrecondition("an NFS volume is no block device".into()));
        }
        Ok(Attachment::Nfs(NfsPlan { server: export.server, share: export.share, path: format!("volumes/{id}"), mount_options: vec![] }))
    }
}

wasmcsi_backend_sdk::export!(MyBackend);

#[cfg(test)]
mod tests;
