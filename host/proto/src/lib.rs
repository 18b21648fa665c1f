//! CSI wire types and tonic gRPC stubs, generated at build time from
//! `proto/csi.proto`, the Container Storage Interface spec's `csi.proto` at
//! [`CSI_SPEC_VERSION`], vendored byte for byte from the spec repository
//! (provenance and license in `proto/README.md` and `proto/csi.LICENSE`; a test
//! pins its SHA-256, the others every field number, enum value and option).
//! This crate owns exactly
//! that: the prost messages, the tonic clients and servers for the
//! Identity, Controller, GroupController, SnapshotMetadata and Node
//! services, and the encoded [`FILE_DESCRIPTOR_SET`] (for gRPC
//! reflection). It owns no behaviour: no service implementation,
//! validation, defaulting or policy lives here, and it must stay
//! wire-identical to the spec (field numbers, enum values, options).
//!
//! Beside it, [`authority`]: the messages and stubs of wasmcsi's own authority endpoint
//! (`proto/authority.proto`: certificates from the built-in CA, grants of volumes), served by
//! the controller.

/// Generated code, one module per protobuf package.
pub mod csi {
    /// Package `csi.v1`: every message, enum and service of the CSI spec.
    pub mod v1 {
        #![allow(
            clippy::all,
            clippy::pedantic,
            clippy::nursery,
            missing_docs,
            rustdoc::all,
            reason = "prost/tonic generated code; its shape is dictated by the CSI spec"
        )]
        tonic::include_proto!("csi.v1");
    }
}

/// Package `wasmcsi.authority.v1`: the controller's authority endpoint.
pub mod authority {
    pub mod v1 {
        #![allow(
            clippy::all,
            clippy::pedantic,
            clippy::nursery,
            missing_docs,
            rustdoc::all,
            reason = "prost/tonic generated code"
        )]
        tonic::include_proto!("wasmcsi.authority.v1");
    }
}

/// Version of the CSI spec that `proto/csi.proto` reproduces.
pub const CSI_SPEC_VERSION: &str = "1.12.0";

/// Encoded `google.protobuf.FileDescriptorSet` for `csi.proto` and its
/// imports (`descriptor.proto`, `timestamp.proto`, `wrappers.proto`),
/// including source info (the spec's comments). Suitable for gRPC
/// server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/csi_v1_descriptor_set.bin"));

#[cfg(test)]
mod tests {
    //! Wire facts checked against the CSI v1.12.0 spec numbers.

    use std::collections::BTreeSet;
    use std::error::Error;

    use prost::Message as _;

    use crate::csi::v1 as csi;

    type TestResult = Result<(), Box<dyn Error>>;

    /// Minimal mirror of `google/protobuf/descriptor.proto` that also
    /// decodes the CSI custom options (extensions 1059 and 1060), which
    /// `prost_types` drops as unknown fields.
    mod shadow {
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct FileDescriptorSet {
            #[prost(message, repeated, tag = "1")]
            pub file: Vec<File>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct File {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
            #[prost(string, optional, tag = "2")]
            pub package: Option<String>,
            #[prost(string, repeated, tag = "3")]
            pub dependency: Vec<String>,
            #[prost(message, repeated, tag = "4")]
            pub message_type: Vec<Message>,
            #[prost(message, repeated, tag = "5")]
            pub enum_type: Vec<Enum>,
            #[prost(message, repeated, tag = "6")]
            pub service: Vec<Service>,
            #[prost(message, repeated, tag = "7")]
            pub extension: Vec<Field>,
            #[prost(message, optional, tag = "8")]
            pub options: Option<FileOptions>,
            #[prost(string, optional, tag = "12")]
            pub syntax: Option<String>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct FileOptions {
            #[prost(string, optional, tag = "11")]
            pub go_package: Option<String>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Message {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
            #[prost(message, repeated, tag = "2")]
            pub field: Vec<Field>,
            #[prost(message, repeated, tag = "3")]
            pub nested_type: Vec<Message>,
            #[prost(message, repeated, tag = "4")]
            pub enum_type: Vec<Enum>,
            #[prost(message, optional, tag = "7")]
            pub options: Option<AlphaOptions>,
            #[prost(message, repeated, tag = "8")]
            pub oneof_decl: Vec<Oneof>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Oneof {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Field {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
            #[prost(string, optional, tag = "2")]
            pub extendee: Option<String>,
            #[prost(int32, optional, tag = "3")]
            pub number: Option<i32>,
            #[prost(int32, optional, tag = "4")]
            pub label: Option<i32>,
            #[prost(int32, optional, tag = "5")]
            pub kind: Option<i32>,
            #[prost(string, optional, tag = "6")]
            pub type_name: Option<String>,
            #[prost(message, optional, tag = "8")]
            pub options: Option<FieldOptions>,
            #[prost(int32, optional, tag = "9")]
            pub oneof_index: Option<i32>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct FieldOptions {
            #[prost(bool, optional, tag = "1059")]
            pub csi_secret: Option<bool>,
            #[prost(bool, optional, tag = "1060")]
            pub alpha_field: Option<bool>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Enum {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
            #[prost(message, repeated, tag = "2")]
            pub value: Vec<EnumValue>,
            #[prost(message, optional, tag = "3")]
            pub options: Option<AlphaOptions>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct EnumValue {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
            #[prost(int32, optional, tag = "2")]
            pub number: Option<i32>,
            #[prost(message, optional, tag = "3")]
            pub options: Option<AlphaOptions>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Service {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
            #[prost(message, repeated, tag = "2")]
            pub method: Vec<Method>,
            #[prost(message, optional, tag = "3")]
            pub options: Option<AlphaOptions>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Method {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
            #[prost(string, optional, tag = "2")]
            pub input_type: Option<String>,
            #[prost(string, optional, tag = "3")]
            pub output_type: Option<String>,
            #[prost(message, optional, tag = "4")]
            pub options: Option<AlphaOptions>,
            #[prost(bool, optional, tag = "5")]
            pub client_streaming: Option<bool>,
            #[prost(bool, optional, tag = "6")]
            pub server_streaming: Option<bool>,
        }

        /// Message, enum, enum-value, service and method options all carry
        /// their `alpha_*` extension at number 1060.
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct AlphaOptions {
            #[prost(bool, optional, tag = "1060")]
            pub alpha: Option<bool>,
        }
    }

    /// The spec file at tag v1.12.0 (commit e6fc13ea4d529db12e211ef79c924ee3186c39d5), as the
    /// spec repository serves it: an edit of the vendored copy, even one that keeps the wire
    /// the same, is no longer the spec's file.
    const CSI_PROTO_SHA256: &str = "5b81236a3809f3ff0b877ff9b82215d0b74a8e291d7f3ec6ee1a44f537c0f86a";

    #[test]
    fn csi_proto_is_the_spec_file_byte_for_byte() {
        use sha2::Digest as _;
        let text = include_bytes!("../../../proto/csi.proto");
        let digest = sha2::Sha256::digest(text);
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, CSI_PROTO_SHA256, "proto/csi.proto is not the CSI spec's v1.12.0 file");
    }

    fn csi_file() -> Result<shadow::File, Box<dyn Error>> {
        let set = shadow::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)?;
        set.file
            .into_iter()
            .find(|f| f.name.as_deref() == Some("csi.proto"))
            .ok_or_else(|| "csi.proto missing from FILE_DESCRIPTOR_SET".into())
    }

    fn is_alpha(options: Option<&shadow::AlphaOptions>) -> bool {
        options.and_then(|o| o.alpha) == Some(true)
    }

    /// Visits every message (nested ones too) with its dotted name.
    fn walk_messages<'a>(prefix: &str, messages: &'a [shadow::Message], out: &mut Vec<(String, &'a shadow::Message)>) {
        for m in messages {
            let name = format!("{prefix}{}", m.name.as_deref().unwrap_or_default());
            out.push((name.clone(), m));
            walk_messages(&format!("{name}."), &m.nested_type, out);
        }
    }

    fn all_messages(file: &shadow::File) -> Vec<(String, &shadow::Message)> {
        let mut out = Vec::new();
        walk_messages("", &file.message_type, &mut out);
        out
    }

    fn message<'a>(file: &'a shadow::File, name: &str) -> Result<&'a shadow::Message, String> {
        all_messages(file)
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, m)| m)
            .ok_or_else(|| format!("message {name} not found"))
    }

    fn field_numbers(m: &shadow::Message) -> Vec<(String, i32)> {
        m.field.iter().map(|f| (f.name.clone().unwrap_or_default(), f.number.unwrap_or_default())).collect()
    }

    fn names(list: &[(&str, i32)]) -> Vec<(String, i32)> {
        list.iter().map(|(n, i)| ((*n).to_owned(), *i)).collect()
    }

    #[test]
    fn spec_version_is_semver() {
        let parts: Vec<&str> = crate::CSI_SPEC_VERSION.split('.').collect();
        assert_eq!(parts, ["1", "12", "0"]);
    }

    #[test]
    fn create_volume_request_encodes_with_spec_tags() {
        let req = csi::CreateVolumeRequest {
            name: "vol".to_owned(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 1024, limit_bytes: 0 }),
            ..Default::default()
        };
        // name = 1 (LEN): 0x0a; capacity_range = 2 (LEN): 0x12;
        // CapacityRange.required_bytes = 1 (VARINT): 0x08, 1024 = 0x80 0x08.
        let expected: &[u8] = &[0x0a, 0x03, b'v', b'o', b'l', 0x12, 0x03, 0x08, 0x80, 0x08];
        assert_eq!(req.encode_to_vec(), expected);

        // secrets = 5 (map entry: key = 1, value = 2).
        let mut with_secret = csi::CreateVolumeRequest::default();
        with_secret.secrets.insert("k".to_owned(), "v".to_owned());
        assert_eq!(with_secret.encode_to_vec(), [0x2a, 0x06, 0x0a, 0x01, b'k', 0x12, 0x01, b'v']);

        // mutable_parameters = 8.
        let mut mutable = csi::CreateVolumeRequest::default();
        mutable.mutable_parameters.insert("a".to_owned(), "b".to_owned());
        assert_eq!(mutable.encode_to_vec()[0], (8 << 3) | 2);
    }

    #[test]
    fn volume_capability_decodes_spec_bytes() -> TestResult {
        // mount = 2 (empty MountVolume), access_mode = 3 { mode = 1: 7 }.
        let bytes = [0x12, 0x00, 0x1a, 0x02, 0x08, 0x07];
        let cap = csi::VolumeCapability::decode(&bytes[..])?;
        assert!(matches!(cap.access_type, Some(csi::volume_capability::AccessType::Mount(_))));
        let mode = cap.access_mode.ok_or("access_mode missing")?.mode();
        assert_eq!(mode, csi::volume_capability::access_mode::Mode::SingleNodeMultiWriter);
        Ok(())
    }

    #[test]
    fn access_mode_values_match_spec() {
        use csi::volume_capability::access_mode::Mode;
        assert_eq!(Mode::Unknown as i32, 0);
        assert_eq!(Mode::SingleNodeWriter as i32, 1);
        assert_eq!(Mode::SingleNodeReaderOnly as i32, 2);
        assert_eq!(Mode::MultiNodeReaderOnly as i32, 3);
        assert_eq!(Mode::MultiNodeSingleWriter as i32, 4);
        assert_eq!(Mode::MultiNodeMultiWriter as i32, 5);
        assert_eq!(Mode::SingleNodeSingleWriter as i32, 6);
        assert_eq!(Mode::SingleNodeMultiWriter as i32, 7);
    }

    #[test]
    fn controller_capability_values_match_spec() {
        use csi::controller_service_capability::rpc::Type;
        assert_eq!(Type::CreateDeleteVolume as i32, 1);
        assert_eq!(Type::PublishUnpublishVolume as i32, 2);
        assert_eq!(Type::ListVolumes as i32, 3);
        assert_eq!(Type::GetCapacity as i32, 4);
        assert_eq!(Type::CreateDeleteSnapshot as i32, 5);
        assert_eq!(Type::ListSnapshots as i32, 6);
        assert_eq!(Type::CloneVolume as i32, 7);
        assert_eq!(Type::PublishReadonly as i32, 8);
        assert_eq!(Type::ExpandVolume as i32, 9);
        assert_eq!(Type::ListVolumesPublishedNodes as i32, 10);
        assert_eq!(Type::VolumeCondition as i32, 11);
        assert_eq!(Type::GetVolume as i32, 12);
        assert_eq!(Type::SingleNodeMultiWriter as i32, 13);
        assert_eq!(Type::ModifyVolume as i32, 14);
        assert_eq!(Type::GetSnapshot as i32, 15);
    }

    #[test]
    fn node_capability_values_match_spec() {
        use csi::node_service_capability::rpc::Type;
        assert_eq!(Type::Unknown as i32, 0);
        assert_eq!(Type::StageUnstageVolume as i32, 1);
        assert_eq!(Type::GetVolumeStats as i32, 2);
        assert_eq!(Type::ExpandVolume as i32, 3);
        assert_eq!(Type::VolumeCondition as i32, 4);
        assert_eq!(Type::SingleNodeMultiWriter as i32, 5);
        assert_eq!(Type::VolumeMountGroup as i32, 6);
    }

    #[test]
    fn plugin_group_and_metadata_values_match_spec() {
        use csi::plugin_capability::service::Type as Service;
        use csi::plugin_capability::volume_expansion::Type as Expansion;
        assert_eq!(Service::ControllerService as i32, 1);
        assert_eq!(Service::VolumeAccessibilityConstraints as i32, 2);
        assert_eq!(Service::GroupControllerService as i32, 3);
        assert_eq!(Service::SnapshotMetadataService as i32, 4);
        assert_eq!(Expansion::Online as i32, 1);
        assert_eq!(Expansion::Offline as i32, 2);
        assert_eq!(csi::group_controller_service_capability::rpc::Type::CreateDeleteGetVolumeGroupSnapshot as i32, 1);
        assert_eq!(csi::volume_usage::Unit::Bytes as i32, 1);
        assert_eq!(csi::volume_usage::Unit::Inodes as i32, 2);
        assert_eq!(csi::BlockMetadataType::FixedLength as i32, 1);
        assert_eq!(csi::BlockMetadataType::VariableLength as i32, 2);
    }

    #[test]
    fn generated_service_names_are_spec_names() {
        assert_eq!(csi::identity_server::SERVICE_NAME, "csi.v1.Identity");
        assert_eq!(csi::controller_server::SERVICE_NAME, "csi.v1.Controller");
        assert_eq!(csi::group_controller_server::SERVICE_NAME, "csi.v1.GroupController");
        assert_eq!(csi::snapshot_metadata_server::SERVICE_NAME, "csi.v1.SnapshotMetadata");
        assert_eq!(csi::node_server::SERVICE_NAME, "csi.v1.Node");
    }

    #[test]
    fn descriptor_set_has_file_package_imports_and_options() -> TestResult {
        let set = shadow::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)?;
        let files: BTreeSet<&str> = set.file.iter().filter_map(|f| f.name.as_deref()).collect();
        for wkt in [
            "google/protobuf/descriptor.proto",
            "google/protobuf/timestamp.proto",
            "google/protobuf/wrappers.proto",
            "csi.proto",
        ] {
            assert!(files.contains(wkt), "{wkt} missing from descriptor set");
        }

        let file = csi_file()?;
        assert_eq!(file.package.as_deref(), Some("csi.v1"));
        assert_eq!(file.syntax.as_deref(), Some("proto3"));
        assert_eq!(
            file.options.as_ref().and_then(|o| o.go_package.as_deref()),
            Some("github.com/container-storage-interface/spec/lib/go/csi")
        );

        let extensions: Vec<(String, i32, String)> = file
            .extension
            .iter()
            .map(|e| {
                (
                    e.name.clone().unwrap_or_default(),
                    e.number.unwrap_or_default(),
                    e.extendee.clone().unwrap_or_default(),
                )
            })
            .collect();
        let expected: Vec<(String, i32, String)> = [
            ("alpha_enum", 1060, ".google.protobuf.EnumOptions"),
            ("alpha_enum_value", 1060, ".google.protobuf.EnumValueOptions"),
            ("csi_secret", 1059, ".google.protobuf.FieldOptions"),
            ("alpha_field", 1060, ".google.protobuf.FieldOptions"),
            ("alpha_message", 1060, ".google.protobuf.MessageOptions"),
            ("alpha_method", 1060, ".google.protobuf.MethodOptions"),
            ("alpha_service", 1060, ".google.protobuf.ServiceOptions"),
        ]
        .iter()
        .map(|(n, i, e)| ((*n).to_owned(), *i, (*e).to_owned()))
        .collect();
        assert_eq!(extensions, expected);
        Ok(())
    }

    #[test]
    fn descriptor_set_has_spec_services_and_methods() -> TestResult {
        let file = csi_file()?;
        let services: Vec<(String, Vec<String>)> = file
            .service
            .iter()
            .map(|s| {
                (
                    s.name.clone().unwrap_or_default(),
                    s.method.iter().map(|m| m.name.clone().unwrap_or_default()).collect(),
                )
            })
            .collect();
        let expected: Vec<(String, Vec<String>)> = [
            ("Identity", &["GetPluginInfo", "GetPluginCapabilities", "Probe"][..]),
            (
                "Controller",
                &[
                    "CreateVolume",
                    "DeleteVolume",
                    "ControllerPublishVolume",
                    "ControllerUnpublishVolume",
                    "ValidateVolumeCapabilities",
                    "ListVolumes",
                    "GetCapacity",
                    "ControllerGetCapabilities",
                    "CreateSnapshot",
                    "DeleteSnapshot",
                    "ListSnapshots",
                    "GetSnapshot",
                    "ControllerExpandVolume",
                    "ControllerGetVolume",
                    "ControllerModifyVolume",
                ][..],
            ),
            (
                "GroupController",
                &[
                    "GroupControllerGetCapabilities",
                    "CreateVolumeGroupSnapshot",
                    "DeleteVolumeGroupSnapshot",
                    "GetVolumeGroupSnapshot",
                ][..],
            ),
            ("SnapshotMetadata", &["GetMetadataAllocated", "GetMetadataDelta"][..]),
            (
                "Node",
                &[
                    "NodeStageVolume",
                    "NodeUnstageVolume",
                    "NodePublishVolume",
                    "NodeUnpublishVolume",
                    "NodeGetVolumeStats",
                    "NodeExpandVolume",
                    "NodeGetCapabilities",
                    "NodeGetInfo",
                ][..],
            ),
        ]
        .iter()
        .map(|(s, ms)| ((*s).to_owned(), ms.iter().map(|m| (*m).to_owned()).collect()))
        .collect();
        assert_eq!(services, expected);

        // Only the SnapshotMetadata RPCs stream (server side).
        for s in &file.service {
            for m in &s.method {
                assert_ne!(m.client_streaming, Some(true));
                let streams = m.server_streaming == Some(true);
                assert_eq!(streams, s.name.as_deref() == Some("SnapshotMetadata"));
            }
        }

        let alpha_services: Vec<&str> =
            file.service.iter().filter(|s| is_alpha(s.options.as_ref())).filter_map(|s| s.name.as_deref()).collect();
        // Group snapshots are GA in v1.12; changed-block metadata is still alpha.
        assert_eq!(alpha_services, ["SnapshotMetadata"]);

        let alpha_methods: Vec<String> = file
            .service
            .iter()
            .flat_map(|s| {
                s.method.iter().filter(|m| is_alpha(m.options.as_ref())).map(move |m| {
                    format!("{}.{}", s.name.as_deref().unwrap_or_default(), m.name.as_deref().unwrap_or_default())
                })
            })
            .collect();
        assert_eq!(alpha_methods, ["Controller.GetSnapshot", "Controller.ControllerGetVolume",]);
        Ok(())
    }

    #[test]
    fn descriptor_set_field_numbers_match_spec() -> TestResult {
        let file = csi_file()?;
        let cases: &[(&str, &[(&str, i32)])] = &[
            (
                "CreateVolumeRequest",
                &[
                    ("name", 1),
                    ("capacity_range", 2),
                    ("volume_capabilities", 3),
                    ("parameters", 4),
                    ("secrets", 5),
                    ("volume_content_source", 6),
                    ("accessibility_requirements", 7),
                    ("mutable_parameters", 8),
                ],
            ),
            (
                "Volume",
                &[
                    ("capacity_bytes", 1),
                    ("volume_id", 2),
                    ("volume_context", 3),
                    ("content_source", 4),
                    ("accessible_topology", 5),
                ],
            ),
            ("VolumeCapability.MountVolume", &[("fs_type", 1), ("mount_flags", 2), ("volume_mount_group", 3)]),
            (
                "NodePublishVolumeRequest",
                &[
                    ("volume_id", 1),
                    ("publish_context", 2),
                    ("staging_target_path", 3),
                    ("target_path", 4),
                    ("volume_capability", 5),
                    ("readonly", 6),
                    ("secrets", 7),
                    ("volume_context", 8),
                ],
            ),
            ("NodeGetInfoResponse", &[("node_id", 1), ("max_volumes_per_node", 2), ("accessible_topology", 3)]),
            (
                "Snapshot",
                &[
                    ("size_bytes", 1),
                    ("snapshot_id", 2),
                    ("source_volume_id", 3),
                    ("creation_time", 4),
                    ("ready_to_use", 5),
                    ("group_snapshot_id", 6),
                ],
            ),
            (
                "GetCapacityResponse",
                &[("available_capacity", 1), ("maximum_volume_size", 2), ("minimum_volume_size", 3)],
            ),
            ("ControllerModifyVolumeRequest", &[("volume_id", 1), ("secrets", 2), ("mutable_parameters", 3)]),
            ("GetSnapshotRequest", &[("snapshot_id", 1), ("secrets", 2)]),
            ("GetSnapshotResponse", &[("snapshot", 1)]),
            (
                "GetMetadataDeltaRequest",
                &[
                    ("base_snapshot_id", 1),
                    ("target_snapshot_id", 2),
                    ("starting_offset", 3),
                    ("max_results", 4),
                    ("secrets", 5),
                ],
            ),
            (
                "GetMetadataAllocatedResponse",
                &[("block_metadata_type", 1), ("volume_capacity_bytes", 2), ("block_metadata", 3)],
            ),
        ];
        for (msg, fields) in cases {
            assert_eq!(field_numbers(message(&file, msg)?), names(fields), "fields of {msg}");
        }

        let oneofs: Vec<(String, Vec<String>)> = all_messages(&file)
            .into_iter()
            .filter(|(_, m)| !m.oneof_decl.is_empty())
            .map(|(n, m)| (n, m.oneof_decl.iter().map(|o| o.name.clone().unwrap_or_default()).collect()))
            .collect();
        let expected: Vec<(String, Vec<String>)> = [
            ("PluginCapability", "type"),
            ("VolumeContentSource", "type"),
            ("VolumeCapability", "access_type"),
            ("ControllerServiceCapability", "type"),
            ("NodeServiceCapability", "type"),
            ("GroupControllerServiceCapability", "type"),
        ]
        .iter()
        .map(|(m, o)| ((*m).to_owned(), vec![(*o).to_owned()]))
        .collect();
        assert_eq!(oneofs, expected);
        Ok(())
    }

    #[test]
    fn descriptor_set_marks_secrets_and_alpha_like_spec() -> TestResult {
        let file = csi_file()?;
        let messages = all_messages(&file);

        let mut secrets = BTreeSet::new();
        let mut alpha_fields = BTreeSet::new();
        let mut alpha_messages = BTreeSet::new();
        let mut alpha_enum_values = BTreeSet::new();
        for (name, m) in &messages {
            if is_alpha(m.options.as_ref()) {
                alpha_messages.insert(name.clone());
            }
            for f in &m.field {
                let full = format!("{name}.{}", f.name.as_deref().unwrap_or_default());
                let opts = f.options.as_ref();
                if opts.and_then(|o| o.csi_secret) == Some(true) {
                    secrets.insert(full.clone());
                }
                if opts.and_then(|o| o.alpha_field) == Some(true) {
                    alpha_fields.insert(full);
                }
            }
            for e in &m.enum_type {
                assert!(!is_alpha(e.options.as_ref()), "no alpha_enum in v1.12");
                for v in &e.value {
                    if is_alpha(v.options.as_ref()) {
                        alpha_enum_values.insert(format!(
                            "{name}.{}.{}",
                            e.name.as_deref().unwrap_or_default(),
                            v.name.as_deref().unwrap_or_default()
                        ));
                    }
                }
            }
        }

        let set = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<BTreeSet<_>>();
        assert_eq!(
            secrets,
            set(&[
                "CreateVolumeRequest.secrets",
                "DeleteVolumeRequest.secrets",
                "ControllerPublishVolumeRequest.secrets",
                "ControllerUnpublishVolumeRequest.secrets",
                "ValidateVolumeCapabilitiesRequest.secrets",
                "ControllerModifyVolumeRequest.secrets",
                "CreateSnapshotRequest.secrets",
                "DeleteSnapshotRequest.secrets",
                "ListSnapshotsRequest.secrets",
                "GetSnapshotRequest.secrets",
                "ControllerExpandVolumeRequest.secrets",
                "NodeStageVolumeRequest.secrets",
                "NodePublishVolumeRequest.secrets",
                "NodeExpandVolumeRequest.secrets",
                "CreateVolumeGroupSnapshotRequest.secrets",
                "DeleteVolumeGroupSnapshotRequest.secrets",
                "GetVolumeGroupSnapshotRequest.secrets",
                "GetMetadataAllocatedRequest.secrets",
                "GetMetadataDeltaRequest.secrets",
            ])
        );
        assert_eq!(
            alpha_fields,
            set(&[
                "ListVolumesResponse.VolumeStatus.volume_condition",
                "GetCapacityResponse.minimum_volume_size",
                "NodeGetVolumeStatsResponse.volume_condition",
                "NodeExpandVolumeRequest.secrets",
            ])
        );
        assert_eq!(
            alpha_messages,
            set(&[
                "ControllerGetVolumeRequest",
                "ControllerGetVolumeResponse",
                "GetSnapshotRequest",
                "GetSnapshotResponse",
                "VolumeCondition",
            ])
        );
        assert_eq!(
            alpha_enum_values,
            set(&[
                "PluginCapability.Service.Type.SNAPSHOT_METADATA_SERVICE",
                "VolumeCapability.AccessMode.Mode.SINGLE_NODE_SINGLE_WRITER",
                "VolumeCapability.AccessMode.Mode.SINGLE_NODE_MULTI_WRITER",
                "ControllerServiceCapability.RPC.Type.VOLUME_CONDITION",
                "ControllerServiceCapability.RPC.Type.GET_VOLUME",
                "ControllerServiceCapability.RPC.Type.SINGLE_NODE_MULTI_WRITER",
                "ControllerServiceCapability.RPC.Type.GET_SNAPSHOT",
                "NodeServiceCapability.RPC.Type.VOLUME_CONDITION",
                "NodeServiceCapability.RPC.Type.SINGLE_NODE_MULTI_WRITER",
            ])
        );

        // The one top-level enum.
        let top: Vec<(String, Vec<(String, i32)>)> = file
            .enum_type
            .iter()
            .map(|e| {
                (
                    e.name.clone().unwrap_or_default(),
                    e.value
                        .iter()
                        .map(|v| (v.name.clone().unwrap_or_default(), v.number.unwrap_or_default()))
                        .collect(),
                )
            })
            .collect();
        assert_eq!(
            top,
            vec![(
                "BlockMetadataType".to_owned(),
                names(&[("UNKNOWN", 0), ("FIXED_LENGTH", 1), ("VARIABLE_LENGTH", 2)])
            )]
        );
        // 94 `message` declarations plus one synthesized entry type per map field (40).
        assert_eq!(messages.len(), 134, "total message count (incl. nested)");
        Ok(())
    }
}
