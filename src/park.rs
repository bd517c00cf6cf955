//! A background task that sleeps with the daemon: it parks when it has
//! nothing left to do, and the path that gives it work again wakes it. An
//! idle daemon is then charged no CPU at all: no timer fires while nothing
//! comes (tests/idle_daemon.rs).
//!
//! The task marks itself parked *before* its last look at its state, and
//! the work path looks at the mark *after* adding its work, both under the
//! lock that guards that state: either the task's look sees the work, or
//! the work path sees the mark and wakes it (the wake is kept as a permit
//! when the task is not yet waiting). Nothing is lost between the two.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct Parking {
    parked: AtomicBool,
    wake: Notify,
}

impl Parking {
    pub const fn new() -> Self {
        Self { parked: AtomicBool::new(false), wake: Notify::const_new() }
    }

    /// Called after adding work, the guarding lock released or not: one
    /// relaxed load while the task runs, a wake-up only when it is parked.
    #[inline]
    pub fn work_arrived(&self) {
        if self.parked.load(Ordering::Relaxed) {
            self.wake_up();
        }
    }

    #[cold]
    fn wake_up(&self) {
        if self.parked.swap(false, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// The task is about to look at its state for the last time before
    /// parking (see the module's comment for the order).
    pub fn about_to_park(&self) {
        self.parked.store(true, Ordering::SeqCst);
    }

    /// The last look found work: the task goes on running.
    pub fn stay_awake(&self) {
        self.parked.store(false, Ordering::Relaxed);
    }

    /// Waits until work arrives (at once if it arrived since
    /// `about_to_park`).
    pub async fn parked(&self) {
        self.wake.notified().await;
    }
}

