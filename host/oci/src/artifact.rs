//! The CNCF Wasm OCI artifact layout (TAG Runtime's Wasm working group): an OCI image
//! manifest whose config has media type `application/vnd.wasm.config.v0+json` and whose one
//! layer is the component (`application/wasm`). What a wasmcsi backend adds is annotations: its
//! name, version, contract and `info()`, so `backend pull` and an operator's registry UI tell a
//! backend's build without loading it.
use crate::error::OciError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const MEDIA_TYPE_WASM_CONFIG: &str = "application/vnd.wasm.config.v0+json";
pub const MEDIA_TYPE_WASM_LAYER: &str = "application/wasm";
pub const MEDIA_TYPE_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_TYPE_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

pub const ANNOTATION_TITLE: &str = "org.opencontainers.image.title";
pub const ANNOTATION_VERSION: &str = "org.opencontainers.image.version";
/// The WIT package the component exports, e.g. `wasmcsi:backend@0.2.0`.
pub const ANNOTATION_CONTRACT: &str = "io.wasmcsi.backend.contract";
/// The backend's `info()` as JSON.
pub const ANNOTATION_INFO: &str = "io.wasmcsi.backend.info";

/// What the pusher knows of the component (the runtime loaded it and called `info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactAnnotations {
    pub name: String,
    pub version: String,
    pub contract: String,
    /// `info()` as a JSON object
    pub info: String,
}

impl ArtifactAnnotations {
    pub fn to_map(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (ANNOTATION_TITLE.into(), self.name.clone()),
            (ANNOTATION_VERSION.into(), self.version.clone()),
            (ANNOTATION_CONTRACT.into(), self.contract.clone()),
            (ANNOTATION_INFO.into(), self.info.clone()),
        ])
    }
}

/// A content descriptor (OCI image spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Descriptor {
    pub fn of(media_type: &str, bytes: &[u8]) -> Self {
        Self {
            media_type: media_type.into(),
            digest: crate::sha256_digest(bytes),
            size: bytes.len() as u64,
            annotations: BTreeMap::new(),
        }
    }
}

/// An OCI image manifest, as much of it as we write and read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The Wasm config blob. No `created` date: pushing the same component twice gives the same
/// digest, so a re-push never moves a digest-pinned configuration.
#[derive(Debug, Serialize)]
struct WasmConfig<'a> {
    architecture: &'a str,
    os: &'a str,
    #[serde(rename = "layerDigests")]
    layer_digests: Vec<&'a str>,
    component: ComponentInfo<'a>,
}

#[derive(Debug, Serialize)]
struct ComponentInfo<'a> {
    target: &'a str,
}

/// The blobs and manifest of one component in the Wasm layout, ready to push.
#[derive(Debug, Clone)]
pub struct Packed {
    pub config: Vec<u8>,
    pub manifest: Vec<u8>,
    pub layer: Descriptor,
    pub config_descriptor: Descriptor,
}

impl Packed {
    pub fn manifest_digest(&self) -> String {
        crate::sha256_digest(&self.manifest)
    }
}

/// Lay out `wasm` as a Wasm artifact annotated with `annotations`.
pub fn pack(wasm: &[u8], annotations: &ArtifactAnnotations) -> Packed {
    let layer = Descriptor::of(MEDIA_TYPE_WASM_LAYER, wasm);
    let config = WasmConfig {
        architecture: "wasm",
        os: "wasip2",
        layer_digests: vec![&layer.digest],
        component: ComponentInfo { target: &annotations.contract },
    };
    // Serializing plain structs of strings cannot fail.
    let config = serde_json::to_vec(&config).unwrap_or_default();
    let config_descriptor = Descriptor::of(MEDIA_TYPE_WASM_CONFIG, &config);
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(MEDIA_TYPE_OCI_MANIFEST.into()),
        config: config_descriptor.clone(),
        layers: vec![layer.clone()],
        annotations: annotations.to_map(),
    };
    let manifest = serde_json::to_vec(&manifest).unwrap_or_default();
    Packed { config, manifest, layer, config_descriptor }
}

/// Parse a manifest and check it is a Wasm artifact: an OCI image manifest, the Wasm config
/// media type, exactly one `application/wasm` layer with a sha256 digest. Returns the manifest.
pub fn check_wasm_manifest(bytes: &[u8], reference: &str) -> Result<Manifest, OciError> {
    let not = |why: String| OciError::NotWasmArtifact { reference: reference.into(), why };
    let manifest: Manifest =
        serde_json::from_slice(bytes).map_err(|e| not(format!("not an OCI image manifest: {e}")))?;
    if manifest.schema_version != 2 {
        return Err(not(format!("schemaVersion {}", manifest.schema_version)));
    }
    if let Some(mt) = &manifest.media_type
        && mt != MEDIA_TYPE_OCI_MANIFEST
    {
        return Err(not(format!("manifest media type {mt}")));
    }
    if manifest.config.media_type != MEDIA_TYPE_WASM_CONFIG {
        return Err(not(format!(
            "config media type {} (a Wasm artifact has {MEDIA_TYPE_WASM_CONFIG})",
            manifest.config.media_type
        )));
    }
    match manifest.layers.as_slice() {
        [layer] if layer.media_type == MEDIA_TYPE_WASM_LAYER => {
            if !crate::source::is_sha256_digest(&layer.digest) {
                return Err(not(format!("layer digest {:?} is not sha256", layer.digest)));
            }
        }
        [layer] => return Err(not(format!("layer media type {} (not {MEDIA_TYPE_WASM_LAYER})", layer.media_type))),
        layers => return Err(not(format!("{} layers (a backend is one component)", layers.len()))),
    }
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn annotations() -> ArtifactAnnotations {
        ArtifactAnnotations {
            name: "nfs".into(),
            version: "0.3.0".into(),
            contract: "wasmcsi:backend@0.2.0".into(),
            info: "{}".into(),
        }
    }

    #[test]
    fn a_packed_component_is_a_wasm_artifact_and_packing_is_reproducible() {
        let packed = pack(b"\0asm\x0d\0\x01\0", &annotations());
        let m = check_wasm_manifest(&packed.manifest, "t").unwrap();
        assert_eq!(m.layers[0], packed.layer);
        assert_eq!(m.config.digest, crate::sha256_digest(&packed.config));
        assert_eq!(m.annotations[ANNOTATION_CONTRACT], "wasmcsi:backend@0.2.0");
        let config: serde_json::Value = serde_json::from_slice(&packed.config).unwrap();
        assert_eq!(config["layerDigests"][0], packed.layer.digest.as_str());
        assert_eq!(pack(b"\0asm\x0d\0\x01\0", &annotations()).manifest_digest(), packed.manifest_digest());
    }

    #[test]
    fn manifests_of_other_artifacts_are_refused_saying_what_they_are() {
        let mut m: serde_json::Value = serde_json::from_slice(&pack(b"x", &annotations()).manifest).unwrap();
        m["config"]["mediaType"] = MEDIA_TYPE_OCI_CONFIG.into();
        let e = check_wasm_manifest(&serde_json::to_vec(&m).unwrap(), "r").unwrap_err().to_string();
        assert!(e.contains(MEDIA_TYPE_OCI_CONFIG), "{e}");
        m["config"]["mediaType"] = MEDIA_TYPE_WASM_CONFIG.into();
        m["layers"][0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip".into();
        assert!(
            check_wasm_manifest(&serde_json::to_vec(&m).unwrap(), "r").unwrap_err().to_string().contains("tar+gzip")
        );
        m["layers"] = serde_json::json!([]);
        assert!(
            check_wasm_manifest(&serde_json::to_vec(&m).unwrap(), "r").unwrap_err().to_string().contains("0 layers")
        );
        assert!(check_wasm_manifest(b"<html>", "r").is_err());
    }
}
