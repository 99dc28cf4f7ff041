//! The metrics and health endpoints of a real `fuse-supervisor run`,
//! scraped over HTTP while a FUSE daemon crashes and comes back in a
//! private mount namespace, and probed while slow clients attack them.
//! Needs root, /dev/fuse and bindfs.
use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fuse_supervisor_testbed::scenario::{
    self, DATA_FILE, Daemon, FuseSource, Restart, SUBDIR_FILE, SupervisorProcess, layers_at,
};
use fuse_supervisor_testbed::{ContainerReader, Sandbox};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const HEAL_TIMEOUT: Duration = Duration::from_secs(20);

fn binary() -> &'static Path {
    Path::new(BINARY)
}

/// Prints the supervisor's metrics when a test fails (it prints its log
/// itself).
struct DumpOnPanic<'a>(&'a SupervisorProcess);

impl Drop for DumpOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok((_, metrics)) = self.0.http_get("/metrics")
        {
            eprintln!("metrics:\n{metrics}");
        }
    }
}

fn metric(supervisor: &SupervisorProcess, series: &str) -> f64 {
    supervisor.metric(series).expect("scrape").unwrap_or_else(|| panic!("{series} is not exposed"))
}

#[test]
fn a_real_heal_shows_in_the_metrics_and_the_endpoints_answer() {
    // Dropped in reverse: readers, supervisor, source, sandbox.
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "shared-data").expect("start bindfs");
    let mut targets: Vec<(PathBuf, &Path)> = (0..2)
        .map(|pod| (source.bind_volume(&sandbox, &format!("pod-{pod}"), "data").unwrap(), Path::new(DATA_FILE)))
        .collect();
    targets.push((source.bind_subpath(&sandbox, "pod-sub", "data").unwrap(), Path::new(SUBDIR_FILE)));
    let supervisor = SupervisorProcess::start(&sandbox, binary(), &sandbox.root().join("state")).expect("supervisor");
    let _dump = DumpOnPanic(&supervisor);
    let readers: Vec<ContainerReader> = targets
        .iter()
        .enumerate()
        .map(|(i, (target, read))| {
            ContainerReader::spawn(&sandbox, &format!("reader-{i}"), target, read).expect("reader")
        })
        .collect();
    for reader in &readers {
        reader.wait_until(HEAL_TIMEOUT, |o| o.content().is_some()).expect("reader reads the source");
    }

    assert_eq!(supervisor.http_get("/healthz").unwrap(), (200, "ok\n".to_owned()));
    assert_eq!(supervisor.http_get("/readyz").unwrap(), (200, "ok\n".to_owned()));
    assert_eq!(supervisor.http_get("/nothing").unwrap().0, 404);
    assert_eq!(metric(&supervisor, r#"fuse_supervisor_targets{state="healthy"}"#), 3.0);
    assert_eq!(metric(&supervisor, "fuse_supervisor_sources"), 1.0);
    assert_eq!(metric(&supervisor, r#"fuse_supervisor_heals_total{result="stacked"}"#), 0.0);
    let (_, text) = supervisor.http_get("/metrics").unwrap();
    assert!(text.ends_with("# EOF\n"), "not an OpenMetrics exposition:\n{text}");
    let baseline = sandbox.count_mounts_under(sandbox.root());

    source.crash().unwrap();
    readers[0].wait_until(HEAL_TIMEOUT, |o| o.error().is_some()).expect("reader sees the crash");
    source.restart(&sandbox, Restart::UnmountThenMount).unwrap();
    let expected = source.expected_content();
    readers[0].wait_until(HEAL_TIMEOUT, |o| o.content() == Some(expected.as_str())).expect("heals");
    for (target, _) in &targets {
        scenario::wait_for("one layer", HEAL_TIMEOUT, || layers_at(&sandbox, target) == 1).unwrap();
    }
    scenario::wait_for("the baseline mount count", HEAL_TIMEOUT, || {
        sandbox.count_mounts_under(sandbox.root()) == baseline
    })
    .unwrap();
    let healed = |supervisor: &SupervisorProcess| {
        metric(supervisor, r#"fuse_supervisor_heals_total{result="stacked"}"#)
            + metric(supervisor, r#"fuse_supervisor_heals_total{result="propagated"}"#)
    };
    // The flatten is done; the report follows it on the loop thread.
    scenario::wait_for("three heals counted", HEAL_TIMEOUT, || healed(&supervisor) == 3.0).unwrap();
    assert!(metric(&supervisor, r#"fuse_supervisor_heals_total{result="stacked"}"#) >= 1.0);
    assert_eq!(metric(&supervisor, r#"fuse_supervisor_heals_total{result="failed"}"#), 0.0);
    assert_eq!(metric(&supervisor, "fuse_supervisor_targets_broken_total"), 3.0);
    assert_eq!(metric(&supervisor, "fuse_supervisor_heal_latency_seconds_count"), 3.0);
    assert!(metric(&supervisor, "fuse_supervisor_heal_latency_seconds_sum") > 0.0);
    assert_eq!(metric(&supervisor, "fuse_supervisor_heal_outage_seconds_count"), 3.0);
    // Each target had one stale layer under it; none is left.
    assert_eq!(metric(&supervisor, "fuse_supervisor_stale_layers_removed_total"), 3.0);
    scenario::wait_for("every target healthy again", HEAL_TIMEOUT, || {
        metric(&supervisor, r#"fuse_supervisor_targets{state="healthy"}"#) == 3.0
    })
    .unwrap();
    for state in ["broken", "healing", "failed"] {
        assert_eq!(metric(&supervisor, &format!("fuse_supervisor_targets{{state=\"{state}\"}}")), 0.0, "{state}");
    }
    assert!(metric(&supervisor, "fuse_supervisor_mount_table_events_total") >= 2.0, "unmount and mount unseen");
    assert!(metric(&supervisor, "fuse_supervisor_scans_total") >= 2.0);
    assert_eq!(supervisor.http_get("/healthz").unwrap(), (200, "ok\n".to_owned()));
}

#[test]
fn metrics_off_serves_nothing() {
    let sandbox = Sandbox::new().expect("sandbox");
    let supervisor = SupervisorProcess::start_with(
        &sandbox,
        binary(),
        &sandbox.root().join("state"),
        ["--kubelet", "none", "--metrics-addr", "off"],
    )
    .expect("supervisor");
    assert_eq!(supervisor.metrics_addr(), None);
    supervisor.wait_for_log(HEAL_TIMEOUT, |line| line.contains("metrics and health endpoints are off")).unwrap();
}

/// A state file that cannot be written (its temporary file's name is taken
/// by a directory, which stops root too): healing goes on, the error is
/// logged once, not at every save, and `/readyz` shows it until a save
/// works again.
#[test]
fn a_state_file_that_cannot_be_written_is_reported_once_and_by_readyz() {
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::Bindfs, "shared-data").expect("start bindfs");
    let target = source.bind_volume(&sandbox, "pod-0", "data").expect("bind");
    let state_dir = sandbox.root().join("state");
    let blocker = state_dir.join("state.json.tmp");
    let dir = blocker.clone();
    sandbox.run(move || std::fs::create_dir_all(dir)).expect("block the temporary file");
    let supervisor = SupervisorProcess::start(&sandbox, binary(), &state_dir).expect("supervisor");
    let _dump = DumpOnPanic(&supervisor);
    let reader = ContainerReader::spawn(&sandbox, "reader", &target, Path::new(DATA_FILE)).expect("reader");
    let crash_and_heal = |source: &mut FuseSource| {
        source.crash().unwrap();
        reader.wait_until(HEAL_TIMEOUT, |o| o.error().is_some()).expect("reader sees the crash");
        source.restart(&sandbox, Restart::UnmountThenMount).unwrap();
        let expected = source.expected_content();
        reader.wait_until(HEAL_TIMEOUT, |o| o.content() == Some(expected.as_str())).expect("heals");
    };

    crash_and_heal(&mut source);
    supervisor
        .wait_for_lines(HEAL_TIMEOUT, 0, 1, |line| line.contains("state still cannot be saved"))
        .expect("a later save fails too");
    let errors: Vec<String> = supervisor.log().into_iter().filter(|line| line.contains("cannot save state")).collect();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(errors[0].contains("state.json") && errors[0].contains("Is a directory"), "{}", errors[0]);
    let (status, body) = supervisor.http_get("/readyz").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ok\n") && body.contains("state.json") && body.contains("Is a directory"), "{body}");

    let dir = blocker.clone();
    sandbox.run(move || std::fs::remove_dir(dir)).expect("unblock");
    crash_and_heal(&mut source);
    supervisor.wait_for_log(HEAL_TIMEOUT, |line| line.contains("state saved again")).expect("saved");
    assert_eq!(supervisor.http_get("/readyz").unwrap(), (200, "ok\n".to_owned()));
}

/// How often a slow client sends the next byte of its request head: well
/// within the 5 s the server once allowed per read, so only a deadline on
/// the whole head ends it.
const SLOW_BYTE: Duration = Duration::from_secs(2);
/// How many times each slow client is closed and comes back.
const SLOW_ROUNDS: usize = 3;
/// A head that never ends.
const SLOW_HEAD: &[u8] =
    b"GET /metrics HTTP/1.1\r\nHost: node\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// A connection to `addr` from `peer` (any of 127.0.0.0/8).
fn connect_from(peer: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&SocketAddr::from((peer, 0)).into()).unwrap();
    socket.connect(&addr.into()).unwrap();
    socket.into()
}

/// A slow-loris client: from `peer`, one byte of a head every
/// [`SLOW_BYTE`]; when the server closes the connection, a new one, for
/// [`SLOW_ROUNDS`] closes. False if a connection outlived `patience`.
fn slow_client(addr: SocketAddr, peer: Ipv4Addr, patience: Duration) -> bool {
    for _ in 0..SLOW_ROUNDS {
        let mut stream = connect_from(peer, addr);
        // The read's timeout paces the bytes and sees the close at once.
        stream.set_read_timeout(Some(SLOW_BYTE)).unwrap();
        let opened = std::time::Instant::now();
        let closed = SLOW_HEAD.iter().any(|byte| {
            if stream.write_all(std::slice::from_ref(byte)).is_err() {
                return true;
            }
            // An unfinished head gets no answer: any read that ends is the close.
            match stream.read(&mut [0u8; 512]) {
                Ok(read) => read == 0,
                Err(err) => !matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
            }
        });
        if !closed || opened.elapsed() > patience {
            return false;
        }
    }
    true
}

/// Slow-loris attacks on the metrics port of a real `fuse-supervisor run`:
/// 16 and 64 connections from the probes' own address (a host-network pod
/// shares the kubelet's), then 64 from eight other addresses, each sending
/// a byte of a head every 2 s and coming back whenever it is closed. Every
/// `GET /healthz` meanwhile answers 200, and every slow connection is
/// closed by the server. Then a flood of complete `/healthz` requests,
/// which does not starve the probe either.
#[test]
fn neither_slow_heads_nor_a_flood_starve_healthz_and_slow_heads_are_closed() {
    let sandbox = Sandbox::new().expect("sandbox");
    let supervisor = SupervisorProcess::start(&sandbox, binary(), &sandbox.root().join("state")).expect("supervisor");
    let _dump = DumpOnPanic(&supervisor);
    let addr = supervisor.metrics_addr().expect("metrics are served");
    // Generous: the head deadline is a few seconds.
    let patience = Duration::from_secs(30);
    for (connections, peers) in [(16u8, 0u8), (64, 0), (64, 8)] {
        let peer = move |i: u8| if peers == 0 { Ipv4Addr::LOCALHOST } else { Ipv4Addr::new(127, 0, 0, 2 + i % peers) };
        let attackers: Vec<_> = (0..connections)
            .map(|i| (peer(i), std::thread::spawn(move || slow_client(addr, peer(i), patience))))
            .collect();
        let mut probes = Vec::new();
        loop {
            probes.push(supervisor.http_get("/healthz").map(|(status, _)| status).map_err(|err| err.to_string()));
            if attackers.iter().all(|(_, attacker)| attacker.is_finished()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let failed: Vec<_> = probes.iter().filter(|probe| **probe != Ok(200)).collect();
        assert!(failed.is_empty(), "{connections} slow connections from {peers} peers: {failed:?} of {}", probes.len());
        assert!(probes.len() >= 10, "the attack was over before it was probed: {probes:?}");
        for (peer, attacker) in attackers {
            assert!(attacker.join().unwrap(), "a slow connection from {peer} was not closed within {patience:?}");
        }
    }
    // A flood of complete `/healthz` requests, back to back on 8
    // connections: the probe still gets its 200 every time.
    let stop = Arc::new(AtomicBool::new(false));
    let flooders: Vec<_> = (0..8)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut answered = 0;
                while !stop.load(Ordering::SeqCst) {
                    let mut stream = connect_from(Ipv4Addr::new(127, 0, 0, 2), addr);
                    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: node\r\n\r\n").unwrap();
                    let mut response = String::new();
                    stream.read_to_string(&mut response).unwrap();
                    answered += usize::from(response.starts_with("HTTP/1.1 200 "));
                }
                answered
            })
        })
        .collect();
    let probes: Vec<_> = (0..50)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            supervisor.http_get("/healthz").map(|(status, _)| status).map_err(|err| err.to_string())
        })
        .collect();
    stop.store(true, Ordering::SeqCst);
    let flooded: usize = flooders.into_iter().map(|flooder| flooder.join().unwrap()).sum();
    assert!(probes.iter().all(|probe| *probe == Ok(200)), "during a flood: {probes:?}");
    assert!(flooded > probes.len(), "the flood was no flood: {flooded} answers");

    let log = supervisor.log();
    assert!(log.iter().any(|line| line.contains("request head not complete in time")), "no head met its deadline");
    assert!(log.iter().any(|line| line.contains("request head closed to make room")), "no head made room");
}
