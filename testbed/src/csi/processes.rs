//! The CSI node plugin and the CSI proxy as processes of a sandbox.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use fuse_supervisor_sys::process::Signal;

use super::{CsiClient, CsiError, io_step};
use crate::{Sandbox, SandboxChild};

/// How long a plugin or proxy may take to serve its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);
const START_POLL: Duration = Duration::from_millis(10);

/// Which driver the `csi-plugin` program plays (see [`super::plugin`]).
#[derive(Debug, Clone, Default)]
pub struct PluginFlags {
    /// Without `STAGE_UNSTAGE_VOLUME`: its daemons mount at the targets.
    pub publish_only: bool,
    /// `NodeStageVolume` answers OK when `/proc/mounts` lists the path.
    pub trust_proc_mounts: bool,
    /// Where each Node call is logged (a sandbox path).
    pub call_log: Option<PathBuf>,
    /// `NodeStageVolume` never answers.
    pub hang_stage: bool,
}

impl PluginFlags {
    fn args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.publish_only {
            args.push("--no-stage-unstage".into());
        }
        if self.trust_proc_mounts {
            args.push("--trust-proc-mounts".into());
        }
        if let Some(call_log) = &self.call_log {
            args.extend(["--call-log".into(), call_log.display().to_string()]);
        }
        if self.hang_stage {
            args.push("--hang-stage".into());
        }
        args
    }
}

/// The test world's `csi-plugin` program serving a socket in the sandbox.
pub struct CsiPluginProcess {
    name: String,
    flags: PluginFlags,
    socket: PathBuf,
    outside_socket: PathBuf,
    process: Option<SandboxChild>,
}

impl CsiPluginProcess {
    /// Starts the plugin named `name` on `socket` (a sandbox path) and
    /// returns once its socket answers `Probe`.
    pub fn start(
        sandbox: &Sandbox,
        socket: &Path,
        name: &str,
        flags: PluginFlags,
    ) -> Result<CsiPluginProcess, CsiError> {
        let mut plugin = CsiPluginProcess {
            name: name.into(),
            flags,
            socket: socket.to_path_buf(),
            outside_socket: sandbox.outside_path(socket),
            process: None,
        };
        plugin.launch(sandbox)?;
        Ok(plugin)
    }

    pub fn flags(&self) -> &PluginFlags {
        &self.flags
    }

    /// The socket as the sandbox's processes see it.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The socket as this process sees it.
    pub fn outside_socket(&self) -> &Path {
        &self.outside_socket
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(SandboxChild::pid)
    }

    /// The plugin's child processes (its daemons and their helpers).
    pub fn children(&self) -> Vec<u32> {
        self.pid().map(children_of).unwrap_or_default()
    }

    /// `SIGKILL`, as an OOM kill or a container's end does; returns once
    /// the plugin is reaped.
    pub fn kill(&mut self) -> Result<(), CsiError> {
        if let Some(process) = self.process.take() {
            process.kill().map_err(io_step("kill the CSI plugin"))?;
        }
        Ok(())
    }

    /// Starts it again with the same flags, as a restarted container.
    pub fn restart(&mut self, sandbox: &Sandbox) -> Result<(), CsiError> {
        self.kill()?;
        self.launch(sandbox)
    }

    /// Starts it again as another driver (one that hangs now).
    pub fn restart_with(&mut self, sandbox: &Sandbox, flags: PluginFlags) -> Result<(), CsiError> {
        self.flags = flags;
        self.restart(sandbox)
    }

    fn launch(&mut self, sandbox: &Sandbox) -> Result<(), CsiError> {
        let binary = crate::programs_binary().map_err(io_step("find the test world's programs"))?;
        let mut command = Command::new(binary);
        command.arg("csi-plugin").arg("--socket").arg(&self.socket).args(["--name", &self.name]);
        command.args(self.flags.args());
        let process = sandbox.spawn(command).map_err(io_step("start the CSI plugin"))?;
        let client = CsiClient::connect(&self.outside_socket)?;
        let answered = wait(START_TIMEOUT, || client.probe().is_ok() || process.try_wait().ok().flatten().is_some());
        if let Ok(Some(status)) = process.try_wait() {
            return Err(exited("the CSI plugin", status));
        }
        self.process = Some(process);
        answered.then_some(()).ok_or(CsiError::Timeout { what: "the CSI plugin's Probe".into(), waited: START_TIMEOUT })
    }
}

/// `fuse-supervisor csi-proxy` in the sandbox, its log in a file.
pub struct CsiProxyProcess {
    process: Option<SandboxChild>,
    listen: PathBuf,
    outside_listen: PathBuf,
    outside_log: PathBuf,
}

impl CsiProxyProcess {
    /// Starts the proxy from `listen` to `driver_socket`, recording in
    /// `record_dir` (sandbox paths), with the secrets or not; returns once
    /// it listens. It logs at debug level, so that a test of what its log
    /// leaves out sees every line it can write.
    pub fn start(
        sandbox: &Sandbox,
        binary: &Path,
        listen: &Path,
        driver_socket: &Path,
        record_dir: &Path,
        record_secrets: bool,
    ) -> Result<CsiProxyProcess, CsiError> {
        let log = sandbox.root().join(format!(
            "csi-proxy-{}.log",
            listen.file_stem().map(|stem| stem.to_string_lossy().into_owned()).unwrap_or_default()
        ));
        let outside_log = sandbox.outside_path(&log);
        let log_file = fs::File::create(&outside_log).map_err(io_step(format!("create {}", log.display())))?;
        let mut command = Command::new(binary);
        command.arg("csi-proxy").arg("--listen").arg(listen).arg("--driver-socket").arg(driver_socket);
        command.arg("--record-dir").arg(record_dir);
        command.args(["--record-secrets", if record_secrets { "on" } else { "off" }, "--log", "debug"]);
        command.stderr(log_file);
        let process = sandbox.spawn(command).map_err(io_step("start the CSI proxy"))?;
        let outside_listen = sandbox.outside_path(listen);
        let listening =
            wait(START_TIMEOUT, || crate::unix_socket_listens(listen) || process.try_wait().ok().flatten().is_some());
        if let Ok(Some(status)) = process.try_wait() {
            return Err(exited("the CSI proxy", status));
        }
        let proxy =
            CsiProxyProcess { process: Some(process), listen: listen.to_path_buf(), outside_listen, outside_log };
        listening
            .then_some(proxy)
            .ok_or(CsiError::Timeout { what: "the CSI proxy's socket".into(), waited: START_TIMEOUT })
    }

    pub fn listen(&self) -> &Path {
        &self.listen
    }

    pub fn outside_listen(&self) -> &Path {
        &self.outside_listen
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.outside_log).unwrap_or_default()
    }

    /// SIGTERM, and its exit status once it exited.
    pub fn stop(&mut self) -> Result<ExitStatus, CsiError> {
        let process = self.process.take().ok_or_else(|| CsiError::Io {
            step: "stop the CSI proxy".into(),
            source: std::io::Error::other("not running"),
        })?;
        process.signal(Signal::Term).map_err(io_step("signal the CSI proxy"))?;
        process.wait().map_err(io_step("wait for the CSI proxy"))
    }
}

impl Drop for CsiProxyProcess {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            let _ = process.kill();
        }
    }
}

impl Drop for CsiPluginProcess {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

fn exited(what: &str, status: ExitStatus) -> CsiError {
    CsiError::Io { step: format!("start {what}"), source: std::io::Error::other(format!("exited: {status}")) }
}

/// Polls `done` until it holds or `timeout` passed; whether it held.
fn wait(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(START_POLL);
    }
}

/// The children of every thread of `pid` (`/proc/<pid>/task/*/children`).
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut children = Vec::new();
    for task in tasks.flatten() {
        let listed = fs::read_to_string(task.path().join("children")).unwrap_or_default();
        children.extend(listed.split_whitespace().filter_map(|child| child.parse::<u32>().ok()));
    }
    children
}
