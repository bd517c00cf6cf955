//! Hot-key shards: the keys of a key's S windows (`shards = S` on a
//! `[[policy]]`, docs/SCALING.md). Shard i's key is the key with the byte
//! 0x1F (`SHARD_MARK`) and `<n>` appended, inside its hash tag
//! (`<prefix>{<key>\x1f<n>}:<window>ms`), where
//! `n` is the smallest number >= i whose tag hashes into the i-th of S equal
//! ranges of the 16384 Cluster slots. So the shards sit in S different slots
//! and, on a cluster whose primaries hold contiguous equal ranges (what
//! `redis-cli --cluster create` and `rebalance` make), on min(S, primaries)
//! different primaries; every daemon computes the same keys. A key with a
//! `{...}` hash tag of its own keeps that tag (`WindowKey`), so its shards
//! share the tag's slot: still exact, but not spread.

use bytes::{BufMut, Bytes, BytesMut};

/// Redis Cluster's slot count.
const SLOTS: u32 = 16_384;

/// Between a key and its shard's number: a control byte, refused in every
/// key a client sends (PROTOCOL.md), so no client key is another key's
/// shard ("a#4" was shard 4 of "a" while the mark was `#`).
pub const SHARD_MARK: u8 = 0x1f;

/// Candidates tried per shard before settling for `n = i` (unreachable in
/// practice: a range of at least 256 slots is missed 4096 times in a row
/// with probability below 1e-27).
const MAX_CANDIDATES: u32 = 4096;

/// The key of shard `shard` (0-based) of `key` split over `shards`.
pub fn shard_key(key: &[u8], shard: u32, shards: u32) -> Bytes {
    let mut out = BytesMut::with_capacity(key.len() + 6);
    out.put_slice(key);
    out.put_u8(SHARD_MARK);
    let n = if has_hash_tag(key) { shard } else { steer(key, shard, shards) };
    out.put_slice(decimal(n, &mut [0; 10]));
    out.freeze()
}

/// The smallest `n >= shard` such that `key` 0x1F `n` hashes into the slot range
/// of `shard`.
fn steer(key: &[u8], shard: u32, shards: u32) -> u32 {
    let (lo, hi) = (shard * SLOTS / shards, (shard + 1) * SLOTS / shards);
    let stem = crc16(crc16(0, key), &[SHARD_MARK]);
    (shard..shard + MAX_CANDIDATES)
        .find(|&n| {
            let slot = u32::from(crc16(stem, decimal(n, &mut [0; 10]))) % SLOTS;
            (lo..hi).contains(&slot)
        })
        .unwrap_or(shard)
}

/// `n` in decimal, in `buf` (no allocation: `steer` tries several).
fn decimal(mut n: u32, buf: &mut [u8; 10]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// Whether `key` has a non-empty `{...}` (as `WindowKey` decides).
fn has_hash_tag(key: &[u8]) -> bool {
    match key.iter().position(|&b| b == b'{') {
        Some(open) => key[open + 1..].iter().position(|&b| b == b'}').is_some_and(|len| len > 0),
        None => false,
    }
}

/// CRC16/XMODEM (Redis Cluster's key hash), continued from `crc`.
fn crc16(mut crc: u16, data: &[u8]) -> u16 {
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(tag: &[u8]) -> u32 {
        u32::from(crc16(0, tag)) % SLOTS
    }

    #[test]
    fn crc16_is_redis_key_hash() {
        // CLUSTER KEYSLOT values from Redis's documentation and redis-cli.
        assert_eq!(slot(b"123456789"), 0x31C3 % SLOTS);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
    }

    #[test]
    fn each_shard_lands_in_its_own_slot_range() {
        for shards in [1, 2, 3, 6, 7, 64] {
            for key in [&b"\x05ordert1"[..], b"\x03apihot-tenant", b""] {
                let mut slots = Vec::new();
                for i in 0..shards {
                    let k = shard_key(key, i, shards);
                    assert!(k.starts_with(key) && k[key.len()] == SHARD_MARK, "{k:?}");
                    let s = slot(&k);
                    assert!((i * SLOTS / shards..(i + 1) * SLOTS / shards).contains(&s), "shard {i}/{shards} of {key:?}: slot {s}");
                    slots.push(s);
                    assert_eq!(k, shard_key(key, i, shards), "the same key on every call");
                }
                slots.dedup();
                assert_eq!(slots.len(), shards as usize);
            }
        }
    }

    #[test]
    fn own_hash_tag_is_kept() {
        assert_eq!(&shard_key(b"\x01a{t}", 2, 3)[..], b"\x01a{t}\x1f2");
    }
}
