//! Root tests of the process watchers and the FUSE-server finder, with real
//! processes: FUSE daemons (the built-in demofs and bindfs) in a private
//! mount namespace, killed with SIGKILL; a fork/exit burst against a tiny
//! netlink buffer; a real pid reuse; subscriptions from the wrong
//! namespaces.
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use fuse_supervisor_engine::watch::processes::fuse_server::{FuseServers, MatchedBy, MountDevice};
use fuse_supervisor_engine::watch::processes::{
    ConnectorOptions, Detection, ExecReports, ExitStatus, PidfdWatcher, ProcConnectorWatcher, ProcessConnector,
    ProcessEvent, ProcessId, ProcessWatchError, ProcessWatcher, Subscription,
};
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource};
use fuse_supervisor_testbed::{Sandbox, system};

const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
const SIGKILL: ExitStatus = ExitStatus::Signaled { signal: 9, core_dumped: false };

#[derive(Debug, Clone, Copy)]
enum Kind {
    Connector,
    Pidfd,
}

fn proc_root() -> PathBuf {
    PathBuf::from("/proc")
}

/// A watcher of `kind` whose events arrive on the returned channel.
fn start(kind: Kind) -> (Box<dyn ProcessWatcher>, Receiver<ProcessEvent>) {
    let (events, inbox) = mpsc::channel();
    let sink = Box::new(move |event| events.send(event).is_ok());
    let watcher: Box<dyn ProcessWatcher> = match kind {
        Kind::Connector => Box::new(
            ProcConnectorWatcher::start(ConnectorOptions::default(), Subscription::default(), sink).expect("subscribe"),
        ),
        Kind::Pidfd => Box::new(PidfdWatcher::start(proc_root(), sink).expect("pidfd watcher")),
    };
    (watcher, inbox)
}

/// The first `Exited` (skipping exec and loss reports); panics on timeout.
fn next_exit(inbox: &Receiver<ProcessEvent>) -> (u32, Option<ExitStatus>, Instant, Detection) {
    let deadline = Instant::now() + EVENT_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match inbox.recv_timeout(left).expect("an exit event in time") {
            ProcessEvent::Exited { pid, status, at, detection } => return (pid, status, at, detection),
            ProcessEvent::Failed(err) => panic!("watcher failed: {err}"),
            ProcessEvent::Exec { .. } | ProcessEvent::Lost => {}
        }
    }
}

/// A plain child process, killed and reaped on drop.
struct Process(Child);

impl Process {
    fn spawn(program: &str, args: &[&str]) -> Process {
        Process(Command::new(program).args(args).stdin(Stdio::piped()).spawn().expect("spawn"))
    }

    fn id(&self) -> ProcessId {
        ProcessId::of(&proc_root(), self.0.id()).expect("process identity")
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The device (mountinfo `major:minor`) of the mount at `path` in the sandbox.
fn device_of(sandbox: &Sandbox, path: &Path) -> MountDevice {
    let table = sandbox.mountinfo();
    let wanted = path.to_str().expect("utf-8 path");
    let device = table
        .lines()
        .map(|line| line.split(' ').collect::<Vec<_>>())
        .filter(|fields| fields.len() > 4 && fields[4] == wanted)
        .map(|fields| fields[2].to_owned())
        // The topmost mount is the last one listed.
        .next_back()
        .unwrap_or_else(|| panic!("no mount at {wanted} in\n{table}"));
    let (major, minor) = device.split_once(':').expect("major:minor");
    MountDevice { major: major.parse().unwrap(), minor: minor.parse().unwrap() }
}

/// The one process serving `source`, found by the finder.
fn server_of(sandbox: &Sandbox, source: &FuseSource) -> ProcessId {
    let serving = FuseServers::scan(&proc_root()).unwrap().serving(device_of(sandbox, &source.path)).unwrap();
    assert_eq!(serving.matched_by, MatchedBy::Connection, "Linux 6.18 names the connection in fdinfo");
    assert_eq!(serving.processes.len(), 1, "{serving:?}");
    serving.processes[0]
}

fn killed_daemon_is_reported(kind: Kind, daemon: Daemon) {
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, daemon, "watched").expect("start daemon");
    let server = server_of(&sandbox, &source);
    assert_eq!(Some(server.pid), source.pid());
    let (watcher, inbox) = start(kind);
    watcher.watch(server).unwrap();
    assert_eq!(watcher.watched(), vec![server]);

    let killed_at = Instant::now();
    source.crash().unwrap();
    let (pid, status, at, detection) = next_exit(&inbox);
    assert_eq!((pid, detection), (server.pid, Detection::Event));
    assert!(at >= killed_at, "death after the kill");
    match kind {
        Kind::Connector => assert_eq!(status, Some(SIGKILL)),
        // Known only if the sandbox reaped the daemon before the watcher asked.
        Kind::Pidfd => assert!(status.is_none() || status == Some(SIGKILL), "{status:?}"),
    }
    assert!(watcher.watched().is_empty(), "an exited process is no longer watched");
}

#[test]
fn proc_connector_reports_a_killed_demofs_daemon() {
    killed_daemon_is_reported(Kind::Connector, Daemon::DemoFs);
}

#[test]
fn proc_connector_reports_a_killed_bindfs_daemon() {
    killed_daemon_is_reported(Kind::Connector, Daemon::Bindfs);
}

#[test]
fn pidfd_reports_a_killed_demofs_daemon() {
    killed_daemon_is_reported(Kind::Pidfd, Daemon::DemoFs);
}

#[test]
fn pidfd_reports_a_killed_bindfs_daemon() {
    killed_daemon_is_reported(Kind::Pidfd, Daemon::Bindfs);
}

#[test]
fn finder_tells_the_daemons_of_two_mounts_apart() {
    let sandbox = Sandbox::new().expect("sandbox");
    let mut demofs = FuseSource::start(&sandbox, Daemon::DemoFs, "first").expect("start demofs");
    let bindfs = FuseSource::start(&sandbox, Daemon::Bindfs, "second").expect("start bindfs");
    let (demofs_device, bindfs_device) = (device_of(&sandbox, &demofs.path), device_of(&sandbox, &bindfs.path));
    assert_ne!(demofs_device, bindfs_device);

    assert_eq!(Some(server_of(&sandbox, &demofs).pid), demofs.pid());
    assert_eq!(Some(server_of(&sandbox, &bindfs).pid), bindfs.pid());

    // A dead daemon's mount stays, served by nobody.
    demofs.crash().unwrap();
    let servers = FuseServers::scan(&proc_root()).unwrap();
    assert!(servers.serving(demofs_device).unwrap().processes.is_empty());
    assert_eq!(
        servers.serving(bindfs_device).unwrap().processes.iter().map(|p| p.pid).collect::<Vec<_>>(),
        vec![bindfs.pid().unwrap()]
    );
}

/// The watcher thread is held inside the sink (as a slow consumer would
/// hold it) while a burst of short processes overflows a minimal receive
/// buffer, and the daemon is killed in the middle of the burst: its exit
/// event cannot be queued. The resync after `ENOBUFS` must still report it.
#[test]
fn lost_events_resync_reports_a_daemon_killed_during_a_burst() {
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::DemoFs, "busy").expect("start daemon");
    let daemon = server_of(&sandbox, &source);
    let mut gate = Process::spawn("sleep", &["1000"]);
    let gate_id = gate.id();

    let (held_tx, held) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let (events, inbox) = mpsc::channel();
    let sink = Box::new(move |event: ProcessEvent| {
        let hold = matches!(event, ProcessEvent::Exited { pid, .. } if pid == gate_id.pid);
        let delivered = events.send(event).is_ok();
        if hold {
            let _ = held_tx.send(());
            let _ = release_rx.recv();
        }
        delivered
    });
    // The kernel raises a tiny request to its minimum (a few events' worth).
    let options = ConnectorOptions { receive_buffer: Some(1), execs: false, ..ConnectorOptions::default() };
    let subscription = Subscription { exec: ExecReports::Off, batch_window: None };
    let watcher = ProcConnectorWatcher::start(options, subscription, sink).expect("subscribe");
    assert!(watcher.connector().kernel_filter());
    watcher.watch(gate_id).unwrap();
    watcher.watch(daemon).unwrap();

    gate.kill();
    held.recv_timeout(EVENT_TIMEOUT).expect("the watcher thread is held in the sink");
    const BURST: usize = 3_000;
    for spawned in 0..BURST {
        if spawned == BURST / 2 {
            source.crash().unwrap();
        }
        Command::new("true").status().expect("run true");
    }
    release.send(()).unwrap();

    let (pid, status, _, gate_detection) = next_exit(&inbox);
    assert_eq!(pid, gate_id.pid);
    // On a busy machine the minimal buffer may overflow before the gate's
    // own exit is read: then the resync reports it, without a status, and
    // the thread is held with the queue still full of that overflow. The
    // burst's drops raise no `ENOBUFS` of their own until the queue has been
    // read empty; the loss is reported only after that (the connector's
    // `a_loss_is_reported_again_for_every_overflow_after_the_queue_was_read`),
    // so the daemon's death in the burst is covered by the next resync.
    match gate_detection {
        Detection::Event => assert_eq!(status, Some(SIGKILL)),
        Detection::Resync => assert_eq!(status, None),
    }
    // Events up to the Lost that ends the resync reporting the daemon (an
    // earlier overflow may have had a resync of its own).
    let daemon_exit = |event: &ProcessEvent| matches!(event, ProcessEvent::Exited { pid, .. } if *pid == daemon.pid);
    let mut seen = Vec::new();
    let deadline = Instant::now() + EVENT_TIMEOUT;
    while !seen.iter().skip_while(|event| !daemon_exit(event)).any(|event| matches!(event, ProcessEvent::Lost)) {
        let left = deadline.saturating_duration_since(Instant::now());
        seen.push(inbox.recv_timeout(left).unwrap_or_else(|_| panic!("no Lost report; events: {seen:?}")));
    }
    assert!(
        seen.iter().any(|event| matches!(
            event,
            ProcessEvent::Exited { pid, status: None, detection: Detection::Resync, .. } if *pid == daemon.pid
        )),
        "the resync reports the daemon before Lost: {seen:?}"
    );
    assert!(watcher.watched().is_empty());
}

/// Runs the test `name` of this binary again under `unshare flags`, with
/// `CHILD_MODE` set to `mode`, and returns its stdout once it passed.
fn run_in_child(name: &str, flags: &[&str], mode: &str) -> String {
    let output = Command::new(system::program("unshare"))
        .args(flags)
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(CHILD_MODE, mode)
        .output()
        .expect("run unshare");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "unshare {flags:?} {name}: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Set in a test run by [`run_in_child`].
const CHILD_MODE: &str = "PROCESS_WATCH_TEST_CHILD";

/// Forces a real pid reuse: the next pid the kernel hands out is set with
/// `ns_last_pid`. Run in a pid namespace of its own, where nothing else
/// takes pids and no other process on the machine sees its pids reused. The
/// first process lives a few clock ticks: start times count in ticks
/// (10 ms), and a daemon worth watching lives longer than one.
fn reused_pid() -> (ProcessId, Process) {
    for _ in 0..20 {
        let mut first = Process::spawn("sleep", &["1000"]);
        let old = first.id();
        std::thread::sleep(Duration::from_millis(30));
        first.kill();
        fs::write("/proc/sys/kernel/ns_last_pid", (old.pid - 1).to_string()).expect("set ns_last_pid (needs root)");
        let second = Process::spawn("sleep", &["1000"]);
        if second.0.id() == old.pid {
            return (old, second);
        }
    }
    panic!("could not get a pid reused in 20 attempts");
}

#[test]
fn pidfd_refuses_a_reused_pid() {
    const NAME: &str = "pidfd_refuses_a_reused_pid";
    if std::env::var(CHILD_MODE).is_err() {
        let stdout = run_in_child(NAME, &["--pid", "--fork", "--mount-proc"], "reuse");
        assert!(stdout.contains("refused: pid "), "{stdout}");
        return;
    }
    let (watcher, _inbox) = start(Kind::Pidfd);
    let (old, new) = reused_pid();
    let err = watcher.watch(old).unwrap_err();
    match &err {
        ProcessWatchError::Reused { pid, expected, found } => {
            assert_eq!((*pid, *expected), (old.pid, old.start_time));
            assert_eq!(*found, new.id().start_time);
        }
        other => panic!("expected a reuse refusal, got {other:?}"),
    }
    println!("refused: {err}");
    assert!(watcher.watched().is_empty());
    // The new process itself is fine to watch.
    watcher.watch(new.id()).unwrap();
}

/// The connector needs the host pid namespace, where forcing a reuse would
/// disturb the machine: the reuse is shown to it as /proc shows one, a
/// live pid with another start time than the identified process had.
#[test]
fn proc_connector_refuses_a_pid_whose_start_time_changed() {
    let (watcher, _inbox) = start(Kind::Connector);
    let process = Process::spawn("sleep", &["1000"]);
    let now = process.id();
    let identified = ProcessId { start_time: now.start_time - 1, ..now };
    let err = watcher.watch(identified).unwrap_err();
    assert!(
        matches!(err, ProcessWatchError::Reused { pid, expected, found }
            if pid == now.pid && expected == identified.start_time && found == now.start_time),
        "{err:?}"
    );
    assert!(watcher.watched().is_empty());
}

fn gone_process_is_refused(kind: Kind) {
    let (watcher, inbox) = start(kind);
    let mut process = Process::spawn("sleep", &["1000"]);
    let id = process.id();
    // Past its first clock tick: a process reusing the pid meanwhile has
    // another start time.
    std::thread::sleep(Duration::from_millis(30));
    process.kill();
    match watcher.watch(id) {
        // Taken again meanwhile, it is a reuse; otherwise it is gone.
        Err(err) => assert!(
            matches!(err, ProcessWatchError::Gone { pid } if pid == id.pid)
                || matches!(err, ProcessWatchError::Reused { .. }),
            "{err:?}"
        ),
        // The exit event was still queued when the pid was added: the
        // watcher thread took it and reports the exit itself.
        Ok(()) => assert_eq!(next_exit(&inbox).0, id.pid),
    }
}

#[test]
fn pidfd_refuses_a_process_that_is_gone() {
    gone_process_is_refused(Kind::Pidfd);
}

#[test]
fn proc_connector_refuses_a_process_that_is_gone() {
    gone_process_is_refused(Kind::Connector);
}

/// After `unwatch`, an exit is not reported: the next exit seen is that of
/// a process killed later.
fn unwatched_process_is_not_reported(kind: Kind) {
    let (watcher, inbox) = start(kind);
    let mut first = Process::spawn("sleep", &["1000"]);
    let mut second = Process::spawn("sleep", &["1000"]);
    watcher.watch(first.id()).unwrap();
    watcher.watch(second.id()).unwrap();
    assert!(watcher.unwatch(first.0.id()));
    assert!(!watcher.unwatch(first.0.id()));
    first.kill();
    second.kill();
    assert_eq!(next_exit(&inbox).0, second.0.id());
}

#[test]
fn pidfd_does_not_report_an_unwatched_process() {
    unwatched_process_is_not_reported(Kind::Pidfd);
}

#[test]
fn proc_connector_does_not_report_an_unwatched_process() {
    unwatched_process_is_not_reported(Kind::Connector);
}

#[test]
fn proc_connector_reports_exec_and_exit_codes_of_watched_processes() {
    let (watcher, inbox) = start(Kind::Connector);
    let mut shell = Process::spawn("sh", &["-c", "read line; exec sh -c 'read line; exit 7'"]);
    let id = shell.id();
    watcher.watch(id).unwrap();
    let mut stdin = shell.0.stdin.take().expect("piped stdin");
    stdin.write_all(b"exec\n").unwrap();
    let event = inbox.recv_timeout(EVENT_TIMEOUT).expect("an exec event");
    assert!(matches!(event, ProcessEvent::Exec { pid, .. } if pid == id.pid), "{event:?}");
    stdin.write_all(b"exit\n").unwrap();
    let (pid, status, _, _) = next_exit(&inbox);
    assert_eq!((pid, status), (id.pid, Some(ExitStatus::Exited(7))));
    drop(stdin);
}

/// Outside the host's namespaces the subscription fails with an error that
/// names the missing setting. Runs itself again under `unshare`: in a new
/// pid namespace (the kernel does not answer) and in a new network
/// namespace (there is no connector).
#[test]
fn proc_connector_outside_the_host_namespaces_names_what_is_missing() {
    const NAME: &str = "proc_connector_outside_the_host_namespaces_names_what_is_missing";
    if let Ok(expected) = std::env::var(CHILD_MODE) {
        let options = ConnectorOptions { ack_timeout: Duration::from_millis(500), ..ConnectorOptions::default() };
        let err = ProcConnectorWatcher::start(options, Subscription::default(), Box::new(|_| true))
            .err()
            .expect("the subscription must fail");
        println!("error: {err}");
        assert!(err.to_string().contains(&expected), "{err}");
        return;
    }
    for (flags, expected) in [(&["--pid", "--fork"][..], "hostPID: true"), (&["--net"][..], "hostNetwork: true")] {
        let stdout = run_in_child(NAME, flags, expected);
        assert!(stdout.contains("error: ") && stdout.contains(expected), "{stdout}");
    }
}

/// A pod without hostNetwork reaches the connector all the same: the
/// subscription is made on a thread that joined the host's network
/// namespace (`/proc/1/ns/net`, with hostPID) for it alone, and the events
/// arrive. Runs itself again under `unshare --net`, with no connector in
/// its own network namespace (the test above shows that).
#[test]
fn proc_connector_subscribes_through_the_hosts_network_namespace() {
    const NAME: &str = "proc_connector_subscribes_through_the_hosts_network_namespace";
    if std::env::var(CHILD_MODE).is_ok() {
        // The host's pid 1 stands for the host: here the test runner, in
        // the machine's network namespace (this machine's own pid 1 cannot
        // be looked at), through a /proc whose "1" is it.
        let runner = std::os::unix::process::parent_id();
        let proc_root = tempfile::tempdir().expect("a fake /proc");
        std::os::unix::fs::symlink(format!("/proc/{runner}"), proc_root.path().join("1")).expect("its pid 1");
        let host = fuse_supervisor_engine::watch::processes::host_network_namespace(proc_root.path());
        let expected = proc_root.path().join("1/ns/net");
        assert_eq!(host.as_deref(), Some(expected.as_path()), "in a network namespace of its own");
        let (send, events) = mpsc::channel();
        let options = ConnectorOptions { network_namespace: host, ..ConnectorOptions::default() };
        let subscription = Subscription { exec: ExecReports::All, batch_window: None };
        let watcher =
            ProcConnectorWatcher::start(options, subscription, Box::new(move |event| send.send(event).is_ok()))
                .expect("subscribed from the host's network namespace");
        let mut child = Process::spawn("true", &[]);
        let pid = child.0.id();
        let deadline = Instant::now() + EVENT_TIMEOUT;
        let seen = std::iter::from_fn(|| events.recv_timeout(deadline.saturating_duration_since(Instant::now())).ok())
            .any(|event| matches!(event, ProcessEvent::Exec { pid: exec, .. } if exec == pid));
        assert!(seen, "no exec event for {pid}");
        child.kill();
        drop(watcher);
        // This thread is still in its own network namespace.
        let inode = |path: &Path| fs::metadata(path).map(|meta| std::os::unix::fs::MetadataExt::ino(&meta)).ok();
        let (own, host) = (inode(Path::new("/proc/thread-self/ns/net")), inode(&expected));
        assert!(own.is_some() && host.is_some() && own != host, "{own:?} {host:?}");
        println!("subscribed");
        return;
    }
    let stdout = run_in_child(NAME, &["--net"], "host");
    assert!(stdout.contains("subscribed"), "{stdout}");
}

/// The agent's process watchers (the daemons', the namespace keeper's, a
/// Job's) share one connector: each gets the exits of its own pids and the
/// execs it asked for, a batching watcher does not delay the others, and
/// one dropped leaves the rest watching.
#[test]
fn watchers_of_one_connector_each_get_their_own_events() {
    const WINDOW: Duration = Duration::from_secs(5);
    let connector = ProcessConnector::open(ConnectorOptions::default()).expect("subscribe");
    let watcher_of = |subscription| {
        let (events, inbox) = mpsc::channel();
        (connector.watcher(subscription, Box::new(move |event| events.send(event).is_ok())), inbox)
    };
    let (daemons, daemon_events) = watcher_of(Subscription::default());
    let batching = Subscription { exec: ExecReports::All, batch_window: Some(WINDOW) };
    let (namespaces, namespace_events) = watcher_of(batching);
    let mut processes: Vec<Process> = (0..3).map(|_| Process::spawn("sleep", &["60"])).collect();
    let pids: Vec<u32> = processes.iter().map(|process| process.0.id()).collect();
    daemons.watch(processes[0].id()).unwrap();
    daemons.watch(processes[1].id()).unwrap();
    namespaces.watch(processes[0].id()).unwrap();
    namespaces.watch(processes[2].id()).unwrap();

    processes[0].kill();
    assert_eq!(next_exit(&daemon_events).0, pids[0]);
    assert_eq!(next_exit(&namespace_events).0, pids[0]);
    // Right after a read: the namespaces' window would hold the next read
    // back, the daemons' (none) does not.
    let killed_at = Instant::now();
    processes[1].kill();
    assert_eq!(next_exit(&daemon_events).0, pids[1]);
    assert!(killed_at.elapsed() < WINDOW, "a death waited for another watcher's batch window");
    // Each watcher's exec policy: the daemons' watches execs of its own pids
    // only, the namespaces' every exec.
    let exec = Process::spawn("true", &[]);
    let exec_pid = exec.0.id();
    let deadline = Instant::now() + EVENT_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match namespace_events.recv_timeout(left).expect("the exec of `true` in time") {
            ProcessEvent::Exec { pid, .. } if pid == exec_pid => break,
            ProcessEvent::Failed(err) => panic!("watcher failed: {err}"),
            _ => {}
        }
    }
    assert!(
        daemon_events.try_iter().all(|event| !matches!(event, ProcessEvent::Exec { .. })),
        "the daemons' watcher asked for its own pids' execs only"
    );
    drop(daemons);
    processes[2].kill();
    assert_eq!(next_exit(&namespace_events).0, pids[2]);
    assert!(namespaces.watched().is_empty());
}
