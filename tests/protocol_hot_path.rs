//! The decoder on the request path: a CHECK, a one-item CHECK_POLICY and
//! the worker shares are decoded without an allocation (the key is left
//! where it lies in the frame), frame after frame off one read buffer.
//! Allocations are counted per thread, so the other tests running beside
//! these are not counted.
//!
//! `cargo test --test protocol_hot_path -- --ignored --nocapture` prints
//! the decode's cost per frame (it uses only API that older releases have,
//! so the same file measures them).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use ratelimitd::protocol::{encode_inline_share, encode_lease_share, encode_policy_request, encode_request, parse_request, Bounds, CheckArgs, FailPolicy, Inbound, PolicyCheckArgs, RequestCodec};
use tokio_util::codec::Decoder;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(Cell::get);
    f();
    ALLOCATIONS.with(Cell::get) - before
}

const CHECK: CheckArgs<'static> = CheckArgs { key: b"tenant-42", limit: 100, window_ms: 60_000, cost: 1, on_error: FailPolicy::Local, local_limit: 10 };
const POLICY: PolicyCheckArgs<'static> = PolicyCheckArgs { policy: b"per_tenant", key: b"tenant-42", cost: 1, on_error: FailPolicy::Open, local_limit: 0 };

/// The hot path's frames: a CHECK, a one-item CHECK_POLICY, an inline
/// limit's share and a LEASE_SHARE.
fn hot_frames() -> Vec<BytesMut> {
    let mut out = Vec::new();
    for encode in [
        (|b: &mut BytesMut| encode_request(1, &CHECK, b)) as fn(&mut BytesMut),
        |b| encode_policy_request(2, &POLICY, b),
        |b| encode_inline_share(3, &CheckArgs { cost: 16, ..CHECK }, b),
        |b| encode_lease_share(4, &PolicyCheckArgs { cost: 16, ..POLICY }, b),
    ] {
        let mut b = BytesMut::new();
        encode(&mut b);
        out.push(b);
    }
    out
}

#[test]
fn the_hot_paths_frames_decode_without_an_allocation() {
    let bounds = Bounds::default();
    for mut frame in hot_frames() {
        // As the server's read buffer hands it over: a shared slice of it.
        let body: Bytes = frame.split_off(4).freeze();
        let op = body[1];
        let mut got = None;
        let n = allocations_in(|| got = Some(parse_request(body, &bounds)));
        assert!(matches!(got, Some(Inbound::Request(_))), "{got:?}");
        assert_eq!(n, 0, "allocations decoding op {op}");
    }
}

#[test]
fn frames_off_one_read_buffer_decode_without_an_allocation_each() {
    // 400 frames as one read brings them; the buffer is allocated before.
    let mut buf = BytesMut::with_capacity(64 * 1024);
    for _ in 0..100 {
        for frame in hot_frames() {
            buf.extend_from_slice(&frame);
        }
    }
    let mut codec = RequestCodec::new(Bounds::default());
    let mut decoded = Vec::with_capacity(400);
    let n = allocations_in(|| {
        while let Some(inbound) = codec.decode(&mut buf).unwrap() {
            decoded.push(inbound);
        }
    });
    assert_eq!(decoded.len(), 400);
    assert!(decoded.iter().all(|i| matches!(i, Inbound::Request(_))));
    // The buffer's first split makes it shareable: one allocation for the
    // whole buffer, none per frame.
    assert!(n <= 1, "{n} allocations for 400 frames");
}

/// The decode's cost per frame: framing and validation of each hot frame,
/// best of 5 rounds of 200,000.
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn decode_cost_per_frame() {
    let bounds = Bounds::default();
    for frame in hot_frames() {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let mut stream = BytesMut::with_capacity(frame.len() * 1000);
            let start = Instant::now();
            let mut n = 0u32;
            for _ in 0..200 {
                stream.clear();
                for _ in 0..1000 {
                    stream.extend_from_slice(&frame);
                }
                let mut codec = RequestCodec::new(bounds);
                while let Some(i) = codec.decode(&mut stream).unwrap() {
                    n += u32::from(matches!(i, Inbound::Request(_)));
                }
            }
            assert_eq!(n, 200_000);
            best = best.min(start.elapsed().as_nanos() as f64 / 200_000.0);
        }
        println!("op {} ({} bytes): {best:.1} ns per frame", frame[5], frame.len());
    }
}
