//! Daemons that hold answers back: a demofs that answers nothing until
//! told, or everything but lookups.
use std::io;

use fuse_supervisor_sys::process::Signal;

use super::{Daemon, FuseSource, Restart, Sandbox, SandboxChild, ScenarioError};

/// What a demofs holds unanswered until `SIGUSR1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holding {
    /// Every request, the kernel's INIT first (none is read).
    Everything,
    /// Lookups only, read and kept unanswered; `statfs` and the rest answer.
    Lookups,
    /// Everything after the first this many lookups: a daemon that answers
    /// a probe (`statfs`, a subPath's lookups) and then hangs.
    AfterLookups(u32),
}

impl FuseSource {
    /// Like [`FuseSource::restart`], but the new daemon (a demofs) answers
    /// nothing until [`FuseSource::answer`]: its mount is in place, and every
    /// request to it, the supervisor's probe first, waits.
    pub fn restart_unanswered(&mut self, sandbox: &Sandbox, style: Restart) -> Result<(), ScenarioError> {
        self.restart_holding(sandbox, style, Holding::Everything)
    }

    /// Like [`FuseSource::restart`], but the new daemon (a demofs) answers
    /// `statfs` and the rest while it holds every lookup until
    /// [`FuseSource::answer`]: its root looks alive, and any path resolved
    /// beneath it (a subPath's directory) hangs. Such a caller cannot be
    /// killed meanwhile; [`FuseSource::end_held_lookups`] ends them.
    pub fn restart_holding_lookups(&mut self, sandbox: &Sandbox, style: Restart) -> Result<(), ScenarioError> {
        self.restart_holding(sandbox, style, Holding::Lookups)
    }

    /// Like [`FuseSource::restart`], but the new daemon (a demofs) answers
    /// everything until it has answered `lookups` lookups, and then nothing
    /// until [`FuseSource::answer`]: it passes the supervisor's probe (its
    /// `statfs`, and one lookup per subPath directory) and hangs after.
    /// [`FuseSource::end_held_lookups`] ends its held callers.
    pub fn restart_hanging_after_lookups(
        &mut self,
        sandbox: &Sandbox,
        style: Restart,
        lookups: u32,
    ) -> Result<(), ScenarioError> {
        self.restart_holding(sandbox, style, Holding::AfterLookups(lookups))
    }

    fn restart_holding(&mut self, sandbox: &Sandbox, style: Restart, holding: Holding) -> Result<(), ScenarioError> {
        if self.daemon != Daemon::DemoFs || self.delegation.is_some() {
            return Err(ScenarioError::Io {
                step: format!("restart holding {holding:?}"),
                source: io::Error::other("only a plain demofs can hold its answers"),
            });
        }
        self.next_holds = Some(holding);
        let restarted = self.restart(sandbox, style);
        self.next_holds = None;
        restarted
    }

    /// Has a daemon started by [`FuseSource::restart_unanswered`] or
    /// [`FuseSource::restart_holding_lookups`] answer.
    pub fn answer(&mut self) -> Result<(), ScenarioError> {
        self.signal(Signal::Usr1)?;
        self.holds_lookups = false;
        Ok(())
    }

    /// Replaces the daemon as a restart script that gives up on a stuck
    /// one does: its mount is detached lazily (`umount -l`) and a new
    /// daemon mounts, while the old one is left running. A daemon that
    /// answers nothing (stopped for good, stuck in the kernel) keeps every
    /// request to its old mount waiting; it is killed when the returned
    /// guard is dropped (declare the guard after the node, so that it is
    /// killed before the processes waiting on it are reaped).
    pub fn replace_leaving_the_daemon(&mut self, sandbox: &Sandbox) -> Result<LeftDaemon, ScenarioError> {
        let left = self.take_daemon()?;
        self.restart(sandbox, Restart::UnmountThenMount)?;
        Ok(left)
    }

    /// Like [`FuseSource::replace_leaving_the_daemon`], but the new daemon
    /// answers nothing either (as [`FuseSource::restart_unanswered`]): a
    /// restart script giving up on one stuck daemon after another.
    pub fn replace_with_an_unanswering_one(&mut self, sandbox: &Sandbox) -> Result<LeftDaemon, ScenarioError> {
        let left = self.take_daemon()?;
        self.restart_unanswered(sandbox, Restart::UnmountThenMount)?;
        Ok(left)
    }

    fn take_daemon(&mut self) -> Result<LeftDaemon, ScenarioError> {
        let left = self.process.take().ok_or_else(|| ScenarioError::Io {
            step: "replace the daemon".into(),
            source: io::Error::other("no daemon running"),
        })?;
        Ok(LeftDaemon(left))
    }

    /// Kills a daemon that may still hold lookups: its device closes, the
    /// kernel aborts the connection and every held caller gets an error.
    /// For cleanup before the processes that may be such callers (the
    /// supervisor's probe, a reader) are killed and reaped, which would
    /// otherwise wait for the daemon forever.
    pub fn end_held_lookups(&mut self) -> Result<(), ScenarioError> {
        if self.holds_lookups { self.crash() } else { Ok(()) }
    }
}

/// A daemon left running by [`FuseSource::replace_leaving_the_daemon`],
/// killed on drop.
pub struct LeftDaemon(SandboxChild);

impl Drop for LeftDaemon {
    fn drop(&mut self) {
        if let Err(err) = self.0.kill() {
            eprintln!("cannot kill the left daemon {}: {err}", self.0.pid());
        }
    }
}
