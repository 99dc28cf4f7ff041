//! The supervisor as a separate process in the sandbox: `fuse-supervisor
//! run`, its JSON log collected line by line, its metrics and health
//! endpoints asked over HTTP. A test that fails while it runs prints its
//! whole log (see its `Drop`), so every failure, also one met once in a
//! stress run, carries what the supervisor saw and did.
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use fuse_supervisor_sys::process::Signal;

use super::observe::{ScenarioError, http_get, io_step};
use super::{Sandbox, SandboxChild};

/// `fuse-supervisor run` in the sandbox, with its JSON log collected.
pub struct SupervisorProcess {
    process: SandboxChild,
    log: Arc<(Mutex<Vec<String>>, Condvar)>,
    /// Where its metrics and health endpoints listen, unless turned off.
    metrics_addr: Option<SocketAddr>,
}

impl SupervisorProcess {
    /// Starts it without kubelet confirmation (`--kubelet none`).
    pub fn start(sandbox: &Sandbox, binary: &Path, state_dir: &Path) -> Result<Self, ScenarioError> {
        Self::start_with(sandbox, binary, state_dir, ["--kubelet", "none"])
    }

    /// Starts it with extra `run` arguments. Unless they say otherwise,
    /// metrics listen on a free port of 127.0.0.1 (the sandbox shares the
    /// host's network, and tests run side by side), found in the log.
    pub fn start_with<I, S>(sandbox: &Sandbox, binary: &Path, state_dir: &Path, args: I) -> Result<Self, ScenarioError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        Self::start_wrapped(sandbox, &[], binary, state_dir, args)
    }

    /// Like [`SupervisorProcess::start_with`], started through `wrapper`
    /// (e.g. `nsenter --pid=… --`: in a pod's pid namespace).
    pub fn start_wrapped<I, S>(
        sandbox: &Sandbox,
        wrapper: &[OsString],
        binary: &Path,
        state_dir: &Path,
        args: I,
    ) -> Result<Self, ScenarioError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut supervisor = Self::spawn_wrapped(sandbox, wrapper, binary, state_dir, args)?;
        supervisor.wait_for_log(Duration::from_secs(10), |line| line.contains("\"supervising\""))?;
        // Logged before the loop starts, so before "supervising".
        supervisor.metrics_addr = supervisor.log().iter().find_map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).ok()?;
            let fields = value.get("fields")?;
            (fields.get("message")? == "serving metrics").then(|| fields.get("addr")?.as_str()?.parse().ok())?
        });
        Ok(supervisor)
    }

    /// Runs it as [`SupervisorProcess::start_wrapped`] would, expecting its
    /// start to fail: returns its log once it has exited, however long a
    /// loaded machine makes the start take (bounded by `timeout` only
    /// against a hang), and fails if it starts supervising instead.
    pub fn failed_start(
        (sandbox, wrapper): (&Sandbox, &[OsString]),
        (binary, state_dir): (&Path, &Path),
        args: &[&str],
        timeout: Duration,
    ) -> Result<Vec<String>, ScenarioError> {
        let supervisor = Self::spawn_wrapped(sandbox, wrapper, binary, state_dir, args)?;
        super::scenario::wait_for("the supervisor's exit", timeout, || {
            supervisor.try_wait().ok().flatten().is_some()
                || supervisor.log().iter().any(|line| line.contains("\"supervising\""))
        })?;
        let log = supervisor.log();
        if supervisor.try_wait()?.is_none() {
            return Err(ScenarioError::Io {
                step: "a start expected to fail".into(),
                source: io::Error::other(format!("it started supervising; its log:\n{}", log.join("\n"))),
            });
        }
        // Its last lines are in once the collector has read its stderr to
        // the end and let go of the log; a child still holding that pipe
        // would keep it open, and the lines read by then are what there is.
        let collected = Arc::clone(&supervisor.log);
        let _ = super::scenario::wait_for("the supervisor's log read to its end", timeout, || {
            Arc::strong_count(&collected) == 2
        });
        Ok(supervisor.log())
    }

    /// `fuse-supervisor run` started, its log being collected; not waited on.
    fn spawn_wrapped<I, S>(
        sandbox: &Sandbox,
        wrapper: &[OsString],
        binary: &Path,
        state_dir: &Path,
        args: I,
    ) -> Result<Self, ScenarioError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut args: Vec<OsString> = args.into_iter().map(|arg| arg.as_ref().to_owned()).collect();
        if !args.iter().any(|arg| arg.to_string_lossy().starts_with("--metrics-addr")) {
            args.extend(["--metrics-addr".into(), "127.0.0.1:0".into()]);
        }
        // Debug unless the caller chose (benchmarks measure at the default, info).
        if !args.iter().any(|arg| arg == "--log" || arg.to_string_lossy().starts_with("--log=")) {
            args.extend(["--log".into(), "debug".into()]);
        }
        let mut command = super::reader::wrapped(wrapper, binary);
        command
            .arg("run")
            .arg("--kubelet-root")
            .arg(sandbox.kubelet_root())
            .arg("--state-dir")
            .arg(state_dir)
            .arg("--staging-dir")
            .arg(sandbox.root().join("staging"))
            // The sandbox thread's namespace is the child's own.
            .args(["--mount-namespace", "/proc/self/ns/mnt", "--log-format", "json"])
            // Tests never talk to a cluster, even when run inside one (CI in a
            // pod has an in-cluster configuration); `--events on` overrides.
            .env("FUSE_SUPERVISOR_EVENTS", "off")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut process = sandbox.spawn(command).map_err(io_step("start the supervisor"))?;
        let stderr = process.take_stderr().ok_or_else(|| ScenarioError::Io {
            step: "supervisor stderr".into(),
            source: io::Error::other("no pipe"),
        })?;
        let log: Arc<(Mutex<Vec<String>>, Condvar)> = Arc::default();
        let collector = Arc::clone(&log);
        std::thread::Builder::new()
            .name("supervisor-log".into())
            .spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let (lines, changed) = &*collector;
                    lines.lock().unwrap_or_else(PoisonError::into_inner).push(line);
                    changed.notify_all();
                }
            })
            .map_err(io_step("start the supervisor log thread"))?;
        Ok(SupervisorProcess { process, log, metrics_addr: None })
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// `GET path` from its metrics server: the status and the body.
    pub fn http_get(&self, path: &str) -> Result<(u16, String), ScenarioError> {
        let addr = self.metrics_addr.ok_or_else(|| ScenarioError::Io {
            step: format!("GET {path}"),
            source: io::Error::other("the supervisor serves no metrics (--metrics-addr off?)"),
        })?;
        http_get(addr, path).map_err(io_step(format!("GET http://{addr}{path}")))
    }

    /// The value of one series in its `/metrics`, e.g.
    /// `fuse_supervisor_heals_total{result="stacked"}`; None if absent.
    pub fn metric(&self, series: &str) -> Result<Option<f64>, ScenarioError> {
        let (status, body) = self.http_get("/metrics")?;
        if status != 200 {
            return Err(ScenarioError::Io {
                step: "GET /metrics".into(),
                source: io::Error::other(format!("HTTP {status}: {body}")),
            });
        }
        Ok(crate::series_value(&body, series))
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Every log line so far.
    pub fn log(&self) -> Vec<String> {
        self.log.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// How many lines it has logged so far.
    pub fn log_len(&self) -> usize {
        self.log.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Waits until `count` lines from line `from` on match `pred`. Sleeps
    /// until lines arrive and copies none: a harness waiting for a heal's
    /// log must not compete with the heal for the CPU.
    pub fn wait_for_lines(
        &self,
        timeout: Duration,
        from: usize,
        count: usize,
        pred: impl Fn(&str) -> bool,
    ) -> Result<(), ScenarioError> {
        let deadline = Instant::now() + timeout;
        let (lines, changed) = &*self.log;
        let mut guard = lines.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut seen, mut matched) = (from, 0);
        loop {
            matched += guard.get(seen..).unwrap_or_default().iter().filter(|line| pred(line)).count();
            seen = guard.len().max(from);
            if matched >= count {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ScenarioError::Timeout {
                    what: format!("{count} matching supervisor log lines ({matched} seen)"),
                    waited: timeout,
                });
            }
            guard = changed.wait_timeout(guard, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Waits for a log line matching `pred` and returns it.
    pub fn wait_for_log(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Result<String, ScenarioError> {
        let deadline = Instant::now() + timeout;
        let (lines, changed) = &*self.log;
        let mut guard = lines.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(line) = guard.iter().find(|line| pred(line)) {
                return Ok(line.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ScenarioError::Timeout {
                    what: format!("supervisor log line; log so far:\n{}", guard.join("\n")),
                    waited: timeout,
                });
            }
            guard = changed.wait_timeout(guard, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Waits until it watches the FUSE daemon `pid`: that daemon's death
    /// will be seen (and the containers' dead mounts isolated) before its
    /// new mount.
    pub fn wait_watching_daemon(&self, pid: u32, timeout: Duration) -> Result<String, ScenarioError> {
        let daemon = format!("[{pid}]");
        self.wait_for_log(timeout, |line| line.contains("\"watching the FUSE daemon\"") && line.contains(&daemon))
    }

    /// Waits until it has learnt the mount namespace of process `pid` (a
    /// container's): a copy of a volume there is healed at the next death
    /// only if it was (`docs/limits.md`, namespaces not learnt), and under
    /// load the learning can lag a container's start by a second.
    pub fn wait_namespace_learnt(&self, pid: u32, timeout: Duration) -> Result<String, ScenarioError> {
        let pid = format!("\"pid\":{pid},");
        self.wait_for_log(timeout, |line| line.contains("\"mount namespace learnt\"") && line.contains(&pid))
    }

    /// Waits until it has seen the death of daemon `pid` and detached a
    /// dead source from its path `detaches` times in all (counted: device
    /// numbers are reused from one crash to the next). A restart over the
    /// stale mount must wait for both (`tests/containers.rs` says why).
    pub fn wait_death_detached(&self, pid: u32, detaches: usize, timeout: Duration) -> Result<(), ScenarioError> {
        let pid = format!("\"pid\":{pid},");
        let died = |line: &str| line.contains("\"daemon died; its targets are degraded\"") && line.contains(&pid);
        self.wait_for_log(timeout, died)?;
        let detached = || self.log().iter().filter(|line| line.contains("\"message\":\"dead source detached")).count();
        super::scenario::wait_for("the dead source detached", timeout, || detached() >= detaches)
    }

    /// Its exit status, if it has exited (reaped then).
    pub fn try_wait(&self) -> Result<Option<std::process::ExitStatus>, ScenarioError> {
        self.process.try_wait().map_err(io_step("check the supervisor's exit"))
    }

    /// SIGKILL and reap: a crash of the supervisor itself.
    pub fn kill(self) -> Result<std::process::ExitStatus, ScenarioError> {
        self.process.kill().map_err(io_step("kill the supervisor"))
    }

    /// SIGTERM, and its exit status once it has exited, within `timeout`
    /// (a process a FUSE request holds cannot exit: it fails then, and the
    /// process is left to the sandbox's end).
    pub fn terminate_within(&self, timeout: Duration) -> Result<std::process::ExitStatus, ScenarioError> {
        self.process.signal(Signal::Term).map_err(io_step("signal the supervisor"))?;
        let mut status = None;
        super::scenario::wait_for("the supervisor's exit after SIGTERM", timeout, || {
            status = self.process.try_wait().ok().flatten();
            status.is_some()
        })?;
        status.ok_or_else(|| io_step("wait for the supervisor")(std::io::Error::other("no exit status")))
    }

    /// SIGTERM and wait: a clean shutdown.
    pub fn stop(self) -> Result<std::process::ExitStatus, ScenarioError> {
        self.process.signal(Signal::Term).map_err(io_step("signal the supervisor"))?;
        self.process.wait().map_err(io_step("wait for the supervisor"))
    }
}

impl Drop for SupervisorProcess {
    /// On a failing test (a panic unwinding through its owner), prints the
    /// log, then where each of its threads and its children's is in the
    /// kernel: libtest keeps both with the test's output. A heal that
    /// waited past a test's deadline shows there what it waited for.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("supervisor log (pid {}):\n{}", self.pid(), self.log().join("\n"));
            eprintln!("supervisor threads at the failure:\n{}", threads_in_the_kernel(Path::new("/proc"), self.pid()));
        }
    }
}

/// Each thread of `pid` and of its children: name, state and kernel stack
/// (`/proc/<pid>/task/<tid>/stack`, root only). Best effort: a thread gone
/// meanwhile, or a stack that cannot be read, is said so in its place.
fn threads_in_the_kernel(proc_root: &Path, pid: u32) -> String {
    let mut out = String::new();
    let mut processes = vec![pid];
    let mut index = 0;
    while let Some(&process) = processes.get(index) {
        index += 1;
        let tasks = proc_root.join(process.to_string()).join("task");
        let Ok(entries) = std::fs::read_dir(&tasks) else {
            out.push_str(&format!("  process {process}: gone\n"));
            continue;
        };
        let mut tids: Vec<u32> = entries
            .flatten()
            .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse().ok()))
            .collect();
        tids.sort_unstable();
        if tids.is_empty() {
            out.push_str(&format!("  process {process}: exited, not reaped\n"));
        }
        for tid in tids {
            let task = tasks.join(tid.to_string());
            let read = |name: &str| std::fs::read_to_string(task.join(name)).unwrap_or_default();
            let state = super::node::state_in_stat(&read("stat")).unwrap_or('?');
            let stack = std::fs::read_to_string(task.join("stack"))
                .map(|stack| {
                    stack.lines().map(|frame| frame.split(' ').nth(1).unwrap_or(frame)).collect::<Vec<_>>().join(" < ")
                })
                .unwrap_or_else(|err| format!("(stack unreadable: {err})"));
            out.push_str(&format!("  {process}/{tid} {} {state}: {stack}\n", read("comm").trim_end()));
            // A child is listed by the thread that made it.
            processes.extend(read("children").split_whitespace().filter_map(|child| child.parse::<u32>().ok()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_and_child_is_described_with_its_kernel_stack() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let stat = format!("/proc/{}/stat", child.id());
        let asleep = || std::fs::read_to_string(&stat).is_ok_and(|stat| stat.contains("(sleep) S "));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !asleep() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let described = threads_in_the_kernel(Path::new("/proc"), std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        let own = std::process::id();
        assert!(described.contains(&format!("  {own}/{own} ")), "{described}");
        let sleeping = format!("  {}/{} sleep S: ", child.id(), child.id());
        let line = described.lines().find(|line| line.starts_with(&sleeping)).unwrap_or_else(|| panic!("{described}"));
        // Root reads kernel stacks: a sleep waits in a nanosleep.
        assert!(line.contains("nanosleep"), "{line}");
    }
}
