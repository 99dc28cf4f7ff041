//! Named points on the heal path where a test build can freeze the whole
//! process, so that the reliability tests SIGKILL it exactly there (after
//! the stacks, with a new top parked, during a state save) instead of
//! hoping a timed signal lands inside a window of a few microseconds.
//!
//! Only the `testbed` build reads `FUSE_SUPERVISOR_TESTBED_STOP_AT` (a
//! comma-separated list of point names); the node agent's build compiles
//! every [`reached`] to nothing.

/// After every stack of a batch is in place, before any flatten.
pub const STACKED: &str = "stacked";
/// A new top parked in the staging directory, its target showing the
/// stale layer again.
pub const PARKED: &str = "parked";
/// New tops slid beneath their stale layers, which are not detached yet.
pub const SLID: &str = "slid";
/// The state file's temporary written and synced, not renamed yet.
pub const STATE_WRITTEN: &str = "state-written";

#[cfg(feature = "testbed")]
pub const ENV: &str = "FUSE_SUPERVISOR_TESTBED_STOP_AT";

/// Stops the process (SIGSTOP to itself) if `point` is one of those named
/// in [`ENV`]; a test then kills it.
#[cfg(feature = "testbed")]
pub fn reached(point: &'static str) {
    use std::sync::OnceLock;
    static POINTS: OnceLock<Vec<String>> = OnceLock::new();
    let points = POINTS.get_or_init(|| {
        std::env::var(ENV).map(|names| names.split(',').map(str::to_owned).collect()).unwrap_or_default()
    });
    if points.iter().any(|name| name == point) {
        tracing::warn!(point, "testbed: stopping at a chosen point");
        // A failure leaves the process running: the test then times out
        // waiting for it to stop, and says so.
        let _ = fuse_supervisor_sys::process::stop_self();
    }
}

#[cfg(not(feature = "testbed"))]
#[inline(always)]
pub fn reached(_point: &'static str) {}
