use std::fs;
use std::path::Path;

use fuse_supervisor_sys::mount::Propagation;

use super::*;
use crate::model::table::Snapshot;

/// A fake `/proc`: each process a directory with its namespace (a file
/// whose inode is the namespace's; processes of one namespace share it by
/// hard links), its start time, and its mount table.
struct FakeProc {
    root: tempfile::TempDir,
}

impl FakeProc {
    fn new() -> FakeProc {
        FakeProc { root: tempfile::tempdir().unwrap() }
    }

    fn path(&self) -> &Path {
        self.root.path()
    }

    /// A process in `namespace` (a new one if None), returning its
    /// namespace's file.
    fn process(&self, pid: u32, namespace: Option<&Path>, started: u64, table: &str) -> PathBuf {
        let dir = self.path().join(pid.to_string());
        fs::create_dir_all(dir.join("ns")).unwrap();
        match namespace {
            Some(first) => fs::hard_link(first, dir.join("ns/mnt")).unwrap(),
            None => fs::write(dir.join("ns/mnt"), "").unwrap(),
        }
        let stat = format!("{pid} (sh) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {started} 0 0");
        fs::write(dir.join("stat"), stat).unwrap();
        fs::write(dir.join("mountinfo"), table).unwrap();
        dir.join("ns/mnt")
    }

    fn exits(&self, pid: u32) {
        fs::remove_dir_all(self.path().join(pid.to_string())).unwrap();
    }

    fn rewrite(&self, pid: u32, table: &str) {
        fs::write(self.path().join(pid.to_string()).join("mountinfo"), table).unwrap();
    }
}

fn inode(path: &Path) -> u64 {
    fs::metadata(path).unwrap().ino()
}

const ROOT: &str = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n";
const DEAD: Dev = Dev { major: 0, minor: 50 };

fn private_volume(minor: u32) -> String {
    format!("{ROOT}20 1 0:{minor} / /volume rw - fuse.bindfs bindfs rw\n")
}

/// Known as a walk leaves them: every namespace of `proc`.
fn kept(proc: &FakeProc) -> Namespaces {
    kept_with(proc, FuseConnections::unavailable())
}

/// [`kept`], with the live FUSE connections listed in `connections`.
fn kept_with(proc: &FakeProc, connections: FuseConnections) -> Namespaces {
    let connections = Arc::new(connections);
    let namespaces = Namespaces {
        proc_root: proc.path().to_path_buf(),
        known: Mutex::default(),
        keeper: OnceLock::new(),
        copier: OnceLock::new(),
        connections,
        late_copies: OnceLock::new(),
        host: OnceLock::new(),
    };
    let walked = walk(proc.path(), &BTreeSet::new(), || {}).unwrap();
    let mut known = namespaces.known();
    for read in walked {
        known.learn(read);
    }
    known.kept = true;
    drop(known);
    namespaces
}

#[test]
fn a_query_reads_again_only_namespaces_that_can_hold_a_connections_mount() {
    let proc = FakeProc::new();
    let with_volume = proc.process(10, None, 100, &private_volume(50));
    let slave = format!("{ROOT}30 1 8:1 /data /data rw master:7 - ext4 /dev/sda1 rw\n");
    let receiving = proc.process(20, None, 200, &slave);
    let plain = proc.process(30, None, 300, ROOT);
    let namespaces = kept(&proc);
    assert_eq!(namespaces.len(), 3);

    // Meanwhile the plain one bound a FUSE mount of its own: it is not
    // read (it could only have made it itself), the slave one is, and
    // there a mount of the dead connection arrived by propagation.
    proc.rewrite(30, &private_volume(50));
    proc.rewrite(20, &format!("{slave}40 30 0:50 / /data/v rw master:9 - fuse.bindfs bindfs rw\n"));
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert!(!found.walked);
    assert_eq!(found.read, 2);
    let mut seen: Vec<(u64, u32, &str)> = found
        .mounts
        .iter()
        .map(|foreign| (foreign.namespace, foreign.pid, foreign.mount.mount_point.to_str().unwrap()))
        .collect();
    seen.sort();
    let mut expected = vec![(inode(&with_volume), 10, "/volume"), (inode(&receiving), 20, "/data/v")];
    expected.sort();
    assert_eq!(seen, expected);
    let slave_mount = found.mounts.iter().find(|foreign| foreign.pid == 20).unwrap();
    assert_eq!(slave_mount.propagation, Propagation::Slave);
    assert!(!found.mounts.iter().any(|foreign| foreign.namespace == inode(&plain)));

    // Skipped namespaces are not read.
    let found = namespaces.holding(&BTreeSet::from([inode(&with_volume)]), &BTreeSet::from([DEAD]), ..).unwrap();
    assert_eq!(found.read, 1);
}

#[test]
fn only_namespaces_learnt_after_a_generation_are_read_for_it() {
    let proc = FakeProc::new();
    proc.process(10, None, 100, &private_volume(50));
    let namespaces = kept(&proc);
    let searched_at = namespaces.generation();
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), searched_at + 1..).unwrap();
    assert_eq!((found.read, found.mounts.len()), (0, 0), "nothing learnt since");

    // A process unshared a copy of the dead mount and exec'd: learnt.
    proc.process(40, None, 400, &private_volume(50));
    let read = read_namespace(proc.path(), 40, None).unwrap().expect("readable");
    namespaces.known().learn(read);
    assert!(namespaces.generation() > searched_at);
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), searched_at + 1..).unwrap();
    assert_eq!(found.read, 1);
    assert_eq!(found.mounts.len(), 1);
    assert_eq!(found.mounts[0].pid, 40);
}

#[test]
fn a_namespace_learnt_after_a_heal_hands_over_its_copies_of_the_connection_replaced() {
    let proc = FakeProc::new();
    let fusectl = tempfile::tempdir().unwrap();
    let dead_dir = fusectl.path().join(crate::heal::connections::directory_name(DEAD));
    fs::create_dir(&dead_dir).unwrap();
    let namespaces = kept_with(&proc, FuseConnections::at(fusectl.path()));
    let (send, handed) = mpsc::channel();
    namespaces.when_late_copies(Box::new(move |late| send.send(late).unwrap()));
    let source = Path::new("/var/lib/fuse/source");
    let generation = namespaces.replaced(&[(DEAD, inode(&dead_dir))], source);
    assert_eq!(generation, namespaces.generation());

    // A copy of the dead connection's mount, learnt now: handed over.
    proc.process(40, None, 400, &private_volume(50));
    namespaces.learn_new(read_namespace(proc.path(), 40, None).unwrap().unwrap());
    let late = handed.try_recv().expect("the late copy handed over");
    assert_eq!(late.source, source);
    assert_eq!(late.mounts.len(), 1);
    assert_eq!((late.mounts[0].pid, late.mounts[0].mount.mount_point.as_path()), (40, Path::new("/volume")));
    // Learnt after the generation the heal's search reads up to.
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..=generation).unwrap();
    assert_eq!(found.read, 0, "the search and the late check see a namespace once");

    // Another connection's mount: nothing.
    proc.process(50, None, 500, &private_volume(51));
    namespaces.learn_new(read_namespace(proc.path(), 50, None).unwrap().unwrap());
    assert!(handed.try_recv().is_err());

    // The dead connection ended and a new one got its number: its mounts
    // are that one's, never replaced.
    fs::rename(&dead_dir, fusectl.path().join("old")).unwrap();
    fs::create_dir(&dead_dir).unwrap();
    proc.process(60, None, 600, &private_volume(50));
    namespaces.learn_new(read_namespace(proc.path(), 60, None).unwrap().unwrap());
    assert!(handed.try_recv().is_err(), "a later connection with the number taken for the dead one");

    // The host's namespace, learnt (again) holding a copy of the dead
    // connection: its targets are the host heal's, never handed over, and
    // no search finds it.
    let host = proc.process(70, None, 700, &private_volume(50));
    namespaces.heal_as_host(inode(&host));
    namespaces.replaced(&[(DEAD, inode(&dead_dir))], source);
    namespaces.learn_new(read_namespace(proc.path(), 70, None).unwrap().unwrap());
    assert!(handed.try_recv().is_err(), "the host's namespace handed over as a container's");
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert!(found.mounts.iter().all(|mount| mount.pid != 70), "{found:?}");
}

#[test]
fn a_namespace_is_forgotten_when_its_anchor_exits_or_is_found_gone() {
    let proc = FakeProc::new();
    let first = proc.process(10, None, 100, &private_volume(50));
    // A later process of the same namespace (an exec'd probe): the
    // namespace is anchored at the oldest.
    proc.process(11, Some(&first), 150, &private_volume(50));
    proc.process(20, None, 200, &private_volume(50));
    let namespaces = kept(&proc);
    assert_eq!(namespaces.len(), 2);
    assert_eq!(namespaces.known().anchors.get(&10), Some(&inode(&first)));
    assert!(!namespaces.known().anchors.contains_key(&11));

    assert_eq!(namespaces.known().forget(11), None, "not an anchor");
    assert_eq!(namespaces.known().forget(10), Some(inode(&first)));
    assert_eq!(namespaces.len(), 1);

    // Gone before its exit was handled: found gone by the query, which
    // forgets it and finds nothing there.
    proc.exits(20);
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert!(found.mounts.is_empty());
    assert!(namespaces.is_empty());
}

#[test]
fn a_pid_taken_by_another_process_does_not_read_as_the_anchor() {
    let proc = FakeProc::new();
    proc.process(10, None, 100, &private_volume(50));
    let namespaces = kept(&proc);
    // The anchor exited and its pid went to a process of another namespace
    // (a hard link keeps the same inode, so this is a new namespace file).
    proc.exits(10);
    proc.process(10, None, 900, &private_volume(50));
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert!(found.mounts.is_empty(), "{:?}", found.mounts);
    assert!(namespaces.is_empty());
}

#[test]
fn until_kept_a_query_walks() {
    let proc = FakeProc::new();
    proc.process(10, None, 100, &private_volume(50));
    let namespaces = Namespaces::new(proc.path());
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert!(found.walked);
    assert_eq!(found.mounts.len(), 1);
}

#[test]
fn a_table_that_receives_propagation_is_told_apart() {
    let receives = |table: &str| Snapshot::parse_receiving(table.as_bytes()).unwrap().1;
    assert!(!receives(ROOT));
    assert!(receives(&format!("{ROOT}30 1 8:1 / /a rw shared:4 - ext4 /dev/sda1 rw\n")));
    assert!(receives(&format!("{ROOT}30 1 8:1 / /a rw master:4 - ext4 /dev/sda1 rw\n")));
}

#[test]
fn a_namespace_holding_other_connections_is_read_only_once_healed_onto_this_one() {
    let proc = FakeProc::new();
    let other = proc.process(10, None, 100, &private_volume(60));
    let namespaces = kept(&proc);
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert_eq!(found.read, 0, "it holds 0:60 only, and receives nothing");

    // A container heal replaced its mount with one of 0:50 (the table
    // says so now, but it was not read since).
    proc.rewrite(10, &private_volume(50));
    namespaces.healed_onto(inode(&other), DEAD);
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert_eq!((found.read, found.mounts.len()), (1, 1));
    // Read again: what it holds is known from its table from now on.
    assert!(namespaces.known().by_inode[&inode(&other)].healed_onto.is_empty());
}

/// The kernel reuses a freed namespace's inode: an entry whose anchor is
/// no longer in it (exited, its exit not handled yet, or moved) does not
/// stand for the new namespace with that inode, which is learnt afresh.
#[test]
fn a_reused_namespace_inode_is_learnt_afresh() {
    let proc = FakeProc::new();
    let first = proc.process(10, None, 100, &private_volume(60));
    let namespaces = kept(&proc);
    let reused = inode(&first);
    assert!(namespaces.is_known(reused));

    // A new namespace with that inode (pid 20), its old anchor elsewhere.
    proc.process(20, Some(&first), 200, &private_volume(50));
    fs::remove_file(&first).unwrap();
    fs::write(&first, "").unwrap();
    assert!(!namespaces.is_known(reused), "its anchor left it");
    let read = read_namespace(proc.path(), 20, None).unwrap().expect("readable");
    namespaces.known().learn(read);
    assert!(namespaces.is_known(reused));
    assert_eq!(namespaces.known().anchors.get(&20), Some(&reused));
    assert!(!namespaces.known().anchors.contains_key(&10), "the old anchor stands for nothing");
    let found = namespaces.holding(&BTreeSet::new(), &BTreeSet::from([DEAD]), ..).unwrap();
    assert_eq!(found.mounts.iter().map(|foreign| foreign.pid).collect::<Vec<_>>(), [20]);
}

/// A namespace whose first process in the walk exits before its table is
/// read (here its mountinfo is missing) is read through its next process,
/// not skipped; and it is recorded with its oldest process, which will
/// still be there to enter it through.
#[test]
fn a_namespace_whose_first_process_vanished_is_read_through_the_next() {
    let proc = FakeProc::new();
    let own = proc.process(1, None, 1, "");
    // A container's `usleep` (exited: only its namespace link is left), the
    // reader that is reading its table, and the container's init, whose
    // pid is higher: they wrapped.
    let container = proc.path().join("7/ns");
    fs::create_dir_all(&container).unwrap();
    let container = container.join("mnt");
    fs::write(&container, "").unwrap();
    let dead_line = format!("{ROOT}900 1 0:50 / /volume rw,relatime master:3 - fuse.bindfs bindfs rw\n");
    proc.process(4000, Some(&container), 500, &dead_line);
    proc.process(9000, Some(&container), 100, &dead_line);
    let walked = Namespaces::new(proc.path());
    let found = walked.holding(&BTreeSet::from([inode(&own)]), &BTreeSet::from([DEAD]), ..).unwrap();
    assert!(found.walked);
    assert_eq!(found.mounts.len(), 1, "{:?}", found.mounts);
    let foreign = &found.mounts[0];
    assert_eq!((foreign.pid, foreign.namespace), (9000, inode(&container)));
    assert_eq!(foreign.mount.mount_point, Path::new("/volume"));
    assert_eq!(foreign.propagation, Propagation::Slave);
}

#[test]
fn the_walk_skips_the_own_namespace_and_finds_nothing_without_dead_connections() {
    let own = BTreeSet::from([inode(Path::new("/proc/self/ns/mnt"))]);
    let found = Namespaces::new(Path::new("/proc")).holding(&own, &BTreeSet::new(), ..).unwrap();
    assert!(found.walked && found.mounts.is_empty());
    assert!(Namespaces::new(Path::new("/nonexistent")).holding(&own, &BTreeSet::new(), ..).is_err());
}
