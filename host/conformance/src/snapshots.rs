//! Snapshots (CreateSnapshot idempotent, GetSnapshot, ListSnapshots with its filters and
//! paging, DeleteSnapshot) and clones (CreateVolume from a snapshot and from a volume, with the
//! node flow's data in them).
use crate::{DATA_FILE, FOREIGN_ID, MAX_PAGES, NO_VOLUME, Objects, Suite, call, made_snapshot, made_volume, status};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use tonic::Code;
use tonic::Status;
use wasmcsi_proto::csi::v1 as csi;

impl Suite<'_> {
    pub(crate) async fn snapshot_checks(&mut self, objects: &Objects) -> Option<csi::Snapshot> {
        const CREATE: &str = "CreateSnapshot snapshots the volume";
        const REPEAT: &str = "CreateSnapshot repeated returns the same snapshot";
        const CONFLICT: &str = "CreateSnapshot with the same name from another volume is AlreadyExists";
        const BY_ID: &str = "ListSnapshots by snapshot_id finds exactly the snapshot";
        const BY_SOURCE: &str = "ListSnapshots by source_volume_id finds the snapshot";
        const GET: &str = "GetSnapshot returns the snapshot";
        let volume = objects.volume.as_ref();
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::CreateDeleteSnapshot),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        let name = self.name("snap");
        let request = self.secreted(csi::CreateSnapshotRequest {
            source_volume_id: volume.map(|v| v.volume_id.clone()).unwrap_or_default(),
            name: name.clone(),
            ..Default::default()
        });
        let mut snapshot = None;
        if self.open(CREATE, &blocked) {
            let answer = call(self.ctl().create_snapshot(request.clone())).await;
            if let Ok(r) = &answer {
                self.created.made(&made_snapshot(r.clone()));
            }
            let source = request.source_volume_id.clone();
            let mut made = None;
            self.judge_optional(CREATE, answer, |r| match r.snapshot {
                Some(s) if !s.snapshot_id.is_empty() && s.source_volume_id == source => {
                    made = Some(s);
                    Ok(())
                }
                Some(s) => Err(format!(
                    "snapshot {:?} of {:?}, expected a snapshot of {source}",
                    s.snapshot_id, s.source_volume_id
                )),
                None => Err("the answer carries no snapshot".into()),
            });
            snapshot = made;
        }
        let blocked =
            Self::gates([blocked, snapshot.is_none().then(|| "no snapshot: CreateSnapshot failed".to_string())]);

        if self.open(REPEAT, &blocked)
            && let Some(s) = &snapshot
        {
            let answer = call(self.ctl().create_snapshot(request.clone())).await;
            if let Ok(r) = &answer {
                self.created.made(&made_snapshot(r.clone()));
            }
            let first = s.snapshot_id.clone();
            self.judge(
                REPEAT,
                answer.map_err(status).and_then(|r| match r.snapshot {
                    Some(again) if again.snapshot_id == first => Ok(()),
                    Some(again) => Err(format!("first {first}, then {}", again.snapshot_id)),
                    None => Err("the answer carries no snapshot".into()),
                }),
            );
        }

        let conflict_blocked = Self::gates([
            blocked.clone(),
            objects.other.is_none().then(|| "no second volume: the concurrent CreateVolume failed".to_string()),
        ]);
        if self.open(CONFLICT, &conflict_blocked)
            && let Some(other) = &objects.other
        {
            let request =
                self.secreted(csi::CreateSnapshotRequest { source_volume_id: other.clone(), ..request.clone() });
            self.expect(CONFLICT, None, Code::AlreadyExists, rpc!(self.ctl(), create_snapshot, request, made_snapshot))
                .await;
        }

        let blocked_get = blocked.clone();
        let list_blocked = Self::gates([self.controller_gate(ControllerRpc::ListSnapshots), blocked]);
        if self.open(BY_ID, &list_blocked)
            && let Some(s) = &snapshot
        {
            let answer = self
                .list_snapshots(csi::ListSnapshotsRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() })
                .await;
            let want = s.snapshot_id.clone();
            self.judge_optional(BY_ID, answer, |found| {
                if found.len() == 1 && found[0].snapshot_id == want {
                    Ok(())
                } else {
                    Err(format!("found {:?}", found.iter().map(|s| &s.snapshot_id).collect::<Vec<_>>()))
                }
            });
        }
        if self.open(BY_SOURCE, &list_blocked)
            && let Some(s) = &snapshot
        {
            let answer = self
                .list_snapshots(csi::ListSnapshotsRequest {
                    source_volume_id: s.source_volume_id.clone(),
                    ..Default::default()
                })
                .await;
            let (want, source) = (s.snapshot_id.clone(), s.source_volume_id.clone());
            self.judge_optional(BY_SOURCE, answer, |found| {
                if !found.iter().any(|s| s.snapshot_id == want) {
                    Err(format!(
                        "{want} is missing from {:?}",
                        found.iter().map(|s| &s.snapshot_id).collect::<Vec<_>>()
                    ))
                } else if let Some(other) = found.iter().find(|s| s.source_volume_id != source) {
                    Err(format!("{} of {} is listed too", other.snapshot_id, other.source_volume_id))
                } else {
                    Ok(())
                }
            });
        }
        let get_gate = self.controller_gate(ControllerRpc::GetSnapshot);
        if self.open(GET, &Self::gates([get_gate.clone(), blocked_get]))
            && let Some(s) = &snapshot
        {
            let request =
                self.secreted(csi::GetSnapshotRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() });
            let answer = call(self.ctl().get_snapshot(request)).await;
            let want = s.clone();
            self.judge(
                GET,
                answer.map_err(status).and_then(|r| match r.snapshot {
                    Some(got)
                        if got.snapshot_id == want.snapshot_id && got.source_volume_id == want.source_volume_id =>
                    {
                        Ok(())
                    }
                    Some(got) => Err(format!(
                        "asked for {} of {}, got {} of {}",
                        want.snapshot_id, want.source_volume_id, got.snapshot_id, got.source_volume_id
                    )),
                    None => Err("the answer carries no snapshot".into()),
                }),
            );
        }
        for (label, id) in [
            ("a well-formed unknown snapshot id", self.unknown_id()),
            ("a foreign snapshot id", FOREIGN_ID.to_string()),
        ] {
            let request = self.secreted(csi::GetSnapshotRequest { snapshot_id: id.clone(), ..Default::default() });
            self.expect_optional(
                &format!("GetSnapshot of {label} is NotFound"),
                get_gate.clone(),
                Code::NotFound,
                rpc!(self.ctl(), get_snapshot, request),
            )
            .await;
            let name = format!("ListSnapshots by {label} is empty");
            if self.open(&name, &self.controller_gate(ControllerRpc::ListSnapshots)) {
                let answer =
                    self.list_snapshots(csi::ListSnapshotsRequest { snapshot_id: id, ..Default::default() }).await;
                self.judge_optional(&name, answer, |found| {
                    if found.is_empty() { Ok(()) } else { Err(format!("found {found:?}")) }
                });
            }
        }
        snapshot
    }

    /// Every snapshot a filter matches, following pages.
    pub(crate) async fn list_snapshots(
        &mut self,
        request: csi::ListSnapshotsRequest,
    ) -> Result<Vec<csi::Snapshot>, Status> {
        let mut found = Vec::new();
        let mut token = String::new();
        for _ in 0..MAX_PAGES {
            let r =
                call(self.ctl().list_snapshots(csi::ListSnapshotsRequest { starting_token: token, ..request.clone() }))
                    .await?;
            found.extend(r.entries.into_iter().filter_map(|e| e.snapshot));
            if r.next_token.is_empty() {
                return Ok(found);
            }
            token = r.next_token;
        }
        Err(Status::internal(format!("ListSnapshots handed out more than {MAX_PAGES} pages")))
    }

    pub(crate) async fn clone_checks(&mut self, objects: &mut Objects) {
        const FROM_SNAPSHOT: &str = "CreateVolume from the snapshot clones it";
        const FROM_VOLUME: &str = "CreateVolume from the volume clones it";
        const SNAPSHOT_DATA: &str = "a clone of the snapshot holds the data written before the snapshot";
        const VOLUME_DATA: &str = "a clone of the volume holds the volume's data";
        use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};

        let snapshot_source = objects.snapshot.as_ref().map(|s| (s.snapshot_id.clone(), s.size_bytes));
        let volume_source =
            objects.volume.as_ref().map(|v| (v.volume_id.clone(), objects.expanded.unwrap_or(v.capacity_bytes)));
        let cases = [
            (
                FROM_SNAPSHOT,
                SNAPSHOT_DATA,
                "snapshot-clone",
                Self::gates([
                    self.controller_gate(ControllerRpc::CreateDeleteSnapshot),
                    snapshot_source.is_none().then(|| "no snapshot".to_string()),
                ]),
                snapshot_source.map(|(id, size)| (Type::Snapshot(SnapshotSource { snapshot_id: id }), size)),
            ),
            (
                FROM_VOLUME,
                VOLUME_DATA,
                "volume-clone",
                Self::gates([
                    self.controller_gate(ControllerRpc::CloneVolume),
                    volume_source.is_none().then(|| NO_VOLUME.to_string()),
                ]),
                volume_source.map(|(id, size)| (Type::Volume(VolumeSource { volume_id: id }), size)),
            ),
        ];
        for (name, data_name, what, blocked, source) in cases {
            let mut clone = None;
            if self.open(name, &blocked)
                && let Some((source, size)) = source
            {
                let content = csi::VolumeContentSource { r#type: Some(source) };
                let request = csi::CreateVolumeRequest {
                    volume_content_source: Some(content.clone()),
                    ..self.create_request(&self.name(what), self.profile.required_bytes.max(size))
                };
                let answer = self.create_pending(request).await;
                if let Ok(r) = &answer {
                    self.created.made(&made_volume(r.clone()));
                }
                let mut made = None;
                self.judge_optional(name, answer, |r| match r.volume {
                    Some(v) if v.content_source.as_ref() == Some(&content) => {
                        made = Some(v);
                        Ok(())
                    }
                    Some(v) => Err(format!(
                        "volume {} answers content_source {:?}, expected {content:?}",
                        v.volume_id, v.content_source
                    )),
                    None => Err("the answer carries no volume".into()),
                });
                clone = made;
            }
            if let Some(c) = &clone {
                objects.clones.push(c.volume_id.clone());
            }
            let data_blocked = if !self.profile.node {
                Some("profile.node is off (reading a clone needs real mounts)".to_string())
            } else {
                Self::gates([
                    self.node_gate(None),
                    clone.is_none().then(|| "no clone".to_string()),
                    (!objects.data_written).then(|| "the node flow wrote no data".to_string()),
                ])
            };
            if self.open(data_name, &data_blocked)
                && let Some(c) = &clone
            {
                let verdict = self.read_through_mount(&c.volume_id, &c.volume_context, what).await.and_then(|read| {
                    if read == self.data() {
                        Ok(())
                    } else {
                        Err(format!("{DATA_FILE} holds {} other bytes", read.len()))
                    }
                });
                self.judge(data_name, verdict);
            }
        }
    }
}

impl Suite<'_> {
    /// A volume deleted while a snapshot of it exists (the spec lets snapshots outlive their
    /// source): CreateVolume of its name again must not be refused for good. It makes a new
    /// volume, or answers ABORTED (the CO retries) until the snapshot is deleted, then makes
    /// one. ALREADY_EXISTS is final for a CO: the claim would never bind. A plugin that refuses
    /// to delete a volume with snapshots (FAILED_PRECONDITION, as the spec allows) skips it.
    pub(crate) async fn reused_name_check(&mut self) {
        const REUSED: &str =
            "CreateVolume of a name whose volume was deleted while a snapshot of it exists is not AlreadyExists";
        let blocked = self.controller_gate(ControllerRpc::CreateDeleteSnapshot);
        if !self.open(REUSED, &blocked) {
            return;
        }
        let verdict = self.reused_name().await;
        match verdict {
            Ok(None) => self.judge(REUSED, Ok(())),
            Ok(Some(skip)) => self.record(REUSED, crate::Outcome::Skip(skip)),
            Err(e) => self.judge(REUSED, Err(e)),
        }
    }

    /// The steps of [`Self::reused_name_check`]: `Ok(Some(why))` when it does not apply.
    async fn reused_name(&mut self) -> Result<Option<String>, String> {
        let name = self.name("reused");
        let request = self.create_request(&name, self.profile.required_bytes);
        let first = call(self.ctl().create_volume(request.clone()))
            .await
            .map_err(|s| format!("CreateVolume: {}", status(s)))?;
        self.created.made(&made_volume(first.clone()));
        let volume = first.volume.ok_or("CreateVolume answered no volume")?;
        let snapshot = call(self.ctl().create_snapshot(self.secreted(csi::CreateSnapshotRequest {
            source_volume_id: volume.volume_id.clone(),
            name: self.name("reused-snap"),
            ..Default::default()
        })))
        .await;
        let snapshot = match snapshot {
            Ok(r) => {
                self.created.made(&made_snapshot(r.clone()));
                r.snapshot.ok_or("CreateSnapshot answered no snapshot")?
            }
            Err(s) if s.code() == Code::Unimplemented => return Ok(Some(format!("not supported: {}", s.message()))),
            Err(s) => return Err(format!("CreateSnapshot: {}", status(s))),
        };
        match call(self.ctl().delete_volume(self.delete_request(&volume.volume_id))).await {
            Ok(_) => {}
            Err(s) if s.code() == Code::FailedPrecondition => {
                return Ok(Some(format!("the volume is not deleted while it has snapshots: {}", s.message())));
            }
            Err(s) => return Err(format!("DeleteVolume with a snapshot: {}", status(s))),
        }
        // While the snapshot exists: a new volume, or ABORTED.
        match call(self.ctl().create_volume(request.clone())).await {
            Ok(r) => {
                self.created.made(&made_volume(r.clone()));
                let id = r.volume.map(|v| v.volume_id).unwrap_or_default();
                call(self.ctl().delete_volume(self.delete_request(&id)))
                    .await
                    .map_err(|s| format!("DeleteVolume: {}", status(s)))?;
            }
            Err(s) if s.code() == Code::Aborted => {}
            Err(s) => return Err(format!("CreateVolume while the snapshot exists: {}", status(s))),
        }
        call(self.ctl().delete_snapshot(
            self.secreted(csi::DeleteSnapshotRequest { snapshot_id: snapshot.snapshot_id, ..Default::default() }),
        ))
        .await
        .map_err(|s| format!("DeleteSnapshot: {}", status(s)))?;
        // With the snapshot gone the name is free: it makes a volume.
        let last = call(self.ctl().create_volume(request))
            .await
            .map_err(|s| format!("CreateVolume after the snapshot was deleted: {}", status(s)))?;
        self.created.made(&made_volume(last.clone()));
        let id = last.volume.map(|v| v.volume_id).unwrap_or_default();
        call(self.ctl().delete_volume(self.delete_request(&id)))
            .await
            .map_err(|s| format!("DeleteVolume: {}", status(s)))?;
        Ok(None)
    }
}
