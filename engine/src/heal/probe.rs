//! Health probes of FUSE sources, on worker threads with a bounded wait.
//!
//! Any access to a FUSE path can hang for as long as its daemon is stopped,
//! so the loop only ever hands a probe an fd and goes on; the worker reports
//! back on the loop's channel. A probe stuck in a stopped daemon is never
//! duplicated: one probe per mount is in flight at a time, and a path's
//! newer mount is probed beside the few of its earlier ones whose daemons
//! never answered ([`Prober::supersede`]). The probe's
//! calls themselves are made by the FUSE call helper ([`fuse_calls`]), so a
//! daemon that holds one holds no thread of the agent's and not its exit.
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

use crate::errors::chain;
use crate::heal::fuse_calls::{self, Answer};
use crate::heal::priority::HealPriority;

/// Handles on a live source, opened by a probe: its root, and every
/// subdirectory that subPath targets need or why it could not be opened
/// beneath the root. Each subdirectory is judged alone: one that a tenant
/// turned into a symlink fails the targets bound to it, not the source.
#[derive(Debug)]
pub struct SourceHandles {
    pub root: OwnedFd,
    pub subdirs: BTreeMap<PathBuf, Result<OwnedFd, Arc<io::Error>>>,
}

impl SourceHandles {
    /// The handle to stack onto a target whose root is `root_in_source`,
    /// or the refusal of that subdirectory; None if it was not probed.
    pub fn for_root(&self, root_in_source: &Path) -> Option<Result<&OwnedFd, &Arc<io::Error>>> {
        if root_in_source.as_os_str().is_empty() {
            return Some(Ok(&self.root));
        }
        self.subdirs.get(root_in_source).map(Result::as_ref)
    }
}

/// What a probe found.
#[derive(Debug)]
pub enum ProbeOutcome {
    Live(SourceHandles),
    /// The daemon answered `statfs` with an error (ENOTCONN for a dead one).
    Failed(io::Error),
}

/// A finished probe, as sent to the loop.
#[derive(Debug)]
pub struct ProbeReport {
    pub source: PathBuf,
    pub mount_id: u32,
    pub outcome: ProbeOutcome,
    /// How long the source took to answer (or fail): the daemon's time.
    pub waited: Duration,
    /// The probed mount's root where the outcome holds no handle on it,
    /// kept until the loop has read the report: while it is held, the
    /// kernel cannot give the mount's ID to a newer mount. Let go in the
    /// probe's thread, the ID of a source unmounted during its probe went
    /// to its replacement before the loop heard of the end, and the scan
    /// in between took the replacement for the mount being probed (its
    /// heal waited for a probe that had ended).
    pub holding: Option<OwnedFd>,
}

/// Starts probes and remembers which are in flight and since when.
#[derive(Debug)]
pub struct Prober {
    timeout: Duration,
    /// Probe threads wait for a daemon's answer and report it at once.
    priority: HealPriority,
    /// When each probe started, and the mount it probes.
    in_flight: HashMap<PathBuf, (Instant, u32)>,
    /// Probes of mounts that a newer mount at their path replaced, left
    /// waiting on their daemons: their reports are dropped. The probe's
    /// descriptor holds its mount, so the kernel cannot give its ID to
    /// another mount while the probe waits.
    superseded: Vec<(PathBuf, u32)>,
    spare: Option<SpareThread>,
}

/// How many probes of earlier mounts may wait at one path on daemons that
/// do not answer (stopped for good, or stuck in the kernel): each holds a
/// thread here and one in the FUSE call helper until its daemon answers or
/// dies. Beyond it, the path's newest mount waits for one of them.
pub const MAX_SUPERSEDED_PER_PATH: usize = 4;

type ProbeJob = Box<dyn FnOnce() + Send>;

/// A probe thread, at the heal priority and asleep until its probe comes.
/// The loop starts one ahead of need, so handing it a probe costs a
/// wake-up: a thread started for the probe waited 0.75 ms on average (2 ms
/// at worst) for a CPU on a 2-CPU node, behind the very daemon start-up
/// the probe waits for. Each runs one probe and ends, so a probe stuck in a
/// stopped daemon holds no other.
#[derive(Debug)]
struct SpareThread {
    job: Sender<ProbeJob>,
}

impl SpareThread {
    fn start(priority: HealPriority) -> io::Result<SpareThread> {
        let (job, waiting) = mpsc::channel::<ProbeJob>();
        std::thread::Builder::new().name("probe".into()).spawn(move || {
            priority.raise();
            // No job when the prober is dropped first.
            if let Ok(job) = waiting.recv() {
                job();
            }
        })?;
        Ok(SpareThread { job })
    }
}

impl Prober {
    pub fn new(timeout: Duration, priority: HealPriority) -> Self {
        Prober { timeout, priority, in_flight: HashMap::new(), superseded: Vec::new(), spare: None }
    }

    /// Starts a spare probe thread unless one is waiting: for the loop to
    /// call when it has nothing urgent to do, never just before a probe.
    pub fn keep_spare(&mut self) {
        if self.spare.is_some() {
            return;
        }
        match SpareThread::start(self.priority) {
            Ok(spare) => self.spare = Some(spare),
            Err(err) => {
                tracing::debug!(err = %chain(&err), "cannot start a spare probe thread; probes start their own")
            }
        }
    }

    pub fn in_flight(&self, source: &Path) -> bool {
        self.in_flight.contains_key(source)
    }

    /// Whether a probe of the mount `mount_id` at `source` is in flight.
    pub fn in_flight_on(&self, source: &Path, mount_id: u32) -> bool {
        self.in_flight.get(source).is_some_and(|(_, probed)| *probed == mount_id)
    }

    /// Probes the source `root` was opened on; `subdirs` are opened below
    /// it. The report goes to `report` wrapped by `wrap`.
    pub fn start<E: Send + 'static>(
        &mut self,
        source: &Path,
        mount_id: u32,
        root: OwnedFd,
        subdirs: Vec<PathBuf>,
        report: Sender<E>,
        wrap: fn(ProbeReport) -> E,
    ) -> io::Result<()> {
        let reported = source.to_path_buf();
        let job: ProbeJob = Box::new(move || {
            let asked = Instant::now();
            let (outcome, holding) = probe(root, &subdirs);
            let waited = asked.elapsed();
            // The loop may be gone on shutdown; nothing to report to then.
            let _ = report.send(wrap(ProbeReport { source: reported, mount_id, outcome, waited, holding }));
        });
        let thread = match self.spare.take() {
            Some(spare) => spare,
            None => SpareThread::start(self.priority)?,
        };
        // Only a panic before its first job ends a spare's thread.
        thread.job.send(job).map_err(|_| io::Error::other("probe thread ended before its probe"))?;
        self.in_flight.insert(source.to_path_buf(), (Instant::now(), mount_id));
        Ok(())
    }

    /// Whether the probe of `source` in flight has been waiting for at
    /// least `wait`.
    pub fn waited(&self, source: &Path, wait: Duration) -> bool {
        self.in_flight.get(source).is_some_and(|(started, _)| started.elapsed() >= wait)
    }

    /// When the probe of `source` in flight will have waited `wait`.
    pub fn will_have_waited(&self, source: &Path, wait: Duration) -> Option<Instant> {
        self.in_flight.get(source).map(|(started, _)| *started + wait)
    }

    /// Leaves the probe in flight at `path` to its daemon, which has not
    /// answered while a newer mount took its mount's place, so that the
    /// newer one can be probed: its report will be dropped. False (and
    /// nothing changed) when [`MAX_SUPERSEDED_PER_PATH`] such probes wait
    /// at `path` already.
    pub fn supersede(&mut self, path: &Path) -> bool {
        if self.superseded.iter().filter(|(waiting, _)| waiting == path).count() >= MAX_SUPERSEDED_PER_PATH {
            return false;
        }
        if let Some((_, mount_id)) = self.in_flight.remove(path) {
            self.superseded.push((path.to_path_buf(), mount_id));
        }
        true
    }

    /// Called when a report of the probe of `mount_id` at `path` arrives:
    /// whether it is the answer of the path's probe in flight (not of one
    /// [`Self::supersede`] left to its daemon).
    pub fn finished(&mut self, path: &Path, mount_id: u32) -> bool {
        if let Some(at) = self.superseded.iter().position(|(waiting, id)| waiting == path && *id == mount_id) {
            self.superseded.swap_remove(at);
            return false;
        }
        let current = self.in_flight.get(path).is_some_and(|(_, probed)| *probed == mount_id);
        if current {
            self.in_flight.remove(path);
        }
        current
    }

    /// Sources whose probe has been waiting longer than the timeout: their
    /// daemon is not answering (stopped, or overloaded).
    pub fn overdue(&self) -> Vec<PathBuf> {
        let now = Instant::now();
        self.in_flight
            .iter()
            .filter(|(_, (started, _))| now.duration_since(*started) >= self.timeout)
            .map(|(path, _)| path.clone())
            .collect()
    }

    /// When each in-flight probe becomes overdue.
    pub fn deadlines(&self) -> impl Iterator<Item = (&Path, Instant)> {
        self.in_flight.iter().map(|(source, (started, _))| (source.as_path(), *started + self.timeout))
    }
}

/// Opens the top mount at `source` for a probe, with its mount ID, so the
/// caller can tell whether it is still the mount it saw.
pub fn open_mount_root(source: &Path) -> io::Result<(u32, OwnedFd)> {
    let root = fuse_supervisor_sys::resolve::open_path(source)?;
    Ok((fuse_supervisor_sys::resolve::mount_id_of(root.as_fd())?, root))
}

/// `statfs` of the source, then its subdirectories opened: through the
/// FUSE call helper, so that a daemon that never answers holds none of the
/// agent's threads. With the root back where the outcome does not hold it
/// ([`ProbeReport::holding`]).
fn probe(root: OwnedFd, subdirs: &[PathBuf]) -> (ProbeOutcome, Option<OwnedFd>) {
    match fuse_calls::ask(root.as_fd(), true, subdirs) {
        Answer::StatfsFailed(err) => (ProbeOutcome::Failed(err), Some(root)),
        Answer::Opened(opened) => {
            let opened = subdirs.iter().cloned().zip(opened.into_iter().map(|result| result.map_err(Arc::new)));
            (ProbeOutcome::Live(SourceHandles { root, subdirs: opened.collect() }), None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start_probe(prober: &mut Prober, dir: &Path, report: &Sender<ProbeReport>) {
        start_probe_of(prober, dir, 1, report);
    }

    fn start_probe_of(prober: &mut Prober, dir: &Path, mount_id: u32, report: &Sender<ProbeReport>) {
        let root = fuse_supervisor_sys::resolve::open_path(dir).unwrap();
        prober.start(dir, mount_id, root, Vec::new(), report.clone(), |report| report).unwrap();
    }

    #[test]
    fn a_superseded_probe_is_left_to_its_daemon_and_its_answer_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let (report, reports) = mpsc::channel();
        let mut prober = Prober::new(Duration::from_secs(2), HealPriority::OFF);
        let newest = MAX_SUPERSEDED_PER_PATH as u32 + 1;
        start_probe_of(&mut prober, dir.path(), 1, &report);
        for mount_id in 2..=newest {
            assert!(prober.supersede(dir.path()));
            start_probe_of(&mut prober, dir.path(), mount_id, &report);
            assert!(prober.in_flight_on(dir.path(), mount_id));
        }
        assert!(!prober.supersede(dir.path()), "as many as may wait at the path are waiting");
        assert!(prober.in_flight_on(dir.path(), newest), "a refusal leaves the probe in flight");
        let mut answered = Vec::new();
        for _ in 1..=newest {
            let answer = reports.recv_timeout(Duration::from_secs(10)).unwrap();
            answered.push((answer.mount_id, prober.finished(dir.path(), answer.mount_id)));
        }
        answered.sort();
        let expected: Vec<(u32, bool)> = (1..=newest).map(|mount_id| (mount_id, mount_id == newest)).collect();
        assert_eq!(answered, expected, "only the newest mount's answer is the path's");
        assert!(prober.superseded.is_empty());
        assert!(!prober.in_flight(dir.path()));
    }

    #[test]
    fn a_spare_thread_takes_the_next_probe_and_a_probe_without_one_starts_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let (report, reports) = mpsc::channel();
        let mut prober = Prober::new(Duration::from_secs(2), HealPriority::OFF);
        prober.keep_spare();
        assert!(prober.spare.is_some());
        start_probe(&mut prober, dir.path(), &report);
        assert!(prober.spare.is_none(), "the spare took the probe");
        let answer = reports.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(matches!(answer.outcome, ProbeOutcome::Live(_)), "{answer:?}");

        assert!(prober.finished(dir.path(), answer.mount_id));
        start_probe(&mut prober, dir.path(), &report);
        let answer = reports.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(matches!(answer.outcome, ProbeOutcome::Live(_)), "{answer:?}");
        prober.keep_spare();
        assert!(prober.spare.is_some());
    }
}
