//! The protocol's vocabulary, each enum written once: its wire value and its
//! name come from one table, and `from_wire`, `to_wire`, `as_str`,
//! `from_name` and `ALL` are generated from it. Metrics label sets iterate
//! over `ALL`; tests/vocabulary.rs checks the Lua client's tables and
//! docs/PROTOCOL.md against the same lists, so the three cannot drift.

use std::fmt;

/// The protocol version this daemon speaks.
pub const VERSION: u8 = 1;
/// Op code of a rate-limit check.
pub const OP_CHECK: u8 = 1;
/// Op code of a check of named policies from the daemon's configuration.
pub const OP_CHECK_POLICY: u8 = 2;
/// Op code of a refund: takes back the admissions of a refundable
/// CHECK_POLICY by the handle its response carried.
pub const OP_REFUND: u8 = 3;
/// CHECK_POLICY request flag: answer with a refund handle (the response
/// carries the extension of docs/PROTOCOL.md section 5b).
pub const FLAG_REFUNDABLE: u16 = 0x0001;
/// CHECK_POLICY request flag: reserve the item's cost as an estimate, to be
/// settled to the actual cost by op 9 (docs/PROTOCOL.md section 4f); the
/// response carries the extension of section 5b with the settle handle.
pub const FLAG_SETTLE: u16 = 0x0002;
/// Op code of a settle: the actual cost of a reserved request
/// (docs/PROTOCOL.md section 4f). REFUND's layout, one item whose cost is
/// the actual (0 allowed).
pub const OP_SETTLE: u8 = 9;
/// Op code of a worker share of a quota lease (docs/PROTOCOL.md section
/// 4h, docs/PERFORMANCE.md "Worker shares"): CHECK_POLICY's header and one
/// item whose cost is the units wanted; answered with the units granted
/// (`count`) and the ms they are valid for from the worker's send
/// (`retry_after_ms`).
pub const OP_LEASE_SHARE: u8 = 10;
/// CHECK request flag: not a check but a worker share of an inline
/// limit's quota lease (docs/PROTOCOL.md section 4h): `cost` is the units
/// wanted (1..=`MAX_SHARE_UNITS`), answered as a LEASE_SHARE is.
pub const FLAG_SHARE: u16 = 0x1000;
/// CHECK request flag, with `FLAG_SHARE`: units of an inline limit's
/// worker share given back (`cost`, 1..=`MAX_GIVE_BACK_UNITS`), unused:
/// the daemon takes them back into its lease (docs/PROTOCOL.md section 4h).
pub const FLAG_SHARE_GIVE_BACK: u16 = 0x2000;
/// LEASE_SHARE flag: the item's `cost` is units of the host's share given
/// back, unused (1..=`MAX_GIVE_BACK_UNITS`), not units wanted.
pub const FLAG_GIVE_BACK: u16 = 0x0001;
/// Most units one give-back returns: the most a worker's shared-dict entry
/// holds (lua/resty/ratelimitd/share.lua, MAX_PACKED).
pub const MAX_GIVE_BACK_UNITS: u32 = 4095;
/// Most units one LEASE_SHARE asks for (and is granted): the worker's
/// shared-dict counter packs them under its deadline (lua/resty/ratelimitd/share.lua).
pub const MAX_SHARE_UNITS: u32 = 255;
/// Largest cost of one request, or actual of a settle, on the O(1)
/// algorithms (GCRA, sliding counter, fixed window): a month of tokens.
pub const MAX_O1_COST: u32 = 1_000_000_000;
/// Most items in one CHECK_POLICY or REFUND request.
pub const MAX_POLICY_ITEMS: usize = 8;
/// Bytes of a refund handle: the daemon instance and the call's sequence,
/// which name the admissions' ZSET members.
pub const HANDLE_LEN: usize = 16;
/// Bytes of a REFUND body before its first item: version, op, id, flags,
/// a reserved byte, item count, the handle.
pub const REFUND_HEADER_LEN: usize = 10 + HANDLE_LEN;
/// Bytes of one item's result in a response extension: decision, source,
/// count, remaining, retry-after, reset, limit, window.
pub const ITEM_RESULT_LEN: usize = 26;
/// Largest response extension: item count, refusing item, handle length,
/// a handle and `MAX_POLICY_ITEMS` item results.
pub const MAX_EXTENSION_LEN: usize = 3 + HANDLE_LEN + MAX_POLICY_ITEMS * ITEM_RESULT_LEN;
/// Op code of acquiring a concurrency lease (docs/PROTOCOL.md, section 4d).
pub const OP_ACQUIRE: u8 = 5;
/// Op code of releasing one; same layout.
pub const OP_RELEASE: u8 = 6;
/// Bytes of an ACQUIRE or RELEASE body before its key and lease id.
pub const LEASE_HEADER_LEN: usize = 29;
/// Longest lease id.
pub const MAX_LEASE_ID_LEN: usize = 64;
/// ACQUIRE_POLICY (section 4e): a lease of a named concurrency policy; with
/// `FLAG_RELEASE`, its release.
pub const OP_ACQUIRE_POLICY: u8 = 7;
/// DESCRIBE_POLICY (docs/PROTOCOL.md section 4g): what the daemon's
/// configuration in force says of a policy name (exists? kind, algorithm,
/// limit, window, on_error, local quota), so that a client can verify the
/// names it uses and take a policy's window instead of repeating it.
pub const OP_DESCRIBE_POLICY: u8 = 8;
/// Bytes of a DESCRIBE_POLICY body before the name: version, op, id,
/// flags, name length.
pub const DESCRIBE_HEADER_LEN: usize = 9;
/// Op 7's flag: release the lease instead of acquiring it.
pub const FLAG_RELEASE: u16 = 0x0001;
/// Op 7's fixed bytes: the 14 of CHECK_POLICY's header, the lease id's
/// length, and the item's 7 (cost, key length, name length).
pub const POLICY_LEASE_HEADER_LEN: usize = 22;
/// Bytes of a CHECK_POLICY body before its first item: version, op, id,
/// flags, fail policy, item count, local limit.
pub const POLICY_HEADER_LEN: usize = 14;
/// Bytes of one CHECK_POLICY item before its name and key: cost, key length,
/// name length.
pub const POLICY_ITEM_LEN: usize = 7;
/// Longest policy name. Below 0x20 on purpose: the daemon's stored key of a
/// policy check starts with the name's length byte, a control byte no
/// inline key may hold, so policy windows never share a key with inline
/// ones (docs/POLICIES.md).
pub const MAX_POLICY_NAME_LEN: usize = 31;
/// CHECK flag bits naming the request's algorithm (an `Algorithm` wire
/// value, shifted by `ALGORITHM_SHIFT`); 0 is the log, so a client that
/// sends no flags keeps the seed's behaviour.
pub const ALGORITHM_FLAGS: u16 = 0x0F00;
pub const ALGORITHM_SHIFT: u32 = 8;
/// Bytes in the length prefix.
pub const LEN_PREFIX: usize = 4;
/// Largest body accepted, in bytes. A check with a 512-byte key is 540 bytes;
/// the rest is headroom for several limits in one request.
pub const MAX_FRAME_LEN: usize = 4096;
/// Bytes before the first limit entry: version, op, id, flags, policy, count.
pub const REQUEST_HEADER_LEN: usize = 10;
/// Bytes of one limit entry before its key.
pub const LIMIT_ENTRY_LEN: usize = 18;
/// Bytes of a response body before its message.
pub const RESPONSE_FIXED_LEN: usize = 28;
/// Longest error message sent; longer ones are cut at a char boundary.
pub const MAX_MESSAGE_LEN: usize = 512;

/// The big-endian u32 at `at`; callers check the length first.
#[inline(always)]
pub(super) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The big-endian u16 at `at`; callers check the length first.
#[inline(always)]
pub(super) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Defines a wire enum from rows of `Variant = value => "name"`.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident: $repr:ty {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name {
            $( $(#[$vmeta])* $variant = $value, )+
        }

        impl $name {
            /// Every value, in wire order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            pub const fn from_wire(v: $repr) -> Option<Self> {
                match v {
                    $($value => Some(Self::$variant),)+
                    _ => None,
                }
            }

            pub const fn to_wire(self) -> $repr {
                self as $repr
            }

            /// The name in logs, metrics labels, docs and the Lua client.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }

            pub fn from_name(name: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|v| v.as_str() == name)
            }

            /// Position in `ALL`: an index into per-value arrays (metrics).
            #[inline]
            pub const fn index(self) -> usize {
                let mut i = 0;
                while i < Self::ALL.len() {
                    if Self::ALL[i] as $repr == self as $repr {
                        return i;
                    }
                    i += 1;
                }
                unreachable!()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

wire_enum! {
    /// What to do when the shared store (Redis) cannot decide in time.
    pub enum FailPolicy: u8 {
        /// Allow the request; the response's source is `FailOpen`.
        Open = 0 => "open",
        /// Deny the request; the response's source is `FailClosed`.
        Closed = 1 => "closed",
        /// Decide with a per-host exact sliding window using the request's local quota.
        Local = 2 => "local",
    }
}

impl std::str::FromStr for FailPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::from_name(s).ok_or_else(|| format!("unknown fail policy '{s}' (expected open, closed or local)"))
    }
}

wire_enum! {
    /// The outcome of a check.
    pub enum Decision: u8 {
        Allowed = 0 => "allowed",
        Denied = 1 => "denied",
        Error = 2 => "error",
        /// A shadow policy would have refused: the request is admitted and
        /// nothing was recorded (CHECK_POLICY only).
        ShadowDenied = 3 => "shadow_denied",
        /// A shadow policy had room: the request is admitted, and what the
        /// client is shown never comes from it (CHECK_POLICY and
        /// ACQUIRE_POLICY, and every shadow item of a multi-item check).
        ShadowAllowed = 4 => "shadow_allowed",
    }
}

wire_enum! {
    /// Who made the decision.
    pub enum Source: u8 {
        /// The shared sliding window in Redis.
        Redis = 0 => "redis",
        /// The per-host fallback window (fail policy `local`).
        LocalFallback = 1 => "local",
        /// Redis failed and the request's policy was `open`.
        FailOpen = 2 => "fail_open",
        /// Redis failed and the request's policy was `closed`.
        FailClosed = 3 => "fail_closed",
        /// The per-host windows as the only store (no Redis configured).
        Memory = 4 => "memory",
        /// Refused by the daemon's denial cache: Redis refused the same key,
        /// limit and window at no smaller cost, and cannot admit it yet.
        DenialCache = 5 => "denial_cache",
        /// Admitted by a policy without asking any store: the key is on the
        /// policy's allowlist or its override is `unlimited` (CHECK_POLICY only).
        Exempt = 6 => "exempt",
        /// No decision was made (the request was invalid).
        None = 255 => "none",
    }
}

wire_enum! {
    /// Error codes carried in responses. Ranges: 1-19 the request was
    /// rejected and the stream is still in sync; 20-29 the connection is
    /// closed after the response; 30-49 the daemon could not decide as
    /// asked: with decision allowed/denied the request's fail policy decided
    /// (30-33, 35), with decision error nothing did and the client's own
    /// policy applies (34).
    pub enum ErrorCode: u16 {
        None = 0 => "OK",
        Malformed = 1 => "MALFORMED",
        UnsupportedVersion = 2 => "UNSUPPORTED_VERSION",
        UnknownOp = 3 => "UNKNOWN_OP",
        UnsupportedFlags = 4 => "UNSUPPORTED_FLAGS",
        UnsupportedLimitCount = 5 => "UNSUPPORTED_LIMIT_COUNT",
        InvalidKey = 6 => "INVALID_KEY",
        InvalidLimit = 7 => "INVALID_LIMIT",
        InvalidWindow = 8 => "INVALID_WINDOW",
        InvalidCost = 9 => "INVALID_COST",
        InvalidPolicy = 10 => "INVALID_POLICY",
        InvalidLocalLimit = 11 => "INVALID_LOCAL_LIMIT",
        /// CHECK_POLICY named a policy the daemon's configuration does not
        /// have: a configuration error; the client's fail policy decides.
        UnknownPolicy = 12 => "UNKNOWN_POLICY",
        /// CHECK_POLICY or REFUND named the same policy and key twice.
        DuplicateItem = 13 => "DUPLICATE_ITEM",
        /// A REFUND the store cannot carry out (the in-memory backend keeps
        /// no member ids); nothing was taken back.
        RefundUnsupported = 14 => "REFUND_UNSUPPORTED",
        /// The CHECK's algorithm bits name no algorithm this daemon has.
        UnknownAlgorithm = 16 => "UNKNOWN_ALGORITHM",
        /// ACQUIRE or RELEASE with a lease id empty, too long or with a
        /// control byte, or a lease length outside 1..=max_window_ms.
        InvalidLease = 17 => "INVALID_LEASE",
        /// The policy named is of the other kind: CHECK_POLICY (op 2) of a
        /// concurrency policy, or ACQUIRE_POLICY (op 7) of a rate policy.
        WrongPolicyKind = 18 => "WRONG_POLICY_KIND",
        /// A combination of features the daemon cannot honour at request
        /// time: a policy of another algorithm than log in a multi-item or
        /// refundable check, or in a refund. A decision error: the
        /// client's fail policy applies.
        UnsupportedCombination = 19 => "UNSUPPORTED_COMBINATION",
        FrameTooLarge = 20 => "FRAME_TOO_LARGE",
        RedisTimeout = 30 => "REDIS_TIMEOUT",
        RedisUnavailable = 31 => "REDIS_UNAVAILABLE",
        RedisError = 32 => "REDIS_ERROR",
        CircuitOpen = 33 => "CIRCUIT_OPEN",
        LocalCapacity = 34 => "LOCAL_CAPACITY",
        /// Too many Redis calls in flight (the adaptive limit): refused at
        /// once, Redis not asked; the fail policy decided.
        Overloaded = 35 => "OVERLOADED",
    }
}

wire_enum! {
    /// How a limit counts (docs/ALGORITHMS.md). Sent in a CHECK's flag bits
    /// `ALGORITHM_FLAGS`; set per `[[policy]]` by `algorithm = "..."`.
    pub enum Algorithm: u8 {
        /// The exact sliding log: one ZSET member per admission (the default).
        Log = 0 => "log",
        /// The exact sliding window as a ring of admission times: the log's
        /// decisions at 8 bytes per admission unit.
        Ring = 1 => "ring",
        /// GCRA: a bucket of `limit` tokens refilled at `limit` per window,
        /// one number per key; admitted requests carry their pacing delay.
        Gcra = 2 => "gcra",
        /// The previous fixed window weighted by its overlap plus the
        /// current one: O(1) per key, approximate.
        SlidingCounter = 3 => "sliding_counter",
        /// Fixed windows aligned to multiples of the window since the epoch
        /// (a UTC minute, hour or day): O(1) per key.
        Fixed = 4 => "fixed",
    }
}

wire_enum! {
    /// What a named policy limits (DESCRIBE_POLICY's answer): a rate,
    /// decided by CHECK_POLICY, or concurrent leases, by ACQUIRE_POLICY.
    pub enum PolicyKind: u8 {
        Rate = 0 => "rate",
        Concurrency = 1 => "concurrency",
    }
}

impl Algorithm {
    /// The algorithm named by a CHECK's flags, or the bits that name none.
    pub const fn from_flags(flags: u16) -> Result<Self, u8> {
        let bits = ((flags & ALGORITHM_FLAGS) >> ALGORITHM_SHIFT) as u8;
        match Self::from_wire(bits) {
            Some(a) => Ok(a),
            None => Err(bits),
        }
    }

    /// The CHECK flag bits that name this algorithm.
    pub const fn to_flags(self) -> u16 {
        (self.to_wire() as u16) << ALGORITHM_SHIFT
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::from_name(s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|a| a.as_str()).collect();
            format!("unknown algorithm '{s}' (expected one of: {})", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_conversions_agree() {
        for &e in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_wire(e.to_wire()), Some(e));
            assert_eq!(ErrorCode::from_name(e.as_str()), Some(e));
            assert_eq!(ErrorCode::ALL[e.index()], e);
        }
        for &s in Source::ALL {
            assert_eq!(Source::from_wire(s.to_wire()), Some(s));
            assert_eq!(Source::ALL[s.index()], s);
        }
        assert_eq!(Source::None.to_wire(), 255);
        assert_eq!(ErrorCode::from_wire(15), None);
        assert_eq!("local".parse::<FailPolicy>(), Ok(FailPolicy::Local));
        assert!("nope".parse::<FailPolicy>().unwrap_err().contains("open, closed or local"));
        for &a in Algorithm::ALL {
            assert_eq!(Algorithm::from_flags(a.to_flags() | 0x0003), Ok(a));
        }
        assert_eq!(Algorithm::from_flags(0), Ok(Algorithm::Log));
        assert_eq!(Algorithm::from_flags(0x0F00), Err(15));
        assert!("lgo".parse::<Algorithm>().unwrap_err().contains("log, ring, gcra, sliding_counter, fixed"));
    }
}
