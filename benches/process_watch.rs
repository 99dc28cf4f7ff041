//! Process watchers: how fast a death is reported, and what the node-wide
//! proc connector costs under process churn. A benchmark, not a test: it
//! prints numbers.
//!
//! ```text
//! cargo bench --bench process_watch [-- --kills 200 --daemon-kills 20 --seconds 10 --rate 1000]
//! ```
//!
//! 1. Death-to-event latency, both backends: SIGKILL sent → `Exited`
//!    received by the consumer thread, p50/p90/p99. First on plain `sleep`
//!    processes, then on FUSE daemons (demofs, in a private mount namespace)
//!    whose exit also tears down a FUSE connection. For the proc connector
//!    the kernel's exit timestamp splits it into kill → death and death →
//!    delivery.
//! 2. CPU of the proc-connector watcher thread (`schedstat` on-CPU time)
//!    while the bench forks and reaps `/bin/true` at a steady rate: without
//!    the kernel filter, with it (exit + exec, the default), with exit only,
//!    and with no load (what the rest of the machine costs it meanwhile);
//!    then the daemons' watcher beside a second that takes every exec (the
//!    namespace keeper), on one shared connector and on two.
//!
//! Every flag is also an environment variable (`PROCESS_WATCH_BENCH_RATE`…).
//! Needs root (and /dev/fuse for the daemons).
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use fuse_supervisor_engine::watch::processes::{
    ConnectorOptions, EventSink, ExecReports, PidfdWatcher, ProcConnectorWatcher, ProcessConnector, ProcessEvent,
    ProcessId, ProcessWatcher, Subscription,
};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource};

#[allow(dead_code)]
mod common;

use common::Flags;

const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

struct Options {
    kills: usize,
    daemon_kills: usize,
    window: Duration,
    rate: u64,
}

impl Options {
    /// `--flag value` from the command line, else `PROCESS_WATCH_BENCH_FLAG`,
    /// else the default. Unknown arguments (cargo passes `--bench`) are ignored.
    fn parse() -> Options {
        let flags = Flags::new("PROCESS_WATCH_BENCH");
        Options {
            kills: flags.number("kills", "200"),
            daemon_kills: flags.number("daemon-kills", "20"),
            window: Duration::from_secs(flags.number("seconds", "10")),
            rate: flags.number("rate", "1000"),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Connector,
    Pidfd,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Connector => "proc connector",
            Kind::Pidfd => "pidfd",
        }
    }

    fn start(self) -> (Box<dyn ProcessWatcher>, Receiver<ProcessEvent>) {
        let (events, inbox) = mpsc::channel();
        let sink = Box::new(move |event| events.send(event).is_ok());
        let watcher: Box<dyn ProcessWatcher> = match self {
            Kind::Connector => {
                let watcher = ProcConnectorWatcher::start(ConnectorOptions::default(), Subscription::default(), sink);
                Box::new(watcher.expect("subscribe"))
            }
            Kind::Pidfd => Box::new(PidfdWatcher::start(PathBuf::from("/proc"), sink).expect("pidfd watcher")),
        };
        (watcher, inbox)
    }
}

/// Waits for the `Exited` of `pid`; returns when it was received and the
/// death time the watcher reported.
fn exited(inbox: &Receiver<ProcessEvent>, pid: u32) -> (Instant, Instant) {
    loop {
        match inbox.recv_timeout(EVENT_TIMEOUT).expect("an exit event in time") {
            ProcessEvent::Exited { pid: exited, at, .. } if exited == pid => return (Instant::now(), at),
            ProcessEvent::Failed(err) => panic!("watcher failed: {err}"),
            _ => {}
        }
    }
}

/// Percentiles of a sample, in microseconds.
fn summary(label: &str, mut sample: Vec<Duration>) {
    sample.sort_unstable();
    let at = |q: f64| sample[((sample.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
    println!(
        "{label:<58} n={:<4} p50 {:>8.1} µs  p90 {:>8.1} µs  p99 {:>8.1} µs  max {:>8.1} µs",
        sample.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0)
    );
}

/// Kill → received, and (proc connector) kill → death and death → received.
#[derive(Default)]
struct Latencies {
    total: Vec<Duration>,
    to_death: Vec<Duration>,
    delivery: Vec<Duration>,
}

impl Latencies {
    fn record(&mut self, killed: Instant, (received, died): (Instant, Instant)) {
        self.total.push(received - killed);
        self.to_death.push(died.saturating_duration_since(killed));
        self.delivery.push(received.saturating_duration_since(died));
    }

    fn print(self, kind: Kind, what: &str) {
        summary(&format!("{}: SIGKILL → Exited received ({what})", kind.name()), self.total);
        if kind == Kind::Connector {
            summary("    of which SIGKILL → death (kernel timestamp)", self.to_death);
            summary("    of which death → Exited received", self.delivery);
        }
    }
}

fn plain_process_latency(kind: Kind, kills: usize) {
    let (watcher, inbox) = kind.start();
    let mut latencies = Latencies::default();
    for _ in 0..kills {
        let mut child = Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().expect("spawn sleep");
        let id = ProcessId::of(Path::new("/proc"), child.id()).expect("identity");
        watcher.watch(id).expect("watch");
        let killed = Instant::now();
        child.kill().expect("kill");
        latencies.record(killed, exited(&inbox, id.pid));
        child.wait().expect("reap");
    }
    latencies.print(kind, "sleep processes");
}

fn daemon_latency(kind: Kind, kills: usize) {
    let sandbox = Sandbox::new().expect("sandbox");
    let (watcher, inbox) = kind.start();
    let mut source = FuseSource::start(&sandbox, Daemon::DemoFs, "bench").expect("start demofs");
    let mut latencies = Latencies::default();
    for round in 0..kills {
        if round > 0 {
            source.restart(&sandbox, fuse_supervisor_testbed::scenario::Restart::UnmountThenMount).expect("restart");
        }
        let pid = source.pid().expect("daemon running");
        watcher.watch(ProcessId::of(Path::new("/proc"), pid).expect("identity")).expect("watch");
        let killed = Instant::now();
        fuse_supervisor_sys::process::signal(pid, fuse_supervisor_sys::process::Signal::Kill).expect("kill");
        latencies.record(killed, exited(&inbox, pid));
        source.crash().expect("reap");
    }
    latencies.print(kind, "demofs FUSE daemons");
}

/// On-CPU nanoseconds of this process's thread named `name`. A thread names
/// itself once it runs, so a just-started one is waited for a little.
/// The on-CPU time of every thread named `name`, added up.
fn thread_cpu_ns(name: &str) -> u64 {
    for _ in 0..100 {
        let tasks = std::fs::read_dir("/proc/self/task").expect("list threads");
        let mut found = None;
        for task in tasks.map_while(Result::ok) {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() == name {
                let schedstat = std::fs::read_to_string(task.path().join("schedstat")).expect("schedstat");
                let ns: u64 = schedstat.split_whitespace().next().and_then(|ns| ns.parse().ok()).expect("on-CPU time");
                *found.get_or_insert(0) += ns;
            }
        }
        if let Some(ns) = found {
            return ns;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no thread named {name}");
}

/// Forks and reaps `/bin/true` at `rate` per second until `stop`; returns
/// how many ran. Children are reaped by a second thread so that spawning
/// keeps its pace.
fn churn(rate: u64, window: Duration) -> u64 {
    let (spawned, reap) = mpsc::channel::<Child>();
    let reaper = std::thread::spawn(move || {
        for mut child in reap {
            let _ = child.wait();
        }
    });
    let interval = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let started = Instant::now();
    let mut count = 0u64;
    while started.elapsed() < window {
        let due = started + interval * count as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let child = Command::new("/bin/true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn /bin/true");
        count += 1;
        let _ = spawned.send(child);
    }
    drop(spawned);
    let _ = reaper.join();
    count
}

struct Load {
    label: &'static str,
    kernel_filter: bool,
    exec: ExecReports,
    rate: u64,
    /// A second watcher of every exec, as the namespace keeper is beside
    /// the daemons' watcher: on the same connector (true) or its own.
    second: Option<bool>,
}

fn connector_cpu(load: &Load, window: Duration) {
    let lost = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&lost);
    let ready = Arc::new(Barrier::new(2));
    let options = ConnectorOptions {
        kernel_filter: load.kernel_filter,
        execs: load.exec != ExecReports::Off || load.second.is_some(),
        ..ConnectorOptions::default()
    };
    let sink = move || -> EventSink {
        let counter = Arc::clone(&counter);
        Box::new(move |event| {
            match event {
                ProcessEvent::Lost => {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                ProcessEvent::Failed(err) => panic!("watcher failed: {err:?}"),
                _ => {}
            }
            true
        })
    };
    let connector = ProcessConnector::open(options.clone()).expect("subscribe");
    let watcher = connector.watcher(Subscription { exec: load.exec, batch_window: None }, sink());
    let every_exec = Subscription { exec: ExecReports::All, batch_window: None };
    let second = match load.second {
        None => None,
        Some(true) => Some(connector.watcher(every_exec, sink())),
        Some(false) => Some(ProcConnectorWatcher::start(options, every_exec, sink()).expect("subscribe")),
    };
    let decoded = || {
        let own = second.as_ref().filter(|_| load.second == Some(false));
        connector.events_decoded() + own.map_or(0, |watcher| watcher.connector().events_decoded())
    };
    // One watched process, as a supervisor would have: its daemon.
    let mut daemon = Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().expect("spawn sleep");
    watcher.watch(ProcessId::of(Path::new("/proc"), daemon.id()).expect("identity")).expect("watch");
    let gate = Arc::clone(&ready);
    let rate = load.rate;
    let generator = std::thread::spawn(move || {
        gate.wait();
        if rate == 0 {
            std::thread::sleep(window);
            0
        } else {
            churn(rate, window)
        }
    });
    let before = thread_cpu_ns("procwatch");
    let decoded_before = decoded();
    let opened = Instant::now();
    ready.wait();
    let spawned = generator.join().expect("generator");
    // Let the watcher drain what is queued before reading its clock.
    std::thread::sleep(Duration::from_millis(200));
    let cpu = Duration::from_nanos(thread_cpu_ns("procwatch") - before);
    let decoded = decoded() - decoded_before;
    let elapsed = opened.elapsed();
    let per_event =
        if decoded > 0 { format!("{:.2} µs", cpu.as_secs_f64() * 1e6 / decoded as f64) } else { "-".to_owned() };
    println!(
        "{:<42} filter {:<5} {:>6} processes ({:>5.0}/s)  {:>7} events decoded  watcher CPU {:>7.1} ms = {:>5.2} % of a core  {per_event:>8}/event  lost {}",
        load.label,
        connector.kernel_filter(),
        spawned,
        spawned as f64 / window.as_secs_f64(),
        decoded,
        cpu.as_secs_f64() * 1e3,
        cpu.as_secs_f64() / elapsed.as_secs_f64() * 100.0,
        lost.load(Ordering::Relaxed),
    );
    let _ = daemon.kill();
    let _ = daemon.wait();
    drop(second);
}

fn main() {
    let options = Options::parse();
    println!("# death-to-event latency");
    for kind in [Kind::Connector, Kind::Pidfd] {
        plain_process_latency(kind, options.kills);
    }
    for kind in [Kind::Connector, Kind::Pidfd] {
        daemon_latency(kind, options.daemon_kills);
    }
    println!(
        "# proc-connector watcher CPU, {} s per line, churn target {} processes/s (fork+exec+exit of /bin/true)",
        options.window.as_secs(),
        options.rate
    );
    let loads = [
        Load {
            label: "no load (the rest of the machine)",
            kernel_filter: true,
            exec: ExecReports::Watched,
            rate: 0,
            second: None,
        },
        Load {
            label: "churn, no kernel filter",
            kernel_filter: false,
            exec: ExecReports::Watched,
            rate: options.rate,
            second: None,
        },
        Load {
            label: "churn, kernel filter exit+exec (default)",
            kernel_filter: true,
            exec: ExecReports::Watched,
            rate: options.rate,
            second: None,
        },
        Load {
            label: "churn, kernel filter exit only",
            kernel_filter: true,
            exec: ExecReports::Off,
            rate: options.rate,
            second: None,
        },
        Load {
            label: "churn, + every exec's watcher, one socket",
            kernel_filter: true,
            exec: ExecReports::All,
            rate: options.rate,
            second: Some(true),
        },
        Load {
            label: "churn, + every exec's watcher, two sockets",
            kernel_filter: true,
            exec: ExecReports::All,
            rate: options.rate,
            second: Some(false),
        },
    ];
    // Twice, interleaved: the rest of the machine (other builds) is noise.
    for _ in 0..2 {
        for load in &loads {
            connector_cpu(load, options.window);
        }
    }
}
