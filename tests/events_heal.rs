//! Events end to end: a real FUSE daemon crashes and comes back in a private
//! mount namespace while `fuse-supervisor run` heals, confirms the restart
//! with a kubelet stand-in and publishes Events to an API server stand-in
//! reached through `--events-kubeconfig`. Needs root and /dev/fuse.
use std::path::Path;
use std::time::{Duration, SystemTime};

use fuse_supervisor_testbed::apiserver::{ApiRequest, ApiServerStandIn};
use fuse_supervisor_testbed::kubelet::{KubeletStandIn, app_pod, fuse_owner_pod, pod_list_body};
use fuse_supervisor_testbed::scenario::{DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SupervisorProcess};
use fuse_supervisor_testbed::{ContainerReader, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);
const TOKEN: &str = "supervisor-token";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces";

fn reason(request: &ApiRequest, reason: &str) -> bool {
    request.method == "POST" && request.body["reason"] == reason
}

/// Starts the supervisor in the sandbox, confirming restarts with `kubelet`
/// and publishing Events to `api`.
fn supervise(sandbox: &Sandbox, kubelet: &KubeletStandIn, api: &ApiServerStandIn) -> SupervisorProcess {
    supervise_with(sandbox, kubelet, api, &[])
}

/// [`supervise`] with more flags.
fn supervise_with(
    sandbox: &Sandbox,
    kubelet: &KubeletStandIn,
    api: &ApiServerStandIn,
    more: &[&str],
) -> SupervisorProcess {
    kubelet.set_token(Some(TOKEN));
    // Written from the sandbox: its tmpfs hides the host's directory.
    let files = sandbox.root().join("credentials");
    let (ca, token, kubeconfig) = (files.join("ca.pem"), files.join("token"), files.join("kubeconfig"));
    let writes = (files, ca.clone(), kubelet.ca_pem().to_owned(), token.clone(), kubeconfig.clone(), api.kubeconfig());
    sandbox
        .run(move || {
            let (files, ca, pem, token, kubeconfig, config) = writes;
            std::fs::create_dir_all(files)?;
            std::fs::write(ca, pem)?;
            std::fs::write(token, TOKEN)?;
            std::fs::write(kubeconfig, config)
        })
        .expect("write credentials");
    let args = vec![
        "--kubelet".to_owned(),
        format!("https://127.0.0.1:{}", kubelet.port()),
        "--kubelet-ca-file".to_owned(),
        ca.display().to_string(),
        "--kubelet-token-file".to_owned(),
        token.display().to_string(),
        "--events".to_owned(),
        "on".to_owned(),
        "--events-kubeconfig".to_owned(),
        kubeconfig.display().to_string(),
        "--node-name".to_owned(),
        "node-1".to_owned(),
    ];
    let args = args.into_iter().chain(more.iter().map(|arg| (*arg).to_owned()));
    SupervisorProcess::start_with(sandbox, Path::new(BINARY), &sandbox.root().join("state"), args).expect("supervisor")
}

/// A source served by the FUSE pod `fuse-owner` (which the kubelet lists
/// as started an hour ago), bound into the app pod `web-0`, read by it.
struct Owned {
    source: FuseSource,
    reader: ContainerReader,
    kubelet: KubeletStandIn,
}

impl Owned {
    fn start(sandbox: &Sandbox, daemon: Daemon) -> Owned {
        let source = FuseSource::start(sandbox, daemon, "owned").expect("start daemon");
        let target = source.bind_volume(sandbox, "app-pod-uid", "data").expect("bind volume");
        let reader = ContainerReader::spawn(sandbox, "app", &target, Path::new(DATA_FILE)).expect("reader");
        Owned::reads(&reader, source.expected_content());
        let kubelet = KubeletStandIn::start().expect("kubelet stand-in");
        kubelet.set_pods(Owned::pods(sandbox, 0, SystemTime::now() - Duration::from_secs(3600)));
        Owned { source, reader, kubelet }
    }

    fn reads(reader: &ContainerReader, expected: String) {
        reader
            .wait_until(TIMEOUT, |observation| observation.content() == Some(expected.as_str()))
            .expect("the container reads the source");
    }

    /// `/pods` with the FUSE pod's container in its `instance`th run.
    fn pods(sandbox: &Sandbox, instance: u32, started: SystemTime) -> Vec<u8> {
        let host_path = sandbox.runtime_root().display().to_string();
        pod_list_body([
            fuse_owner_pod("fuse-owner", "owner-uid", &host_path, instance, started),
            app_pod("apps", "web-0", "app-pod-uid"),
        ])
    }
}

#[test]
fn a_real_heal_is_published_as_events_on_the_pod_and_the_daemon_pod() {
    let sandbox = Sandbox::new().expect("sandbox");
    let Owned { mut source, reader, kubelet } = Owned::start(&sandbox, Daemon::DemoFs);
    let reads = |expected: String| Owned::reads(&reader, expected);
    let pods = |instance, started| Owned::pods(&sandbox, instance, started);
    let api = ApiServerStandIn::start().expect("API server stand-in");
    let supervisor = supervise(&sandbox, &kubelet, &api);
    let on_failure = Dump(&api);

    source.crash().expect("crash");
    reader.wait_until(TIMEOUT, |observation| observation.error().is_some()).expect("reader sees the crash");
    source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
    kubelet.set_pods(pods(1, SystemTime::now()));
    reads(source.expected_content());

    let healed = api.wait_for(TIMEOUT, |request| reason(request, "FuseMountHealed")).expect("FuseMountHealed");
    assert_eq!(healed.path, format!("{EVENTS}/apps/events"));
    let body = &healed.body;
    assert_eq!(body["regarding"]["name"], "web-0");
    assert_eq!(body["regarding"]["uid"], "app-pod-uid");
    assert_eq!((body["type"].as_str(), body["action"].as_str()), (Some("Normal"), Some("Heal")));
    assert_eq!(body["reportingInstance"], "fuse-supervisor-node-1");
    let note = body["note"].as_str().unwrap();
    assert!(note.starts_with("FUSE volume mount volumes/"), "{note}");
    for part in ["healed from", "outage ", "heal latency ", "stale layer"] {
        assert!(note.contains(part), "{part:?} not in {note:?}");
    }

    // The outage was published first, as a warning on the same pod.
    let broken = api.wait_for(TIMEOUT, |request| reason(request, "FuseMountBroken")).expect("FuseMountBroken");
    assert_eq!((broken.path.as_str(), broken.body["type"].as_str()), (healed.path.as_str(), Some("Warning")));
    assert_eq!(broken.body["regarding"], healed.body["regarding"]);
    let order: Vec<String> = api.requests().iter().map(|request| request.body["reason"].to_string()).collect();
    let position = |reason: &str| order.iter().position(|seen| seen.trim_matches('"') == reason);
    assert!(position("FuseMountBroken") < position("FuseMountHealed"), "{order:?}");

    let restarted =
        api.wait_for(TIMEOUT, |request| reason(request, "FuseDaemonRestarted")).expect("FuseDaemonRestarted");
    assert_eq!(restarted.body["regarding"]["name"], "fuse-owner");
    assert_eq!(restarted.body["regarding"]["uid"], "owner-uid");
    assert!(restarted.path.starts_with(EVENTS));

    // The daemon's pod is known now (the kubelet named it at the restart):
    // at the next crash the dead mount at the source, detached so that the
    // restart mounts on a directory, is told to that pod.
    source.crash().expect("crash again");
    let detached = api.wait_for(TIMEOUT, |request| reason(request, "FuseSourceDetached")).expect("FuseSourceDetached");
    assert_eq!(detached.body["regarding"]["name"], "fuse-owner");
    assert_eq!((detached.body["type"].as_str(), detached.body["action"].as_str()), (Some("Normal"), Some("Detach")));
    let note = detached.body["note"].as_str().unwrap();
    assert!(note.contains(&source.path.display().to_string()) && note.contains("can mount there again"), "{note}");
    source.restart(&sandbox, Restart::UnmountThenMount).expect("restart again");
    kubelet.set_pods(pods(2, SystemTime::now()));
    reads(source.expected_content());

    drop(on_failure);
    supervisor.stop().expect("stop the supervisor");
}

/// A daemon that keeps crashing: each restart is healed, and the source
/// healed more than `--flapping-heals` times within the window is a Warning
/// on the daemon's pod, named by the kubelet at its restarts.
#[test]
fn a_daemon_that_keeps_crashing_is_a_warning_on_its_pod() {
    let sandbox = Sandbox::new().expect("sandbox");
    let Owned { mut source, reader, kubelet } = Owned::start(&sandbox, Daemon::Bindfs);
    let reads = |expected: String| Owned::reads(&reader, expected);
    let pods = |instance, started| Owned::pods(&sandbox, instance, started);
    let api = ApiServerStandIn::start().expect("API server stand-in");
    let supervisor = supervise_with(&sandbox, &kubelet, &api, &["--flapping-heals", "2", "--flapping-window", "10m"]);
    let on_failure = Dump(&api);

    for instance in 1..=3 {
        let mark = supervisor.log_len();
        source.crash().expect("crash");
        reader.wait_until(TIMEOUT, |observation| observation.error().is_some()).expect("reader sees the crash");
        source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
        kubelet.set_pods(pods(instance, SystemTime::now()));
        reads(source.expected_content());
        let healed = |line: &str| line.contains("\"message\":\"healed\"");
        supervisor.wait_for_lines(TIMEOUT, mark, 1, healed).expect("healed");
        if instance < 3 {
            let flapping = supervisor.log().iter().filter(|line| line.contains("keeps crashing")).count();
            assert_eq!(flapping, 0, "{instance} heals are not a crash loop yet");
        }
    }
    let flapping = api.wait_for(TIMEOUT, |request| reason(request, "FuseDaemonFlapping")).expect("FuseDaemonFlapping");
    assert_eq!(flapping.body["regarding"]["name"], "fuse-owner");
    assert_eq!(flapping.body["type"], "Warning");
    let note = flapping.body["note"].as_str().unwrap();
    assert!(note.contains("3 restarts within 10m"), "{note}");
    // Counted once per window, as the Event is sent.
    assert_eq!(supervisor.metric("fuse_supervisor_daemon_flapping_total").expect("metrics"), Some(1.0));

    drop(on_failure);
    supervisor.stop().expect("stop the supervisor");
}

/// On a failed assertion, prints what the API server saw (the supervisor
/// prints its log itself).
struct Dump<'a>(&'a ApiServerStandIn);

impl Drop for Dump<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for request in self.0.requests() {
                eprintln!("API server saw: {} {} {}", request.method, request.path, request.body);
            }
        }
    }
}

/// A tenant turns its subPath directory into a symlink out of the volume
/// while the daemon is down: its pod gets a Warning saying why its mount is
/// not healed, and the other pod on the source is healed as usual.
#[test]
fn a_subpath_turned_into_a_symlink_is_a_warning_on_its_pod_alone() {
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "owned").expect("start daemon");
    source.bind_volume(&sandbox, "app-pod-uid", "data").expect("bind volume");
    source.bind_subpath(&sandbox, "tenant-pod-uid", "data").expect("bind subPath");
    let kubelet = KubeletStandIn::start().expect("kubelet stand-in");
    let host_path = sandbox.runtime_root().display().to_string();
    let started = SystemTime::now() - Duration::from_secs(3600);
    let pods = |instance, started| {
        pod_list_body([
            fuse_owner_pod("fuse-owner", "owner-uid", &host_path, instance, started),
            app_pod("apps", "web-0", "app-pod-uid"),
            app_pod("tenants", "tenant-0", "tenant-pod-uid"),
        ])
    };
    kubelet.set_pods(pods(0, started));
    let api = ApiServerStandIn::start().expect("API server stand-in");
    let supervisor = supervise(&sandbox, &kubelet, &api);
    let on_failure = Dump(&api);

    source.crash().expect("crash");
    let subdir = source.backing.join(SUBDIR);
    let outside = sandbox.root().join("outside-the-volume");
    sandbox
        .run(move || {
            std::fs::create_dir_all(&outside)?;
            std::fs::remove_dir_all(&subdir)?;
            std::os::unix::fs::symlink(&outside, &subdir)
        })
        .expect("the tenant swaps its subPath directory for a symlink");
    source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
    kubelet.set_pods(pods(1, SystemTime::now()));

    let on_pod = |request: &ApiRequest, name: &str| request.body["regarding"]["name"] == name;
    let failed = api
        .wait_for(TIMEOUT, |request| reason(request, "FuseHealFailed") && on_pod(request, "tenant-0"))
        .expect("FuseHealFailed on the tenant's pod");
    assert_eq!(failed.path, format!("{EVENTS}/tenants/events"));
    assert_eq!(failed.body["type"], "Warning");
    let note = failed.body["note"].as_str().unwrap();
    for part in ["volume-subpaths/", "sub of the source", "Too many levels of symbolic links", "retrying in "] {
        assert!(note.contains(part), "{part:?} not in {note:?}");
    }
    api.wait_for(TIMEOUT, |request| reason(request, "FuseMountHealed") && on_pod(request, "web-0"))
        .expect("the other pod is healed");
    let requests = api.requests();
    assert!(
        !requests.iter().any(|request| reason(request, "FuseHealFailed") && on_pod(request, "web-0")),
        "the other pod's heal failed"
    );
    assert!(
        !requests.iter().any(|request| reason(request, "FuseMountHealed") && on_pod(request, "tenant-0")),
        "the symlinked subPath was healed"
    );

    drop(on_failure);
    supervisor.stop().expect("stop the supervisor");
}
