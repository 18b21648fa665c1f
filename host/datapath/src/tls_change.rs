//! A live upgrade that changes how the replica port travels (`wasmcsi upgrade datapath
//! --tls-mode … --tls-dir … --authority …`): the path a node takes from plaintext to mutual TLS
//! (`off` → `permissive` → `required`) with its volumes attached. The new binary gets the new
//! flags in place of the old ones ([`apply`]); nothing else of the command line changes.
//!
//! Before anything is suspended the change is checked ([`check`]) against what the volumes
//! attached here need *now*, and refused with the reason when the new image would cut them off:
//!
//! - credentials that do not load, or are not this node's (the new image would not start, and a
//!   data path that does not start loses its volumes' devices);
//! - `required` while plaintext connections are open on this node's replica port: those are
//!   other nodes' engines (or control clients) that do not speak TLS to this node yet, and would
//!   be refused when they reconnect to the new image. A node that went `permissive` reconnects
//!   over TLS, so every node goes `permissive` before any goes `required`;
//! - a replica of an attached volume on another node that does not answer the new
//!   configuration (an `off` node's server to a `required` client, a server whose CA the new
//!   credentials do not trust, a `required` server to a plaintext client). A member that does
//!   not answer at all is not counted: the engine has lost it already, whatever the mode;
//! - TLS without a grant the new credentials verify and no authority endpoint to fetch one
//!   from: every other node's replica server would refuse the volume's sessions.
//!
//! What is not checked: a peer that connects in plaintext between the check and the handover
//! (the window is the suspend, well under a second).

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use wasmcsi_block::control::{ControlError, Reach, ReplicaServerClient};
use wasmcsi_block::transport::Transport;
use wasmcsi_trust::{Credentials, ExpectedRole, LiveCredentials, Role, TlsMode};

use crate::DataPath;
use crate::wire::TlsChange;

/// How long the check waits for each member's answer.
const MEMBER_WAIT: Duration = Duration::from_secs(5);

/// The replica port's configuration after the upgrade: the flags the new binary gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextTls {
    pub mode: TlsMode,
    pub dir: Option<PathBuf>,
    pub authority: Option<String>,
}

/// Why a TLS change is refused (the data path serves on as it is).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsChangeError {
    #[error("--tls-mode {0} needs this node's credentials (--tls-dir)")]
    NoCredentials(TlsMode),
    #[error("--authority needs this node's credentials (--tls-dir)")]
    AuthorityWithoutCredentials,
    #[error("the credentials in {}: {message}", dir.display())]
    Credentials { dir: PathBuf, message: String },
    #[error("the credentials in {} are {role}'s, this data path serves node {node}", dir.display())]
    NotThisNode { dir: PathBuf, role: Role, node: String },
    #[error(
        "{0} plaintext connection(s) are open on this node's replica port: engines or clients that do not speak TLS \
         to this node yet would be refused by a required data path; move every node to permissive first (a \
         permissive engine reconnects over TLS)"
    )]
    PlaintextPeers(u64),
    #[error("volume {volume}'s engine would be cut off from its replica on node {node} ({addr}): {detail}")]
    Member { volume: String, node: String, addr: SocketAddr, detail: String },
    #[error(
        "volume {0} holds no grant the new credentials verify and no --authority is configured to fetch one: other \
         nodes' replica servers would refuse its sessions over TLS"
    )]
    NoGrant(String),
}

/// The value of the last `--NAME VALUE` or `--NAME=VALUE` in `args`.
fn flag(args: &[OsString], name: &str) -> Option<OsString> {
    let with_eq = format!("{name}=");
    let mut value = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a.as_os_str() == name {
            value = it.next().cloned();
        } else if let Some(v) = a.to_str().and_then(|a| a.strip_prefix(&with_eq)) {
            value = Some(OsString::from(v));
        }
    }
    value
}

/// Removes every `--NAME VALUE` and `--NAME=VALUE` from `args`.
fn remove_flag(args: &mut Vec<OsString>, name: &str) {
    let with_eq = format!("{name}=");
    let mut kept = Vec::with_capacity(args.len());
    let mut it = std::mem::take(args).into_iter();
    while let Some(a) = it.next() {
        if a.as_os_str() == name {
            it.next();
        } else if !a.to_str().is_some_and(|a| a.starts_with(&with_eq)) {
            kept.push(a);
        }
    }
    *args = kept;
}

/// The configuration `change` leads to from a data path started with `args` (its own command
/// line, without the program name): what the change names, and the rest as it is.
pub fn resolve(change: &TlsChange, args: &[OsString]) -> NextTls {
    NextTls {
        mode: change.mode,
        dir: change.dir.clone().or_else(|| flag(args, "--tls-dir").map(PathBuf::from)),
        authority: change.authority.clone().or_else(|| flag(args, "--authority").and_then(|a| a.into_string().ok())),
    }
}

/// `args` with the TLS flags of `next` in place of the ones it had.
pub fn apply(next: &NextTls, args: &mut Vec<OsString>) {
    for name in ["--tls-mode", "--tls-dir", "--authority"] {
        remove_flag(args, name);
    }
    args.extend([OsString::from("--tls-mode"), OsString::from(next.mode.to_string())]);
    if let Some(dir) = &next.dir {
        args.extend([OsString::from("--tls-dir"), dir.as_os_str().to_owned()]);
    }
    if let Some(url) = &next.authority {
        args.extend([OsString::from("--authority"), OsString::from(url)]);
    }
}

/// The transport `next` gives this node, its credentials checked to be this node's.
fn transport(next: &NextTls, node: &str) -> Result<Transport, TlsChangeError> {
    if next.authority.is_some() && next.dir.is_none() {
        return Err(TlsChangeError::AuthorityWithoutCredentials);
    }
    if next.mode == TlsMode::Off {
        return Ok(Transport::Plain);
    }
    let dir = next.dir.clone().ok_or(TlsChangeError::NoCredentials(next.mode))?;
    let credentials = Credentials::load(&dir)
        .map_err(|e| TlsChangeError::Credentials { dir: dir.clone(), message: e.to_string() })?;
    if *credentials.role() != Role::Node(node.to_owned()) {
        return Err(TlsChangeError::NotThisNode { dir, role: credentials.role().clone(), node: node.to_owned() });
    }
    Transport::new(next.mode, Some(LiveCredentials::new(credentials)))
        .map_err(|_| TlsChangeError::NoCredentials(next.mode))
}

/// Whether the data path may move to `next` with the volumes it has attached now (see the
/// module docs).
#[tracing::instrument(name = "datapath.check_tls_change", skip_all, fields(mode = %next.mode))]
pub async fn check(datapath: &DataPath, next: &NextTls) -> Result<(), TlsChangeError> {
    let node = datapath.identity().node.clone();
    let transport = transport(next, &node)?;
    if next.mode == TlsMode::Required && datapath.tls_mode() != TlsMode::Required {
        let plaintext = datapath.replica_stats().plaintext_open.load(Ordering::Relaxed);
        if plaintext > 0 {
            return Err(TlsChangeError::PlaintextPeers(plaintext));
        }
    }
    let infos = datapath.attach_infos();
    if let Some(credentials) = transport.credentials() {
        let anchors = credentials.current().anchors().clone();
        for (volume, info) in &infos {
            let remote = info.members.iter().any(|(n, _)| *n != node);
            let grant = datapath.grant(volume).or_else(|| info.grant.clone());
            let verified = grant.is_some_and(|g| wasmcsi_trust::grant::verify(&g, &anchors, SystemTime::now()).is_ok());
            if remote && !verified && next.authority.is_none() {
                return Err(TlsChangeError::NoGrant(volume.clone()));
            }
        }
    }
    let mut members: Vec<(String, String, SocketAddr)> = infos
        .iter()
        .flat_map(|(volume, info)| {
            info.members.iter().filter_map(|(n, addr)| Some((volume.clone(), n.clone(), (*addr)?)))
        })
        .filter(|(_, n, _)| *n != node)
        .collect();
    members.sort_by(|a, b| (&a.1, a.2).cmp(&(&b.1, b.2)));
    members.dedup_by(|a, b| (&a.1, a.2) == (&b.1, b.2));
    let mut asked = tokio::task::JoinSet::new();
    for (volume, member, addr) in members {
        let reach = Reach { transport: transport.clone(), server: ExpectedRole::Node(member.clone()) };
        asked.spawn(async move {
            let answer = ReplicaServerClient::over(addr, MEMBER_WAIT, reach).identify().await;
            (volume, member, addr, answer)
        });
    }
    while let Some(done) = asked.join_next().await {
        let Ok((volume, member, addr, answer)) = done else { continue };
        match answer {
            Ok(_) => {}
            Err(e @ (ControlError::Unreachable { .. } | ControlError::Timeout { .. })) => {
                tracing::warn!(volume.id = %volume, node = %member, %addr, error = %e, "a replica node does not answer; not counted against the TLS change");
            }
            Err(e) => {
                return Err(TlsChangeError::Member { volume, node: member, addr, detail: e.to_string() });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_change_keeps_what_it_does_not_name_and_replaces_every_spelling_of_what_it_does() {
        let before = args(&[
            "datapath",
            "--tls-mode=off",
            "--node-id",
            "n1",
            "--tls-dir",
            "/old",
            "--authority",
            "https://c:9503",
            "--tls-mode",
            "off",
        ]);
        let change = TlsChange { mode: TlsMode::Permissive, dir: None, authority: None };
        let next = resolve(&change, &before);
        assert_eq!(
            next,
            NextTls { mode: TlsMode::Permissive, dir: Some("/old".into()), authority: Some("https://c:9503".into()) }
        );
        let change = TlsChange { mode: TlsMode::Required, dir: Some("/new".into()), authority: None };
        let next = resolve(&change, &before);
        let mut after = before.clone();
        apply(&next, &mut after);
        assert_eq!(
            after,
            args(&[
                "datapath",
                "--node-id",
                "n1",
                "--tls-mode",
                "required",
                "--tls-dir",
                "/new",
                "--authority",
                "https://c:9503"
            ])
        );
        // Applied twice: the same line (a second upgrade starts from the first one's).
        let mut again = after.clone();
        apply(&next, &mut again);
        assert_eq!(again, after);
    }

    #[test]
    fn tls_without_credentials_and_an_authority_without_them_are_refused_before_anything_is_read() {
        let next = NextTls { mode: TlsMode::Permissive, dir: None, authority: None };
        assert!(matches!(transport(&next, "n1"), Err(TlsChangeError::NoCredentials(TlsMode::Permissive))));
        let next = NextTls { mode: TlsMode::Off, dir: None, authority: Some("https://c:9503".into()) };
        assert!(matches!(transport(&next, "n1"), Err(TlsChangeError::AuthorityWithoutCredentials)));
        let next = NextTls { mode: TlsMode::Off, dir: None, authority: None };
        assert!(matches!(transport(&next, "n1"), Ok(Transport::Plain)));
    }

    #[test]
    fn credentials_of_another_node_or_that_do_not_load_are_refused() {
        use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("a CA");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let issued = ca.issue(&Role::Node("n2".into()), Validity::starting_now(DEFAULT_LEAF_VALIDITY)).expect("issued");
        issued.write(dir.path(), &[ca.certificate().clone()]).expect("written");
        let next = NextTls { mode: TlsMode::Required, dir: Some(dir.path().to_owned()), authority: None };
        assert!(matches!(transport(&next, "n1"), Err(TlsChangeError::NotThisNode { .. })));
        assert!(matches!(transport(&next, "n2"), Ok(Transport::Required(_))));
        let empty = tempfile::tempdir().expect("a temporary directory");
        let next = NextTls { mode: TlsMode::Required, dir: Some(empty.path().to_owned()), authority: None };
        assert!(matches!(transport(&next, "n2"), Err(TlsChangeError::Credentials { .. })));
    }
}
