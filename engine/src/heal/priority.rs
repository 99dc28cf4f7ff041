//! The CPU priority of the heal path.
//!
//! A heal competes for the CPU with the very containers it heals (they read
//! again as soon as the stacks are in place, while the stale layers are
//! still being removed) and with the new FUSE daemon serving them. On a
//! busy node a normal-priority heal of 100 targets took twice as long as on
//! an idle one; at `SCHED_FIFO` it takes little more (numbers in
//! docs/reliability.md, "Heal latency"). The threads that do nothing but
//! heal run real-time for good: the flatten helpers, the probes, and the watcher's wake-up of the loop.
//! The loop itself is raised only from the moment a heal is due until it is
//! done ([`HealWindow`]; lowered while it reports a heal, which nobody
//! waits for), or while one is expected (a daemon's death was
//! seen, for at most the 30 s its stale layers are held): between heals it
//! scans tables of any size, and a storm of mount changes must not take a
//! CPU from the kubelet making them.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use crate::errors::chain;
use fuse_supervisor_sys::process;
use tracing::{debug, warn};

/// The nice value of background work (the namespace keeper, the daemons'
/// discovery). Not 19: beside one busy nice-0 process per CPU, nice 19
/// (weight 15 against 1,024) got ~1.4 % of a CPU, and a keeper reading a
/// large table or a discovery walking `/proc` at a death took over a
/// minute; nice 10 (weight 110) gets ~10 %, still well behind any process
/// at the normal priority. Heals do not wait for it: they hold background
/// work off while they run ([`HealActivity`]).
pub const BACKGROUND_NICE: i32 = 10;

/// `SCHED_FIFO` priority of the heal path; off for the normal policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HealPriority(Option<u8>);

/// Warned once: every heal thread would fail the same way.
static REFUSED: AtomicBool = AtomicBool::new(false);

impl HealPriority {
    pub const OFF: HealPriority = HealPriority(None);

    /// `SCHED_FIFO` at `priority` (1-99); 0 is off.
    pub fn realtime(priority: u8) -> Self {
        HealPriority((priority > 0).then_some(priority.min(99)))
    }

    pub fn is_off(self) -> bool {
        self.0.is_none()
    }

    /// The `SCHED_FIFO` priority; None when off.
    pub fn value(self) -> Option<u8> {
        self.0
    }

    /// Lowers the calling thread to the background priority
    /// ([`BACKGROUND_NICE`]), for work that yields the CPU to heals and to
    /// other processes but must still end on a busy node.
    pub fn lower_this_thread() -> std::io::Result<()> {
        process::set_thread_nice(BACKGROUND_NICE)
    }

    /// Raises the calling thread; without the privilege (no
    /// `CAP_SYS_NICE`, or a cgroup without a real-time budget) heals run at
    /// the normal priority, and the first refusal is logged.
    pub fn raise(self) -> bool {
        let Some(priority) = self.0 else { return false };
        match process::set_thread_realtime(Some(priority)) {
            Ok(()) => true,
            Err(err) => {
                if !REFUSED.swap(true, Ordering::Relaxed) {
                    warn!(err = %chain(&err), priority, "cannot run heals at SCHED_FIFO; they run at the normal priority");
                }
                false
            }
        }
    }

    /// Back to the normal policy; whether the thread is there now.
    fn lower(self) -> bool {
        match process::set_thread_realtime(None) {
            Ok(()) => true,
            Err(err) => {
                debug!(err = %chain(&err), "cannot return to the normal scheduling policy");
                false
            }
        }
    }
}

/// How many mounts of other namespaces' tables a thread reads at the
/// real-time priority it is at, at most, before it reads on at the normal
/// policy ([`RealtimeReads`]; a mountinfo line counts a mount per KiB):
/// a node's containers hold a few dozen mounts each (100 of them about
/// 3,000), read at once; a tenant's table is as big as it makes it, and
/// 6,000 binds at 29 KB mount points were 140 ms of a CPU to list, 2.3 s
/// to read as mountinfo, which at `SCHED_FIFO` kept the kernel's own
/// threads (its workqueues, RCU's grace periods) off that CPU.
pub const REALTIME_READ_MOUNTS: usize = 4096;

/// The reads of other namespaces' tables by a thread that may be raised
/// (the loop, searching at a death): the first [`REALTIME_READ_MOUNTS`]
/// mounts are read at its priority, the rest at the normal policy, and the
/// thread is raised again when this is dropped.
#[derive(Debug)]
pub struct RealtimeReads {
    /// The thread's `SCHED_FIFO` priority when this was made.
    raised: Option<u8>,
    left: usize,
    lowered: bool,
}

impl RealtimeReads {
    pub fn of_this_thread() -> Self {
        Self::with_budget(REALTIME_READ_MOUNTS)
    }

    fn with_budget(left: usize) -> Self {
        RealtimeReads { raised: process::thread_fifo_priority().ok().flatten(), left, lowered: false }
    }

    /// `mounts` more were listed: past the budget, a raised thread goes to
    /// the normal policy.
    pub fn listed(&mut self, mounts: usize) {
        self.left = self.left.saturating_sub(mounts);
        if self.left > 0 || self.lowered || self.raised.is_none() {
            return;
        }
        if HealPriority(self.raised).lower() {
            self.lowered = true;
            debug!(
                mounts = REALTIME_READ_MOUNTS,
                "past its share of other namespaces' mounts read at the heal priority: the rest at the normal one"
            );
        }
    }
}

impl Drop for RealtimeReads {
    fn drop(&mut self) {
        if self.lowered {
            HealPriority(self.raised).raise();
        }
    }
}

/// Whether a heal is under way, for background work that must not run
/// beside one. Its CPU time is the least of it: a walk of `/proc` spends
/// long stretches in the kernel, where it neither yields the CPU to a
/// waking heal thread at once nor lets an expedited RCU grace period (one
/// per stale layer removed) end until it leaves them. Discovering the new
/// daemon beside the heal of its 100 targets put that heal's p99 at
/// 9.4-12.1 ms (8.0-9.0 ms waiting).
#[derive(Debug, Default)]
pub struct HealActivity {
    under_way: AtomicBool,
    lock: Mutex<()>,
    over: Condvar,
}

impl HealActivity {
    fn set(&self, under_way: bool) {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.under_way.store(under_way, Ordering::Release);
        if !under_way {
            self.over.notify_all();
        }
    }

    pub fn is_under_way(&self) -> bool {
        self.under_way.load(Ordering::Acquire)
    }

    /// Returns once no heal is under way: at once when none is (one atomic
    /// load, cheap enough between any two steps of a long walk). A heal's
    /// window ends when no probe is due, so at the latest after
    /// `--probe-timeout` when a stopped daemon never answers.
    pub fn wait_until_quiet(&self) {
        if !self.is_under_way() {
            return;
        }
        let guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let _guard = self
            .over
            .wait_while(guard, |()| self.under_way.load(Ordering::Acquire))
            .unwrap_or_else(PoisonError::into_inner);
    }
}

/// From the moment a heal is due (its probe starts) until no heal is: the
/// loop runs at the heal priority, and background work holds off
/// ([`HealActivity`]). While a heal is only expected, the loop stays raised
/// and background work goes on.
#[derive(Debug)]
pub struct HealWindow {
    priority: HealPriority,
    /// Open while it says a heal is under way (the window alone sets it).
    activity: Arc<HealActivity>,
    raised: bool,
}

impl HealWindow {
    pub fn new(priority: HealPriority, activity: Arc<HealActivity>) -> Self {
        HealWindow { priority, activity, raised: false }
    }

    /// A heal is due: a few syscalls the first time, none after.
    pub fn open(&mut self) {
        if !self.activity.is_under_way() {
            self.activity.set(true);
            self.raise();
        }
    }

    /// No heal is due any more. While one is `expected` any moment (a
    /// daemon died; its new mount will need a heal) the loop stays raised,
    /// so that the heal does not start by waiting for a CPU: among 100 busy
    /// containers, a new mount's probe started 3.1-7.3 ms (p99 of 200; up
    /// to 14.5 ms) after the loop first saw the mount at the normal
    /// priority, and 1.8-2.3 ms raised.
    pub fn close(&mut self, expected: bool) {
        if self.activity.is_under_way() {
            self.activity.set(false);
        }
        if expected {
            self.raise();
        } else if std::mem::take(&mut self.raised) {
            self.priority.lower();
        }
    }

    /// A heal will be due (a daemon died): the loop is raised already for
    /// the work it does ahead of it, such as isolating the containers'
    /// dead mounts, which at the normal priority among 100 busy containers
    /// took hundreds of milliseconds.
    pub fn expect(&mut self) {
        self.raise();
    }

    /// The heal is done; telling of it (log lines, metrics, Events) is
    /// left, which nobody waits for, while the new daemon is answering its
    /// readers' first requests: the loop reports at the normal priority,
    /// not on a CPU the daemon cannot take. Whether it was lowered, for
    /// [`Self::raise_after_reports`]; the heal stays under way meanwhile.
    pub fn lower_for_reports(&mut self) -> bool {
        if !std::mem::take(&mut self.raised) {
            return false;
        }
        self.priority.lower();
        true
    }

    /// Back to the heal priority after the reports, if
    /// [`Self::lower_for_reports`] lowered the loop: the rest of its turn
    /// may heal another source.
    pub fn raise_after_reports(&mut self, lowered: bool) {
        if lowered {
            self.raise();
        }
    }

    fn raise(&mut self) {
        if !self.raised {
            self.raised = self.priority.raise();
        }
    }

    pub fn is_raised(&self) -> bool {
        self.raised
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fifo() -> Option<u8> {
        process::thread_fifo_priority().unwrap()
    }

    #[test]
    fn zero_is_off_and_priorities_stop_at_99() {
        assert!(HealPriority::realtime(0).is_off());
        assert_eq!(HealPriority::realtime(200), HealPriority(Some(99)));
        assert!(!HealPriority::OFF.raise());
    }

    /// A raised thread reads its budget's mounts raised, the rest at the
    /// normal policy, and is raised again once done; one at the normal
    /// policy is left there.
    #[test]
    fn reads_past_the_budget_are_made_at_the_normal_policy() {
        std::thread::spawn(|| {
            assert!(HealPriority::realtime(3).raise());
            {
                let mut reads = RealtimeReads::with_budget(1000);
                reads.listed(512);
                assert_eq!(fifo(), Some(3), "within the budget");
                reads.listed(512);
                assert_eq!(fifo(), None, "past it");
                reads.listed(512);
                assert_eq!(fifo(), None);
            }
            assert_eq!(fifo(), Some(3), "raised again after the reads");
            {
                let mut reads = RealtimeReads::with_budget(1000);
                reads.listed(10);
            }
            assert_eq!(fifo(), Some(3), "a small read changes nothing");
            HealPriority::realtime(3).lower();
            {
                let mut reads = RealtimeReads::with_budget(1);
                reads.listed(512);
            }
            assert_eq!(fifo(), None, "never raised: left at the normal policy");
        })
        .join()
        .unwrap();
    }

    /// The tests run as root, so the raise is granted.
    #[test]
    fn the_loop_is_raised_for_a_heal_and_lowered_after() {
        std::thread::spawn(|| {
            let activity = Arc::new(HealActivity::default());
            let mut window = HealWindow::new(HealPriority::realtime(1), Arc::clone(&activity));
            window.open();
            assert!(window.is_raised());
            assert!(activity.is_under_way());
            assert_eq!(fifo(), Some(1));
            window.open();
            window.close(true);
            assert!(window.is_raised(), "raised while a heal is expected");
            assert!(!activity.is_under_way(), "background work goes on meanwhile");
            assert_eq!(fifo(), Some(1));
            window.close(false);
            assert!(!window.is_raised());
            assert!(!activity.is_under_way());
            assert_eq!(fifo(), None);
            window.close(true);
            assert_eq!(fifo(), Some(1), "an expected heal raises a lowered loop");
            window.close(false);
            assert_eq!(fifo(), None);
            window.open();
            assert!(window.lower_for_reports());
            assert_eq!(fifo(), None, "reports at the normal priority");
            assert!(activity.is_under_way(), "the heal is still under way while it is reported");
            window.raise_after_reports(true);
            assert_eq!(fifo(), Some(1), "raised again for the rest of the turn");
            window.close(false);
            assert!(!window.lower_for_reports(), "nothing to lower");
            window.raise_after_reports(false);
            assert_eq!(fifo(), None);
            let mut off = HealWindow::new(HealPriority::OFF, Arc::clone(&activity));
            off.open();
            assert!(!off.is_raised());
            assert!(activity.is_under_way(), "background work holds off at any priority");
            assert_eq!(fifo(), None);
            off.close(false);
        })
        .join()
        .unwrap();
    }

    /// Only the calling thread is lowered; the field after the priority in
    /// `/proc/thread-self/stat` is its nice value.
    #[test]
    fn background_threads_are_lowered_alone() {
        fn nice() -> i32 {
            let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
            let after_command = &stat[stat.rfind(')').unwrap() + 2..];
            after_command.split(' ').nth(16).unwrap().parse().unwrap()
        }
        let before = nice();
        let lowered = std::thread::spawn(|| {
            HealPriority::lower_this_thread().unwrap();
            nice()
        });
        assert_eq!(lowered.join().unwrap(), BACKGROUND_NICE);
        assert_eq!(nice(), before);
    }

    #[test]
    fn background_work_waits_until_the_heal_window_closes() {
        let activity = Arc::new(HealActivity::default());
        activity.wait_until_quiet();
        let mut window = HealWindow::new(HealPriority::OFF, Arc::clone(&activity));
        window.open();
        let (resumed, waiting) = std::sync::mpsc::channel();
        let background = {
            let activity = Arc::clone(&activity);
            std::thread::spawn(move || {
                activity.wait_until_quiet();
                resumed.send(()).unwrap();
            })
        };
        assert!(
            waiting.recv_timeout(std::time::Duration::from_millis(100)).is_err(),
            "background work ran during a heal"
        );
        window.close(false);
        waiting.recv_timeout(std::time::Duration::from_secs(10)).expect("background work resumes after the heal");
        background.join().unwrap();
    }
}
