//! src/redis/scripts/gcra.lua's settle (issue 33 item 2) against the history it
//! stands for, on a real redis-server, with the script's own clock
//! argument: after every operation of a random trace of checks, reserves
//! and settles, the bucket leaves no more room than replaying what was
//! admitted with each settled reserve charged its actual at its reserve's
//! time (the others their estimate); and exactly as much in the traces
//! that settle each reserve before anything else is charged. The memory
//! backend's twin: src/local_store.rs,
//! `a_gcra_settle_never_leaves_more_room_than_the_actual_charged_at_the_reserve`.

mod common;

use std::time::Instant;

use common::rng::Rng;
use common::RedisServer;

const GCRA: &str = common::scripts::GCRA;
const LIMIT: u32 = 10;
const WINDOW: u64 = 2000;

/// One call of the script: its reply's first field (allowed / matched).
fn call(c: &mut redis::Connection, sha: &str, record: &str, now: u64, mode: &str, cost: u32) -> i64 {
    let reply: Vec<i64> = redis::cmd("EVALSHA").arg(sha).arg(2).arg("g").arg(record).arg(WINDOW).arg(now).arg(mode).arg(LIMIT).arg(cost).query(c).unwrap();
    reply[0]
}

#[test]
fn a_gcra_settle_in_redis_never_leaves_more_room_than_the_actual_charged_at_the_reserve() {
    let redis = RedisServer::start_unix();
    let mut c = redis.conn();
    let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(GCRA).query(&mut c).unwrap();
    let tok = WINDOW as f64 / f64::from(LIMIT);
    let seed0 = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    let (mut settles, mut exact_checked) = (0, 0);
    for trace in 0..60u64 {
        let seed = seed0 ^ trace.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut rng = Rng(seed | 1);
        let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
        let orderly = trace % 3 == 0;
        // The script's clock never runs behind the real one: a key it set
        // to expire when its bucket is full must not expire (in real time)
        // before the script's time says so.
        let started = Instant::now();
        let t0 = 1_000_000u64;
        let mut now = t0;
        let mut admitted: Vec<(u64, Result<u32, usize>)> = Vec::new();
        let mut reserves: Vec<(u32, Option<u32>, u64)> = Vec::new();
        let mut open: Vec<usize> = Vec::new();
        let (mut charges, mut exact) = (0u64, true);
        for _ in 0..60 {
            now = (now + rng.below(500)).max(t0 + started.elapsed().as_millis() as u64 + 1);
            let op = if orderly && !open.is_empty() { 2 } else { rng.below(3) };
            match op {
                0 => {
                    let cost = 1 + rng.below(3) as u32;
                    if call(&mut c, &sha, "unused", now, "m", cost) == 1 {
                        admitted.push((now, Ok(cost)));
                        charges += 1;
                    }
                }
                1 => {
                    let est = 1 + rng.below(6) as u32;
                    let id = reserves.len();
                    if call(&mut c, &sha, &format!("g:settle:{id}"), now, "r", est) == 1 {
                        charges += 1;
                        admitted.push((now, Err(id)));
                        reserves.push((est, None, charges));
                        open.push(id);
                    }
                }
                _ if !open.is_empty() => {
                    let id = open.swap_remove(rng.below(open.len() as u64) as usize);
                    let est = reserves[id].0;
                    let actual = rng.below(u64::from(2 * est) + 1) as u32;
                    let stored: Option<String> = redis::cmd("GET").arg("g").query(&mut c).unwrap();
                    let drained = stored.is_none_or(|s| s.split(' ').next().unwrap().parse::<f64>().unwrap() < now as f64);
                    exact &= reserves[id].2 == charges && !(actual > est && drained);
                    if actual > est {
                        charges += 1;
                    }
                    assert_eq!(call(&mut c, &sha, &format!("g:settle:{id}"), now, "s", actual), 1, "its record");
                    reserves[id].1 = Some(actual);
                    settles += 1;
                }
                _ => {}
            }
            let history = admitted.iter().fold(0.0f64, |tat, &(t, what)| {
                let cost = match what {
                    Ok(c) => c,
                    Err(id) => reserves[id].1.unwrap_or(reserves[id].0),
                };
                tat.max(t as f64) + f64::from(cost) * tok
            });
            let stored: Option<String> = redis::cmd("GET").arg("g").query(&mut c).unwrap();
            let real = stored.map_or(0.0, |s| s.split(' ').next().unwrap().parse::<f64>().unwrap());
            let (real, history) = (real.max(now as f64), history.max(now as f64));
            assert!(real >= history - 1e-6, "seed {seed} at {now}: the bucket full at {real}, the history's at {history}: more room");
            if exact {
                assert!((real - history).abs() < 1e-6, "seed {seed} at {now}: {real} where the history has {history}");
                exact_checked += 1;
            }
        }
    }
    assert!(settles > 500 && exact_checked > 500, "{settles} settles, {exact_checked} steps checked exact");
    eprintln!("{settles} settles; no step left more room than the history; {exact_checked} steps exactly the history's");
}
