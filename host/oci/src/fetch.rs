//! Pull one backend verified, through the cache: resolve a tag (when allowed), take the
//! manifest (cache or registry) and check it is a Wasm artifact, check its signature (when keys
//! are configured) *before* the layer is downloaded, then take the layer (cache or registry)
//! bounded in size and checked against its digest. Only verified files enter the cache.
use crate::artifact::{Descriptor, check_wasm_manifest};
use crate::cache::{ArtifactCache, CachedSignature};
use crate::client::RegistryClient;
use crate::error::OciError;
use crate::signature::{ANNOTATION_SIGNATURE, MEDIA_TYPE_SIMPLE_SIGNING, PublicKeys, check_signature, signature_tag};
use crate::source::Source;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What must hold of an artifact before it is handed out.
#[derive(Debug, Clone, Default)]
pub struct FetchPolicy {
    /// A source naming a tag is resolved; otherwise refused.
    pub allow_tag: bool,
    /// When not empty, a signature by one of these over the artifact's digest is required.
    pub keys: PublicKeys,
}

/// A verified component.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// the source pinned to the manifest digest
    pub pinned: Source,
    pub manifest_digest: String,
    /// the component's bytes and where the cache keeps them
    pub wasm: Vec<u8>,
    pub path: PathBuf,
    pub annotations: BTreeMap<String, String>,
    /// the key file that verified its signature
    pub signed_by: Option<PathBuf>,
    /// no registry request was needed
    pub from_cache: bool,
}

#[tracing::instrument(name = "oci.fetch", skip_all, fields(source = %source))]
pub async fn fetch(
    client: &RegistryClient,
    source: &Source,
    cache: &ArtifactCache,
    policy: &FetchPolicy,
) -> Result<Fetched, OciError> {
    let mut from_cache = true;
    let (digest, manifest_bytes) = match &source.digest {
        Some(d) => (d.clone(), cache.manifest(d)?),
        None if !policy.allow_tag => return Err(OciError::TagNotAllowed { reference: source.to_string() }),
        None => {
            let (bytes, digest) = client.manifest(source).await?;
            from_cache = false;
            tracing::info!(source = %source, %digest, "tag resolved to a digest");
            (digest, Some(bytes))
        }
    };
    let pinned = source.at_digest(&digest);
    let manifest_bytes = match manifest_bytes {
        Some(b) => b,
        None => {
            from_cache = false;
            client.manifest(&pinned).await?.0
        }
    };
    let manifest = check_wasm_manifest(&manifest_bytes, &pinned.to_string())?;
    let layer = &manifest.layers[0];
    let limit = client.options().max_layer_bytes;
    if layer.size > limit {
        return Err(OciError::TooLarge { reference: pinned.to_string(), size: layer.size, limit });
    }
    let signed_by = if policy.keys.is_empty() {
        None
    } else {
        let (key, fetched) = verify_signatures(client, &pinned, cache, &policy.keys).await?;
        from_cache &= !fetched;
        Some(key)
    };
    let (wasm, path) = match cache.blob(&layer.digest)? {
        Some(bytes) => (bytes, cache.blob_path(&layer.digest)),
        None => {
            from_cache = false;
            download_layer(client, &pinned, cache, layer).await?
        }
    };
    // Last: a manifest in the cache means its layer (and its signature) are there too.
    cache.put_manifest(&digest, &manifest_bytes)?;
    Ok(Fetched {
        pinned,
        manifest_digest: digest,
        wasm,
        path,
        annotations: manifest.annotations,
        signed_by,
        from_cache,
    })
}

async fn download_layer(
    client: &RegistryClient,
    pinned: &Source,
    cache: &ArtifactCache,
    layer: &Descriptor,
) -> Result<(Vec<u8>, PathBuf), OciError> {
    let tmp = cache.temp_file()?;
    let mut out =
        tokio::fs::File::from_std(tmp.reopen().map_err(|e| OciError::Cache { path: tmp.path().into(), source: e })?);
    // On any error `tmp` is dropped, and removed with it.
    client.blob_into(pinned, layer, client.options().max_layer_bytes, &mut out).await?;
    tokio::io::AsyncWriteExt::flush(&mut out)
        .await
        .map_err(|e| OciError::Cache { path: tmp.path().into(), source: e })?;
    drop(out);
    let path = cache.commit_blob(tmp, &layer.digest)?;
    // Read back through the verifying reader: what is handed out is what the cache holds.
    let wasm = cache.blob(&layer.digest)?.ok_or_else(|| OciError::Cache {
        path: path.clone(),
        source: std::io::Error::other("vanished after it was written"),
    })?;
    Ok((wasm, path))
}

/// The key that verifies a signature of `pinned`'s digest: from the cache's kept signatures
/// first, else from the registry (the tag `sha256-HEX.sig`); and whether the registry was asked.
async fn verify_signatures(
    client: &RegistryClient,
    pinned: &Source,
    cache: &ArtifactCache,
    keys: &PublicKeys,
) -> Result<(PathBuf, bool), OciError> {
    let digest = pinned.digest.clone().unwrap_or_default();
    for kept in cache.signatures(&digest) {
        if let Ok(key) = check_signature(keys, kept.payload.as_bytes(), &kept.signature, &digest) {
            return Ok((key.to_path_buf(), false));
        }
    }
    let refuse = |why: String| OciError::Signature { reference: pinned.to_string(), why };
    let tag = signature_tag(&digest);
    let Some((bytes, _)) = client.manifest_if_any(&pinned.at_tag(&tag)).await? else {
        return Err(refuse(format!("unsigned: no signature at tag {tag}")));
    };
    let manifest: crate::artifact::Manifest =
        serde_json::from_slice(&bytes).map_err(|e| refuse(format!("signature manifest at {tag}: {e}")))?;
    let mut reasons = vec![];
    for layer in manifest.layers.iter().filter(|l| l.media_type == MEDIA_TYPE_SIMPLE_SIGNING) {
        let Some(signature) = layer.annotations.get(ANNOTATION_SIGNATURE) else {
            reasons.push(format!("layer {} has no signature annotation", layer.digest));
            continue;
        };
        let payload = client.small_blob(&pinned.at_tag(&tag), layer).await?;
        match check_signature(keys, &payload, signature, &digest) {
            Ok(key) => {
                let payload = String::from_utf8(payload).map_err(|_| refuse("payload is not UTF-8".into()))?;
                cache.put_signatures(&digest, &[CachedSignature { payload, signature: signature.clone() }])?;
                return Ok((key.to_path_buf(), true));
            }
            Err(why) => reasons.push(why),
        }
    }
    if reasons.is_empty() {
        reasons.push(format!("no {MEDIA_TYPE_SIMPLE_SIGNING} layer at tag {tag}"));
    }
    Err(refuse(reasons.join("; ")))
}
