//! A short soak of `fuse-supervisor run`: 50 crash/restart cycles of a
//! daemon serving ten targets (one a subPath), each read in a container,
//! mixing daemon styles in turn: bindfs restarting unmount-then-mount,
//! demofs mounting over the stale mount, bindfs daemonizing (its child
//! serves). Every cycle converges (every target read again, one layer
//! each, the mount count at its baseline, the state file current), the
//! supervisor sees each crashed process die and watches each new daemon's
//! serving process (the daemonized child), and its descriptors and threads
//! are where they were after the first cycles: nothing leaks per heal.
//! `cargo bench --bench soak` runs a thousand and prints the figures.
//! Needs root, /dev/fuse and bindfs.
use std::path::Path;
use std::time::Duration;

use fuse_supervisor_testbed::node::{MIXED, Node, NodeOptions};
use fuse_supervisor_testbed::scenario::Daemon;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(30);
/// Cycles before the usage counts as settled (the first heals start the
/// probe and flatten threads, the allocator's arenas, the state file).
const WARM_UP: usize = 10;

#[test]
fn fifty_cycles_heal_every_time_and_leak_nothing() {
    let options = NodeOptions { daemon: Daemon::Bindfs, volumes: 9, subpaths: 1 };
    let mut node = Node::new(Path::new(BINARY), options).expect("node");
    node.converge(TIMEOUT).expect("readers read");
    node.start_supervisor(&[], &[]).expect("supervisor");
    node.converge(TIMEOUT).expect("the state saved");
    let soak = node
        .soak(50, &MIXED, TIMEOUT)
        .unwrap_or_else(|(soak, err)| panic!("after {} cycles: {err:?}\n{}", soak.cycles, node.describe()));
    assert_eq!(soak.cycles, 50);
    let settled = soak.usage[WARM_UP - 1];
    let last = soak.usage[soak.usage.len() - 1];
    assert!(last.descriptors <= settled.descriptors, "descriptors grew: {settled:?} → {last:?}");
    assert!(last.threads <= settled.threads, "threads grew: {settled:?} → {last:?}");
    // Memory moves with the allocator; a leak per heal would add up over 40.
    assert!(last.rss_kib <= settled.rss_kib + 2048, "RSS grew: {settled:?} → {last:?}");
}
