//! The one kill-on-drop guard for every process a test starts.

use std::path::PathBuf;
use std::process::{Child, ChildStderr, Command, ExitStatus};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::wait::{poll, Waited};

/// A child process that is stopped and reaped when dropped, so that a failed
/// assertion never leaves a server holding a port or a socket.
pub struct ChildGuard {
    child: Child,
    name: String,
    log: Option<PathBuf>,
    /// Sent first when stopped (`kill`, drop), with how long to wait before
    /// SIGKILL (nginx: SIGQUIT, so that the master takes its workers down
    /// with it rather than leave them running).
    polite_stop: Option<(Signal, Duration)>,
    exited: Option<ExitStatus>,
}

impl ChildGuard {
    /// Spawns `cmd`. `log` is the file the process writes its log to (read
    /// into panic messages when it dies early or never gets ready).
    pub fn spawn(name: &str, cmd: &mut Command, log: Option<PathBuf>) -> Self {
        let child = cmd.spawn().unwrap_or_else(|e| panic!("{name}: cannot start {:?}: {e} (scripts/test installs what the tests need)", cmd.get_program()));
        Self { child, name: name.to_string(), log, polite_stop: None, exited: None }
    }

    /// When stopping, send `signal` and give the process `grace` to exit before SIGKILL.
    pub fn stop_politely_with(mut self, signal: Signal, grace: Duration) -> Self {
        self.polite_stop = Some((signal, grace));
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status once the process has exited (and been reaped).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            // An error here would mean the child was reaped elsewhere; this
            // runs in Drop too, where a panic would abort the test binary.
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// What the process has logged so far (empty without a log file).
    pub fn log(&self) -> String {
        self.log.as_ref().and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default()
    }

    /// The read end of a piped stderr.
    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.stderr.take()
    }

    /// Sends `sig`; the process must not have been seen to exit.
    pub fn signal(&self, sig: Signal) {
        if let Some(status) = self.exited {
            panic!("{}: cannot send {sig}: exited with {status}\n{}", self.name, self.log());
        }
        kill(Pid::from_raw(self.pid() as i32), sig).unwrap_or_else(|e| panic!("{}: {sig}: {e}", self.name));
    }

    /// Polls `ready` until it holds; panics, with the log, after `limit` or
    /// as soon as the process exits (a dead server will never get ready).
    pub fn wait_until(&mut self, what: &str, limit: Duration, ready: impl FnMut() -> bool) {
        match poll(limit, Some(self), ready) {
            Waited::Ready => {}
            Waited::Exited(status) => panic!("{what}: {} exited with {status} before it was ready\n{}", self.name, self.log()),
            Waited::TimedOut => panic!("{what}: not ready after {limit:?}\n{}", self.log()),
        }
    }

    /// SIGTERM, then waits up to `limit` for the exit; returns its status.
    pub fn terminate(&mut self, limit: Duration) -> ExitStatus {
        self.signal(Signal::SIGTERM);
        if matches!(poll(limit, Some(self), || false), Waited::TimedOut) {
            panic!("{}: still running {limit:?} after SIGTERM\n{}", self.name, self.log());
        }
        self.exited().expect("exited")
    }

    /// Stops the process now, paused or not, and reaps it.
    pub fn kill(&mut self) {
        if self.exited().is_some() {
            return;
        }
        let pid = Pid::from_raw(self.pid() as i32);
        // A process stopped with SIGSTOP does not act on SIGQUIT/SIGTERM
        // until it is continued.
        let _ = kill(pid, Signal::SIGCONT);
        if let Some((sig, grace)) = self.polite_stop {
            let _ = kill(pid, sig);
            if matches!(poll(grace, Some(self), || false), Waited::Exited(_)) {
                return;
            }
        }
        let _ = self.child.kill();
        self.exited = self.child.wait().ok();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}
