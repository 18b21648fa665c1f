//! Guests built against `wasmcsi:backend@0.1.0`: what their exports answer, in the current
//! types. Owns the conversions between 0.1.0's `driver` records and the current ones (every
//! other type is shared, see [`crate::bindings::v0_1`]) and the exports 0.1.0 lacks:
//! - `get-snapshot` is answered from `list-snapshots` filtered by the id (NOT_FOUND when no
//!   entry has it), and a backend that lists snapshots is given the `get-snapshot` feature;
//! - `reconcile-volume`, `modify-volume` and the group snapshot exports are `unimplemented`
//!   without calling the guest, as they are for a current backend without the feature: a 0.1.0
//!   backend never has those features, so the host never asks it;
//! - `attach-plan` is called without the secrets 0.1.0 cannot take, and a create request
//!   carrying `mutable-parameters` (which 0.1.0 cannot take either) is invalid-argument;
//! - a `replicated-block` attach plan has no filesystem of its own (`fs-type` ""; the node's
//!   default), and no plan asks for a frontend or encryption.
//!
//! 0.1.0's `rbd` is 0.2.0's, served by `compat::v0_2`'s adapter; its `block` import is never
//! served (`contract::BLOCK_REFUSED`): it had no provider, so no 0.1.0 backend can have used it.
use super::convert::{cases, record};
use super::driver::{CallFuture, Driver};
use super::lend::forward;
use super::{lacks, refuse_mutable_parameters};
use crate::bindings::driver::{
    self as new, Attachment, Capacity, CapacityRange, Expansion, GroupSnapshot, Pair, SecretRef, Snapshot,
    SnapshotPage, Timestamp, Topology, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::types::Error;
use crate::bindings::v0_1::driver::{self as old, Guest};
use crate::contract::ContractVersion;
use crate::state::CallState;
use wasmtime::Store;

/// The version this module serves, as its answers name it.
const VERSION: ContractVersion = ContractVersion::V0_1;

/// Pages of `list-snapshots` followed to find one snapshot before the answer counts as a
/// token loop (the guest's, not the caller's fault).
const MAX_PAGES: usize = 1_000;

record! {
    new::CreateVolumeRequest => old::CreateVolumeRequest {
        name, capacity, capabilities, parameters, secrets, content_source, accessibility,
    }
    old::BackendInfo => new::BackendInfo { name, version, features [each], parameters }
    old::Expansion => new::Expansion { capacity_bytes, node_expansion_required }
    old::VolumeStatus => new::VolumeStatus { volume, condition }
    old::VolumePage => new::VolumePage { entries [each], next_token }
    old::SnapshotPage => new::SnapshotPage { entries, next_token }
    old::Capacity => new::Capacity { available_bytes, maximum_volume_bytes, minimum_volume_bytes }
    old::BindPlan => new::BindPlan { root, path, capacity_bytes }
    old::NfsPlan => new::NfsPlan { server, share, path, mount_options }
}

cases! {
    old::Feature => new::Feature {
        CreateDeleteVolume, CreateDeleteSnapshot, ListSnapshots, CloneVolume, ExpandVolume, OnlineExpansion,
        GetCapacity, ListVolumes, GetVolume, VolumeCondition, SingleNodeMultiWriter, NodeExpansion,
    }
    old::Attachment => new::Attachment { Bind(plan), Nfs(plan), ReplicatedBlock(plan), Rbd(plan) }
}

impl From<old::BlockPlan> for new::BlockPlan {
    fn from(p: old::BlockPlan) -> Self {
        // 0.1.0 could not name a filesystem, a frontend or encryption: the node's defaults.
        Self {
            volume_id: p.volume_id,
            size_bytes: p.size_bytes,
            fs_type: String::new(),
            frontend: None,
            encryption: None,
        }
    }
}

impl From<old::RbdPlan> for new::RbdPlan {
    fn from(p: old::RbdPlan) -> Self {
        Self { cluster: p.cluster, pool: p.pool, image: p.image, secrets: p.secrets, encryption: None }
    }
}

/// The current description of a 0.1.0 backend: its features as they are, plus `get-snapshot`
/// when it lists snapshots (the host answers GetSnapshot from the list); never `self-healing`.
fn upgrade_info(info: old::BackendInfo) -> new::BackendInfo {
    let mut info = new::BackendInfo::from(info);
    if info.features.contains(&new::Feature::ListSnapshots) && !info.features.contains(&new::Feature::GetSnapshot) {
        info.features.push(new::Feature::GetSnapshot);
    }
    info
}

/// 0.1.0's `driver`, in the current types: the exports it has with the current arguments are
/// forwarded (their answers converted), the others answered here.
impl Driver for Guest {
    forward! {
        delete_volume = call_delete_volume(volume_id: String, secrets: Vec<SecretRef>) -> ();
        expand_volume = call_expand_volume(
            volume_id: String,
            capacity: CapacityRange,
            capability: Option<VolumeCapability>,
            secrets: Vec<SecretRef>
        ) -> Expansion;
        get_volume = call_get_volume(volume_id: String) -> VolumeStatus;
        list_volumes = call_list_volumes(max_entries: u32, starting_token: String) -> VolumePage;
        validate_volume_capabilities = call_validate_volume_capabilities(
            volume_id: String,
            volume_context: Vec<Pair>,
            capabilities: Vec<VolumeCapability>,
            parameters: Vec<Pair>
        ) -> Option<String>;
        create_snapshot = call_create_snapshot(name: String, source_volume_id: String, parameters: Vec<Pair>, secrets: Vec<SecretRef>) -> Snapshot;
        delete_snapshot = call_delete_snapshot(snapshot_id: String, secrets: Vec<SecretRef>) -> ();
        list_snapshots = call_list_snapshots(
            snapshot_id: Option<String>,
            source_volume_id: Option<String>,
            max_entries: u32,
            starting_token: String
        ) -> SnapshotPage;
        get_capacity = call_get_capacity(capabilities: Vec<VolumeCapability>, parameters: Vec<Pair>, topology: Option<Topology>) -> Capacity;
    }

    fn info<'a>(&'a self, store: &'a mut Store<CallState>) -> CallFuture<'a, new::BackendInfo> {
        Box::pin(async move { self.call_info(store).await.map(|info| Ok(upgrade_info(info))) })
    }

    fn create_volume<'a>(
        &'a self,
        store: &'a mut Store<CallState>,
        req: new::CreateVolumeRequest,
    ) -> CallFuture<'a, new::Volume> {
        Box::pin(async move {
            if let Err(e) = refuse_mutable_parameters(VERSION, &req) {
                return Ok(Err(e));
            }
            self.call_create_volume(store, &req.into()).await
        })
    }

    /// The plan without the secrets, which 0.1.0's `attach-plan` does not take.
    fn attach_plan<'a>(
        &'a self,
        store: &'a mut Store<CallState>,
        volume_id: String,
        volume_context: Vec<Pair>,
        capability: VolumeCapability,
        _: Vec<SecretRef>,
    ) -> CallFuture<'a, Attachment> {
        Box::pin(async move {
            let plan = self.call_attach_plan(store, &volume_id, &volume_context, &capability).await?;
            Ok(plan.map(Into::into))
        })
    }

    /// `get-snapshot` from `list-snapshots`: every page of the list filtered to `id`, searched
    /// for an entry with exactly that id (the guest's filter is not trusted to be exact).
    fn get_snapshot<'a>(&'a self, store: &'a mut Store<CallState>, id: String) -> CallFuture<'a, new::Snapshot> {
        Box::pin(async move {
            let mut token = String::new();
            for _ in 0..MAX_PAGES {
                let page = match self.call_list_snapshots(&mut *store, Some(&id), None, 0, &token).await? {
                    Ok(page) => page,
                    Err(e) => return Ok(Err(e)),
                };
                if let Some(found) = page.entries.into_iter().find(|s| s.snapshot_id == id) {
                    return Ok(Ok(found));
                }
                if page.next_token.is_empty() {
                    return Ok(Err(Error::NotFound(format!("snapshot {id} not found"))));
                }
                if page.next_token == token {
                    return Err(wasmtime::Error::msg(format!(
                        "list-snapshots returned its starting token {token:?} again"
                    )));
                }
                token = page.next_token;
            }
            Err(wasmtime::Error::msg(format!("list-snapshots did not end within {MAX_PAGES} pages")))
        })
    }

    fn reconcile_volume<'a>(&'a self, _: &'a mut Store<CallState>, _: String, _: Timestamp) -> CallFuture<'a, ()> {
        lacks(VERSION, "reconcile-volume")
    }

    fn modify_volume<'a>(
        &'a self,
        _: &'a mut Store<CallState>,
        _: String,
        _: Vec<Pair>,
        _: Vec<SecretRef>,
    ) -> CallFuture<'a, ()> {
        lacks(VERSION, "modify-volume")
    }

    fn create_group_snapshot<'a>(
        &'a self,
        _: &'a mut Store<CallState>,
        _: String,
        _: Vec<String>,
        _: Vec<Pair>,
        _: Vec<SecretRef>,
    ) -> CallFuture<'a, GroupSnapshot> {
        lacks(VERSION, "create-group-snapshot")
    }

    fn delete_group_snapshot<'a>(
        &'a self,
        _: &'a mut Store<CallState>,
        _: String,
        _: Vec<String>,
        _: Vec<SecretRef>,
    ) -> CallFuture<'a, ()> {
        lacks(VERSION, "delete-group-snapshot")
    }

    fn get_group_snapshot<'a>(
        &'a self,
        _: &'a mut Store<CallState>,
        _: String,
        _: Vec<String>,
        _: Vec<SecretRef>,
    ) -> CallFuture<'a, GroupSnapshot> {
        lacks(VERSION, "get-group-snapshot")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::types::{
        AccessMode, AccessType, CapacityRange, ContentSource, MountVolume, Pair, SecretRef, Snapshot, Timestamp,
        Topology, TopologyRequirement, Volume, VolumeCapability, VolumeCondition,
    };

    /// Records of both versions print alike (same names, same fields) when converted right.
    fn same<A: std::fmt::Debug, B: std::fmt::Debug>(a: &A, b: &B) {
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
    }

    fn pair(k: &str, v: &str) -> Pair {
        Pair { key: k.into(), value: v.into() }
    }

    fn volume(id: &str) -> Volume {
        Volume {
            volume_id: id.into(),
            capacity_bytes: 7,
            volume_context: vec![pair("a", "b")],
            content_source: Some(ContentSource::Snapshot("s".into())),
            accessible_topology: vec![Topology { segments: vec![pair("zone", "z1")] }],
        }
    }

    #[test]
    fn a_create_request_reaches_a_0_1_guest_field_for_field() {
        let req = new::CreateVolumeRequest {
            name: "pvc-1".into(),
            capacity: CapacityRange { required_bytes: 1, limit_bytes: 2 },
            capabilities: vec![VolumeCapability {
                access_type: AccessType::Mount(MountVolume { fs_type: "xfs".into(), mount_flags: vec!["ro".into()] }),
                access_mode: AccessMode::SingleNodeMultiWriter,
            }],
            parameters: vec![pair("root", "default")],
            secrets: vec![SecretRef { key: "userKey".into(), handle: 3 }],
            content_source: Some(ContentSource::Volume("v".into())),
            accessibility: Some(TopologyRequirement {
                requisite: vec![Topology { segments: vec![pair("node", "n1")] }],
                preferred: vec![],
            }),
            mutable_parameters: vec![],
        };
        let sent = old::CreateVolumeRequest::from(req.clone());
        // Every field 0.1.0 has, as it was; `mutable-parameters` (empty) is not one of them.
        same(&format!("{req:?}").replace(", mutable-parameters: []", ""), &format!("{sent:?}"));
        let mut modifying = req;
        modifying.mutable_parameters = vec![pair("iops", "100")];
        let e = refuse_mutable_parameters(VERSION, &modifying).expect_err("0.1.0 cannot apply them");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("iops") && m.contains("0.1.0")), "{e:?}");
    }

    #[test]
    fn answers_of_a_0_1_guest_keep_every_field() {
        let status = |id| old::VolumeStatus {
            volume: volume(id),
            condition: Some(VolumeCondition { abnormal: true, message: "m".into() }),
        };
        let page = old::VolumePage { entries: vec![status("a"), status("b")], next_token: "2".into() };
        same(&page, &new::VolumePage::from(page.clone()));
        let snapshots = old::SnapshotPage {
            entries: vec![Snapshot {
                snapshot_id: "s".into(),
                source_volume_id: "a".into(),
                size_bytes: 1,
                creation_time: Timestamp { seconds: 2, nanos: 3 },
                ready_to_use: true,
            }],
            next_token: String::new(),
        };
        same(&snapshots, &new::SnapshotPage::from(snapshots.clone()));
        let expansion = old::Expansion { capacity_bytes: 9, node_expansion_required: true };
        same(&expansion, &new::Expansion::from(expansion));
        let capacity = old::Capacity { available_bytes: 1, maximum_volume_bytes: 2, minimum_volume_bytes: 3 };
        same(&capacity, &new::Capacity::from(capacity));
    }

    #[test]
    fn attach_plans_keep_their_kind_and_a_block_plan_gets_the_default_filesystem() {
        let plans = [
            old::Attachment::Bind(old::BindPlan { root: "r".into(), path: "p".into(), capacity_bytes: 1 }),
            old::Attachment::Nfs(old::NfsPlan {
                server: "s".into(),
                share: "/e".into(),
                path: "p".into(),
                mount_options: vec!["nfsvers=4.1".into()],
            }),
            old::Attachment::Rbd(old::RbdPlan {
                cluster: "c".into(),
                pool: "p".into(),
                image: "i".into(),
                secrets: vec![SecretRef { key: "userID".into(), handle: 0 }],
            }),
        ];
        for plan in plans {
            let converted = format!("{:?}", new::Attachment::from(plan.clone()));
            // The same plan; what 0.1.0 cannot ask for is not asked for.
            same(&format!("{plan:?}"), &converted.replace(", encryption: None", ""));
        }
        let block = old::Attachment::ReplicatedBlock(old::BlockPlan { volume_id: "v".into(), size_bytes: 4096 });
        match new::Attachment::from(block) {
            new::Attachment::ReplicatedBlock(p) => {
                assert_eq!((p.volume_id.as_str(), p.size_bytes, p.fs_type.as_str()), ("v", 4096, ""));
                assert!(p.frontend.is_none() && p.encryption.is_none(), "{p:?}");
            }
            other => panic!("a block plan became {other:?}"),
        }
    }

    #[test]
    fn every_0_1_feature_is_the_current_feature_of_its_name() {
        use old::Feature::*;
        let all = [
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
            NodeExpansion,
        ];
        for f in all {
            same(&f, &new::Feature::from(f));
        }
    }

    #[test]
    fn a_0_1_backend_that_lists_snapshots_gets_get_snapshot_and_none_is_self_healing() {
        let info = |features| old::BackendInfo {
            name: "legacy".into(),
            version: "1".into(),
            features,
            parameters: vec!["root".into()],
        };
        let listing = upgrade_info(info(vec![old::Feature::CreateDeleteSnapshot, old::Feature::ListSnapshots]));
        assert_eq!(
            listing.features,
            [new::Feature::CreateDeleteSnapshot, new::Feature::ListSnapshots, new::Feature::GetSnapshot]
        );
        assert_eq!((listing.name.as_str(), listing.version.as_str()), ("legacy", "1"));
        assert_eq!(listing.parameters, ["root"]);
        let plain = upgrade_info(info(vec![old::Feature::CreateDeleteVolume]));
        assert_eq!(plain.features, [new::Feature::CreateDeleteVolume]);
        assert!(!listing.features.contains(&new::Feature::SelfHealing));
    }

    /// The `with` remapping in `bindings::v0_1` and [`super::super::link`] serve 0.1.0 guests
    /// with the current implementations of `log`, `kv`, `dir` and `nfs`, the current types,
    /// and 0.2.0's `rbd` adapter: sound only while those interfaces are the same in 0.1.0 and
    /// in the package they are taken from (doc comments aside; `types` may only have grown).
    #[test]
    fn the_interfaces_0_1_shares_are_identical_where_they_are_taken_from() {
        use crate::compat::v0_2::tests::interface;
        let current = include_str!("../../../../wit/backend.wit");
        let v0_2 = include_str!("../../../../wit/previous/0.2.0/backend.wit");
        let previous = include_str!("../../../../wit/previous/0.1.0/backend.wit");
        for name in ["log", "kv", "dir", "nfs"] {
            assert_eq!(interface(previous, name), interface(current, name), "interface {name}");
            assert!(!interface(current, name).is_empty(), "interface {name} not found");
        }
        assert_eq!(interface(previous, "rbd"), interface(v0_2, "rbd"));
        let types = interface(current, "types");
        let previous_types = interface(previous, "types");
        let missing: Vec<&String> = previous_types.iter().filter(|l| !types.contains(l)).collect();
        assert!(missing.is_empty(), "0.1.0's types not in the current ones: {missing:?}");
        assert_ne!(interface(previous, "block"), interface(v0_2, "block"));
    }
}
