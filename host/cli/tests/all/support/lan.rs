//! A private LAN of network namespaces for multi-node tests: a bridge in a namespace of its own
//! (the switch) and one namespace per member, joined to the bridge by a veth pair, addressed
//! 10.201.0.N/24. Members reach each other and nothing else; the test process (root namespace)
//! reaches them only through unix sockets and the shared mount namespace. Each LAN is isolated,
//! so concurrent tests reuse the same addresses without colliding.
//!
//! A partition is the member's port on the switch set down: the member keeps its address and
//! its sockets, its packets go nowhere (as with a pulled cable), and TCP peers notice only by
//! their own timeouts. Every namespace is deleted on drop, also when a test panics.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

static SEQ: AtomicUsize = AtomicUsize::new(0);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip (iproute2)");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

pub struct Lan {
    switch: String,
    /// Member namespaces, in joining order (member i has port `p{i}` and address .{i + 2}).
    members: Vec<String>,
}

/// One member of a [`Lan`]: its namespace (for `nsenter --net=/run/netns/NAME`) and address.
#[derive(Debug, Clone)]
pub struct Member {
    pub netns: String,
    pub addr: Ipv4Addr,
    port: String,
}

impl Lan {
    pub fn create() -> Self {
        let switch = format!("wcl{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        ip(&["netns", "add", &switch]);
        let lan = Self { switch, members: Vec::new() };
        ip(&["-n", &lan.switch, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &lan.switch, "link", "set", "br0", "up"]);
        lan
    }

    /// A new member namespace, connected and up.
    pub fn join(&mut self) -> Member {
        let i = self.members.len();
        let netns = format!("{}-{i}", self.switch);
        ip(&["netns", "add", &netns]);
        self.members.push(netns.clone());
        let port = format!("p{i}");
        let addr = Ipv4Addr::new(10, 201, 0, u8::try_from(i + 2).expect("fewer than 250 members"));
        ip(&["-n", &self.switch, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &netns]);
        ip(&["-n", &self.switch, "link", "set", &port, "master", "br0", "up"]);
        ip(&["-n", &netns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
        ip(&["-n", &netns, "link", "set", "eth0", "up"]);
        ip(&["-n", &netns, "link", "set", "lo", "up"]);
        Member { netns, addr, port }
    }

    /// Cuts `m` off the LAN.
    pub fn partition(&self, m: &Member) {
        ip(&["-n", &self.switch, "link", "set", &m.port, "down"]);
    }

    pub fn heal(&self, m: &Member) {
        ip(&["-n", &self.switch, "link", "set", &m.port, "up"]);
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        // Deleting a namespace destroys its veth ends, and with them the pairs.
        for ns in self.members.iter().chain([&self.switch]) {
            let _ = Command::new("ip").args(["netns", "del", ns]).stderr(Stdio::null()).output();
        }
    }
}
