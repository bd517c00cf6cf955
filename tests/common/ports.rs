//! Loopback TCP ports that cannot collide between tests running at once.
//!
//! A port that was free when it was chosen may be taken before the server
//! binds it, by another test that chose the same one; both tests then talk
//! to one server. So no port is handed out on its own: `on_own_ports` picks
//! candidates, lets the caller start its server on them and confirm that the
//! process serving them is the one it started (Redis: `INFO server`
//! `process_id`; others: `listens_on`), and moves on to other candidates if
//! the server exited (a port was taken) or someone else answered.

use std::collections::hash_map::RandomState;
use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// Attempts before giving up: each failed one means a port was taken between
/// the check and the bind, which is rare; twenty in a row means something
/// else is wrong, and the last reason is reported.
pub const ATTEMPTS: usize = 20;

/// Starts something on `count` ports of its own. `start` gets the candidate
/// ports and returns the started, confirmed server, or why these ports did
/// not work out (after stopping what it started); then others are tried.
pub fn on_own_ports<T>(what: &str, count: usize, mut start: impl FnMut(&[u16]) -> Result<T, String>) -> T {
    let mut reasons = Vec::new();
    for _ in 0..ATTEMPTS {
        let ports = candidates(count);
        match start(&ports) {
            Ok(started) => return started,
            Err(why) => reasons.push(format!("ports {ports:?}: {why}")),
        }
    }
    panic!("{what}: no ports of its own after {ATTEMPTS} attempts; the last:\n{}", reasons.last().unwrap());
}

/// `on_own_ports` for one port.
pub fn on_own_port<T>(what: &str, mut start: impl FnMut(u16) -> Result<T, String>) -> T {
    on_own_ports(what, 1, |ports| start(ports[0]))
}

/// `count` distinct ports, each bindable on 127.0.0.1 at this moment (a
/// cheap filter, not a reservation: see the module comment).
fn candidates(count: usize) -> Vec<u16> {
    let range = outside_ephemeral_range();
    let mut ports = Vec::with_capacity(count);
    while ports.len() < count {
        let port = range.start + (random() % u64::from(range.end - range.start)) as u16;
        if !ports.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            ports.push(port);
        }
    }
    ports
}

/// Ports the kernel does not hand out for `bind(0)` and outgoing
/// connections (the daemon's, redis-cli's, the HTTP clients'), so that a
/// candidate is not busy as the local end of some connection, and tests
/// elsewhere that still bind port 0 do not land on it.
fn outside_ephemeral_range() -> Range<u16> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let bounds: Vec<u16> = text.split_whitespace().filter_map(|n| n.parse().ok()).collect();
    match bounds[..] {
        [low, _] if low >= 12_000 => 10_000..low,
        [_, high] if high <= 63_000 => high + 1..65_535,
        _ => 10_000..65_535,
    }
}

/// Different in each test process and for each call: test binaries running
/// at once must not walk the same sequence of ports.
fn random() -> u64 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// True when process `pid` holds a listening TCP socket on `port` (any
/// local address, IPv4 or IPv6): the port is that process's, as no other
/// process can listen on it at the same time (none of the servers the tests
/// start sets SO_REUSEPORT).
pub fn listens_on(pid: u32, port: u16) -> bool {
    let listening = listening_inodes(port);
    if listening.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok()).any(|target| {
        let target = target.to_string_lossy();
        target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')).and_then(|n| n.parse::<u64>().ok()).is_some_and(|inode| listening.contains(&inode))
    })
}

/// Inodes of the sockets in state LISTEN on `port`, from /proc/net/tcp{,6}:
/// `sl local_address(hex ip:hex port) rem_address st ... uid timeout inode`.
fn listening_inodes(port: u16) -> HashSet<u64> {
    const LISTEN: &str = "0A";
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9)) else { continue };
            let local_port = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if *state == LISTEN && local_port == Some(port) {
                if let Ok(inode) = inode.parse() {
                    inodes.insert(inode);
                }
            }
        }
    }
    inodes
}
