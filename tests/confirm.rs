//! Restart confirmation end to end: a real FUSE daemon crashes and comes
//! back in a private mount namespace while `fuse-supervisor run` asks an
//! HTTPS kubelet stand-in whether the daemon's pod restarted. Every heal is
//! judged from a container-model reader. Needs root and /dev/fuse.
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use fuse_supervisor_testbed::kubelet::{Fault, KubeletStandIn, app_pod, fuse_owner_pod, pod_list_body};
use fuse_supervisor_testbed::scenario::{DATA_FILE, Daemon, FuseSource, Restart, SupervisorProcess, wait_for};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);
const TOKEN: &str = "supervisor-token";
const OWNER: &str = "fuse-owner";

fn binary() -> &'static Path {
    Path::new(BINARY)
}

/// One pod reading a source whose owner pod publishes it through a
/// Bidirectional hostPath of the sandbox's runtime tree.
struct Node {
    reader: Option<ContainerReader>,
    supervisor: Option<SupervisorProcess>,
    kubelet: KubeletStandIn,
    source: FuseSource,
    /// When the owner's container (instance 0) started: long before the test.
    started: SystemTime,
    sandbox: Sandbox,
}

impl Node {
    fn new() -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, Daemon::DemoFs, "owned").expect("start daemon");
        let target = source.bind_volume(&sandbox, "app-pod", "data").expect("bind volume");
        let reader = ContainerReader::spawn(&sandbox, "app", &target, Path::new(DATA_FILE)).expect("reader");
        let kubelet = KubeletStandIn::start().expect("kubelet stand-in");
        kubelet.set_token(Some(TOKEN));
        let node = Node {
            reader: Some(reader),
            supervisor: None,
            kubelet,
            source,
            started: SystemTime::now() - Duration::from_secs(3600),
            sandbox,
        };
        node.owner_is(0, node.started);
        node.reads_again();
        node
    }

    /// The stand-in shows the owner's container as its `instance`-th run.
    fn owner_is(&self, instance: u32, started: SystemTime) {
        let host_path = self.sandbox.runtime_root().display().to_string();
        self.kubelet.set_pods(pod_list_body([fuse_owner_pod(OWNER, "owner-uid", &host_path, instance, started)]));
    }

    /// Starts the supervisor against `kubelet` (an https URL) with extra flags.
    fn start_supervisor(&mut self, kubelet: &str, extra: &[&str]) {
        // Written from the sandbox: its tmpfs hides the host's directory.
        let files = self.sandbox.root().join("credentials");
        let (ca, token) = (files.join("ca.pem"), files.join("token"));
        let writes = (files, ca.clone(), self.kubelet.ca_pem().to_owned(), token.clone());
        self.sandbox
            .run(move || {
                let (files, ca, pem, token) = writes;
                std::fs::create_dir_all(files)?;
                std::fs::write(ca, pem)?;
                std::fs::write(token, TOKEN)
            })
            .expect("write credentials");
        let mut args: Vec<String> = vec![
            "--kubelet".into(),
            kubelet.into(),
            "--kubelet-ca-file".into(),
            path(&ca),
            "--kubelet-token-file".into(),
            path(&token),
        ];
        args.extend(extra.iter().map(|arg| arg.to_string()));
        let state = self.sandbox.root().join("state");
        self.supervisor =
            Some(SupervisorProcess::start_with(&self.sandbox, binary(), &state, args).expect("supervisor"));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    fn reader(&self) -> &ContainerReader {
        self.reader.as_ref().expect("reader")
    }

    fn reads_again(&self) {
        let expected = self.source.expected_content();
        self.reader()
            .wait_until(TIMEOUT, |observation| observation.content() == Some(expected.as_str()))
            .expect("the container reads the source");
    }

    fn crash_and_restart(&mut self) {
        self.source.crash().expect("crash");
        self.reader().wait_until(TIMEOUT, |observation| observation.error().is_some()).expect("reader sees the crash");
        self.source.restart(&self.sandbox, Restart::UnmountThenMount).expect("restart");
    }

    fn logged(&self, message: &str) -> String {
        let quoted = format!("\"message\":\"{message}");
        self.supervisor().wait_for_log(TIMEOUT, |line| line.contains(&quoted)).expect(message)
    }
}

fn path(path: &Path) -> String {
    path.display().to_string()
}

fn url(kubelet: &KubeletStandIn) -> String {
    format!("https://127.0.0.1:{}", kubelet.port())
}

/// A series of the supervisor's `/metrics`, 0 when it is not exposed yet.
fn metric(node: &Node, series: &str) -> f64 {
    node.supervisor().metric(series).expect("scrape /metrics").unwrap_or(0.0)
}

fn still_broken(observation: Option<Observation>) -> bool {
    observation.is_some_and(|observation| observation.error().is_some())
}

#[test]
fn a_restart_the_kubelet_confirms_is_healed_and_its_owner_recorded() {
    let mut node = Node::new();
    node.start_supervisor(&url(&node.kubelet), &[]);
    node.crash_and_restart();
    node.owner_is(1, SystemTime::now());

    node.reads_again();
    let confirmed = node.logged("kubelet confirms the owner restarted");
    assert!(confirmed.contains(OWNER), "{confirmed}");
    node.logged("healed");
    assert!(node.kubelet.requests() >= 1);
    assert_eq!(metric(&node, "fuse_supervisor_daemon_restarts_total"), 1.0);
    assert!(metric(&node, r#"fuse_supervisor_kubelet_requests_total{code="200"}"#) >= 1.0);
    // The state file is written when the loop has nothing else to do,
    // after the heal: wait for it.
    let state_file = node.sandbox.root().join("state/state.json");
    let recorded = || {
        let state_file = state_file.clone();
        let state = node.sandbox.run(move || std::fs::read_to_string(state_file)).unwrap_or_default();
        state.contains(OWNER) && state.contains("containerd://")
    };
    if let Err(err) = wait_for("the owner in the state file", TIMEOUT, recorded) {
        let state = node.sandbox.run(move || std::fs::read_to_string(state_file)).unwrap_or_default();
        panic!("{err}; owner not recorded:\n{state}");
    }
}

#[test]
fn a_malformed_pod_beside_the_owner_is_skipped_and_the_restart_confirmed() {
    let mut node = Node::new();
    node.start_supervisor(&url(&node.kubelet), &["--kubelet-grace", "30s"]);
    node.crash_and_restart();
    let mut broken = app_pod("apps", "broken-app", "broken-uid");
    broken["status"]["containerStatuses"][0]["state"] = serde_json::json!({"running": {"startedAt": "yesterday"}});
    let host_path = node.sandbox.runtime_root().display().to_string();
    let owner = fuse_owner_pod(OWNER, "owner-uid", &host_path, 1, SystemTime::now());
    node.kubelet.set_pods(pod_list_body([broken, owner]));

    node.reads_again();
    node.logged("kubelet confirms the owner restarted");
    let skipped = node.logged("kubelet listed a pod that cannot be read; skipped");
    for says in ["apps/broken-app", "broken-uid", "status.containerStatuses[0].state.running.startedAt", "yesterday"] {
        assert!(skipped.contains(says), "{says}: {skipped}");
    }
    assert_eq!(metric(&node, "fuse_supervisor_daemon_restarts_total"), 1.0);
}

#[test]
fn no_restart_shown_means_no_heal_until_the_kubelet_shows_it() {
    let mut node = Node::new();
    node.start_supervisor(&url(&node.kubelet), &[]);
    node.crash_and_restart();

    node.logged("kubelet shows no restart of the owner yet");
    // Re-checks go on; the target stays broken meanwhile.
    let asked = node.kubelet.requests();
    std::thread::sleep(Duration::from_millis(700));
    assert!(node.kubelet.requests() > asked, "no re-check in 700 ms");
    assert!(still_broken(node.reader().latest()), "healed without confirmation");
    assert!(!node.supervisor().log().iter().any(|line| line.contains("\"healed\"")));

    node.owner_is(1, SystemTime::now());
    node.reads_again();
    node.logged("kubelet confirms the owner restarted");
}

#[test]
fn an_unreachable_kubelet_delays_the_heal_by_the_grace_only() {
    let mut node = Node::new();
    // A port nothing listens on: connection refused, which is retried.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    node.start_supervisor(&format!("https://127.0.0.1:{closed}"), &["--kubelet-grace", "1s"]);
    node.crash_and_restart();
    let restarted = Instant::now();

    node.reads_again();
    let waited = restarted.elapsed();
    let line = node.logged("kubelet failed for the whole grace; healing on mount evidence alone");
    assert!(line.contains("refused") || line.contains("connect"), "{line}");
    assert!(waited >= Duration::from_millis(900), "healed after {waited:?}, before the grace");
}

#[test]
fn a_failing_kubelet_is_retried_and_a_later_answer_confirms() {
    let mut node = Node::new();
    node.kubelet.set_fault(Some(Fault::Status(500)));
    node.start_supervisor(&url(&node.kubelet), &["--kubelet-grace", "30s"]);
    node.crash_and_restart();
    node.owner_is(1, SystemTime::now());

    let failed = node.logged("kubelet cannot confirm the restart");
    assert!(failed.contains("500"), "{failed}");
    assert!(still_broken(node.reader().latest()));
    node.kubelet.set_fault(None);
    node.reads_again();
    node.logged("kubelet confirms the owner restarted");
    assert!(metric(&node, r#"fuse_supervisor_kubelet_requests_total{code="500"}"#) >= 1.0);
    assert!(metric(&node, r#"fuse_supervisor_kubelet_requests_total{code="200"}"#) >= 1.0);
}

#[test]
fn a_forbidden_kubelet_heals_at_once_and_names_the_rbac_rule() {
    let mut node = Node::new();
    node.kubelet.set_fault(Some(Fault::Status(403)));
    node.start_supervisor(&url(&node.kubelet), &["--kubelet-grace", "30s"]);
    node.crash_and_restart();

    node.reads_again();
    let line = node.logged("kubelet cannot confirm; healing on mount evidence alone");
    assert!(line.contains("nodes/pods"), "{line}");
    assert!(metric(&node, r#"fuse_supervisor_kubelet_requests_total{code="403"}"#) >= 1.0);
    assert_eq!(metric(&node, "fuse_supervisor_daemon_restarts_total"), 0.0);
}

#[test]
fn a_wrong_ca_is_refused_at_the_handshake_and_heals_on_mount_evidence() {
    let mut node = Node::new();
    let other = KubeletStandIn::start().expect("second stand-in");
    // The supervisor trusts the first stand-in's CA but talks to the other.
    node.start_supervisor(&url(&other), &["--kubelet-grace", "30s"]);
    node.crash_and_restart();

    node.reads_again();
    let line = node.logged("kubelet cannot confirm; healing on mount evidence alone");
    assert!(line.contains("certificate"), "{line}");
    assert_eq!(other.requests(), 0, "a request went to an unverified kubelet");
    assert!(metric(&node, r#"fuse_supervisor_kubelet_requests_total{code="none"}"#) >= 1.0);
}

#[test]
fn a_missing_kubelet_address_is_a_clear_start_error() {
    let output = std::process::Command::new(binary())
        .args(["run", "--kubelet-root", "/nonexistent"])
        .env_remove("FUSE_SUPERVISOR_NODE_IP")
        .env_remove("FUSE_SUPERVISOR_NODE_NAME")
        .env_remove("FUSE_SUPERVISOR_KUBELET")
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--node-ip") && stderr.contains("--kubelet none"), "{stderr}");
}
