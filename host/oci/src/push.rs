//! Writing to a registry: a component as a Wasm artifact, and a cosign-compatible signature of
//! an artifact's digest (appended beside the signatures already there, as cosign does).
use crate::artifact::{
    ArtifactAnnotations, Descriptor, MEDIA_TYPE_OCI_CONFIG, MEDIA_TYPE_OCI_MANIFEST, Manifest, pack,
};
use crate::client::RegistryClient;
use crate::error::OciError;
use crate::signature::{
    ANNOTATION_SIGNATURE, MEDIA_TYPE_SIMPLE_SIGNING, SigningKey, encode_signature, payload, signature_tag,
};
use crate::source::Source;
use std::collections::BTreeMap;

/// Push `wasm` to `target` (a tag) in the Wasm layout; the pinned source (its manifest digest).
#[tracing::instrument(name = "oci.push", skip_all, fields(target = %target))]
pub async fn push(
    client: &RegistryClient,
    target: &Source,
    wasm: &[u8],
    annotations: &ArtifactAnnotations,
) -> Result<Source, OciError> {
    let packed = pack(wasm, annotations);
    client.push_blob(target, wasm, &packed.layer.digest).await?;
    client.push_blob(target, &packed.config, &packed.config_descriptor.digest).await?;
    let digest = client.push_manifest(target, &packed.manifest).await?;
    Ok(target.at_digest(&digest))
}

/// Sign `pinned`'s digest with `key` and push the signature to its `sha256-HEX.sig` tag; the
/// signature manifest's digest.
#[tracing::instrument(name = "oci.sign", skip_all, fields(artifact = %pinned))]
pub async fn sign(client: &RegistryClient, pinned: &Source, key: &SigningKey) -> Result<String, OciError> {
    let digest = pinned.digest.clone().ok_or_else(|| OciError::Source {
        reference: pinned.to_string(),
        why: "sign a digest (@sha256:…), not a tag: a tag may name other bytes tomorrow".into(),
    })?;
    // The artifact must exist: a signature of a digest nobody can pull is a mistake.
    client.manifest(pinned).await?;
    let body = payload(&pinned.repository_reference(), &digest);
    let signature = encode_signature(&key.sign(&body)?);
    let mut layer = Descriptor::of(MEDIA_TYPE_SIMPLE_SIGNING, &body);
    layer.annotations.insert(ANNOTATION_SIGNATURE.into(), signature);

    let tag_source = pinned.at_tag(&signature_tag(&digest));
    let mut layers = match client.manifest_if_any(&tag_source).await? {
        Some((bytes, _)) => serde_json::from_slice::<Manifest>(&bytes).map(|m| m.layers).unwrap_or_default(),
        None => vec![],
    };
    layers.retain(|l| *l != layer);
    layers.push(layer);
    // The image config cosign writes: one diff id per payload.
    let diff_ids: Vec<&str> = layers.iter().map(|l| l.digest.as_str()).collect();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "",
        "os": "",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap_or_default();
    let config_descriptor = Descriptor::of(MEDIA_TYPE_OCI_CONFIG, &config);
    client.push_blob(&tag_source, &body, &crate::sha256_digest(&body)).await?;
    client.push_blob(&tag_source, &config, &config_descriptor.digest).await?;
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(MEDIA_TYPE_OCI_MANIFEST.into()),
        config: config_descriptor,
        layers,
        annotations: BTreeMap::new(),
    };
    client.push_manifest(&tag_source, &serde_json::to_vec(&manifest).unwrap_or_default()).await
}
