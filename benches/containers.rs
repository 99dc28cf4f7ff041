//! The heal inside containers, end to end: N real runc containers (a static
//! busybox, each on a pod target of its own bound `rbind,rprivate`, the
//! default `mountPropagation: None`, so only the in-namespace heal reaches
//! them) reading one global FUSE mount (demofs), `fuse-supervisor run`
//! watching, and the daemon crashing and coming back (unmount, then mount)
//! K times. Per heal:
//!
//! - new mount → last container healed: the supervisor's `latency_us` of
//!   its `container healed` lines (from the first sight of the new mount to
//!   the end of the batch's parallel heal in the containers);
//! - new mount → last container reads again: from the same first sight
//!   (the host `healed` line's timestamp less its `latency_us`) to the
//!   latest of the containers' first good reads, each stamped as its line
//!   arrives (so late by up to one `--interval-ms`);
//! - the host heal's `latency_us` (its slowest target) with the containers,
//!   then from its end to the containers' batch beginning, and that batch
//!   (`took_us`), which add up to the first figure; and in a second run
//!   with the same targets and as many containers reading a tmpfs instead
//!   (the same load, nothing of the connection in them): what healing the
//!   containers adds to the host heal;
//! - the daemon's death → its mounts in containers isolated (the search
//!   for them and making them private, `took_us` of the `containers' dead
//!   mounts isolated` line), and the search alone (`searched_us`), with the
//!   namespaces kept by events and, in a third run, with
//!   `--container-namespaces walk` (a walk of `/proc`), whose heals are
//!   shown too.
//!
//! A benchmark, not a test: it prints numbers.
//!
//! ```text
//! cargo bench --bench containers [-- --sizes 10,100 --cycles 20 --interval-ms 10 --walk on]
//! ```
//!
//! Every flag is also an environment variable (`CONTAINERS_BENCH_SIZES`…).
//! Needs root, /dev/fuse and runc with busybox-static; everything runs in
//! a private mount namespace that dies with the run.
use std::path::Path;
use std::time::{Duration, SystemTime};

use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::runc::{Runc, RuncContainer, RuncSpec, VolumePropagation};
use fuse_supervisor_testbed::scenario::{self, DATA_FILE, Daemon, FuseSource, Restart, SupervisorProcess};

#[allow(dead_code)]
mod common;

use common::{Flags, log_lines, timestamp};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    if !common::is_root() {
        eprintln!("containers bench: needs root (mount namespaces, /dev/fuse, runc); not run");
        return;
    }
    let flags = Flags::new("CONTAINERS_BENCH");
    let sizes = flags.list("sizes", "10,100", |size| size.parse::<usize>().ok());
    let cycles: usize = flags.number("cycles", "20");
    let interval = Duration::from_millis(flags.number("interval-ms", "10"));
    let compare_walk = flags.on_off("walk", "on");
    println!("heals in runc containers (None propagation), {cycles} restarts of demofs, reads every {interval:?}");
    for size in sizes {
        let with = measure(size, cycles, interval, true, "events");
        let without = measure(size, cycles, interval, false, "events");
        println!("{size} containers");
        println!("  new mount → last container healed        {}", summary(&with.containers_healed));
        println!("  new mount → last container reads again   {}", summary(&with.containers_read));
        println!("  host heal, with the containers           {}", summary(&with.host));
        println!("    host heal → containers' heal begins    {}", summary(&with.between));
        println!("    the containers' heal                   {}", summary(&with.containers_took));
        println!("  host heal, containers reading a tmpfs    {}", summary(&without.host));
        println!("  death → containers isolated              {}", summary(&with.isolated));
        println!("    of which the search                    {}", summary(&with.searched));
        if compare_walk {
            let walked = measure(size, cycles, interval, true, "walk");
            println!("  with --container-namespaces walk:");
            println!("  new mount → last container healed        {}", summary(&walked.containers_healed));
            println!("  host heal, with the containers           {}", summary(&walked.host));
            println!("  death → containers isolated              {}", summary(&walked.isolated));
            println!("    of which the search                    {}", summary(&walked.searched));
        }
    }
}

/// Per heal, in µs.
#[derive(Default)]
struct Figures {
    host: Vec<u64>,
    containers_healed: Vec<u64>,
    /// From the host heal's end to the containers' batch beginning.
    between: Vec<u64>,
    /// The containers' batch, all in parallel.
    containers_took: Vec<u64>,
    containers_read: Vec<u64>,
    isolated: Vec<u64>,
    searched: Vec<u64>,
}

/// `size` pod targets on one demofs and as many containers reading every
/// `interval`, each a target (`on_volumes`) or a tmpfs directory, through
/// `cycles` restarts, the containers' namespaces known by `namespaces`
/// (`--container-namespaces`).
fn measure(size: usize, cycles: usize, interval: Duration, on_volumes: bool, namespaces: &str) -> Figures {
    let binary = Path::new(BINARY);
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::DemoFs, "bench-data").expect("daemon");
    let runc = Runc::new(&sandbox).expect("runc image");
    let mut containers: Vec<RuncContainer> = Vec::new();
    for pod in 0..size {
        let name = format!("pod-{pod:04}");
        let target = source.bind_volume(&sandbox, &name, "data").expect("bind");
        let volume = if on_volumes {
            target
        } else {
            let dir = sandbox.root().join("tmpfs-volumes").join(&name);
            let file = dir.join(DATA_FILE);
            sandbox
                .run(move || std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(file, "idle")))
                .expect("dir");
            sandbox.root().join("tmpfs-volumes").join(&name)
        };
        let spec = RuncSpec::reader(name, volume, VolumePropagation::None, DATA_FILE, interval);
        containers.push(runc.start(&spec).expect("start a container"));
    }
    let state_dir = sandbox.root().join("state");
    let args = ["--kubelet", "none", "--log", "info", "--container-namespaces", namespaces];
    let supervisor = SupervisorProcess::start_with(&sandbox, binary, &state_dir, args).expect("supervisor");
    let mut figures = Figures::default();
    for cycle in 0..cycles {
        let logged = |message: &str| log_lines(&supervisor, message).len();
        scenario::wait_for("the daemon watched", TIMEOUT, || logged("watching the FUSE daemon") > cycle)
            .expect("daemon watched");
        let crashed = SystemTime::now();
        source.crash().expect("kill");
        if on_volumes {
            // The search at the death is done before the new mount exists.
            scenario::wait_for("the containers isolated", TIMEOUT, || {
                logged("containers' dead mounts isolated") > cycle
            })
            .expect("isolated");
            let isolations = log_lines(&supervisor, "containers' dead mounts isolated");
            let fields = isolations.last().map(|line| &line["fields"]);
            figures.isolated.extend(fields.and_then(|fields| fields["took_us"].as_u64()));
            figures.searched.extend(fields.and_then(|fields| fields["searched_us"].as_u64()));
        }
        source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
        scenario::wait_for("every target healed", TIMEOUT, || logged("healed") >= size * (cycle + 1)).expect("healed");
        let healed = log_lines(&supervisor, "healed");
        let batch = &healed[size * cycle..size * (cycle + 1)];
        let host = batch.iter().filter_map(|line| line["fields"]["latency_us"].as_u64()).max().expect("latency_us");
        figures.host.push(host);
        if !on_volumes {
            continue;
        }
        // The first sight of the new mount, on the wall clock.
        let first = &batch[0];
        let seen = timestamp(first) - Duration::from_micros(first["fields"]["latency_us"].as_u64().unwrap_or(0));
        scenario::wait_for("every container healed", TIMEOUT, || logged("container healed") >= size * (cycle + 1))
            .expect("container heals");
        let container_heals = log_lines(&supervisor, "container healed");
        let container_batch = &container_heals[size * cycle..size * (cycle + 1)];
        let latest = container_batch.iter().filter_map(|line| line["fields"]["latency_us"].as_u64()).max();
        figures.containers_healed.push(latest.expect("latency_us"));
        // One batch: every line has its latency and its duration.
        let took = container_batch.iter().filter_map(|line| line["fields"]["took_us"].as_u64()).max();
        figures.containers_took.extend(took);
        figures.between.extend(latest.zip(took).map(|(latest, took)| latest.saturating_sub(took).saturating_sub(host)));
        let expected = source.expected_content();
        let mut last_read = seen;
        for container in &containers {
            container.wait_until(TIMEOUT, |seen| seen.content() == Some(expected.as_str())).expect("reads again");
            let history = container.history();
            let read = history.iter().find(|seen| seen.at > crashed && seen.content() == Some(expected.as_str()));
            last_read = last_read.max(read.expect("a good read after the crash").at);
        }
        figures.containers_read.push(last_read.duration_since(seen).unwrap_or_default().as_micros() as u64);
    }
    drop(supervisor);
    drop(containers);
    figures
}

fn summary(micros: &[u64]) -> String {
    if micros.is_empty() {
        return "no heals".into();
    }
    let mut micros = micros.to_vec();
    micros.sort_unstable();
    let at = |q: f64| micros[((micros.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    format!("p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms  ({} heals)", at(0.5), at(0.99), at(1.0), micros.len())
}
