//! Programs the tests run from system packages. A test that needs one that
//! is not installed fails with the line `cargo xtask test` prints for it,
//! not with a spawn error.

use std::ffi::OsStr;
use std::path::PathBuf;

// One table for both: the task installs from it, the test bed names from it.
#[path = "../../xtask/src/system_packages.rs"]
#[allow(dead_code, reason = "the installer's half is used by `cargo xtask` only")]
mod system_packages;

use system_packages::{PackageManager, TEST_PACKAGES, locate, missing_message};

/// Where `program` is on `PATH`.
///
/// # Panics
/// When it is not installed, with the one-line message naming its package
/// and the command that installs it; and when `program` is not in the
/// table of test packages, even if installed here (a test that runs something
/// new adds it there, so `cargo xtask test` installs it on a fresh machine).
pub fn program(program: &str) -> PathBuf {
    program_on(program, &std::env::var_os("PATH").unwrap_or_default())
}

fn program_on(program: &str, search_path: &OsStr) -> PathBuf {
    let Some(package) = TEST_PACKAGES.iter().find(|package| package.program == program) else {
        panic!("{program} is not in xtask/src/system_packages.rs: add it there, so `cargo xtask test` installs it");
    };
    match locate(package, search_path) {
        Some(path) => path,
        None => panic!("{}", missing_message(&[*package], PackageManager::find(search_path))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panic_message(find: impl FnOnce() -> PathBuf + std::panic::UnwindSafe) -> String {
        let payload = std::panic::catch_unwind(find).expect_err("should panic");
        payload.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    #[test]
    fn a_missing_program_fails_with_the_installers_line() {
        let search_path = OsStr::new("/nonexistent");
        let message = panic_message(|| program_on("bindfs", search_path));
        assert_eq!(message, missing_message(&TEST_PACKAGES[..1], None));
        assert!(message.starts_with("the tests need programs that are not installed: bindfs ("), "{message}");
    }

    #[test]
    fn a_program_outside_the_table_is_refused_even_if_installed() {
        let message = panic_message(|| program_on("sh", OsStr::new("/bin:/usr/bin")));
        assert!(message.contains("not in xtask/src/system_packages.rs"), "{message}");
    }

    #[test]
    fn an_installed_program_is_found() {
        assert!(program_on("unshare", OsStr::new("/nonexistent:/usr/bin:/bin")).ends_with("unshare"));
    }
}
