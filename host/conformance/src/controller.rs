//! The Controller service's volume calls: the `backend` parameter, unknown ids, CreateVolume
//! (idempotent, under concurrent retries), GetCapacity, ControllerGetVolume,
//! ControllerExpandVolume, ControllerPublishVolume to a node that does not exist, ListVolumes
//! (paging) and DeleteVolume.
use crate::{
    CALL_TIMEOUT, FOREIGN_ID, MAX_PAGES, NO_VOLUME, Objects, Outcome, PARALLEL, Suite, UNKNOWN_BACKEND, call,
    expect_code, made_snapshot, made_volume, path_str, status,
};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use std::collections::HashMap;
use std::collections::HashSet;
use std::time::Duration;
use tonic::Code;
use tonic::Status;
use wasmcsi_csi::plugin::BACKEND_PARAMETER;
use wasmcsi_proto::csi::v1 as csi;

impl Suite<'_> {
    /// The `backend` parameter: missing or unknown is INVALID_ARGUMENT naming the choices.
    pub(crate) async fn backend_parameter_checks(&mut self) {
        let cases = [
            (
                "CreateVolume with an unknown backend is InvalidArgument listing the available ones",
                Some(UNKNOWN_BACKEND),
            ),
            ("CreateVolume without a backend parameter is InvalidArgument listing the available ones", None),
        ];
        for (name, backend) in cases {
            let mut request = self.create_request(&self.name("no-backend"), self.profile.required_bytes);
            match backend {
                Some(b) => request.parameters.insert(BACKEND_PARAMETER.into(), b.into()),
                None => request.parameters.remove(BACKEND_PARAMETER),
            };
            let answer = call(self.ctl().create_volume(request)).await;
            let verdict = match answer {
                Err(s) if s.code() == Code::InvalidArgument && s.message().contains(self.backend.as_str()) => Ok(()),
                Err(s) if s.code() == Code::InvalidArgument => {
                    Err(format!("the message does not list the available backend {:?}: {}", self.backend, s.message()))
                }
                Err(s) => Err(format!("expected InvalidArgument, got {}", status(s))),
                Ok(r) => {
                    self.created.made(&made_volume(r));
                    Err("expected InvalidArgument, got OK".into())
                }
            };
            self.judge(name, verdict);
        }
    }

    /// Unknown ids: NOT_FOUND where the spec says so, OK for deletes.
    pub(crate) async fn unknown_id_checks(&mut self) {
        let staging = self.work.join("unknown-staging");
        let target = self.work.join("unknown-target").join("mount");
        for dir in [&staging, &self.work.join("unknown-target")] {
            if let Err(e) = std::fs::create_dir_all(dir) {
                tracing::warn!(path = %dir.display(), "conformance: cannot create directory: {e}");
            }
        }
        for (label, id) in [("a well-formed unknown id", self.unknown_id()), ("a foreign id", FOREIGN_ID.to_string())] {
            let cap = self.profile.capability.clone();
            let request = self.secreted(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: id.clone(),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            });
            self.expect(
                &format!("ValidateVolumeCapabilities of {label} is NotFound"),
                None,
                Code::NotFound,
                rpc!(self.ctl(), validate_volume_capabilities, request),
            )
            .await;

            let gate = self.controller_gate(ControllerRpc::GetVolume);
            let request = csi::ControllerGetVolumeRequest { volume_id: id.clone() };
            self.expect_optional(
                &format!("ControllerGetVolume of {label} is NotFound"),
                gate,
                Code::NotFound,
                rpc!(self.ctl(), controller_get_volume, request),
            )
            .await;

            let gate = self.controller_gate(ControllerRpc::ExpandVolume);
            let request = self.secreted(csi::ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: self.profile.required_bytes.saturating_mul(2),
                    limit_bytes: 0,
                }),
                ..Default::default()
            });
            self.expect_optional(
                &format!("ControllerExpandVolume of {label} is NotFound"),
                gate,
                Code::NotFound,
                rpc!(self.ctl(), controller_expand_volume, request),
            )
            .await;

            let gate = self.controller_gate(ControllerRpc::CreateDeleteSnapshot);
            let request = self.secreted(csi::CreateSnapshotRequest {
                source_volume_id: id.clone(),
                name: self.name("snap-of-unknown"),
                ..Default::default()
            });
            self.expect_optional(
                &format!("CreateSnapshot from {label} is NotFound"),
                gate.clone(),
                Code::NotFound,
                rpc!(self.ctl(), create_snapshot, request, made_snapshot),
            )
            .await;

            let request = self.secreted(csi::DeleteSnapshotRequest { snapshot_id: id.clone(), ..Default::default() });
            self.expect_optional(
                &format!("DeleteSnapshot of {label} is OK"),
                gate,
                Code::Ok,
                rpc!(self.ctl(), delete_snapshot, request),
            )
            .await;

            let request = self.delete_request(&id);
            self.expect(
                &format!("DeleteVolume of {label} is OK"),
                None,
                Code::Ok,
                rpc!(self.ctl(), delete_volume, request),
            )
            .await;

            let request = self.stage_request(&id, &HashMap::new(), &staging);
            self.created.staged.push((id.clone(), staging.clone()));
            self.expect(
                &format!("NodeStageVolume of {label} is NotFound"),
                self.node_gate(None),
                Code::NotFound,
                rpc!(self.nd(), node_stage_volume, request),
            )
            .await;

            let request = self.publish_request(&id, &HashMap::new(), &staging, &target, false);
            self.created.published.push((id.clone(), target.clone()));
            self.expect(
                &format!("NodePublishVolume of {label} is NotFound"),
                self.node_gate(None),
                Code::NotFound,
                rpc!(self.nd(), node_publish_volume, request),
            )
            .await;

            let request = csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: path_str(&self.work),
                ..Default::default()
            };
            self.expect(
                &format!("NodeGetVolumeStats of {label} is NotFound"),
                self.node_gate(Some(NodeRpc::GetVolumeStats)),
                Code::NotFound,
                rpc!(self.nd(), node_get_volume_stats, request),
            )
            .await;
        }
    }

    /// The volume most later checks use, and CreateVolume's idempotency.
    pub(crate) async fn create_volume_checks(&mut self) -> Option<csi::Volume> {
        const CREATE: &str = "CreateVolume creates a volume";
        const REPEAT: &str = "CreateVolume repeated with the same name and parameters returns the same volume";
        const CONFLICT: &str = "CreateVolume with the same name and a larger size is AlreadyExists";
        const VALIDATE: &str = "ValidateVolumeCapabilities confirms the profile's capability";
        let name = self.name("vol");
        let required = self.profile.required_bytes;
        let request = self.create_request(&name, required);
        let answer = call(self.ctl().create_volume(request.clone())).await;
        let volume = match answer {
            Ok(r) => {
                self.created.made(&made_volume(r.clone()));
                // `BACKEND@NODE:` for a node-local backend's volume in a multi-node cluster.
                let prefix = format!("{}:", self.backend);
                let pinned = format!("{}@", self.backend);
                let verdict = match &r.volume {
                    None => Err("the answer carries no volume".to_string()),
                    Some(v) if !v.volume_id.starts_with(&prefix) && !v.volume_id.starts_with(&pinned) => {
                        Err(format!("volume id {:?} does not start with {prefix:?}", v.volume_id))
                    }
                    Some(v) if v.capacity_bytes < required => {
                        Err(format!("capacity {} < required {required}", v.capacity_bytes))
                    }
                    Some(_) => Ok(()),
                };
                let ok = verdict.is_ok();
                self.judge(CREATE, verdict);
                r.volume.filter(|_| ok)
            }
            Err(s) => {
                self.record(CREATE, Outcome::Fail(status(s)));
                None
            }
        };
        let blocked = volume.is_none().then(|| NO_VOLUME.to_string());

        if self.open(REPEAT, &blocked)
            && let Some(v) = &volume
        {
            let answer = call(self.ctl().create_volume(request.clone())).await;
            let verdict = match answer {
                Ok(r) => {
                    self.created.made(&made_volume(r.clone()));
                    match r.volume {
                        Some(again) if again.volume_id == v.volume_id && again.capacity_bytes == v.capacity_bytes => {
                            Ok(())
                        }
                        Some(again) => Err(format!(
                            "first {} ({} bytes), then {} ({} bytes)",
                            v.volume_id, v.capacity_bytes, again.volume_id, again.capacity_bytes
                        )),
                        None => Err("the answer carries no volume".into()),
                    }
                }
                Err(s) => Err(status(s)),
            };
            self.judge(REPEAT, verdict);
        }

        if self.open(CONFLICT, &blocked)
            && let Some(v) = &volume
        {
            let larger = v.capacity_bytes.saturating_add(required.max(1 << 20));
            let request = self.create_request(&name, larger);
            self.expect(CONFLICT, None, Code::AlreadyExists, rpc!(self.ctl(), create_volume, request, made_volume))
                .await;
        }

        if self.open(VALIDATE, &blocked)
            && let Some(v) = &volume
        {
            let request = self.secreted(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: v.volume_id.clone(),
                volume_context: v.volume_context.clone(),
                volume_capabilities: vec![self.profile.capability.clone()],
                parameters: self.profile.parameters.clone(),
                ..Default::default()
            });
            let answer = call(self.ctl().validate_volume_capabilities(request)).await;
            let cap = self.profile.capability.clone();
            self.judge(
                VALIDATE,
                answer.map_err(status).and_then(|r| match r.confirmed {
                    Some(c) if c.volume_capabilities == vec![cap] => Ok(()),
                    Some(c) => Err(format!("confirmed other capabilities: {:?}", c.volume_capabilities)),
                    None => Err(format!("not confirmed: {}", r.message)),
                }),
            );
        }
        volume
    }

    /// Retries racing each other: every answer is the one volume, or ABORTED.
    pub(crate) async fn concurrent_create_check(&mut self) -> Option<String> {
        const NAME: &str = "CreateVolume sent 8 times in parallel yields one volume (OK with the same id, or Aborted)";
        let request = self.create_request(&self.name("race"), self.profile.required_bytes);
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..PARALLEL {
            let mut client = self.ctl();
            let request = request.clone();
            calls.spawn(async move { call(client.create_volume(request)).await });
        }
        let mut ids = Vec::new();
        let mut problems = Vec::new();
        let mut aborted = 0;
        while let Some(joined) = calls.join_next().await {
            match joined {
                Ok(Ok(r)) => match r.volume {
                    Some(v) => ids.push(v.volume_id),
                    None => problems.push("an OK answer without a volume".to_string()),
                },
                Ok(Err(s)) if s.code() == Code::Aborted => aborted += 1,
                Ok(Err(s)) => problems.push(status(s)),
                Err(e) => problems.push(format!("call task failed: {e}")),
            }
        }
        for id in &ids {
            self.created.volume(id);
        }
        let distinct: HashSet<&String> = ids.iter().collect();
        if ids.is_empty() {
            problems.push(format!("no call succeeded ({aborted} Aborted)"));
        }
        if distinct.len() > 1 {
            problems.push(format!("several volumes for one name: {distinct:?}"));
        }
        let verdict = if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) };
        self.judge(NAME, verdict);
        (distinct.len() == 1).then(|| ids.swap_remove(0))
    }

    pub(crate) async fn get_capacity_check(&mut self) {
        const NAME: &str = "GetCapacity answers for the profile's parameters";
        if !self.open(NAME, &self.controller_gate(ControllerRpc::GetCapacity)) {
            return;
        }
        let request = csi::GetCapacityRequest {
            volume_capabilities: vec![self.profile.capability.clone()],
            parameters: self.profile.parameters.clone(),
            ..Default::default()
        };
        let answer = call(self.ctl().get_capacity(request)).await;
        self.judge_optional(NAME, answer, |r| {
            let sizes = [Some(r.available_capacity), r.maximum_volume_size, r.minimum_volume_size];
            if sizes.into_iter().flatten().any(|s| s < 0) { Err(format!("negative size in {r:?}")) } else { Ok(()) }
        });
    }

    pub(crate) async fn get_volume_check(&mut self, volume: Option<&csi::Volume>) {
        const NAME: &str = "ControllerGetVolume returns the volume";
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::GetVolume),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        if !self.open(NAME, &blocked) {
            return;
        }
        let Some(v) = volume else { return };
        let answer =
            call(self.ctl().controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() }))
                .await;
        let (id, required) = (v.volume_id.clone(), self.profile.required_bytes);
        self.judge_optional(NAME, answer, |r| match r.volume {
            Some(got) if got.volume_id == id && got.capacity_bytes >= required => Ok(()),
            Some(got) => Err(format!("got {} with {} bytes", got.volume_id, got.capacity_bytes)),
            None => Err("the answer carries no volume".into()),
        });
    }

    /// ControllerPublishVolume to a node id no node has is NOT_FOUND (CSI: "a node corresponding
    /// to the specified node_id does not exist"); it runs before the node flow, which publishes
    /// the same volume to the real node, so a ghost made its owner fails that flow too.
    pub(crate) async fn unknown_node_check(&mut self, volume: Option<&csi::Volume>) {
        const NAME: &str = "ControllerPublishVolume to a node that does not exist is NotFound";
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::PublishUnpublishVolume),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        let Some(v) = volume.filter(|_| blocked.is_none()) else {
            self.open(NAME, &blocked);
            return;
        };
        let ghost = format!("no-such-node-{}", self.run);
        // Should it be published there anyway, the cleanup unpublishes it.
        self.created.attached.push((v.volume_id.clone(), ghost.clone()));
        let request = csi::ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: ghost,
            volume_capability: Some(self.profile.capability.clone()),
            readonly: false,
            secrets: self.profile.secrets.clone(),
            volume_context: v.volume_context.clone(),
        };
        self.expect(NAME, None, Code::NotFound, rpc!(self.ctl(), controller_publish_volume, request)).await;
    }

    /// Returns the capacity after expansion.
    pub(crate) async fn expand_checks(&mut self, volume: Option<&csi::Volume>) -> Option<i64> {
        const EXPAND: &str = "ControllerExpandVolume grows the volume to at least the requested size";
        const AFTER: &str = "ControllerGetVolume reports the expanded capacity";
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::ExpandVolume),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        let mut expanded = None;
        if self.open(EXPAND, &blocked)
            && let Some(v) = volume
        {
            let want = v.capacity_bytes.saturating_add(self.profile.required_bytes.max(1 << 20));
            let request = self.secreted(csi::ControllerExpandVolumeRequest {
                volume_id: v.volume_id.clone(),
                capacity_range: Some(csi::CapacityRange { required_bytes: want, limit_bytes: 0 }),
                volume_capability: Some(self.profile.capability.clone()),
                ..Default::default()
            });
            let answer = call(self.ctl().controller_expand_volume(request)).await;
            let mut got = None;
            let ok = self.judge_optional(EXPAND, answer, |r| {
                got = Some(r.capacity_bytes);
                if r.capacity_bytes >= want {
                    Ok(())
                } else {
                    Err(format!("capacity {} < requested {want}", r.capacity_bytes))
                }
            });
            expanded = got.filter(|_| ok);
        }

        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::GetVolume),
            expanded.is_none().then(|| "ControllerExpandVolume did not succeed".to_string()),
        ]);
        if self.open(AFTER, &blocked)
            && let (Some(v), Some(want)) = (volume, expanded)
        {
            let answer = call(
                self.ctl().controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() }),
            )
            .await;
            self.judge_optional(AFTER, answer, |r| match r.volume {
                Some(got) if got.capacity_bytes >= want => Ok(()),
                Some(got) => Err(format!("capacity {} < expanded {want}", got.capacity_bytes)),
                None => Err("the answer carries no volume".into()),
            });
        }
        expanded
    }

    /// Every volume id ListVolumes returns with `max_entries` per page, in order (duplicates kept).
    pub(crate) async fn list_volume_ids(&mut self, max_entries: i32) -> Result<Vec<String>, String> {
        let mut ids = Vec::new();
        let mut token = String::new();
        for _ in 0..MAX_PAGES {
            let r = call(self.ctl().list_volumes(csi::ListVolumesRequest { max_entries, starting_token: token }))
                .await
                .map_err(status)?;
            if max_entries > 0 && r.entries.len() > max_entries as usize {
                return Err(format!("a page of {} entries with max_entries = {max_entries}", r.entries.len()));
            }
            ids.extend(r.entries.into_iter().filter_map(|e| e.volume).map(|v| v.volume_id));
            if r.next_token.is_empty() {
                return Ok(ids);
            }
            token = r.next_token;
        }
        Err(format!("ListVolumes handed out more than {MAX_PAGES} pages"))
    }

    /// CreateVolume, called again while it answers ABORTED ("an operation is pending for this
    /// volume": a clone a backend fills in the background), as the external-provisioner does;
    /// for at most [`CALL_TIMEOUT`].
    pub(crate) async fn create_pending(
        &mut self,
        request: csi::CreateVolumeRequest,
    ) -> Result<csi::CreateVolumeResponse, Status> {
        let started = std::time::Instant::now();
        loop {
            match call(self.ctl().create_volume(request.clone())).await {
                Err(s) if s.code() == Code::Aborted && started.elapsed() < CALL_TIMEOUT => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                answer => return answer,
            }
        }
    }

    pub(crate) async fn list_volumes_checks(&mut self, objects: &Objects) {
        const CONTAINS: &str = "ListVolumes includes the created volume";
        const PAGED: &str = "ListVolumes pages one entry at a time to the end without duplicates";
        const BAD_TOKEN: &str = "ListVolumes with an invalid starting_token is Aborted";
        let gate = self.controller_gate(ControllerRpc::ListVolumes);
        let ours: Vec<String> = objects
            .volume
            .iter()
            .map(|v| v.volume_id.clone())
            .chain(objects.other.clone())
            .chain(objects.clones.clone())
            .collect();

        let blocked = Self::gates([gate.clone(), objects.volume.is_none().then(|| NO_VOLUME.to_string())]);
        if self.open(CONTAINS, &blocked) {
            let verdict = self.list_volume_ids(0).await.and_then(|ids| {
                let missing: Vec<&String> = ours.iter().filter(|v| !ids.contains(v)).collect();
                if missing.is_empty() { Ok(()) } else { Err(format!("missing {missing:?}")) }
            });
            self.judge(CONTAINS, verdict);
        }
        if self.open(PAGED, &blocked) {
            let verdict = self.list_volume_ids(1).await.and_then(|ids| {
                let mut seen = HashSet::new();
                if let Some(dup) = ids.iter().find(|id| !seen.insert(*id)) {
                    return Err(format!("{dup} listed twice"));
                }
                let missing: Vec<&String> = ours.iter().filter(|v| !seen.contains(v)).collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("missing {missing:?} from the {} paged entries", ids.len()))
                }
            });
            self.judge(PAGED, verdict);
        }
        if self.open(BAD_TOKEN, &gate) {
            let mut problems = Vec::new();
            for token in ["csic-invalid-token".to_string(), format!("{}:csic-invalid-token", self.backend)] {
                let answer = call(
                    self.ctl().list_volumes(csi::ListVolumesRequest { max_entries: 0, starting_token: token.clone() }),
                )
                .await;
                if let Outcome::Fail(why) = expect_code(&answer, Code::Aborted) {
                    problems.push(format!("token {token:?}: {why}"));
                }
            }
            self.judge(BAD_TOKEN, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }
    }

    /// Whether a volume still exists, asked the cheapest way the controller offers.
    pub(crate) async fn volume_exists(&mut self, id: &str) -> Result<bool, String> {
        if self.controller_gate(ControllerRpc::GetVolume).is_none() {
            match call(self.ctl().controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id.to_string() }))
                .await
            {
                Ok(_) => return Ok(true),
                Err(s) if s.code() == Code::NotFound => return Ok(false),
                Err(s) if s.code() == Code::Unimplemented => {}
                Err(s) => return Err(format!("ControllerGetVolume: {}", status(s))),
            }
        }
        if self.controller_gate(ControllerRpc::ListVolumes).is_none() {
            return self.list_volume_ids(0).await.map(|ids| ids.iter().any(|v| v == id));
        }
        Err("neither GET_VOLUME nor LIST_VOLUMES is offered".into())
    }

    pub(crate) async fn delete_checks(&mut self, objects: &Objects) {
        const DELETE_SNAPSHOT: &str = "DeleteSnapshot deletes the snapshot";
        const DELETE_SNAPSHOT_AGAIN: &str = "DeleteSnapshot repeated is OK";
        const RACE: &str = "DeleteVolume sent 8 times in parallel deletes the volume (each OK or Aborted)";
        const CLONES: &str = "DeleteVolume deletes the clones";
        const DELETE: &str = "DeleteVolume deletes the volume";
        const DELETE_AGAIN: &str = "DeleteVolume repeated is OK";

        let blocked = objects.snapshot.is_none().then(|| "no snapshot".to_string());
        if self.open(DELETE_SNAPSHOT, &blocked)
            && let Some(s) = &objects.snapshot
        {
            let answer =
                call(self.ctl().delete_snapshot(self.secreted(csi::DeleteSnapshotRequest {
                    snapshot_id: s.snapshot_id.clone(),
                    ..Default::default()
                })))
                .await;
            let mut verdict = answer.map(|_| ()).map_err(status);
            if verdict.is_ok() && self.controller_gate(ControllerRpc::ListSnapshots).is_none() {
                verdict = match self
                    .list_snapshots(csi::ListSnapshotsRequest {
                        snapshot_id: s.snapshot_id.clone(),
                        ..Default::default()
                    })
                    .await
                {
                    Ok(found) if found.is_empty() => Ok(()),
                    Ok(_) => Err("ListSnapshots still finds it".into()),
                    Err(s) if s.code() == Code::Unimplemented => Ok(()),
                    Err(s) => Err(format!("ListSnapshots: {}", status(s))),
                };
            }
            self.judge(DELETE_SNAPSHOT, verdict);
        }
        if self.open(DELETE_SNAPSHOT_AGAIN, &blocked)
            && let Some(s) = &objects.snapshot
        {
            let answer =
                call(self.ctl().delete_snapshot(self.secreted(csi::DeleteSnapshotRequest {
                    snapshot_id: s.snapshot_id.clone(),
                    ..Default::default()
                })))
                .await;
            self.record(DELETE_SNAPSHOT_AGAIN, expect_code(&answer, Code::Ok));
        }

        let blocked = objects.other.is_none().then(|| "no volume from the concurrent CreateVolume".to_string());
        if self.open(RACE, &blocked)
            && let Some(id) = &objects.other
        {
            let mut calls = tokio::task::JoinSet::new();
            for _ in 0..PARALLEL {
                let mut client = self.ctl();
                let request = self.delete_request(id);
                calls.spawn(async move { call(client.delete_volume(request)).await });
            }
            let mut problems = Vec::new();
            while let Some(joined) = calls.join_next().await {
                match joined {
                    Ok(Ok(_)) => {}
                    Ok(Err(s)) if s.code() == Code::Aborted => {}
                    Ok(Err(s)) => problems.push(status(s)),
                    Err(e) => problems.push(format!("call task failed: {e}")),
                }
            }
            match self.volume_exists(id).await {
                Ok(false) => {}
                Ok(true) => problems.push(format!("{id} still exists afterwards")),
                Err(e) => problems.push(e),
            }
            self.judge(RACE, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }

        // Clones first: a backend may refuse to delete a volume that clones depend on.
        let blocked = objects.clones.is_empty().then(|| "no clones".to_string());
        if self.open(CLONES, &blocked) {
            let mut problems = Vec::new();
            for id in &objects.clones {
                if let Err(s) = call(self.ctl().delete_volume(self.delete_request(id))).await {
                    problems.push(format!("{id}: {}", status(s)));
                }
            }
            self.judge(CLONES, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }

        let blocked = objects.volume.is_none().then(|| NO_VOLUME.to_string());
        if self.open(DELETE, &blocked)
            && let Some(v) = &objects.volume
        {
            let answer = call(self.ctl().delete_volume(self.delete_request(&v.volume_id))).await;
            let mut verdict = answer.map(|_| ()).map_err(status);
            if verdict.is_ok() {
                verdict = match self.volume_exists(&v.volume_id).await {
                    Ok(false) => Ok(()),
                    Ok(true) => Err(format!("{} still exists", v.volume_id)),
                    Err(e) => Err(e),
                };
            }
            self.judge(DELETE, verdict);
        }
        if self.open(DELETE_AGAIN, &blocked)
            && let Some(v) = &objects.volume
        {
            let answer = call(self.ctl().delete_volume(self.delete_request(&v.volume_id))).await;
            self.record(DELETE_AGAIN, expect_code(&answer, Code::Ok));
        }
    }
}
