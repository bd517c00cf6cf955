//! The vocabulary of the log's Redis data: the key of a client key's
//! window, its Cluster slot, and a script's reply as a verdict. Shared by
//! `window` (one key per call) and `multi` (several keys, several slots).

use std::io::Write;

use redis::{RedisWrite, ToRedisArgs};

use crate::protocol::Algorithm;
use crate::window::Verdict;

/// The Redis key of a client key, window and algorithm:
/// `<prefix>{<key>}:<window>ms` for the log (the seed's keys, unchanged),
/// `<prefix>{<key>}:<window>ms:<algorithm>` for the others (`:ring`), so
/// that two algorithms never read each other's data;
/// or `<prefix>~<key>:<window>ms` when the key already carries a non-empty
/// `{...}` hash tag of its own, so that callers can keep related keys in
/// one Cluster slot. The `~` keeps the two forms apart (`a` and `{a}` are
/// different keys). The window is part of the key because two locations
/// may share a key with different windows: in one ZSET, the shorter
/// window's cleanup would erase the longer one's history. It sits outside
/// the hash tag, so every window of a key lives in the key's slot. The
/// prefix is always there, so no client key reaches outside the namespace.
#[derive(Clone, Copy, Debug)]
pub struct WindowKey<'a> {
    pub prefix: &'a [u8],
    pub key: &'a [u8],
    pub window_ms: u32,
    pub algorithm: Algorithm,
}

impl WindowKey<'_> {
    fn has_hash_tag(&self) -> bool {
        match self.key.iter().position(|&b| b == b'{') {
            Some(open) => self.key[open + 1..].iter().position(|&b| b == b'}').is_some_and(|len| len > 0),
            None => false,
        }
    }

    /// The full key as bytes (admin tools and tests; the hot path writes it
    /// straight into the command buffer).
    pub fn to_vec(self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.prefix.len() + self.key.len() + 2);
        self.write_into(&mut v).expect("writing to a Vec cannot fail");
        v
    }

    /// Everything before the window: the part all windows of a key share.
    pub(super) fn write_stem(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(self.prefix)?;
        if self.has_hash_tag() {
            w.write_all(b"~")?;
            w.write_all(self.key)
        } else {
            w.write_all(b"{")?;
            w.write_all(self.key)?;
            w.write_all(b"}")
        }
    }

    fn write_into(&self, w: &mut impl Write) -> std::io::Result<()> {
        self.write_stem(w)?;
        write!(w, ":{}ms", self.window_ms)?;
        match self.algorithm {
            Algorithm::Log => Ok(()),
            a => write!(w, ":{}", a.as_str()),
        }
    }

    /// A `SCAN MATCH` pattern for every window of this key, of every
    /// algorithm (admin tools): the stem with glob characters escaped, then
    /// `:*ms*`.
    pub fn all_windows_pattern(&self) -> Vec<u8> {
        let mut stem = Vec::with_capacity(self.prefix.len() + self.key.len() + 2);
        self.write_stem(&mut stem).expect("writing to a Vec cannot fail");
        let mut out = glob_escaped(&stem);
        out.extend_from_slice(b":*ms*");
        out
    }
}

/// `bytes` with the glob characters of `SCAN MATCH` escaped: a pattern
/// that matches exactly these bytes (a client's key may hold any of them).
pub fn glob_escaped(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() * 2 + 4);
    for &b in bytes {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out
}

impl ToRedisArgs for WindowKey<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let _ = self.write_into(&mut out.writer_for_next_arg());
    }
}

/// The Redis Cluster slot of a key: CRC16 (XMODEM) of its hash tag, or of
/// the whole key, modulo 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter().position(|&b| b == b'}').filter(|&len| len > 0).map(|len| &rest[..len])
    });
    let mut crc: u16 = 0;
    for &b in tagged.unwrap_or(key) {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

pub(super) fn verdict(allowed: i64, count: i64, remaining: i64, retry_after_ms: i64, reset_ms: i64) -> Verdict {
    Verdict {
        allowed: allowed == 1,
        count: clamp_u32(count),
        remaining: clamp_u32(remaining),
        retry_after_ms: clamp_u32(retry_after_ms),
        reset_ms: clamp_u32(reset_ms),
    }
}

fn clamp_u32(v: i64) -> u32 {
    v.clamp(0, u32::MAX as i64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(prefix: &str, key: &str) -> String {
        String::from_utf8(WindowKey { prefix: prefix.as_bytes(), key: key.as_bytes(), window_ms: 1000, algorithm: Algorithm::Log }.to_vec()).unwrap()
    }

    #[test]
    fn keys_are_prefixed_hash_tagged_and_name_their_window() {
        assert_eq!(key("rl:", "order:tenant-1001"), "rl:{order:tenant-1001}:1000ms");
        assert_eq!(key("rl:", "{tenant-1}:order"), "rl:~{tenant-1}:order:1000ms");
        assert_ne!(key("rl:", "a"), key("rl:", "{a}"));
        // An empty tag is no tag: the whole key is wrapped.
        assert_eq!(key("rl:", "a{}b"), "rl:{a{}b}:1000ms");
        assert_eq!(key("rl:", "a}b{"), "rl:{a}b{}:1000ms");
        let k = |w, algorithm| WindowKey { prefix: b"rl:", key: b"k", window_ms: w, algorithm }.to_vec();
        assert_ne!(k(100, Algorithm::Log), k(60_000, Algorithm::Log));
        assert_eq!(k(100, Algorithm::Ring), b"rl:{k}:100ms:ring");
        let glob = WindowKey { prefix: b"rl:", key: b"a*b?[c]", window_ms: 5, algorithm: Algorithm::Log }.all_windows_pattern();
        assert_eq!(String::from_utf8(glob).unwrap(), r"rl:{a\*b\?\[c\]}:*ms*");
    }

    #[test]
    fn cluster_slots_follow_the_hash_tag() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(key_slot(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"{user1000}.followers"));
    }
}
