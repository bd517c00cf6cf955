//! Planning: which store windows a resolved item is counted in. An
//! unsharded item has one window, under its key. A sharded one (`shards =
//! S`, docs/SCALING.md) has S, under `redis::shard_key`, each with its part
//! of the key's limit (`shard_limit`, parts summing to the limit), tried in
//! this daemon's round robin; a shard whose part is below the item's cost
//! is never asked. The same plan serves single checks, multi-item and
//! refundable checks (SEMANTICS S1); a refund names every shard.

use std::borrow::Cow;

use bytes::Bytes;

use crate::policies::shard_limit;
use crate::redis::shard_key;

use super::resolve::Item;

/// The shards an item may be admitted by, in the order they are tried:
/// from the policy's round-robin start, skipping parts below the cost.
#[derive(Clone, Copy, Debug)]
pub(super) struct ShardOrder {
    first: u32,
    shards: u32,
    limit: u32,
    cost: u32,
    /// Shards passed so far (tried or skipped).
    next: u32,
}

impl ShardOrder {
    /// The order of a sharded item (`item.shards > 1`, a limit): takes one
    /// step of its policy's round robin.
    pub fn of(item: &Item<'_>, limit: u32) -> Self {
        let first = item.policy.map_or(0, |p| p.first_shard());
        Self { first, shards: item.shards, limit, cost: item.cost, next: 0 }
    }
}

impl Iterator for ShardOrder {
    /// (shard index, its part of the limit)
    type Item = (u32, u32);

    fn next(&mut self) -> Option<(u32, u32)> {
        while self.next < self.shards {
            let i = (self.first + self.next) % self.shards;
            self.next += 1;
            let part = shard_limit(self.limit, i, self.shards);
            if self.cost <= part {
                return Some((i, part));
            }
        }
        None
    }
}

/// One window of an item: its key and its limit.
#[derive(Clone, Debug)]
pub(super) struct Window<'a> {
    pub key: Cow<'a, [u8]>,
    pub limit: u32,
}

impl<'a> Window<'a> {
    /// The one window of an unsharded item (no allocation).
    pub fn whole(item: &Item<'a>, limit: u32) -> Self {
        Self { key: Cow::Borrowed(&item.key[..]), limit }
    }

    /// Shard `i` of a sharded item: a key of its own (one small
    /// allocation, only for sharded policies).
    pub fn shard(item: &Item<'_>, i: u32, part: u32) -> Self {
        Self { key: Cow::Owned(shard_key(item.key, i, item.shards).to_vec()), limit: part }
    }
}

/// Every window a refund of `item` names, with its limit: its key, or
/// every shard's (the admission was taken by one; removing absent members
/// is harmless).
pub(super) fn refund_windows(item: &Item<'_>, limit: u32) -> Vec<(Bytes, u32)> {
    if item.shards > 1 {
        (0..item.shards).map(|i| (shard_key(item.key, i, item.shards), shard_limit(limit, i, item.shards))).collect()
    } else {
        vec![(item.key.clone(), limit)]
    }
}

/// An item's windows in a multi-item check: the current one, and for a
/// sharded item the ones still untried.
#[derive(Debug)]
pub(super) struct Planned<'a> {
    pub window: Window<'a>,
    /// `Some` for a sharded item: the shards not tried yet.
    pub rest: Option<ShardOrder>,
    /// The refusals of a sharded item's tried shards, merged (room left
    /// summed, earliest retry), to report the key as a whole.
    pub refusals: Option<crate::window::Verdict>,
}

impl<'a> Planned<'a> {
    /// The first window of `item` (with a limit; exempt items are not planned).
    /// `None`: a sharded item no shard of which can hold its cost
    /// (resolution refuses that cost already).
    pub fn first(item: &Item<'a>, limit: u32) -> Option<Self> {
        if item.shards <= 1 {
            return Some(Self { window: Window::whole(item, limit), rest: None, refusals: None });
        }
        let mut order = ShardOrder::of(item, limit);
        let (i, part) = order.next()?;
        Some(Self { window: Window::shard(item, i, part), rest: Some(order), refusals: None })
    }

    /// Moves a sharded item to its next untried shard; false when none is
    /// left (or the item is not sharded).
    pub fn advance(&mut self, item: &Item<'_>) -> bool {
        match self.rest.as_mut().and_then(Iterator::next) {
            Some((i, part)) => {
                self.window = Window::shard(item, i, part);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts of limit 10 over 3 shards are 4, 3, 3: a cost of 4 fits
    /// shard 0 only, a cost of 3 every shard, each once, in round-robin
    /// order from the start.
    #[test]
    fn the_shard_order_skips_parts_below_the_cost_and_visits_each_shard_once() {
        let order = |first, cost| ShardOrder { first, shards: 3, limit: 10, cost, next: 0 }.collect::<Vec<_>>();
        assert_eq!(order(1, 4), [(0, 4)]);
        assert_eq!(order(1, 3), [(1, 3), (2, 3), (0, 4)]);
        assert_eq!(order(2, 1), [(2, 3), (0, 4), (1, 3)]);
        assert_eq!(order(0, 5), []);
    }
}
