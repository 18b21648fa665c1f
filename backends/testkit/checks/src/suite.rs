//! The checks, in the order of `wasmcsi backend check`'s controller checks and named after
//! them with the WIT's function names: what the backend is (`info`), unknown ids, creating a
//! volume (idempotent repeat, conflicting repeat, capabilities, attach plan, any name CSI
//! allows), capacity, `get-volume`, expansion, snapshots, clones, listing with paging, and
//! deleting (idempotent repeat, unknown afterwards). Snapshots are made with no parameters (a
//! VolumeSnapshotClass's are not a StorageClass's), as `backend check` makes them. Optional features the backend does not
//! list are skipped, and so is an answer `unimplemented` (the host would answer that call
//! itself). Every check is judged on its own; one that needs an object an earlier one could not
//! make is skipped with the reason. What the checks make is deleted at the end, and that is a
//! check too.
//!
//! Long (~770 lines, ~740 without its tests) because it is one list: the checks in the order they
//! run, each a short function over the objects the earlier ones made; split, the order would
//! have to be read across files.
use crate::wit::wasmcsi::backend::driver::{self, CreateVolumeRequest, Feature};
use crate::wit::wasmcsi::backend::types::{
    AccessMode, AccessType, CapacityRange, ContentSource, Error, MountVolume, Pair, SecretRef, Snapshot, Volume,
    VolumeCapability,
};
use wasmcsi_check_report::{Outcome, Report};

/// The size of the volumes the checks make.
const REQUIRED_BYTES: u64 = 1 << 20;
/// An id no backend hands out (not of any backend's form).
const FOREIGN_ID: &str = "nope";
/// The WIT's bound on a volume id (so that `BACKEND:ID` fits CSI's 128 bytes).
const MAX_ID_BYTES: usize = 95;
/// Pages followed before a listing counts as a token loop.
const MAX_PAGES: usize = 10_000;
const NO_VOLUME: &str = "no volume: create-volume failed";

/// `not-found: volume x not found`.
pub fn describe(e: &Error) -> String {
    let (code, msg) = match e {
        Error::InvalidArgument(m) => ("invalid-argument", m),
        Error::NotFound(m) => ("not-found", m),
        Error::AlreadyExists(m) => ("already-exists", m),
        Error::FailedPrecondition(m) => ("failed-precondition", m),
        Error::OutOfRange(m) => ("out-of-range", m),
        Error::ResourceExhausted(m) => ("resource-exhausted", m),
        Error::Unavailable(m) => ("unavailable", m),
        Error::Aborted(m) => ("aborted", m),
        Error::Unimplemented(m) => ("unimplemented", m),
        Error::DeadlineExceeded(m) => ("deadline-exceeded", m),
        Error::PermissionDenied(m) => ("permission-denied", m),
        Error::Internal(m) => ("internal", m),
    };
    format!("{code}: {msg}")
}

/// Whether an id keeps the WIT's contract: 1-95 bytes of `[A-Za-z0-9._-]`.
pub fn check_id(what: &str, id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(format!("{what} id {id:?} is not 1-{MAX_ID_BYTES} bytes of [A-Za-z0-9._-]")) }
}

/// The expected error case, by its WIT name.
fn expect_error<T: std::fmt::Debug>(answer: Result<T, Error>, want: &str) -> Result<(), String> {
    match answer {
        Err(e) if describe(&e).starts_with(&format!("{want}:")) => Ok(()),
        Err(e) => Err(format!("expected {want}, got {}", describe(&e))),
        Ok(v) => Err(format!("expected {want}, got ok: {v:?}")),
    }
}

/// A name of exactly `bytes` bytes that CSI allows and ids and paths do not (slash, spaces,
/// accents, CJK, an emoji, a tab, a line feed), as `backend check`'s name checks use.
pub fn unicode_name(prefix: &str, bytes: usize) -> String {
    let mut name = format!("{prefix} /Données\t中文 ✓🦀\n");
    while name.len() + 'é'.len_utf8() <= bytes {
        name.push('é');
    }
    while name.len() < bytes {
        name.push('x');
    }
    name
}

fn mount_capability() -> VolumeCapability {
    VolumeCapability {
        access_type: AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: AccessMode::SingleNodeWriter,
    }
}

fn feature_name(f: Feature) -> &'static str {
    match f {
        Feature::CreateDeleteVolume => "create-delete-volume",
        Feature::CreateDeleteSnapshot => "create-delete-snapshot",
        Feature::ListSnapshots => "list-snapshots",
        Feature::CloneVolume => "clone-volume",
        Feature::ExpandVolume => "expand-volume",
        Feature::OnlineExpansion => "online-expansion",
        Feature::GetCapacity => "get-capacity",
        Feature::ListVolumes => "list-volumes",
        Feature::GetVolume => "get-volume",
        Feature::VolumeCondition => "volume-condition",
        Feature::SingleNodeMultiWriter => "single-node-multi-writer",
        Feature::NodeExpansion => "node-expansion",
        Feature::GetSnapshot => "get-snapshot",
        Feature::SelfHealing => "self-healing",
        Feature::ModifyVolume => "modify-volume",
        Feature::GroupSnapshots => "group-snapshots",
    }
}

/// Run every check against the imported `driver`.
pub fn run(params: &[(String, String)], secrets: &[String]) -> Report {
    let mut suite = Suite {
        params: params.iter().map(|(k, v)| Pair { key: k.clone(), value: v.clone() }).collect(),
        secrets: (1..).zip(secrets).map(|(handle, key)| SecretRef { key: key.clone(), handle }).collect(),
        features: Vec::new(),
        run: run_id(),
        report: Report::default(),
        volumes: Vec::new(),
        snapshots: Vec::new(),
    };
    suite.all_checks();
    suite.clean_up();
    suite.report
}

fn run_id() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{:x}", nanos & 0xffff_ffff_ffff)
}

/// Objects later checks use.
#[derive(Default)]
struct Objects {
    volume: Option<Volume>,
    /// a second volume (the source of the snapshot conflict)
    other: Option<Volume>,
    expanded: Option<u64>,
    snapshot: Option<Snapshot>,
    clones: Vec<String>,
}

struct Suite {
    params: Vec<Pair>,
    secrets: Vec<SecretRef>,
    features: Vec<Feature>,
    run: String,
    report: Report,
    /// made, to delete at the end (deleted ones are removed)
    volumes: Vec<String>,
    snapshots: Vec<String>,
}

impl Suite {
    fn name(&self, what: &str) -> String {
        format!("csic-{}-{what}", self.run)
    }

    /// `Some(reason)` to skip a check of `feature` when the backend does not list it.
    fn gate(&self, feature: Feature) -> Option<String> {
        (!self.features.contains(&feature))
            .then(|| format!("the backend does not list feature {}", feature_name(feature)))
    }

    /// Skip `name` for the first reason given; whether it is open.
    fn open(&mut self, name: &str, blocked: impl IntoIterator<Item = Option<String>>) -> bool {
        match blocked.into_iter().flatten().next() {
            Some(why) => {
                self.report.record(name, Outcome::Skip(why));
                false
            }
            None => true,
        }
    }

    /// Judge an answer of an optional operation: `unimplemented` skips, another error fails.
    fn optional<T>(
        &mut self,
        name: &str,
        answer: Result<T, Error>,
        judge: impl FnOnce(&T) -> Result<(), String>,
    ) -> Option<T> {
        match answer {
            Err(Error::Unimplemented(m)) => {
                self.report.record(name, Outcome::Skip(format!("unimplemented: {m}")));
                None
            }
            Err(e) => {
                self.report.record(name, Outcome::Fail(describe(&e)));
                None
            }
            Ok(v) => self.report.judge(name, judge(&v)).then_some(v),
        }
    }

    fn request(&self, name: &str, required_bytes: u64) -> CreateVolumeRequest {
        CreateVolumeRequest {
            name: name.to_owned(),
            capacity: CapacityRange { required_bytes, limit_bytes: 0 },
            capabilities: vec![mount_capability()],
            parameters: self.params.clone(),
            secrets: self.secrets.clone(),
            content_source: None,
            accessibility: None,
            mutable_parameters: vec![],
        }
    }

    fn create(&mut self, request: &CreateVolumeRequest) -> Result<Volume, Error> {
        let answer = driver::create_volume(request);
        if let Ok(v) = &answer
            && !self.volumes.contains(&v.volume_id)
        {
            self.volumes.push(v.volume_id.clone());
        }
        answer
    }

    fn delete_volume(&mut self, id: &str) -> Result<(), Error> {
        let answer = driver::delete_volume(id, &self.secrets);
        if answer.is_ok() {
            self.volumes.retain(|v| v != id);
        }
        answer
    }

    fn all_checks(&mut self) {
        self.info_checks();
        self.unknown_id_checks();
        let mut objects = Objects { volume: self.create_volume_checks(), ..Default::default() };
        self.name_checks();
        self.get_capacity_check();
        self.get_volume_check(objects.volume.as_ref());
        objects.expanded = self.expand_checks(objects.volume.as_ref());
        self.snapshot_checks(&mut objects);
        self.clone_checks(&mut objects);
        self.list_volumes_checks(&objects);
        self.delete_checks(&objects);
    }

    fn info_checks(&mut self) {
        let info = driver::info();
        let verdict = if info.name.is_empty() {
            Err("name is empty".to_string())
        } else if info.version.is_empty() {
            Err("version is empty".to_string())
        } else {
            Ok(())
        };
        self.report.judge("info returns a name and a version", verdict);
        self.features = info.features;
        let offered = self.features.contains(&Feature::CreateDeleteVolume);
        let listed: Vec<&str> = self.features.iter().map(|f| feature_name(*f)).collect();
        self.report.judge(
            "info lists feature create-delete-volume",
            if offered { Ok(()) } else { Err(format!("features: {listed:?}")) },
        );
    }

    /// Ids the backend never handed out: not-found where the WIT says so, ok for deletes.
    fn unknown_id_checks(&mut self) {
        let cap = mount_capability();
        let answer = driver::validate_volume_capabilities(FOREIGN_ID, &[], &[cap], &self.params);
        self.report
            .judge("validate-volume-capabilities of a foreign id is not-found", expect_error(answer, "not-found"));

        const GET: &str = "get-volume of a foreign id is not-found";
        if self.open(GET, [self.gate(Feature::GetVolume)]) {
            let answer = driver::get_volume(FOREIGN_ID);
            self.report.judge(GET, expect_error(answer, "not-found"));
        }

        const EXPAND: &str = "expand-volume of a foreign id is not-found";
        if self.open(EXPAND, [self.gate(Feature::ExpandVolume)]) {
            let range = CapacityRange { required_bytes: REQUIRED_BYTES * 2, limit_bytes: 0 };
            let answer = driver::expand_volume(FOREIGN_ID, range, None, &self.secrets);
            self.report.judge(EXPAND, expect_error(answer, "not-found"));
        }

        const SNAPSHOT: &str = "create-snapshot from a foreign id is not-found";
        const DELETE_SNAPSHOT: &str = "delete-snapshot of a foreign id is ok";
        if self.open(SNAPSHOT, [self.gate(Feature::CreateDeleteSnapshot)]) {
            let answer = driver::create_snapshot(&self.name("snap-of-foreign"), FOREIGN_ID, &[], &self.secrets);
            if let Ok(s) = &answer {
                self.snapshots.push(s.snapshot_id.clone());
            }
            self.report.judge(SNAPSHOT, expect_error(answer, "not-found"));
        }
        if self.open(DELETE_SNAPSHOT, [self.gate(Feature::CreateDeleteSnapshot)]) {
            let answer = driver::delete_snapshot(FOREIGN_ID, &self.secrets);
            self.report.judge(DELETE_SNAPSHOT, answer.map_err(|e| describe(&e)));
        }

        let answer = driver::delete_volume(FOREIGN_ID, &self.secrets);
        self.report.judge("delete-volume of a foreign id is ok", answer.map_err(|e| describe(&e)));
    }

    /// The volume most later checks use, and create-volume's idempotency.
    fn create_volume_checks(&mut self) -> Option<Volume> {
        const CREATE: &str = "create-volume creates a volume";
        const REPEAT: &str = "create-volume repeated with the same name and parameters returns the same volume";
        const CONFLICT: &str = "create-volume with the same name and a larger size is already-exists";
        const VALIDATE: &str = "validate-volume-capabilities confirms the profile's capability";
        const PLAN: &str = "attach-plan answers for the volume";
        let request = self.request(&self.name("vol"), REQUIRED_BYTES);
        let volume = match self.create(&request) {
            Ok(v) => {
                let verdict = check_id("volume", &v.volume_id).and_then(|()| {
                    if v.capacity_bytes < REQUIRED_BYTES {
                        Err(format!("capacity {} < required {REQUIRED_BYTES}", v.capacity_bytes))
                    } else {
                        Ok(())
                    }
                });
                self.report.judge(CREATE, verdict).then_some(v)
            }
            Err(e) => {
                self.report.record(CREATE, Outcome::Fail(describe(&e)));
                None
            }
        };
        let blocked = volume.is_none().then(|| NO_VOLUME.to_string());
        for name in [REPEAT, CONFLICT, VALIDATE, PLAN] {
            if blocked.is_some() {
                self.open(name, [blocked.clone()]);
            }
        }
        let v = volume?;

        let verdict = match self.create(&request) {
            Ok(again) if again.volume_id == v.volume_id && again.capacity_bytes == v.capacity_bytes => Ok(()),
            Ok(again) => Err(format!(
                "first {:?} ({} bytes), then {:?} ({} bytes)",
                v.volume_id, v.capacity_bytes, again.volume_id, again.capacity_bytes
            )),
            Err(e) => Err(describe(&e)),
        };
        self.report.judge(REPEAT, verdict);

        let larger = self.request(&request.name, v.capacity_bytes.saturating_add(1 << 30));
        let answer = self.create(&larger);
        self.report.judge(CONFLICT, expect_error(answer, "already-exists"));

        let answer =
            driver::validate_volume_capabilities(&v.volume_id, &v.volume_context, &[mount_capability()], &self.params);
        let verdict = match answer {
            Ok(None) => Ok(()),
            Ok(Some(why)) => Err(format!("not confirmed: {why}")),
            Err(e) => Err(describe(&e)),
        };
        self.report.judge(VALIDATE, verdict);

        // The profile's secrets stand for NodeStageVolume's.
        let answer = driver::attach_plan(&v.volume_id, &v.volume_context, &mount_capability(), &self.secrets);
        self.report.judge(PLAN, answer.map(drop).map_err(|e| describe(&e)));
        Some(v)
    }

    /// Any name CSI allows names a volume, and the same name again is the same volume. What
    /// this makes it deletes at once.
    fn name_checks(&mut self) {
        const LONG: &str =
            "create-volume with a 128-byte Unicode name creates a volume, and the same name again returns it";
        let request = self.request(&unicode_name(&self.name("vol-名"), 128), REQUIRED_BYTES);
        let (first, again) = (self.create(&request), self.create(&request));
        let verdict = match (&first, &again) {
            (Ok(a), Ok(b)) if a.volume_id == b.volume_id => check_id("volume", &a.volume_id),
            (Ok(a), Ok(b)) => Err(format!("one name, two volumes: {:?} and {:?}", a.volume_id, b.volume_id)),
            (Err(e), _) | (_, Err(e)) => Err(describe(e)),
        };
        self.report.judge(LONG, verdict);
        for made in [first, again].into_iter().flatten() {
            // Already gone after the first delete when both were one volume: ok as well.
            let _ = self.delete_volume(&made.volume_id);
        }
    }

    fn get_capacity_check(&mut self) {
        const NAME: &str = "get-capacity answers for the profile's parameters";
        if !self.open(NAME, [self.gate(Feature::GetCapacity)]) {
            return;
        }
        let answer = driver::get_capacity(&[mount_capability()], &self.params, None);
        self.optional(NAME, answer, |c| {
            if c.minimum_volume_bytes != 0
                && c.maximum_volume_bytes != 0
                && c.minimum_volume_bytes > c.maximum_volume_bytes
            {
                Err(format!("minimum {} > maximum {}", c.minimum_volume_bytes, c.maximum_volume_bytes))
            } else {
                Ok(())
            }
        });
    }

    fn get_volume_check(&mut self, volume: Option<&Volume>) {
        const NAME: &str = "get-volume returns the volume";
        if !self.open(NAME, [self.gate(Feature::GetVolume), volume.is_none().then(|| NO_VOLUME.to_string())]) {
            return;
        }
        let Some(v) = volume else { return };
        let answer = driver::get_volume(&v.volume_id);
        self.optional(NAME, answer, |s| {
            if s.volume.volume_id == v.volume_id && s.volume.capacity_bytes >= REQUIRED_BYTES {
                Ok(())
            } else {
                Err(format!("got {:?} with {} bytes", s.volume.volume_id, s.volume.capacity_bytes))
            }
        });
    }

    /// The capacity after expansion.
    fn expand_checks(&mut self, volume: Option<&Volume>) -> Option<u64> {
        const EXPAND: &str = "expand-volume grows the volume to at least the requested size";
        const AFTER: &str = "get-volume reports the expanded capacity";
        let mut expanded = None;
        if self.open(EXPAND, [self.gate(Feature::ExpandVolume), volume.is_none().then(|| NO_VOLUME.to_string())])
            && let Some(v) = volume
        {
            let want = v.capacity_bytes.saturating_add(REQUIRED_BYTES);
            let range = CapacityRange { required_bytes: want, limit_bytes: 0 };
            let answer = driver::expand_volume(&v.volume_id, range, Some(&mount_capability()), &self.secrets);
            expanded = self
                .optional(EXPAND, answer, |e| {
                    if e.capacity_bytes >= want {
                        Ok(())
                    } else {
                        Err(format!("capacity {} < requested {want}", e.capacity_bytes))
                    }
                })
                .map(|e| e.capacity_bytes);
        }
        let blocked =
            [self.gate(Feature::GetVolume), expanded.is_none().then(|| "expand-volume did not succeed".to_string())];
        if self.open(AFTER, blocked)
            && let (Some(v), Some(want)) = (volume, expanded)
        {
            let answer = driver::get_volume(&v.volume_id);
            self.optional(AFTER, answer, |s| {
                if s.volume.capacity_bytes >= want {
                    Ok(())
                } else {
                    Err(format!("capacity {} < expanded {want}", s.volume.capacity_bytes))
                }
            });
        }
        expanded
    }

    fn snapshot_checks(&mut self, objects: &mut Objects) {
        const CREATE: &str = "create-snapshot snapshots the volume";
        const REPEAT: &str = "create-snapshot repeated returns the same snapshot";
        const CONFLICT: &str = "create-snapshot with the same name from another volume is already-exists";
        const BY_ID: &str = "list-snapshots by snapshot-id finds exactly the snapshot";
        const BY_SOURCE: &str = "list-snapshots by source-volume-id finds the snapshot";
        const GET: &str = "get-snapshot returns the snapshot";
        let gate = self.gate(Feature::CreateDeleteSnapshot);
        let no_volume = objects.volume.is_none().then(|| NO_VOLUME.to_string());
        if !self.open(CREATE, [gate.clone(), no_volume.clone()]) {
            for name in [REPEAT, CONFLICT, BY_ID, BY_SOURCE, GET] {
                self.open(name, [gate.clone(), no_volume.clone()]);
            }
            return;
        }
        let Some(v) = objects.volume.clone() else { return };
        let name = self.name("snap");
        let answer = driver::create_snapshot(&name, &v.volume_id, &[], &self.secrets);
        if let Ok(s) = &answer {
            self.snapshots.push(s.snapshot_id.clone());
        }
        let snapshot = self.optional(CREATE, answer, |s| {
            check_id("snapshot", &s.snapshot_id)?;
            if s.source_volume_id != v.volume_id {
                return Err(format!("source {:?}, not {:?}", s.source_volume_id, v.volume_id));
            }
            if !s.ready_to_use {
                return Err("not ready to use".into());
            }
            Ok(())
        });
        let no_snapshot = snapshot.is_none().then(|| "no snapshot: create-snapshot failed".to_string());
        let Some(s) = snapshot else {
            for name in [REPEAT, CONFLICT, BY_ID, BY_SOURCE, GET] {
                self.open(name, [no_snapshot.clone()]);
            }
            return;
        };

        let answer = driver::create_snapshot(&name, &v.volume_id, &[], &self.secrets);
        self.report.judge(
            REPEAT,
            match answer {
                Ok(again) if again.snapshot_id == s.snapshot_id => Ok(()),
                Ok(again) => Err(format!("first {:?}, then {:?}", s.snapshot_id, again.snapshot_id)),
                Err(e) => Err(describe(&e)),
            },
        );

        let other = self.request(&self.name("other"), REQUIRED_BYTES);
        match self.create(&other) {
            Ok(o) => {
                let answer = driver::create_snapshot(&name, &o.volume_id, &[], &self.secrets);
                if let Ok(s) = &answer {
                    self.snapshots.push(s.snapshot_id.clone());
                }
                self.report.judge(CONFLICT, expect_error(answer, "already-exists"));
                objects.other = Some(o);
            }
            Err(e) => self.report.record(CONFLICT, Outcome::Skip(format!("no second volume: {}", describe(&e)))),
        }

        let list = self.gate(Feature::ListSnapshots);
        if self.open(BY_ID, [list.clone()]) {
            let answer = list_snapshots(Some(&s.snapshot_id), None);
            self.optional(BY_ID, answer, |found| match found.as_slice() {
                [one] if one.snapshot_id == s.snapshot_id => Ok(()),
                other => Err(format!("found {:?}", other.iter().map(|s| &s.snapshot_id).collect::<Vec<_>>())),
            });
        }
        if self.open(BY_SOURCE, [list]) {
            let answer = list_snapshots(None, Some(&v.volume_id));
            self.optional(BY_SOURCE, answer, |found| {
                if found.iter().any(|f| f.snapshot_id == s.snapshot_id) {
                    Ok(())
                } else {
                    Err(format!("{:?} is not listed", s.snapshot_id))
                }
            });
        }
        if self.open(GET, [self.gate(Feature::GetSnapshot)]) {
            let answer = driver::get_snapshot(&s.snapshot_id);
            self.optional(GET, answer, |got| {
                if got.snapshot_id == s.snapshot_id && got.source_volume_id == v.volume_id {
                    Ok(())
                } else {
                    Err(format!("got {:?} of {:?}", got.snapshot_id, got.source_volume_id))
                }
            });
        }
        objects.snapshot = Some(s);
    }

    fn clone_checks(&mut self, objects: &mut Objects) {
        const FROM_SNAPSHOT: &str = "create-volume from the snapshot clones it";
        const FROM_VOLUME: &str = "create-volume from the volume clones it";
        let no_snapshot = objects.snapshot.is_none().then(|| "no snapshot to clone".to_string());
        if self.open(FROM_SNAPSHOT, [self.gate(Feature::CreateDeleteSnapshot), no_snapshot])
            && let Some(s) = objects.snapshot.clone()
        {
            let source = ContentSource::Snapshot(s.snapshot_id.clone());
            if let Some(id) = self.clone_from(FROM_SNAPSHOT, "clone-of-snap", source, s.size_bytes) {
                objects.clones.push(id);
            }
        }
        let no_volume = objects.volume.is_none().then(|| NO_VOLUME.to_string());
        if self.open(FROM_VOLUME, [self.gate(Feature::CloneVolume), no_volume])
            && let Some(v) = objects.volume.clone()
        {
            let size = objects.expanded.unwrap_or(v.capacity_bytes);
            let source = ContentSource::Volume(v.volume_id.clone());
            if let Some(id) = self.clone_from(FROM_VOLUME, "clone-of-vol", source, size) {
                objects.clones.push(id);
            }
        }
    }

    /// Create a volume from `source`, at least `size` bytes; the new id when it passed.
    fn clone_from(&mut self, check: &str, what: &str, source: ContentSource, size: u64) -> Option<String> {
        let mut request = self.request(&self.name(what), size.max(REQUIRED_BYTES));
        request.content_source = Some(source.clone());
        let answer = self.create(&request);
        self.optional(check, answer, |c| {
            check_id("volume", &c.volume_id)?;
            // The host answers the request's source whatever the backend says (CSI's rule), so
            // none is fine; another source is the backend's mistake.
            match &c.content_source {
                None => Ok(()),
                Some(got) if *got == source => Ok(()),
                Some(got) => Err(format!("content source {got:?}, not {source:?}")),
            }
        })
        .map(|c| c.volume_id)
    }

    fn list_volumes_checks(&mut self, objects: &Objects) {
        const CONTAINS: &str = "list-volumes includes the created volume";
        const PAGED: &str = "list-volumes pages one entry at a time to the end without duplicates";
        const BAD_TOKEN: &str = "list-volumes with an invalid starting-token is aborted";
        let gate = self.gate(Feature::ListVolumes);
        if self.open(CONTAINS, [gate.clone(), objects.volume.is_none().then(|| NO_VOLUME.to_string())])
            && let Some(v) = &objects.volume
        {
            let answer = list_volume_ids(0);
            self.optional(CONTAINS, answer, |ids| {
                if ids.contains(&v.volume_id) { Ok(()) } else { Err(format!("{:?} is not in {ids:?}", v.volume_id)) }
            });
        }
        if self.open(PAGED, [gate.clone()]) {
            let answer = list_volume_ids(1);
            let made = self.volumes.clone();
            self.optional(PAGED, answer, |ids| {
                let mut seen = std::collections::HashSet::new();
                if let Some(dup) = ids.iter().find(|id| !seen.insert(*id)) {
                    return Err(format!("{dup:?} listed twice"));
                }
                match made.iter().find(|m| !ids.contains(m)) {
                    Some(missing) => Err(format!("{missing:?} was not listed")),
                    None => Ok(()),
                }
            });
        }
        if self.open(BAD_TOKEN, [gate]) {
            let answer = driver::list_volumes(0, "csic-invalid-token");
            match answer {
                Err(Error::Unimplemented(m)) => {
                    self.report.record(BAD_TOKEN, Outcome::Skip(format!("unimplemented: {m}")))
                }
                answer => {
                    self.report.judge(BAD_TOKEN, expect_error(answer, "aborted"));
                }
            }
        }
    }

    fn delete_checks(&mut self, objects: &Objects) {
        const DELETE_SNAPSHOT: &str = "delete-snapshot deletes the snapshot";
        const DELETE_SNAPSHOT_AGAIN: &str = "delete-snapshot repeated is ok";
        const CLONES: &str = "delete-volume deletes the clones";
        const DELETE: &str = "delete-volume deletes the volume";
        const DELETE_AGAIN: &str = "delete-volume repeated is ok";
        const GONE: &str = "get-volume of a deleted volume is not-found";
        const VALIDATE_GONE: &str = "validate-volume-capabilities of a deleted volume is not-found";

        let no_snapshot = objects.snapshot.is_none().then(|| "no snapshot".to_string());
        if self.open(DELETE_SNAPSHOT, [no_snapshot.clone()])
            && let Some(s) = &objects.snapshot
        {
            let verdict =
                driver::delete_snapshot(&s.snapshot_id, &self.secrets).map_err(|e| describe(&e)).and_then(|()| {
                    if self.features.contains(&Feature::ListSnapshots) {
                        match list_snapshots(Some(&s.snapshot_id), None) {
                            Ok(found) if found.is_empty() => Ok(()),
                            Ok(_) => Err("list-snapshots still finds it".to_string()),
                            Err(e) => Err(format!("list-snapshots after: {}", describe(&e))),
                        }
                    } else {
                        Ok(())
                    }
                });
            if verdict.is_ok() {
                self.snapshots.retain(|id| *id != s.snapshot_id);
            }
            self.report.judge(DELETE_SNAPSHOT, verdict);
            let again = driver::delete_snapshot(&s.snapshot_id, &self.secrets);
            self.report.judge(DELETE_SNAPSHOT_AGAIN, again.map_err(|e| describe(&e)));
        } else {
            self.open(DELETE_SNAPSHOT_AGAIN, [no_snapshot]);
        }

        if self.open(CLONES, [objects.clones.is_empty().then(|| "no clones".to_string())]) {
            let mut problems = Vec::new();
            for id in &objects.clones {
                if let Err(e) = self.delete_volume(id) {
                    problems.push(format!("{id}: {}", describe(&e)));
                }
            }
            self.report.judge(CLONES, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }

        let no_volume = objects.volume.is_none().then(|| NO_VOLUME.to_string());
        if !self.open(DELETE, [no_volume.clone()]) {
            for name in [DELETE_AGAIN, GONE, VALIDATE_GONE] {
                self.open(name, [no_volume.clone()]);
            }
            return;
        }
        let Some(v) = &objects.volume else { return };
        if let Some(o) = &objects.other {
            let _ = self.delete_volume(&o.volume_id);
        }
        let answer = self.delete_volume(&v.volume_id);
        let deleted = self.report.judge(DELETE, answer.map_err(|e| describe(&e)));
        let again = driver::delete_volume(&v.volume_id, &self.secrets);
        self.report.judge(DELETE_AGAIN, again.map_err(|e| describe(&e)));
        let not_deleted = (!deleted).then(|| "delete-volume failed".to_string());
        if self.open(GONE, [self.gate(Feature::GetVolume), not_deleted.clone()]) {
            self.report.judge(GONE, expect_error(driver::get_volume(&v.volume_id), "not-found"));
        }
        if self.open(VALIDATE_GONE, [not_deleted]) {
            let answer = driver::validate_volume_capabilities(
                &v.volume_id,
                &v.volume_context,
                &[mount_capability()],
                &self.params,
            );
            self.report.judge(VALIDATE_GONE, expect_error(answer, "not-found"));
        }
    }

    /// Delete what is left: snapshots first, then volumes (clones before their sources).
    fn clean_up(&mut self) {
        const NAME: &str = "cleanup removes every snapshot and volume the checks made";
        let mut problems = Vec::new();
        for id in std::mem::take(&mut self.snapshots) {
            if let Err(e) = driver::delete_snapshot(&id, &self.secrets) {
                problems.push(format!("snapshot {id}: {}", describe(&e)));
            }
        }
        for id in std::mem::take(&mut self.volumes).into_iter().rev() {
            if let Err(e) = driver::delete_volume(&id, &self.secrets) {
                problems.push(format!("volume {id}: {}", describe(&e)));
            }
        }
        self.report.judge(NAME, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
    }
}

/// Every snapshot of a filter, following tokens.
fn list_snapshots(snapshot_id: Option<&str>, source: Option<&str>) -> Result<Vec<Snapshot>, Error> {
    let mut all = Vec::new();
    let mut token = String::new();
    for _ in 0..MAX_PAGES {
        let page = driver::list_snapshots(snapshot_id, source, 0, &token)?;
        all.extend(page.entries);
        if page.next_token.is_empty() {
            return Ok(all);
        }
        token = page.next_token;
    }
    Err(Error::Internal(format!("list-snapshots: no end after {MAX_PAGES} pages")))
}

/// Every volume id, `max_entries` per page, following tokens.
fn list_volume_ids(max_entries: u32) -> Result<Vec<String>, Error> {
    let mut all = Vec::new();
    let mut token = String::new();
    for _ in 0..MAX_PAGES {
        let page = driver::list_volumes(max_entries, &token)?;
        if max_entries > 0 && page.entries.len() > max_entries as usize {
            return Err(Error::Internal(format!(
                "a page of {} entries for max-entries {max_entries}",
                page.entries.len()
            )));
        }
        all.extend(page.entries.into_iter().map(|e| e.volume.volume_id));
        if page.next_token.is_empty() {
            return Ok(all);
        }
        token = page.next_token;
    }
    Err(Error::Internal(format!("list-volumes: no end after {MAX_PAGES} pages")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_keep_the_wit_contract() {
        assert!(check_id("volume", "default.pvc-1_x").is_ok());
        assert!(check_id("volume", "").is_err());
        assert!(check_id("volume", "a/b").is_err());
        assert!(check_id("volume", &"x".repeat(96)).is_err());
    }

    #[test]
    fn a_unicode_name_has_the_asked_length_and_what_ids_refuse() {
        let n = unicode_name("csic-1-vol-名", 128);
        assert_eq!(n.len(), 128);
        assert!(n.contains('/') && n.contains('\n') && n.contains('🦀'));
    }

    #[test]
    fn an_error_is_described_by_its_wit_case() {
        assert_eq!(describe(&Error::NotFound("volume v".into())), "not-found: volume v");
        assert!(expect_error::<()>(Err(Error::NotFound("x".into())), "not-found").is_ok());
        assert!(expect_error::<()>(Err(Error::Internal("x".into())), "not-found").is_err());
        assert!(expect_error(Ok(1), "not-found").is_err());
    }
}
