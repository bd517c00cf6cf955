//! RFC 3339 times in UTC ("2026-12-06T09:00:00Z"), to and from Unix ms:
//! the only form the admin API reads and writes expiries in.

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// days_from_civil).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Parses "YYYY-MM-DDTHH:MM:SSZ" (or "+00:00"; fractions of a second are
/// not accepted) to Unix ms.
pub fn parse_utc(s: &str) -> Result<u64, String> {
    let bad = || format!("'{s}' is not a UTC time such as \"2026-12-06T09:00:00Z\"");
    let body = s.strip_suffix('Z').or_else(|| s.strip_suffix("+00:00")).ok_or_else(bad)?;
    let b = body.as_bytes();
    if b.len() != 19 || b[4] != b'-' || b[7] != b'-' || !(b[10] == b'T' || b[10] == b' ') || b[13] != b':' || b[16] != b':' {
        return Err(bad());
    }
    let num = |r: std::ops::Range<usize>| body.get(r).filter(|t| t.bytes().all(|c| c.is_ascii_digit())).and_then(|t| t.parse::<i64>().ok()).ok_or_else(bad);
    let (y, mo, d, h, mi, se) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1970..=9999).contains(&y) || !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 59 {
        return Err(bad());
    }
    let days = days_from_civil(y, mo, d);
    if civil_from_days(days) != (y, mo, d) {
        return Err(format!("'{s}': no such day"));
    }
    Ok(((days * 86_400 + h * 3600 + mi * 60 + se) * 1000) as u64)
}

/// Formats Unix ms as "YYYY-MM-DDTHH:MM:SS.mmmZ".
pub fn format_utc(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z", t / 3600, t / 60 % 60, t % 60, ms % 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_times_parse_and_format_round_trip() {
        assert_eq!(parse_utc("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(parse_utc("2026-12-06T09:00:00Z"), Ok(1_796_547_600_000));
        assert_eq!(format_utc(1_796_547_600_123), "2026-12-06T09:00:00.123Z");
        assert_eq!(parse_utc("2024-02-29T12:00:00+00:00").map(format_utc), Ok("2024-02-29T12:00:00.000Z".into()));
    }

    #[test]
    fn malformed_or_impossible_times_are_refused() {
        for bad in ["", "2026-12-06", "2026-12-06T09:00:00", "2026-12-06T09:00:00+01:00", "2026-13-01T00:00:00Z", "2026-02-30T00:00:00Z", "2026-12-06T24:00:00Z", "２026-12-06T09:00:00Z"] {
            assert!(parse_utc(bad).is_err(), "{bad}");
        }
    }
}
