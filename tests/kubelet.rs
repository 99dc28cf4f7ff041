//! The kubelet client against the HTTPS stand-in: every fixture round trips,
//! and every fault gives its own clear error.
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, UNIX_EPOCH};

use fuse_supervisor::events::PodNames;
use fuse_supervisor_engine::kube::Kubelet;
use fuse_supervisor_engine::kube::{
    KubeletAuthz, KubeletClient, KubeletConfig, KubeletError, KubeletTls, PodList, TimeoutPhase,
};
use fuse_supervisor_testbed::CapturedLogs;
use fuse_supervisor_testbed::kubelet::{Fault, KubeletStandIn, full_node_pods, fuse_owner_pod, pod_list_body};
use tempfile::TempDir;

const FIXTURES: [&str; 4] = [
    "juicefs-mount-pod.json",
    "juicefs-mount-pod-restarted.json",
    "fluid-fuse-daemonset.json",
    "native-sidecar-and-job.json",
];

/// A stand-in and a directory with its CA, its certificate and a token.
struct Node {
    kubelet: KubeletStandIn,
    dir: TempDir,
}

impl Node {
    fn start() -> Self {
        let kubelet = KubeletStandIn::start().unwrap();
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("ca.pem"), kubelet.ca_pem()).unwrap();
        fs::write(dir.path().join("cert.pem"), kubelet.cert_pem()).unwrap();
        fs::write(dir.path().join("token"), "token-one\n").unwrap();
        Self { kubelet, dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn config(&self, tls: KubeletTls) -> KubeletConfig {
        KubeletConfig {
            port: self.kubelet.port(),
            token_file: Some(self.path("token")),
            connect_timeout: Duration::from_secs(2),
            read_timeout: Duration::from_secs(2),
            ..KubeletConfig::new("127.0.0.1", tls)
        }
    }

    fn client(&self) -> KubeletClient {
        KubeletClient::new(self.config(KubeletTls::CaFile(self.path("ca.pem")))).unwrap()
    }
}

fn fixture(name: &str) -> Vec<u8> {
    fs::read(format!("{}/fixtures/kubelet/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// The error and its whole chain of causes, as a log line would show it.
fn chain(err: &KubeletError) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

#[test]
fn every_fixture_round_trips() {
    let node = Node::start();
    let client = node.client();
    for name in FIXTURES {
        let body = fixture(name);
        node.kubelet.set_pods(body.clone());
        assert_eq!(client.pods().unwrap(), PodList::from_slice(&body).unwrap(), "{name}");
    }
    // A full node: about 0.5 MiB, sent chunked like Go does.
    let body = full_node_pods(110);
    assert!(body.len() > 256 * 1024, "{}", body.len());
    node.kubelet.set_pods(body);
    let pods = client.pods().unwrap();
    assert_eq!(pods.items.len(), 110);
    assert_eq!(node.kubelet.requests(), FIXTURES.len() + 1);
    assert_eq!(node.kubelet.last_token().as_deref(), Some("token-one"));
}

#[test]
fn a_scenario_owner_pod_shows_its_restart() {
    let node = Node::start();
    let client = node.client();
    let started = UNIX_EPOCH + Duration::from_secs(1_741_064_767);
    let owner = |instance, at| fuse_owner_pod("mount-a", "uid-a", "/sandbox/runtime/vol", instance, at);
    node.kubelet.set_pods(pod_list_body([owner(0, started)]));
    let before = client.pods().unwrap();
    let pod = before.pod("uid-a").unwrap();
    let published: Vec<_> = pod.bidirectional_host_paths().map(|b| (b.container, b.host_path)).collect();
    assert_eq!(published, [("jfs-mount", "/sandbox/runtime/vol")]);
    let old = pod.container_status("jfs-mount").unwrap().clone();
    assert_eq!((old.restart_count, old.started_at()), (0, Some(started)));

    let restarted = started + Duration::from_secs(90);
    node.kubelet.set_pods(pod_list_body([owner(1, restarted)]));
    let after = client.pods().unwrap();
    let new = after.pod("uid-a").unwrap().container_status("jfs-mount").unwrap();
    assert_ne!(new.container_id, old.container_id);
    assert_eq!((new.restart_count, new.started_at()), (1, Some(restarted)));
    assert_eq!(new.last_state.terminated.as_ref().unwrap().container_id, old.container_id);
}

#[test]
fn a_wrong_token_is_401_naming_the_token_file() {
    let node = Node::start();
    node.kubelet.set_token(Some("the-right-one"));
    let err = node.client().pods().unwrap_err();
    assert!(matches!(err, KubeletError::Unauthorized { .. }), "{err:?}");
    let message = chain(&err);
    assert!(message.contains("401") && message.contains(&node.path("token").display().to_string()), "{message}");
    assert!(!err.is_retryable());
}

#[test]
fn forbidden_names_the_rbac_rule() {
    let node = Node::start();
    node.kubelet.set_fault(Some(Fault::Status(403)));
    let err = node.client().pods().unwrap_err();
    let message = chain(&err);
    assert!(matches!(err, KubeletError::Forbidden { .. }), "{err:?}");
    assert!(message.contains("`nodes/pods`") && !message.contains("nodes/proxy"), "{message}");
    assert!(message.contains("subresource(s)=[pods]"), "the kubelet's own words are kept: {message}");
    assert!(!err.is_retryable());

    let proxy = KubeletClient::new(KubeletConfig { authz: KubeletAuthz::NodesProxy, ..node.client().config().clone() });
    let message = chain(&proxy.unwrap().pods().unwrap_err());
    assert!(message.contains("`nodes/proxy`"), "{message}");
}

#[test]
fn a_server_error_is_reported_before_any_body_parse() {
    let node = Node::start();
    node.kubelet.set_fault(Some(Fault::Status(500)));
    let err = node.client().pods().unwrap_err();
    // The body ("Internal Server Error") is not JSON: the status wins.
    let KubeletError::Status { code: 500, ref body, .. } = err else { panic!("{err:?}") };
    assert_eq!(body, "Internal Server Error");
    assert!(chain(&err).contains(&node.kubelet.addr().to_string()));
    assert!(err.is_retryable());
}

#[test]
fn a_slow_response_times_out_on_the_whole_response_deadline() {
    let node = Node::start();
    node.kubelet.set_pods(full_node_pods(110));
    // 20 pieces over 4 s: a piece every 200 ms, so no single read waits
    // longer than the 400 ms timeout; only a whole-response deadline stops it.
    node.kubelet.set_fault(Some(Fault::Slow(Duration::from_secs(4))));
    let timeout = Duration::from_millis(400);
    let client = KubeletClient::new(KubeletConfig { read_timeout: timeout, ..node.client().config().clone() }).unwrap();
    let started = Instant::now();
    let err = client.pods().unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err, KubeletError::Timeout { phase: TimeoutPhase::Response, limit, .. } if limit == timeout),
        "{err:?}"
    );
    assert!(took >= timeout, "gave up after {took:?}");
    assert!(took < timeout + Duration::from_secs(1), "waited {took:?} for a {timeout:?} deadline");
    assert!(chain(&err).contains("did not send the whole /pods response within 400ms"), "{}", chain(&err));
    assert!(err.is_retryable());
}

#[test]
fn malformed_json_names_the_path_line_and_column() {
    let node = Node::start();
    node.kubelet.set_fault(Some(Fault::Malformed));
    let err = node.client().pods().unwrap_err();
    let KubeletError::Body { ref source, .. } = err else { panic!("{err:?}") };
    assert_eq!((source.path.as_str(), source.line), ("items[0].spec.containers[0]", 1));
    let message = chain(&err);
    assert!(message.contains("not a valid PodList") && message.contains("column"), "{message}");
    assert!(!err.is_retryable());
}

#[test]
fn an_unreadable_pod_is_skipped_and_warned_about_once_while_it_stays() {
    let node = Node::start();
    let client = node.client();
    let started = UNIX_EPOCH + Duration::from_secs(1_741_064_767);
    let owner = fuse_owner_pod("mount-a", "uid-a", "/sandbox/runtime/vol", 0, started);
    let mut broken = fuse_owner_pod("mount-b", "uid-b", "/sandbox/runtime/other", 0, started);
    broken["spec"]["containers"] = serde_json::json!({"name": "not a list"});
    node.kubelet.set_pods(pod_list_body([broken, owner]));
    let logs = CapturedLogs::default();
    logs.capture(tracing::Level::INFO, || {
        for _ in 0..3 {
            let pods = client.pods().unwrap();
            assert!(pods.pod("uid-a").is_some() && pods.pod("uid-b").is_none());
            assert_eq!(pods.skipped.len(), 1);
        }
    });
    let logs = logs.text();
    let warnings: Vec<_> = logs.lines().filter(|line| line.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{logs}");
    for says in ["kube-system/mount-b", "uid-b", "spec.containers", "127.0.0.1:"] {
        assert!(warnings[0].contains(says), "{says}: {logs}");
    }
    // Events still name it: its metadata reads.
    let mut names = Kubelet::new(client.config().clone());
    let named: Vec<String> = PodNames::pods(&mut names).unwrap().into_iter().map(|pod| pod.name).collect();
    assert_eq!(named, ["mount-a", "mount-b"]);
}

#[test]
fn a_dropped_connection_is_a_retryable_protocol_error() {
    let node = Node::start();
    node.kubelet.set_fault(Some(Fault::Close));
    let err = node.client().pods().unwrap_err();
    assert!(matches!(err, KubeletError::Protocol { .. }), "{err:?}");
    assert!(chain(&err).contains("closed before the response was complete"), "{}", chain(&err));
    assert!(err.is_retryable());
    assert_eq!(node.kubelet.requests(), 1);
}

#[test]
fn a_body_cut_short_is_a_retryable_protocol_error() {
    let node = Node::start();
    node.kubelet.set_pods(full_node_pods(20));
    node.kubelet.set_fault(Some(Fault::CutShort));
    let err = node.client().pods().unwrap_err();
    assert!(matches!(err, KubeletError::Protocol { .. }), "{err:?}");
    assert!(chain(&err).contains("closed before the response was complete"), "{}", chain(&err));
    assert!(err.is_retryable());
}

/// The responses that once fooled the client (`fixtures/fuzz/http-framing`).
#[test]
fn every_framing_regression_case_is_a_protocol_error() {
    let node = Node::start();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/fuzz/http-framing");
    let mut cases = 0;
    for entry in fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        node.kubelet.set_fault(Some(Fault::Raw(fs::read(&path).unwrap())));
        let err = node.client().pods().unwrap_err();
        assert!(matches!(err, KubeletError::Protocol { .. }), "{}: {err:?}", path.display());
        cases += 1;
    }
    assert!(cases > 0, "no case in {}", dir.display());
}

#[test]
fn a_closed_port_is_connection_refused() {
    let node = Node::start();
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let client = KubeletClient::new(KubeletConfig { port, ..node.client().config().clone() }).unwrap();
    let err = client.pods().unwrap_err();
    let KubeletError::Connect { ref source, .. } = err else { panic!("{err:?}") };
    assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(chain(&err).contains(&format!("127.0.0.1:{port}")), "{}", chain(&err));
    assert!(err.is_retryable());
}

#[test]
fn a_listener_that_never_answers_times_out_in_the_handshake() {
    let node = Node::start();
    // Accepts (the kernel completes the TCP handshake) but never speaks TLS.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let connect_timeout = Duration::from_millis(300);
    let config = KubeletConfig { port, connect_timeout, ..node.client().config().clone() };
    let started = Instant::now();
    let err = KubeletClient::new(config).unwrap().pods().unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, KubeletError::Timeout { phase: TimeoutPhase::Tls, .. }), "{err:?}");
    assert!(took >= connect_timeout && took < connect_timeout + Duration::from_secs(1), "{took:?}");
    assert!(chain(&err).contains("did not finish the TLS handshake within 300ms"), "{}", chain(&err));
    assert!(err.is_retryable());
}

#[test]
fn a_certificate_from_another_ca_is_refused_naming_the_ca_file() {
    let node = Node::start();
    let other = KubeletStandIn::start().unwrap();
    let other_ca = node.path("other-ca.pem");
    fs::write(&other_ca, other.ca_pem()).unwrap();
    let client = KubeletClient::new(node.config(KubeletTls::CaFile(other_ca.clone()))).unwrap();
    let err = client.pods().unwrap_err();
    assert!(matches!(err, KubeletError::Tls { .. }), "{err:?}");
    let message = chain(&err);
    assert!(
        message.contains(&other_ca.display().to_string()) && message.contains("not signed by that CA"),
        "{message}"
    );
    assert!(!err.is_retryable());
    assert_eq!(node.kubelet.requests(), 0, "no request may leave before the certificate is trusted");
}

#[test]
fn a_pinned_certificate_must_be_exactly_the_served_one() {
    let node = Node::start();
    let pinned = KubeletClient::new(node.config(KubeletTls::PinnedCertFile(node.path("cert.pem")))).unwrap();
    assert!(pinned.pods().is_ok());

    // The pin ignores names: reach the same kubelet as "localhost".
    let by_name = KubeletConfig { host: "localhost".into(), ..pinned.config().clone() };
    assert!(KubeletClient::new(by_name).unwrap().pods().is_ok());

    let other = KubeletStandIn::start().unwrap();
    let wrong = node.path("other-cert.pem");
    fs::write(&wrong, other.cert_pem()).unwrap();
    let err = KubeletClient::new(node.config(KubeletTls::PinnedCertFile(wrong.clone()))).unwrap().pods().unwrap_err();
    assert!(matches!(err, KubeletError::Tls { .. }), "{err:?}");
    let message = chain(&err);
    assert!(message.contains(&format!("the pinned certificate {}", wrong.display())), "{message}");
    assert!(message.contains("presented a different certificate"), "{message}");

    // Pinning the CA instead of the serving certificate is not the same.
    let err = KubeletClient::new(node.config(KubeletTls::PinnedCertFile(node.path("ca.pem")))).unwrap().pods();
    assert!(matches!(err, Err(KubeletError::Tls { .. })), "{err:?}");
    assert_eq!(node.kubelet.requests(), 2);
}

#[test]
fn bad_trust_files_fail_at_start() {
    let node = Node::start();
    fs::write(node.path("empty.pem"), "").unwrap();
    for tls in [
        KubeletTls::CaFile(node.path("missing.pem")),
        KubeletTls::CaFile(node.path("empty.pem")),
        KubeletTls::PinnedCertFile(node.path("empty.pem")),
    ] {
        let err = KubeletClient::new(node.config(tls.clone())).unwrap_err();
        assert!(matches!(err, KubeletError::ReadTrust { .. }), "{tls:?}: {err:?}");
        assert!(chain(&err).contains(node.dir.path().to_str().unwrap()), "{}", chain(&err));
    }
}

#[test]
fn insecure_skip_verify_works_and_warns_on_every_start() {
    let node = Node::start();
    let logs = CapturedLogs::default();
    logs.capture(tracing::Level::INFO, || {
        for _ in 0..2 {
            let client = KubeletClient::new(node.config(KubeletTls::InsecureSkipVerify)).unwrap();
            assert!(client.pods().is_ok());
        }
    });
    let logs = logs.text();
    let warnings: Vec<_> = logs.lines().filter(|line| line.contains("WARN")).collect();
    assert_eq!(warnings.len(), 2, "{logs}");
    assert!(warnings[0].contains("verification is off") && warnings[0].contains("127.0.0.1:"), "{logs}");
}

#[test]
fn the_token_is_read_again_on_every_call() {
    let node = Node::start();
    let client = node.client();
    node.kubelet.set_token(Some("token-one"));
    client.pods().unwrap();
    assert_eq!(node.kubelet.last_token().as_deref(), Some("token-one"));

    // The kubelet rotates the projected token: the next call sends the new one.
    fs::write(node.path("token"), "token-two\n").unwrap();
    node.kubelet.set_token(Some("token-two"));
    client.pods().unwrap();
    assert_eq!(node.kubelet.last_token().as_deref(), Some("token-two"));
    assert_eq!(node.kubelet.requests(), 2);
}

#[test]
fn a_missing_or_empty_token_file_is_named_and_nothing_is_sent() {
    let node = Node::start();
    let client = node.client();
    for contents in [None, Some("\n")] {
        match contents {
            None => fs::remove_file(node.path("token")).unwrap(),
            Some(text) => fs::write(node.path("token"), text).unwrap(),
        }
        let err = client.pods().unwrap_err();
        assert!(matches!(err, KubeletError::Token { .. }), "{err:?}");
        assert!(chain(&err).contains(&node.path("token").display().to_string()), "{}", chain(&err));
    }
    assert_eq!(node.kubelet.requests(), 0);

    // No token file at all: no Authorization header.
    let anonymous = KubeletClient::new(KubeletConfig { token_file: None, ..client.config().clone() }).unwrap();
    anonymous.pods().unwrap();
    assert_eq!(node.kubelet.last_token(), None);
}
