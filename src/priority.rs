//! The CPU priority of the heal path.
//!
//! A heal competes for the CPU with the very containers it heals (they read
//! again as soon as the stacks are in place, while the stale layers are
//! still being removed) and with the new FUSE daemon serving them. On a
//! busy node a normal-priority heal of 100 targets took twice as long as on
//! an idle one; at `SCHED_FIFO` it takes little more (numbers in the
//! README). The threads that do nothing but heal run real-time for good:
//! the flatten helpers, the probes, and the watcher's wake-up of the loop.
//! The loop itself is raised only from the moment a heal is due until it is
//! done ([`LoopPriority`]): between heals it scans tables of any size, and a
//! storm of mount changes must not take a CPU from the kubelet making them.
use std::sync::atomic::{AtomicBool, Ordering};

use fuse_supervisor_sys::process;
use tracing::{debug, warn};

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

    /// Raises the calling thread; without the privilege (no
    /// `CAP_SYS_NICE`, or a cgroup without a real-time budget) heals run at
    /// the normal priority, and the first refusal is logged.
    pub fn raise(self) -> bool {
        let Some(priority) = self.0 else { return false };
        match process::set_thread_realtime(Some(priority)) {
            Ok(()) => true,
            Err(err) => {
                if !REFUSED.swap(true, Ordering::Relaxed) {
                    warn!(%err, priority, "cannot run heals at SCHED_FIFO; they run at the normal priority");
                }
                false
            }
        }
    }

    /// Back to the normal policy.
    fn lower(self) {
        if let Err(err) = process::set_thread_realtime(None) {
            debug!(%err, "cannot return to the normal scheduling policy");
        }
    }
}

/// The loop thread's priority: raised while a heal is due or under way.
#[derive(Debug)]
pub struct LoopPriority {
    priority: HealPriority,
    raised: bool,
}

impl LoopPriority {
    pub fn new(priority: HealPriority) -> Self {
        LoopPriority { priority, raised: false }
    }

    /// A heal is due: one syscall the first time, none after (none when off).
    pub fn raise(&mut self) {
        if !self.raised {
            self.raised = self.priority.raise();
        }
    }

    /// No heal is due any more.
    pub fn lower(&mut self) {
        if std::mem::take(&mut self.raised) {
            self.priority.lower();
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

    /// The tests run as root, so the raise is granted.
    #[test]
    fn the_loop_is_raised_for_a_heal_and_lowered_after() {
        std::thread::spawn(|| {
            let mut priority = LoopPriority::new(HealPriority::realtime(1));
            priority.raise();
            assert!(priority.is_raised());
            assert_eq!(fifo(), Some(1));
            priority.raise();
            priority.lower();
            assert!(!priority.is_raised());
            assert_eq!(fifo(), None);
            let mut off = LoopPriority::new(HealPriority::OFF);
            off.raise();
            assert!(!off.is_raised());
            assert_eq!(fifo(), None);
        })
        .join()
        .unwrap();
    }
}
