//! What an Event costs the loop thread: `EventReporter::report` for a
//! healed target, queued (the publisher has room) and dropped (the queue is
//! full because the API server does not answer).
//!
//! `cargo bench --bench events -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use fuse_supervisor::events::{ApiServer, Events, EventsConfig};
use fuse_supervisor_engine::heal::Healed;
use fuse_supervisor_engine::model::state::Owner;
use fuse_supervisor_engine::report::{HealReport, Report, Reporter, TargetEvent};
use http::{Request, Response};
use kube::client::Body;

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;
/// The unanswered request; dropping it fails the publisher's call.
type Pending = (Request<Body>, tower_test::mock::SendResponse<Response<Body>>);

/// A publisher stuck on a request its API server does not answer, so it
/// takes nothing more off the queue until the handle is dropped.
fn stuck_publisher(queue: usize, runtime: &tokio::runtime::Runtime) -> (Events, Handle, Pending) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let config = EventsConfig { queue, ..EventsConfig::new(ApiServer::InCluster, "bench") };
    let events = Events::start_with_client(move || kube::Client::new(service, "default"), None, &config)
        .expect("start the publisher");
    let owner = Owner {
        namespace: "kube-system".into(),
        pod: "fuse-daemon".into(),
        pod_uid: "owner".into(),
        container: "fuse".into(),
        container_id: None,
        started_at: None,
    };
    events.reporter().report(&Report::DaemonRestarted { source: Path::new("/var/lib/fuse"), owner: &owner });
    let pending = runtime.block_on(handle.next_request()).expect("the publisher's first request");
    (events, handle, pending)
}

/// The pending request first: the publisher's call fails and it can stop.
fn finish(events: Events, handle: Handle, pending: Pending) {
    drop(pending);
    drop(handle);
    drop(events);
}

fn report(c: &mut Criterion) {
    let target = TargetEvent {
        target: Path::new(
            "/var/lib/kubelet/pods/0c7a3f4e-2b6e-4d8a-9a53-8d1e2f6b7c90/volumes/kubernetes.io~csi/pvc-1/mount",
        ),
        pod_uid: "0c7a3f4e-2b6e-4d8a-9a53-8d1e2f6b7c90",
        source: Path::new("/var/lib/juicefs/volume/pvc-1-abcdef"),
        broken_since: None,
    };
    let heal = HealReport {
        how: Healed::Stacked,
        latency: Duration::from_micros(800),
        source_wait: Some(Duration::from_micros(300)),
        outage: Some(Duration::from_millis(1_200)),
        layers_removed: 1,
    };
    let healed = Report::TargetHealed { target: &target, heal: &heal };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut group = c.benchmark_group("event_report");
    // A fresh queue as long as the batch, so every report fits.
    group.bench_function("queued", |b| {
        b.iter_custom(|iters| {
            let (events, handle, pending) = stuck_publisher(iters as usize, &runtime);
            let reporter = events.reporter();
            let start = Instant::now();
            for _ in 0..iters {
                reporter.report(black_box(&healed));
            }
            let took = start.elapsed();
            drop(reporter);
            finish(events, handle, pending);
            took
        })
    });
    group.bench_function("dropped", |b| {
        b.iter_custom(|iters| {
            let (events, handle, pending) = stuck_publisher(1, &runtime);
            let reporter = events.reporter();
            reporter.report(&healed);
            let start = Instant::now();
            for _ in 0..iters {
                reporter.report(black_box(&healed));
            }
            let took = start.elapsed();
            assert_eq!(events.counters().dropped(), iters);
            drop(reporter);
            finish(events, handle, pending);
            took
        })
    });
    group.finish();
}

criterion_group!(benches, report);
criterion_main!(benches);
