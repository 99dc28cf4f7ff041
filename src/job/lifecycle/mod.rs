//! The lifecycle thread: kubelet answers, process exits and the grace
//! deadlines, one at a time.
//!
//! Kubelet calls happen when there is something to learn, never on a fixed
//! period: at start; shortly after a pod directory appears or goes; when
//! every watched application process of a pod has exited (the one call that
//! confirms the end, repeated at 200 ms doubling to 2 s while the kubelet's
//! status lags the exit); and, backing off to 30 s, while a qualifying pod
//! still has containers that are not running or not yet identified
//! (starting, or restarting under `OnFailure`). A node with no such pod
//! makes no calls at all.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, error, info, warn};

use super::assess::{Assessment, Exits, assess};
use super::containers::ContainerProcesses;
use super::fuse_container::{Fuse, identify_fuse};
use fuse_supervisor_engine::errors::chain;
mod ending;

use super::{JobConfig, JobError, JobScope};
use fuse_supervisor_engine::kube::pods::runtime_id;
use fuse_supervisor_engine::kube::{Kubelet, Pod, PodList};
use fuse_supervisor_engine::watch::dir_changes::{Changes, DirChanges};
use fuse_supervisor_engine::watch::processes::fuse_server::FuseServers;
use fuse_supervisor_engine::watch::processes::{
    Backend, ConnectorOptions, ExecReports, PidfdWatcher, ProcConnectorWatcher, ProcessConnector, ProcessEvent,
    ProcessId, ProcessWatchError, ProcessWatcher, Subscription,
};
use fuse_supervisor_engine::watch::thread::{Waiting, Waker, Watching, Woken};

const PROCESSES: u64 = 2;
const PODS: u64 = 3;

/// A pod directory appearing comes before its containers: wait a little.
const AFTER_POD_DIR: Duration = Duration::from_millis(500);

/// The running lifecycle; stops and joins its thread on drop.
pub struct JobLifecycle {
    _watching: Watching,
}

impl JobLifecycle {
    /// Starts the lifecycle thread. Call it before the caller leaves its
    /// own mount namespace: the thread stays in it (the kubelet's token and
    /// CA files are there). `finished` is called once, on the thread, when
    /// the one pod of [`JobScope::Pod`] is done, so that the sidecar
    /// supervisor ends too and the pod can complete. With the process
    /// connector as its backend, it watches on `connector` when given (the
    /// agent's), else on one of its own.
    pub fn spawn(
        config: JobConfig,
        connector: Option<&ProcessConnector>,
        finished: impl FnOnce() + Send + 'static,
    ) -> Result<JobLifecycle, JobError> {
        config.kubelet.load()?;
        let client = config.kubelet.clone();
        let setup = |what| move |source| JobError::Setup { what, source };
        let stop = Watching::stop_waker("job-lifecycle")?;
        let arrived = Arc::new(Waker::new().map_err(setup("eventfd"))?);
        let waiting = Waiting::new(&stop).map_err(setup("epoll"))?;
        waiting.add_readable(arrived.as_fd(), PROCESSES).map_err(setup("epoll"))?;
        let inbox: Arc<Mutex<Vec<ProcessEvent>>> = Arc::default();
        let sink = {
            let (inbox, arrived) = (inbox.clone(), arrived.clone());
            Box::new(move |event| {
                inbox.lock().unwrap_or_else(PoisonError::into_inner).push(event);
                arrived.wake().is_ok()
            })
        };
        let watcher: Box<dyn ProcessWatcher> = match config.watcher {
            Backend::Pidfd => Box::new(PidfdWatcher::start(config.proc_root.clone(), sink)?),
            Backend::ProcConnector => {
                let subscription = Subscription { exec: ExecReports::Off, batch_window: None };
                match connector {
                    Some(connector) => Box::new(connector.watcher(subscription, sink)),
                    None => {
                        let options = ConnectorOptions {
                            execs: false,
                            proc_root: config.proc_root.clone(),
                            ..Default::default()
                        };
                        Box::new(ProcConnectorWatcher::start(options, subscription, sink)?)
                    }
                }
            }
        };
        let pods_dir = match &config.scope {
            // One pod, already there: nothing new to look out for.
            JobScope::Pod { .. } => None,
            JobScope::Node(_) => watch_pods_dir(&config, &waiting),
        };
        let mut lifecycle = Lifecycle {
            client,
            watcher,
            inbox,
            arrived,
            waiting,
            pods_dir,
            own_cgroups: std::fs::read_to_string(config.proc_root.join("self/cgroup")).unwrap_or_default(),
            config,
            pods: BTreeMap::new(),
            by_pid: HashMap::new(),
            ask_at: Some(Instant::now()),
            failures: 0,
            finished: Some(Box::new(finished)),
        };
        let watching = Watching::start("job-lifecycle", stop, move || lifecycle.run())?;
        Ok(JobLifecycle { _watching: watching })
    }
}

/// An inotify watch on `<kubelet_root>/pods`, added from a thread that
/// joined the supervisor's namespace (the watch outlives it).
fn watch_pods_dir(config: &JobConfig, waiting: &Waiting) -> Option<DirChanges> {
    let pods = config.kubelet_root.join("pods");
    let namespace = config.mount_namespace.clone();
    let added = DirChanges::new().and_then(|changes| {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    fuse_supervisor_sys::ns::join_mount_namespace(&namespace)?;
                    changes.watch(&pods, Changes::Entries)
                })
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the watch thread panicked")))
        })?;
        waiting.add_readable(changes.as_fd(), PODS)?;
        Ok(changes)
    });
    match added {
        Ok(changes) => Some(changes),
        Err(err) => {
            // Pods starting later are then found only when another pod's
            // event prompts a look.
            warn!(pods = %pods.display(), err = %chain(&err), "cannot watch the pod directories for new pods");
            None
        }
    }
}

/// What the lifecycle knows of one qualifying pod.
#[derive(Debug)]
struct Tracked {
    name: String,
    fuse: Option<Fuse>,
    /// Application containers being watched, by container name.
    apps: BTreeMap<String, App>,
    phase: Phase,
    /// When to ask the kubelet about this pod again, and how often it was.
    recheck_at: Option<Instant>,
    attempts: u32,
    last_assessment: &'static str,
}

#[derive(Debug)]
struct App {
    container_id: String,
    main: ProcessId,
    exited: bool,
}

#[derive(Debug)]
enum Phase {
    Watching,
    Ending {
        step: Step,
        deadline: Instant,
        alive: BTreeSet<ProcessId>,
    },
    /// Ended (or found ended); kept so it is not looked at again.
    Done,
    /// Never to be touched (restartPolicy Always, native sidecar...).
    Left,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Unmounted,
    Terminated,
    Killed,
}

/// How soon to ask again, by what is awaited.
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// The kubelet's status lags a process exit by up to a relist period.
    Lag,
    /// Containers starting or restarting.
    Start,
}

fn recheck_delay(wait: Wait, attempts: u32) -> Duration {
    let (first, cap) = match wait {
        Wait::Lag => (Duration::from_millis(200), Duration::from_secs(2)),
        Wait::Start => (Duration::from_millis(500), Duration::from_secs(30)),
    };
    first.saturating_mul(1 << attempts.min(8)).min(cap)
}

struct Lifecycle {
    config: JobConfig,
    client: Kubelet,
    watcher: Box<dyn ProcessWatcher>,
    inbox: Arc<Mutex<Vec<ProcessEvent>>>,
    arrived: Arc<Waker>,
    waiting: Waiting,
    pods_dir: Option<DirChanges>,
    /// `/proc/self/cgroup`: tells the supervisor's own container in sidecar mode.
    own_cgroups: String,
    pods: BTreeMap<String, Tracked>,
    /// Watched pids → pod UID.
    by_pid: HashMap<u32, String>,
    /// The next kubelet call.
    ask_at: Option<Instant>,
    /// Failed calls in a row.
    failures: u32,
    finished: Option<Box<dyn FnOnce() + Send>>,
}

impl Lifecycle {
    fn run(&mut self) {
        let scope = match &self.config.scope {
            JobScope::Node(selector) => format!("pods matching {selector}"),
            JobScope::Pod { uid } => format!("pod {uid}"),
        };
        info!(scope, grace_ms = self.config.grace.as_millis() as u64, "job lifecycle started");
        loop {
            let timeout = self.next_deadline().map(|at| at.saturating_duration_since(Instant::now()));
            let (pods, processes) = match self.waiting.wait(timeout) {
                Ok(Woken::Stop) => return,
                Ok(Woken::Ready(ready)) => (ready.contains(&PODS), ready.contains(&PROCESSES)),
                Err(err) => {
                    error!(err = %chain(&err), "job lifecycle cannot wait for events; stopping");
                    return;
                }
            };
            if pods {
                self.on_pod_dirs();
            }
            if processes && !self.on_process_events() {
                return;
            }
            let now = Instant::now();
            if self.ask_at.is_some_and(|at| at <= now) {
                self.ask();
            }
            self.escalate(Instant::now());
            if self.finished.is_some()
                && matches!(self.config.scope, JobScope::Pod { .. })
                && self.pods.values().any(|pod| matches!(pod.phase, Phase::Done))
                && let Some(finished) = self.finished.take()
            {
                info!("the pod's work and its FUSE container are done; the supervisor ends too");
                finished();
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let endings = self.pods.values().filter_map(|pod| match &pod.phase {
            Phase::Ending { deadline, .. } => Some(*deadline),
            _ => None,
        });
        self.ask_at.into_iter().chain(endings).min()
    }

    fn ask_by(&mut self, at: Instant) {
        self.ask_at = Some(self.ask_at.map_or(at, |current| current.min(at)));
    }

    fn on_pod_dirs(&mut self) {
        let Some(changes) = &mut self.pods_dir else { return };
        let changed = changes.drain().unwrap_or_else(|err| {
            warn!(err = %chain(&err), "cannot read pod-directory events");
            false
        });
        if changed {
            self.ask_by(Instant::now() + AFTER_POD_DIR);
        }
    }

    /// Returns false if the watcher failed (the lifecycle cannot go on).
    fn on_process_events(&mut self) -> bool {
        if let Err(err) = self.arrived.drain() {
            warn!(err = %chain(&err), "cannot reset the process-event wakeup");
        }
        let events = std::mem::take(&mut *self.inbox.lock().unwrap_or_else(PoisonError::into_inner));
        for event in events {
            match event {
                ProcessEvent::Exited { pid, status, .. } => self.on_exit(pid, status),
                // Exits of watched processes were reported before this.
                ProcessEvent::Lost => self.ask_by(Instant::now()),
                ProcessEvent::Exec { .. } => {}
                ProcessEvent::Failed(err) => {
                    error!(err = %chain(&err), "the job lifecycle's process watcher stopped; no more FUSE sidecars are ended");
                    return false;
                }
            }
        }
        true
    }

    fn on_exit(&mut self, pid: u32, status: Option<fuse_supervisor_engine::watch::processes::ExitStatus>) {
        let Some(uid) = self.by_pid.remove(&pid) else { return };
        let Some(pod) = self.pods.get_mut(&uid) else { return };
        if let Phase::Ending { step, alive, .. } = &mut pod.phase {
            alive.retain(|process| process.pid != pid);
            if alive.is_empty() {
                let how = match step {
                    Step::Unmounted => "unmount",
                    Step::Terminated => "SIGTERM",
                    Step::Killed => "SIGKILL",
                };
                info!(pod = %pod.name, ended_by = how, "FUSE daemon exited");
                pod.phase = Phase::Done;
            }
            return;
        }
        let Some((container, app)) = pod.apps.iter_mut().find(|(_, app)| app.main.pid == pid) else { return };
        app.exited = true;
        debug!(pod = %pod.name, container = %container, pid, ?status, "application process exited");
        if pod.apps.values().all(|app| app.exited) {
            info!(pod = %pod.name, "every application process exited; asking the kubelet to confirm");
            pod.attempts = 0;
            pod.recheck_at = Some(Instant::now());
            self.ask_by(Instant::now());
        }
    }

    /// One `/pods` call; its answer is applied to every pod.
    fn ask(&mut self) {
        self.ask_at = None;
        let started = Instant::now();
        match self.client.pods() {
            Ok(list) => {
                self.failures = 0;
                debug!(
                    pods = list.items.len(),
                    took_us = started.elapsed().as_micros() as u64,
                    "pods listed for the job lifecycle"
                );
                self.reconcile(&list);
            }
            Err(err) => {
                self.failures += 1;
                let delay = recheck_delay(Wait::Start, self.failures);
                warn!(err = %chain(&err), retry_in_ms = delay.as_millis() as u64, "job lifecycle cannot list the node's pods");
                self.ask_by(Instant::now() + delay);
                return;
            }
        }
        let rechecks: Vec<Instant> = self.pods.values().filter_map(|pod| pod.recheck_at).collect();
        if let Some(at) = rechecks.into_iter().min() {
            self.ask_by(at);
        }
    }

    fn in_scope(&self, pod: &Pod) -> bool {
        match &self.config.scope {
            JobScope::Node(selector) => selector.matches(&pod.metadata.labels),
            JobScope::Pod { uid } => pod.metadata.uid == *uid,
        }
    }

    fn reconcile(&mut self, list: &PodList) {
        let now = Instant::now();
        let in_scope: Vec<&Pod> = list.items.iter().filter(|pod| self.in_scope(pod)).collect();
        // Pods gone from the node (or from the scope) are forgotten; one the
        // kubelet listed but that could not be read is not gone, and keeps
        // its watches until it reads again.
        let unreadable = list.skipped.iter().map(|pod| pod.uid.as_str());
        let present: BTreeSet<&str> = in_scope.iter().map(|pod| pod.metadata.uid.as_str()).chain(unreadable).collect();
        let gone: Vec<String> = self.pods.keys().filter(|uid| !present.contains(uid.as_str())).cloned().collect();
        for uid in gone {
            self.forget(&uid);
        }
        let mut to_identify = Vec::new();
        for pod in in_scope {
            let uid = &pod.metadata.uid;
            let tracked = self.pods.entry(uid.clone()).or_insert_with(|| Tracked {
                name: format!("{}/{}", pod.metadata.namespace, pod.metadata.name),
                fuse: None,
                apps: BTreeMap::new(),
                phase: Phase::Watching,
                recheck_at: None,
                attempts: 0,
                last_assessment: "",
            });
            if !matches!(tracked.phase, Phase::Watching) {
                continue;
            }
            tracked.recheck_at = None;
            if matches!(pod.status.phase.as_deref(), Some("Succeeded" | "Failed")) {
                debug!(pod = %tracked.name, "pod completed already");
                tracked.phase = Phase::Done;
                continue;
            }
            if pod.spec.restart_policy.as_deref().unwrap_or("Always") == "Always" {
                info!(pod = %tracked.name, "restartPolicy Always: the pod never completes; its FUSE container is left alone");
                tracked.phase = Phase::Left;
                continue;
            }
            to_identify.push(pod);
        }
        if to_identify.is_empty() {
            return;
        }
        // One pass over /proc for every container of these pods.
        let ids: BTreeSet<String> = to_identify
            .iter()
            .flat_map(|pod| pod.status.container_statuses.iter().chain(&pod.status.init_container_statuses))
            .filter(|status| status.is_running())
            .filter_map(|status| status.container_id.as_deref().map(|id| runtime_id(id).to_owned()))
            .collect();
        let processes = match ContainerProcesses::scan(&self.config.proc_root, &ids) {
            Ok(processes) => processes,
            Err(err) => {
                error!(err = %chain(&err), "cannot find the containers' processes");
                return;
            }
        };
        let mut servers = None;
        for pod in to_identify {
            self.judge(pod, &processes, &mut servers, now);
        }
    }

    /// Applies one pod's kubelet status.
    fn judge(&mut self, pod: &Pod, processes: &ContainerProcesses, servers: &mut Option<FuseServers>, now: Instant) {
        let uid = pod.metadata.uid.clone();
        let needs_fuse = self.pods.get(&uid).is_some_and(|tracked| {
            tracked.fuse.as_ref().is_none_or(|fuse| {
                // Its container restarted: find its servers again.
                pod.container_status(&fuse.container).and_then(|s| s.container_id.as_deref()).map(runtime_id)
                    != Some(fuse.container_id.as_str())
            })
        });
        if needs_fuse {
            let found = identify_fuse(pod, processes, servers, &self.config.proc_root);
            if let Some(tracked) = self.pods.get_mut(&uid) {
                tracked.fuse = found;
            }
        }
        let own = self.own_container(pod);
        let Some(tracked) = self.pods.get_mut(&uid) else { return };
        let Some(fuse) = tracked.fuse.clone() else {
            debug!(pod = %tracked.name, "no FUSE container serving a mount yet");
            schedule(tracked, Wait::Start, now);
            return;
        };
        let mut view = pod.clone();
        if let Some(own) = &own {
            // The supervisor's own container (sidecar mode) is not the work.
            view.spec.containers.retain(|container| container.name != *own);
        }
        let assessment = assess(&view, &fuse.container);
        if tracked.last_assessment != assessment.name() {
            info!(pod = %tracked.name, fuse_container = %fuse.container, assessment = assessment.name(), "job pod");
            tracked.last_assessment = assessment.name();
        }
        match assessment {
            Assessment::RestartAlways | Assessment::NativeSidecar | Assessment::NoApplication => {
                tracked.phase = Phase::Left;
            }
            Assessment::FuseNotRunning => schedule(tracked, Wait::Start, now),
            Assessment::AwaitingRestart { exits } => {
                info!(pod = %tracked.name, exits = %Exits(&exits), "OnFailure: waiting for the failed containers to run again");
                schedule(tracked, Wait::Start, now);
            }
            Assessment::Working { running, waiting } => {
                let mut lagging = false;
                let mut unseen = !waiting.is_empty();
                // Containers no longer running, or running as a new
                // instance, are watched afresh.
                let stale: Vec<String> = tracked
                    .apps
                    .iter()
                    .filter(|(name, app)| {
                        !running.iter().any(|r| r.container == **name && r.container_id == app.container_id)
                    })
                    .map(|(name, _)| name.clone())
                    .collect();
                for name in stale {
                    if let Some(app) = tracked.apps.remove(&name) {
                        self.watcher.unwatch(app.main.pid);
                        self.by_pid.remove(&app.main.pid);
                    }
                }
                for run in running {
                    if tracked.apps.contains_key(&run.container) {
                        continue;
                    }
                    let Some(main) = processes.main_process(&run.container_id) else {
                        debug!(pod = %tracked.name, container = %run.container, "no process of the container found");
                        unseen = true;
                        continue;
                    };
                    match self.watcher.watch(main) {
                        Ok(()) => {
                            debug!(pod = %tracked.name, container = %run.container, pid = main.pid, "watching application process");
                            self.by_pid.insert(main.pid, uid.clone());
                            tracked
                                .apps
                                .insert(run.container, App { container_id: run.container_id, main, exited: false });
                        }
                        Err(ProcessWatchError::Gone { .. } | ProcessWatchError::Reused { .. }) => {
                            // Exited between the scan and now: the kubelet will say so.
                            lagging = true;
                        }
                        Err(err) => {
                            warn!(pod = %tracked.name, container = %run.container, err = %chain(&err), "cannot watch application process");
                            unseen = true;
                        }
                    }
                }
                lagging |= !tracked.apps.is_empty() && tracked.apps.values().all(|app| app.exited);
                if lagging {
                    schedule(tracked, Wait::Lag, now);
                } else if unseen {
                    schedule(tracked, Wait::Start, now);
                } else {
                    tracked.attempts = 0;
                }
            }
            Assessment::Finished { exits } => {
                info!(pod = %tracked.name, exits = %Exits(&exits), fuse_container = %fuse.container, "application containers finished; ending the FUSE container");
                for app in std::mem::take(&mut tracked.apps).into_values() {
                    self.watcher.unwatch(app.main.pid);
                    self.by_pid.remove(&app.main.pid);
                }
                let name = tracked.name.clone();
                self.end(&uid, &name, &fuse, now);
            }
        }
    }

    /// In sidecar mode, the name of the pod's container that this process is in.
    fn own_container(&self, pod: &Pod) -> Option<String> {
        if !matches!(self.config.scope, JobScope::Pod { .. }) {
            return None;
        }
        pod.status.container_statuses.iter().find_map(|status| {
            let id = runtime_id(status.container_id.as_deref()?);
            (id.len() >= 12
                && self.own_cgroups.lines().any(|line| line.ends_with(id) || line.contains(&format!("-{id}."))))
            .then(|| status.name.clone())
        })
    }

    fn forget(&mut self, uid: &str) {
        let Some(pod) = self.pods.remove(uid) else { return };
        debug!(pod = %pod.name, "pod gone");
        let pids: Vec<u32> = self.by_pid.iter().filter(|(_, owner)| *owner == uid).map(|(&pid, _)| pid).collect();
        for pid in pids {
            self.by_pid.remove(&pid);
            self.watcher.unwatch(pid);
        }
    }
}

fn schedule(tracked: &mut Tracked, wait: Wait, now: Instant) {
    tracked.recheck_at = Some(now + recheck_delay(wait, tracked.attempts));
    tracked.attempts += 1;
}
