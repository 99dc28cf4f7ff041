//! The test side of a container-model process: spawn it in a sandbox and keep
//! the history of what it saw.
use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuse_supervisor_sys::mount::Propagation;

use super::container::{ContainerOptions, unescape};
use super::{Sandbox, SandboxChild, TestbedError};

/// How long [`ContainerReader::spawn`] waits for the first observation.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What a container reader saw once (it reports only changes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// When the container saw it (its clock, which is the test's).
    pub at: SystemTime,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The file was read and the volume listed.
    Ok { content: String, entries: Vec<String> },
    /// The errno name of the first failure, e.g. `ENOTCONN`.
    Err(String),
}

impl Observation {
    /// The file content, if this was a successful read.
    pub fn content(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Ok { content, .. } => Some(content),
            Outcome::Err(_) => None,
        }
    }

    /// The volume's entry names (sorted), if this was a successful read.
    pub fn entries(&self) -> Option<&[String]> {
        match &self.outcome {
            Outcome::Ok { entries, .. } => Some(entries),
            Outcome::Err(_) => None,
        }
    }

    /// The errno name, if this was a failure.
    pub fn error(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Err(errno) => Some(errno),
            Outcome::Ok { .. } => None,
        }
    }

    /// Parses one line of the container's output (format in [`super::container`]).
    pub fn parse(line: &str) -> Option<Self> {
        let (nanos, rest) = line.split_once(' ')?;
        let at = UNIX_EPOCH + Duration::from_nanos(u64::try_from(nanos.parse::<u128>().ok()?).ok()?);
        let outcome = if let Some(errno) = rest.strip_prefix("err ") {
            Outcome::Err(errno.to_string())
        } else {
            let (content, entries) = rest.strip_prefix("ok ")?.rsplit_once(" |")?;
            let entries = entries.trim_start();
            Outcome::Ok {
                content: unescape(content),
                entries: if entries.is_empty() { Vec::new() } else { entries.split(',').map(unescape).collect() },
            }
        };
        Some(Self { at, outcome })
    }
}

#[derive(Default)]
struct History {
    observations: Vec<Observation>,
    exited: bool,
    /// Lines that were not observations (a bug, shown in failures).
    garbage: Vec<String>,
}

/// What a reading process reported so far, shared between the thread that
/// collects its output and the test that waits on it: the container model's
/// and a runc container's.
#[derive(Clone, Default)]
pub(super) struct Readings(Arc<(Mutex<History>, Condvar)>);

/// Why [`Readings::wait_until`] gave up, with the history described.
pub(super) enum GaveUp {
    Exited(String),
    Timeout(String),
}

impl Readings {
    /// Collects `output`, a line an observation, until it ends.
    pub(super) fn collect(&self, output: impl std::io::Read, mut line_of: impl FnMut(String) -> Option<String>) {
        let (lock, changed) = &*self.0;
        for line in BufReader::new(output).lines() {
            let Ok(line) = line else { break };
            let Some(line) = line_of(line) else { continue };
            let mut history = lock.lock().unwrap_or_else(PoisonError::into_inner);
            match Observation::parse(&line) {
                Some(observation) => history.observations.push(observation),
                None => history.garbage.push(line),
            }
            changed.notify_all();
        }
        lock.lock().unwrap_or_else(PoisonError::into_inner).exited = true;
        changed.notify_all();
    }

    /// Waits until the **latest** observation satisfies `pred` and returns it.
    pub(super) fn wait_until(
        &self,
        timeout: Duration,
        pred: impl Fn(&Observation) -> bool,
    ) -> Result<Observation, GaveUp> {
        let (lock, changed) = &*self.0;
        let deadline = Instant::now() + timeout;
        let mut history = lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(latest) = history.observations.last().filter(|latest| pred(latest)) {
                return Ok(latest.clone());
            }
            if history.exited {
                return Err(GaveUp::Exited(describe(&history)));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(GaveUp::Timeout(describe(&history)));
            }
            history = changed.wait_timeout(history, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    pub(super) fn observations(&self) -> Vec<Observation> {
        self.0.0.lock().unwrap_or_else(PoisonError::into_inner).observations.clone()
    }

    pub(super) fn latest(&self) -> Option<Observation> {
        self.0.0.lock().unwrap_or_else(PoisonError::into_inner).observations.last().cloned()
    }

    /// The history, one observation a line, for failure messages.
    pub(super) fn describe(&self) -> String {
        describe(&self.0.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A running container-model process and what it has seen so far.
pub struct ContainerReader {
    name: String,
    child: SandboxChild,
    history: Readings,
}

impl ContainerReader {
    /// Starts the test world's `container` program in `sandbox` on `volume`, with
    /// rootfs `containers/<name>/rootfs`, hiding the kubelet and runtime
    /// trees, reading `read` (relative to the volume) every 2 ms. Returns once
    /// the container has made its namespace and reported a first observation.
    pub fn spawn(sandbox: &Sandbox, name: &str, volume: &Path, read: &Path) -> Result<Self, TestbedError> {
        let rootfs = sandbox
            .container_rootfs(name)
            .map_err(|source| TestbedError::Setup { step: format!("create rootfs of container {name}"), source })?;
        let options = ContainerOptions {
            volume: volume.to_path_buf(),
            rootfs,
            hide: vec![sandbox.kubelet_root(), sandbox.runtime_root()],
            read: read.to_path_buf(),
            interval: Duration::from_millis(2),
            propagation: Propagation::Slave,
            wake_on_mount_change: false,
        };
        Self::spawn_with(sandbox, name, &options)
    }

    /// Like [`ContainerReader::spawn`] with every option given.
    pub fn spawn_with(sandbox: &Sandbox, name: &str, options: &ContainerOptions) -> Result<Self, TestbedError> {
        Self::spawn_wrapped(sandbox, &[], name, options)
    }

    /// Like [`ContainerReader::spawn_with`], started through `wrapper`
    /// (e.g. `nsenter --pid=… --mount=… --`: a container made from another
    /// container's namespace, in a pod's pid namespace).
    pub fn spawn_wrapped(
        sandbox: &Sandbox,
        wrapper: &[OsString],
        name: &str,
        options: &ContainerOptions,
    ) -> Result<Self, TestbedError> {
        let binary = crate::programs_binary()
            .map_err(|source| TestbedError::Setup { step: "find the test world's programs".into(), source })?;
        let mut command = wrapped(wrapper, &binary);
        command.args(["container", "--volume"]).arg(&options.volume).arg("--rootfs").arg(&options.rootfs);
        for hidden in &options.hide {
            command.arg("--hide").arg(hidden);
        }
        command
            .arg("--read")
            .arg(&options.read)
            .arg("--interval-ms")
            .arg(options.interval.as_millis().to_string())
            .args((options.propagation == Propagation::Private).then_some("--private"))
            .args(options.wake_on_mount_change.then_some("--wake-on-mount-change"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = sandbox
            .spawn(command)
            .map_err(|source| TestbedError::Spawn { program: binary.display().to_string(), source })?;
        let stdout = child.take_stdout().ok_or_else(|| TestbedError::NoStdout { name: name.to_string() })?;
        let history = Readings::default();
        let collector = history.clone();
        std::thread::Builder::new()
            .name(format!("reader-{name}"))
            .spawn(move || collector.collect(stdout, Some))
            .map_err(|source| TestbedError::Setup { step: format!("start output thread of {name}"), source })?;
        let reader = Self { name: name.to_string(), child, history };
        reader.wait_until(STARTUP_TIMEOUT, |_| true)?;
        Ok(reader)
    }

    /// Waits until the **latest** observation satisfies `pred` and returns it.
    /// Fails with the whole history when `timeout` passes or the process exits.
    pub fn wait_until(
        &self,
        timeout: Duration,
        pred: impl Fn(&Observation) -> bool,
    ) -> Result<Observation, TestbedError> {
        self.history.wait_until(timeout, pred).map_err(|gave_up| match gave_up {
            GaveUp::Exited(history) => TestbedError::ReaderExited { name: self.name.clone(), history },
            GaveUp::Timeout(history) => TestbedError::Timeout { name: self.name.clone(), waited: timeout, history },
        })
    }

    /// Every observation so far, oldest first.
    pub fn history(&self) -> Vec<Observation> {
        self.history.observations()
    }

    /// The most recent observation.
    pub fn latest(&self) -> Option<Observation> {
        self.history.latest()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The container process (to signal or kill it).
    pub fn child(&self) -> &SandboxChild {
        &self.child
    }

    /// Where the container mounts the volume, inside its own namespace.
    pub fn volume_in_container(options: &ContainerOptions) -> PathBuf {
        options.rootfs.join("volume")
    }
}

impl Drop for ContainerReader {
    fn drop(&mut self) {
        // Already dead or reaped by the sandbox: fine either way.
        let _ = self.child.kill();
    }
}

impl std::fmt::Debug for ContainerReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerReader").field("name", &self.name).field("child", &self.child).finish()
    }
}

fn describe(history: &History) -> String {
    let mut text = String::new();
    let start = history.observations.first().map_or(UNIX_EPOCH, |first| first.at);
    for observation in &history.observations {
        let offset = observation.at.duration_since(start).unwrap_or_default();
        // Writing to a String cannot fail.
        let _ = writeln!(text, "  +{offset:?} {:?}", observation.outcome);
    }
    for line in &history.garbage {
        let _ = writeln!(text, "  unparsed: {line}");
    }
    if history.exited {
        text.push_str("  (exited)\n");
    }
    text
}

/// `binary` run through `wrapper` (its first element is the program), or
/// directly if `wrapper` is empty.
pub(crate) fn wrapped(wrapper: &[OsString], binary: &Path) -> Command {
    match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(binary);
            command
        }
        None => Command::new(binary),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ok_and_err_lines() {
        let ok = Observation::parse("1700000000000000001 ok v1\\x0a | a,b\\x2cc").unwrap();
        assert_eq!(ok.content(), Some("v1\n"));
        assert_eq!(ok.entries().unwrap(), ["a", "b,c"]);
        let empty = Observation::parse("5 ok  | ").unwrap();
        assert_eq!(empty.content(), Some(""));
        assert!(empty.entries().unwrap().is_empty());
        let err = Observation::parse("5 err ENOTCONN").unwrap();
        assert_eq!(err.error(), Some("ENOTCONN"));
        assert!(Observation::parse("garbage").is_none());
    }
}
