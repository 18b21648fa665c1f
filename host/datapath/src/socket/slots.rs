//! The data-path socket's connection slots: a total cap, a cap per client, and the [`Slot`] a
//! connection holds while it lives (dropping it gives the slot back).
//!
//! A client is the process that connected, as the kernel names it (`SO_PEERCRED`: uid and
//! pid), never anything the client says. The per-client cap is what keeps slots for the others:
//! one client holds at most [`SocketLimits::max_per_client`] of the
//! [`SocketLimits::max_connections`], so the rest stay free for the node plugin however many
//! connections another process opens and leaves idle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The socket's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketLimits {
    /// Connections served at once, from every client together.
    pub max_connections: usize,
    /// Connections served at once from one client (one process).
    pub max_per_client: usize,
    /// How long a connection may take to send a whole request (or to read a reply) before it
    /// is closed. The node plugin sends its request as soon as it connects, so only a stuck or
    /// hostile client ever reaches it; a request being answered (an attach takes seconds) is
    /// not idle.
    pub idle_timeout: Duration,
}

pub const DEFAULT_MAX_CONNECTIONS: usize = 128;
/// A quarter of the total: three quarters stay for the other clients.
pub const DEFAULT_MAX_PER_CLIENT: usize = 32;
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for SocketLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_client: DEFAULT_MAX_PER_CLIENT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// Who connected: the kernel's credentials of the connecting process (`None`: the kernel gave
/// none, and every such connection counts as one client).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    pub uid: Option<u32>,
    pub pid: Option<i32>,
}

impl Client {
    pub fn of(stream: &tokio::net::UnixStream) -> Self {
        match stream.peer_cred() {
            Ok(cred) => Client { uid: Some(cred.uid()), pid: cred.pid() },
            Err(_) => Client { uid: None, pid: None },
        }
    }
}

impl std::fmt::Display for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.pid, self.uid) {
            (Some(pid), Some(uid)) => write!(f, "pid {pid} (uid {uid})"),
            (None, Some(uid)) => write!(f, "uid {uid}"),
            _ => f.write_str("a client without credentials"),
        }
    }
}

/// Why a connection was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Every slot is held.
    Total,
    /// The client holds its cap of connections.
    PerClient,
}

pub(crate) struct Slots {
    limits: SocketLimits,
    counts: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    total: usize,
    /// Connections held per client, and whether its refusal was logged since it last had room.
    by_client: HashMap<Client, (usize, bool)>,
}

impl Slots {
    pub(crate) fn new(limits: SocketLimits) -> Arc<Slots> {
        Arc::new(Slots { limits, counts: Mutex::new(Counts::default()) })
    }

    /// A slot for a connection of `client`; the refusal, and whether it is the first since the
    /// client last had room (log it once, not once per connection of a flood).
    pub(crate) fn try_take(self: &Arc<Self>, client: Client) -> Result<Slot, (Refusal, bool)> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let total = counts.total;
        let (held, logged) = counts.by_client.entry(client).or_insert((0, false));
        let refusal = if *held >= self.limits.max_per_client {
            Some(Refusal::PerClient)
        } else if total >= self.limits.max_connections {
            Some(Refusal::Total)
        } else {
            None
        };
        if let Some(refusal) = refusal {
            let first = !std::mem::replace(logged, true);
            if *held == 0 {
                counts.by_client.remove(&client);
            }
            return Err((refusal, first));
        }
        *held += 1;
        counts.total += 1;
        Ok(Slot { slots: self.clone(), client })
    }

    pub(crate) fn held(&self) -> usize {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner).total
    }
}

/// One admitted connection's slot; released when dropped.
pub(crate) struct Slot {
    slots: Arc<Slots>,
    client: Client,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.slots.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total = counts.total.saturating_sub(1);
        if let Some((held, logged)) = counts.by_client.get_mut(&self.client) {
            *held = held.saturating_sub(1);
            *logged = false;
            if *held == 0 {
                counts.by_client.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn client(pid: i32) -> Client {
        Client { uid: Some(0), pid: Some(pid) }
    }

    fn limits(max_connections: usize, max_per_client: usize) -> SocketLimits {
        SocketLimits { max_connections, max_per_client, ..SocketLimits::default() }
    }

    #[test]
    fn one_client_takes_its_cap_and_leaves_the_rest_to_others() {
        let slots = Slots::new(limits(4, 2));
        let held: Vec<Slot> = (0..2).map(|_| slots.try_take(client(1)).ok().unwrap()).collect();
        assert_eq!(slots.try_take(client(1)).err(), Some((Refusal::PerClient, true)));
        assert_eq!(slots.try_take(client(1)).err(), Some((Refusal::PerClient, false)), "logged once per burst");
        let other: Vec<Slot> = (0..2).map(|_| slots.try_take(client(2)).ok().unwrap()).collect();
        assert_eq!(slots.try_take(client(3)).err(), Some((Refusal::Total, true)));
        assert_eq!(slots.held(), 4);
        drop(held);
        assert!(slots.try_take(client(1)).is_ok(), "released slots are taken again");
        drop(other);
        assert_eq!(slots.held(), 0);
        assert!(slots.counts.lock().unwrap().by_client.is_empty(), "no client kept once it holds nothing");
    }

    #[test]
    fn a_refused_client_is_logged_again_after_it_had_room() {
        let slots = Slots::new(limits(4, 1));
        let held = slots.try_take(client(1)).ok().unwrap();
        assert_eq!(slots.try_take(client(1)).err(), Some((Refusal::PerClient, true)));
        drop(held);
        let _held = slots.try_take(client(1)).ok().unwrap();
        assert_eq!(slots.try_take(client(1)).err(), Some((Refusal::PerClient, true)));
    }
}
