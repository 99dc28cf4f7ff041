//! A storm of 10,000 pod-directory changes and more mount changes than the
//! fanotify queue holds, made while the supervisor is frozen, overflows
//! both its inotify and its fanotify queues (see `testbed::storm`). It
//! resyncs both, misses nothing (every target of the storm known, the
//! deleted pods' targets forgotten, in the metrics and the state file), and
//! heals correctly after. Needs root, /dev/fuse, bindfs and Linux 6.15+.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_engine::model::state::Journal;
use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_testbed::scenario::{self, Restart, layers_at};
use fuse_supervisor_testbed::storm::{StormNode, StormPlan};
use fuse_supervisor_testbed::{ContainerReader, Observation};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
/// Generous: the resync walks 10,000 pod directories on a loaded machine.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The field `name` of a JSON log line, as a number.
fn field(line: &str, name: &str) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    value.get("fields")?.get(name)?.as_u64()
}

/// `resyncs_total` of `watch` for lost events, from the supervisor's `/metrics`.
fn overflow_resyncs(node: &StormNode, watch: &str) -> f64 {
    let series = format!("fuse_supervisor_resyncs_total{{watch=\"{watch}\",reason=\"overflow\"}}");
    node.supervisor.metric(&series).expect("scrape /metrics").unwrap_or_else(|| panic!("no {series}"))
}

fn top_dev(node: &StormNode, path: &Path) -> Option<Dev> {
    let snapshot = Snapshot::parse(node.sandbox.mountinfo().as_bytes()).ok()?;
    snapshot.fuse_mounts.iter().rfind(|mount| mount.mount_point == path).map(|mount| mount.dev)
}

fn reads(expected: String) -> impl Fn(&Observation) -> bool {
    move |observation| observation.content() == Some(expected.as_str())
}

#[test]
fn a_storm_overflowing_both_queues_misses_nothing_and_heals_after() {
    let plan = StormPlan::overflowing().expect("queue limits");
    let mut node = StormNode::prepare(Path::new(BINARY), plan, &[]).expect("a supervised node");
    let from = node.supervisor.log_len();
    let before = (overflow_resyncs(&node, "pods"), overflow_resyncs(&node, "mounts"));

    node.storm().expect("the storm");

    // Both queues overflowed, and each watcher resynced.
    let line = |what: &str, pred: &dyn Fn(&str) -> bool| -> String {
        let log = &node.supervisor;
        log.wait_for_lines(TIMEOUT, from, 1, pred).unwrap_or_else(|err| panic!("{what}: {err}"));
        log.log()[from..].iter().find(|line| pred(line)).cloned().unwrap_or_default()
    };
    line("the inotify queue overflowed", &|l| l.contains("\"inotify queue overflowed; rescanning pod directories\""));
    let rescanned = line("the pod directories rescanned", &|l| l.contains("\"pod directories rescanned\""));
    let pods = plan.kept_pods + plan.new_pods;
    assert_eq!(field(&rescanned, "pods"), Some(pods as u64), "{rescanned}");
    let resynced = line("the fanotify queue overflowed", &|l| {
        l.contains("\"mount table resynced\"") && l.contains("\"overflow\"")
    });
    eprintln!("after the storm:\n  {rescanned}\n  {resynced}");
    // Each resync counted, by the watcher that lost events.
    let after = || (overflow_resyncs(&node, "pods"), overflow_resyncs(&node, "mounts"));
    scenario::wait_for("both resyncs counted", TIMEOUT, || after().0 > before.0 && after().1 > before.1)
        .unwrap_or_else(|err| panic!("{err}: before {before:?}, now {:?}", after()));

    // Every target of the storm known, the deleted pods' ones forgotten.
    let targets = node.targets.len();
    assert_eq!(targets, plan.kept_pods + plan.new_targets);
    node.wait_for_healthy_targets(targets, TIMEOUT).expect("every target in the metrics");
    // Read from outside the sandbox's namespace, where the test runs.
    let state_dir = node.sandbox.outside_path(&node.state_dir);
    let expected = node.targets.clone();
    let recorded = || -> BTreeSet<PathBuf> {
        Journal::load(&state_dir)
            .map(|journal| journal.mappings().keys().map(Path::to_path_buf).collect())
            .unwrap_or_default()
    };
    scenario::wait_for("the state file to hold exactly the storm's targets", TIMEOUT, || recorded() == expected)
        .unwrap_or_else(|err| {
            let recorded = recorded();
            let missing: Vec<_> = expected.difference(&recorded).take(5).collect();
            let extra: Vec<_> = recorded.difference(&expected).take(5).collect();
            panic!("{err}: {} recorded; missing {missing:?}…, not forgotten {extra:?}…", recorded.len())
        });

    // A crash after the storm heals every target, old and new, readers
    // included, to one layer on the new connection.
    let (old, new) = (node.targets.first().unwrap().clone(), node.targets.last().unwrap().clone());
    let readers: Vec<ContainerReader> = [("old", &old), ("new", &new)]
        .into_iter()
        .map(|(name, target)| {
            ContainerReader::spawn(&node.sandbox, name, target, Path::new(scenario::DATA_FILE)).expect("reader")
        })
        .collect();
    for reader in &readers {
        reader.wait_until(TIMEOUT, reads(node.source.expected_content())).expect("reads before the crash");
    }
    let baseline = node.sandbox.count_mounts_under(node.sandbox.root());
    node.source.crash().expect("crash");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart");
    for reader in &readers {
        reader.wait_until(TIMEOUT, reads(node.source.expected_content())).expect("reads after the heal");
    }
    let source_dev = top_dev(&node, &node.source.path).expect("the source is mounted");
    for target in &node.targets {
        scenario::wait_for("one layer on the new connection", TIMEOUT, || {
            layers_at(&node.sandbox, target) == 1 && top_dev(&node, target) == Some(source_dev)
        })
        .unwrap_or_else(|err| panic!("{}: {err}", target.display()));
    }
    scenario::wait_for("the mount count before the crash", TIMEOUT, || {
        node.sandbox.count_mounts_under(node.sandbox.root()) == baseline
    })
    .expect("no mount left behind");
    node.wait_for_healthy_targets(targets, TIMEOUT).expect("every target healthy again");
}
