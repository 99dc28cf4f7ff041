//! A node for the reliability tests and benchmarks: one FUSE source bound
//! into whole-volume and subPath targets, each read by a container-model
//! reader, the supervisor as a process that can be frozen at a chosen point
//! ([`fuse_supervisor_engine::stop_point`]) and killed, and the check that the node
//! converged: every target read again, one layer each on the source's
//! current connection, the mount count at its baseline, the state file
//! valid and up to date.
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::process::{self, Signal};

use super::observe::io_step;
use super::scenario::{
    DATA_FILE, Daemon, FuseSource, Restart, SUBDIR_FILE, ScenarioError, SupervisorProcess, layers_at, wait_for,
};
use super::{ContainerReader, Observation, Sandbox};
use fuse_supervisor_engine::model::state::Journal;
use fuse_supervisor_engine::model::table::{Dev, Snapshot};

/// What a [`Node`] is made of.
#[derive(Debug, Clone, Copy)]
pub struct NodeOptions {
    pub daemon: Daemon,
    /// Pods binding the whole volume.
    pub volumes: usize,
    /// Pods binding the source's subdirectory (a subPath).
    pub subpaths: usize,
}

/// One source, its targets (whole volumes first, then subPaths), a reader
/// on each, and the supervisor once started.
pub struct Node {
    // Declared first: readers and the supervisor die before the sandbox.
    pub readers: Vec<ContainerReader>,
    pub supervisor: Option<SupervisorProcess>,
    pub source: FuseSource,
    pub targets: Vec<PathBuf>,
    pub state_dir: PathBuf,
    pub sandbox: Sandbox,
    subpaths: usize,
    binary: PathBuf,
    /// Mounts in the sandbox once the first supervisor started (its staging
    /// tmpfs included).
    baseline: Option<usize>,
}

impl Node {
    pub fn new(binary: &Path, options: NodeOptions) -> Result<Node, ScenarioError> {
        let sandbox = Sandbox::new().map_err(|err| ScenarioError::Io {
            step: "create the sandbox".into(),
            source: std::io::Error::other(err.to_string()),
        })?;
        let source = FuseSource::start(&sandbox, options.daemon, "shared-data")?;
        let mut node = Node {
            readers: Vec::new(),
            supervisor: None,
            source,
            targets: Vec::new(),
            state_dir: sandbox.root().join("state"),
            sandbox,
            subpaths: options.subpaths,
            binary: binary.to_path_buf(),
            baseline: None,
        };
        for pod in 0..options.volumes + options.subpaths {
            let uid = format!("pod-{pod:04}");
            let (target, read) = if pod < options.volumes {
                (node.source.bind_volume(&node.sandbox, &uid, "data")?, DATA_FILE)
            } else {
                (node.source.bind_subpath(&node.sandbox, &uid, "data")?, SUBDIR_FILE)
            };
            let reader = ContainerReader::spawn(&node.sandbox, &uid, &target, Path::new(read)).map_err(|err| {
                ScenarioError::Io {
                    step: format!("start reader {uid}"),
                    source: std::io::Error::other(err.to_string()),
                }
            })?;
            node.readers.push(reader);
            node.targets.push(target);
        }
        Ok(node)
    }

    /// Starts the supervisor with `run` arguments `args` (after
    /// `--kubelet none`), through `wrapper` (e.g. `env`, `prlimit`), and
    /// records the baseline mount count at its first start.
    pub fn start_supervisor(&mut self, wrapper: &[OsString], args: &[&str]) -> Result<(), ScenarioError> {
        let all = ["--kubelet", "none"].into_iter().chain(args.iter().copied());
        let supervisor = SupervisorProcess::start_wrapped(&self.sandbox, wrapper, &self.binary, &self.state_dir, all)?;
        self.supervisor = Some(supervisor);
        if self.baseline.is_none() {
            self.baseline = Some(self.mounts());
        }
        Ok(())
    }

    /// Starts the supervisor so that it stops itself at `point` (see
    /// [`fuse_supervisor_engine::stop_point`]).
    pub fn start_supervisor_stopping_at(&mut self, point: &str, args: &[&str]) -> Result<(), ScenarioError> {
        let wrapper =
            [OsString::from("env"), OsString::from(format!("{}={point}", fuse_supervisor_engine::stop_point::ENV))];
        self.start_supervisor(&wrapper, args)
    }

    pub fn supervisor(&self) -> Result<&SupervisorProcess, ScenarioError> {
        self.supervisor.as_ref().ok_or_else(|| ScenarioError::Io {
            step: "find the supervisor".into(),
            source: std::io::Error::other("not started"),
        })
    }

    /// Waits until the supervisor has stopped itself (state `T`).
    pub fn wait_until_stopped(&self, timeout: Duration) -> Result<(), ScenarioError> {
        let pid = self.supervisor()?.pid();
        wait_for(&format!("the supervisor (pid {pid}) stopped at its chosen point"), timeout, || {
            process_state(pid) == Some('T')
        })
    }

    /// SIGKILLs the supervisor and reaps it.
    pub fn kill_supervisor(&mut self) -> Result<(), ScenarioError> {
        if let Some(supervisor) = self.supervisor.take() {
            supervisor.kill()?;
        }
        Ok(())
    }

    pub fn mounts(&self) -> usize {
        self.sandbox.count_mounts_under(self.sandbox.root())
    }

    pub fn baseline(&self) -> Option<usize> {
        self.baseline
    }

    /// Waits until the node converged (see the module docs; the state file
    /// only while a supervisor runs) and returns how long that took; the
    /// error says what was still wrong.
    pub fn converge(&self, timeout: Duration) -> Result<Duration, ScenarioError> {
        let started = Instant::now();
        self.healed(timeout)?;
        if self.supervisor.is_none() {
            return Ok(started.elapsed());
        }
        let source_dev = top_dev(&self.sandbox, &self.source.path);
        let left = timeout.saturating_sub(started.elapsed());
        let mut last = Ok(());
        let state_is_current = || {
            last = self.state_is_current(source_dev);
            last.is_ok()
        };
        if wait_for("the state file valid and current", left, state_is_current).is_err() {
            last?;
        }
        Ok(started.elapsed())
    }

    /// [`Node::converge`] but for the state file: every target read again,
    /// one layer each on the source's connection, the mount count at its
    /// baseline.
    pub fn healed(&self, timeout: Duration) -> Result<(), ScenarioError> {
        let started = Instant::now();
        let expected = self.source.expected_content();
        let volumes = self.targets.len() - self.subpaths;
        for (index, reader) in self.readers.iter().enumerate() {
            let left = timeout.saturating_sub(started.elapsed());
            let reads = |o: &Observation| {
                if index < volumes {
                    o.content() == Some(expected.as_str())
                } else {
                    o.content().is_some_and(|c| c.starts_with("inside"))
                        && o.entries() == Some(&[SUBDIR_FILE.to_owned()][..])
                }
            };
            reader.wait_until(left, reads).map_err(|err| ScenarioError::Io {
                step: format!("reader {} reads the current source", reader.name()),
                source: std::io::Error::other(err.to_string()),
            })?;
        }
        let source_dev = || top_dev(&self.sandbox, &self.source.path);
        for target in &self.targets {
            let left = timeout.saturating_sub(started.elapsed());
            wait_for(&format!("one layer on the source's connection at {}", target.display()), left, || {
                layers_at(&self.sandbox, target) == 1 && top_dev(&self.sandbox, target) == source_dev()
            })?;
        }
        if let Some(baseline) = self.baseline {
            let left = timeout.saturating_sub(started.elapsed());
            wait_for(&format!("the baseline mount count {baseline}"), left, || self.mounts() == baseline).map_err(
                |err| ScenarioError::Io {
                    step: format!("{err}: {} mounts now\n{}", self.mounts(), self.sandbox.mountinfo()),
                    source: std::io::Error::other("mounts left over"),
                },
            )?;
        }
        Ok(())
    }

    /// The state file loads, and maps every target to the source's current
    /// connection.
    fn state_is_current(&self, source_dev: Option<Dev>) -> Result<(), ScenarioError> {
        let dir = self.state_dir.clone();
        let journal = self.sandbox.run(move || Journal::load(&dir)).map_err(|err| ScenarioError::Io {
            step: "load the state file".into(),
            source: std::io::Error::other(err.to_string()),
        })?;
        for target in &self.targets {
            let mapping = journal.get(target);
            if mapping.map(|mapping| mapping.dev) != source_dev {
                return Err(ScenarioError::Io {
                    step: format!("the state file's mapping of {}", target.display()),
                    source: std::io::Error::other(format!("{mapping:?}, the source is on {source_dev:?}")),
                });
            }
        }
        Ok(())
    }

    /// `fuse-supervisor status --json` on the node's state directory: the
    /// parsed output, once it exits successfully.
    pub fn status(&self) -> Result<serde_json::Value, ScenarioError> {
        let mut command = std::process::Command::new(&self.binary);
        command
            .args(["status", "--json", "--kubelet-root"])
            .arg(self.sandbox.kubelet_root())
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["--mount-namespace", "/proc/self/ns/mnt"])
            .stdout(std::process::Stdio::piped());
        let mut child = self.sandbox.spawn(command).map_err(io_step("start status"))?;
        let mut out = String::new();
        if let Some(mut stdout) = child.take_stdout() {
            std::io::Read::read_to_string(&mut stdout, &mut out).map_err(io_step("read status"))?;
        }
        let exit = child.wait().map_err(io_step("wait for status"))?;
        if !exit.success() {
            return Err(ScenarioError::Io { step: format!("status {exit}"), source: std::io::Error::other(out) });
        }
        serde_json::from_str(&out).map_err(|err| ScenarioError::Io {
            step: format!("status --json printed {out:?}"),
            source: std::io::Error::other(err),
        })
    }

    /// The sandbox's mount table, for a failure message (the supervisor
    /// prints its log itself when a test fails).
    pub fn describe(&self) -> String {
        format!("mount table:\n{}", self.sandbox.mountinfo())
    }
}

/// Where [`Node::kill_at`] kills the supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillPoint {
    /// Every stack of a heal in place, nothing flattened.
    Stacked,
    /// A new top parked in the staging directory.
    Parked,
    /// New tops slid beneath their stale layers, not detached yet.
    Slid,
    /// A state save's temporary written, not renamed yet.
    StateWritten,
    /// A daemon's death seen and its targets' stale layers held (the dead
    /// source left in place), before the daemon comes back.
    Held,
}

impl KillPoint {
    pub const ALL: [KillPoint; 5] =
        [KillPoint::Stacked, KillPoint::Parked, KillPoint::Slid, KillPoint::StateWritten, KillPoint::Held];

    pub fn name(self) -> &'static str {
        match self {
            KillPoint::Stacked => fuse_supervisor_engine::stop_point::STACKED,
            KillPoint::Parked => fuse_supervisor_engine::stop_point::PARKED,
            KillPoint::Slid => fuse_supervisor_engine::stop_point::SLID,
            KillPoint::StateWritten => fuse_supervisor_engine::stop_point::STATE_WRITTEN,
            KillPoint::Held => "held",
        }
    }
}

impl Node {
    /// One kill: the supervisor (any running one SIGKILLed first; the
    /// first time, after a plain one saved its state) is
    /// started to stop at `point`, the daemon restarts (unmount, then
    /// mount) so that a heal reaches it, and it is SIGKILLed there; then a
    /// plain supervisor starts. Returns the time from that start until the
    /// node converged.
    pub fn kill_at(&mut self, point: KillPoint, timeout: Duration) -> Result<Duration, ScenarioError> {
        if self.baseline.is_none() {
            // The state file first: a supervisor killed before its first
            // save knows nothing a restarted one could use, and this
            // node's source is in no layout it could be found by.
            self.start_supervisor(&[], &[])?;
            self.converge(timeout)?;
        }
        self.kill_supervisor()?;
        if point == KillPoint::Held {
            self.start_supervisor(&[], &["--detach-dead-sources", "off"])?;
            let watched = |line: &str| line.contains("\"watching the FUSE daemon\"");
            self.supervisor()?.wait_for_log(timeout, watched)?;
            let from = self.supervisor()?.log_len();
            self.source.crash()?;
            let died = |line: &str| line.contains("\"daemon died; its targets are degraded\"");
            self.supervisor()?.wait_for_lines(timeout, from, 1, died)?;
            self.kill_supervisor()?;
            self.source.restart(&self.sandbox, Restart::UnmountThenMount)?;
        } else {
            self.start_supervisor_stopping_at(point.name(), &[])?;
            self.source.restart(&self.sandbox, Restart::UnmountThenMount)?;
            self.wait_until_stopped(timeout)?;
            self.kill_supervisor()?;
        }
        let started = Instant::now();
        self.start_supervisor(&[], &[])?;
        self.converge(timeout).map(|_| started.elapsed()).map_err(|err| ScenarioError::Io {
            step: format!("after a kill at {}", point.name()),
            source: std::io::Error::other(err.to_string()),
        })
    }
}

/// What a soak of [`Node::soak`] saw: every cycle healed (it stops at the
/// first that does not), the supervisor's usage sampled after each.
#[derive(Debug, Default)]
pub struct Soak {
    pub cycles: usize,
    pub converge_times: Vec<Duration>,
    pub usage: Vec<Usage>,
}

/// The daemon styles a soak mixes, one per cycle in turn: bindfs
/// restarting unmount-then-mount, demofs mounting over the stale mount,
/// and bindfs daemonizing (the process that mounted exits, its child
/// serves).
pub const MIXED: [(Daemon, Restart); 3] = [
    (Daemon::Bindfs, Restart::UnmountThenMount),
    (Daemon::DemoFs, Restart::MountOverStale),
    (Daemon::BindfsDaemonized, Restart::UnmountThenMount),
];

impl Node {
    /// `cycles` crash/restart cycles of the source (see [`Node::cycle`]),
    /// each daemon and restart style of `styles` in turn; the supervisor's
    /// usage sampled after each. First the supervisor must watch the
    /// running daemon. Stops at the first cycle that does not converge,
    /// with its error.
    pub fn soak(
        &mut self,
        cycles: usize,
        styles: &[(Daemon, Restart)],
        timeout: Duration,
    ) -> Result<Soak, (Soak, ScenarioError)> {
        let mut soak = Soak::default();
        if let Err(err) = self.wait_until_watched(0, timeout) {
            return Err((soak, err));
        }
        for (cycle, &(daemon, style)) in styles.iter().cycle().take(cycles).enumerate() {
            let result = self
                .cycle(daemon, style, timeout)
                .and_then(|converged| Ok((converged, Usage::of(self.supervisor()?.pid())?)));
            match result {
                Ok((converged, usage)) => {
                    soak.cycles += 1;
                    soak.converge_times.push(converged);
                    soak.usage.push(usage);
                }
                Err(err) => {
                    let step = format!("cycle {cycle} ({} {style:?})", daemon.name());
                    return Err((soak, ScenarioError::Io { step, source: std::io::Error::other(format!("{err:?}")) }));
                }
            }
        }
        Ok(soak)
    }

    /// A crash, seen by a container (the outage has begun), the restart as
    /// `daemon` in `style`, and the node converged; returns the time from
    /// the crash until then. With a supervisor running, the restart waits
    /// as a FUSE pod's restart takes (tens of milliseconds at least) until
    /// the supervisor saw the crashed process die and, before a mount over
    /// the stale mount, detached the dead mount (a restart within
    /// milliseconds of the death is one the supervisor may never see as a
    /// death, and one over the stale mount leaves it to the daemon: docs/limits.md,
    /// Daemons); after convergence it must watch the new daemon's serving
    /// process, so that the next crash is of a watched daemon too.
    pub fn cycle(&mut self, daemon: Daemon, style: Restart, timeout: Duration) -> Result<Duration, ScenarioError> {
        let (crashed, from) = (self.source.pid(), self.supervisor.as_ref().map(SupervisorProcess::log_len));
        let started = Instant::now();
        self.source.crash()?;
        if let Some(reader) = self.readers.first() {
            reader.wait_until(timeout, |o: &Observation| o.error().is_some()).map_err(|err| ScenarioError::Io {
                step: format!("reader {} sees the crash", reader.name()),
                source: std::io::Error::other(err.to_string()),
            })?;
        }
        let source = self.source.path.display().to_string();
        if let (Some(from), Some(crashed)) = (from, crashed) {
            let died = |line: &str| logged(line, DAEMON_DIED, &source, Some(("pid", crashed)));
            self.wait_for_log(from, &format!("the death of {crashed}"), timeout, died)?;
            if style == Restart::MountOverStale {
                let detached = |line: &str| logged(line, DEAD_SOURCE_DETACHED, &source, None);
                self.wait_for_log(from, "the dead source detached", timeout, detached)?;
            }
        }
        self.source.restart_as(&self.sandbox, daemon, style)?;
        self.converge(timeout)?;
        let converged = started.elapsed();
        if let Some(from) = from {
            self.wait_until_watched(from, timeout)?;
        }
        Ok(converged)
    }

    /// Waits for a line of the supervisor's log from line `from` on that
    /// `logged` accepts; the error names `what`.
    fn wait_for_log(
        &self,
        from: usize,
        what: &str,
        timeout: Duration,
        logged: impl Fn(&str) -> bool,
    ) -> Result<(), ScenarioError> {
        self.supervisor()?.wait_for_lines(timeout, from, 1, logged).map_err(|err| ScenarioError::Io {
            step: format!("the supervisor logs {what}"),
            source: std::io::Error::other(err.to_string()),
        })
    }

    /// Waits until the supervisor's log, from line `from`, says it watches
    /// the process serving the source: found at once, or left serving by
    /// the process that mounted (a death retracted).
    pub fn wait_until_watched(&self, from: usize, timeout: Duration) -> Result<(), ScenarioError> {
        let pid = self.source.pid().ok_or_else(|| ScenarioError::Io {
            step: "find the source's daemon".into(),
            source: std::io::Error::other("none running"),
        })?;
        let source = self.source.path.display().to_string();
        let watched = |line: &str| {
            logged(line, WATCHING, &source, Some(("pids", pid)))
                || logged(line, RETRACTED, &source, Some(("pids", pid)))
        };
        self.wait_for_log(from, &format!("it watches {} (pid {pid})", self.source.daemon().name()), timeout, watched)
    }
}

/// Messages of the supervisor's log that a cycle waits for.
const DAEMON_DIED: &str = "daemon died; its targets are degraded";
const DEAD_SOURCE_DETACHED: &str =
    "dead source detached: its daemon can mount there again; its targets' stale layers are let go";
const WATCHING: &str = "watching the FUSE daemon";
const RETRACTED: &str = "connection still served by another process; death retracted";

/// Whether the JSON log line is `message` about `source`, naming the pid
/// in the given field if one is given (a number, or a list such as
/// `[12, 34]`).
fn logged(line: &str, message: &str, source: &str, naming: Option<(&str, u32)>) -> bool {
    if !line.contains(message) {
        return false;
    }
    let Ok(line) = serde_json::from_str::<serde_json::Value>(line) else { return false };
    let fields = &line["fields"];
    let names = |(field, pid): (&str, u32)| match &fields[field] {
        serde_json::Value::Number(number) => number.as_u64() == Some(u64::from(pid)),
        serde_json::Value::String(list) => {
            list.trim_matches(['[', ']']).split(", ").any(|listed| listed.parse() == Ok(pid))
        }
        _ => false,
    };
    fields["message"] == message && fields["source"] == source && naming.is_none_or(names)
}

impl Drop for Node {
    /// Before the readers and the supervisor are killed and reaped: a
    /// daemon still holding lookups would keep its callers (the
    /// supervisor's probe) from ever exiting.
    fn drop(&mut self) {
        if let Err(err) = self.source.end_held_lookups() {
            eprintln!("cannot end the lookups held by {}: {err}", self.source.path.display());
        }
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("sandbox", &self.sandbox).field("targets", &self.targets).finish()
    }
}

/// The device of the topmost FUSE mount at `path`, from the sandbox's table.
pub fn top_dev(sandbox: &Sandbox, path: &Path) -> Option<Dev> {
    let snapshot = Snapshot::parse(sandbox.mountinfo().as_bytes()).ok()?;
    snapshot.fuse_mounts.iter().rfind(|mount| mount.mount_point == path).map(|mount| mount.dev)
}

/// The state letter of process `pid` (`R`, `S`, `T` for stopped…), from
/// `/proc/<pid>/stat`.
pub fn process_state(pid: u32) -> Option<char> {
    state_in_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The state letter in the text of a `stat` file (a process's or a
/// thread's): it follows the parenthesised name, which may hold spaces.
pub(crate) fn state_in_stat(stat: &str) -> Option<char> {
    stat.rsplit_once(") ")?.1.chars().next()
}

/// What a process holds, sampled from `/proc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub rss_kib: u64,
    /// The resident peak since the process started (`VmHWM`).
    pub peak_rss_kib: u64,
    /// Of the resident set now, the pages of files (`RssFile`, `RssShmem`):
    /// mostly the binary's own code, which a debug build makes large.
    pub file_kib: u64,
    pub descriptors: usize,
    pub threads: u64,
}

impl Usage {
    /// The peak of memory the process made itself (heap, stacks): its
    /// resident peak less the file pages it holds now. File pages are only
    /// added as code runs, so this never overstates that peak.
    pub fn peak_anonymous_kib(&self) -> u64 {
        self.peak_rss_kib.saturating_sub(self.file_kib)
    }

    pub fn of(pid: u32) -> Result<Usage, ScenarioError> {
        let status_path = format!("/proc/{pid}/status");
        let status = fs::read_to_string(&status_path).map_err(io_step(format!("read {status_path}")))?;
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find_map(|line| line.strip_prefix(name))?;
            line.split_whitespace().next()?.parse().ok()
        };
        let missing = |name: &str| ScenarioError::Io {
            step: format!("{name} in {status_path}"),
            source: std::io::Error::other("missing"),
        };
        let rss_kib = field("VmRSS:").ok_or_else(|| missing("VmRSS"))?;
        let peak_rss_kib = field("VmHWM:").ok_or_else(|| missing("VmHWM"))?;
        let threads = field("Threads:").ok_or_else(|| missing("Threads"))?;
        let file_kib = field("RssFile:").ok_or_else(|| missing("RssFile"))?
            + field("RssShmem:").ok_or_else(|| missing("RssShmem"))?;
        let fd_dir = format!("/proc/{pid}/fd");
        let descriptors = fs::read_dir(&fd_dir).map_err(io_step(format!("list {fd_dir}")))?.count();
        Ok(Usage { rss_kib, peak_rss_kib, file_kib, descriptors, threads })
    }
}

/// Continues a stopped process when dropped, so that a failing test never
/// leaves one frozen.
#[derive(Debug)]
pub struct Frozen(pub u32);

impl Frozen {
    /// SIGSTOPs `pid`.
    pub fn stop(pid: u32) -> Result<Frozen, ScenarioError> {
        process::signal(pid, Signal::Stop).map_err(io_step(format!("stop {pid}")))?;
        Ok(Frozen(pid))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = process::signal(self.0, Signal::Cont);
    }
}
