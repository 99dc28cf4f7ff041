//! Hung FUSE daemons under `fuse-supervisor run`: a daemon SIGSTOPped
//! before it dies, a new daemon SIGSTOPped before its first answer, and a
//! new daemon that answers `statfs` but holds every `lookup` (the probe of
//! a subPath's directory waits on it). Each is bounded by
//! `--probe-timeout`: the loop stays responsive (`/healthz`, `status`),
//! another source crashes and heals meanwhile, and the hung one heals once
//! it answers or is replaced, even while it stays stuck. Real daemons in
//! private mount namespaces; needs root, /dev/fuse and bindfs.
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::{probe, resolve};

use fuse_supervisor_testbed::node::{Frozen, Node, NodeOptions};
use fuse_supervisor_testbed::scenario::{DATA_FILE, Daemon, FuseSource, Restart, ScenarioError};
use fuse_supervisor_testbed::{ContainerReader, Observation};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(30);
const PROBE_TIMEOUT: &str = "1s";

/// The node's source (two volumes and a subPath) and another source with
/// one pod and its reader, supervised with a short probe timeout.
struct TwoSources {
    other_reader: ContainerReader,
    other: FuseSource,
    node: Node,
}

impl TwoSources {
    fn new(daemon: Daemon) -> TwoSources {
        let options = NodeOptions { daemon, volumes: 2, subpaths: 1 };
        let mut node = Node::new(Path::new(BINARY), options).expect("node");
        let other = FuseSource::start(&node.sandbox, Daemon::Bindfs, "other-data").expect("other");
        let target: PathBuf = other.bind_volume(&node.sandbox, "pod-other", "other").expect("bind");
        let other_reader =
            ContainerReader::spawn(&node.sandbox, "pod-other", &target, Path::new(DATA_FILE)).expect("reader");
        node.converge(TIMEOUT).expect("readers read");
        node.start_supervisor(&[], &["--probe-timeout", PROBE_TIMEOUT]).expect("supervisor");
        node.converge(TIMEOUT).expect("the state saved");
        let watched = |line: &str| line.contains("\"watching the FUSE daemon\"");
        node.supervisor().and_then(|s| s.wait_for_lines(TIMEOUT, 0, 2, watched)).expect("both daemons watched");
        TwoSources { other_reader, other, node }
    }

    /// The supervisor's `healed` line for the node's first target.
    fn healed_line(&self) -> String {
        let target = self.node.targets[0].display().to_string();
        let healed = |line: &str| line.contains("\"healed\"") && line.contains(&target);
        self.check(self.node.supervisor().and_then(|s| s.wait_for_log(TIMEOUT, healed)))
    }

    /// Waits until the supervisor says, after log line `from`, that the
    /// node's source does not answer its probe.
    fn wait_until_overdue(&self, from: usize) {
        let overdue = |line: &str| line.contains("\"source does not answer; its heal waits until it does\"");
        self.check(self.node.supervisor().and_then(|s| s.wait_for_lines(TIMEOUT, from, 1, overdue)));
    }

    fn check<T>(&self, result: Result<T, ScenarioError>) -> T {
        result.unwrap_or_else(|err| panic!("{err:?}\n{}", self.node.describe()))
    }

    /// While the node's source hangs: the other source crashes and heals,
    /// `/healthz` answers 200 and `status` answers.
    fn stays_responsive(&mut self) {
        let node = &self.node;
        self.other.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the other daemon");
        let expected = self.other.expected_content();
        let read = self.other_reader.wait_until(TIMEOUT, |o: &Observation| o.content() == Some(expected.as_str()));
        read.unwrap_or_else(|err| panic!("the other source did not heal: {err}\n{}", node.describe()));
        let (status, body) = self.check(node.supervisor().and_then(|s| s.http_get("/healthz")));
        assert_eq!(status, 200, "{body}");
        let status = self.check(node.status());
        assert!(status["targets"].as_array().is_some_and(|targets| targets.len() == 4), "{status}");
    }
}

/// The daemon is stopped (every request hangs) and then killed: its
/// targets wait, the loop does not.
#[test]
fn a_daemon_stopped_before_its_death_holds_up_nothing_else() {
    let mut world = TwoSources::new(Daemon::Bindfs);
    world.node.source.stop().expect("stop the daemon");
    // Readers of the stopped source hang in their reads; the supervisor
    // must not: it probes nothing yet (nothing changed), and it answers.
    world.stays_responsive();
    world.node.source.crash().expect("kill the stopped daemon");
    let died = |line: &str| line.contains("\"daemon died; its targets are degraded\"");
    world.check(world.node.supervisor().and_then(|s| s.wait_for_log(TIMEOUT, died)));
    world.node.source.restart(&world.node.sandbox, Restart::UnmountThenMount).expect("restart");
    world.check(world.node.converge(TIMEOUT));
}

/// The new daemon mounts and is stopped before it answers the probe: the
/// probe gives up after `--probe-timeout` and says so, the loop goes on,
/// and the heal happens once the daemon answers.
#[test]
fn a_new_daemon_stopped_before_its_first_answer_holds_up_nothing_else() {
    let mut world = TwoSources::new(Daemon::Bindfs);
    let from = world.check(world.node.supervisor()).log_len();
    // Frozen, the supervisor cannot probe before the daemon is stopped.
    let frozen = world.check(Frozen::stop(world.check(world.node.supervisor()).pid()));
    world.node.source.restart(&world.node.sandbox, Restart::UnmountThenMount).expect("restart");
    world.node.source.stop().expect("stop the new daemon");
    let stopped_at = Instant::now();
    drop(frozen);
    world.wait_until_overdue(from);
    assert!(stopped_at.elapsed() >= Duration::from_secs(1), "reported before --probe-timeout");
    world.stays_responsive();
    assert!(
        world.node.readers[0].latest().is_some_and(|o| o.content().is_none()),
        "healed from a daemon that never answered"
    );
    world.node.source.resume().expect("resume the new daemon");
    world.check(world.node.converge(TIMEOUT));
}

/// The new daemon answers `statfs` but holds every lookup: the probe of the
/// subPath's directory waits on it, gives up after `--probe-timeout` and
/// says so, nothing is healed from the daemon, the loop and the other
/// source go on, and the heal happens once the daemon answers lookups, its
/// wait counted as the source's.
#[test]
fn a_new_daemon_that_holds_lookups_holds_up_nothing_else() {
    let mut world = TwoSources::new(Daemon::DemoFs);
    let from = world.check(world.node.supervisor()).log_len();
    let restarted_at = Instant::now();
    world.node.source.restart_holding_lookups(&world.node.sandbox, Restart::UnmountThenMount).expect("restart");
    world.wait_until_overdue(from);
    let held_for = restarted_at.elapsed();
    assert!(held_for >= Duration::from_secs(1), "reported before --probe-timeout");
    // The daemon is not stopped: its root answers.
    let source = world.node.sandbox.outside_path(&world.node.source.path);
    answers_statfs(&source).unwrap_or_else(|err| panic!("statfs of the held daemon: {err}"));
    world.stays_responsive();
    for reader in &world.node.readers {
        assert!(reader.latest().is_some_and(|o| o.content().is_none()), "healed from a daemon holding lookups");
    }
    world.node.source.answer().expect("answer lookups");
    world.check(world.node.converge(TIMEOUT));
    let healed = world.healed_line();
    let line: serde_json::Value = serde_json::from_str(&healed).expect("a JSON log line");
    let waited = Duration::from_micros(line["fields"]["source_wait_us"].as_u64().expect("source_wait_us"));
    assert!(waited >= Duration::from_secs(1), "the held lookups are the source's wait: {healed}");
}

/// The new daemon never answers, and a restart script gives up on it: its
/// mount is detached lazily and another daemon mounts, the stuck one left
/// running. The probe waiting on the stuck daemon is left to it, and the
/// newest mount is probed and healed from at once, not when the stuck
/// daemon ends.
#[test]
fn a_daemon_stuck_for_good_and_replaced_holds_up_not_its_successor() {
    let mut world = TwoSources::new(Daemon::DemoFs);
    let from = world.check(world.node.supervisor()).log_len();
    world.node.source.restart_unanswered(&world.node.sandbox, Restart::UnmountThenMount).expect("restart");
    world.wait_until_overdue(from);
    // Declared after the node: killed first, which ends the waiting probe.
    let _stuck = world.node.source.replace_leaving_the_daemon(&world.node.sandbox).expect("replace");
    world.check(world.node.converge(TIMEOUT));
    world.stays_responsive();
}

/// A restart script gives up on one stuck daemon after another: the probes
/// of four of them are left waiting, and the newest mount waits for one to
/// end. That is said once, however many scans plan its heal again (each
/// change of the other source does), and the heal follows as soon as a
/// stuck daemon ends.
#[test]
fn past_four_stuck_daemons_the_newest_mount_waits_and_says_so_once() {
    let mut world = TwoSources::new(Daemon::DemoFs);
    let from = world.check(world.node.supervisor()).log_len();
    world.node.source.restart_unanswered(&world.node.sandbox, Restart::UnmountThenMount).expect("restart");
    world.wait_until_overdue(from);
    let left_waiting = |line: &str| line.contains("\"a probe of an earlier mount is left waiting on its daemon");
    // Each mount replaced only once its probe runs: a mount replaced before
    // is never probed, and leaves no probe waiting.
    let probing = |line: &str| line.contains("\"probing source\"");
    // Declared after the node: killed first, which ends the waiting probes.
    let mut stuck = Vec::new();
    for replaced in 1..=4 {
        stuck.push(world.node.source.replace_with_an_unanswering_one(&world.node.sandbox).expect("replace"));
        world.check(world.node.supervisor().and_then(|s| s.wait_for_lines(TIMEOUT, from, replaced + 1, probing)));
    }
    stuck.push(world.node.source.replace_with_an_unanswering_one(&world.node.sandbox).expect("replace"));
    let waits = |line: &str| line.contains("\"not probing the newest mount");
    world.check(world.node.supervisor().and_then(|s| s.wait_for_lines(TIMEOUT, from, 1, waits)));
    world.stays_responsive();
    world.stays_responsive();
    let log = world.check(world.node.supervisor()).log().split_off(from);
    assert_eq!(log.iter().filter(|line| waits(line)).count(), 1, "said more than once:\n{}", log.join("\n"));
    assert_eq!(log.iter().filter(|line| left_waiting(line)).count(), 4, "{}", log.join("\n"));
    // What the other source's heals started has ended (its last daemon
    // watched, then the log quiet), so that no scan comes from elsewhere
    // after the stuck daemon ends: once, one did come first, and hid that
    // the end of an earlier mount's probe asked for none while the newest
    // waited.
    let supervisor = world.check(world.node.supervisor());
    let other_healed = |line: &str| line.contains("\"healed\"") && line.contains("pod-other");
    let last_heal = supervisor.log().iter().rposition(|line| other_healed(line)).map_or(from, |at| at + 1);
    let watched_other = |line: &str| line.contains("\"watching the FUSE daemon\"") && line.contains("other-data");
    world.check(supervisor.wait_for_lines(TIMEOUT, last_heal, 1, watched_other));
    wait_until_quiet(|| supervisor.log_len());
    // One stuck daemon ends, and its probe with it: the newest mount is
    // probed at the scan that end asks for, and healed once its daemon
    // answers.
    drop(stuck.remove(0));
    world.node.source.answer().expect("the newest daemon answers");
    world.check(world.node.converge(TIMEOUT));
}

/// Returns once `log_len` has not grown for 300 ms, or after 5 s of a log
/// that keeps growing.
fn wait_until_quiet(log_len: impl Fn() -> usize) {
    let started = Instant::now();
    let mut seen = log_len();
    while started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(300));
        let now = log_len();
        if now == seen {
            return;
        }
        seen = now;
    }
}

/// `statfs` of the mount at `path`, on a thread of its own: an error if it
/// fails or does not answer within a few seconds (the thread is left to
/// the daemon's end then).
fn answers_statfs(path: &Path) -> Result<(), String> {
    let (done, answer) = mpsc::channel();
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = done.send(resolve::open_path(&path).and_then(|root| probe::statfs(root.as_fd())));
    });
    match answer.recv_timeout(Duration::from_secs(5)) {
        Ok(result) => result.map_err(|err| err.to_string()),
        Err(_) => Err("no answer within 5 s".into()),
    }
}
