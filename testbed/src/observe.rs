//! Looking at a scenario from outside: the mounts at a path, waiting for
//! the table or a condition, an HTTP GET of the supervisor's endpoints.
use std::collections::HashSet;
use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use fuse_supervisor_sys::mountinfo_poll::priority_pending;
use fuse_supervisor_sys::poll::Poller;

use super::Sandbox;

/// A step of a scenario or of looking at one that failed, and how.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("{step}")]
    Io {
        step: String,
        #[source]
        source: io::Error,
    },
    #[error("{what} did not happen within {waited:?}")]
    Timeout { what: String, waited: Duration },
    #[error("{daemon} cannot mount over a stale mount (it stats the mount point first)")]
    CannotMountOverStale { daemon: &'static str },
    #[error("{daemon} exited before it mounted, {status}")]
    DaemonExited { daemon: &'static str, status: std::process::ExitStatus },
}

pub(super) fn io_step(step: impl Into<String>) -> impl FnOnce(io::Error) -> ScenarioError {
    let step = step.into();
    move |source| ScenarioError::Io { step, source }
}

/// IDs of the FUSE mounts at `path` in the sandbox.
pub fn fuse_mount_ids_at(sandbox: &Sandbox, path: &Path) -> HashSet<u32> {
    fuse_mount_ids_in(&sandbox.mountinfo(), path)
}

fn fuse_mount_ids_in(table: &str, path: &Path) -> HashSet<u32> {
    let Ok(snapshot) = fuse_supervisor_engine::model::table::Snapshot::parse(table.as_bytes()) else {
        return HashSet::new();
    };
    snapshot.fuse_mounts.iter().filter(|m| m.mount_point == path).map(|m| m.mount_id).collect()
}

/// The FUSE connections mounted at `path`.
pub(super) fn fuse_connections_in(table: &str, path: &Path) -> HashSet<fuse_supervisor_engine::model::table::Dev> {
    let Ok(snapshot) = fuse_supervisor_engine::model::table::Snapshot::parse(table.as_bytes()) else {
        return HashSet::new();
    };
    snapshot.fuse_mounts.iter().filter(|m| m.mount_point == path).map(|m| m.dev).collect()
}

/// Waits until `done` accepts the sandbox's mount table, reading it once
/// now and then once per change notification, never on a timer: a poll
/// every few milliseconds would read the table (under the namespace lock)
/// in the middle of the heal that the latency harness measures.
pub fn wait_for_table(
    sandbox: &Sandbox,
    what: &str,
    timeout: Duration,
    mut done: impl FnMut(&str) -> bool,
) -> Result<(), ScenarioError> {
    let mountinfo = sandbox.mountinfo_path();
    let step = || io_step(format!("watch {}", mountinfo.display()));
    let mut file = fs::File::open(&mountinfo).map_err(step())?;
    let poller = Poller::new().map_err(step())?;
    poller.add_priority(file.as_fd(), 0).map_err(step())?;
    let deadline = Instant::now() + timeout;
    let (mut table, mut events) = (String::new(), Vec::with_capacity(1));
    loop {
        // Consumed before the read: a change after it wakes the wait.
        priority_pending(file.as_fd()).map_err(step())?;
        table.clear();
        file.seek(SeekFrom::Start(0)).and_then(|_| file.read_to_string(&mut table)).map_err(step())?;
        if done(&table) {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ScenarioError::Timeout { what: what.to_owned(), waited: timeout });
        }
        poller.wait(&mut events, Some(left)).map_err(step())?;
    }
}

/// Number of FUSE layers stacked at `path` in the sandbox.
pub fn layers_at(sandbox: &Sandbox, path: &Path) -> usize {
    fuse_mount_ids_at(sandbox, path).len()
}

/// One HTTP/1.1 GET with `Connection: close`: the status and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    // In one write, so in one segment, as the kubelet's and Prometheus's
    // clients send theirs: `write!` on the stream writes each piece of the
    // format alone, and a head that arrives in pieces holds a place in the
    // server's table of slow heads (where 64 slow clients from the same
    // address pushed one out, once, on a loaded machine).
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, format!("not an HTTP response: {response:?}"));
    let (head, body) = response.split_once("\r\n\r\n").ok_or_else(malformed)?;
    let status = head.split(' ').nth(1).and_then(|code| code.parse().ok()).ok_or_else(malformed)?;
    Ok((status, body.to_owned()))
}

/// Polls `done` every few milliseconds; test-side only, never in the supervisor.
pub fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Result<(), ScenarioError> {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() >= deadline {
            return Err(ScenarioError::Timeout { what: what.to_owned(), waited: timeout });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// The value of one series in an exposition, e.g.
/// `fuse_supervisor_heals_total{result="stacked"}`.
pub fn series_value(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.split(' ').next()?.parse().ok())
}

/// Whether a unix socket bound at `path` listens: `/proc/net/unix` flags it
/// `__SO_ACCEPTCON` (a sandbox shares this process's network namespace).
/// Not whether the socket file exists: it appears at bind(), and
/// connections are refused until listen().
pub fn unix_socket_listens(path: &Path) -> bool {
    const ACCEPTING: u32 = 0x0001_0000;
    let Ok(table) = fs::read_to_string("/proc/net/unix") else { return false };
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let flags = fields.get(3).and_then(|flags| u32::from_str_radix(flags, 16).ok()).unwrap_or(0);
        fields.get(7).is_some_and(|bound| Path::new(bound) == path) && flags & ACCEPTING != 0
    })
}
