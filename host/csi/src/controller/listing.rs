//! ListVolumes and ListSnapshots: one listing over every backend, page by page, with tokens
//! the host hands out and checks (a token it did not hand out is ABORTED, as the spec asks).
//!
//! A node-local backend's objects live on many nodes (`topology`). A controller with node
//! plugins to ask lists them node by node (`across_nodes`): this node's here, another's by
//! asking its node plugin for that backend's page (`peer`). A node that does not answer
//! fails the listing (UNAVAILABLE) rather than leave its volumes out: a CO reads a volume
//! missing from ListVolumes as gone.
use super::ControllerService;
use super::pipeline::{OnObject, Unknown};
use crate::answer;
use crate::convert::bytes;
use crate::error::{CsiError, CsiResult};
use crate::ids::ObjectId;
use crate::ids::is_node_tag;
use crate::plugin::DIGEST_CONTEXT_KEY;
use crate::topology::Holder;
use std::future::Future;
use std::sync::Arc;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::driver::{self, Feature};

/// Page through several backends as one list. Tokens are `BACKEND:INNER`, where INNER is
/// what `fetch` handed out for that backend (its own token, or `across_nodes`'s); a token
/// we did not hand out is ABORTED, as the spec asks. `fetch` checks what it fetched.
pub(super) async fn paged<T, F, Fut>(
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
        if entries.len() > remaining as usize {
            return Err(CsiError::Internal(format!(
                "{op} of {name}: {} entries for a page of {remaining}",
                entries.len()
            )));
        }
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
pub(super) fn page_size(max_entries: i32) -> CsiResult<u32> {
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
fn volume_entry(b: &Backend, e: &driver::VolumeStatus) -> CsiResult<csi::list_volumes_response::Entry> {
    Ok(csi::list_volumes_response::Entry {
        volume: Some(answer::volume(b, "list_volumes", &e.volume, None)?),
        status: Some(csi::list_volumes_response::VolumeStatus {
            published_node_ids: vec![],
            volume_condition: e.condition.as_ref().map(answer::condition),
        }),
    })
}

impl ControllerService {
    /// Every backend's volumes, one backend after another. A backend that fails on its first
    /// page, or is not loaded while the host's journal records volumes of it, does not take
    /// the listing down, and its volumes do not vanish: they come from the journal, marked
    /// abnormal with why (the CO's health monitor shows that as the volume's condition).
    pub(super) async fn list_volumes(&self, req: csi::ListVolumesRequest) -> CsiResult<csi::ListVolumesResponse> {
        let d = &self.0;
        let loaded = self.capable(Feature::ListVolumes);
        let mut names: std::collections::BTreeSet<String> = loaded.iter().map(|b| b.name.clone()).collect();
        let journal = d
            .registry
            .journal_backends()
            .map_err(|source| CsiError::Journal { subject: "every backend".into(), source })?;
        names.extend(journal.into_iter().filter(|n| d.registry.get(n).is_none()));
        let names: Vec<String> = names.into_iter().collect();
        let max = page_size(req.max_entries)?;
        let (mut index, mut cursor) = parse_volume_token(&req.starting_token, &names)?;
        let mut entries = Vec::new();
        while index < names.len() {
            let name = &names[index];
            let remaining = max - u32::try_from(entries.len()).unwrap_or(max);
            let backend = loaded.iter().find(|b| &b.name == name);
            let cursor = std::mem::replace(&mut cursor, Cursor::Backend(String::new()));
            let holders = match backend {
                Some(b) => d.holders(b).await,
                None => None,
            };
            let (mut got, next) = match (backend, holders, cursor) {
                (Some(b), Some(holders), Cursor::Backend(token)) => {
                    let (got, next) = self.volumes_across_nodes(b, &holders, remaining, &token).await?;
                    (got, (!next.is_empty()).then_some(Cursor::Backend(next)))
                }
                (Some(_), Some(_), Cursor::Journal(_)) => {
                    return Err(CsiError::InvalidToken(format!("invalid starting_token {:?}", req.starting_token)));
                }
                (backend, _, cursor) => self.volumes_here(name, backend, cursor, remaining).await?,
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
        let mut records = self
            .0
            .registry
            .journal_volumes(name, from, take as usize + 1)
            .map_err(|source| CsiError::Journal { subject: format!("backend {name}"), source })?;
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

    /// One page of backend `name`'s volumes as this process holds them: from the backend
    /// (`backend`: loaded here) or, when it is not loaded or fails, from the host's journal.
    async fn volumes_here(
        &self,
        name: &str,
        backend: Option<&Arc<Backend>>,
        cursor: Cursor,
        remaining: u32,
    ) -> CsiResult<(Vec<csi::list_volumes_response::Entry>, Option<Cursor>)> {
        let d = &self.0;
        let not_loaded = || format!("backend {name} is not loaded on this host; listed from the host's journal");
        Ok(match (backend, cursor) {
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
                return Err(CsiError::InvalidToken(format!("invalid starting_token for {name}")));
            }
        })
    }

    /// One page of node-local `b`'s volumes over every node that holds some (`holders`):
    /// this node's from here, another's asked of its node plugin. `token`: `across_nodes`'s.
    async fn volumes_across_nodes(
        &self,
        b: &Arc<Backend>,
        holders: &[Holder],
        max: u32,
        token: &str,
    ) -> CsiResult<(Vec<csi::list_volumes_response::Entry>, String)> {
        let name = b.name.as_str();
        let here = |max: u32, token: String| async move {
            let (_, cursor) = parse_volume_token(&token, &[name.to_string()])?;
            let (got, next) = self.volumes_here(name, Some(b), cursor, max).await?;
            Ok((got, next.map(|c| volume_token(name, &c)).unwrap_or_default()))
        };
        let there = |node: String, max: u32, token: String| async move {
            let fresh = token.is_empty();
            let starting_token = if fresh { format!("{name}:") } else { token };
            let req = csi::ListVolumesRequest { max_entries: page_request(max), starting_token };
            match self.forward(&node, b, req).await {
                Ok(page) => {
                    let of_b = |e: &csi::list_volumes_response::Entry| {
                        e.volume.as_ref().and_then(|v| ObjectId::parse(&v.volume_id)).is_some_and(|o| o.backend == name)
                    };
                    let entries = page.entries.into_iter().filter(of_b).collect();
                    Ok((entries, same_backend(name, page.next_token)))
                }
                // The node does not know the backend at all: it holds none of its volumes.
                Err(CsiError::Peer { status, .. }) if fresh && status.code() == tonic::Code::Aborted => {
                    Ok((vec![], String::new()))
                }
                Err(e) => Err(e),
            }
        };
        across_nodes(holders, max, token, here, there).await
    }

    pub(super) async fn list_snapshots(&self, req: csi::ListSnapshotsRequest) -> CsiResult<csi::ListSnapshotsResponse> {
        // A filter routes to one backend; an id that cannot be ours matches nothing.
        let Some(filter_id) = [&req.snapshot_id, &req.source_volume_id].into_iter().find(|s| !s.is_empty()) else {
            return self.snapshots_of(self.capable(Feature::ListSnapshots), None, None, &req).await;
        };
        self.on_object(&req, OnObject::new(filter_id, Unknown::Nothing), async |b, oid| {
            let snap = (!req.snapshot_id.is_empty()).then(|| oid.local.clone());
            let vol = if req.source_volume_id.is_empty() {
                None
            } else {
                match ObjectId::parse(&req.source_volume_id) {
                    Some(v) if v.backend == b.name => Some(v.local),
                    _ => return Ok(csi::ListSnapshotsResponse::default()),
                }
            };
            self.snapshots_of(vec![b], snap, vol, &req).await
        })
        .await
    }

    /// One page of the snapshots of `backends` (those that list snapshots), filtered by
    /// snapshot `snap` or source volume `vol` (local ids).
    async fn snapshots_of(
        &self,
        backends: Vec<Arc<Backend>>,
        snap: Option<String>,
        vol: Option<String>,
        req: &csi::ListSnapshotsRequest,
    ) -> CsiResult<csi::ListSnapshotsResponse> {
        let backends: Vec<_> = backends.into_iter().filter(|b| b.has_feature(Feature::ListSnapshots)).collect();
        let (entries, next_token) =
            paged("list_snapshots", backends, req.max_entries, &req.starting_token, |b, max, token| {
                let (snap, vol) = (snap.clone(), vol.clone());
                async move {
                    let holders = match (&snap, &vol) {
                        (None, None) => self.0.holders(&b).await,
                        _ => None,
                    };
                    match holders {
                        Some(holders) => self.snapshots_across_nodes(&b, &holders, max, &token).await,
                        None => self.snapshots_here(&b, snap, vol, max, token).await,
                    }
                }
            })
            .await?;
        Ok(csi::ListSnapshotsResponse { entries, next_token })
    }

    /// One page of `b`'s snapshots as this process holds them (`token`: the backend's own).
    async fn snapshots_here(
        &self,
        b: &Arc<Backend>,
        snap: Option<String>,
        vol: Option<String>,
        max: u32,
        token: String,
    ) -> CsiResult<(Vec<csi::list_snapshots_response::Entry>, String)> {
        let page = b.list_snapshots(snap, vol, max, token).await?;
        answer::page(b, "list_snapshots", &page.entries, &page.next_token, max)?;
        let entries = page
            .entries
            .iter()
            .map(|s| {
                Ok(csi::list_snapshots_response::Entry {
                    snapshot: Some(self.pin_snapshot(b, answer::snapshot(b, "list_snapshots", s)?)?),
                })
            })
            .collect::<CsiResult<Vec<_>>>()?;
        Ok((entries, page.next_token))
    }

    /// One page of node-local `b`'s snapshots over every node that holds some (see
    /// `volumes_across_nodes`).
    async fn snapshots_across_nodes(
        &self,
        b: &Arc<Backend>,
        holders: &[Holder],
        max: u32,
        token: &str,
    ) -> CsiResult<(Vec<csi::list_snapshots_response::Entry>, String)> {
        let name = b.name.as_str();
        let here = |max: u32, token: String| self.snapshots_here(b, None, None, max, token);
        let there = |node: String, max: u32, token: String| async move {
            let fresh = token.is_empty();
            let starting_token = if fresh { format!("{name}:") } else { token };
            let req =
                csi::ListSnapshotsRequest { max_entries: page_request(max), starting_token, ..Default::default() };
            match self.forward(&node, b, req).await {
                Ok(page) => {
                    let of_b = |e: &csi::list_snapshots_response::Entry| {
                        e.snapshot
                            .as_ref()
                            .and_then(|s| ObjectId::parse(&s.snapshot_id))
                            .is_some_and(|o| o.backend == name)
                    };
                    let entries = page.entries.into_iter().filter(of_b).collect();
                    Ok((entries, same_backend(name, page.next_token)))
                }
                Err(CsiError::Peer { status, .. }) if fresh && status.code() == tonic::Code::Aborted => {
                    Ok((vec![], String::new()))
                }
                Err(e) => Err(e),
            }
        };
        across_nodes(holders, max, token, here, there).await
    }
}

/// The page size to ask a node plugin for (at most [`answer::MAX_PAGE_ENTRIES`], so it fits).
fn page_request(max: u32) -> i32 {
    i32::try_from(max).unwrap_or(i32::MAX)
}

/// A node plugin's next token when it still lists backend `name` (`NAME:…` or `NAME/…`);
/// empty when it has gone on to another backend, i.e. `name` is done on that node.
fn same_backend(name: &str, next: String) -> String {
    let rest = next.strip_prefix(name);
    if rest.is_some_and(|r| r.starts_with(':') || r.starts_with('/')) { next } else { String::new() }
}

/// One page of a node-local backend's objects over the nodes that hold them, in tag order:
/// `here` lists this node's, `there` asks node N's plugin; each takes at most `max` and a
/// token of its own ("": from the start) and answers the next one ("": done). The token this
/// hands out is `TAG+INNER`: node TAG's inner token. A node gone between two pages is
/// skipped: the listing goes on with the next tag after it.
async fn across_nodes<T, H, HF, P, PF>(
    holders: &[Holder],
    max: u32,
    token: &str,
    here: H,
    there: P,
) -> CsiResult<(Vec<T>, String)>
where
    H: Fn(u32, String) -> HF,
    HF: Future<Output = CsiResult<(Vec<T>, String)>>,
    P: Fn(String, u32, String) -> PF,
    PF: Future<Output = CsiResult<(Vec<T>, String)>>,
{
    let (mut at, mut inner) = if token.is_empty() {
        (0, String::new())
    } else {
        let invalid = || CsiError::InvalidToken(format!("invalid starting_token (node part {token:?})"));
        let (tag, inner) = token.split_once('+').filter(|(tag, _)| is_node_tag(tag)).ok_or_else(invalid)?;
        match holders.iter().position(|h| h.tag.as_str() >= tag) {
            Some(i) if holders[i].tag == tag => (i, inner.to_string()),
            Some(i) => (i, String::new()),
            None => return Ok((vec![], String::new())),
        }
    };
    let mut out = Vec::new();
    while let Some(holder) = holders.get(at) {
        let remaining = max.saturating_sub(u32::try_from(out.len()).unwrap_or(max));
        if remaining == 0 {
            return Ok((out, format!("{}+", holder.tag)));
        }
        let token = std::mem::take(&mut inner);
        let (mut got, next) = match &holder.node {
            None => here(remaining, token).await?,
            Some(node) => there(node.clone(), remaining, token).await?,
        };
        if got.len() > remaining as usize {
            return Err(CsiError::Internal(format!(
                "node {}: {} entries for a page of {remaining}",
                holder.tag,
                got.len()
            )));
        }
        out.append(&mut got);
        if !next.is_empty() {
            return Ok((out, format!("{}+{next}", holder.tag)));
        }
        at += 1;
    }
    Ok((out, String::new()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests: a failed listing is the failure")]
    use super::*;
    use std::collections::BTreeMap;

    fn holders(tags: &[(&str, bool)]) -> Vec<Holder> {
        tags.iter().map(|(t, here)| Holder { tag: t.to_string(), node: (!here).then(|| format!("node-{t}")) }).collect()
    }

    /// Node `tag`'s objects, listed by index tokens like a backend would.
    fn node_items(tag: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{tag}/{i}")).collect()
    }

    fn page_of(items: &[String], max: u32, token: &str) -> CsiResult<(Vec<String>, String)> {
        let from: usize =
            if token.is_empty() { 0 } else { token.parse().map_err(|_| CsiError::InvalidToken(token.into()))? };
        let to = (from + max as usize).min(items.len());
        Ok((items[from..to].to_vec(), if to < items.len() { to.to_string() } else { String::new() }))
    }

    async fn list_all(holders: &[Holder], items: &BTreeMap<String, Vec<String>>, max: u32) -> Vec<String> {
        let mut all = Vec::new();
        let mut token = String::new();
        loop {
            let here = |m: u32, t: String| {
                let mine = items.values().next().cloned().unwrap_or_default();
                async move { page_of(&mine, m, &t) }
            };
            let there = |node: String, m: u32, t: String| {
                let theirs = items.get(node.trim_start_matches("node-")).cloned().unwrap_or_default();
                async move { page_of(&theirs, m, &t) }
            };
            let (got, next) = across_nodes(holders, max, &token, here, there).await.unwrap();
            assert!(got.len() <= max as usize);
            all.extend(got);
            if next.is_empty() {
                return all;
            }
            token = next;
        }
    }

    #[tokio::test]
    async fn every_node_is_listed_once_in_tag_order_whatever_the_page_size() {
        let hs = holders(&[("a", true), ("b", false), ("c", false)]);
        let items: BTreeMap<String, Vec<String>> =
            [("a", 3), ("b", 0), ("c", 5)].iter().map(|(t, n)| (t.to_string(), node_items(t, *n))).collect();
        let want: Vec<String> = items.values().flatten().cloned().collect();
        for max in [1, 2, 3, 7, 100] {
            assert_eq!(list_all(&hs, &items, max).await, want, "pages of {max}");
        }
    }

    #[tokio::test]
    async fn a_node_gone_between_pages_is_skipped_and_a_foreign_token_is_aborted() {
        let hs = holders(&[("a", false), ("c", false)]);
        let none = |_: u32, _: String| async { Ok((Vec::<String>::new(), String::new())) };
        let theirs = |node: String, _: u32, _: String| async move { Ok((vec![node], String::new())) };
        // The token names node b, which left: the listing goes on at c.
        let (got, next) = across_nodes(&hs, 10, "b+7", none, theirs).await.unwrap();
        assert_eq!((got, next), (vec!["node-c".to_string()], String::new()));
        let refused = across_nodes(&hs, 10, "no tag here", none, theirs).await.unwrap_err();
        assert!(matches!(refused, CsiError::InvalidToken(_)), "{refused:?}");
    }

    #[tokio::test]
    async fn a_node_that_answers_more_than_asked_is_refused() {
        let hs = holders(&[("a", false)]);
        let none = |_: u32, _: String| async { Ok((Vec::<String>::new(), String::new())) };
        let greedy =
            |_: String, m: u32, _: String| async move { Ok(((0..=m).map(|i| i.to_string()).collect(), String::new())) };
        let refused = across_nodes(&hs, 2, "", none, greedy).await.unwrap_err();
        assert!(matches!(refused, CsiError::Internal(_)), "{refused:?}");
    }

    #[test]
    fn a_node_token_goes_on_only_while_it_lists_the_same_backend() {
        assert_eq!(same_backend("hostpath", "hostpath:abc".into()), "hostpath:abc");
        assert_eq!(same_backend("hostpath", "hostpath/3".into()), "hostpath/3");
        assert_eq!(same_backend("hostpath", "hostpath2:abc".into()), "");
        assert_eq!(same_backend("hostpath", "nfs:".into()), "");
        assert_eq!(same_backend("hostpath", String::new()), "");
    }
}
