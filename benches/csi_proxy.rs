//! What the CSI proxy adds to a call: each call made straight to a driver
//! that answers at once (the test world's plugin, mounting nothing), then
//! the same call through `csi-proxy`, each on its own thread and runtime as
//! in their own processes. `NodeGetCapabilities` is passed through as it
//! comes; `NodePublishVolume` is read whole and recorded (a file written,
//! flushed and renamed) before its answer goes back. Prints p50 and p99 of
//! each, and the difference.
//!
//! `cargo bench --bench csi_proxy` (records on /dev/shm where there is one,
//! as on a node's /run tmpfs).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use fuse_supervisor_engine::csi::api;
use fuse_supervisor_engine::csi::proxy::{self, ProxyConfig};
use fuse_supervisor_testbed::csi::CsiClient;
use fuse_supervisor_testbed::csi::plugin::{self, PluginOptions};

const CALLS: usize = 5000;
const WARM_UP: usize = 500;

fn main() {
    let tmpfs = Path::new("/dev/shm");
    let dir = if tmpfs.is_dir() { tempfile::tempdir_in(tmpfs) } else { tempfile::tempdir() }.expect("a directory");
    let (driver_socket, listen) = (dir.path().join("driver.sock"), dir.path().join("proxy.sock"));
    let record_dir = dir.path().join("records");

    let options = PluginOptions {
        socket: driver_socket.clone(),
        name: "bench.csi".into(),
        node_id: "node".into(),
        stage_unstage: true,
        trust_proc_mounts: false,
        answer_only: true,
        call_log: None,
        hang_stage: false,
    };
    let (socket, proxied) = (driver_socket.clone(), listen.clone());
    std::thread::spawn(move || {
        on_a_runtime(async move {
            let listener = tokio::net::UnixListener::bind(&socket).expect("the driver's socket");
            plugin::serve(options, listener, std::future::pending()).await;
        });
    });
    let config =
        ProxyConfig { listen: proxied, driver_socket: driver_socket.clone(), record_dir, record_secrets: true };
    std::thread::spawn(move || {
        on_a_runtime(async move { proxy::serve(config, std::future::pending()).await.expect("the proxy serves") });
    });
    while !listen.exists() || !driver_socket.exists() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let direct = CsiClient::connect(&driver_socket).expect("a client of the driver");
    let through = CsiClient::connect(&listen).expect("a client of the proxy");

    println!("records in {} ({CALLS} calls each, after {WARM_UP})", dir.path().display());
    let capabilities = |client: &CsiClient| {
        client.node_get_capabilities().expect("NodeGetCapabilities");
    };
    compare("NodeGetCapabilities", &direct, &through, capabilities);
    let publish = |client: &CsiClient| client.publish(publish_request()).expect("NodePublishVolume");
    compare("NodePublishVolume", &direct, &through, publish);
}

fn on_a_runtime(future: impl Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(future);
}

/// What the kubelet sends for a pod's volume, secrets included.
fn publish_request() -> api::NodePublishVolumeRequest {
    use api::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    api::NodePublishVolumeRequest {
        volume_id: "bench-volume".into(),
        publish_context: HashMap::new(),
        staging_target_path: "/var/lib/kubelet/plugins/kubernetes.io/csi/bench.csi/0123/globalmount".into(),
        target_path: "/var/lib/kubelet/pods/uid/volumes/kubernetes.io~csi/pv/mount".into(),
        volume_capability: Some(api::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter.into() }),
        }),
        readonly: false,
        secrets: HashMap::from([("key".into(), "secret".into())]),
        volume_context: HashMap::from([("source".into(), "/backing".into())]),
    }
}

fn compare(name: &str, direct: &CsiClient, through: &CsiClient, call: impl Fn(&CsiClient)) {
    let straight = latencies(direct, &call);
    let proxied = latencies(through, &call);
    let (p50, p99) = (percentile(&straight, 50), percentile(&straight, 99));
    let (proxied_p50, proxied_p99) = (percentile(&proxied, 50), percentile(&proxied, 99));
    println!(
        "{name}: direct p50 {p50:?} p99 {p99:?}; through the proxy p50 {proxied_p50:?} p99 {proxied_p99:?}; \
         added p50 {:?} p99 {:?}",
        proxied_p50.saturating_sub(p50),
        proxied_p99.saturating_sub(p99)
    );
}

fn latencies(client: &CsiClient, call: &impl Fn(&CsiClient)) -> Vec<Duration> {
    (0..WARM_UP).for_each(|_| call(client));
    let mut taken: Vec<Duration> = (0..CALLS)
        .map(|_| {
            let start = Instant::now();
            call(client);
            start.elapsed()
        })
        .collect();
    taken.sort();
    taken
}

fn percentile(sorted: &[Duration], percent: usize) -> Duration {
    sorted[(sorted.len() * percent / 100).min(sorted.len() - 1)]
}
