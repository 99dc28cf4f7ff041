//! A supervisor that never saw its targets healthy: it starts after the
//! crash, with no state file, and finds the source through the CSI staging
//! layout from the pod's vol_data.json. Needs root and /dev/fuse.
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_testbed::scenario::{
    DATA_FILE, Daemon, FuseSource, Restart, SUBDIR_FILE, SupervisorProcess, layers_at, wait_for,
};
use fuse_supervisor_testbed::{ContainerReader, Sandbox};
use sha2::{Digest, Sha256};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);
const DRIVER: &str = "csi.example.com";
const HANDLE: &str = "vol-4f1c";

fn binary() -> &'static Path {
    Path::new(BINARY)
}

/// A bindfs source at the CSI staging path of `HANDLE`, with a pod's
/// whole-volume bind of it and the volume's vol_data.json.
fn staged_volume(sandbox: &Sandbox) -> (FuseSource, PathBuf) {
    let hash: String = Sha256::digest(HANDLE.as_bytes()).iter().map(|byte| format!("{byte:02x}")).collect();
    let staging = sandbox.kubelet_root().join("plugins/kubernetes.io/csi").join(DRIVER).join(hash).join("globalmount");
    let source = FuseSource::start_at(sandbox, Daemon::Bindfs, "staged", &staging).expect("daemon");
    let volume = source.bind_volume(sandbox, "pod-a", "pvc-1234").expect("bind volume");
    let vol_data = volume.parent().expect("volume dir").join("vol_data.json");
    let json = format!(
        r#"{{"driverName":"{DRIVER}","nodeName":"node-a","specVolID":"pvc-1234","volumeHandle":"{HANDLE}","volumeLifecycleMode":"Persistent"}}"#
    );
    sandbox.run(move || std::fs::write(vol_data, json)).expect("write vol_data.json");
    (source, volume)
}

#[test]
fn a_supervisor_started_after_the_crash_heals_through_the_csi_staging_layout() {
    let sandbox = Sandbox::new().expect("sandbox");
    let (mut source, volume) = staged_volume(&sandbox);
    let subpath = source.bind_subpath(&sandbox, "pod-a", "data").expect("bind subPath");
    let readers = [
        ContainerReader::spawn(&sandbox, "volume", &volume, Path::new(DATA_FILE)).expect("reader"),
        ContainerReader::spawn(&sandbox, "subpath", &subpath, Path::new(SUBDIR_FILE)).expect("reader"),
    ];
    let baseline = sandbox.count_mounts_under(sandbox.root());

    source.crash().expect("crash");
    source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
    readers[0].wait_until(TIMEOUT, |seen| seen.error().is_some()).expect("the crash is seen");
    let supervisor = SupervisorProcess::start(&sandbox, binary(), &sandbox.root().join("fresh-state")).expect("start");

    let expected = source.expected_content();
    readers[0].wait_until(TIMEOUT, |seen| seen.content() == Some(expected.as_str())).expect("volume reads again");
    readers[1].wait_until(TIMEOUT, |seen| seen.content().is_some()).expect("subPath reads again");
    let located = supervisor
        .wait_for_log(TIMEOUT, |line| line.contains("source located by layout") && line.contains("volume-subpaths"))
        .expect("the subPath is located");
    assert!(located.contains("csi-staging"), "{located}");
    assert!(supervisor.log().iter().any(|line| line.contains("source located by layout") && line.contains("pvc-1234")));
    for target in [&volume, &subpath] {
        wait_for("one layer", TIMEOUT, || layers_at(&sandbox, target) == 1).expect("flattened");
    }
    // Beside the supervisor's own staging tmpfs, the table is as before the crash.
    let staging = sandbox.root().join("staging");
    let mounts = || sandbox.count_mounts_under(sandbox.root()) - sandbox.count_mounts_under(&staging);
    wait_for("the baseline mount count", TIMEOUT, || mounts() == baseline)
        .unwrap_or_else(|err| panic!("{err}: {} mounts, {baseline} before\n{}", mounts(), sandbox.mountinfo()));
}

/// The state file is garbage (a disk that filled up mid-write, a hand edit):
/// the supervisor keeps it aside, says where it is bad, and heals from the
/// mount table and the layouts instead of exiting.
#[test]
fn a_corrupt_state_file_is_kept_aside_and_the_supervisor_heals_without_it() {
    let sandbox = Sandbox::new().expect("sandbox");
    let (mut source, volume) = staged_volume(&sandbox);
    let reader = ContainerReader::spawn(&sandbox, "volume", &volume, Path::new(DATA_FILE)).expect("reader");
    source.crash().expect("crash");
    source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
    reader.wait_until(TIMEOUT, |seen| seen.error().is_some()).expect("the crash is seen");
    let state_dir = sandbox.root().join("state");
    let garbage = b"{\"version\": 1,\n \"targets\": {\"/k\": tru".to_vec();
    let (dir, written) = (state_dir.clone(), garbage.clone());
    sandbox
        .run(move || std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join("state.json"), written)))
        .expect("write the state file");

    let supervisor = SupervisorProcess::start(&sandbox, binary(), &state_dir).expect("start despite the state file");
    let expected = source.expected_content();
    reader.wait_until(TIMEOUT, |seen| seen.content() == Some(expected.as_str())).expect("volume reads again");
    let warned: Vec<String> =
        supervisor.log().into_iter().filter(|line| line.contains("state file cannot be used")).collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    for says in ["\"line\":2", "\"column\":", "state.json", "state.json.corrupt-"] {
        assert!(warned[0].contains(says), "{says}: {}", warned[0]);
    }
    let dir = state_dir.clone();
    let kept: Vec<Vec<u8>> = sandbox
        .run(move || {
            let names =
                std::fs::read_dir(&dir)?.map(|entry| entry.map(|entry| entry.path())).collect::<Result<Vec<_>, _>>()?;
            names
                .iter()
                .filter(|path| path.to_string_lossy().contains("state.json.corrupt-"))
                .map(std::fs::read)
                .collect::<std::io::Result<Vec<_>>>()
        })
        .expect("list the state directory");
    assert_eq!(kept, [garbage], "the bad file is kept as it was");
}
