//! Kubernetes Events through the kube client's mock transport (tower-test):
//! the reporter on the "loop" side, the real publisher thread, and the
//! requests the API server would see, with their bodies.
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fuse_supervisor::events::{ApiServer, EventReporter, Events, EventsConfig, PodNames, PodRef};
use fuse_supervisor_engine::heal::Healed;
use fuse_supervisor_engine::kube::KubeletError;
use fuse_supervisor_engine::model::state::Owner;
use fuse_supervisor_engine::report::{HealReport, Report, Reporter, TargetEvent};
use http::{Method, Request, Response};
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock::{self, Handle, SendResponse};

const WAIT: Duration = Duration::from_secs(10);
const TARGET: &str = "/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~csi/pv-data/mount";
const SOURCE: &str = "/var/lib/juicefs/volume/pv-data-abcdef";

/// The kubelet's pods: `uid-N` is `apps/web-N`; counts its calls.
#[derive(Clone, Default)]
struct Node(Arc<Mutex<usize>>);

impl PodNames for Node {
    fn pods(&mut self) -> Result<Vec<PodRef>, KubeletError> {
        *self.0.lock().unwrap() += 1;
        Ok((1..=3)
            .map(|n| PodRef { namespace: "apps".into(), name: format!("web-{n}"), uid: format!("uid-{n}") })
            .collect())
    }
}

/// The API server's side of the mock transport.
struct ApiServerMock {
    handle: Handle<Request<Body>, Response<Body>>,
    runtime: tokio::runtime::Runtime,
}

/// One request as the API server saw it.
struct Seen {
    method: Method,
    path: String,
    content_type: String,
    body: Value,
    respond: SendResponse<Response<Body>>,
}

impl Seen {
    fn answer(self, status: u16, body: &Value) {
        let response = Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap();
        self.respond.send_response(response);
    }

    /// Answers like the API server: the object written back.
    fn accept(self) -> Value {
        let body = self.body.clone();
        let status = if self.method == Method::POST { 201 } else { 200 };
        self.answer(status, &body);
        body
    }
}

impl ApiServerMock {
    fn next(&mut self) -> Seen {
        let handle = &mut self.handle;
        self.runtime.block_on(async {
            let (request, respond) = tokio::time::timeout(WAIT, handle.next_request())
                .await
                .expect("a request to the API server")
                .expect("the client is still there");
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.expect("request body");
            Seen {
                method: parts.method,
                path: parts.uri.path().to_owned(),
                content_type: parts
                    .headers
                    .get("content-type")
                    .map(|value| value.to_str().unwrap().to_owned())
                    .unwrap_or_default(),
                body: serde_json::from_slice(&bytes).expect("a JSON body"),
                respond,
            }
        })
    }

    /// No request comes within a short while.
    fn quiet(&mut self) {
        let handle = &mut self.handle;
        let next = self
            .runtime
            .block_on(async { tokio::time::timeout(Duration::from_millis(300), handle.next_request()).await });
        // A timeout, or a client gone without sending anything.
        assert!(!matches!(next, Ok(Some(_))), "unexpected request to the API server");
    }
}

fn start(names: Option<Node>, queue: usize) -> (Events, ApiServerMock) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let config = EventsConfig { queue, ..EventsConfig::new(ApiServer::InCluster, "node-1") };
    let names = names.map(|node| Box::new(node) as Box<dyn PodNames>);
    let events = Events::start_with_client(move || kube::Client::new(service, "default"), names, &config).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    (events, ApiServerMock { handle, runtime })
}

fn target(broken_since: Option<SystemTime>) -> TargetEvent<'static> {
    TargetEvent { target: Path::new(TARGET), pod_uid: "uid-1", source: Path::new(SOURCE), broken_since }
}

fn broken(reporter: &EventReporter) {
    reporter.report(&Report::TargetBroken(&target(Some(SystemTime::now()))));
}

#[test]
fn a_healed_mount_is_posted_about_its_pod() {
    let node = Node::default();
    let (events, mut api) = start(Some(node.clone()), 16);
    let heal = HealReport {
        how: Healed::Stacked,
        latency: Duration::from_micros(2_700),
        source_wait: Some(Duration::from_micros(1_100)),
        outage: Some(Duration::from_millis(1_400)),
        layers_removed: 1,
    };
    events.reporter().report(&Report::TargetHealed { target: &target(None), heal: &heal });

    let seen = api.next();
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.path, "/apis/events.k8s.io/v1/namespaces/apps/events");
    let body = seen.accept();
    assert_eq!(body["apiVersion"], "events.k8s.io/v1");
    assert_eq!(body["kind"], "Event");
    assert_eq!(body["metadata"]["namespace"], "apps");
    assert!(body["metadata"]["name"].as_str().unwrap().starts_with("web-1."));
    assert_eq!(
        body["regarding"],
        json!({"apiVersion": "v1", "kind": "Pod", "namespace": "apps", "name": "web-1", "uid": "uid-1"})
    );
    assert_eq!(body["reason"], "FuseMountHealed");
    assert_eq!(body["type"], "Normal");
    assert_eq!(body["action"], "Heal");
    assert_eq!(body["reportingController"], "fuse-supervisor");
    assert_eq!(body["reportingInstance"], "fuse-supervisor-node-1");
    assert_eq!(
        body["note"],
        "FUSE volume mount volumes/kubernetes.io~csi/pv-data/mount healed from /var/lib/juicefs/volume/pv-data-abcdef \
         by stacking the new mount: outage 1.4s, heal latency 2.7ms, 1 stale layer removed"
    );
    assert!(body["eventTime"].as_str().unwrap().ends_with('Z'));
    assert!(body.get("series").is_none());
    events.stop();
    assert_eq!(*node.0.lock().unwrap(), 1);
}

#[test]
fn repeats_patch_the_series_of_the_first_event() {
    let node = Node::default();
    let (events, mut api) = start(Some(node.clone()), 16);
    let reporter = events.reporter();
    broken(&reporter);
    let first = api.next();
    assert_eq!((first.method.clone(), first.body["reason"].clone()), (Method::POST, json!("FuseMountBroken")));
    assert_eq!(first.body["type"], "Warning");
    let created = first.accept();
    let name = created["metadata"]["name"].as_str().unwrap().to_owned();

    for count in 2..=3 {
        broken(&reporter);
        let repeat = api.next();
        assert_eq!(repeat.method, Method::PATCH);
        assert_eq!(repeat.path, format!("/apis/events.k8s.io/v1/namespaces/apps/events/{name}"));
        assert_eq!(repeat.content_type, "application/merge-patch+json");
        let series = &repeat.body["series"];
        assert_eq!(series["count"], count);
        assert!(series["lastObservedTime"].is_string());
        // Only the series changes: the note of an Event is immutable.
        assert_eq!(repeat.body.as_object().unwrap().len(), 1);
        let mut updated = created.clone();
        updated["series"] = series.clone();
        repeat.answer(200, &updated);
    }
    events.stop();
    // The pod was named once; the repeats needed no name.
    assert_eq!(*node.0.lock().unwrap(), 1);
    api.quiet();
}

#[test]
fn a_series_whose_event_vanished_is_posted_again() {
    let (events, mut api) = start(Some(Node::default()), 16);
    let reporter = events.reporter();
    broken(&reporter);
    let first = api.next().accept();
    broken(&reporter);
    let patch = api.next();
    assert_eq!(patch.method, Method::PATCH);
    let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
        "message": "events.events.k8s.io not found"});
    patch.answer(404, &gone);

    let again = api.next();
    assert_eq!(again.method, Method::POST);
    assert_ne!(again.body["metadata"]["name"], first["metadata"]["name"]);
    assert_eq!(again.body["series"]["count"], 2);
    assert_eq!(again.body["note"], first["note"]);
    let recreated = again.accept();

    broken(&reporter);
    let patch = api.next();
    assert_eq!(patch.path.rsplit('/').next(), recreated["metadata"]["name"].as_str());
    assert_eq!(patch.body["series"]["count"], 3);
    patch.accept();
    let counters = events.counters();
    events.stop();
    // The patch that found nothing is neither written nor failed: its event was.
    assert_eq!((counters.written(), counters.failed()), (3, 0));
}

#[test]
fn a_daemon_restart_is_about_the_owner_pod_and_needs_no_kubelet() {
    let (events, mut api) = start(None, 16);
    let reporter = events.reporter();
    // Without a kubelet, an application pod has no name: nothing is sent.
    broken(&reporter);
    let owner = Owner {
        namespace: "kube-system".into(),
        pod: "juicefs-node-1-pv-data".into(),
        pod_uid: "owner-uid".into(),
        container: "jfs-mount".into(),
        container_id: Some("containerd://abc".into()),
        started_at: Some(SystemTime::now()),
    };
    reporter.report(&Report::DaemonRestarted { source: Path::new(SOURCE), owner: &owner });

    let seen = api.next();
    assert_eq!(seen.path, "/apis/events.k8s.io/v1/namespaces/kube-system/events");
    let body = seen.accept();
    assert_eq!(body["reason"], "FuseDaemonRestarted");
    assert_eq!(body["action"], "Confirm");
    assert_eq!(body["regarding"]["name"], "juicefs-node-1-pv-data");
    assert_eq!(body["regarding"]["uid"], "owner-uid");
    assert_eq!(
        body["note"],
        "container jfs-mount restarted and mounted /var/lib/juicefs/volume/pv-data-abcdef again; \
         the pods using it are being healed"
    );
    let counters = events.counters();
    events.stop();
    assert_eq!((counters.unresolved(), counters.written()), (1, 1));
}

#[test]
fn a_full_queue_drops_and_counts_without_blocking_the_reporter() {
    let (events, mut api) = start(Some(Node::default()), 2);
    let reporter = events.reporter();
    let counters = events.counters();
    broken(&reporter);
    // The publisher now waits for the API server, which does not answer yet.
    let held = api.next();
    // Two fit in the queue; the other eight are dropped at once.
    for _ in 0..10 {
        reporter.report(&Report::HealFailed {
            target: &target(None),
            error: "cannot open target: permission denied",
            attempts: 3,
            retry_in: Duration::from_millis(400),
        });
    }
    assert_eq!(counters.dropped(), 8);
    held.accept();
    // The two queued ones: one event, one repeat.
    let failed = api.next();
    assert_eq!(failed.body["reason"], "FuseHealFailed");
    assert_eq!(
        failed.body["note"],
        "cannot heal FUSE volume mount volumes/kubernetes.io~csi/pv-data/mount from \
         /var/lib/juicefs/volume/pv-data-abcdef (attempt 3): cannot open target: permission denied; retrying in 400ms"
    );
    failed.accept();
    assert_eq!(api.next().method, Method::PATCH);
    drop(reporter);
    events.stop();
    assert_eq!(counters.dropped(), 8);
}

#[test]
fn after_the_burst_repeats_are_held_back_and_their_count_written_at_stop() {
    let (events, mut api) = start(Some(Node::default()), 64);
    let reporter = events.reporter();
    let counters = events.counters();
    for _ in 0..27 {
        broken(&reporter);
    }
    // 25 writes: the event and 24 series patches.
    let mut counts = Vec::new();
    for _ in 0..25 {
        let seen = api.next();
        counts.push(seen.body["series"]["count"].as_i64().unwrap_or(1));
        seen.accept();
    }
    assert_eq!(counts, (1..=25).collect::<Vec<i64>>());
    api.quiet();
    assert_eq!(counters.limited(), 2);
    // Stopping writes the count the limiter held back.
    let stopper = std::thread::spawn(move || events.stop());
    let last = api.next();
    assert_eq!((last.method.clone(), last.body["series"]["count"].clone()), (Method::PATCH, json!(27)));
    last.accept();
    stopper.join().unwrap();
    assert_eq!(counters.written(), 26);
}
