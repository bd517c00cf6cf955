//! Which policies a reserve and its settle (docs/PROTOCOL.md 4f) can name:
//! the one rule the daemon applies at request time (decision::resolve,
//! `UNSUPPORTED_COMBINATION`) and `check-config --nginx` applies to the
//! limiters an nginx configuration builds with `settle = true`.

use crate::protocol::Algorithm;

/// Why a rate policy of `algorithm` with `shards` cannot be reserved and
/// settled exactly; `None` when it can.
pub fn reserve_refusal(algorithm: Algorithm, shards: u32) -> Option<&'static str> {
    if matches!(algorithm, Algorithm::Log | Algorithm::Ring) {
        return Some("the log keeps one Redis member per unit, so a settle would write or remove up to 10^9 of them: reserve and settle need algorithm gcra, sliding_counter or fixed");
    }
    if shards > 1 {
        return Some("a sharded key does not know which shard holds the reserve: reserve and settle need an unsharded policy");
    }
    None
}

/// Why a policy cannot be an item of a multi-item or refundable check
/// (several policies in one request all or nothing, a refundable admission,
/// its refund), or None: the request would get UNSUPPORTED_COMBINATION.
/// The daemon's rule at request time (src/decision/resolve.rs) and
/// `check-config --nginx`'s.
pub fn multi_refusal(algorithm: Algorithm, penalty: bool) -> Option<&'static str> {
    if algorithm != Algorithm::Log {
        return Some("several policies in one request, refundable checks and refunds need algorithm log");
    }
    if penalty {
        return Some("a penalty box is checked alone, not with other policies in one request, refundable or refunded");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_log_policies_without_a_penalty_box_can_be_items_of_several() {
        assert_eq!(multi_refusal(Algorithm::Log, false), None);
        assert!(multi_refusal(Algorithm::Log, true).is_some_and(|w| w.contains("penalty box")));
        for a in [Algorithm::Gcra, Algorithm::Fixed, Algorithm::SlidingCounter, Algorithm::Ring] {
            assert!(multi_refusal(a, false).is_some_and(|w| w.contains("need algorithm log")));
        }
    }

    #[test]
    fn only_unsharded_o1_policies_can_be_reserved() {
        for a in [Algorithm::Gcra, Algorithm::Fixed, Algorithm::SlidingCounter] {
            assert_eq!(reserve_refusal(a, 1), None);
            assert!(reserve_refusal(a, 2).is_some_and(|w| w.contains("shard")));
        }
        for a in [Algorithm::Log, Algorithm::Ring] {
            assert!(reserve_refusal(a, 1).is_some_and(|w| w.contains("member per unit")));
        }
    }
}
