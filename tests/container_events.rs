//! The heal inside containers reported end to end: real runc containers of
//! two pods, listed by a kubelet stand-in in the real `/pods` format with
//! the containers' runtime IDs (which their cgroups carry), a third-party
//! FUSE daemon from Debian crashing and restarting under `fuse-supervisor
//! run`, and the Events it publishes read back from an API server
//! stand-in: per pod one `FuseMountHealed` and one `FuseContainersHealed`
//! naming its containers, how many were healed and how; the `container
//! healed` log lines name pod and container; `/metrics` counts them. Needs
//! root and /dev/fuse.
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::apiserver::{ApiRequest, ApiServerStandIn};
use fuse_supervisor_testbed::kubelet::{KubeletStandIn, app_pod_running, fuse_owner_pod, pod_list_body};
use fuse_supervisor_testbed::runc::{self, Runc, RuncContainer, RuncSpec, VolumePropagation};
use fuse_supervisor_testbed::scenario::{self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR_FILE, SupervisorProcess};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);
const READ_INTERVAL: Duration = Duration::from_millis(10);

/// The pod whose whole volume two containers mount, one of each propagation.
const WEB: (&str, &str, &str) = ("apps", "web-0", "web-pod-uid");
/// The pod whose one container mounts a subPath of the volume.
const BATCH: (&str, &str, &str) = ("jobs", "batch-0", "batch-pod-uid");

/// Everything the test started, dropped containers and supervisor first.
struct Node {
    containers: Vec<(&'static str, RuncContainer)>,
    supervisor: Option<SupervisorProcess>,
    api: ApiServerStandIn,
    kubelet: KubeletStandIn,
    source: FuseSource,
    runc: Runc,
    sandbox: Sandbox,
}

impl Node {
    fn new(daemon: Daemon) -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start daemon");
        let runc = Runc::new(&sandbox).expect("runc image");
        let kubelet = KubeletStandIn::start().expect("kubelet stand-in");
        let api = ApiServerStandIn::start().expect("API server stand-in");
        Node { containers: Vec::new(), supervisor: None, api, kubelet, source, runc, sandbox }
    }

    /// Starts container `name` of the pod with UID `pod_uid`, reading `read` in `volume`.
    fn start_container(
        &mut self,
        pod_uid: &'static str,
        name: &str,
        volume: PathBuf,
        propagation: VolumePropagation,
        read: &str,
    ) {
        let spec = RuncSpec::reader(format!("{pod_uid}-{name}"), volume, propagation, read, READ_INTERVAL);
        let container = self.runc.start(&spec).unwrap_or_else(|err| panic!("start container {name}: {err}"));
        self.containers.push((pod_uid, container));
    }

    /// The container's name in its pod: the runc name after the pod's UID.
    fn pod_container(pod_uid: &str, container: &RuncContainer) -> String {
        container.name().trim_start_matches(pod_uid).trim_start_matches('-').to_owned()
    }

    /// `/pods`: the FUSE pod serving the source in its `instance`th run,
    /// and the two application pods with their containers' runtime IDs.
    fn pods(&self, instance: u32, started: SystemTime) -> Vec<u8> {
        let host_path = self.sandbox.runtime_root().display().to_string();
        let app = |(namespace, name, uid): (&str, &str, &str)| {
            let containers: Vec<(String, &str)> = self
                .containers
                .iter()
                .filter(|(pod_uid, _)| *pod_uid == uid)
                .map(|(_, container)| (Node::pod_container(uid, container), container.id()))
                .collect();
            let containers: Vec<(&str, &str)> = containers.iter().map(|(name, id)| (name.as_str(), *id)).collect();
            app_pod_running(namespace, name, uid, &containers)
        };
        pod_list_body([fuse_owner_pod("fuse-owner", "owner-uid", &host_path, instance, started), app(WEB), app(BATCH)])
    }

    fn supervise(&mut self) {
        let mut args = self.kubelet.client_args(&self.sandbox).expect("kubelet credentials");
        let kubeconfig = self.sandbox.root().join("credentials").join("events-kubeconfig");
        let (at, config) = (kubeconfig.clone(), self.api.kubeconfig());
        self.sandbox.run(move || std::fs::write(at, config)).expect("write the kubeconfig");
        args.extend(["--events", "on", "--events-kubeconfig"].map(str::to_owned));
        args.push(kubeconfig.display().to_string());
        args.extend(["--node-name", "node-1"].map(str::to_owned));
        let state_dir = self.sandbox.root().join("state");
        let supervisor = SupervisorProcess::start_with(&self.sandbox, Path::new(BINARY), &state_dir, args);
        self.supervisor = Some(supervisor.expect("supervisor"));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    fn wait_all(&self, what: &str, pred: impl Fn(&RuncContainer, &fuse_supervisor_testbed::Observation) -> bool) {
        for (_, container) in &self.containers {
            container
                .wait_until(TIMEOUT, |seen| pred(container, seen))
                .unwrap_or_else(|err| panic!("container {} does not {what}: {err}", container.name()));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let containers = self.containers.iter().map(|(_, container)| container);
            runc::print_failure(&self.sandbox, containers);
            for request in self.api.requests() {
                eprintln!("API server saw: {} {} {}", request.method, request.path, request.body);
            }
        }
    }
}

fn posted(request: &ApiRequest, reason: &str, pod: &str) -> bool {
    request.method == "POST" && request.body["reason"] == reason && request.body["regarding"]["name"] == pod
}

/// A field of a JSON log line, as text.
fn field(line: &serde_json::Value, name: &str) -> String {
    line["fields"][name].as_str().unwrap_or_default().to_owned()
}

/// Three containers of two pods on one source crash with its daemon and
/// are healed in their namespaces; each pod is told once that its mount was
/// healed and once which of its containers were, how many and how.
fn container_heals_are_published_per_pod(daemon: Daemon) {
    let mut node = Node::new(daemon);
    let web = node.source.bind_volume(&node.sandbox, WEB.2, "data").expect("bind the web pod's volume");
    let batch = node.source.bind_subpath(&node.sandbox, BATCH.2, "data").expect("bind the batch pod's subPath");
    node.start_container(WEB.2, "app", web.clone(), VolumePropagation::HostToContainer, DATA_FILE);
    node.start_container(WEB.2, "sidecar", web, VolumePropagation::None, DATA_FILE);
    node.start_container(BATCH.2, "worker", batch, VolumePropagation::None, SUBDIR_FILE);
    node.kubelet.set_pods(node.pods(0, SystemTime::now() - Duration::from_secs(3600)));
    node.supervise();

    let daemon_pid = format!("[{}]", node.source.pid().expect("daemon running"));
    let watched = |line: &str| line.contains("\"watching the FUSE daemon\"") && line.contains(&daemon_pid);
    node.supervisor().wait_for_log(TIMEOUT, watched).expect("the daemon watched");
    node.source.crash().expect("crash the daemon");
    node.wait_all("see the crash", |_, seen| seen.error().is_some());
    let isolated = |line: &str| line.contains("\"containers' dead mounts isolated\"");
    node.supervisor().wait_for_log(TIMEOUT, isolated).expect("the containers' dead mounts isolated");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).expect("restart the daemon");
    node.kubelet.set_pods(node.pods(1, SystemTime::now()));
    let whole = node.source.expected_content();
    node.wait_all("read again", |container, seen| match container.name().starts_with(BATCH.2) {
        true => seen.content().is_some_and(|content| content.starts_with("inside ")),
        false => seen.content() == Some(whole.as_str()),
    });

    // The metric: every container replaced by the live mount, none failed.
    let supervisor = node.supervisor();
    let series = |result: &str| format!("fuse_supervisor_container_heals_total{{result=\"{result}\"}}");
    let replaced = || supervisor.metric(&series("replaced")).expect("scrape /metrics");
    scenario::wait_for("three container heals counted", TIMEOUT, || replaced() == Some(3.0))
        .unwrap_or_else(|err| panic!("{err}: {:?}", replaced()));
    for result in ["stacked", "failed"] {
        assert_eq!(supervisor.metric(&series(result)).expect("scrape /metrics"), Some(0.0), "{result}");
    }

    // The log: each heal names its pod and container.
    let healed: Vec<serde_json::Value> = supervisor
        .log()
        .iter()
        .filter(|line| line.contains("\"container healed\""))
        .map(|line| serde_json::from_str(line).expect("a JSON log line"))
        .collect();
    let mut named: Vec<(String, String, String)> =
        healed.iter().map(|line| (field(line, "pod"), field(line, "container"), field(line, "how"))).collect();
    named.sort();
    let expected = [("apps/web-0", "app"), ("apps/web-0", "sidecar"), ("jobs/batch-0", "worker")]
        .map(|(pod, container)| (pod.to_owned(), container.to_owned(), "replaced".to_owned()));
    assert_eq!(named, expected, "{healed:#?}");

    // The Events: per pod one of each, in its namespace, in that order.
    let api = &node.api;
    for ((namespace, pod, uid), containers) in
        [(WEB, "inside 2 containers, each in its own"), (BATCH, "inside container worker, in its own")]
    {
        let containers_healed = api
            .wait_for(TIMEOUT, |request| posted(request, "FuseContainersHealed", pod))
            .unwrap_or_else(|err| panic!("FuseContainersHealed on {pod}: {err}"));
        let requests = api.requests();
        for reason in ["FuseMountHealed", "FuseContainersHealed"] {
            let count = requests.iter().filter(|request| posted(request, reason, pod)).count();
            assert_eq!(count, 1, "{reason} on {pod}");
        }
        let position = |reason| requests.iter().position(|request| posted(request, reason, pod));
        assert!(position("FuseMountHealed") < position("FuseContainersHealed"), "{pod}: {requests:#?}");
        let body = &containers_healed.body;
        assert_eq!(containers_healed.path, format!("/apis/events.k8s.io/v1/namespaces/{namespace}/events"));
        assert_eq!(body["regarding"]["uid"], uid);
        assert_eq!(body["regarding"]["namespace"], namespace);
        assert_eq!((body["type"].as_str(), body["action"].as_str()), (Some("Normal"), Some("Heal")));
        let note = body["note"].as_str().expect("a note");
        let count = if pod == WEB.1 { 2 } else { 1 };
        assert!(note.contains(containers), "{containers:?} not in {note:?}");
        assert!(note.contains(&node.source.path.display().to_string()), "no source in {note:?}");
        let counted = format!(": {count} replaced by the live mount");
        assert!(note.contains(&counted), "{counted:?} not in {note:?}");
        if count == 2 {
            assert!(note.ends_with("; containers app, sidecar"), "{note:?}");
        }
        assert!(!note.contains("stacked"), "{note:?}");
    }

    let supervisor = node.supervisor.take().expect("supervisor running");
    supervisor.stop().expect("stop the supervisor");
}

#[test]
fn container_heals_after_bindfs_restarts_are_published_per_pod() {
    container_heals_are_published_per_pod(Daemon::Bindfs);
}

#[test]
fn container_heals_after_rclone_restarts_are_published_per_pod() {
    container_heals_are_published_per_pod(Daemon::Rclone);
}
