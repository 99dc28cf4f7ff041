//! Faults of the node under `fuse-supervisor run`: a state directory that
//! is full or read-only (healing goes on, one error), a staging directory
//! it cannot use, an open-file limit too low for a heal, no CAP_SYS_ADMIN,
//! a seccomp profile that refuses the new mount API or `setns`.
//! Each ends in a clear error, at start or per heal; never a half-done
//! heal, never a lost target. Real daemons in private mount namespaces;
//! needs root, /dev/fuse, bindfs and util-linux's prlimit and setpriv.
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_testbed::node::{Node, NodeOptions, top_dev};

use fuse_supervisor_sys::mount;
use fuse_supervisor_testbed::scenario::{Daemon, Restart, ScenarioError, SupervisorProcess, layers_at, wait_for};
use fuse_supervisor_testbed::system::program;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
/// The test world's programs (demofs, refuse-calls…).
const TESTBED: &str = env!("CARGO_BIN_EXE_fuse-supervisor-testbed");
const TIMEOUT: Duration = Duration::from_secs(30);

fn node(volumes: usize) -> Node {
    let options = NodeOptions { daemon: Daemon::Bindfs, volumes, subpaths: 1 };
    let node = Node::new(Path::new(BINARY), options).expect("node");
    node.converge(TIMEOUT).expect("readers read before anything happens");
    node
}

fn or_describe<T>(node: &Node, result: Result<T, ScenarioError>) -> T {
    result.unwrap_or_else(|err| panic!("{err:?}\n{}", node.describe()))
}

/// Started, and its start-up walk of the node's mount namespaces done: a
/// fault set up after it (a lower open-file limit) must not meet the walk
/// (seen once in a loaded run: the walk ran out of descriptors, and every
/// search walked `/proc` after).
fn start(node: &mut Node, wrapper: &[OsString]) {
    if let Err(err) = node.start_supervisor(wrapper, &[]) {
        panic!("{err:?}\n{}", node.describe());
    }
    let walked =
        |line: &str| line.contains("\"mount namespaces walked\"") || line.contains("cannot walk the mount namespaces");
    let supervisor = node.supervisor().expect("running");
    or_describe(node, supervisor.wait_for_log(TIMEOUT, walked));
}

fn crash_and_restart(node: &mut Node) {
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
}

fn lines_with(node: &Node, text: &str) -> Vec<String> {
    node.supervisor().map(|s| s.log()).unwrap_or_default().into_iter().filter(|line| line.contains(text)).collect()
}

/// A state directory on a tmpfs of `bytes`, read-only or not.
fn small_state_dir(node: &Node, bytes: u64, read_only: bool) {
    let dir = node.state_dir.clone();
    node.sandbox
        .run(move || std::fs::create_dir_all(&dir).and_then(|()| mount::mount_tmpfs_limited(&dir, bytes, read_only)))
        .expect("mount the state directory's tmpfs");
}

/// The state file cannot be saved (`errno` says why): the heals go on, the
/// error is logged once over two heals and `/readyz` shows it; once the
/// directory is usable again (`fix`) the next save works and says so.
fn heals_go_on_without_the_state_file(node: &mut Node, errno: &str, fix: impl FnOnce(&Node)) {
    start(node, &[]);
    for _ in 0..2 {
        crash_and_restart(node);
        or_describe(node, node.healed(TIMEOUT));
    }
    let errors = lines_with(node, "cannot save state");
    assert_eq!(errors.len(), 1, "{errors:#?}\n{}", node.describe());
    assert!(errors[0].contains(errno), "{}", errors[0]);
    let (status, body) = or_describe(node, node.supervisor().and_then(|s| s.http_get("/readyz")));
    assert!(status == 200 && body.contains(errno), "{status} {body}");

    fix(node);
    crash_and_restart(node);
    or_describe(node, node.converge(TIMEOUT));
    // The state writer saves on its own thread, after the heal the readers
    // saw: its line may come after they read again.
    let saved = |line: &str| line.contains("\"state saved again\"");
    or_describe(node, node.supervisor().and_then(|supervisor| supervisor.wait_for_log(TIMEOUT, saved)));
    assert_eq!(lines_with(node, "state saved again").len(), 1, "{}", node.describe());
}

#[test]
fn a_full_state_directory_stops_no_heal() {
    let mut node = node(2);
    small_state_dir(&node, 64 * 1024, false);
    let filler = node.state_dir.join("filler");
    let fill = filler.clone();
    let filled = node.sandbox.run(move || std::fs::write(fill, vec![0_u8; 1 << 20]));
    assert_eq!(filled.map_err(|err| err.raw_os_error()), Err(Some(28)), "the tmpfs is full (ENOSPC)");
    heals_go_on_without_the_state_file(&mut node, "No space left on device", |node| {
        node.sandbox.run(move || std::fs::remove_file(filler)).expect("free the space");
    });
}

#[test]
fn a_read_only_state_directory_stops_no_heal() {
    let mut node = node(2);
    small_state_dir(&node, 64 * 1024, true);
    heals_go_on_without_the_state_file(&mut node, "Read-only file system", |node| {
        let dir = node.state_dir.clone();
        node.sandbox
            .run(move || mount::detach(&dir).and_then(|()| mount::mount_tmpfs_limited(&dir, 64 * 1024, false)))
            .expect("a writable state directory");
    });
}

/// What a `run` that cannot start logged, with `wrapper` and `args`.
fn failed_start(node: &Node, wrapper: &[OsString], args: &[&str]) -> String {
    let all: Vec<&str> = ["--kubelet", "none"].iter().chain(args).copied().collect();
    let run = (Path::new(BINARY), node.state_dir.as_path());
    match SupervisorProcess::failed_start((&node.sandbox, wrapper), run, &all, TIMEOUT) {
        Ok(log) => log.join("\n"),
        Err(err) => panic!("{err}\n{}", node.describe()),
    }
}

/// A staging path it cannot mount on (a file there): `run` stops at once,
/// naming it, before any heal; a crash meanwhile is healed once it can
/// start.
#[test]
fn an_unusable_staging_directory_stops_the_start_with_its_path() {
    let mut node = node(1);
    start(&mut node, &[]);
    or_describe(&node, node.converge(TIMEOUT));
    node.kill_supervisor().expect("stop");
    let staging: PathBuf = node.sandbox.root().join("staging");
    let blocked = staging.clone();
    node.sandbox
        .run(move || {
            mount::detach(&blocked)
                .and_then(|()| std::fs::remove_dir_all(&blocked))
                .and_then(|()| std::fs::write(&blocked, ""))
        })
        .expect("a file where the staging directory was");
    crash_and_restart(&mut node);

    let log = failed_start(&node, &[], &[]);
    assert!(log.contains(&format!("staging mount {}", staging.display())), "{log}");
    let mounts = node.mounts();
    assert_eq!(Some(mounts), node.baseline().map(|baseline| baseline - 1), "only the staging tmpfs is gone\n{log}");

    let path = staging.clone();
    node.sandbox.run(move || std::fs::remove_file(path)).expect("the file gone");
    start(&mut node, &[]);
    or_describe(&node, node.converge(TIMEOUT));
}

/// Every FUSE mount in each reader's namespace is on `dev` (the source's
/// connection), one per mount point: no dead layer left in a container.
fn containers_have_one_live_layer(node: &Node, dev: Option<Dev>) -> Result<(), String> {
    for reader in &node.readers {
        let pid = reader.child().pid();
        let table = std::fs::read(format!("/proc/{pid}/mountinfo")).map_err(|err| format!("{pid}: {err}"))?;
        let snapshot = Snapshot::parse(&table).map_err(|err| format!("{pid}: {err}"))?;
        let mut points = BTreeSet::new();
        for mount in &snapshot.fuse_mounts {
            if Some(mount.dev) != dev || !points.insert(&mount.mount_point) {
                return Err(format!("reader {} (pid {pid}): {mount:?} besides {points:?}", reader.name()));
            }
        }
    }
    Ok(())
}

/// After a heal at an open-file limit of `limit`: every target is read
/// again with one layer on the new connection (its stale layer gone,
/// subPath included), the node's mount count back at its baseline, every
/// container's copy one live layer, the supervisor still up and every
/// target still in its state.
fn every_target_one_live_layer(node: &Node) {
    or_describe(node, node.healed(TIMEOUT));
    let source_dev = top_dev(&node.sandbox, &node.source.path);
    let mut last = Ok(());
    let containers = wait_for("every container one live layer", TIMEOUT, || {
        last = containers_have_one_live_layer(node, source_dev);
        last.is_ok()
    });
    if containers.is_err() {
        panic!("{last:?}\n{}", node.describe());
    }
    let status = or_describe(node, node.status());
    let targets = status["targets"].as_array().map_or(0, Vec::len);
    assert_eq!(targets, node.targets.len(), "a target left the state: {status}");
    let supervisor = node.supervisor().expect("running");
    assert!(supervisor.try_wait().ok().flatten().is_none(), "the supervisor exited\n{}", node.describe());
}

/// `run` through `wrapper` stops at start, its log naming each of
/// `expected`, with the mount table untouched though a crash waits to be
/// healed; the next start without it heals that crash.
fn a_refused_start_mounts_nothing(wrapper: &[OsString], expected: &[&str]) {
    let mut node = node(1);
    start(&mut node, &[]);
    or_describe(&node, node.converge(TIMEOUT));
    node.kill_supervisor().expect("stop");
    crash_and_restart(&mut node);
    let before = node.sandbox.mountinfo();
    let log = failed_start(&node, wrapper, &[]);
    assert!(expected.iter().all(|text| log.contains(text)), "{expected:?}\n{log}");
    assert_eq!(node.sandbox.mountinfo(), before, "{log}");
    start(&mut node, &[]);
    or_describe(&node, node.converge(TIMEOUT));
}

/// Without CAP_SYS_ADMIN nothing can be mounted: `run` stops at start,
/// saying what it could not do, and touches nothing.
#[test]
fn without_cap_sys_admin_the_start_fails_clearly_and_mounts_nothing() {
    let setpriv = [program("setpriv"), "--inh-caps=-sys_admin".into(), "--bounding-set=-sys_admin".into(), "--".into()];
    a_refused_start_mounts_nothing(&setpriv.map(OsString::from), &["Operation not permitted"]);
}

/// `run` under a seccomp filter that refuses `calls` with `errno` (the
/// test world's `refuse-calls`) stops at start naming the call,
/// the errno (`expected`) and what to change, and mounts nothing.
fn a_refused_call_stops_the_start(calls: &str, errno: &str, expected: [&str; 2]) {
    let filtered = [TESTBED, "refuse-calls", "--calls", calls, "--errno", errno, "--"].map(OsString::from);
    let [call, errno] = expected;
    a_refused_start_mounts_nothing(&filtered, &[call, errno, "seccompProfile", "nothing was mounted"]);
}

/// A profile that forbids the new mount API (EPERM).
#[test]
fn the_new_mount_api_forbidden_stops_the_start_clearly_and_mounts_nothing() {
    a_refused_call_stops_the_start("new-mount-api", "eperm", ["open_tree is refused", "Operation not permitted"]);
}

/// A profile that does not list the new mount API, answered as the
/// runtimes' default profiles answer calls they do not list (ENOSYS).
#[test]
fn the_new_mount_api_unlisted_stops_the_start_clearly_and_mounts_nothing() {
    a_refused_call_stops_the_start("new-mount-api", "enosys", ["open_tree is refused", "Function not implemented"]);
}

/// A profile that forbids `setns`.
#[test]
fn setns_forbidden_stops_the_start_clearly_and_mounts_nothing() {
    a_refused_call_stops_the_start("setns", "eperm", ["setns is refused", "Operation not permitted"]);
}

/// Sets the open-file soft limit of the running supervisor (its hard limit
/// stays: raising it back needs no CAP_SYS_RESOURCE).
fn set_soft_nofile(node: &Node, soft: u32) {
    let pid = node.supervisor().expect("running").pid().to_string();
    let set = std::process::Command::new(program("prlimit"))
        .args([format!("--nofile={soft}:").as_str(), "--pid", &pid])
        .status()
        .expect("run prlimit");
    assert!(set.success(), "prlimit --nofile={soft}: --pid {pid}: {set}");
}

/// An open-file limit too low for a heal (set on the running supervisor
/// alone): the heal fails as a whole before it changes any mount, logged
/// with each target and `Too many open files`, and is retried; the
/// supervisor stays up. Once the limit is raised again the retry heals
/// every target, and nothing was left half-done meanwhile: each ends with
/// one layer, subPath included, and so does every container.
#[test]
fn an_open_file_limit_too_low_for_a_heal_fails_it_whole_and_its_retry_heals_all() {
    let mut node = node(12);
    start(&mut node, &[]);
    or_describe(&node, node.converge(TIMEOUT));
    set_soft_nofile(&node, LOW_NOFILE);
    crash_and_restart(&mut node);

    let supervisor = node.supervisor().expect("running");
    let failed = |line: &str| {
        line.contains("\"heal failed\"") && line.contains("Too many open files") && line.contains("\"target\"")
    };
    or_describe(&node, supervisor.wait_for_log(TIMEOUT, failed));
    // Nothing was mounted on any target: each still has its one stale layer.
    for target in &node.targets {
        assert_eq!(layers_at(&node.sandbox, target), 1, "{} stacked\n{}", target.display(), node.describe());
    }
    assert!(lines_with(&node, "\"healed\"").is_empty(), "a target healed short of descriptors\n{}", node.describe());

    set_soft_nofile(&node, 4096);
    every_target_one_live_layer(&node);
}

/// Descriptors the supervisor runs with, and a few more: not enough for a
/// heal of the node's 13 targets (several handles each).
const LOW_NOFILE: u32 = 48;
