//! The host's replicated block data path, pure-logic half: the replica wire protocol
//! ([`protocol`]), the dirty-region bitmap that makes delta rebuilds possible ([`dirty`]) and the
//! sans-I/O replication engine ([`replication`]) that turns client I/O and replica replies into
//! messages to send. It owns no sockets, files, threads or clocks: a driver (the replica server,
//! the engine's TCP driver, the FUSE frontend — all later parts of issue 4) feeds it events and
//! executes its actions, which is what lets `sim` test it on a seeded simulated network.

pub mod dirty;
pub mod protocol;
pub mod replication;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod testutil;
