//! The pod-directory watcher on a real kubelet-shaped tree in a temporary
//! directory, with real inotify. No mounts: nothing here needs a namespace.
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use fuse_supervisor_engine::watch::pods::{LostEvents, PodChange, PodDirectory, PodWatcher, VolDataError};

const WAIT: Duration = Duration::from_secs(60);

/// A watcher whose changes a test applies to its own model, as the
/// supervisor will.
struct Watched {
    _root: tempfile::TempDir,
    pods_dir: PathBuf,
    watcher: Option<PodWatcher>,
    changes: Receiver<PodChange>,
    directory: PodDirectory,
    resyncs: usize,
    /// Why events were lost, as the watcher told before each rescan.
    lost: Vec<LostEvents>,
    pods_added: usize,
    invalid: Vec<VolDataError>,
}

impl Watched {
    fn start() -> Self {
        Self::start_with_gate(None)
    }

    fn start_with_gate(gate: Option<Arc<Gate>>) -> Self {
        let root = tempfile::tempdir().unwrap();
        let pods_dir = root.path().join("pods");
        fs::create_dir(&pods_dir).unwrap();
        let (send, changes) = mpsc::channel();
        let watcher = PodWatcher::spawn(root.path(), None, move |change| {
            if let Some(gate) = &gate {
                gate.pass();
            }
            // The test may have finished and dropped the receiver.
            let _ = send.send(change);
        })
        .unwrap();
        let mut watched = Watched {
            _root: root,
            pods_dir,
            watcher: Some(watcher),
            changes,
            directory: PodDirectory::default(),
            resyncs: 0,
            lost: Vec::new(),
            pods_added: 0,
            invalid: Vec::new(),
        };
        // The initial scan is sent before `spawn` returns.
        watched.take_pending();
        assert_eq!(watched.resyncs, 1, "the first message is the initial scan");
        watched
    }

    fn apply(&mut self, change: PodChange) {
        match &change {
            PodChange::Resync(_) => self.resyncs += 1,
            PodChange::EventsLost(why) => self.lost.push(*why),
            PodChange::PodAdded { .. } => self.pods_added += 1,
            PodChange::Failed(err) => panic!("watcher failed: {err}"),
            _ => {}
        }
        if let PodChange::VolDataInvalid { error, .. } = change {
            self.invalid.push(error);
            return;
        }
        self.directory.apply(change);
    }

    fn take_pending(&mut self) {
        while let Ok(change) = self.changes.try_recv() {
            self.apply(change);
        }
    }

    /// Applies changes until `done` holds once the watcher is quiet.
    fn wait_until(&mut self, what: &str, done: impl Fn(&Watched) -> bool) {
        let deadline = Instant::now() + WAIT;
        loop {
            match self.changes.recv_timeout(Duration::from_millis(100)) {
                Ok(change) => {
                    self.apply(change);
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => panic!("watcher stopped while waiting for {what}"),
            }
            if done(self) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; model has {} pods", self.directory.len());
        }
    }

    /// Waits until the model is exactly what a fresh scan of the disk reads.
    fn wait_exact(&mut self) {
        let expected = PodDirectory::scan(&self.pods_dir).unwrap();
        let deadline = Instant::now() + WAIT;
        while self.directory != expected && Instant::now() < deadline {
            match self.changes.recv_timeout(Duration::from_millis(100)) {
                Ok(change) => self.apply(change),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => panic!("watcher stopped"),
            }
        }
        assert!(self.directory == expected, "model differs from disk: {}", difference(&self.directory, &expected));
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(watcher) = self.watcher.take() {
            watcher.stop().unwrap();
        }
    }
}

fn difference(model: &PodDirectory, disk: &PodDirectory) -> String {
    for (uid, pod) in disk.pods() {
        match model.pod(uid) {
            None => return format!("pod {uid} missing"),
            Some(seen) if seen != pod => return format!("pod {uid}: model {seen:?}, disk {pod:?}"),
            Some(_) => {}
        }
    }
    match model.pods().find(|(uid, _)| disk.pod(uid).is_none()) {
        Some((uid, _)) => format!("pod {uid} should be gone"),
        None => "none".into(),
    }
}

fn vol_data_json(pv: &str, driver: &str) -> String {
    format!(
        r#"{{"attachmentID":"csi-0000","driverName":"{driver}","nodeName":"node-1","specVolID":"{pv}","volumeHandle":"{pv}","volumeLifecycleMode":"Persistent"}}"#
    ) + "\n"
}

/// Writes `vol_data.json` the way the kubelet does: create, one write, close.
fn write_vol_data(volume_dir: &Path, contents: &str) {
    let mut file = fs::File::create(volume_dir.join("vol_data.json")).unwrap();
    file.write_all(contents.as_bytes()).unwrap();
}

/// A pod the kubelet would lay out: two CSI volumes (mount dir and
/// vol_data.json), a projected token volume and, for every third pod, a
/// subPath entry.
fn make_pod(pods_dir: &Path, n: usize) -> String {
    let uid = format!("{n:08x}-1111-4222-8333-{n:012x}");
    let pod = pods_dir.join(&uid);
    for v in 0..2 {
        let pv = format!("pvc-{n:06}-{v}");
        let volume = pod.join("volumes/kubernetes.io~csi").join(&pv);
        fs::create_dir_all(volume.join("mount")).unwrap();
        write_vol_data(&volume, &vol_data_json(&pv, "csi.juicefs.com"));
    }
    fs::create_dir_all(pod.join("volumes/kubernetes.io~projected/kube-api-access-x7k2q")).unwrap();
    fs::create_dir_all(pod.join("containers/app")).unwrap();
    if n.is_multiple_of(3) {
        fs::create_dir_all(pod.join("volume-subpaths/data/app/0")).unwrap();
    }
    uid
}

#[test]
fn a_burst_of_1000_pods_created_and_removed_is_tracked_exactly() {
    let mut watched = Watched::start();
    let uids: Vec<String> = (0..1000).map(|n| make_pod(&watched.pods_dir, n)).collect();
    // Remove most of them again while the watcher is still catching up.
    for uid in uids.iter().step_by(3).chain(uids.iter().skip(1).step_by(3)) {
        fs::remove_dir_all(watched.pods_dir.join(uid)).unwrap();
    }
    watched.wait_exact();

    let kept: Vec<&String> = uids.iter().skip(2).step_by(3).collect();
    assert_eq!(watched.directory.len(), kept.len());
    for (n, uid) in uids.iter().enumerate().skip(2).step_by(3) {
        let pod = watched.directory.pod(uid).unwrap();
        assert_eq!(pod.volumes.len(), 3, "{uid}");
        let data = watched.directory.vol_data(uid, &format!("pvc-{n:06}-1")).unwrap();
        assert_eq!(&*data.driver_name, "csi.juicefs.com");
        assert_eq!(pod.subpaths.len(), usize::from(n % 3 == 0));
    }
    assert!(watched.invalid.is_empty(), "{:?}", watched.invalid);

    for uid in &kept {
        fs::remove_dir_all(watched.pods_dir.join(uid)).unwrap();
    }
    watched.wait_until("every pod to be removed", |watched| watched.directory.is_empty());
    assert!(watched.pods_added > 0, "pods were seen through events, not only scans");
}

#[test]
fn vol_data_written_after_the_volume_directory_is_seen() {
    let mut watched = Watched::start();
    let uid = "7c1d2e3f-0000-4000-8000-000000000001";
    let volume = watched.pods_dir.join(uid).join("volumes/kubernetes.io~csi/pv-late");
    fs::create_dir_all(volume.join("mount")).unwrap();
    watched
        .wait_until("the volume without data", |w| w.directory.volume(uid, "kubernetes.io~csi", "pv-late").is_some());
    assert_eq!(watched.directory.vol_data(uid, "pv-late"), None);

    write_vol_data(&volume, &vol_data_json("pv-late", "fuse.csi.fluid.io"));
    watched.wait_until("its vol_data", |w| w.directory.vol_data(uid, "pv-late").is_some());
    assert_eq!(&*watched.directory.vol_data(uid, "pv-late").unwrap().driver_name, "fuse.csi.fluid.io");

    // Renamed into place (an atomic writer) is seen too.
    let staged = volume.join(".vol_data.tmp");
    fs::write(&staged, vol_data_json("pv-late", "csi.juicefs.com")).unwrap();
    fs::rename(&staged, volume.join("vol_data.json")).unwrap();
    watched.wait_until("the renamed vol_data", |w| {
        w.directory.vol_data(uid, "pv-late").is_some_and(|data| &*data.driver_name == "csi.juicefs.com")
    });
    assert!(watched.invalid.is_empty(), "{:?}", watched.invalid);
}

#[test]
fn malformed_vol_data_is_reported_by_name_and_the_volume_is_kept() {
    let mut watched = Watched::start();
    let uid = "7c1d2e3f-0000-4000-8000-000000000002";
    let volume = watched.pods_dir.join(uid).join("volumes/kubernetes.io~csi/pv-bad");
    fs::create_dir_all(&volume).unwrap();
    write_vol_data(&volume, r#"{"driverName":"csi.juicefs.com","specVolID":"pv-bad","nodeName":"n"}"#);
    watched.wait_until("the malformed vol_data to be reported", |w| !w.invalid.is_empty());

    let message = watched.invalid[0].to_string();
    let file = volume.join("vol_data.json");
    assert_eq!(message, format!("{}: field volumeHandle is missing", file.display()));
    assert!(watched.directory.volume(uid, "kubernetes.io~csi", "pv-bad").is_some(), "the volume is still tracked");
    assert_eq!(watched.directory.vol_data(uid, "pv-bad"), None);
    watched.wait_exact();

    // Fixed by the next write.
    write_vol_data(&volume, &vol_data_json("pv-bad", "csi.juicefs.com"));
    watched.wait_until("the fixed vol_data", |w| w.directory.vol_data(uid, "pv-bad").is_some());
}

#[test]
fn a_scan_at_start_sees_what_exists_already() {
    let root = tempfile::tempdir().unwrap();
    let pods_dir = root.path().join("pods");
    fs::create_dir(&pods_dir).unwrap();
    let uids: Vec<String> = (0..50).map(|n| make_pod(&pods_dir, n)).collect();
    let (send, changes) = mpsc::channel();
    let watcher = PodWatcher::spawn(root.path(), None, move |change| {
        let _ = send.send(change);
    })
    .unwrap();
    let Ok(PodChange::Resync(directory)) = changes.try_recv() else { panic!("the initial scan comes first") };
    assert_eq!(directory, PodDirectory::scan(&pods_dir).unwrap());
    assert_eq!(directory.len(), uids.len());
    watcher.stop().unwrap();
}

#[test]
fn a_missing_pods_directory_is_an_error_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let err = PodWatcher::spawn(root.path(), None, |_| {}).err().unwrap();
    assert_eq!(err.to_string(), format!("cannot watch {}", root.path().join("pods").display()));
}

/// Holds the watcher thread inside its sink while the test floods the queue.
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    closed: bool,
    blocked: bool,
}

impl Gate {
    fn pass(&self) {
        let mut state = self.state.lock().unwrap();
        while state.closed {
            state.blocked = true;
            self.changed.notify_all();
            state = self.changed.wait(state).unwrap();
        }
    }

    fn set_closed(&self, closed: bool) {
        self.state.lock().unwrap().closed = closed;
        self.changed.notify_all();
    }

    fn wait_blocked(&self) {
        let state = self.state.lock().unwrap();
        let (state, timeout) = self.changed.wait_timeout_while(state, WAIT, |state| !state.blocked).unwrap();
        assert!(!timeout.timed_out() && state.blocked, "the watcher never reached its sink");
    }
}

/// More events than the inotify queue holds arrive while the watcher is
/// held: the kernel drops them and queues `IN_Q_OVERFLOW`; the watcher
/// rescans and the model ends exact. The queue is overflowed by holding the
/// reader, not by shrinking `fs.inotify.max_queued_events` (a global knob).
#[test]
fn a_queue_overflow_recovers_by_rescan() {
    let max_queued: usize =
        fs::read_to_string("/proc/sys/fs/inotify/max_queued_events").unwrap().trim().parse().unwrap();
    let gate = Arc::new(Gate { state: Mutex::new(GateState::default()), changed: Condvar::new() });
    let mut watched = Watched::start_with_gate(Some(gate.clone()));
    let pods_dir = watched.pods_dir.clone();
    let kept = make_pod(&pods_dir, 1);
    watched.wait_exact();

    gate.set_closed(true);
    fs::create_dir(pods_dir.join("00000000-gate-4000-8000-000000000000")).unwrap();
    gate.wait_blocked();
    // Each mkdir and rmdir in pods/ is one event: overflow the queue.
    let names: Vec<String> =
        (0..max_queued / 2 + 1000).map(|n| format!("{n:08x}-flood-4000-8000-000000000000")).collect();
    for name in &names {
        fs::create_dir(pods_dir.join(name)).unwrap();
    }
    for name in &names {
        fs::remove_dir(pods_dir.join(name)).unwrap();
    }
    fs::remove_dir_all(pods_dir.join(&kept)).unwrap();
    let late = make_pod(&pods_dir, 2);
    gate.set_closed(false);

    watched.wait_until("a rescan", |w| w.resyncs >= 2);
    assert_eq!(watched.lost, [LostEvents::Overflow], "the loss is told before its rescan");
    watched.wait_exact();
    assert!(watched.directory.pod(&late).is_some());
    assert!(watched.directory.pod(&kept).is_none());
    assert_eq!(watched.directory.len(), 2, "the gate pod and the late pod");
}

#[test]
fn the_watcher_thread_joins_the_given_mount_namespace() {
    let root = tempfile::tempdir().unwrap();
    fs::create_dir(root.path().join("pods")).unwrap();
    make_pod(&root.path().join("pods"), 7);
    // Our own namespace, joined by path as the host's would be.
    let (send, changes) = mpsc::channel();
    let watcher = PodWatcher::spawn(root.path(), Some(Path::new("/proc/self/ns/mnt")), move |change| {
        let _ = send.send(change);
    })
    .unwrap();
    let Ok(PodChange::Resync(directory)) = changes.try_recv() else { panic!("the initial scan comes first") };
    assert_eq!(directory.len(), 1);
    watcher.stop().unwrap();

    let missing = root.path().join("no-such-namespace");
    let err = PodWatcher::spawn(root.path(), Some(&missing), |_| {}).err().unwrap();
    assert_eq!(err.to_string(), format!("cannot join mount namespace {}", missing.display()));
}
