//! Overrides set through the admin API: a table of (policy, key) → limit
//! with an expiry, kept in Redis and read by every daemon in the
//! background (`admin_api::store`), swapped in whole here. The request path
//! only reads this table: one atomic load and, when the table is not
//! empty, one hash lookup by the scoped key the frame already carries. No
//! lock, no allocation, no Redis call.
//!
//! An entry in force replaces what the file says for its key (the
//! policy's limit, a `[policy.overrides]` entry, the allowlist); when it
//! expires, or is deleted, the file's value is the key's limit again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::config::PolicyLimit;

/// One override in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveOverride {
    pub limit: PolicyLimit,
    /// Unix time in ms, on Redis's clock, at which it stops applying.
    pub expires_at_ms: u64,
}

/// The overrides in force, by scoped key (length byte, policy name, key:
/// what a CHECK_POLICY frame carries as `scoped_key`).
pub type Table = HashMap<Box<[u8]>, LiveOverride>;

/// The table the request path reads, replaced whole by the refresher.
#[derive(Debug, Default)]
pub struct LiveOverrides {
    table: ArcSwap<Table>,
    /// This daemon's own admin writes, applied at once (the daemon that
    /// answers a write applies it before it answers), and kept until a
    /// refresh that read Redis after them has replaced the table: a refresh
    /// whose read began before a write would otherwise undo it until the
    /// next one. Only the admin API and the refresher take this lock; the
    /// request path never does.
    writes: Mutex<Writes>,
}

#[derive(Debug, Default)]
struct Writes {
    seq: u64,
    /// (seq, scoped key, the override now, None: deleted).
    pending: Vec<(u64, Box<[u8]>, Option<LiveOverride>)>,
}

fn apply(table: &mut Table, scoped: &[u8], o: Option<LiveOverride>) {
    match o {
        Some(o) => {
            table.insert(scoped.into(), o);
        }
        None => {
            table.remove(scoped);
        }
    }
}

impl LiveOverrides {
    /// The override in force for `scoped_key`, if any.
    #[inline]
    pub fn limit_for(&self, scoped_key: &[u8]) -> Option<PolicyLimit> {
        let table = self.table.load();
        if table.is_empty() {
            return None;
        }
        table.get(scoped_key).map(|o| o.limit)
    }

    /// The table in force now.
    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    /// Puts `table` in force.
    pub fn replace(&self, table: Table) {
        self.table.store(Arc::new(table));
    }

    /// Where this daemon's writes stand: taken before a refresh reads Redis.
    pub fn write_mark(&self) -> u64 {
        self.writes.lock().expect("not poisoned").seq
    }

    /// Puts `table`, read from Redis after `mark` was taken, in force, with
    /// this daemon's writes made since `mark` applied over it; forgets the
    /// writes it already holds.
    pub fn replace_read_after(&self, mut table: Table, mark: u64) {
        let mut writes = self.writes.lock().expect("not poisoned");
        writes.pending.retain(|(seq, _, _)| *seq > mark);
        for (_, scoped, o) in &writes.pending {
            apply(&mut table, scoped, *o);
        }
        self.table.store(Arc::new(table));
    }

    /// Applies this daemon's admin write of `scoped` (None: deleted) now.
    /// Costs a copy of the table: admin writes only.
    pub fn write(&self, scoped: &[u8], o: Option<LiveOverride>) {
        let mut writes = self.writes.lock().expect("not poisoned");
        writes.seq += 1;
        let seq = writes.seq;
        writes.pending.push((seq, scoped.into(), o));
        let mut table = Table::clone(&self.table.load());
        apply(&mut table, scoped, o);
        self.table.store(Arc::new(table));
    }

    /// A copy of the overrides in force.
    pub fn entries(&self) -> Vec<(Box<[u8]>, LiveOverride)> {
        self.table.load().iter().map(|(k, o)| (k.clone(), *o)).collect()
    }

    /// How many overrides are in force.
    pub fn len(&self) -> usize {
        self.table.load().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The key the daemon counts a policy's key under, as a CHECK_POLICY frame
/// carries it: the name's length byte, the name, the key. Names are at
/// most 255 bytes long (the configuration checks it).
pub fn scoped_key(policy: &str, key: &[u8]) -> Vec<u8> {
    let mut scoped = Vec::with_capacity(1 + policy.len() + key.len());
    scoped.push(u8::try_from(policy.len()).unwrap_or(u8::MAX));
    scoped.extend_from_slice(policy.as_bytes());
    scoped.extend_from_slice(key);
    scoped
}

/// The policy name and key of a scoped key, if it is one.
pub fn split_scoped(scoped: &[u8]) -> Option<(&str, &[u8])> {
    let (&len, rest) = scoped.split_first()?;
    let len = usize::from(len);
    let name = std::str::from_utf8(rest.get(..len)?).ok()?;
    Some((name, &rest[len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_table_answers_nothing_and_a_filled_one_answers_its_keys_only() {
        let live = LiveOverrides::default();
        assert_eq!(live.limit_for(&scoped_key("p", b"k")), None);
        let mut t = Table::new();
        t.insert(scoped_key("p", b"k").into(), LiveOverride { limit: PolicyLimit::Limit(7), expires_at_ms: 1 });
        live.replace(t);
        assert_eq!(live.limit_for(&scoped_key("p", b"k")), Some(PolicyLimit::Limit(7)));
        assert_eq!(live.limit_for(&scoped_key("q", b"k")), None);
        assert_eq!(live.limit_for(&scoped_key("p", b"k2")), None);
    }

    #[test]
    fn a_scoped_key_splits_back_into_its_policy_and_key() {
        assert_eq!(split_scoped(&scoped_key("per_tenant", b"a:b")), Some(("per_tenant", &b"a:b"[..])));
        assert_eq!(split_scoped(&[9, b'x']), None);
        assert_eq!(split_scoped(&[]), None);
    }
}
