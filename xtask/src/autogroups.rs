//! The kernel's session autogroups turned off while the tests run, and
//! turned back on when they end, however they end.
//!
//! On the 2-CPU VM this project is developed on (Linux 6.18), with
//! autogroups on and both CPUs busy (a build, or the stress's busy loops),
//! the scheduler left the kernel's own per-CPU workqueue threads and RCU's
//! grace-period thread runnable and unrun for 30 s to minutes: every
//! unmount then waited for a grace period that could not end, and the tests
//! waiting on a heal failed. With autogroups off, the same runs never
//! stalled. Nothing the tests check depends on autogroups.

use std::env;
use std::ffi::OsStr;
use std::fs;
use std::io::{self, ErrorKind, Read};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};

const SYSCTL: &str = "/proc/sys/kernel/sched_autogroup_enabled";

/// Holds the autogroups off; dropped (or this process gone), they are on
/// again.
pub struct AutogroupsOff {
    /// `xtask autogroups-on-when-done`, which turns them on when its
    /// standard input, a pipe only this process writes to, closes.
    restorer: Option<Child>,
}

/// Turns the autogroups off if they are on and this process may, saying
/// so; otherwise says why they stay on, or nothing when there are none.
pub fn turn_off() -> AutogroupsOff {
    let restorer = env::current_exe().map(|exe| {
        let mut command = Command::new(exe);
        command.arg("autogroups-on-when-done").arg(SYSCTL);
        command
    });
    turn_off_at(Path::new(SYSCTL), restorer)
}

/// [`turn_off`] of the setting at `sysctl`, `restorer` started to turn it
/// on again once its standard input closes.
fn turn_off_at(sysctl: &Path, restorer: io::Result<Command>) -> AutogroupsOff {
    let none = AutogroupsOff { restorer: None };
    match fs::read_to_string(sysctl) {
        Ok(value) if value.trim() == "1" => {}
        // Off already, or a kernel without them: nothing to restore.
        _ => return none,
    }
    // The restorer first, so that no way this process ends leaves them
    // off: in a process group of its own, the terminal's Ctrl-C does not
    // reach it.
    let restorer = restorer.and_then(|mut command| command.stdin(Stdio::piped()).process_group(0).spawn());
    let mut restorer = match restorer {
        Ok(child) => child,
        Err(err) => {
            eprintln!("xtask: the kernel's session autogroups stay on (cannot start what turns them on again: {err})");
            return none;
        }
    };
    match fs::write(sysctl, "0") {
        Ok(()) => {
            eprintln!(
                "xtask: kernel.sched_autogroup_enabled=0 until the tests end: with session autogroups, \
                 this project's 2-CPU development VM left the kernel's workqueue and RCU threads unrun \
                 for minutes beside busy sessions (docs/development.md#the-kernels-stalls)"
            );
            AutogroupsOff { restorer: Some(restorer) }
        }
        Err(err) => {
            let why = if err.kind() == ErrorKind::PermissionDenied { "not root".to_owned() } else { err.to_string() };
            eprintln!("xtask: the kernel's session autogroups stay on ({}: {why})", sysctl.display());
            let _ = restorer.kill();
            let _ = restorer.wait();
            none
        }
    }
}

impl Drop for AutogroupsOff {
    fn drop(&mut self) {
        if let Some(mut restorer) = self.restorer.take() {
            drop(restorer.stdin.take());
            let _ = restorer.wait();
        }
    }
}

/// `xtask autogroups-on-when-done SYSCTL`: waits for its standard input to
/// close (its parent done, or gone), then turns the autogroups on.
pub fn on_when_done(sysctl: &OsStr) -> ExitCode {
    let mut sink = [0u8; 64];
    let mut stdin = io::stdin();
    loop {
        match stdin.read(&mut sink) {
            Ok(0) => break,
            Err(err) if err.kind() != ErrorKind::Interrupted => break,
            _ => {}
        }
    }
    match fs::write(sysctl, "1") {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let sysctl = Path::new(sysctl).display();
            eprintln!(
                "xtask: cannot turn the kernel's session autogroups on again ({sysctl}: {err}); `sysctl kernel.sched_autogroup_enabled=1` does"
            );
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for `xtask autogroups-on-when-done` (the test binary is
    /// not xtask): the same protocol in a shell.
    fn shell_restorer(sysctl: &Path) -> io::Result<Command> {
        let mut command = Command::new("sh");
        command.args(["-c", "cat >/dev/null; printf 1 >\"$0\""]).arg(sysctl);
        Ok(command)
    }

    #[test]
    fn they_are_off_while_held_and_on_again_once_dropped() {
        let sysctl = env::temp_dir().join(format!("xtask-autogroups-{}", std::process::id()));
        fs::write(&sysctl, "1\n").unwrap();
        let off = turn_off_at(&sysctl, shell_restorer(&sysctl));
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "0");
        drop(off);
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "1");

        // Off already: left as found, and nothing to restore.
        fs::write(&sysctl, "0\n").unwrap();
        let off = turn_off_at(&sysctl, shell_restorer(&sysctl));
        assert!(off.restorer.is_none());
        drop(off);
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "0\n");
        fs::remove_file(&sysctl).unwrap();
    }
}
