use std::fs;
use std::sync::mpsc::Receiver;

use super::discovery::add_holder;
use super::*;

struct NoWatcher;

impl ProcessWatcher for NoWatcher {
    fn watch(&self, _: ProcessId) -> Result<(), ProcessWatchError> {
        Ok(())
    }
    fn unwatch(&self, _: u32) -> bool {
        false
    }
    fn watched(&self) -> Vec<ProcessId> {
        Vec::new()
    }
    fn backend(&self) -> fuse_supervisor_engine::watch::processes::Backend {
        fuse_supervisor_engine::watch::processes::Backend::Pidfd
    }
}

/// Daemons without threads: discovery requests queue on the receiver.
/// No `fusectl` (the number alone names a connection) but where a test
/// makes one.
fn daemons() -> (Daemons, Receiver<Vec<(PathBuf, Dev)>>) {
    let (requests, queue) = mpsc::channel();
    let options = DaemonWatch { fuse_connections: PathBuf::from("/nonexistent/fusectl"), ..DaemonWatch::default() };
    let daemons = Daemons {
        options,
        watcher: Arc::new(NoWatcher),
        holders: Arc::default(),
        known: BTreeMap::new(),
        identities: BTreeMap::new(),
        connections: Arc::new(FuseConnections::unavailable()),
        want_exec: Arc::default(),
        last_exec_discovery: None,
        orphans: BTreeMap::new(),
        requests: Some(requests),
        discovery: None,
    };
    (daemons, queue)
}

fn found(dev: Dev, pids: &[u32], scanned_at: Instant) -> Vec<Discovered> {
    let processes = pids.iter().map(|&pid| ProcessId { pid, start_time: 1 }).collect();
    vec![Discovered { source: "/runtime/g".into(), dev, result: Ok(processes), scanned_at, exact: true }]
}

/// A connection served by pid 10, discovered.
fn served(dev: Dev) -> (Daemons, Receiver<Vec<(PathBuf, Dev)>>) {
    served_with(daemons(), dev)
}

fn served_with(
    (mut daemons, queue): (Daemons, Receiver<Vec<(PathBuf, Dev)>>),
    dev: Dev,
) -> (Daemons, Receiver<Vec<(PathBuf, Dev)>>) {
    daemons.sources_seen([(Path::new("/runtime/g"), dev)].into_iter(), std::iter::empty());
    assert_eq!(queue.try_recv().unwrap(), vec![(PathBuf::from("/runtime/g"), dev)]);
    add_holder(&daemons.holders, ProcessId { pid: 10, start_time: 1 }, Path::new("/runtime/g"), dev);
    assert!(daemons.discovered(found(dev, &[10], Instant::now())) == Verdicts::default());
    (daemons, queue)
}

#[test]
fn a_death_is_retracted_when_the_discovery_after_it_finds_a_holder() {
    let dev = Dev { major: 0, minor: 52 };
    let (mut daemons, queue) = served(dev);
    let before = Instant::now();
    let (deaths, partial) = daemons.exited(10);
    assert_eq!(deaths, vec![Death { source: "/runtime/g".into(), dev }]);
    assert!(partial.is_empty());
    assert_eq!(queue.try_recv().unwrap(), vec![(PathBuf::from("/runtime/g"), dev)], "the death is checked");
    // A scan begun before the exit says nothing about after it.
    assert!(daemons.discovered(found(dev, &[11], before)).retracted.is_empty());
    let retracted = daemons.discovered(found(dev, &[11], Instant::now())).retracted;
    assert_eq!(retracted, vec![Retraction { source: "/runtime/g".into(), dev, pids: vec![11] }]);
}

#[test]
fn a_death_stands_when_nobody_holds_the_connection() {
    let dev = Dev { major: 0, minor: 52 };
    let (mut daemons, _queue) = served(dev);
    assert_eq!(daemons.exited(10).0.len(), 1);
    let verdicts = daemons.discovered(found(dev, &[], Instant::now()));
    assert_eq!(
        verdicts,
        Verdicts { confirmed: vec![Death { source: "/runtime/g".into(), dev }], ..Verdicts::default() }
    );
    assert_eq!(daemons.discovered(found(dev, &[11], Instant::now())), Verdicts::default(), "dead for good");
}

#[test]
fn a_death_stands_when_its_number_went_to_another_connection() {
    let connections = tempfile::tempdir().unwrap();
    let dir = connections.path().join("52");
    fs::create_dir(&dir).unwrap();
    let dev = Dev { major: 0, minor: 52 };
    let (mut fresh, queue) = daemons();
    fresh.connections = Arc::new(FuseConnections::at(connections.path()));
    let (mut daemons, _queue) = served_with((fresh, queue), dev);
    assert_eq!(daemons.exited(10).0.len(), 1);
    // The connection goes, and a pod's own daemon gets its number before
    // the check's scan: its directory is another (the old one is kept
    // aside so that the new cannot take its inode).
    fs::rename(&dir, connections.path().join("old")).unwrap();
    fs::create_dir(&dir).unwrap();
    let stranger = ProcessId { pid: 20, start_time: 1 };
    add_holder(&daemons.holders, stranger, Path::new("/runtime/g"), dev);
    let verdicts = daemons.discovered(found(dev, &[20], Instant::now()));
    assert_eq!(
        verdicts,
        Verdicts { confirmed: vec![Death { source: "/runtime/g".into(), dev }], ..Verdicts::default() },
        "not retracted by another connection's holder"
    );
    assert!(!lock(&daemons.holders).contains_key(&20), "nor watched as this one's");
    assert_eq!(daemons.exited(20), (Vec::new(), Vec::new()), "so its exit is nobody's death");
}

#[test]
fn a_connection_first_seen_without_fusectl_is_known_by_its_number() {
    let connections = tempfile::tempdir().unwrap();
    let dev = Dev { major: 0, minor: 52 };
    let (mut fresh, queue) = daemons();
    fresh.connections = Arc::new(FuseConnections::at(connections.path()));
    let (mut daemons, _queue) = served_with((fresh, queue), dev);
    // fusectl mounted since (its directory now there): no identity to
    // compare, so a holder found after the exit is the connection's.
    fs::create_dir(connections.path().join("52")).unwrap();
    assert_eq!(daemons.exited(10).0.len(), 1);
    add_holder(&daemons.holders, ProcessId { pid: 11, start_time: 1 }, Path::new("/runtime/g"), dev);
    let retracted = daemons.discovered(found(dev, &[11], Instant::now())).retracted;
    assert_eq!(retracted, vec![Retraction { source: "/runtime/g".into(), dev, pids: vec![11] }]);
}

#[test]
fn a_holder_of_a_dying_connection_exiting_is_not_a_second_death() {
    let dev = Dev { major: 0, minor: 52 };
    let (mut daemons, queue) = served(dev);
    assert_eq!(daemons.exited(10).0.len(), 1);
    // Found by the check, gone before its answer is read.
    add_holder(&daemons.holders, ProcessId { pid: 11, start_time: 1 }, Path::new("/runtime/g"), dev);
    let scanned_at = Instant::now();
    let (deaths, _) = daemons.exited(11);
    assert!(deaths.is_empty());
    assert_eq!(queue.try_iter().count(), 2, "each exit asks again");
    assert!(daemons.discovered(found(dev, &[11], scanned_at)).retracted.is_empty(), "that answer is stale");
}

/// A connection served by pid 10, beside a watchdog, pid 11, that holds
/// it too; `/proc` is a stand-in where 11 sleeps reading the device if
/// `watchdog_reads`.
fn served_beside_a_watchdog(dev: Dev, watchdog_reads: bool) -> (Daemons, tempfile::TempDir) {
    let proc_root = tempfile::tempdir().unwrap();
    let task = proc_root.path().join("11/task/11");
    fs::create_dir_all(&task).unwrap();
    fs::write(task.join("wchan"), if watchdog_reads { "fuse_dev_do_read" } else { "do_sigtimedwait" }).unwrap();
    let (mut daemons, _queue) = served(dev);
    daemons.options.proc_root = proc_root.path().to_path_buf();
    add_holder(&daemons.holders, ProcessId { pid: 11, start_time: 1 }, Path::new("/runtime/g"), dev);
    (daemons, proc_root)
}

fn is_served(daemons: &Daemons, dev: Dev) -> bool {
    matches!(daemons.known.get(&dev), Some((_, Known::Served)))
}

#[test]
fn a_watchdogs_next_child_is_looked_for_until_it_holds_the_connection() {
    let dev = Dev { major: 0, minor: 52 };
    let (mut daemons, _proc_root) = served_beside_a_watchdog(dev, false);
    let (deaths, partial) = daemons.exited(10);
    assert!(deaths.is_empty());
    assert_eq!(partial[0].remaining, [11]);
    // Only the watchdog, which does not read: looked for again, on a timer.
    assert!(daemons.discovered(found(dev, &[11], Instant::now())) == Verdicts::default());
    assert!(!is_served(&daemons, dev));
    assert!(daemons.next_deadline().is_some(), "the next look is due");
    // Its next child holds it now.
    assert!(daemons.discovered(found(dev, &[11, 12], Instant::now())) == Verdicts::default());
    assert!(is_served(&daemons, dev));
    assert_eq!(daemons.next_deadline(), None, "no timer once served");
}

#[test]
fn holders_left_reading_the_connection_serve_it() {
    let dev = Dev { major: 0, minor: 52 };
    let (mut daemons, _proc_root) = served_beside_a_watchdog(dev, true);
    assert_eq!(daemons.exited(10).1.len(), 1);
    assert!(daemons.discovered(found(dev, &[11], Instant::now())) == Verdicts::default());
    assert!(is_served(&daemons, dev));
}

#[test]
fn this_process_does_not_read_a_fuse_device() {
    assert!(!reads_fuse_device(Path::new("/proc"), std::process::id()));
}

#[test]
fn a_connection_nobody_held_at_its_first_search_is_checked_and_may_be_dead() {
    let dev = Dev { major: 0, minor: 53 };
    let (mut daemons, queue) = daemons();
    daemons.sources_seen([(Path::new("/runtime/g"), dev)].into_iter(), std::iter::empty());
    assert_eq!(queue.try_recv().unwrap(), vec![(PathBuf::from("/runtime/g"), dev)]);
    let unheld = daemons.discovered(found(dev, &[], Instant::now())).unheld;
    assert_eq!(unheld, vec![(PathBuf::from("/runtime/g"), dev)], "nobody holds it: its mount is probed");
    assert!(daemons.unheld_died(dev), "its mount answered ENOTCONN: dead");
    assert!(!daemons.unheld_died(dev), "one death");
    assert_eq!(daemons.discovered(found(dev, &[11], Instant::now())), Verdicts::default(), "dead for good");

    // Without fdinfo's connection, an empty answer may be the fallback's
    // doubt rather than nobody: nothing to probe.
    let other = Dev { major: 0, minor: 54 };
    daemons.sources_seen([(Path::new("/runtime/h"), other)].into_iter(), std::iter::empty());
    let mut doubtful = found(other, &[], Instant::now());
    doubtful[0].exact = false;
    assert!(daemons.discovered(doubtful).unheld.is_empty());
    // A holder found since: not dead, whatever a late probe says.
    let (mut daemons, _queue) = served(Dev { major: 0, minor: 55 });
    assert!(!daemons.unheld_died(Dev { major: 0, minor: 55 }));
}

#[test]
fn a_connection_unmounted_from_its_source_stays_watched_while_a_target_is_on_it() {
    let dev = Dev { major: 0, minor: 53 };
    // A restart script's `kill; umount`: the scan of the unmount comes
    // before the loop handles the exit, and the target is still on the
    // dead connection.
    let (mut daemons, _queue) = served(dev);
    daemons.sources_seen(std::iter::empty(), [dev].into_iter());
    let (deaths, partial) = daemons.exited(10);
    assert_eq!(deaths, vec![Death { source: "/runtime/g".into(), dev }], "the exit is a death");
    assert!(partial.is_empty());

    // With no target on it either (its pod went first), it is forgotten:
    // the daemon's end after its last unmount is no death.
    let (mut daemons, _queue) = served(dev);
    daemons.sources_seen(std::iter::empty(), std::iter::empty());
    let (deaths, partial) = daemons.exited(10);
    assert!(deaths.is_empty() && partial.is_empty());

    // Nor is one whose daemon was never found kept by its target: a search
    // would probe the source, which no longer shows it.
    let (mut unserved, queue) = self::daemons();
    unserved.sources_seen([(Path::new("/runtime/g"), dev)].into_iter(), std::iter::empty());
    assert_eq!(queue.try_recv().unwrap(), vec![(PathBuf::from("/runtime/g"), dev)]);
    unserved.sources_seen(std::iter::empty(), [dev].into_iter());
    assert!(!unserved.known.contains_key(&dev), "an unserved connection gone from its source is forgotten");
}
