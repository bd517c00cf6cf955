//! The vocabulary every store shares: what to check (`LimitSpec`), what a
//! store answers (`Verdict`), and why a shared store could not answer
//! (`StoreError`). It imports nothing of this crate, so every layer can use
//! it and none has to reach upwards for it.

use std::time::Duration;

/// One limit to check, borrowed from the request.
#[derive(Clone, Copy, Debug)]
pub struct LimitSpec<'a> {
    pub key: &'a [u8],
    pub limit: u32,
    pub window_ms: u32,
    pub cost: u32,
}

/// A store's answer for one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Verdict {
    pub allowed: bool,
    /// Admissions in the window after this request.
    pub count: u32,
    pub remaining: u32,
    /// 0 when allowed; else ms until a retry of the same cost can pass.
    pub retry_after_ms: u32,
    /// ms until the window holds no admissions.
    pub reset_ms: u32,
}

impl Verdict {
    /// The verdict as answered under `limit`, the limit in force: a window
    /// that holds more (counted under a larger limit before an override or
    /// a reload lowered it) reports `count` = `limit`, so that `count +
    /// remaining` is the limit in force whatever the window holds, which is
    /// how clients learn it (docs/PROTOCOL.md section 7).
    #[inline]
    pub fn under(self, limit: u32) -> Self {
        Self { count: self.count.min(limit), ..self }
    }
}

/// Why the shared store could not decide.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis is unavailable: {0}")]
    Unavailable(String),
    #[error("redis error: {0}")]
    Redis(String),
    #[error("circuit open: redis is down or too slow; waiting for a probe to succeed")]
    CircuitOpen,
    /// Refused before reaching Redis: the calls in flight were at the
    /// adaptive limit (the value given), so this one could not meet its
    /// deadline. Not a failure of Redis.
    #[error("overloaded: {0} redis calls in flight, the adaptive limit; decided at once by the fail policy")]
    Overloaded(u32),
}

/// A `fixed` window's `window_ms` when its windows are calendar months or
/// are aligned to a UTC offset (docs/ALGORITHMS.md, `fixed`): a value above
/// any valid duration (30 days at most), so it never names a plain window.
/// `CALENDAR + (minutes << 12) + (offset_minutes + 2048)`, with `minutes`
/// the window's length (0: a calendar month) and the offset within ±14:00.
/// src/redis/scripts/fixed_window.lua decodes it the same way.
pub const CALENDAR: u32 = 0xC000_0000;

/// The `window_ms` of a fixed window of `minutes` (0: a calendar month)
/// aligned to `offset_minutes` east of UTC; a plain length when that is
/// the same thing (whole minutes at offset 0).
pub fn calendar_window_ms(minutes: u32, offset_minutes: i32) -> u32 {
    debug_assert!(minutes < 1 << 18 && offset_minutes.abs() <= 14 * 60);
    if minutes > 0 && offset_minutes == 0 {
        return minutes * 60_000;
    }
    CALENDAR + (minutes << 12) + (offset_minutes + 2048) as u32
}

/// The fixed window holding `wall_ms` (ms since the Unix epoch): its start
/// and its end, for a plain `window_ms` (aligned to multiples of it since
/// the epoch) or a `CALENDAR` one.
pub fn fixed_bounds(window_ms: u32, wall_ms: u64) -> (u64, u64) {
    const DAY: i64 = 86_400_000;
    if window_ms < CALENDAR {
        let w = u64::from(window_ms);
        let start = wall_ms - wall_ms % w;
        return (start, start + w);
    }
    let code = window_ms - CALENDAR;
    let (minutes, offset) = (i64::from(code >> 12), (i64::from(code & 0xFFF) - 2048) * 60_000);
    let local = wall_ms as i64 + offset;
    let (start, end) = if minutes > 0 {
        let w = minutes * 60_000;
        let start = local - local.rem_euclid(w);
        (start, start + w)
    } else {
        let (y, m, _) = civil_from_days(local.div_euclid(DAY));
        let next = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
        (days_from_civil(y, m, 1) * DAY, days_from_civil(next.0, next.1, 1) * DAY)
    };
    ((start - offset).max(0) as u64, (end - offset) as u64)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day since 1970-01-01 (Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
}

/// A window's length for what reports one (a fallback's retry-after): a
/// calendar month counts as 31 days.
pub fn nominal_window_ms(window_ms: u32) -> u32 {
    if window_ms < CALENDAR {
        return window_ms;
    }
    match (window_ms - CALENDAR) >> 12 {
        0 => 31 * 86_400_000,
        minutes => minutes * 60_000,
    }
}

#[cfg(test)]
mod calendar_tests {
    use super::*;

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        for z in (-800_000..800_000).step_by(7) {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
    }

    #[test]
    fn months_and_offsets_bound_the_window() {
        let day = 86_400_000u64;
        let at = |y, m, d| days_from_civil(y, m, d) as u64 * day;
        let month = calendar_window_ms(0, 0);
        // 2024-02-29 12:00 UTC: February of a leap year.
        assert_eq!(fixed_bounds(month, at(2024, 2, 29) + day / 2), (at(2024, 2, 1), at(2024, 3, 1)));
        assert_eq!(fixed_bounds(month, at(2026, 12, 31) + day - 1), (at(2026, 12, 1), at(2027, 1, 1)));
        assert_eq!(fixed_bounds(month, at(2027, 1, 1)), (at(2027, 1, 1), at(2027, 2, 1)));
        // UTC+02:00: the month starts at 22:00 UTC the day before.
        let plus2 = calendar_window_ms(0, 120);
        let h = 3_600_000;
        assert_eq!(fixed_bounds(plus2, at(2026, 4, 30) + 22 * h), (at(2026, 4, 30) + 22 * h, at(2026, 5, 31) + 22 * h));
        assert_eq!(fixed_bounds(plus2, at(2026, 4, 30) + 22 * h - 1), (at(2026, 3, 31) + 22 * h, at(2026, 4, 30) + 22 * h));
        // A day at UTC-05:00 runs 05:00..05:00 UTC; at offset 0 it is plain.
        let minus5 = calendar_window_ms(1440, -300);
        assert_eq!(fixed_bounds(minus5, at(2026, 1, 2) + 3 * h), (at(2026, 1, 1) + 5 * h, at(2026, 1, 2) + 5 * h));
        assert_eq!(calendar_window_ms(1440, 0), 86_400_000);
        assert_eq!((nominal_window_ms(month), nominal_window_ms(minus5), nominal_window_ms(1000)), (31 * 86_400_000, 86_400_000, 1000));
    }
}
