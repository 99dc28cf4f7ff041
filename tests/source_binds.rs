//! More binds of a global mount outside the pods: the chain the CSI and
//! JuiceFS drivers build (daemon mount → staging `globalmount` → pod
//! targets, one through a subPath) and an operator's extra bind. After a
//! crash the stale binds are never taken for the targets' source, and each
//! one is healed like a target. Needs root and /dev/fuse.
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_testbed::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR, SUBDIR_FILE, SupervisorProcess, layers_at,
};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(20);

struct StagedNode {
    // Declared first: readers and the supervisor die before the sandbox.
    readers: Vec<(PathBuf, ContainerReader)>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    subpath: PathBuf,
    state_dir: PathBuf,
    sandbox: Sandbox,
}

impl StagedNode {
    /// The daemon's mount, its CSI staging bind and an extra bind outside
    /// the kubelet tree, two pod volumes and a subPath bound from the
    /// staging path as NodePublish does; a reader on every one of them.
    fn new(daemon: Daemon) -> StagedNode {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, daemon, "shared-data").expect("start daemon");
        let staging = sandbox
            .kubelet_root()
            .join("plugins/kubernetes.io/csi/csi.example.com")
            .join("0f5e2d6c8b9a4e3f1d7c6b5a49382716a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0")
            .join("globalmount");
        let extra = sandbox.runtime_root().join("debug/shared-data");
        sandbox.bind(&source.path, &staging).expect("stage");
        sandbox.bind(&source.path, &extra).expect("extra bind");
        let subpath = sandbox.subpath_dir("pod-c", "data", "app", 0);
        sandbox.bind(&staging.join(SUBDIR), &subpath).expect("subPath bind");
        let mut node = StagedNode {
            readers: Vec::new(),
            supervisor: None,
            source,
            subpath: subpath.clone(),
            state_dir: sandbox.root().join("state"),
            sandbox,
        };
        for uid in ["pod-a", "pod-b"] {
            let target = node.sandbox.pod_volume_dir(uid, "data");
            node.sandbox.bind(&staging, &target).expect("publish");
            node.add_reader(uid, &target, DATA_FILE);
        }
        node.add_reader("staging", &staging, DATA_FILE);
        node.add_reader("extra", &extra, DATA_FILE);
        node.add_reader("pod-c", &subpath, SUBDIR_FILE);
        node
    }

    fn add_reader(&mut self, name: &str, volume: &Path, read: &str) {
        let reader = ContainerReader::spawn(&self.sandbox, name, volume, Path::new(read));
        self.readers.push((volume.to_path_buf(), reader.expect("reader")));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    /// Mounts in the sandbox, but for the source path's own stack: after a
    /// mount over the stale one, the daemon's dead mount stays under it
    /// (with a subPath's propagated copy on it), and that is the daemon's.
    fn mounts(&self) -> usize {
        self.sandbox.count_mounts_under(self.sandbox.root()) - self.sandbox.count_mounts_under(&self.source.path)
    }

    /// Every reader reads the current generation (the subPath reader its
    /// directory's file, and nothing else of the volume).
    fn all_read(&self) {
        let expected = self.source.expected_content();
        for (path, reader) in &self.readers {
            let seen = if *path == self.subpath {
                reader.wait_until(TIMEOUT, |o: &Observation| o.content().is_some_and(|c| c.starts_with("inside")))
            } else {
                reader.wait_until(TIMEOUT, |o: &Observation| o.content() == Some(expected.as_str()))
            };
            let seen = seen.unwrap_or_else(|err| panic!("{}: {err}", path.display()));
            if *path == self.subpath {
                assert_eq!(seen.entries(), Some(&[SUBDIR_FILE.to_owned()][..]), "the subPath shows more");
            }
        }
    }

    /// One layer at each bind, and the whole sandbox's mount count back at
    /// `baseline`.
    fn settles_to(&self, baseline: usize) {
        for (path, _) in &self.readers {
            scenario::wait_for("one layer", TIMEOUT, || layers_at(&self.sandbox, path) == 1)
                .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        }
        scenario::wait_for("the baseline mount count", TIMEOUT, || self.mounts() == baseline)
            .unwrap_or_else(|err| panic!("{err}: {} now, {baseline} before", self.mounts()));
    }

    /// The state file names the daemon's own mount as the source of every
    /// pod target and of both extra binds, never a bind of it.
    fn sources_recorded(&self) {
        let state = self.sandbox.outside_path(&self.state_dir.join("state.json"));
        // Saved after the heal's reports, which may come after the readers
        // read again: waited for until it holds every target.
        let read = || -> Option<(String, serde_json::Value)> {
            let text = std::fs::read_to_string(&state).ok()?;
            let value: serde_json::Value = serde_json::from_str(&text).ok()?;
            let targets = value["targets"].as_object()?;
            self.readers
                .iter()
                .all(|(path, _)| targets.contains_key(&path.display().to_string()))
                .then_some((text, value))
        };
        let mut found = None;
        scenario::wait_for("the state file holding every target", TIMEOUT, || {
            found = read();
            found.is_some()
        })
        .unwrap_or_else(|err| panic!("{err}: {}", std::fs::read_to_string(&state).unwrap_or_default()));
        let (text, value) = found.expect("found when the wait ended");
        let targets = value["targets"].as_object().expect("targets");
        for (path, _) in &self.readers {
            let mapping = &targets[&path.display().to_string()];
            assert_eq!(mapping["source"], self.source.path.display().to_string(), "{}: {text}", path.display());
        }
    }
}

impl Drop for StagedNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("mount table:\n{}", self.sandbox.mountinfo());
        }
    }
}

fn staged_chain_heals(daemon: Daemon, restart: Restart) {
    let mut node = StagedNode::new(daemon);
    node.all_read();
    let supervisor =
        SupervisorProcess::start_with(&node.sandbox, Path::new(BINARY), &node.state_dir, ["--kubelet", "none"]);
    node.supervisor = Some(supervisor.expect("supervisor"));
    let baseline = node.mounts();
    scenario::wait_for("the mappings saved", TIMEOUT, || {
        std::fs::read_to_string(node.sandbox.outside_path(&node.state_dir.join("state.json")))
            .is_ok_and(|text| text.contains("globalmount"))
    })
    .unwrap();

    for cycle in 0..2 {
        // The death is seen, and the stale layers held, before the new mount
        // covers them (a real restart takes far longer than seeing it).
        let daemon = format!("[{}]", node.source.pid().expect("daemon running"));
        let watched = |line: &str| line.contains("\"watching the FUSE daemon\"") && line.contains(&daemon);
        node.supervisor().wait_for_log(TIMEOUT, watched).unwrap();
        node.source.crash().unwrap();
        let died = |line: &str| line.contains("\"daemon died; its targets are degraded\"");
        node.supervisor().wait_for_lines(TIMEOUT, 0, cycle + 1, died).unwrap();
        let (path, reader) = &node.readers[0];
        reader.wait_until(TIMEOUT, |o| o.error().is_some()).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        node.source.restart(&node.sandbox, restart).unwrap();
        node.all_read();
        node.settles_to(baseline);
        node.sources_recorded();
    }
    assert!(
        node.supervisor().log().iter().all(|line| !line.contains("source of target changed")),
        "a stale bind was taken for a source"
    );
}

#[test]
fn a_staged_chain_heals_after_unmount_then_mount_with_bindfs() {
    staged_chain_heals(Daemon::Bindfs, Restart::UnmountThenMount);
}

#[test]
fn a_staged_chain_heals_after_unmount_then_mount_with_demofs() {
    staged_chain_heals(Daemon::DemoFs, Restart::UnmountThenMount);
}

#[test]
fn a_staged_chain_heals_after_a_mount_over_the_stale_source() {
    staged_chain_heals(Daemon::DemoFs, Restart::MountOverStale);
}

/// NodePublishVolume during an outage: a pod scheduled while the daemon is
/// dead gets a bind of the dead staging mount (the daemon's own mount is
/// already detached from the source path). It is learned from its peer
/// group, and healed with the others when the daemon is back.
#[test]
fn a_pod_published_during_an_outage_is_healed_with_the_others() {
    let mut node = StagedNode::new(Daemon::Bindfs);
    node.all_read();
    let supervisor =
        SupervisorProcess::start_with(&node.sandbox, Path::new(BINARY), &node.state_dir, ["--kubelet", "none"]);
    node.supervisor = Some(supervisor.expect("supervisor"));
    let baseline = node.mounts();
    let daemon = format!("[{}]", node.source.pid().expect("daemon running"));
    let watched = |line: &str| line.contains("\"watching the FUSE daemon\"") && line.contains(&daemon);
    node.supervisor().wait_for_log(TIMEOUT, watched).unwrap();

    node.source.crash().unwrap();
    let detached = |line: &str| line.contains("\"dead source detached");
    node.supervisor().wait_for_log(TIMEOUT, detached).unwrap();
    let staging = node.readers.iter().find(|(path, _)| path.ends_with("globalmount")).expect("staging").0.clone();
    let late = node.sandbox.pod_volume_dir("pod-d", "data");
    node.sandbox.bind(&staging, &late).expect("publish during the outage");

    node.source.restart(&node.sandbox, Restart::InPlace).unwrap();
    node.add_reader("pod-d", &late, DATA_FILE);
    node.all_read();
    node.settles_to(baseline + 1);
    node.sources_recorded();
}
