//! A daemon that daemonizes: the process the sandbox started mounts, forks
//! and exits, and its child, which nobody waits for, serves the connection.
use std::ffi::OsString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::process::Command;

use super::{MOUNT_TIMEOUT, SandboxChild, ScenarioError, wait_for};

/// The argument vector `command` runs with, program first.
pub(super) fn command_line(command: &Command) -> Vec<OsString> {
    std::iter::once(command.get_program()).chain(command.get_args()).map(ToOwned::to_owned).collect()
}

/// Waits until `parent` (started with `command_line`) has exited, as a
/// daemonizing daemon does once its child serves, and returns the pid of
/// that child: the one other process running the same command line.
pub(super) fn serving_child(
    parent: &SandboxChild,
    command_line: &[OsString],
    daemon: &'static str,
) -> Result<u32, ScenarioError> {
    let found = find_serving_child(parent, command_line, daemon);
    if found.is_err() {
        // A child forked before the parent was given up on is nobody's to
        // stop otherwise: it would serve on, and keep the test's mount
        // namespace, after the test. The command line names the sandbox.
        for pid in processes_running(command_line).into_iter().filter(|pid| *pid != parent.pid()) {
            let _ = fuse_supervisor_sys::process::signal(pid, fuse_supervisor_sys::process::Signal::Kill);
        }
    }
    found
}

fn find_serving_child(
    parent: &SandboxChild,
    command_line: &[OsString],
    daemon: &'static str,
) -> Result<u32, ScenarioError> {
    let mut status = None;
    wait_for(&format!("{daemon} (pid {}) to daemonize and exit", parent.pid()), MOUNT_TIMEOUT, || {
        status = parent.try_wait().ok().flatten();
        status.is_some()
    })?;
    if let Some(status) = status.filter(|status| !status.success()) {
        return Err(ScenarioError::DaemonExited { daemon, status });
    }
    let running_it: Vec<u32> = processes_running(command_line).into_iter().filter(|pid| *pid != parent.pid()).collect();
    match running_it[..] {
        [child] => Ok(child),
        _ => Err(ScenarioError::Io {
            step: format!("find the child {daemon} (pid {}) left serving", parent.pid()),
            source: std::io::Error::other(format!("processes running {command_line:?}: {running_it:?}")),
        }),
    }
}

/// Pids of the live processes whose command line is `command_line` (a
/// zombie's reads empty).
fn processes_running(command_line: &[OsString]) -> Vec<u32> {
    let wanted: Vec<u8> = command_line.iter().flat_map(|arg| arg.as_bytes().iter().copied().chain([0])).collect();
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| cmdline == wanted))
        .collect()
}
