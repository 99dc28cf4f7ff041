//! `fuse-supervisor demo`: a node in a private mount namespace, three pods
//! on one FUSE volume, the supervisor watching, and the FUSE daemon killed
//! and restarted a few times. Prints what each container saw and what the
//! supervisor did, and fails if any container did not read again.
//!
//! Nothing touches the machine's own mounts: everything lives in a
//! [`Sandbox`], which takes every process and mount with it when dropped,
//! also after Ctrl-C.
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use fuse_supervisor_sys::poll::Poller;

use crate::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR_FILE, ScenarioError, SupervisorProcess, layers_at,
};
use crate::{ContainerReader, Observation, Sandbox, TestbedError};
use fuse_supervisor_engine::model::table::{Dev, Snapshot};

mod interrupt;
mod output;
mod report;

use interrupt::Interrupt;
use output::{LogEntry, Timeline, describe_batch, millis, plural, style_name, summary};
pub use report::{CycleReport, DemoError, DemoOptions, DemoReport, HealKind, HealRecord, PodRecovery};

/// The name of the source, its volume, and the pods bound to it.
const SOURCE_NAME: &str = "shared-data";
const VOLUME: &str = "shared-data";
/// How long the supervisor gets to go quiet after the containers recovered.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the demo waits for the supervisor to detach a dead daemon's
/// mount before it restarts the daemon anyway (with the process watcher
/// off, nothing is detached).
const DETACH_WAIT: Duration = Duration::from_secs(2);
/// How often long waits look at the interrupt flag.
const INTERRUPT_CHECK: Duration = Duration::from_millis(100);

/// Runs the demo, printing the timeline and the summary to `out`.
pub fn run(options: &DemoOptions, out: &mut dyn Write) -> Result<DemoReport, DemoError> {
    if !Path::new("/dev/fuse").exists() {
        return Err(DemoError::NoFuseDevice);
    }
    let interrupt = Interrupt::install()?;
    let result = Demo::new(options, out, &interrupt).and_then(|mut demo| demo.run());
    // Whatever went wrong, a Ctrl-C is the reason to report.
    match result {
        Err(_) if interrupt.requested() => Err(DemoError::Interrupted),
        other => other,
    }
}

/// One pod: its target, what its container reads, and the container.
struct Pod {
    name: &'static str,
    target: PathBuf,
    subpath: bool,
    reader: ContainerReader,
}

struct Demo<'a> {
    options: &'a DemoOptions,
    out: &'a mut dyn Write,
    interrupt: &'a Interrupt,
    // Field order is drop order: containers and supervisor go before the
    // daemon, the sandbox (which kills whatever is left) last.
    pods: Vec<Pod>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    sandbox: Sandbox,
    /// Pod name of each target path, to read the supervisor's log.
    pod_of_target: HashMap<PathBuf, &'static str>,
}

fn scenario(step: &str) -> impl FnOnce(ScenarioError) -> DemoError {
    let step = step.to_owned();
    move |source| DemoError::Scenario { step, source }
}

impl<'a> Demo<'a> {
    fn new(options: &'a DemoOptions, out: &'a mut dyn Write, interrupt: &'a Interrupt) -> Result<Self, DemoError> {
        let sandbox = Sandbox::new().map_err(DemoError::Sandbox)?;
        writeln!(out, "fuse-supervisor demo: a node in a private mount namespace at {}", sandbox.root().display())
            .map_err(DemoError::Output)?;
        interrupt.check()?;
        let source = FuseSource::start(&sandbox, options.daemon, SOURCE_NAME)
            .map_err(scenario(&format!("start {}", options.daemon.name())))?;
        let mut demo = Demo {
            options,
            out,
            interrupt,
            pods: Vec::new(),
            supervisor: None,
            source,
            sandbox,
            pod_of_target: HashMap::new(),
        };
        demo.set_up()?;
        Ok(demo)
    }

    fn say(&mut self, line: impl AsRef<str>) -> Result<(), DemoError> {
        writeln!(self.out, "{}", line.as_ref()).map_err(DemoError::Output)
    }

    fn set_up(&mut self) -> Result<(), DemoError> {
        let root = self.sandbox.root().to_path_buf();
        let relative = |path: &Path| path.strip_prefix(&root).unwrap_or(path).display().to_string();
        let global = relative(&self.source.path);
        self.say(format!(
            "  global mount   {global}  ({}, pid {})",
            self.options.daemon.name(),
            self.source.pid().unwrap_or_default()
        ))?;
        for (name, subpath) in [("pod-a", false), ("pod-b", false), ("pod-c", true)] {
            self.interrupt.check()?;
            let (target, read) = if subpath {
                let target =
                    self.source.bind_subpath(&self.sandbox, name, VOLUME).map_err(scenario("bind a subPath"))?;
                (target, SUBDIR_FILE)
            } else {
                let target = self.source.bind_volume(&self.sandbox, name, VOLUME).map_err(scenario("bind a volume"))?;
                (target, DATA_FILE)
            };
            let reader = ContainerReader::spawn(&self.sandbox, name, &target, Path::new(read))
                .map_err(|source| DemoError::StartReader { pod: name.to_owned(), source })?;
            let what = if subpath { format!("subPath {}/", scenario::SUBDIR) } else { "whole volume".to_owned() };
            self.say(format!("  {name:<14} {}  ({what}; container reads {read} every 2 ms)", relative(&target)))?;
            self.pod_of_target.insert(target.clone(), name);
            self.pods.push(Pod { name, target, subpath, reader });
        }
        self.interrupt.check()?;
        let state_dir = self.sandbox.root().join("state");
        let supervisor = SupervisorProcess::start(&self.sandbox, &self.options.binary, &state_dir)
            .map_err(scenario("start the supervisor"))?;
        self.say(format!(
            "  supervisor     pid {}, watching {}",
            supervisor.pid(),
            relative(&self.sandbox.kubelet_root())
        ))?;
        self.supervisor = Some(supervisor);
        // Every container reads the first generation before anything breaks.
        for index in 0..self.pods.len() {
            self.wait_for_read(index, 0, Duration::from_secs(10))?;
        }
        Ok(())
    }

    fn mounts(&self) -> usize {
        self.sandbox.count_mounts_under(self.sandbox.root())
    }

    fn supervisor(&self) -> &SupervisorProcess {
        // Set in `set_up`, which `new` runs before handing the demo out.
        self.supervisor.as_ref().unwrap_or_else(|| unreachable!("the supervisor starts in set_up"))
    }

    fn run(&mut self) -> Result<DemoReport, DemoError> {
        let mounts_at_start = self.mounts();
        self.say(format!("  mounts under the sandbox: {mounts_at_start}"))?;
        let mut cycles = Vec::new();
        for (index, style) in restart_styles(self.options.cycles, self.options.daemon, self.options.mount_over_stale)
            .into_iter()
            .enumerate()
        {
            self.interrupt.check()?;
            cycles.push(self.cycle(index + 1, style)?);
        }
        let mounts_at_end = self.mounts();
        let report = DemoReport { daemon: self.options.daemon, mounts_at_start, mounts_at_end, cycles };
        let summary = summary(&report);
        self.say(summary)?;
        if let Some(supervisor) = self.supervisor.take() {
            // A clean shutdown; the sandbox would kill it anyway.
            let _ = supervisor.stop();
        }
        if report.mounts_at_end != report.mounts_at_start {
            if !report.stale_layers_expected() {
                return Err(DemoError::MountsLeftBehind { start: mounts_at_start, end: mounts_at_end });
            }
            self.say(format!(
                "the {} extra mounts are stale layers that mount-over-stale restarts leave under the global mount\n\
                 (the daemon's own, with what subPath heals propagated onto its sub/ directory), covered by the\n\
                 new one and left alone; with unmount-then-mount restarts only, the node ends flat",
                mounts_at_end.abs_diff(mounts_at_start)
            ))?;
        }
        self.say("every container read its volume again after every restart; the sandbox goes away on exit")?;
        Ok(report)
    }

    fn cycle(&mut self, number: usize, style: Restart) -> Result<CycleReport, DemoError> {
        let how = match style {
            Restart::UnmountThenMount => "the stale global mount is unmounted, then the daemon mounts afresh",
            Restart::MountOverStale => "the new daemon mounts over the stale global mount",
            Restart::InPlace => "the new daemon mounts where the old one did, as it finds it",
        };
        self.say(format!("\n── cycle {number}: {} ({how})", style_name(style)))?;
        let mounts_before = self.mounts();
        let log_mark = self.supervisor().log().len();
        let history_marks: Vec<usize> = self.pods.iter().map(|pod| pod.reader.history().len()).collect();

        // Phase 1: the daemon dies; every container starts failing.
        let pid = self.source.pid().unwrap_or_default();
        let killed_at = SystemTime::now();
        self.source.crash().map_err(scenario("kill the daemon"))?;
        let mut timeline = Timeline::new(killed_at);
        timeline.add(killed_at, format!("daemon killed (pid {pid}, SIGKILL)"));
        for index in 0..self.pods.len() {
            let seen = self.wait_for_failure(index, number)?;
            let pod = &self.pods[index];
            timeline.add(seen.at, format!("{}: {}", pod.name, seen.error().unwrap_or("error")));
        }
        self.say(timeline.take())?;

        // The supervisor detaches the dead daemon's own mount once nobody
        // holds its connection, milliseconds after the death: a pod's
        // restart takes longer than that.
        let detached = |line: &str| line.contains("\"message\":\"dead source detached");
        if self.supervisor().wait_for_lines(DETACH_WAIT, log_mark, 1, detached).is_ok() {
            let log = self.supervisor().log();
            let line = log.iter().skip(log_mark).find(|line| detached(line));
            let at = line.and_then(|line| LogEntry::parse(line)).and_then(|entry| entry.at);
            timeline
                .add(at.unwrap_or_else(SystemTime::now), "the supervisor detached the dead global mount".to_owned());
            self.say(timeline.take())?;
        }

        // Phase 2: the daemon comes back; the supervisor (or the kernel) heals.
        self.interrupt.check()?;
        let restarting_at = SystemTime::now();
        let detached_before = self.supervisor().log().iter().skip(log_mark).any(|line| detached(line));
        let mounted_at = self.restart(style)?;
        // An earlier mount-over-stale restart leaves a stale layer under the
        // global mount that unmounting the top does not remove: the new
        // mount then lands on it, exactly as a mount over stale does.
        let global_layers = layers_at(&self.sandbox, &self.source.path);
        let landed_on_stale = global_layers > 1;
        timeline.add(
            restarting_at,
            match style {
                Restart::MountOverStale if global_layers > 1 || !detached_before => {
                    "new daemon starting; it mounts over the stale global mount".to_owned()
                }
                Restart::MountOverStale => {
                    "new daemon starting; it would mount over the stale global mount, but that was detached".to_owned()
                }
                Restart::UnmountThenMount => "stale global mount unmounted; new daemon starting".to_owned(),
                Restart::InPlace => "new daemon starting on its mount point".to_owned(),
            },
        );
        let generation = self.source.expected_content();
        let generation = generation.rsplit_once(' ').map_or(generation.as_str(), |(_, n)| n).to_owned();
        timeline.add(
            mounted_at,
            format!(
                "new global mount appeared (pid {}, generation {generation})",
                self.source.pid().unwrap_or_default()
            ),
        );
        let mut pods = Vec::new();
        for index in 0..self.pods.len() {
            let recovered = match self.wait_for_read(index, number, self.options.recovery_timeout) {
                Ok(recovered) => recovered,
                Err(err) => {
                    self.say(timeline.take())?;
                    self.say(self.diagnostics())?;
                    return Err(err);
                }
            };
            let pod = &self.pods[index];
            let history = pod.reader.history();
            let since_kill = &history[history_marks[index]..];
            let mut errors: Vec<String> = Vec::new();
            for errno in since_kill.iter().filter_map(Observation::error) {
                if !errors.iter().any(|seen| seen == errno) {
                    errors.push(errno.to_owned());
                }
            }
            // The first correct read after the failure, not the latest.
            let first_ok = since_kill
                .iter()
                .skip_while(|o| o.error().is_none())
                .find(|o| o.content() == recovered.content())
                .map_or(recovered.at, |o| o.at);
            let outage = first_ok.duration_since(killed_at).unwrap_or_default();
            let content = recovered.content().unwrap_or_default();
            let shown = if pod.subpath { content.to_owned() } else { format!("… generation {generation}") };
            timeline.add(first_ok, format!("{} reads \"{shown}\" again (outage {})", pod.name, millis(outage)));
            pods.push(PodRecovery { pod: pod.name.to_owned(), errors, outage });
        }
        self.settle(log_mark, mounted_at, !landed_on_stale, mounts_before);
        let heals = self.heals_since(log_mark, &mut timeline);
        self.say(timeline.take())?;
        for pod in &pods {
            self.say(format!(
                "   {:<6} saw {:<26} read again {} after the kill",
                pod.pod,
                pod.errors.join(", "),
                millis(pod.outage)
            ))?;
        }

        let mounts_after = self.mounts();
        let mut layers: Vec<(String, usize)> =
            self.pods.iter().map(|pod| (pod.name.to_owned(), layers_at(&self.sandbox, &pod.target))).collect();
        layers.push(("global".to_owned(), layers_at(&self.sandbox, &self.source.path)));
        let layer_text: Vec<String> = layers.iter().map(|(name, count)| format!("{name} {count}")).collect();
        self.say(format!(
            "   mounts under the sandbox: {mounts_before} before, {mounts_after} after; FUSE layers: {}",
            layer_text.join(", ")
        ))?;
        if landed_on_stale {
            let under = global_layers - 1;
            let cause = match style {
                Restart::MountOverStale | Restart::InPlace => "the new global mount went over the stale one".to_owned(),
                Restart::UnmountThenMount => format!(
                    "unmounting the top left {} from an earlier mount-over-stale restart, and the new global mount \
                     landed on {}",
                    plural(under as u64, "older stale layer"),
                    if under == 1 { "it" } else { "them" }
                ),
            };
            let targets_flat = layers.iter().filter(|(name, _)| name != "global").all(|(_, count)| *count == 1);
            let targets = if targets_flat {
                "the supervisor removed the covered stale layers\n         through the handles it took when the \
                 daemon died; the stale global mount below\n         is the daemon's own and is left alone"
            } else {
                "their stale layers stay underneath,\n         covered and out of the supervisor's reach (the \
                 daemon's death was not seen first)"
            };
            self.say(format!(
                "   note: {cause};\n         the kernel propagated it onto the whole-volume targets; {targets}"
            ))?;
        }
        Ok(CycleReport { number, style, landed_on_stale, mounts_before, mounts_after, pods, heals, layers })
    }

    /// Brings the daemon back; returns when the new global mount appeared
    /// (seen by polling the table every millisecond).
    fn restart(&mut self, style: Restart) -> Result<SystemTime, DemoError> {
        let path = self.source.path.clone();
        let before = connections_at(&self.sandbox, &path);
        let restarted = AtomicBool::new(false);
        // The sandbox thread's table: `<thread dir>/ns/mnt` → `<thread dir>/mountinfo`.
        let table = self.sandbox.namespace_path().parent().and_then(Path::parent).map(|dir| dir.join("mountinfo"));
        let mountinfo = table.map_or_else(|| Err(io::Error::other("no thread directory")), std::fs::File::open);
        let (sandbox, source) = (&self.sandbox, &mut self.source);
        std::thread::scope(|scope| {
            let watcher = scope.spawn(|| {
                // Woken by the kernel on every change of the table, like the
                // supervisor; the timeout only lets it notice the end.
                let poller = mountinfo.as_ref().ok().and_then(|file| {
                    let poller = Poller::new().ok()?;
                    poller.add_priority(file.as_fd(), 0).ok()?;
                    Some(poller)
                });
                let mut events = Vec::new();
                loop {
                    let done = restarted.load(Ordering::SeqCst);
                    if done || connections_at(sandbox, &path).difference(&before).next().is_some() {
                        // After a failed restart nothing appears; the error says why.
                        return SystemTime::now();
                    }
                    match &poller {
                        Some(poller) => {
                            let _ = poller.wait(&mut events, Some(Duration::from_millis(20)));
                        }
                        None => std::thread::sleep(Duration::from_millis(1)),
                    }
                }
            });
            let result = source.restart(sandbox, style).map_err(scenario("restart the daemon"));
            restarted.store(true, Ordering::SeqCst);
            // The watcher only polls; it cannot panic short of a bug in std.
            let appeared_at = watcher.join().unwrap_or_else(|_| SystemTime::now());
            result.map(|()| appeared_at)
        })
    }

    fn wait_for_failure(&self, index: usize, cycle: usize) -> Result<Observation, DemoError> {
        let pod = &self.pods[index];
        self.wait_reader(pod, self.options.recovery_timeout, &|o: &Observation| o.error().is_some())
            .map_err(|source| DemoError::NoFailureSeen { cycle, pod: pod.name.to_owned(), source })
    }

    /// Waits until the pod's container reads what the current daemon serves;
    /// a subPath container must see only its subdirectory.
    fn wait_for_read(&self, index: usize, cycle: usize, timeout: Duration) -> Result<Observation, DemoError> {
        let pod = &self.pods[index];
        let expected = self.source.expected_content();
        let subpath = pod.subpath;
        let reads = move |o: &Observation| match o.content() {
            Some(_) if subpath => true,
            Some(content) => content == expected,
            None => false,
        };
        let seen = self.wait_reader(pod, timeout, &reads).map_err(|source| DemoError::NotRecovered {
            cycle,
            pod: pod.name.to_owned(),
            waited: timeout,
            source,
        })?;
        if subpath && seen.entries() != Some(&[SUBDIR_FILE.to_owned()][..]) {
            return Err(DemoError::SubpathLeak {
                cycle,
                pod: pod.name.to_owned(),
                entries: seen.entries().unwrap_or_default().to_vec(),
            });
        }
        Ok(seen)
    }

    /// [`ContainerReader::wait_until`] in slices, so Ctrl-C is noticed.
    fn wait_reader(
        &self,
        pod: &Pod,
        timeout: Duration,
        pred: &dyn Fn(&Observation) -> bool,
    ) -> Result<Observation, TestbedError> {
        let deadline = Instant::now() + timeout;
        loop {
            let slice = INTERRUPT_CHECK.min(deadline.saturating_duration_since(Instant::now()));
            match pod.reader.wait_until(slice, pred) {
                Err(TestbedError::Timeout { .. }) if Instant::now() < deadline && !self.interrupt.requested() => {}
                Err(TestbedError::Timeout { name, history, .. }) => {
                    return Err(TestbedError::Timeout { name, waited: timeout, history });
                }
                other => return other,
            }
        }
    }

    /// Waits until the supervisor has nothing left to do: its latest scan
    /// found no heal to make and came after the new mount appeared, nothing
    /// was logged for a little while, and (when the restart left nothing
    /// stale to cover) the mount count is back where it was. Best effort:
    /// whatever is left shows in the counts.
    fn settle(&self, log_mark: usize, mounted_at: SystemTime, flat_expected: bool, mounts_before: usize) {
        const QUIET: Duration = Duration::from_millis(50);
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        while Instant::now() < deadline && !self.interrupt.requested() {
            let entries: Vec<LogEntry> =
                self.supervisor().log().iter().skip(log_mark).filter_map(|line| LogEntry::parse(line)).collect();
            let idle = entries.iter().rev().find(|entry| entry.message == "scanned").is_some_and(|scan| {
                scan.fields.get("batches").and_then(serde_json::Value::as_u64) == Some(0)
                    && scan.at.is_some_and(|at| at >= mounted_at)
            });
            let quiet = entries
                .last()
                .and_then(|entry| entry.at)
                .is_some_and(|at| SystemTime::now().duration_since(at).is_ok_and(|since| since >= QUIET));
            let flat = !flat_expected || self.mounts() == mounts_before;
            if idle && quiet && flat {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What the supervisor complained about and which FUSE mounts exist,
    /// for a failed cycle.
    fn diagnostics(&self) -> String {
        let mut text = String::from("   supervisor warnings and errors:\n");
        for entry in self.supervisor().log().iter().filter_map(|line| LogEntry::parse(line)) {
            if matches!(entry.level.as_str(), "WARN" | "ERROR") {
                let target = entry.field_str("target").or(entry.field_str("source")).unwrap_or("");
                let err = entry.field_str("err").unwrap_or("");
                let _ = writeln!(text, "     {} {} {target} {err}", entry.level, entry.message);
            }
        }
        text.push_str("   FUSE mounts in the sandbox (mount ID, device, root, mount point):\n");
        if let Ok(snapshot) = Snapshot::parse(self.sandbox.mountinfo().as_bytes()) {
            for fuse in &snapshot.fuse_mounts {
                let _ = writeln!(
                    text,
                    "     {:>5} {:>8} {:<5} {}",
                    fuse.mount_id,
                    fuse.dev.to_string(),
                    fuse.root.display(),
                    fuse.mount_point.display()
                );
            }
        }
        text.truncate(text.trim_end().len());
        text
    }

    /// The supervisor's heal lines since `log_mark`, added to the timeline.
    fn heals_since(&self, log_mark: usize, timeline: &mut Timeline) -> Vec<HealRecord> {
        let mut heals: Vec<HealRecord> = Vec::new();
        // Lines of one heal batch share their latency; print them as one.
        let mut batch: Vec<(SystemTime, HealRecord)> = Vec::new();
        let flush = |batch: &mut Vec<(SystemTime, HealRecord)>, timeline: &mut Timeline| {
            if let Some((at, _)) = batch.last() {
                timeline.add(*at, describe_batch(batch.iter().map(|(_, heal)| heal)));
            }
            batch.clear();
        };
        for entry in self.supervisor().log().iter().skip(log_mark).filter_map(|line| LogEntry::parse(line)) {
            let pod = entry.field_str("target").and_then(|t| self.pod_of_target.get(Path::new(t))).copied();
            let at = entry.at.unwrap_or_else(SystemTime::now);
            match (entry.message.as_str(), pod) {
                ("healed", Some(pod)) => {
                    let kind = match entry.field_str("how") {
                        Some("propagated") => HealKind::Propagated,
                        _ => HealKind::Stacked,
                    };
                    let heal = HealRecord {
                        pod: pod.to_owned(),
                        kind,
                        layers_removed: entry
                            .fields
                            .get("layers_removed")
                            .and_then(serde_json::Value::as_u64)
                            .unwrap_or(0),
                        latency: entry
                            .fields
                            .get("latency_us")
                            .and_then(serde_json::Value::as_u64)
                            .map(Duration::from_micros),
                    };
                    if batch.last().is_some_and(|(_, last)| last.latency != heal.latency) {
                        flush(&mut batch, timeline);
                    }
                    heals.push(heal.clone());
                    batch.push((at, heal));
                }
                ("healed by propagation", Some(pod)) => {
                    flush(&mut batch, timeline);
                    timeline.add(at, format!("supervisor saw {pod} healed by the kernel's propagation"));
                    heals.push(HealRecord {
                        pod: pod.to_owned(),
                        kind: HealKind::ByKernel,
                        layers_removed: 0,
                        latency: None,
                    });
                }
                ("heal failed", _) | ("healed, but stale layers remain", _) => {
                    flush(&mut batch, timeline);
                    let who = pod.map_or_else(|| entry.field_str("target").unwrap_or("?").to_owned(), str::to_owned);
                    timeline.add(
                        at,
                        format!("supervisor: {} for {who}: {}", entry.message, entry.field_str("err").unwrap_or("")),
                    );
                }
                _ => {}
            }
        }
        flush(&mut batch, timeline);
        heals
    }
}

/// The FUSE connections mounted at `path`. Not mount IDs: the kernel
/// reuses the ID of an unmounted mount for the next one.
fn connections_at(sandbox: &Sandbox, path: &Path) -> HashSet<Dev> {
    let table = sandbox.mountinfo();
    let Ok(snapshot) = Snapshot::parse(table.as_bytes()) else { return HashSet::new() };
    snapshot.fuse_mounts.iter().filter(|fuse| fuse.mount_point == path).map(|fuse| fuse.dev).collect()
}

/// Restart styles: unmount-then-mount, and a last mount-over-stale restart
/// when asked for and the daemon can do it (bindfs, like every libfuse
/// daemon, cannot). Last, because the stale layers such a restart leaves
/// under the global mount make every later restart a mount over stale too.
fn restart_styles(cycles: usize, daemon: Daemon, mount_over_stale: bool) -> Vec<Restart> {
    (0..cycles)
        .map(|cycle| match daemon {
            Daemon::DemoFs if mount_over_stale && cycles > 1 && cycle == cycles - 1 => Restart::MountOverStale,
            _ => Restart::UnmountThenMount,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternates_restart_styles_where_the_daemon_can() {
        use Restart::{MountOverStale as M, UnmountThenMount as U};
        assert_eq!(restart_styles(4, Daemon::DemoFs, true), [U, U, U, M]);
        assert_eq!(restart_styles(1, Daemon::DemoFs, true), [U]);
        assert_eq!(restart_styles(2, Daemon::DemoFs, false), [U, U]);
        assert_eq!(restart_styles(2, Daemon::Bindfs, true), [U, U]);
    }
}
