//! Guests built against `wasmcsi:backend@0.2.0`: what their exports answer, in the current
//! types (here), and their `block` and `rbd` imports, whose shape 0.3.0 changed, served by the
//! current capabilities ([`block`], [`rbd`]). Every other interface is shared (see
//! [`crate::bindings::v0_2`]).
//!
//! What 0.2.0 lacks:
//! - `modify-volume` and the group snapshot exports are `unimplemented` without calling the
//!   guest (a 0.2.0 backend cannot declare their features, so the host never asks it);
//! - `reconcile-volume` is called without the host's clock, `attach-plan` without the secrets;
//! - a create request carrying `mutable-parameters` is invalid-argument (never dropped);
//! - its attach plans ask for no frontend and no encryption.
pub mod block;
pub mod rbd;

use super::convert::{cases, record};
use super::driver::{CallFuture, Driver};
use super::lend::forward;
use super::{lacks, refuse_mutable_parameters};
use crate::bindings::driver::{
    self as new, Attachment, Capacity, CapacityRange, Expansion, GroupSnapshot, Pair, SecretRef, Snapshot,
    SnapshotPage, Timestamp, Topology, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::v0_2::driver::{self as old, Guest};
use crate::contract::ContractVersion;
use crate::state::CallState;
use wasmtime::Store;

/// The version this module serves, as its answers name it.
const VERSION: ContractVersion = ContractVersion::V0_2;

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
        GetCapacity, ListVolumes, GetVolume, VolumeCondition, SingleNodeMultiWriter, NodeExpansion, GetSnapshot,
        SelfHealing,
    }
    old::Attachment => new::Attachment { Bind(plan), Nfs(plan), ReplicatedBlock(plan), Rbd(plan) }
}

impl From<old::BlockPlan> for new::BlockPlan {
    fn from(p: old::BlockPlan) -> Self {
        // 0.2.0 could not ask for a frontend or encryption: the node's choice, unencrypted.
        Self { volume_id: p.volume_id, size_bytes: p.size_bytes, fs_type: p.fs_type, frontend: None, encryption: None }
    }
}

impl From<old::RbdPlan> for new::RbdPlan {
    fn from(p: old::RbdPlan) -> Self {
        Self { cluster: p.cluster, pool: p.pool, image: p.image, secrets: p.secrets, encryption: None }
    }
}

/// 0.2.0's `driver`, in the current types: the exports it has with the current arguments are
/// forwarded (their answers converted), the others adapted or answered here.
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
        get_snapshot = call_get_snapshot(snapshot_id: String) -> Snapshot;
        get_capacity = call_get_capacity(capabilities: Vec<VolumeCapability>, parameters: Vec<Pair>, topology: Option<Topology>) -> Capacity;
    }

    fn info<'a>(&'a self, store: &'a mut Store<CallState>) -> CallFuture<'a, new::BackendInfo> {
        Box::pin(async move { self.call_info(store).await.map(|info| Ok(info.into())) })
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

    /// The plan without the secrets, which 0.2.0's `attach-plan` does not take.
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

    /// Without the host's clock, which 0.2.0's `reconcile-volume` does not take (its guests
    /// read WASI's).
    fn reconcile_volume<'a>(
        &'a self,
        store: &'a mut Store<CallState>,
        volume_id: String,
        _: Timestamp,
    ) -> CallFuture<'a, ()> {
        Box::pin(async move { self.call_reconcile_volume(store, &volume_id).await })
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
pub(crate) mod tests {
    use super::*;
    use crate::bindings::types::Error;
    use crate::bindings::types::{
        AccessMode, AccessType, ContentSource, MountVolume, Pair, SecretRef, Topology, TopologyRequirement,
        VolumeCapability,
    };

    fn pair(k: &str, v: &str) -> Pair {
        Pair { key: k.into(), value: v.into() }
    }

    #[test]
    fn a_create_request_reaches_a_0_2_guest_field_for_field_and_mutable_parameters_are_refused() {
        let req = new::CreateVolumeRequest {
            name: "pvc-1".into(),
            capacity: CapacityRange { required_bytes: 1, limit_bytes: 2 },
            capabilities: vec![VolumeCapability {
                access_type: AccessType::Mount(MountVolume { fs_type: "xfs".into(), mount_flags: vec!["ro".into()] }),
                access_mode: AccessMode::SingleNodeMultiWriter,
            }],
            parameters: vec![pair("replicas", "2")],
            secrets: vec![SecretRef { key: "k".into(), handle: 0 }],
            content_source: Some(ContentSource::Snapshot("s".into())),
            accessibility: Some(TopologyRequirement {
                requisite: vec![Topology { segments: vec![pair("node", "n1")] }],
                preferred: vec![],
            }),
            mutable_parameters: vec![],
        };
        let sent = old::CreateVolumeRequest::from(req.clone());
        assert_eq!(format!("{req:?}").replace(", mutable-parameters: []", ""), format!("{sent:?}"));
        let mut modifying = req;
        modifying.mutable_parameters = vec![pair("qosIops", "100")];
        let e = refuse_mutable_parameters(VERSION, &modifying).expect_err("0.2.0 cannot apply them");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("qosIops") && m.contains("0.2.0")), "{e:?}");
    }

    #[test]
    fn a_0_2_block_plan_keeps_its_filesystem_and_asks_for_no_frontend_or_encryption() {
        let plan = old::Attachment::ReplicatedBlock(old::BlockPlan {
            volume_id: "v".into(),
            size_bytes: 4096,
            fs_type: "xfs".into(),
        });
        match new::Attachment::from(plan) {
            new::Attachment::ReplicatedBlock(p) => {
                assert_eq!((p.volume_id.as_str(), p.size_bytes, p.fs_type.as_str()), ("v", 4096, "xfs"));
                assert!(p.frontend.is_none() && p.encryption.is_none(), "{p:?}");
            }
            other => panic!("a block plan became {other:?}"),
        }
        let rbd = old::Attachment::Rbd(old::RbdPlan {
            cluster: "c".into(),
            pool: "p".into(),
            image: "i".into(),
            secrets: vec![SecretRef { key: "userID".into(), handle: 0 }],
        });
        match new::Attachment::from(rbd) {
            new::Attachment::Rbd(p) => {
                assert_eq!((p.cluster.as_str(), p.pool.as_str(), p.image.as_str()), ("c", "p", "i"));
                assert_eq!(p.secrets.len(), 1);
                assert!(p.encryption.is_none());
            }
            other => panic!("an rbd plan became {other:?}"),
        }
    }

    #[test]
    fn every_0_2_feature_is_the_current_feature_of_its_name() {
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
            GetSnapshot,
            SelfHealing,
        ];
        for f in all {
            assert_eq!(format!("{f:?}"), format!("{:?}", new::Feature::from(f)));
        }
    }

    /// The `with` remapping in `bindings::v0_2` and [`super::super::link`] serve 0.2.0 guests
    /// with the current implementations of `log`, `kv`, `dir` and `nfs` and the current types:
    /// sound only while those interfaces are the same in both packages (doc comments aside),
    /// and `types` only grew.
    #[test]
    fn the_interfaces_0_2_shares_with_0_3_are_identical_in_both_packages() {
        let current = include_str!("../../../../../wit/backend.wit");
        let previous = include_str!("../../../../../wit/previous/0.2.0/backend.wit");
        for name in ["log", "kv", "dir", "nfs"] {
            assert_eq!(interface(previous, name), interface(current, name), "interface {name}");
            assert!(!interface(current, name).is_empty(), "interface {name} not found");
        }
        let types = definitions(current, "types");
        for definition in definitions(previous, "types") {
            assert!(types.contains(&definition), "0.2.0's {:?} is not in the current types", definition[0]);
        }
        assert!(types.len() > definitions(previous, "types").len(), "io-limits was added");
        for changed in ["block", "rbd", "driver"] {
            assert_ne!(interface(previous, changed), interface(current, changed), "{changed}");
        }
    }

    /// The body of `interface NAME { … }` without comments and blank lines.
    pub(crate) fn interface(wit: &str, name: &str) -> Vec<String> {
        let start = format!("interface {name} {{");
        wit.lines()
            .skip_while(|l| l.trim() != start)
            .skip(1)
            .take_while(|l| *l != "}")
            .map(|l| l.split("//").next().unwrap_or("").trim().to_string())
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// The type definitions of an interface, each its lines (from `record`/`variant`/`enum`
    /// to its closing brace).
    pub(crate) fn definitions(wit: &str, name: &str) -> Vec<Vec<String>> {
        let mut out: Vec<Vec<String>> = vec![];
        for line in interface(wit, name) {
            let starts = ["record ", "variant ", "enum ", "flags "].iter().any(|k| line.starts_with(k));
            match out.last_mut() {
                Some(open) if !starts && open.last().is_some_and(|l| l != "}") => open.push(line),
                _ if starts => out.push(vec![line]),
                _ => {}
            }
        }
        out
    }
}
