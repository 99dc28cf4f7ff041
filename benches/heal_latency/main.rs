//! Heal latency, end to end: N pod targets bound to one global FUSE mount,
//! `fuse-supervisor run` watching, and the daemon crashing and coming back
//! (unmount, then mount) K times. Each cycle is timed from the moment the new
//! global mount appears in the sandbox's mount namespace:
//!
//! - (a1) until every target has been seen with the new mount on top,
//! - (a2) until every target is on the new mount with exactly one layer (healed),
//! - (b)  until every container reader reads the new content again,
//!
//! and the supervisor's own `latency_us` (its loop's wake-up to the heal) is
//! collected from its log. A benchmark, not a test: it prints numbers.
//!
//! Before the supervisor starts, the same crash and restart is healed by the
//! floor (`floor.rs`): a minimal healer making only the mount calls a heal of
//! that size must make, on the same sandbox, daemon and readers, so that the
//! supervisor's share is read against the kernel's own cost on the same
//! machine in the same run (`--floor off` skips it). Each reader is a
//! container of its own, every other one mounting the volume
//! `HostToContainer` and the rest `None` (`--propagation`). With `--readers
//! wake` (the default) a failing reader reads again the moment its
//! container's mount table changes (and every 100 ms at the latest), and a
//! reader that reads does so every 100 ms: they cost the node nothing while
//! they wait, so the heal is not measured against its own readers. With
//! `--readers poll` they read every `--reader-interval-ms` throughout (the
//! saturated variant: 100 readers at 2 ms are 50,000 reads a second, each
//! served by the daemon once healed).
//!
//! `--modes event,poll` runs every size in both of the supervisor's modes,
//! one after the other, and prints them side by side: `event` wakes on the
//! kernel's mount-table notification, `poll` scans every `--poll-period`
//! (5s, like Fluid's default) as polling healers do.
//!
//! ```text
//! cargo bench --bench heal_latency [-- --sizes 1,100,1000 --cycles 20 --large-cycles 8
//!     --daemons demofs,bindfs --modes event,poll --poll-period 5s --sampled-readers 20
//!     --readers wake --reader-interval-ms 2 --propagation mixed
//!     --floor on --supervisor-log info --log-dir DIR]
//! ```
//!
//! Every flag is also an environment variable (`HEAL_BENCH_SIZES`, ...).
//! Needs root and /dev/fuse (and bindfs for the bindfs rows). Everything
//! runs in a private mount namespace that dies with the run.
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuse_supervisor_engine::heal::priority::HealPriority;
use fuse_supervisor_engine::model::mountinfo::is_fuse_type;
use fuse_supervisor_engine::model::table::Dev;
use fuse_supervisor_sys::poll::{Poller, Waker};
use fuse_supervisor_sys::statmount::{self, MountSummary};
use fuse_supervisor_sys::{fuse, ns, resolve};
use fuse_supervisor_testbed::container::ContainerOptions;
use fuse_supervisor_testbed::scenario::{DATA_FILE, Daemon, FuseSource, Restart, SupervisorProcess, wait_for};
use fuse_supervisor_testbed::{ContainerReader, Sandbox};

#[allow(dead_code)]
#[path = "../common/mod.rs"]
mod common;
mod floor;

use common::{Flags, is_root};
use floor::{FloorContainer, FloorHealer, FloorTimes};
use fuse_supervisor_sys::mount::Propagation;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(60);
/// `--readers wake`: how often a reader reads when nothing woke it.
const WAKING_READERS_INTERVAL: Duration = Duration::from_millis(100);
#[derive(Clone)]
struct Options {
    sizes: Vec<usize>,
    cycles: usize,
    large_cycles: usize,
    daemons: Vec<Daemon>,
    modes: Vec<Mode>,
    /// `--poll-period` of the supervisor in poll mode.
    poll_period: String,
    /// The supervisor's `--log` level: info, its default, unless the
    /// timeline needs debug lines (each costs the loop a few microseconds).
    supervisor_log: String,
    /// Where to keep each run's supervisor log (`<daemon>-<mode>-<N>.log`).
    log_dir: Option<PathBuf>,
    /// Up to this many targets, one reader per target; above, readers are
    /// sampled: a reader per target would swamp the machine and measure the
    /// scheduler instead of the heal.
    all_readers_up_to: usize,
    sampled_readers: usize,
    /// `--readers poll`'s interval.
    reader_interval: Duration,
    /// Readers woken by their namespace's mount changes (`wake`), or
    /// polling every `reader_interval` (`poll`, the saturated variant).
    readers_wake: bool,
    /// Which containers mount the volume as a slave (`HostToContainer`) and
    /// which private (`None`): every other one (`mixed`), or all one way.
    propagation: PropagationMix,
    /// Also time the floor (see `floor.rs`) on the same sandbox, before the
    /// supervisor starts.
    floor: bool,
    /// Off: no table watcher (so no (a) and (b)), to see what it costs the
    /// supervisor (its CPU time, and its brief holds of the namespace lock).
    table_watch: bool,
    /// Once the new mount has appeared, the watcher spends at most this
    /// share of its time looking (it pauses after each look for the look's
    /// cost times (100 - duty) / duty, at most 2 ms), so that looking after
    /// every single change does not slow the heal it measures. The pauses
    /// bound how late (a) can be; the longest is reported.
    watch_duty_percent: u32,
    /// The watcher's `SCHED_FIFO` priority once it has seen the new mount
    /// (0, the default: the normal scheduler; until then it runs at
    /// [`ANCHOR_PRIORITY`]). At the heal's own priority it takes CPU time
    /// from the heal it measures (100 targets, 100 readers: (a2) median 3.8
    /// -> 5.6 ms).
    watch_priority: u8,
    /// Also run each size without readers and without the table watcher, for
    /// the supervisor's own latency undisturbed by the measuring.
    clean_pass: bool,
}

impl Options {
    fn parse() -> Options {
        let flags = Flags::new("HEAL_BENCH");
        let daemon = |name: &str| match name {
            "demofs" => Some(Daemon::DemoFs),
            "bindfs" => Some(Daemon::Bindfs),
            _ => None,
        };
        Options {
            sizes: flags.list("sizes", "1,100,1000", |n| n.parse().ok()),
            cycles: flags.number("cycles", "20"),
            large_cycles: flags.number("large-cycles", "8"),
            daemons: flags.list("daemons", "demofs,bindfs", daemon),
            modes: flags.list("modes", "event", |name| match name {
                "event" => Some(Mode::Event),
                "poll" => Some(Mode::Poll),
                _ => None,
            }),
            poll_period: flags.text("poll-period", "5s"),
            supervisor_log: flags.text("supervisor-log", "info"),
            log_dir: Some(flags.text("log-dir", "")).filter(|dir| !dir.is_empty()).map(PathBuf::from),
            all_readers_up_to: flags.number("all-readers-up-to", "100"),
            sampled_readers: flags.number("sampled-readers", "20"),
            watch_duty_percent: flags.number::<u32>("watch-duty-percent", "10").clamp(1, 100),
            watch_priority: flags.number::<u8>("watch-priority", "0"),
            table_watch: flags.on_off("table-watch", "on"),
            clean_pass: flags.on_off("clean-pass", "on"),
            reader_interval: Duration::from_millis(flags.number("reader-interval-ms", "2")),
            readers_wake: flags.one("readers", "wake", |name| match name {
                "wake" => Some(true),
                "poll" => Some(false),
                _ => None,
            }),
            propagation: flags.one("propagation", "mixed", |name| match name {
                "mixed" => Some(PropagationMix::Mixed),
                "host-to-container" => Some(PropagationMix::HostToContainer),
                "none" => Some(PropagationMix::None),
                _ => None,
            }),
            floor: flags.on_off("floor", "on"),
        }
    }

    /// The same run without readers and without the table watcher.
    fn undisturbed(&self) -> Options {
        Options { table_watch: false, all_readers_up_to: 0, sampled_readers: 0, floor: false, ..self.clone() }
    }

    /// The volume's propagation in the container of the `index`th reader.
    fn propagation(&self, index: usize) -> Propagation {
        match self.propagation {
            PropagationMix::HostToContainer => Propagation::Slave,
            PropagationMix::None => Propagation::Private,
            PropagationMix::Mixed if index.is_multiple_of(2) => Propagation::Slave,
            PropagationMix::Mixed => Propagation::Private,
        }
    }

    fn cycles_for(&self, targets: usize) -> usize {
        if targets > 100 { self.large_cycles } else { self.cycles }
    }

    fn reader_indices(&self, targets: usize) -> Vec<usize> {
        if targets <= self.all_readers_up_to {
            return (0..targets).collect();
        }
        // Evenly spread, first and last included.
        match self.sampled_readers.min(targets) {
            0 => Vec::new(),
            1 => vec![0],
            sampled => (0..sampled).map(|i| i * (targets - 1) / (sampled - 1)).collect(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PropagationMix {
    Mixed,
    HostToContainer,
    None,
}

impl PropagationMix {
    fn name(self) -> &'static str {
        match self {
            PropagationMix::Mixed => "half HostToContainer, half None",
            PropagationMix::HostToContainer => "HostToContainer",
            PropagationMix::None => "None",
        }
    }
}

/// How the supervisor learns of the new global mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Its mount-table notification (the default).
    Event,
    /// Its next full scan on the timer.
    Poll,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Event => "event",
            Mode::Poll => "poll",
        }
    }

    fn args(self, options: &Options) -> Vec<String> {
        let mut args =
            vec!["--kubelet".to_owned(), "none".to_owned(), "--log".to_owned(), options.supervisor_log.clone()];
        if self == Mode::Poll {
            args.extend([
                "--mode".to_owned(),
                "poll".to_owned(),
                "--poll-period".to_owned(),
                options.poll_period.clone(),
            ]);
        }
        args
    }
}

/// What the table watcher saw of one restart, stamped at the wake-up whose
/// read first showed it.
#[derive(Debug, Clone, Default)]
struct Milestones {
    /// The new global mount: wake time (monotonic and wall clock) and device.
    appeared: Option<(Instant, SystemTime, Dev)>,
    /// Every target has been seen with the new mount on top (not
    /// necessarily in one read: flattening parks each target's new top for
    /// a moment, so at scale no single read shows them all on top).
    reachable: Option<Instant>,
    /// Every target is on the new mount with one layer.
    flat: Option<Instant>,
    /// The longest pause the watcher took between reads after the
    /// appearance: how late (a) can be at most.
    longest_pause: Duration,
}

struct Armed {
    source: PathBuf,
    old_dev: Dev,
    targets: Vec<WatchedTarget>,
    /// How many targets, in order, have been seen flat.
    flat: usize,
    seen: Milestones,
}

/// One target, as the watcher follows it.
struct WatchedTarget {
    path: PathBuf,
    /// The unique ID of the mount its layers sit on (the pod directory's):
    /// a target is flat when its top is on the new connection and mounted
    /// right there.
    base: u64,
    /// Seen with the new mount on top yet.
    reached: bool,
}

/// The mount on top at `path`: `statx` takes no lock, `statmount` holds the
/// namespace lock for microseconds.
fn top_mount(path: &Path) -> Option<MountSummary> {
    fuse::top_mount_id(path).and_then(statmount::mount_summary).ok()
}

/// The device of a FUSE mount on top at `source` that is not the dead one
/// on `old_dev`: the new mount of a restart, once there is one.
fn new_fuse_mount(source: &Path, old_dev: Dev) -> Option<Dev> {
    let top = top_mount(source)?;
    let dev = Dev::from(top.dev);
    (is_fuse_type(&top.fs_type) && dev != old_dev).then_some(dev)
}

/// The device of the mount on top at `path`, without a lock and without
/// asking its FUSE daemon.
fn top_dev(path: &Path) -> Option<Dev> {
    resolve::open_path(path).and_then(|fd| resolve::device_of(fd.as_fd())).ok().map(Dev::from)
}

impl Armed {
    /// Looks at the source and the targets by path and mount ID, never by
    /// reading the whole table: a read holds the (global) namespace lock,
    /// which every mount call of the heal needs, for hundreds of
    /// microseconds, and for milliseconds when the watcher is preempted in
    /// the middle of it by the readers it shares the CPUs with (seen with
    /// perf: the loop blocked in `down_write` in `mount_setattr` and
    /// `move_mount`; the p99 doubled). Whether a target is reached takes a
    /// `statx`, no lock; whether it is flat a `statmount` too, asked of the
    /// targets in order up to the first that is not.
    fn observe(&mut self, woke: (Instant, SystemTime)) {
        let Some((_, _, dev)) = self.seen.appeared else {
            if let Some(dev) = new_fuse_mount(&self.source, self.old_dev) {
                // The targets are looked at from the next wake on, once the
                // watcher is back at its own priority: at the anchor's, a
                // look at 1,000 targets held a CPU for 3-4 ms, which the
                // supervisor's probe and the new daemon were waiting for.
                // No target is healed at the instant its new mount appears.
                self.seen.appeared = Some((woke.0, woke.1, dev));
            }
            return;
        };
        if self.seen.flat.is_some() {
            return;
        }
        for target in self.targets.iter_mut().filter(|target| !target.reached) {
            target.reached = top_dev(&target.path) == Some(dev);
        }
        while let Some(target) = self.targets.get_mut(self.flat) {
            let top = top_mount(&target.path);
            if !top.is_some_and(|top| Dev::from(top.dev) == dev && top.parent_unique_id == target.base) {
                break;
            }
            target.reached = true;
            self.flat += 1;
        }
        if self.seen.reachable.is_none() && self.targets.iter().all(|target| target.reached) {
            self.seen.reachable = Some(woke.0);
        }
        if self.flat == self.targets.len() {
            self.seen.flat = Some(woke.0);
        }
    }
}

#[derive(Default)]
struct WatchState {
    armed: Option<Armed>,
    /// At [`ANCHOR_PRIORITY`], waiting for the new mount.
    anchoring: bool,
    wakes: u64,
    failure: Option<String>,
}

/// Watches the sandbox's mount table with `EPOLLPRI` on its mountinfo and
/// rereads and parses it after every wake-up.
struct TableWatch {
    state: Arc<(Mutex<WatchState>, Condvar)>,
    stop: Arc<Waker>,
    /// Tells the watcher it was armed (it raises its priority).
    armed: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

/// Caps the watcher's pause: a read slowed by a busy CPU would otherwise
/// make the next pause, and the error of (a), as long.
const LONGEST_PAUSE: Duration = Duration::from_millis(2);

const TABLE: u64 = 1;
const STOP: u64 = 2;
const ARMED: u64 = 3;

/// The watcher's `SCHED_FIFO` priority from its arming until it has seen the
/// new mount: above the heal's (1), so that it wakes first and the instant
/// every measure runs from is the new mount's, whichever healer (the
/// supervisor or the floor) would otherwise take the CPU first.
const ANCHOR_PRIORITY: u8 = 2;

impl TableWatch {
    fn start(sandbox: &Sandbox, duty_percent: u32, priority: u8) -> TableWatch {
        // Opened on the sandbox thread: the file shows that thread's namespace
        // for as long as it is open. Only polled: each change wakes the
        // watcher, which then looks at the mounts it follows.
        let table = sandbox.run(|| std::fs::File::open("/proc/thread-self/mountinfo")).expect("open sandbox mountinfo");
        let namespace = std::fs::File::open(sandbox.namespace_path()).expect("open the sandbox's mount namespace");
        let stop = Arc::new(Waker::new().expect("eventfd"));
        let armed = Arc::new(Waker::new().expect("eventfd"));
        let poller = Poller::new().expect("epoll");
        poller.add_priority(table.as_fd(), TABLE).expect("watch mountinfo");
        poller.add_readable(stop.as_fd(), STOP).expect("watch eventfd");
        poller.add_readable(armed.as_fd(), ARMED).expect("watch eventfd");
        let state: Arc<(Mutex<WatchState>, Condvar)> = Arc::default();
        let shared = Arc::clone(&state);
        let arming = Arc::clone(&armed);
        let thread = std::thread::Builder::new()
            .name("table-watch".into())
            .spawn(move || {
                // Paths and mount IDs are looked up in the sandbox's namespace.
                if let Err(err) = ns::enter_mount_namespace(namespace.as_fd()) {
                    let mut state = shared.0.lock().unwrap_or_else(PoisonError::into_inner);
                    state.failure = Some(format!("cannot enter the sandbox's mount namespace: {err}"));
                    shared.1.notify_all();
                    return;
                }
                // Kept open (polled) for as long as the watcher runs.
                let _table = table;
                if priority > 0 && !HealPriority::realtime(priority).raise() {
                    eprintln!("# the table watcher runs at the normal priority (no CAP_SYS_NICE?)");
                }
                let mut events = Vec::new();
                let (lock, changed) = &*shared;
                let mut pause = None;
                loop {
                    if let Some(pause) = pause.take() {
                        std::thread::sleep(pause);
                    }
                    if let Err(err) = poller.wait(&mut events, None) {
                        lock.lock().unwrap_or_else(PoisonError::into_inner).failure = Some(format!("epoll: {err}"));
                        changed.notify_all();
                        return;
                    }
                    let woke = (Instant::now(), SystemTime::now());
                    if events.contains(&STOP) {
                        return;
                    }
                    let mut state = lock.lock().unwrap_or_else(PoisonError::into_inner);
                    if events.contains(&ARMED) {
                        let _ = arming.drain();
                        if !HealPriority::realtime(ANCHOR_PRIORITY).raise() {
                            eprintln!("# the table watcher cannot raise its priority: (a) and (b) may start late");
                        }
                        state.anchoring = true;
                        changed.notify_all();
                        if !events.contains(&TABLE) {
                            continue;
                        }
                    }
                    state.wakes += 1;
                    if let Some(armed) = state.armed.as_mut() {
                        let noticing = armed.seen.appeared.is_none();
                        armed.observe(woke);
                        // Until the new mount appears, every wake is looked
                        // at at once: that instant anchors every measure.
                        // After it, looks are spaced out, the first by the
                        // longest pause (it looked at no target).
                        if armed.seen.appeared.is_some() {
                            let cost = woke.0.elapsed();
                            let gap = match noticing {
                                true => LONGEST_PAUSE,
                                false => (cost * (100 - duty_percent) / duty_percent).min(LONGEST_PAUSE),
                            };
                            armed.seen.longest_pause = armed.seen.longest_pause.max(gap);
                            pause = Some(gap);
                        }
                    }
                    if state.anchoring && state.armed.as_ref().is_some_and(|armed| armed.seen.appeared.is_some()) {
                        let _ = fuse_supervisor_sys::process::set_thread_realtime((priority > 0).then_some(priority));
                        state.anchoring = false;
                    }
                    changed.notify_all();
                }
            })
            .expect("start the table watcher");
        TableWatch { state, stop, armed, thread: Some(thread) }
    }

    /// Follows the restart of the source at `source` (now on `old_dev`,
    /// dead). Called between the crash and the restart.
    fn arm(&self, sandbox: &Sandbox, source: &Path, old_dev: Dev, targets: &[PathBuf]) {
        let paths = targets.to_vec();
        let targets = sandbox.run(move || {
            paths
                .into_iter()
                .map(|path| {
                    let base = top_mount(&path).expect("statmount of a stale target").parent_unique_id;
                    WatchedTarget { path, base, reached: false }
                })
                .collect()
        });
        let armed = Armed { source: source.to_path_buf(), old_dev, targets, flat: 0, seen: Milestones::default() };
        let (lock, changed) = &*self.state;
        let mut state = lock.lock().unwrap_or_else(PoisonError::into_inner);
        state.armed = Some(armed);
        state.anchoring = false;
        self.armed.wake().expect("wake the table watcher");
        // At its anchoring priority before the restart it times.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !state.anchoring && Instant::now() < deadline {
            state = changed.wait_timeout(state, Duration::from_millis(100)).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Waits until the armed restart is fully healed; returns what was seen
    /// (incomplete on timeout) and disarms.
    fn wait_healed(&self, timeout: Duration) -> Milestones {
        let (lock, changed) = &*self.state;
        let deadline = Instant::now() + timeout;
        let mut state = lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(failure) = &state.failure {
                panic!("table watcher failed: {failure}");
            }
            let done = state.armed.as_ref().is_some_and(|armed| armed.seen.flat.is_some());
            let left = deadline.saturating_duration_since(Instant::now());
            if done || left.is_zero() {
                return state.armed.take().map(|armed| armed.seen).unwrap_or_default();
            }
            state = changed.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    fn wakes(&self) -> u64 {
        self.state.0.lock().unwrap_or_else(PoisonError::into_inner).wakes
    }
}

impl Drop for TableWatch {
    fn drop(&mut self) {
        // The watcher holds the sandbox's mountinfo open, which keeps the
        // namespace (and its mounts) alive: it must end before the sandbox.
        let _ = self.stop.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One restart's numbers, in microseconds.
#[derive(Debug, Default)]
struct Cycle {
    reachable_us: Option<u64>,
    healed_us: Option<u64>,
    /// Every reader reads the new content.
    all_read_us: Option<u64>,
    /// Each reader's own time to read the new content.
    per_reader_us: Vec<u64>,
    /// The largest `latency_us` the supervisor logged for this restart.
    supervisor_us: Option<u64>,
    /// The largest `source_wait_us`: the new daemon's time to answer.
    source_wait_us: Option<u64>,
    /// The largest `latency_us - source_wait_us`: the supervisor's own time.
    after_source_us: Option<u64>,
    healed_lines: usize,
    table_wakes: u64,
    /// The watcher's longest pause between looks during the heal.
    watch_pause_us: u64,
    /// A floor cycle's own timings.
    floor: Option<FloorTimes>,
}

struct SizeResult {
    undisturbed: bool,
    /// Healed by the floor, not the supervisor.
    floor: bool,
    /// The readers' CPU time over the cycles' wall time, in % of one CPU.
    readers_cpu_percent: Option<f64>,
    mode: Mode,
    daemon: Daemon,
    targets: usize,
    readers: usize,
    cycles: Vec<Cycle>,
    timeline: Vec<String>,
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

fn global_dev(sandbox: &Sandbox, source: &Path) -> Dev {
    let source = source.to_path_buf();
    Dev::from(sandbox.run(move || top_mount(&source)).expect("the global mount is in the table").dev)
}

/// What the bench reads of a JSON log line.
struct LogLine {
    message: String,
    latency_us: Option<u64>,
    source_wait_us: Option<u64>,
    at: Option<SystemTime>,
}

/// The message and the numbers of a JSON log line; None for anything else.
fn log_fields(line: &str) -> Option<LogLine> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    let fields = value.get("fields")?;
    let number = |name: &str| fields.get(name).and_then(serde_json::Value::as_u64);
    Some(LogLine {
        message: fields.get("message")?.as_str()?.to_owned(),
        latency_us: number("latency_us"),
        source_wait_us: number("source_wait_us"),
        at: value.get("timestamp").and_then(serde_json::Value::as_str).and_then(parse_rfc3339),
    })
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (what tracing-subscriber writes) as a
/// wall-clock time.
fn parse_rfc3339(text: &str) -> Option<SystemTime> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut date_parts = date.split('-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (date_parts.next()??, date_parts.next()??, date_parts.next()??);
    let (clock, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut clock_parts = clock.split(':').map(|p| p.parse::<u64>().ok());
    let (hour, minute, second) = (clock_parts.next()??, clock_parts.next()??, clock_parts.next()??);
    let nanos: u32 = format!("{fraction:0<9}").get(..9)?.parse().ok()?;
    // Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
    // days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second;
    Some(UNIX_EPOCH + Duration::new(seconds, nanos))
}

fn reads_new(expected: &str) -> impl Fn(&fuse_supervisor_testbed::Observation) -> bool + '_ {
    move |observation| observation.content() == Some(expected)
}

/// The readers' CPU time so far, in clock ticks (`/proc/<pid>/stat`'s utime
/// and stime; 100 a second).
fn readers_cpu_ticks(readers: &[&ContainerReader]) -> u64 {
    readers
        .iter()
        .filter_map(|reader| std::fs::read_to_string(format!("/proc/{}/stat", reader.child().pid())).ok())
        .filter_map(|stat| {
            // After the command's closing parenthesis: state is field 3,
            // utime and stime fields 14 and 15.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

/// One crash and restart of `source`, timed from the new global mount as
/// the watcher saw it: (a) and (b). `arm` is told the dead connection just
/// before the restart. Returns the cycle and its anchor (the new mount's
/// wall-clock time, or the restart call's without a watcher).
fn crash_and_restart(
    sandbox: &Sandbox,
    source: &mut FuseSource,
    readers: &[&ContainerReader],
    watch: Option<&TableWatch>,
    target_paths: &[PathBuf],
    cycle: usize,
    arm: impl FnOnce(Dev),
) -> (Cycle, SystemTime) {
    let old_dev = global_dev(sandbox, &source.path);
    source.crash().expect("crash the daemon");
    for reader in readers {
        reader.wait_until(HEAL_TIMEOUT, |o| o.error().is_some()).expect("reader sees the crash");
    }
    if let Some(watch) = watch {
        watch.arm(sandbox, &source.path, old_dev, target_paths);
    }
    arm(old_dev);
    let restarted_wall = SystemTime::now();
    source.restart(sandbox, Restart::UnmountThenMount).expect("restart the daemon");
    let expected = source.expected_content();
    let mut result = Cycle::default();
    // Without the watcher, the timeline is anchored at the restart call
    // instead, and (a) and (b) are not measured.
    let mut anchor = restarted_wall;
    let Some(watch) = watch else { return (result, anchor) };
    let seen = watch.wait_healed(HEAL_TIMEOUT);
    let Some((appeared, appeared_wall, _)) = seen.appeared else {
        panic!("cycle {cycle}: the new global mount never appeared in the table");
    };
    anchor = appeared_wall;
    result.reachable_us = seen.reachable.map(|at| micros(at - appeared));
    result.healed_us = seen.flat.map(|at| micros(at - appeared));
    result.watch_pause_us = micros(seen.longest_pause);
    if seen.flat.is_none() {
        eprintln!("cycle {cycle}: not healed within {HEAL_TIMEOUT:?}; table:\n{}", sandbox.mountinfo());
    }
    for reader in readers {
        if reader.wait_until(HEAL_TIMEOUT, reads_new(&expected)).is_err() {
            eprintln!("cycle {cycle}: {} never read {expected:?}", reader.name());
            continue;
        }
        let first = reader.history().into_iter().find(|o| reads_new(&expected)(o)).map(|o| o.at);
        if let Some(at) = first {
            result.per_reader_us.push(micros(at.duration_since(anchor).unwrap_or_default()));
        }
    }
    if result.per_reader_us.len() == readers.len() {
        result.all_read_us = result.per_reader_us.iter().copied().max();
    }
    (result, anchor)
}

/// The floor's cycles (see `floor.rs`): the same crash and restart, healed
/// by the minimal healer, the supervisor not running.
fn floor_cycles(
    sandbox: &Sandbox,
    source: &mut FuseSource,
    readers: &[(ContainerReader, PathBuf, Propagation)],
    watch: &TableWatch,
    target_paths: &[PathBuf],
    cycles: usize,
) -> Vec<Cycle> {
    let containers = readers
        .iter()
        .map(|(reader, mount_point, propagation)| FloorContainer {
            pid: reader.child().pid(),
            mount_point: mount_point.clone(),
            propagation: *propagation,
        })
        .collect();
    let floor = FloorHealer::start(sandbox, &source.path, target_paths, containers);
    let readers: Vec<&ContainerReader> = readers.iter().map(|(reader, _, _)| reader).collect();
    let baseline = sandbox.count_mounts_under(sandbox.root());
    let mut results = Vec::with_capacity(cycles);
    for cycle in 0..cycles {
        let (mut result, _) =
            crash_and_restart(sandbox, source, &readers, Some(watch), target_paths, cycle, |dead| floor.arm(dead));
        match floor.wait(HEAL_TIMEOUT) {
            Ok(times) => {
                result.floor = Some(times);
            }
            Err(err) => panic!("cycle {cycle}: the floor did not heal: {err}\n{}", sandbox.mountinfo()),
        }
        wait_for("baseline mount count", Duration::from_secs(10), || {
            sandbox.count_mounts_under(sandbox.root()) == baseline
        })
        .unwrap_or_else(|_| panic!("cycle {cycle}: the floor left layers behind:\n{}", sandbox.mountinfo()));
        eprintln!(
            "  floor {cycle:>2}: healed {:?} µs, all read {:?} µs, host {} µs ({} detached alone), containers {:?} µs",
            result.healed_us,
            result.all_read_us,
            result.floor.map_or(0, |f| f.host_us),
            result.floor.map_or(0, |f| f.detached_alone),
            result.floor.and_then(|f| f.containers_us),
        );
        results.push(result);
    }
    results
}

fn run_size(options: &Options, mode: Mode, daemon: Daemon, targets: usize) -> Vec<SizeResult> {
    let binary = Path::new(BINARY);
    let cycles = options.cycles_for(targets);
    eprintln!("# {} with {targets} target(s), {} mode: setting up", daemon.name(), mode.name());
    // Dropped in reverse order: watcher, readers, supervisor, source, sandbox.
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start the FUSE daemon");
    let target_paths: Vec<PathBuf> = (0..targets)
        .map(|pod| source.bind_volume(&sandbox, &format!("pod-{pod:05}"), "data").expect("bind a pod volume"))
        .collect();
    let readers_started = options.reader_indices(targets).len();
    let readers: Vec<(ContainerReader, PathBuf, Propagation)> = options
        .reader_indices(targets)
        .into_iter()
        .map(|index| {
            let name = format!("reader-{index:05}");
            let container = ContainerOptions {
                volume: target_paths[index].clone(),
                rootfs: sandbox.container_rootfs(&name).expect("container rootfs"),
                hide: vec![sandbox.kubelet_root(), sandbox.runtime_root()],
                read: PathBuf::from(DATA_FILE),
                interval: if options.readers_wake { WAKING_READERS_INTERVAL } else { options.reader_interval },
                wake_on_mount_change: options.readers_wake,
                propagation: options.propagation(index),
            };
            let reader = ContainerReader::spawn_with(&sandbox, &name, &container).expect("start a container reader");
            (reader, ContainerReader::volume_in_container(&container), container.propagation)
        })
        .collect();
    for (reader, _, _) in &readers {
        reader.wait_until(HEAL_TIMEOUT, reads_new(&source.expected_content())).expect("reader reads the source");
    }
    let reader_refs: Vec<&ContainerReader> = readers.iter().map(|(reader, _, _)| reader).collect();
    let watch =
        options.table_watch.then(|| TableWatch::start(&sandbox, options.watch_duty_percent, options.watch_priority));
    let mut results = Vec::new();
    if let Some(watch) = watch.as_ref().filter(|_| options.floor) {
        eprintln!("# the floor, before the supervisor starts");
        let ticks = readers_cpu_ticks(&reader_refs);
        let started = Instant::now();
        let floor = floor_cycles(&sandbox, &mut source, &readers, watch, &target_paths, cycles);
        results.push(SizeResult {
            undisturbed: false,
            floor: true,
            mode,
            daemon,
            targets,
            readers: readers_started,
            readers_cpu_percent: cpu_percent(readers_cpu_ticks(&reader_refs) - ticks, started.elapsed()),
            cycles: floor,
            timeline: Vec::new(),
        });
    }
    let supervisor = SupervisorProcess::start_with(&sandbox, binary, &sandbox.root().join("state"), mode.args(options))
        .expect("start the supervisor");
    // Measure a settled supervisor: its start-up search for the daemon
    // reads every process's descriptors and would compete with the first heal.
    if std::env::var("FUSE_SUPERVISOR_PROCESS_WATCH").as_deref() != Ok("off") {
        supervisor
            .wait_for_log(HEAL_TIMEOUT, |line| line.contains("watching the FUSE daemon"))
            .expect("the supervisor finds the daemon");
    }
    let baseline = sandbox.count_mounts_under(sandbox.root());
    let ticks = readers_cpu_ticks(&reader_refs);
    let started = Instant::now();
    let mut measured = Vec::with_capacity(cycles);
    let mut timeline = Vec::new();
    for cycle in 0..cycles {
        let log_start = supervisor.log_len();
        let wakes_before = watch.as_ref().map_or(0, TableWatch::wakes);
        let (mut result, anchor) =
            crash_and_restart(&sandbox, &mut source, &reader_refs, watch.as_ref(), &target_paths, cycle, |_| ());
        // The heal is done; let the supervisor finish its log and its
        // follow-up scans before the next crash.
        let _ = supervisor.wait_for_lines(Duration::from_secs(10), log_start, targets, |l| l.contains("\"healed\""));
        let _ = wait_for("baseline mount count", Duration::from_secs(10), || {
            sandbox.count_mounts_under(sandbox.root()) == baseline
        });
        std::thread::sleep(Duration::from_millis(100));
        let log = supervisor.log();
        let mut heal_latencies = Vec::new();
        let mut source_waits = Vec::new();
        // Runs of one message in log order: (message, first offset, count).
        let mut events: Vec<(String, i64, usize)> = Vec::new();
        for LogLine { message, latency_us, source_wait_us, at } in log[log_start..].iter().filter_map(|l| log_fields(l))
        {
            if message == "healed"
                && let Some(latency) = latency_us
            {
                heal_latencies.push(latency);
                if let Some(wait) = source_wait_us {
                    source_waits.push((wait, latency.saturating_sub(wait)));
                }
            }
            if let Some(at) = at {
                let offset = match at.duration_since(anchor) {
                    Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
                    Err(before) => -i64::try_from(before.duration().as_micros()).unwrap_or(i64::MAX),
                };
                match events.last_mut() {
                    Some((last, _, count)) if *last == message => *count += 1,
                    _ => events.push((message, offset, 1)),
                }
            }
        }
        result.healed_lines = heal_latencies.len();
        result.supervisor_us = heal_latencies.iter().copied().max();
        result.source_wait_us = source_waits.iter().map(|(wait, _)| *wait).max();
        result.after_source_us = source_waits.iter().map(|(_, after)| *after).max();
        result.table_wakes = watch.as_ref().map_or(0, TableWatch::wakes) - wakes_before;
        // The slowest cycle's timeline is the one worth reading.
        let slowest = measured.iter().all(|earlier: &Cycle| earlier.supervisor_us <= result.supervisor_us);
        if slowest {
            timeline = events
                .into_iter()
                .map(|(message, offset, count)| format!("{:>+10.3} ms  {message} (x{count})", offset as f64 / 1000.0))
                .collect();
        }
        eprintln!(
            "  cycle {cycle:>2}: reachable {:?} µs, healed {:?} µs, all read {:?} µs, supervisor {:?} µs, {} heal lines, {} table wakes",
            result.reachable_us,
            result.healed_us,
            result.all_read_us,
            result.supervisor_us,
            result.healed_lines,
            result.table_wakes
        );
        measured.push(result);
    }
    let readers_cpu_percent = cpu_percent(readers_cpu_ticks(&reader_refs) - ticks, started.elapsed());
    drop(watch);
    drop(reader_refs);
    drop(readers);
    if let Some(dir) = &options.log_dir {
        let path = dir.join(format!("{}-{}-{targets}.log", daemon.name(), mode.name()));
        if let Err(err) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, supervisor.log().join("\n")))
        {
            eprintln!("cannot keep the supervisor log in {}: {err}", path.display());
        }
    }
    if let Err(err) = supervisor.stop() {
        eprintln!("supervisor did not stop cleanly: {err}");
    }
    results.push(SizeResult {
        undisturbed: !options.table_watch && readers_started == 0,
        floor: false,
        mode,
        daemon,
        targets,
        readers: readers_started,
        readers_cpu_percent,
        cycles: measured,
        timeline,
    });
    results
}

/// CPU time in clock ticks over `wall`, as a share of one CPU.
fn cpu_percent(ticks: u64, wall: Duration) -> Option<f64> {
    (!wall.is_zero()).then(|| ticks as f64 / 100.0 / wall.as_secs_f64() * 100.0)
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(us: u64) -> String {
    format!("{:.3}", us as f64 / 1000.0)
}

fn row(measure: &str, result: &SizeResult, mut values: Vec<u64>, missing: usize, target: &str) {
    values.sort_unstable();
    let (p50, p99, max) = if values.is_empty() {
        ("-".to_owned(), "-".to_owned(), "-".to_owned())
    } else {
        (ms(percentile(&values, 50.0)), ms(percentile(&values, 99.0)), ms(*values.last().unwrap_or(&0)))
    };
    let missing = if missing > 0 { format!(" ({missing} missing)") } else { String::new() };
    println!(
        "{:<7} {:<5} {:>5}  {:<38} {:>6}{missing}  {:>9}  {:>9}  {:>9}  {target}",
        result.daemon.name(),
        if result.floor { "floor" } else { result.mode.name() },
        result.targets,
        measure,
        values.len(),
        p50,
        p99,
        max
    );
}

fn report(results: &[SizeResult], options: &Options) {
    println!();
    println!("heal latency, crash -> restart (unmount, then mount), ms");
    println!("(a), (b): from the new global mount appearing in the sandbox (EPOLLPRI wake-up of a watcher on");
    println!("  its mountinfo, at SCHED_FIFO above the healers' until it has seen the new mount, so that it");
    println!("  wakes first); it looks at the source and the targets by path and mount ID (statx, statmount;");
    println!("  never a whole-table read, which would hold the namespace lock the heal needs); after that it spends");
    println!(
        "  at most {}% of its time looking, so (a) can be late by its longest pause (listed below per N).",
        options.watch_duty_percent
    );
    match options.readers_wake {
        true => println!(
            "(b): container readers ({}), failing, read again when their namespace's mount table changes",
            options.propagation.name(),
        ),
        false => println!(
            "(b): container readers ({}) poll every {:?} throughout (saturated: served reads load the daemon);",
            options.propagation.name(),
            options.reader_interval
        ),
    }
    if options.readers_wake {
        println!("  (POLLPRI on their own mountinfo) and every {WAKING_READERS_INTERVAL:?} otherwise;");
    }
    println!("  their own timestamps; what they cost is listed below per N, in % of one CPU over the cycles.");
    if options.floor {
        println!("floor: the same crash and restart on the same sandbox, before the supervisor starts, healed by");
        println!("  a minimal healer told the layout: woken on the table, SCHED_FIFO, the new source slid beneath");
        println!("  each host target and one detach; per container, on a thread kept per namespace, one clone,");
        println!("  setns, slide beneath, detach. No probe, no plan, no checks: the kernel's cost of one layer");
        println!("  everywhere, plus the new daemon's first answers.");
    }
    println!("supervisor: its logged latency_us (loop wake-up for the table change -> heal done), max per cycle;");
    println!("  source_wait_us is the part spent waiting for the new daemon to answer the probe (its INIT and");
    println!("  one statfs), which no heal may skip; the rest is the heal's own.");
    println!("  \"undisturbed\" rows are a second run without readers and without the watcher.");
    if options.modes.contains(&Mode::Poll) {
        println!(
            "mode poll: the supervisor scans every {} instead of waking on the table change, so (a) and (b)",
            options.poll_period
        );
        println!("  include the wait for the next scan, and its latency_us runs from that scan's timer wake-up.");
    }
    println!("percentiles are nearest-rank over the n samples (p99 of 20 samples is the max).");
    println!();
    println!(
        "{:<7} {:<5} {:>5}  {:<38} {:>6}  {:>9}  {:>9}  {:>9}  target",
        "daemon", "mode", "N", "measure", "n", "p50", "p99", "max"
    );
    for result in results {
        let cycles = &result.cycles;
        let collect = |f: fn(&Cycle) -> Option<u64>| -> (Vec<u64>, usize) {
            let values: Vec<u64> = cycles.iter().filter_map(f).collect();
            let missing = cycles.len() - values.len();
            (values, missing)
        };
        let heal_target =
            if result.targets == 100 && result.mode == Mode::Event { "100 targets healed: p99 < 10 ms" } else { "" };
        if result.undisturbed {
            let (values, missing) = collect(|c| c.supervisor_us);
            row("supervisor latency_us, undisturbed", result, values, missing, heal_target);
            continue;
        }
        let reads_target = if result.targets == 100 { "p99 <= 10 ms" } else { "" };
        if cycles.iter().any(|c| c.healed_us.is_some()) {
            let (values, missing) = collect(|c| c.reachable_us);
            row("(a1) all targets seen on the new mount", result, values, missing, "");
            let (values, missing) = collect(|c| c.healed_us);
            row("(a2) all targets healed, 1 layer", result, values, missing, heal_target);
        }
        if result.readers > 0 && cycles.iter().any(|c| c.all_read_us.is_some()) {
            let (values, missing) = collect(|c| c.all_read_us);
            let sampled = if result.readers < result.targets { " sampled" } else { "" };
            row(&format!("(b)  all {}{sampled} readers read", result.readers), result, values, missing, reads_target);
            let per_reader: Vec<u64> = cycles.iter().flat_map(|c| c.per_reader_us.iter().copied()).collect();
            row("(b') each reader reads (pooled)", result, per_reader, 0, "");
        }
        if result.floor {
            let (values, missing) = collect(|c| c.floor.map(|floor| floor.host_us));
            row("floor's clock: host targets, 1 layer", result, values, missing, "");
            let (values, missing) = collect(|c| c.floor.and_then(|floor| floor.containers_us));
            row("floor's clock: last container replaced", result, values, missing, "");
            continue;
        }
        let (values, missing) = collect(|c| c.supervisor_us);
        row("supervisor latency_us", result, values, missing, "");
        let (values, missing) = collect(|c| c.source_wait_us);
        row("  of which source_wait_us (the daemon)", result, values, missing, "");
        let (values, missing) = collect(|c| c.after_source_us);
        row("  the rest: the supervisor's own", result, values, missing, "");
    }
    println!();
    for result in results {
        let lines: Vec<usize> = result.cycles.iter().map(|c| c.healed_lines).collect();
        let run = if result.undisturbed {
            "undisturbed"
        } else if result.floor {
            "floor"
        } else {
            "measured"
        };
        println!(
            "{} {} N={} ({run}): \"healed\" log lines per cycle {:?}",
            result.daemon.name(),
            result.mode.name(),
            result.targets,
            lines
        );
        if !result.undisturbed {
            let wakes: Vec<u64> = result.cycles.iter().map(|c| c.table_wakes).collect();
            let pause = result.cycles.iter().map(|c| c.watch_pause_us).max().unwrap_or(0);
            println!("  table watcher wake-ups per cycle {wakes:?}; longest pause between looks {} ms", ms(pause));
        }
        if let Some(percent) = result.readers_cpu_percent.filter(|_| result.readers > 0) {
            println!("  the {} readers used {percent:.1}% of one CPU over the cycles", result.readers);
        }
        if result.readers < result.targets && result.readers > 0 {
            println!("  readers sampled: {} of {} targets (evenly spread)", result.readers, result.targets);
        }
        let anchor = if result.undisturbed { "the restart call" } else { "the new mount appeared" };
        println!("  supervisor log of the slowest cycle (runs of one message in log order, ms after {anchor}):");
        for line in &result.timeline {
            println!("    {line}");
        }
    }
}

fn main() {
    let options = Options::parse();
    if !is_root() {
        eprintln!("heal_latency needs root (mount namespaces, /dev/fuse): skipped");
        return;
    }
    let mut results = Vec::new();
    for &daemon in &options.daemons {
        for &targets in &options.sizes {
            for &mode in &options.modes {
                results.extend(run_size(&options, mode, daemon, targets));
                if options.clean_pass && (options.table_watch || !options.reader_indices(targets).is_empty()) {
                    results.extend(run_size(&options.undisturbed(), mode, daemon, targets));
                }
            }
        }
    }
    report(&results, &options);
}
