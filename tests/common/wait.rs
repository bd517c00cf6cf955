//! Waiting with a deadline: the one polling loop of the tests.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use super::process::ChildGuard;

/// How often a condition is polled: short against the deadlines the tests
/// measure, long enough not to compete with the processes under test for
/// the CPU.
pub const POLL_EVERY: Duration = Duration::from_millis(10);

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    Ready,
    /// The watched process died first: the condition can no longer come true.
    Exited(ExitStatus),
    TimedOut,
}

/// Polls `ready` until it holds, `child` has exited, or `limit` has passed.
/// For callers that handle each outcome (a server that exited because its
/// port was taken is retried on another port); see `wait_until` and
/// `ChildGuard::wait_until` for the panicking forms.
pub fn poll(limit: Duration, mut child: Option<&mut ChildGuard>, mut ready: impl FnMut() -> bool) -> Waited {
    let start = Instant::now();
    loop {
        if ready() {
            return Waited::Ready;
        }
        if let Some(status) = child.as_deref_mut().and_then(ChildGuard::exited) {
            return Waited::Exited(status);
        }
        if start.elapsed() >= limit {
            return Waited::TimedOut;
        }
        std::thread::sleep(POLL_EVERY);
    }
}

/// Polls `ready` until it holds; panics after `limit`. When the condition
/// depends on a process the test started, use `ChildGuard::wait_until`,
/// which also fails at once, with the log, if that process exits.
pub fn wait_until(what: &str, limit: Duration, ready: impl FnMut() -> bool) {
    if poll(limit, None, ready) != Waited::Ready {
        panic!("{what}: not true after {limit:?}");
    }
}

/// The deadline of a retry loop written out in an async test body, where
/// each try awaits the daemon and its result is asserted on, which a
/// `wait_until` closure cannot do.
pub struct Deadline {
    what: String,
    start: Instant,
    limit: Duration,
}

impl Deadline {
    pub fn start(what: impl Into<String>, limit: Duration) -> Self {
        Self { what: what.into(), start: Instant::now(), limit }
    }

    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Between two tries: panics with `why` once the limit has passed,
    /// otherwise sleeps `every` (without blocking the runtime).
    pub async fn retry_in<D: std::fmt::Display>(&self, every: Duration, why: impl FnOnce() -> D) {
        if self.start.elapsed() >= self.limit {
            panic!("{}: not within {:?}: {}", self.what, self.limit, why());
        }
        tokio::time::sleep(every).await;
    }
}
