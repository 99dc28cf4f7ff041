//! End-to-end heals: a real FUSE daemon crashes and comes back in a private
//! mount namespace while `fuse-supervisor run` watches; every heal is judged
//! from inside a container-model reader. Needs root and /dev/fuse.
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor::testbed::scenario::{DATA_FILE, Daemon, FuseSource, Restart, SupervisorProcess, layers_at};
use fuse_supervisor::testbed::{ContainerReader, Observation, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(20);

fn binary() -> &'static Path {
    Path::new(BINARY)
}

fn reads(expected: String) -> impl Fn(&Observation) -> bool {
    move |observation| observation.content() == Some(expected.as_str())
}

fn fails(observation: &Observation) -> bool {
    observation.error().is_some()
}

struct Node {
    // Declared first: readers and the supervisor die before the sandbox.
    readers: Vec<ContainerReader>,
    supervisor: Option<SupervisorProcess>,
    source: FuseSource,
    targets: Vec<PathBuf>,
    state_dir: PathBuf,
    sandbox: Sandbox,
}

impl Node {
    /// A source served by `daemon` bound into `pods` pod volumes, each with
    /// a reader of the data file.
    fn new(daemon: Daemon, pods: usize) -> Node {
        let sandbox = Sandbox::new().expect("sandbox");
        let source = FuseSource::start(&sandbox, binary(), daemon, "shared-data").expect("start daemon");
        let mut node = Node {
            readers: Vec::new(),
            supervisor: None,
            targets: Vec::new(),
            state_dir: sandbox.root().join("state"),
            source,
            sandbox,
        };
        for pod in 0..pods {
            let uid = format!("pod-{pod:04}");
            let target = node.source.bind_volume(&node.sandbox, &uid, "data").expect("bind volume");
            node.add_reader(&uid, &target, Path::new(DATA_FILE));
            node.targets.push(target);
        }
        node
    }

    fn add_reader(&mut self, name: &str, volume: &Path, read: &Path) {
        let reader = ContainerReader::spawn(&self.sandbox, binary(), name, volume, read).expect("reader");
        self.readers.push(reader);
    }

    fn start_supervisor(&mut self) {
        self.supervisor = Some(SupervisorProcess::start(&self.sandbox, binary(), &self.state_dir).expect("supervisor"));
    }

    fn supervisor(&self) -> &SupervisorProcess {
        self.supervisor.as_ref().expect("supervisor running")
    }

    fn all_read(&self, expected: &str) {
        for reader in &self.readers[..self.targets.len()] {
            reader.wait_until(HEAL_TIMEOUT, reads(expected.to_owned())).expect("reader reads the source");
        }
    }

    fn mounts(&self) -> usize {
        self.sandbox.count_mounts_under(self.sandbox.root())
    }
}

#[test]
fn one_pod_is_healed_after_unmount_then_mount() {
    let mut node = Node::new(Daemon::DemoFs, 1);
    node.all_read(&node.source.expected_content());
    node.start_supervisor();
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, fails).expect("reader sees the crash");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.all_read(&node.source.expected_content());
    node.supervisor().wait_for_log(HEAL_TIMEOUT, |line| line.contains("\"healed\"")).unwrap();
    assert_eq!(layers_at(&node.sandbox, &node.targets[0]), 1, "{}", node.sandbox.mountinfo());
    assert_eq!(node.mounts(), baseline, "{}", node.sandbox.mountinfo());
}

#[test]
fn bindfs_pod_is_healed_after_unmount_then_mount() {
    let mut node = Node::new(Daemon::Bindfs, 1);
    node.all_read(&node.source.expected_content());
    node.start_supervisor();
    let baseline = node.mounts();

    node.source.crash().unwrap();
    node.readers[0].wait_until(HEAL_TIMEOUT, fails).expect("reader sees the crash");
    node.source.restart(&node.sandbox, Restart::UnmountThenMount).unwrap();

    node.all_read(&node.source.expected_content());
    assert_eq!(layers_at(&node.sandbox, &node.targets[0]), 1, "{}", node.sandbox.mountinfo());
    assert_eq!(node.mounts(), baseline, "{}", node.sandbox.mountinfo());
}
