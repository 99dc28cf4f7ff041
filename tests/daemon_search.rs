//! A daemon that dies before `run`'s search for it finds it: no process
//! holds its connection any more, which the search alone cannot tell from
//! a descriptor on its way from `fusermount` to its daemon. Its mount
//! answering ENOTCONN tells: the death is taken as seen at the search, its
//! targets are Degraded, its dead mount detached so that its pod's restart
//! mounts there again, and the heal follows. Needs root, /dev/fuse and
//! bindfs, and a kernel that names a `/dev/fuse` descriptor's connection
//! in fdinfo (6.17+).
use std::path::Path;
use std::time::Duration;

use fuse_supervisor_testbed::scenario::{self, DATA_FILE, Daemon, FuseSource, Restart, SupervisorProcess};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);

const DIED: &str = "\"daemon died; its targets are degraded\"";

fn supervise(sandbox: &Sandbox) -> SupervisorProcess {
    let state_dir = sandbox.root().join("state");
    SupervisorProcess::start_with(sandbox, Path::new(BINARY), &state_dir, ["--kubelet", "none"]).expect("supervisor")
}

/// `fuse-supervisor status` in the sandbox, from the supervisor's state file.
fn status(sandbox: &Sandbox) -> String {
    let mut command = std::process::Command::new(BINARY);
    command.arg("status").arg("--kubelet-root").arg(sandbox.kubelet_root());
    command.arg("--state-dir").arg(sandbox.root().join("state"));
    command.args(["--mount-namespace", "/proc/self/ns/mnt"]).stdout(std::process::Stdio::piped());
    let mut child = sandbox.spawn(command).expect("status");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.take_stdout().expect("stdout"), &mut out).expect("read status");
    assert!(child.wait().expect("wait for status").success(), "{out}");
    out
}

/// The daemon crashed while no supervisor ran: the first search finds
/// nobody holding its connection, and the probe of its mount finds it dead.
#[test]
fn a_daemon_dead_before_run_starts_is_seen_dead_at_the_first_search() {
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "early").expect("start daemon");
    let target = source.bind_volume(&sandbox, "pod-uid", "data").expect("bind volume");
    let reader = ContainerReader::spawn(&sandbox, "app", &target, Path::new(DATA_FILE)).expect("reader");
    let reads = |expected: String| move |seen: &Observation| seen.content() == Some(expected.as_str());
    reader.wait_until(TIMEOUT, reads(source.expected_content())).expect("reads before the crash");
    source.crash().expect("crash");
    reader.wait_until(TIMEOUT, |seen| seen.error().is_some()).expect("the reader sees the crash");

    let supervisor = supervise(&sandbox);
    let died = supervisor.wait_for_log(TIMEOUT, |line| line.contains(DIED)).expect("the death seen");
    let fields: serde_json::Value = serde_json::from_str(&died).expect("a JSON log line");
    assert_eq!(fields["fields"]["detection"], "search", "{died}");
    assert_eq!(fields["fields"]["targets"], 1, "{died}");
    let detached = |line: &str| line.contains("\"message\":\"dead source detached");
    supervisor.wait_for_log(TIMEOUT, detached).expect("the dead source detached");
    assert_eq!(supervisor.metric("fuse_supervisor_daemon_deaths_total").expect("scrape /metrics"), Some(1.0));
    let degraded = "DEGRADED: daemon died";
    scenario::wait_for("status to show the death", TIMEOUT, || status(&sandbox).contains(degraded))
        .unwrap_or_else(|err| panic!("{err}:\n{}", status(&sandbox)));
    assert!(status(&sandbox).contains("before it was found, its dead mount detached"), "{}", status(&sandbox));

    // The FUSE pod's restart: libfuse's bindfs mounts on its mount point
    // only because the dead mount is gone from it.
    source.restart(&sandbox, Restart::InPlace).expect("bindfs restarts in place");
    reader.wait_until(TIMEOUT, reads(source.expected_content())).expect("reads after the heal");
    supervisor.stop().expect("stop the supervisor");
}

/// The race the soak harness met: the daemon killed right after `run`
/// started, before or after its search found it. Either way its death is
/// seen, by the process watcher or by the search.
#[test]
fn a_daemon_killed_right_after_run_starts_is_seen_dead() {
    for round in 0..3 {
        let sandbox = Sandbox::new().expect("sandbox");
        let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "race").expect("start daemon");
        source.bind_volume(&sandbox, "pod-uid", "data").expect("bind volume");
        let supervisor = supervise(&sandbox);
        source.crash().expect("crash");
        supervisor
            .wait_for_log(TIMEOUT, |line| line.contains(DIED))
            .unwrap_or_else(|err| panic!("round {round}: the death not seen: {err}"));
        supervisor.stop().expect("stop the supervisor");
    }
}
