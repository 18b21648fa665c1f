//! CSI Controller: validates each request as the spec asks, routes it to the backend that
//! owns it, and checks the backend's answer before it reaches Kubernetes. ControllerPublish
//! gives a replicated block volume to one node (the host's own mechanism: it raises the
//! volume's epoch on its replicas, see `docs/replicated-block.md`); for every other attachment
//! kind it checks the volume exists and answers with an empty publish context.
//! ControllerModifyVolume is not offered (no mutable parameters).
//!
//! A call on a node-local backend's volume runs on the node that holds it (`topology`): a
//! controller that is not that node forwards it whole to the node plugin (`peer`) and answers
//! what the node answered; the node runs it here and pins what it made to itself.
use crate::answer;
use crate::convert::{self, bytes};
use crate::driver::{DIGEST_CONTEXT_KEY, Driver, required};
use crate::error::{CsiError, CsiResult};
use crate::guard::{GatePass, Side};
use crate::ids::ObjectId;
use crate::topology::Route;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_proto::csi::v1::controller_server::Controller;
use wasmcsi_runtime::driver::{self as wit, Feature};
use wasmcsi_runtime::store::VolumeRecord;
use wasmcsi_runtime::{Backend, secret_refs};

#[derive(Clone)]
pub struct ControllerService(pub Arc<Driver>);

type Reply<T> = Result<tonic::Response<T>, tonic::Status>;

fn need(backend: &Backend, feature: Feature, what: &str) -> CsiResult<()> {
    if backend.has_feature(feature) {
        Ok(())
    } else {
        Err(CsiError::Unimplemented(format!("backend {} does not support {what}", backend.name)))
    }
}

/// A content source must name an object of the same backend (a volume cannot be cloned
/// across backends: each owns its storage).
fn content_source(d: &Driver, backend: &Backend, src: &csi::VolumeContentSource) -> CsiResult<wit::ContentSource> {
    use csi::volume_content_source::Type;
    let (id, is_snapshot) = match &src.r#type {
        Some(Type::Snapshot(s)) => (required(&s.snapshot_id, "volume_content_source.snapshot.snapshot_id")?, true),
        Some(Type::Volume(v)) => (required(&v.volume_id, "volume_content_source.volume.volume_id")?, false),
        None => return Err(CsiError::Missing("volume_content_source.type")),
    };
    let (owner, oid) =
        d.backend_for_id(id)?.ok_or_else(|| CsiError::NotFound(format!("content source {id} not found")))?;
    if owner.name != backend.name {
        return Err(CsiError::Invalid(format!(
            "content source {id} belongs to backend {}, not {}",
            owner.name, backend.name
        )));
    }
    if is_snapshot {
        Ok(wit::ContentSource::Snapshot(oid.local))
    } else {
        need(backend, Feature::CloneVolume, "cloning volumes")?;
        Ok(wit::ContentSource::Volume(oid.local))
    }
}

/// The capability to ask for a plan with when the CO sent none (unpublish).
fn plain_mount() -> wit::VolumeCapability {
    use wasmcsi_runtime::bindings::types as wt;
    wit::VolumeCapability {
        access_type: wt::AccessType::Mount(wt::MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: wt::AccessMode::SingleNodeWriter,
    }
}

/// The replica sets a backend that planned a replicated block attachment may reach.
fn block_catalog(backend: &Backend) -> CsiResult<&wasmcsi_block::catalog::Catalog> {
    backend.block_catalog().ok_or_else(|| {
        CsiError::FailedPrecondition(format!(
            "backend {} planned a replicated-block attachment but has no block grant ([backends.{}.grants.block])",
            backend.name, backend.name
        ))
    })
}

/// Enter `backend`'s gate on `side` (see `guard`): a creation and a change of an existing
/// object of one backend never run at once, whatever ids the backend gives names. A call
/// waits for the other side at most one backend deadline (what the other side's call can
/// take), then answers ABORTED.
async fn enter(d: &Driver, backend: &Backend, side: Side, what: &str) -> CsiResult<GatePass> {
    d.inflight.gates.enter(&backend.name, side, backend.limits.call_deadline(), what).await
}

/// What a forwarded call may take beyond the backend's own deadline, twice (a creation may
/// wait one deadline at the backend's gate, then run one): the hop and the node's queue.
const FORWARD_MARGIN: Duration = Duration::from_secs(2);

/// The object a content source names, for placement.
fn source_object(src: &csi::VolumeContentSource) -> Option<ObjectId> {
    use csi::volume_content_source::Type;
    match &src.r#type {
        Some(Type::Snapshot(s)) => ObjectId::parse(&s.snapshot_id),
        Some(Type::Volume(v)) => ObjectId::parse(&v.volume_id),
        None => None,
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Page through several backends as one list. Tokens are `BACKEND:INNER`, where INNER is
/// that backend's own token; a token we did not hand out is ABORTED, as the spec asks.
async fn paged<T, F, Fut>(
    op: &'static str,
    backends: Vec<Arc<Backend>>,
    max_entries: i32,
    token: &str,
    fetch: F,
) -> CsiResult<(Vec<T>, String)>
where
    F: Fn(Arc<Backend>, u32, String) -> Fut,
    Fut: Future<Output = CsiResult<(Vec<T>, String)>>,
{
    let max = page_size(max_entries)?;
    let (mut index, mut inner) = if token.is_empty() {
        (0, String::new())
    } else {
        let (name, inner) =
            token.split_once(':').ok_or_else(|| CsiError::InvalidToken(format!("invalid starting_token {token:?}")))?;
        let i = backends
            .iter()
            .position(|b| b.name == name)
            .ok_or_else(|| CsiError::InvalidToken(format!("invalid starting_token {token:?}")))?;
        (i, inner.to_string())
    };
    let mut out = Vec::new();
    while index < backends.len() {
        let remaining = max - u32::try_from(out.len()).unwrap_or(max);
        let backend = backends[index].clone();
        let name = backend.name.clone();
        let (mut entries, next) = fetch(backend.clone(), remaining, std::mem::take(&mut inner)).await?;
        answer::page(&backend, op, &entries, &next, remaining)?;
        out.append(&mut entries);
        if !next.is_empty() {
            return Ok((out, format!("{name}:{next}")));
        }
        index += 1;
        if out.len() >= max as usize {
            return Ok((out, backends.get(index).map(|b| format!("{}:", b.name)).unwrap_or_default()));
        }
    }
    Ok((out, String::new()))
}

/// The page size the host asks backends for: the CO's limit, at most
/// [`answer::MAX_PAGE_ENTRIES`] (also when it set none: the spec lets the plugin page then),
/// so one answer stays one small gRPC message.
fn page_size(max_entries: i32) -> CsiResult<u32> {
    let max = u32::try_from(max_entries).map_err(|_| CsiError::Invalid("max_entries must not be negative".into()))?;
    Ok(if max == 0 { answer::MAX_PAGE_ENTRIES } else { max.min(answer::MAX_PAGE_ENTRIES) })
}

/// Where a ListVolumes listing goes on within one backend's volumes.
enum Cursor {
    /// the backend's own page token ("": its first page)
    Backend(String),
    /// the host's journal of the backend's volumes, after this many
    Journal(usize),
}

/// A ListVolumes token: `NAME:INNER` (backend NAME's own token INNER) or `NAME/N` (its
/// volumes in the host's journal from the N-th on). Backend names hold neither ':' nor '/'.
fn volume_token(name: &str, cursor: &Cursor) -> String {
    match cursor {
        Cursor::Backend(inner) => format!("{name}:{inner}"),
        Cursor::Journal(n) => format!("{name}/{n}"),
    }
}

/// The backend (its index in `names`) and cursor a token names; a token we did not hand out
/// is ABORTED, as the spec asks.
fn parse_volume_token(token: &str, names: &[String]) -> CsiResult<(usize, Cursor)> {
    if token.is_empty() {
        return Ok((0, Cursor::Backend(String::new())));
    }
    let invalid = || CsiError::InvalidToken(format!("invalid starting_token {token:?}"));
    let at = token.find([':', '/']).ok_or_else(invalid)?;
    let (name, rest) = (&token[..at], &token[at + 1..]);
    let cursor = if token[at..].starts_with(':') {
        Cursor::Backend(rest.to_string())
    } else {
        Cursor::Journal(rest.parse().map_err(|_| invalid())?)
    };
    let index = names.iter().position(|n| n == name).ok_or_else(invalid)?;
    Ok((index, cursor))
}

/// One entry of a backend's ListVolumes page, checked.
fn volume_entry(b: &Backend, e: &wit::VolumeStatus) -> CsiResult<csi::list_volumes_response::Entry> {
    Ok(csi::list_volumes_response::Entry {
        volume: Some(answer::volume(b, "list_volumes", &e.volume, None)?),
        status: Some(csi::list_volumes_response::VolumeStatus {
            published_node_ids: vec![],
            volume_condition: e.condition.as_ref().map(answer::condition),
        }),
    })
}

impl ControllerService {
    /// Forward one call of `backend` to node `node`'s plugin (see `peer`).
    async fn forward<Req, Resp, F, Fut>(
        &self,
        node: &str,
        backend: &Backend,
        method: &'static str,
        req: Req,
        f: F,
    ) -> CsiResult<Resp>
    where
        F: FnOnce(ControllerClient<tonic::transport::Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let peers = self.0.node_local.peers.as_ref().ok_or_else(|| {
            CsiError::Internal(format!("a call for node {node} to forward, but no node plugins are configured"))
        })?;
        let timeout = backend.limits.call_deadline() * 2 + FORWARD_MARGIN;
        peers.call(node, method, timeout, req, f).await
    }

    /// A snapshot a node-local backend made here, its ids pinned to this node.
    fn pin_snapshot(&self, backend: &Backend, mut s: csi::Snapshot) -> CsiResult<csi::Snapshot> {
        s.snapshot_id = self.0.pin_id(backend, &s.snapshot_id)?;
        s.source_volume_id = self.0.pin_id(backend, &s.source_volume_id)?;
        Ok(s)
    }

    async fn create_volume(&self, req: csi::CreateVolumeRequest) -> CsiResult<csi::CreateVolumeResponse> {
        let d = &self.0;
        let name = required(&req.name, "name")?.to_string();
        crate::ids::check_name("name", &name)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::Missing("volume_capabilities"));
        }
        let capabilities = convert::capabilities(&req.volume_capabilities)?;
        let capacity = convert::capacity(req.capacity_range.as_ref())?;
        let (backend, parameters) = d.backend_for_parameters(&req.parameters)?;
        need(&backend, Feature::CreateDeleteVolume, "creating volumes")?;
        let source_oid = req.volume_content_source.as_ref().and_then(source_object);
        if let Route::Node(node) =
            d.route_create(&backend, req.accessibility_requirements.as_ref(), source_oid.as_ref()).await?
        {
            return self
                .forward(&node, &backend, "CreateVolume", req, |mut c, r| async move { c.create_volume(r).await })
                .await;
        }
        let source = req.volume_content_source.as_ref().map(|s| content_source(d, &backend, s)).transpose()?;
        let _guard = d.inflight.try_start(format!("create-volume/{name}"))?;
        let _pass = enter(d, &backend, Side::Create, &format!("volume {name}")).await?;

        let secrets = convert::secrets(&req.secrets);
        let request = wit::CreateVolumeRequest {
            name: name.clone(),
            capacity,
            capabilities,
            parameters,
            secrets: secret_refs(&secrets),
            content_source: source,
            accessibility: req.accessibility_requirements.as_ref().map(|t| wit::TopologyRequirement {
                requisite: t.requisite.iter().map(convert::topology).collect(),
                preferred: t.preferred.iter().map(convert::topology).collect(),
            }),
        };
        let created = backend.create_volume(request, secrets).await?;
        let mut volume = answer::created(&backend, &created, &capacity)?;
        d.pin_volume(&backend, &mut volume)?;

        // The first creation records which build made the volume; retries keep that record.
        let store = &d.registry.runtime().store;
        let internal = |e: wasmcsi_runtime::store::StoreError| CsiError::Internal(e.to_string());
        let digest = match store.volume(&volume.volume_id).map_err(internal)? {
            Some(r) => r.digest,
            None => {
                let record = VolumeRecord {
                    backend: backend.name.clone(),
                    digest: backend.digest.clone(),
                    capacity_bytes: created.capacity_bytes,
                    created_at: now_secs(),
                };
                store.record_volume(&volume.volume_id, &record).map_err(internal)?;
                record.digest
            }
        };
        volume.volume_context.insert(DIGEST_CONTEXT_KEY.into(), digest);
        volume.content_source = req.volume_content_source;
        tracing::info!(volume.id = %volume.volume_id, bytes = volume.capacity_bytes, "volume ready");
        Ok(csi::CreateVolumeResponse { volume: Some(volume) })
    }

    async fn delete_volume(&self, req: csi::DeleteVolumeRequest) -> CsiResult<csi::DeleteVolumeResponse> {
        let d = &self.0;
        let id = required(&req.volume_id, "volume_id")?;
        // An id that cannot be ours names no volume: deleting it succeeds (idempotency).
        let Some((backend, oid)) = d.backend_for_id(id)? else { return Ok(csi::DeleteVolumeResponse {}) };
        need(&backend, Feature::CreateDeleteVolume, "deleting volumes")?;
        if let Route::Node(node) = d.route_object(&backend, &oid).await? {
            return self
                .forward(&node, &backend, "DeleteVolume", req, |mut c, r| async move { c.delete_volume(r).await })
                .await;
        }
        let _guard = d.inflight.try_start(id.to_string())?;
        let _pass = enter(d, &backend, Side::Existing, id).await?;
        backend.delete_volume(oid.local, convert::secrets(&req.secrets)).await?;
        d.registry.runtime().store.forget_volume(id).map_err(|e| CsiError::Internal(e.to_string()))?;
        tracing::info!(volume.id = %id, "volume deleted");
        Ok(csi::DeleteVolumeResponse {})
    }

    async fn validate(
        &self,
        req: csi::ValidateVolumeCapabilitiesRequest,
    ) -> CsiResult<csi::ValidateVolumeCapabilitiesResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::Missing("volume_capabilities"));
        }
        let caps = convert::capabilities(&req.volume_capabilities)?;
        let (backend, oid) =
            self.0.backend_for_id(id)?.ok_or_else(|| CsiError::NotFound(format!("volume {id} not found")))?;
        if let Route::Node(node) = self.0.route_object(&backend, &oid).await? {
            return self
                .forward(&node, &backend, "ValidateVolumeCapabilities", req, |mut c, r| async move {
                    c.validate_volume_capabilities(r).await
                })
                .await;
        }
        let mut params = req.parameters.clone();
        params.remove(crate::driver::BACKEND_PARAMETER);
        let mut context = req.volume_context.clone();
        context.remove(DIGEST_CONTEXT_KEY);
        let verdict = backend
            .validate_volume_capabilities(oid.local, convert::pairs(&context), caps, convert::pairs(&params))
            .await?;
        Ok(match verdict {
            None => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: Default::default(),
                }),
                message: String::new(),
            },
            Some(message) => {
                csi::ValidateVolumeCapabilitiesResponse { confirmed: None, message: answer::message(&message) }
            }
        })
    }

    fn capable(&self, f: Feature) -> Vec<Arc<Backend>> {
        self.0.registry.all().into_iter().filter(|b| b.has_feature(f)).collect()
    }

    /// Every backend's volumes, one backend after another. A backend that fails on its first
    /// page, or is not loaded while the host's journal records volumes of it, does not take
    /// the listing down, and its volumes do not vanish: they come from the journal, marked
    /// abnormal with why (the CO's health monitor shows that as the volume's condition).
    async fn list_volumes(&self, req: csi::ListVolumesRequest) -> CsiResult<csi::ListVolumesResponse> {
        let d = &self.0;
        let store = &d.registry.runtime().store;
        let loaded = self.capable(Feature::ListVolumes);
        let mut names: std::collections::BTreeSet<String> = loaded.iter().map(|b| b.name.clone()).collect();
        let journal = store.backends_with_volumes().map_err(|e| CsiError::Internal(e.to_string()))?;
        names.extend(journal.into_iter().filter(|n| d.registry.get(n).is_none()));
        let names: Vec<String> = names.into_iter().collect();
        let max = page_size(req.max_entries)?;
        let (mut index, mut cursor) = parse_volume_token(&req.starting_token, &names)?;
        let mut entries = Vec::new();
        while index < names.len() {
            let name = &names[index];
            let remaining = max - u32::try_from(entries.len()).unwrap_or(max);
            let backend = loaded.iter().find(|b| &b.name == name);
            let not_loaded = || format!("backend {name} is not loaded on this host; listed from the host's journal");
            let (mut got, next) = match (backend, std::mem::replace(&mut cursor, Cursor::Backend(String::new()))) {
                (Some(b), Cursor::Backend(inner)) => {
                    let first = inner.is_empty();
                    match b.list_volumes(remaining, inner).await {
                        Ok(page) => {
                            answer::page(b, "list_volumes", &page.entries, &page.next_token, remaining)?;
                            let got = page
                                .entries
                                .iter()
                                .map(|e| {
                                    let mut entry = volume_entry(b, e)?;
                                    if let Some(v) = entry.volume.as_mut() {
                                        d.pin_volume(b, v)?;
                                    }
                                    Ok(entry)
                                })
                                .collect::<CsiResult<Vec<_>>>()?;
                            (got, (!page.next_token.is_empty()).then_some(Cursor::Backend(page.next_token)))
                        }
                        Err(e) if first => {
                            let why = format!("not listed by its backend ({e}); listed from the host's journal");
                            self.journal_page(name, 0, remaining, &why)?
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                (Some(_), Cursor::Journal(from)) => {
                    self.journal_page(name, from, remaining, &format!("backend {name} did not list its volumes"))?
                }
                (None, Cursor::Journal(from)) => self.journal_page(name, from, remaining, &not_loaded())?,
                (None, Cursor::Backend(inner)) if inner.is_empty() => {
                    self.journal_page(name, 0, remaining, &not_loaded())?
                }
                (None, Cursor::Backend(_)) => {
                    return Err(CsiError::InvalidToken(format!("invalid starting_token {:?}", req.starting_token)));
                }
            };
            entries.append(&mut got);
            if let Some(next) = next {
                return Ok(csi::ListVolumesResponse { entries, next_token: volume_token(name, &next) });
            }
            index += 1;
            if entries.len() >= max as usize {
                let next_token = names.get(index).map(|n| volume_token(n, &Cursor::Backend(String::new())));
                return Ok(csi::ListVolumesResponse { entries, next_token: next_token.unwrap_or_default() });
            }
        }
        Ok(csi::ListVolumesResponse { entries, next_token: String::new() })
    }

    /// Up to `take` of the volumes the journal records for backend `name` from the `from`-th,
    /// each abnormal for `why`; and where to go on from, if more are left.
    fn journal_page(
        &self,
        name: &str,
        from: usize,
        take: u32,
        why: &str,
    ) -> CsiResult<(Vec<csi::list_volumes_response::Entry>, Option<Cursor>)> {
        let store = &self.0.registry.runtime().store;
        let mut records =
            store.volumes_of(name, from, take as usize + 1).map_err(|e| CsiError::Internal(e.to_string()))?;
        let next = (records.len() > take as usize).then(|| Cursor::Journal(from + take as usize));
        records.truncate(take as usize);
        let condition = csi::VolumeCondition { abnormal: true, message: answer::message(why) };
        let entries = records
            .into_iter()
            .map(|(volume_id, record)| csi::list_volumes_response::Entry {
                volume: Some(csi::Volume {
                    capacity_bytes: bytes(record.capacity_bytes),
                    volume_context: [(DIGEST_CONTEXT_KEY.to_string(), record.digest)].into(),
                    volume_id,
                    content_source: None,
                    accessible_topology: vec![],
                }),
                status: Some(csi::list_volumes_response::VolumeStatus {
                    published_node_ids: vec![],
                    volume_condition: Some(condition.clone()),
                }),
            })
            .collect();
        Ok((entries, next))
    }

    async fn get_capacity(&self, req: csi::GetCapacityRequest) -> CsiResult<csi::GetCapacityResponse> {
        let caps = convert::capabilities(&req.volume_capabilities)?;
        let topology = req.accessible_topology.as_ref().map(convert::topology);
        // With a StorageClass: that backend. Without one: the sum over every backend that
        // reports capacity, so a bare GetCapacity still answers.
        let (backends, params) = if req.parameters.contains_key(crate::driver::BACKEND_PARAMETER) {
            let (b, p) = self.0.backend_for_parameters(&req.parameters)?;
            need(&b, Feature::GetCapacity, "GetCapacity")?;
            (vec![b], p)
        } else {
            (self.capable(Feature::GetCapacity), convert::pairs(&req.parameters))
        };
        let single = backends.len() == 1 && req.parameters.contains_key(crate::driver::BACKEND_PARAMETER);
        if single && let Some(elsewhere) = self.capacity_elsewhere(&backends[0], &req).await? {
            return Ok(elsewhere);
        }
        let mut total = wit::Capacity { available_bytes: 0, maximum_volume_bytes: 0, minimum_volume_bytes: 0 };
        // Every backend at once: a hung one costs its deadline, not the sum of all of them.
        let answers = futures::future::join_all(backends.iter().map(|b| {
            let (caps, params, topology) = (caps.clone(), params.clone(), topology.clone());
            async move {
                let c = b.get_capacity(caps, params, topology).await?;
                answer::capacity(b, &c).map(|()| c)
            }
        }))
        .await;
        for (b, answer) in backends.iter().zip(answers) {
            match answer {
                Ok(c) => {
                    total.available_bytes = total.available_bytes.saturating_add(c.available_bytes);
                    total.maximum_volume_bytes = total.maximum_volume_bytes.max(c.maximum_volume_bytes);
                    total.minimum_volume_bytes = c.minimum_volume_bytes;
                }
                Err(e) if single => return Err(e),
                Err(e) => tracing::debug!(backend = %b.name, "capacity not counted: {e}"),
            }
        }
        Ok(csi::GetCapacityResponse {
            available_capacity: bytes(total.available_bytes),
            maximum_volume_size: (total.maximum_volume_bytes > 0).then(|| bytes(total.maximum_volume_bytes)),
            minimum_volume_size: (single && total.minimum_volume_bytes > 0).then(|| bytes(total.minimum_volume_bytes)),
        })
    }

    /// GetCapacity of a node-local backend, per node: the node the topology names answers for
    /// itself (forwarded there unless it is this one); a node no plugin answers for has none;
    /// without a node, a controller sums every node's. `None`: this host answers, here.
    async fn capacity_elsewhere(
        &self,
        backend: &Backend,
        req: &csi::GetCapacityRequest,
    ) -> CsiResult<Option<csi::GetCapacityResponse>> {
        let d = &self.0;
        if !crate::topology::is_node_local(backend) {
            return Ok(None);
        }
        let asked = req.accessible_topology.as_ref().and_then(|t| t.segments.get(crate::driver::TOPOLOGY_NODE_KEY));
        let peers = d.node_local.peers.as_ref();
        let forward = |node: String| {
            let mut req = req.clone();
            req.accessible_topology = Some(crate::topology::node_topology(&node));
            async move {
                self.forward(&node, backend, "GetCapacity", req, |mut c, r| async move { c.get_capacity(r).await })
                    .await
            }
        };
        match (asked, peers) {
            (Some(node), _) if d.mode.node() && *node == d.node_id => Ok(None),
            (Some(node), Some(p)) if p.knows(node).await => forward(node.clone()).await.map(Some),
            (Some(_), _) => Ok(Some(csi::GetCapacityResponse::default())),
            (None, Some(p)) if !d.mode.node() => {
                let answers = futures::future::join_all(p.node_names().await.into_iter().map(forward)).await;
                let mut total = csi::GetCapacityResponse::default();
                for answer in answers {
                    match answer {
                        Ok(c) => {
                            total.available_capacity = total.available_capacity.saturating_add(c.available_capacity);
                            total.maximum_volume_size = total.maximum_volume_size.max(c.maximum_volume_size);
                        }
                        Err(e) => tracing::debug!(backend = %backend.name, "a node's capacity not counted: {e}"),
                    }
                }
                Ok(Some(total))
            }
            (None, _) => Ok(None),
        }
    }

    async fn create_snapshot(&self, req: csi::CreateSnapshotRequest) -> CsiResult<csi::CreateSnapshotResponse> {
        let d = &self.0;
        let source = required(&req.source_volume_id, "source_volume_id")?;
        let name = required(&req.name, "name")?.to_string();
        crate::ids::check_name("name", &name)?;
        let (backend, oid) =
            d.backend_for_id(source)?.ok_or_else(|| CsiError::NotFound(format!("source volume {source} not found")))?;
        need(&backend, Feature::CreateDeleteSnapshot, "snapshots")?;
        if let Route::Node(node) = d.route_object(&backend, &oid).await? {
            return self
                .forward(&node, &backend, "CreateSnapshot", req, |mut c, r| async move { c.create_snapshot(r).await })
                .await;
        }
        let _guard = d.inflight.try_start(format!("create-snapshot/{name}"))?;
        let _pass = enter(d, &backend, Side::Create, &format!("snapshot {name}")).await?;
        let mut params = req.parameters.clone();
        params.remove(crate::driver::BACKEND_PARAMETER);
        let local_source = oid.local.clone();
        let s =
            backend.create_snapshot(name, oid.local, convert::pairs(&params), convert::secrets(&req.secrets)).await?;
        if s.source_volume_id != local_source {
            return Err(backend
                .reject_output(
                    "create_snapshot",
                    format!("snapshotted {} instead of {local_source}", s.source_volume_id),
                )
                .into());
        }
        let snapshot = self.pin_snapshot(&backend, answer::snapshot(&backend, "create_snapshot", &s)?)?;
        Ok(csi::CreateSnapshotResponse { snapshot: Some(snapshot) })
    }

    async fn delete_snapshot(&self, req: csi::DeleteSnapshotRequest) -> CsiResult<csi::DeleteSnapshotResponse> {
        let id = required(&req.snapshot_id, "snapshot_id")?;
        let Some((backend, oid)) = self.0.backend_for_id(id)? else { return Ok(csi::DeleteSnapshotResponse {}) };
        need(&backend, Feature::CreateDeleteSnapshot, "snapshots")?;
        if let Route::Node(node) = self.0.route_object(&backend, &oid).await? {
            return self
                .forward(&node, &backend, "DeleteSnapshot", req, |mut c, r| async move { c.delete_snapshot(r).await })
                .await;
        }
        let _guard = self.0.inflight.try_start(id.to_string())?;
        let _pass = enter(&self.0, &backend, Side::Existing, id).await?;
        backend.delete_snapshot(oid.local, convert::secrets(&req.secrets)).await?;
        Ok(csi::DeleteSnapshotResponse {})
    }

    async fn list_snapshots(&self, req: csi::ListSnapshotsRequest) -> CsiResult<csi::ListSnapshotsResponse> {
        // A filter routes to one backend; an id that cannot be ours matches nothing.
        let filter_id = [&req.snapshot_id, &req.source_volume_id].into_iter().find(|s| !s.is_empty());
        let (backends, snap, vol) =
            match filter_id {
                Some(id) => match self.0.backend_for_id(id)? {
                    Some((b, oid)) => {
                        if let Route::Node(node) = self.0.route_object(&b, &oid).await? {
                            return self
                                .forward(&node, &b, "ListSnapshots", req, |mut c, r| async move {
                                    c.list_snapshots(r).await
                                })
                                .await;
                        }
                        let snap = (!req.snapshot_id.is_empty()).then(|| oid.local.clone());
                        let vol = if req.source_volume_id.is_empty() {
                            None
                        } else {
                            match ObjectId::parse(&req.source_volume_id) {
                                Some(v) if v.backend == b.name => Some(v.local),
                                _ => return Ok(csi::ListSnapshotsResponse::default()),
                            }
                        };
                        (vec![b], snap, vol)
                    }
                    None => return Ok(csi::ListSnapshotsResponse::default()),
                },
                None => (self.capable(Feature::ListSnapshots), None, None),
            };
        let backends: Vec<_> = backends.into_iter().filter(|b| b.has_feature(Feature::ListSnapshots)).collect();
        let (entries, next_token) =
            paged("list_snapshots", backends, req.max_entries, &req.starting_token, |b, max, token| {
                let (snap, vol) = (snap.clone(), vol.clone());
                async move {
                    let page = b.list_snapshots(snap, vol, max, token).await?;
                    let entries = page
                        .entries
                        .iter()
                        .map(|s| {
                            Ok(csi::list_snapshots_response::Entry {
                                snapshot: Some(self.pin_snapshot(&b, answer::snapshot(&b, "list_snapshots", s)?)?),
                            })
                        })
                        .collect::<CsiResult<Vec<_>>>()?;
                    Ok((entries, page.next_token))
                }
            })
            .await?;
        Ok(csi::ListSnapshotsResponse { entries, next_token })
    }

    /// GetSnapshot. A backend with the `get-snapshot` feature answers it; one that only lists
    /// snapshots (a guest of an older contract) is asked for the list filtered by the id. Either
    /// way the answer must be the snapshot asked for: a backend that answers another one is
    /// refused (INTERNAL), never passed on as if it were the one the CO named.
    async fn get_snapshot(&self, req: csi::GetSnapshotRequest) -> CsiResult<csi::GetSnapshotResponse> {
        let id = required(&req.snapshot_id, "snapshot_id")?;
        let not_found = || CsiError::NotFound(format!("snapshot {id} not found"));
        // An id that cannot be ours names no snapshot.
        let (backend, oid) = self.0.backend_for_id(id)?.ok_or_else(not_found)?;
        if let Route::Node(node) = self.0.route_object(&backend, &oid).await? {
            return self
                .forward(&node, &backend, "GetSnapshot", req, |mut c, r| async move { c.get_snapshot(r).await })
                .await;
        }
        let found = if backend.has_feature(Feature::GetSnapshot) {
            backend.get_snapshot(oid.local.clone()).await?
        } else {
            need(&backend, Feature::ListSnapshots, "GetSnapshot")?;
            let page = backend.list_snapshots(Some(oid.local.clone()), None, 1, String::new()).await?;
            page.entries.into_iter().find(|s| s.snapshot_id == oid.local).ok_or_else(not_found)?
        };
        if found.snapshot_id != oid.local {
            return Err(backend
                .reject_output("get_snapshot", format!("answered snapshot {} for {}", found.snapshot_id, oid.local))
                .into());
        }
        let snapshot = self.pin_snapshot(&backend, answer::snapshot(&backend, "get_snapshot", &found)?)?;
        Ok(csi::GetSnapshotResponse { snapshot: Some(snapshot) })
    }

    async fn expand(&self, req: csi::ControllerExpandVolumeRequest) -> CsiResult<csi::ControllerExpandVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let range = convert::capacity(Some(req.capacity_range.as_ref().ok_or(CsiError::Missing("capacity_range"))?))?;
        let capability = req.volume_capability.as_ref().map(convert::capability).transpose()?;
        let (backend, oid) =
            self.0.backend_for_id(id)?.ok_or_else(|| CsiError::NotFound(format!("volume {id} not found")))?;
        need(&backend, Feature::ExpandVolume, "expansion")?;
        if let Route::Node(node) = self.0.route_object(&backend, &oid).await? {
            return self
                .forward(&node, &backend, "ControllerExpandVolume", req, |mut c, r| async move {
                    c.controller_expand_volume(r).await
                })
                .await;
        }
        let _guard = self.0.inflight.try_start(id.to_string())?;
        let _pass = enter(&self.0, &backend, Side::Existing, id).await?;
        let e = backend.expand_volume(oid.local, range, capability, convert::secrets(&req.secrets)).await?;
        Ok(csi::ControllerExpandVolumeResponse {
            capacity_bytes: answer::expansion(&backend, &e, &range)?,
            node_expansion_required: e.node_expansion_required,
        })
    }

    /// The volume's attachment plan, asked of its backend; `None` for an id that cannot be
    /// ours (a malformed id, or one its backend does not know).
    async fn plan_of(
        &self,
        id: &str,
        context: &std::collections::HashMap<String, String>,
        cap: wit::VolumeCapability,
    ) -> CsiResult<Option<(Arc<Backend>, wit::Attachment)>> {
        let Some((backend, oid)) = self.0.backend_for_id(id)? else { return Ok(None) };
        let mut context = context.clone();
        context.remove(DIGEST_CONTEXT_KEY);
        match backend.attach_plan(oid.local, convert::pairs(&context), cap).await {
            Ok(plan) => Ok(Some((backend, plan))),
            Err(wasmcsi_runtime::CallError::Backend { error: wasmcsi_runtime::WitError::NotFound(_), .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn publish(
        &self,
        req: csi::ControllerPublishVolumeRequest,
    ) -> CsiResult<csi::ControllerPublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let node = required(&req.node_id, "node_id")?;
        let cap = convert::capability(req.volume_capability.as_ref().ok_or(CsiError::Missing("volume_capability"))?)?;
        if let Some((backend, oid)) = self.0.backend_for_id(id)?
            && let Route::Node(at) = self.0.route_object(&backend, &oid).await?
        {
            return self
                .forward(&at, &backend, "ControllerPublishVolume", req, |mut c, r| async move {
                    c.controller_publish_volume(r).await
                })
                .await;
        }
        let _guard = self.0.inflight.try_start(id.to_string())?;
        let (backend, plan) = self
            .plan_of(id, &req.volume_context, cap)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} not found")))?;
        if let wit::Attachment::ReplicatedBlock(p) = plan {
            let catalog = block_catalog(&backend)?;
            catalog.claim(&p.volume_id, node).await?;
            tracing::info!(volume.id = %id, node, "replicated volume published");
        }
        Ok(csi::ControllerPublishVolumeResponse { publish_context: Default::default() })
    }

    async fn unpublish(
        &self,
        req: csi::ControllerUnpublishVolumeRequest,
    ) -> CsiResult<csi::ControllerUnpublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        if let Some((backend, oid)) = self.0.backend_for_id(id)?
            && let Route::Node(at) = self.0.route_object(&backend, &oid).await?
        {
            return self
                .forward(&at, &backend, "ControllerUnpublishVolume", req, |mut c, r| async move {
                    c.controller_unpublish_volume(r).await
                })
                .await;
        }
        let _guard = self.0.inflight.try_start(id.to_string())?;
        // A volume that is gone is unpublished everywhere.
        let Some((backend, plan)) = self.plan_of(id, &Default::default(), plain_mount()).await? else {
            return Ok(csi::ControllerUnpublishVolumeResponse {});
        };
        if let wit::Attachment::ReplicatedBlock(p) = plan {
            let catalog = block_catalog(&backend)?;
            // An empty node id means every node (the spec's unpublish from all).
            let node = (!req.node_id.is_empty()).then_some(req.node_id.as_str());
            catalog.release(&p.volume_id, node).await?;
            tracing::info!(volume.id = %id, node = ?node, "replicated volume unpublished");
        }
        Ok(csi::ControllerUnpublishVolumeResponse {})
    }

    async fn get_volume(&self, req: csi::ControllerGetVolumeRequest) -> CsiResult<csi::ControllerGetVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let (backend, oid) =
            self.0.backend_for_id(id)?.ok_or_else(|| CsiError::NotFound(format!("volume {id} not found")))?;
        need(&backend, Feature::GetVolume, "ControllerGetVolume")?;
        if let Route::Node(node) = self.0.route_object(&backend, &oid).await? {
            return self
                .forward(&node, &backend, "ControllerGetVolume", req, |mut c, r| async move {
                    c.controller_get_volume(r).await
                })
                .await;
        }
        let st = backend.get_volume(oid.local.clone()).await?;
        let mut volume = answer::volume(&backend, "get_volume", &st.volume, Some(oid.local.as_str()))?;
        self.0.pin_volume(&backend, &mut volume)?;
        Ok(csi::ControllerGetVolumeResponse {
            volume: Some(volume),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: vec![],
                volume_condition: st.condition.as_ref().map(answer::condition),
            }),
        })
    }
}

/// What the controller offers; per backend, a missing feature is answered UNIMPLEMENTED.
pub fn controller_capabilities() -> Vec<csi::ControllerServiceCapability> {
    use csi::controller_service_capability::{Rpc, Type, rpc::Type as R};
    [
        R::CreateDeleteVolume,
        R::PublishUnpublishVolume,
        R::CreateDeleteSnapshot,
        R::ListSnapshots,
        R::GetSnapshot,
        R::CloneVolume,
        R::ExpandVolume,
        R::GetCapacity,
        R::ListVolumes,
        R::GetVolume,
        R::VolumeCondition,
        R::SingleNodeMultiWriter,
    ]
    .into_iter()
    .map(|t| csi::ControllerServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
    .collect()
}

#[tonic::async_trait]
impl Controller for ControllerService {
    #[tracing::instrument(name = "csi.create_volume", skip_all, fields(volume.name = %r.get_ref().name))]
    async fn create_volume(&self, r: tonic::Request<csi::CreateVolumeRequest>) -> Reply<csi::CreateVolumeResponse> {
        self.0.observe("CreateVolume", Self::create_volume(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.delete_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn delete_volume(&self, r: tonic::Request<csi::DeleteVolumeRequest>) -> Reply<csi::DeleteVolumeResponse> {
        self.0.observe("DeleteVolume", Self::delete_volume(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_publish_volume", skip_all, fields(volume.id = %r.get_ref().volume_id, node.id = %r.get_ref().node_id))]
    async fn controller_publish_volume(
        &self,
        r: tonic::Request<csi::ControllerPublishVolumeRequest>,
    ) -> Reply<csi::ControllerPublishVolumeResponse> {
        self.0.observe("ControllerPublishVolume", self.publish(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_unpublish_volume", skip_all, fields(volume.id = %r.get_ref().volume_id, node.id = %r.get_ref().node_id))]
    async fn controller_unpublish_volume(
        &self,
        r: tonic::Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Reply<csi::ControllerUnpublishVolumeResponse> {
        self.0.observe("ControllerUnpublishVolume", self.unpublish(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.validate_volume_capabilities", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn validate_volume_capabilities(
        &self,
        r: tonic::Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Reply<csi::ValidateVolumeCapabilitiesResponse> {
        self.0.observe("ValidateVolumeCapabilities", self.validate(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.list_volumes", skip_all)]
    async fn list_volumes(&self, r: tonic::Request<csi::ListVolumesRequest>) -> Reply<csi::ListVolumesResponse> {
        self.0.observe("ListVolumes", Self::list_volumes(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.get_capacity", skip_all)]
    async fn get_capacity(&self, r: tonic::Request<csi::GetCapacityRequest>) -> Reply<csi::GetCapacityResponse> {
        self.0.observe("GetCapacity", Self::get_capacity(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_get_capabilities", skip_all)]
    async fn controller_get_capabilities(
        &self,
        _: tonic::Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Reply<csi::ControllerGetCapabilitiesResponse> {
        self.0
            .observe("ControllerGetCapabilities", async {
                Ok(csi::ControllerGetCapabilitiesResponse { capabilities: controller_capabilities() })
            })
            .await
    }
    #[tracing::instrument(name = "csi.create_snapshot", skip_all, fields(snapshot.name = %r.get_ref().name))]
    async fn create_snapshot(
        &self,
        r: tonic::Request<csi::CreateSnapshotRequest>,
    ) -> Reply<csi::CreateSnapshotResponse> {
        self.0.observe("CreateSnapshot", Self::create_snapshot(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.delete_snapshot", skip_all, fields(snapshot.id = %r.get_ref().snapshot_id))]
    async fn delete_snapshot(
        &self,
        r: tonic::Request<csi::DeleteSnapshotRequest>,
    ) -> Reply<csi::DeleteSnapshotResponse> {
        self.0.observe("DeleteSnapshot", Self::delete_snapshot(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.list_snapshots", skip_all)]
    async fn list_snapshots(&self, r: tonic::Request<csi::ListSnapshotsRequest>) -> Reply<csi::ListSnapshotsResponse> {
        self.0.observe("ListSnapshots", Self::list_snapshots(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.get_snapshot", skip_all, fields(snapshot.id = %r.get_ref().snapshot_id))]
    async fn get_snapshot(&self, r: tonic::Request<csi::GetSnapshotRequest>) -> Reply<csi::GetSnapshotResponse> {
        self.0.observe("GetSnapshot", Self::get_snapshot(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_expand_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn controller_expand_volume(
        &self,
        r: tonic::Request<csi::ControllerExpandVolumeRequest>,
    ) -> Reply<csi::ControllerExpandVolumeResponse> {
        self.0.observe("ControllerExpandVolume", self.expand(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_get_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn controller_get_volume(
        &self,
        r: tonic::Request<csi::ControllerGetVolumeRequest>,
    ) -> Reply<csi::ControllerGetVolumeResponse> {
        self.0.observe("ControllerGetVolume", self.get_volume(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_modify_volume", skip_all)]
    async fn controller_modify_volume(
        &self,
        _: tonic::Request<csi::ControllerModifyVolumeRequest>,
    ) -> Reply<csi::ControllerModifyVolumeResponse> {
        self.0
            .observe("ControllerModifyVolume", async {
                Err(CsiError::Unimplemented("MODIFY_VOLUME is not offered".into()))
            })
            .await
    }
}
