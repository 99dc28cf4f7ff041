//! Root tests of the test world and of the kernel facts the heal stands on.
//! Each test builds its own [`Sandbox`] (a private mount namespace); nothing
//! here touches the machine's own mount table.
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use fuse_supervisor_engine::model::mountinfo::parse_table;
use fuse_supervisor_sys::mount;
use fuse_supervisor_sys::resolve;
use fuse_supervisor_testbed::scenario::{DATA_FILE, Daemon, FuseSource};
use fuse_supervisor_testbed::tenant::{TenantFuse, cover_with_tmpfs};
use fuse_supervisor_testbed::{ContainerReader, Observation, Sandbox};

const WAIT: Duration = Duration::from_secs(10);

fn require_root() {
    assert!(is_root(), "these tests mount in private namespaces and must run as root; they do not skip silently");
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:"))
                .map(|uids| uids.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Mounts a tmpfs at `dir` (created) holding `data` = `content`, `sub/data` =
/// `<content>-sub` and an entry named `marker`.
fn fill_tmpfs(sandbox: &Sandbox, dir: &Path, content: &str, marker: &str) {
    let (dir, content, marker) = (dir.to_path_buf(), content.to_string(), marker.to_string());
    sandbox.run(move || {
        fs::create_dir_all(&dir).unwrap();
        mount::mount_tmpfs(&dir).unwrap();
        // Readers see the mount at once: the data file, which they wait
        // for, comes last, so a reader that reads it sees every entry.
        fs::write(dir.join(&marker), "").unwrap();
        fs::create_dir(dir.join("sub")).unwrap();
        fs::write(dir.join("sub").join(format!("{marker}-sub")), "").unwrap();
        fs::write(dir.join("sub/data"), format!("{content}-sub")).unwrap();
        fs::write(dir.join("data"), &content).unwrap();
    });
}

fn content_is(expected: &str) -> impl Fn(&Observation) -> bool + '_ {
    move |observation| observation.content() == Some(expected)
}

/// Mount points equal to `path` in a mountinfo text.
fn layers_at(mountinfo: &str, path: &Path) -> usize {
    let path = path.to_str().unwrap();
    mountinfo.lines().filter(|line| line.split(' ').nth(4) == Some(path)).count()
}

fn host_mountinfo_mentions(root: &Path) -> bool {
    let root = root.to_str().unwrap();
    fs::read_to_string("/proc/self/mountinfo").unwrap().contains(root)
}

/// A global mount, three pod targets bound from it and one subPath target
/// bound from its `sub` directory, each with a running container reader.
struct Node {
    sandbox: Sandbox,
    global: PathBuf,
    pod_targets: Vec<PathBuf>,
    subpath_target: PathBuf,
    pod_readers: Vec<ContainerReader>,
    subpath_reader: ContainerReader,
}

impl Node {
    fn new() -> Node {
        require_root();
        let sandbox = Sandbox::new().unwrap();
        let global = sandbox.runtime_root().join("default/shared-data/fuse");
        fill_tmpfs(&sandbox, &global, "old", "from-old");
        let pod_targets: Vec<_> =
            (1..=3).map(|pod| sandbox.pod_volume_dir(&format!("pod-{pod}"), "pv-shared")).collect();
        for target in &pod_targets {
            sandbox.bind(&global, target).unwrap();
        }
        let subpath_target = sandbox.subpath_dir("pod-4", "pv-shared", "app", 0);
        sandbox.bind(&global.join("sub"), &subpath_target).unwrap();
        let pod_readers = pod_targets
            .iter()
            .enumerate()
            .map(|(i, target)| {
                ContainerReader::spawn(&sandbox, &format!("pod-{}", i + 1), target, Path::new("data")).unwrap()
            })
            .collect();
        let subpath_reader = ContainerReader::spawn(&sandbox, "pod-4", &subpath_target, Path::new("data")).unwrap();
        Node { sandbox, global, pod_targets, subpath_target, pod_readers, subpath_reader }
    }

    fn all_targets(&self) -> Vec<PathBuf> {
        let mut targets = self.pod_targets.clone();
        targets.push(self.subpath_target.clone());
        targets
    }

    fn wait_all_read(&self, content: &str) {
        for reader in &self.pod_readers {
            reader.wait_until(WAIT, content_is(content)).unwrap();
        }
        self.subpath_reader.wait_until(WAIT, content_is(&format!("{content}-sub"))).unwrap();
    }

    /// The daemon "restarts" the libfuse way: unmount, then mount anew.
    fn crash_and_remount(&self, content: &str, marker: &str) {
        let global = self.global.clone();
        self.sandbox.run(move || mount::detach(&global).unwrap());
        fill_tmpfs(&self.sandbox, &self.global, content, marker);
    }

    /// Mounts under the kubelet and runtime trees (what a heal must restore).
    fn mounts_in_node_trees(&self) -> usize {
        self.sandbox.count_mounts_under(&self.sandbox.kubelet_root())
            + self.sandbox.count_mounts_under(&self.sandbox.runtime_root())
    }

    /// O_PATH fds of the (stale) top layer of every target.
    fn open_targets(&self) -> Vec<OwnedFd> {
        let targets = self.all_targets();
        self.sandbox.run(move || targets.iter().map(|target| resolve::open_path(target).unwrap()).collect())
    }
}

/// A private tmpfs on a directory of the sandbox, where the flatten parks
/// the new top while it removes the stale layer beneath it. A detached tmpfs
/// cannot serve (see `detached_tmpfs_cannot_stage_an_attached_mount`).
fn private_staging_dir(sandbox: &Sandbox) -> OwnedFd {
    let dir = sandbox.root().join("staging");
    sandbox.run(move || {
        fs::create_dir_all(&dir).unwrap();
        mount::mount_tmpfs(&dir).unwrap();
        // A new mount under a shared parent starts shared; the staging must not be.
        mount::set_propagation(&dir, mount::Propagation::Private, false).unwrap();
        resolve::open_dir(&dir).unwrap()
    })
}

/// How a heal must be done (docs/heal.md, "The heal, step by step"), steps 1-4, in the
/// sandbox namespace.
fn heal(node: &Node, staging: &Arc<OwnedFd>) {
    let sandbox = &node.sandbox;
    // Fds of every stale layer, before the first stack covers them.
    let stale = node.open_targets();
    // One stack on one root-level target...
    let global = node.global.clone();
    let stale = sandbox.run(move || {
        let new_global = resolve::open_path(&global).unwrap();
        let copy = mount::clone_mount(new_global.as_fd()).unwrap();
        mount::move_mount(copy.as_fd(), stale[0].as_fd()).unwrap();
        stale
    });
    // ...reaches every root-level peer, but not the subPath target.
    let table = sandbox.mountinfo();
    for target in &node.pod_targets {
        assert_eq!(layers_at(&table, target), 2, "{} not stacked by propagation:\n{table}", target.display());
    }
    assert_eq!(layers_at(&table, &node.subpath_target), 1, "root-level stack reached the subPath target:\n{table}");
    // The subPath target needs its own stack, from the subdirectory.
    let global_sub = node.global.join("sub");
    let stale = sandbox.run(move || {
        let source = resolve::open_path(&global_sub).unwrap();
        let copy = mount::clone_mount(source.as_fd()).unwrap();
        mount::move_mount(copy.as_fd(), stale[3].as_fd()).unwrap();
        stale
    });
    // Flatten: park the new top, drop the stale layer (private, so the
    // containers keep their copies), put the new top back.
    let targets = node.all_targets();
    let staging = Arc::clone(staging);
    sandbox.run(move || {
        for (target, stale_layer) in targets.iter().zip(&stale) {
            mount::make_private(stale_layer.as_fd()).unwrap();
            let top = mount::open_mount(resolve::open_path(target).unwrap().as_fd()).unwrap();
            mount::move_mount(top.as_fd(), staging.as_fd()).unwrap();
            mount::detach_top(stale_layer.as_fd()).unwrap();
            let place = resolve::open_path(target).unwrap();
            mount::move_mount(top.as_fd(), place.as_fd()).unwrap();
        }
    });
}

/// How a heal must be done (docs/heal.md, "The heal, step by step"), on tmpfs stand-ins, for two
/// crash/heal cycles. This test is about propagation and layers, not FUSE: a
/// tmpfs global mount forms the same peer groups, and a dead FUSE mount would
/// only change what the readers see before the heal (ENOTCONN instead of the
/// old content).
#[test]
fn heal_by_stacking_then_flattening_reaches_running_containers() {
    let node = Node::new();
    let sandbox = &node.sandbox;
    node.wait_all_read("old");
    let staging = Arc::new(private_staging_dir(sandbox));
    let mounts_before = node.mounts_in_node_trees();

    for (cycle, content) in ["new", "newer"].into_iter().enumerate() {
        let marker = format!("from-{content}");
        node.crash_and_remount(content, &marker);
        heal(&node, &staging);

        node.wait_all_read(content);
        for reader in &node.pod_readers {
            let seen = reader.latest().unwrap();
            assert_eq!(seen.entries().unwrap(), ["data", marker.as_str(), "sub"], "cycle {cycle}: {}", reader.name());
        }
        let seen = node.subpath_reader.latest().unwrap();
        assert_eq!(seen.entries().unwrap(), ["data".to_string(), format!("{marker}-sub")], "cycle {cycle}");
        let table = sandbox.mountinfo();
        for target in node.all_targets() {
            assert_eq!(layers_at(&table, &target), 1, "cycle {cycle}: {} not flat:\n{table}", target.display());
        }
        assert_eq!(node.mounts_in_node_trees(), mounts_before, "cycle {cycle}:\n{table}");
        // Inside a running container every heal leaves one more layer: its
        // stale copy stays under the propagated new one (the flatten is
        // private on the host and reaches no container). Only a restart of
        // the container clears them.
        for reader in node.pod_readers.iter().chain([&node.subpath_reader]) {
            let inside = fs::read_to_string(format!("/proc/{}/mountinfo", reader.child().pid())).unwrap();
            let volume = sandbox.root().join(format!("containers/{}/rootfs/volume", reader.name()));
            assert_eq!(layers_at(&inside, &volume), cycle + 2, "{}:\n{inside}", reader.name());
        }
    }
}

/// A daemon that mounts its new global mount over the stale
/// one gets it propagated to the root-level targets by the kernel, and their
/// containers recover. Not the subPath target: its root is the subdirectory,
/// and the new mount sits on the root of the stale filesystem, outside it.
#[test]
fn mount_over_stale_global_heals_root_level_targets_but_not_subpath_ones() {
    let node = Node::new();
    node.wait_all_read("old");
    fill_tmpfs(&node.sandbox, &node.global, "new", "from-new");

    for reader in &node.pod_readers {
        let seen = reader.wait_until(WAIT, content_is("new")).unwrap();
        assert_eq!(seen.entries().unwrap(), ["data", "from-new", "sub"]);
    }
    let table = node.sandbox.mountinfo();
    assert_eq!(layers_at(&table, &node.global), 2, "{table}");
    for target in &node.pod_targets {
        assert_eq!(layers_at(&table, target), 2, "{} got no propagated copy:\n{table}", target.display());
    }
    assert_eq!(layers_at(&table, &node.subpath_target), 1, "{table}");
    // Give the subPath reader many read intervals to show a change; it has none.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(node.subpath_reader.latest().unwrap().content(), Some("old-sub"));
    assert_eq!(node.subpath_reader.history().len(), 1, "{:?}", node.subpath_reader.history());
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<_> =
        fs::read_dir(dir).unwrap().map(|entry| entry.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

/// `umount2("/proc/thread-self/fd/N")` resolves to the location, then takes
/// the topmost mount there, not the mount the fd was opened on.
#[test]
fn detach_top_acts_on_the_topmost_mount() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let dir = sandbox.root().join("stack");
    let left = sandbox.run(move || {
        fs::create_dir(&dir).unwrap();
        mount::mount_tmpfs(&dir).unwrap();
        fs::write(dir.join("lower"), "").unwrap();
        let lower = resolve::open_path(&dir).unwrap();
        mount::mount_tmpfs(&dir).unwrap();
        fs::write(dir.join("upper"), "").unwrap();
        mount::detach_top(lower.as_fd()).unwrap();
        entries(&dir)
    });
    assert_eq!(left, ["lower"]);
}

/// `mount_setattr` on an O_PATH fd taken before the layer was covered changes
/// that layer, not the one on top.
#[test]
fn make_private_reaches_a_covered_layer() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let dir = sandbox.kubelet_root().join("target");
    let (lower_id, upper_id) = sandbox.run(move || {
        fs::create_dir(&dir).unwrap();
        mount::mount_tmpfs(&dir).unwrap();
        let lower = resolve::open_path(&dir).unwrap();
        mount::mount_tmpfs(&dir).unwrap();
        let upper = resolve::open_path(&dir).unwrap();
        mount::make_private(lower.as_fd()).unwrap();
        (resolve::mount_id_of(lower.as_fd()).unwrap(), resolve::mount_id_of(upper.as_fd()).unwrap())
    });
    assert_ne!(lower_id, upper_id);
    let table = sandbox.mountinfo();
    let line =
        |id: u32| table.lines().find(|line| line.split(' ').next() == Some(&id.to_string())).unwrap().to_string();
    // Both started shared (their parent, the kubelet tree, is shared).
    assert!(!line(lower_id).contains("shared:"), "{table}");
    assert!(line(upper_id).contains("shared:"), "{table}");
}

/// Linux 6.15+ lets detached trees be mounted onto each other, but on 6.18 a
/// mount attached in the namespace cannot be moved onto a detached tmpfs, and
/// a mount cannot be moved back out of a detached tree: the flatten needs a
/// staging directory inside the namespace.
#[test]
fn detached_tmpfs_cannot_stage_an_attached_mount() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let root = sandbox.root().to_path_buf();
    sandbox.run(move || {
        let attached = root.join("attached");
        fs::create_dir(&attached).unwrap();
        mount::mount_tmpfs(&attached).unwrap();
        mount::set_propagation(&attached, mount::Propagation::Private, false).unwrap();
        let staging = mount::detached_tmpfs().unwrap();
        let handle = mount::open_mount(resolve::open_path(&attached).unwrap().as_fd()).unwrap();
        let err = mount::move_mount(handle.as_fd(), staging.as_fd()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");

        let copy = mount::clone_mount(resolve::open_path(&attached).unwrap().as_fd()).unwrap();
        mount::move_mount(copy.as_fd(), staging.as_fd()).unwrap();
        let back = root.join("back");
        fs::create_dir(&back).unwrap();
        let err = mount::move_mount(copy.as_fd(), resolve::open_path(&back).unwrap().as_fd()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    });
}

/// `MOVE_MOUNT_BENEATH` slides a mount under the top one (an alternative to
/// the staging dance, not used by the verified sequence).
#[test]
fn move_mount_beneath_puts_the_mount_under_the_top() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let root = sandbox.root().to_path_buf();
    let (before, after) = sandbox.run(move || {
        let (source, target) = (root.join("source"), root.join("target"));
        for (dir, file) in [(&source, "beneath"), (&target, "top")] {
            fs::create_dir(dir).unwrap();
            mount::mount_tmpfs(dir).unwrap();
            fs::write(dir.join(file), "").unwrap();
        }
        let copy = mount::clone_mount(resolve::open_path(&source).unwrap().as_fd()).unwrap();
        mount::move_mount_beneath(copy.as_fd(), resolve::open_path(&target).unwrap().as_fd()).unwrap();
        let before = entries(&target);
        mount::detach(&target).unwrap();
        (before, entries(&target))
    });
    assert_eq!(before, ["top"]);
    assert_eq!(after, ["beneath"]);
}

/// The reader reports content and entry changes, and errors by errno name.
#[test]
fn container_reader_reports_changes_of_its_volume() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let volume = sandbox.pod_volume_dir("pod-1", "pv");
    fill_tmpfs(&sandbox, &volume, "v1", "first");
    let reader = ContainerReader::spawn(&sandbox, "reader", &volume, Path::new("data")).unwrap();
    let seen = reader.wait_until(WAIT, content_is("v1")).unwrap();
    assert_eq!(seen.entries().unwrap(), ["data", "first", "sub"]);

    let dir = volume.clone();
    sandbox.run(move || {
        fs::write(dir.join("data"), "v2 | with, separators\nand lines").unwrap();
        fs::write(dir.join("second"), "").unwrap();
    });
    let seen = reader.wait_until(WAIT, |seen| seen.entries().is_some_and(|entries| entries.len() == 4)).unwrap();
    assert_eq!(seen.content(), Some("v2 | with, separators\nand lines"));
    assert_eq!(seen.entries().unwrap(), ["data", "first", "second", "sub"]);

    let dir = volume.clone();
    sandbox.run(move || fs::remove_file(dir.join("data")).unwrap());
    reader.wait_until(WAIT, |seen| seen.error() == Some("ENOENT")).unwrap();

    // It reports only changes: three distinct states seen (a write may be
    // observed half-done, so allow one extra).
    let history = reader.history();
    assert!((3..=5).contains(&history.len()), "{history:?}");
    assert!(history.windows(2).all(|pair| pair[0].outcome != pair[1].outcome), "{history:?}");
}

/// The container's namespace has no view of the kubelet and runtime trees.
#[test]
fn container_cannot_see_the_kubelet_and_runtime_trees() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let volume = sandbox.pod_volume_dir("pod-1", "pv");
    fill_tmpfs(&sandbox, &volume, "v1", "first");
    let reader = ContainerReader::spawn(&sandbox, "reader", &volume, Path::new("data")).unwrap();
    let container_mountinfo = fs::read_to_string(format!("/proc/{}/mountinfo", reader.child().pid())).unwrap();
    let kubelet = sandbox.kubelet_root();
    let runtime = sandbox.runtime_root();
    for line in container_mountinfo.lines() {
        let point = Path::new(line.split(' ').nth(4).unwrap());
        assert!(!point.starts_with(&kubelet) && !point.starts_with(&runtime), "{container_mountinfo}");
    }
    let rootfs_volume = sandbox.root().join("containers/reader/rootfs/volume");
    let line = container_mountinfo
        .lines()
        .find(|line| line.split(' ').nth(4) == rootfs_volume.to_str())
        .unwrap_or_else(|| panic!("no volume mount in the container:\n{container_mountinfo}"));
    assert!(line.contains("master:") && !line.contains("shared:"), "volume must be a slave only: {line}");
}

/// Nothing of the sandbox reaches the host table, during its life or after,
/// even when the test body panics; its children die with it.
#[test]
fn sandbox_leaves_nothing_behind_even_when_the_test_panics() {
    require_root();
    let (tx, rx) = std::sync::mpsc::channel();
    let outcome = std::panic::catch_unwind(move || {
        let sandbox = Sandbox::new().unwrap();
        let volume = sandbox.pod_volume_dir("pod-1", "pv");
        fill_tmpfs(&sandbox, &volume, "v1", "first");
        sandbox.bind(&volume, &sandbox.pod_volume_dir("pod-2", "pv")).unwrap();
        let mut sleeper = Command::new("sleep");
        sleeper.arg("1000");
        let sleeper = sandbox.spawn(sleeper).unwrap();
        let reader = ContainerReader::spawn(&sandbox, "reader", &volume, Path::new("data")).unwrap();
        assert!(sandbox.count_mounts_under(sandbox.root()) >= 5);
        assert!(!host_mountinfo_mentions(sandbox.root()), "sandbox mounts leaked into the host table");
        tx.send((sandbox.root().to_path_buf(), sleeper.pid(), reader.child().pid())).unwrap();
        std::mem::forget(reader); // Its own drop would kill it; the sandbox must.
        panic!("test body fails with the sandbox alive");
    });
    assert!(outcome.is_err());
    let (root, sleeper, reader) = rx.recv().unwrap();
    assert!(!host_mountinfo_mentions(&root), "sandbox mounts left in the host table");
    assert!(!root.exists(), "{} left behind", root.display());
    for pid in [sleeper, reader] {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "child {pid} survived the sandbox");
    }
}

/// Pids are reused: a sandbox directory an earlier process of this pid left
/// behind (killed before its sandboxes dropped) is passed over, not an error.
#[test]
fn a_sandbox_passes_over_directories_left_by_an_earlier_process_of_its_pid() {
    require_root();
    let index = |root: &Path| -> u64 {
        let name = root.file_name().unwrap().to_str().unwrap();
        name.rsplit('-').next().unwrap().parse().unwrap()
    };
    let last = index(Sandbox::new().unwrap().root());
    // The tests beside this one may take some of these names first.
    let left_behind: Vec<PathBuf> = (last + 1..=last + 50)
        .map(|next| std::env::temp_dir().join(format!("fuse-supervisor-sandbox-{}-{next}", std::process::id())))
        .filter(|dir| fs::create_dir(dir).is_ok())
        .collect();
    let created = Sandbox::new();
    for dir in &left_behind {
        fs::remove_dir(dir).unwrap();
    }
    let sandbox = created.expect("a sandbox beside directories left behind");
    assert!(index(sandbox.root()) > last + 50, "{} reused a directory left behind", sandbox.root().display());
}

/// Files of the sandbox are reachable from the test thread through
/// `outside_path`, and not at their plain path.
#[test]
fn outside_path_reaches_the_sandbox_tmpfs() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let file = sandbox.runtime_root().join("written-outside");
    fs::write(sandbox.outside_path(&file), "hello").unwrap();
    assert!(!file.exists(), "the plain path is the host directory");
    let inside = file.clone();
    assert_eq!(sandbox.run(move || fs::read_to_string(inside).unwrap()), "hello");
}

/// A panic inside `Sandbox::run` reaches the caller; the sandbox keeps working.
#[test]
fn sandbox_run_resumes_panics_in_the_caller() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sandbox.run(|| panic!("inside"))));
    assert!(caught.is_err());
    assert_eq!(sandbox.run(|| 7), 7);
    assert_ne!(
        fs::read_link(sandbox.namespace_path()).unwrap(),
        fs::read_link("/proc/self/ns/mnt").unwrap(),
        "the sandbox thread must be in a namespace of its own"
    );
}

/// The mount-table watcher reports the first of a burst of changes and then
/// stays quiet until re-armed; re-arming does not report the changes made
/// while it was disarmed (they are in the read that follows), and a change
/// after re-arming is reported again. The reader tells a change since its
/// last read without reading.
#[test]
fn the_table_watcher_reports_once_per_burst_and_again_after_a_rearm() {
    use fuse_supervisor_engine::model::mountinfo::MountInfoReader;
    use fuse_supervisor_engine::watch::mount_table::{MountWatcher, MountinfoWatcher, Wake};
    use fuse_supervisor_sys::poll::Waker;

    require_root();
    let sandbox = Sandbox::new().unwrap();
    let open = || sandbox.run(|| fs::File::open("/proc/thread-self/mountinfo")).unwrap();
    let mut reader = MountInfoReader::from_file(open());
    let shutdown = Arc::new(Waker::new().unwrap());
    let mut watcher = MountinfoWatcher::new(open(), Arc::clone(&shutdown)).unwrap();
    let rearm = watcher.rearm_handle();
    let (sender, wakes) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        loop {
            let wake = watcher.wait().unwrap();
            sender.send(wake).unwrap();
            if wake == Wake::Shutdown {
                return;
            }
        }
    });
    let mount_tmpfs = |name: &str| {
        let dir = sandbox.root().join(name);
        sandbox.run(move || {
            fs::create_dir_all(&dir).unwrap();
            mount::mount_tmpfs(&dir).unwrap();
        })
    };
    reader.read().unwrap();
    assert!(!reader.changed_since_read().unwrap());

    mount_tmpfs("burst-0");
    assert_eq!(wakes.recv_timeout(WAIT), Ok(Wake::TableChanged));
    for index in 1..50 {
        mount_tmpfs(&format!("burst-{index}"));
    }
    assert!(reader.changed_since_read().unwrap());
    assert!(reader.changed_since_read().unwrap(), "a change stays known until the next read");
    rearm.rearm().unwrap();
    let table = reader.read().unwrap().to_vec();
    assert!(String::from_utf8_lossy(&table).contains("burst-49"));
    assert!(!reader.changed_since_read().unwrap());

    mount_tmpfs("after-rearm");
    assert_eq!(wakes.recv_timeout(WAIT), Ok(Wake::TableChanged));
    assert!(reader.changed_since_read().unwrap());
    shutdown.wake().unwrap();
    // Anything but Shutdown here is a report the burst or the rearm should not have made.
    assert_eq!(wakes.recv_timeout(WAIT), Ok(Wake::Shutdown));
    thread.join().unwrap();
}

/// The mounts of a container's namespace: (mount ID, parent ID, device,
/// mount point, fs type), in table order.
fn container_mounts(pid: u32) -> Vec<(u32, u32, String, PathBuf, String)> {
    let table = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    parse_table(table.as_bytes())
        .unwrap()
        .iter()
        .map(|m| {
            let dev = format!("{}:{}", m.major, m.minor);
            (m.mount_id, m.parent_id, dev, m.mount_point.to_path().into_owned(), m.fs_type.to_owned())
        })
        .collect()
}

/// A tenant's FUSE (hanging on one name) inside a container, with the
/// container's copy of a FUSE volume bound beneath it: the container's table
/// shows the copy on a directory of the tenant's mount, a walk to the copy
/// waits until the tenant is released, and dropping the tenant leaves the
/// container as it was, still reading its volume.
#[test]
fn a_tenant_fuse_holds_the_path_to_the_containers_copy_until_released() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let source = FuseSource::start(&sandbox, Daemon::DemoFs, "shared").unwrap();
    let volume = source.bind_volume(&sandbox, "pod-1", "data").unwrap();
    let reader = ContainerReader::spawn(&sandbox, "victim", &volume, Path::new(DATA_FILE)).unwrap();
    let expected = source.expected_content();
    reader.wait_until(WAIT, |seen| seen.content() == Some(expected.as_str())).unwrap();
    let pid = reader.child().pid();
    let before = container_mounts(pid);
    let rootfs = sandbox.root().join("containers/victim/rootfs");
    let namespace = PathBuf::from(format!("/proc/{pid}/ns/mnt"));

    let tenant =
        TenantFuse::mount_over_copy(&sandbox, &namespace, &rootfs.join("tenant"), &rootfs.join("volume"), "hidden")
            .unwrap();
    assert_eq!(tenant.copy, rootfs.join("tenant/hidden"));
    let mounts = container_mounts(pid);
    let volume_dev = &before.iter().find(|m| m.3 == rootfs.join("volume")).expect("the volume's copy").2;
    let tenant_mount = mounts.iter().find(|m| m.3 == tenant.mount_point).expect("the tenant's FUSE");
    assert_eq!(tenant_mount.4, "fuse.tenant");
    let copy = mounts.iter().find(|m| m.3 == tenant.copy).expect("the copy beneath the tenant's FUSE");
    assert_eq!((&copy.2, copy.1), (volume_dev, tenant_mount.0), "{mounts:?}");
    assert!(!sandbox.mountinfo().contains("fuse.tenant"), "the tenant's mount reached the node");

    let (sender, answer) = std::sync::mpsc::channel();
    let data = PathBuf::from(format!("/proc/{pid}/root")).join(tenant.copy.strip_prefix("/").unwrap()).join(DATA_FILE);
    std::thread::spawn(move || {
        let _ = sender.send(fs::read_to_string(data).map_err(|err| err.kind()));
    });
    // Not a timing assertion: a held lookup never answers.
    let early = answer.recv_timeout(Duration::from_millis(300));
    assert!(early.is_err(), "the walk through the tenant's FUSE was answered: {early:?}");
    tenant.release().unwrap();
    assert_eq!(answer.recv_timeout(WAIT * 2).expect("released"), Ok(expected.clone()));

    drop(tenant);
    assert_eq!(container_mounts(pid), before);
    assert_eq!(reader.latest().and_then(|seen| seen.content().map(str::to_owned)), Some(expected));
}

/// A tmpfs over the container's copy of its volume: the container reads
/// the tmpfs (no data file) and its table shows the tmpfs on top.
#[test]
fn cover_with_tmpfs_covers_a_mount_in_the_containers_namespace() {
    require_root();
    let sandbox = Sandbox::new().unwrap();
    let volume = sandbox.pod_volume_dir("pod-1", "pv");
    fill_tmpfs(&sandbox, &volume, "v1", "first");
    let reader = ContainerReader::spawn(&sandbox, "covered", &volume, Path::new("data")).unwrap();
    reader.wait_until(WAIT, content_is("v1")).unwrap();
    let pid = reader.child().pid();
    let copy = sandbox.root().join("containers/covered/rootfs/volume");
    cover_with_tmpfs(Path::new(&format!("/proc/{pid}/ns/mnt")), &copy).unwrap();
    reader.wait_until(WAIT, |seen| seen.error() == Some("ENOENT")).unwrap();
    let mounts = container_mounts(pid);
    let at_copy: Vec<_> = mounts.iter().filter(|m| m.3 == copy).map(|m| m.4.as_str()).collect();
    assert_eq!(at_copy, ["tmpfs", "tmpfs"], "{mounts:?}");
    assert_eq!(layers_at(&sandbox.mountinfo(), &volume), 1, "the cover reached the node");
}
