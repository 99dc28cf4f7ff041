//! The supervisor SIGKILLed in the middle of a heal, then started again:
//! after every kill the node converges (every target read again, one layer
//! each on the new connection, the mount count at its baseline, the state
//! file valid and current). The test build stops itself at a chosen point
//! (`stop_point`), where the kill lands. Real daemons in private mount
//! namespaces; needs root, /dev/fuse and bindfs. `cargo bench --bench
//! kills` does a hundred of these and prints the figures.
use std::path::Path;
use std::time::Duration;

use fuse_supervisor_testbed::node::{KillPoint, Node, NodeOptions};
use fuse_supervisor_testbed::scenario::Daemon;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(30);

/// Three pods with the whole volume and one with a subPath, each read in a
/// container, killed at each of `points` in turn.
fn converges_after_kills_at(points: &[KillPoint]) {
    let options = NodeOptions { daemon: Daemon::Bindfs, volumes: 3, subpaths: 1 };
    let mut node = Node::new(Path::new(BINARY), options).expect("node");
    node.converge(TIMEOUT).expect("readers read before anything happens");
    for point in points {
        if let Err(err) = node.kill_at(*point, TIMEOUT) {
            panic!("{err:?}\n{}", node.describe());
        }
    }
}

/// The stale layers stay under the new ones, made private; the containers'
/// copies were isolated, not yet healed.
#[test]
fn killed_after_the_stacks_it_converges() {
    converges_after_kills_at(&[KillPoint::Stacked]);
}

/// The new top parked in the staging directory is nobody's: the next start
/// detaches it.
#[test]
fn killed_with_a_new_top_parked_it_converges() {
    converges_after_kills_at(&[KillPoint::Parked]);
}

/// The stale layers are on top again, the new source under them: the next
/// heal only detaches them.
#[test]
fn killed_with_new_tops_slid_beneath_the_stale_layers_it_converges() {
    converges_after_kills_at(&[KillPoint::Slid]);
}

/// Between the write of the state file's temporary and its rename: the old
/// file stays whole, and the next start uses it. Twice in a row.
#[test]
fn killed_during_a_state_save_it_converges() {
    converges_after_kills_at(&[KillPoint::StateWritten, KillPoint::StateWritten]);
}

/// While it holds the stale layers of a dead daemon (the dead source left
/// in place), started again after the daemon came back.
#[test]
fn killed_while_holding_the_layers_of_a_dead_daemon_it_converges() {
    converges_after_kills_at(&[KillPoint::Held]);
}

/// Every point in turn on one node, twice: each kill starts from what the
/// one before left.
#[test]
fn killed_at_every_point_in_turn_it_converges_each_time() {
    converges_after_kills_at(&[KillPoint::ALL, KillPoint::ALL].concat());
}
