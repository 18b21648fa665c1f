//! Names, as the spec allows them: any Unicode of up to 128 bytes (tab, line feed and carriage
//! return included) names a volume or a snapshot, and the same name again is the same object; a
//! longer name, or one with a control character the spec bans (U+0000–U+0008, U+000B, U+000C,
//! U+000E–U+001F, U+007F–U+009F), is INVALID_ARGUMENT. CreateVolume and CreateSnapshot alike.
//! What these checks make they delete again at once, so the checks after them see the suite's
//! usual objects only.
use crate::{NO_VOLUME, Outcome, Suite, call, made_snapshot, made_volume, status};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

/// CSI's limit on a name, in bytes.
const MAX_NAME: usize = 128;

/// One character of every range the spec bans.
const BANNED: [char; 8] = ['\u{0}', '\u{7}', '\u{b}', '\u{c}', '\u{e}', '\u{1b}', '\u{7f}', '\u{9f}'];

/// A name of exactly `bytes` bytes (at least the prefix's and the fixed part's): `prefix`, then
/// what the spec allows and a backend's paths and ids do not (a slash, spaces, accents, CJK, an
/// emoji, a tab, a line feed), then `é` and `x` to fill.
pub(super) fn unicode_name(prefix: &str, bytes: usize) -> String {
    let mut name = format!("{prefix} /Données\t中文 ✓🦀\n");
    while name.len() + 'é'.len_utf8() <= bytes {
        name.push('é');
    }
    while name.len() < bytes {
        name.push('x');
    }
    name
}

impl Suite<'_> {
    /// The name checks of CreateVolume.
    pub(super) async fn name_checks(&mut self) {
        const LONG: &str =
            "CreateVolume with a 128-byte Unicode name creates a volume, and the same name again returns it";
        const TOO_LONG: &str = "CreateVolume with a 129-byte name is InvalidArgument";
        const BANNED_NAME: &str = "CreateVolume with a control character the spec bans in the name is InvalidArgument";

        let name = unicode_name(&self.name("vol-名"), MAX_NAME);
        let request = self.create_request(&name, self.profile.required_bytes);
        let mut made = Vec::new();
        let mut verdict = Ok(());
        for attempt in ["first", "again"] {
            match call(self.ctl().create_volume(request.clone())).await {
                Ok(r) => match r.volume {
                    Some(v) => {
                        self.created.volume(&v.volume_id);
                        made.push(v.volume_id);
                    }
                    None => {
                        verdict = Err(format!("{attempt}: the answer carries no volume"));
                        break;
                    }
                },
                Err(s) => {
                    verdict = Err(format!("{attempt}: {}", status(s)));
                    break;
                }
            }
        }
        if verdict.is_ok() && made.windows(2).any(|w| w[0] != w[1]) {
            verdict = Err(format!("one name, two volumes: {made:?}"));
        }
        made.dedup();
        for id in made {
            if let Err(e) = self.delete_now(&id).await {
                verdict = verdict.and(Err(e));
            }
        }
        self.judge(LONG, verdict);

        let too_long = unicode_name(&self.name("long"), MAX_NAME + 1);
        let request = self.create_request(&too_long, self.profile.required_bytes);
        let answer = call(self.ctl().create_volume(request)).await;
        let verdict = self.refused(answer.map(made_volume));
        self.record(TOO_LONG, verdict);

        let mut problems = Vec::new();
        for c in BANNED {
            let request = self.create_request(&format!("{}{c}", self.name("banned")), self.profile.required_bytes);
            let answer = call(self.ctl().create_volume(request)).await;
            if let Outcome::Fail(why) = self.refused(answer.map(made_volume)) {
                problems.push(format!("U+{:04X}: {why}", u32::from(c)));
            }
        }
        self.judge(BANNED_NAME, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
    }

    /// The name checks of CreateSnapshot, on the suite's volume.
    pub(super) async fn snapshot_name_checks(&mut self, volume: Option<&csi::Volume>) {
        const LONG: &str =
            "CreateSnapshot with a 128-byte Unicode name snapshots the volume, and the same name again returns it";
        const BANNED_NAME: &str =
            "CreateSnapshot with a control character the spec bans in the name is InvalidArgument";
        let blocked = Self::gates([
            self.controller_gate(ControllerRpc::CreateDeleteSnapshot),
            volume.is_none().then(|| NO_VOLUME.to_string()),
        ]);
        let source = volume.map(|v| v.volume_id.clone()).unwrap_or_default();

        if self.open(LONG, &blocked) {
            let request = self.secreted(csi::CreateSnapshotRequest {
                source_volume_id: source.clone(),
                name: unicode_name(&self.name("snap-名"), MAX_NAME),
                ..Default::default()
            });
            let mut made = Vec::new();
            let mut verdict = Ok(());
            let mut unsupported = None;
            for attempt in ["first", "again"] {
                match call(self.ctl().create_snapshot(request.clone())).await {
                    Ok(r) => match r.snapshot {
                        Some(s) if s.source_volume_id == source => {
                            self.created.snapshot(&s.snapshot_id);
                            made.push(s.snapshot_id);
                        }
                        Some(s) => {
                            self.created.snapshot(&s.snapshot_id);
                            verdict = Err(format!("{attempt}: a snapshot of {}, not of {source}", s.source_volume_id));
                            break;
                        }
                        None => {
                            verdict = Err(format!("{attempt}: the answer carries no snapshot"));
                            break;
                        }
                    },
                    // A backend without snapshots (the host answers per backend): skipped, as
                    // `snapshot_checks` skips it.
                    Err(s) if s.code() == Code::Unimplemented => {
                        unsupported = Some(format!("not supported: {}", s.message()));
                        break;
                    }
                    Err(s) => {
                        verdict = Err(format!("{attempt}: {}", status(s)));
                        break;
                    }
                }
            }
            if verdict.is_ok() && made.windows(2).any(|w| w[0] != w[1]) {
                verdict = Err(format!("one name, two snapshots: {made:?}"));
            }
            made.dedup();
            for id in made {
                let request =
                    self.secreted(csi::DeleteSnapshotRequest { snapshot_id: id.clone(), ..Default::default() });
                match call(self.ctl().delete_snapshot(request)).await {
                    Ok(_) => self.created.snapshots.retain(|s| *s != id),
                    Err(s) => verdict = verdict.and(Err(format!("DeleteSnapshot {id}: {}", status(s)))),
                }
            }
            match unsupported {
                Some(why) => self.record(LONG, Outcome::Skip(why)),
                None => self.judge(LONG, verdict),
            }
        }

        if self.open(BANNED_NAME, &blocked) {
            let mut problems = Vec::new();
            for c in BANNED {
                let request = self.secreted(csi::CreateSnapshotRequest {
                    source_volume_id: source.clone(),
                    name: format!("{}{c}", self.name("banned-snap")),
                    ..Default::default()
                });
                let answer = call(self.ctl().create_snapshot(request)).await;
                if let Outcome::Fail(why) = self.refused(answer.map(made_snapshot)) {
                    problems.push(format!("U+{:04X}: {why}", u32::from(c)));
                }
            }
            self.judge(BANNED_NAME, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
        }
    }

    /// INVALID_ARGUMENT passes; whatever an answer that should have been refused made is
    /// remembered for the cleanup.
    fn refused(&mut self, answer: Result<super::Made, tonic::Status>) -> Outcome {
        match answer {
            Err(s) if s.code() == Code::InvalidArgument => Outcome::Pass,
            Err(s) => Outcome::Fail(format!("expected InvalidArgument, got {}", status(s))),
            Ok(made) => {
                self.created.made(&made);
                Outcome::Fail("expected InvalidArgument, got OK".into())
            }
        }
    }

    /// DeleteVolume of a volume a check made for itself; forgotten by the cleanup once gone.
    async fn delete_now(&mut self, id: &str) -> Result<(), String> {
        let request = self.delete_request(id);
        call(self.ctl().delete_volume(request)).await.map_err(|s| format!("DeleteVolume {id}: {}", status(s)))?;
        self.created.volumes.retain(|v| v != id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unicode_names_have_the_asked_length_and_only_allowed_characters() {
        for bytes in [40, 127, 128, 129] {
            let name = unicode_name("csic-1-vol", bytes);
            assert_eq!(name.len(), bytes, "{name:?}");
            assert!(name.chars().all(|c| (!BANNED.contains(&c) && !c.is_control()) || "\t\n".contains(c)), "{name:?}");
            assert!(!name.is_ascii(), "{name:?}");
        }
        assert!(BANNED.iter().all(|c| c.is_control() && !"\t\n\r".contains(*c)));
    }
}
