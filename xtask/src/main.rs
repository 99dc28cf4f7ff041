//! `cargo xtask test [ARGS…]`: installs the system packages the tests run
//! programs from (as root, with the distribution's package manager), or stops
//! with one line naming what is missing; then runs `cargo test --workspace
//! ARGS…`.
//!
//! `cargo xtask stress …`: the same packages, then the integration tests
//! run repeatedly beside busy-looping processes (`stress.rs`).
//!
//! Both run the tests with the kernel's session autogroups off, as root
//! (`autogroups.rs`).
//!
//! `cargo xtask demo [ARGS…]`: builds the node agent and the test world's
//! binary (release) and runs `fuse-supervisor-testbed demo ARGS…`, which
//! runs the agent built beside it.

mod autogroups;
mod stress;
mod system_packages;

use std::env;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::process::{Command, ExitCode};

use system_packages::{PackageManager, SystemPackage, missing_message, missing_packages};

const USAGE: &str = "usage: cargo xtask test [ARGS…]
  installs the system packages the tests need (as root), then runs `cargo test --workspace ARGS…`
usage: cargo xtask demo [ARGS…]
  builds the node agent and the test world (release), then runs `fuse-supervisor-testbed demo ARGS…`";

fn main() -> ExitCode {
    let mut args = env::args_os().skip(1);
    match args.next().as_deref().and_then(OsStr::to_str) {
        Some("test") => test(args.collect()),
        Some("demo") => demo(args.collect()),
        Some("stress") => match stress::parse_args(args.collect()) {
            Ok(stress_args) => match ensure_test_packages() {
                Ok(()) => {
                    let _autogroups_off = autogroups::turn_off();
                    stress::stress(stress_args)
                }
                Err(message) => {
                    eprintln!("xtask: {message}");
                    ExitCode::from(2)
                }
            },
            Err(message) => {
                eprintln!("xtask stress: {message}\n{}", stress::USAGE);
                ExitCode::from(2)
            }
        },
        // A busy-looping child of `stress`, not for people.
        Some("hog") => stress::hog(),
        // What turns the autogroups on again once the tests end, not for people.
        Some("autogroups-on-when-done") => autogroups::on_when_done(&args.next().unwrap_or_default()),
        Some("-h" | "--help") => {
            println!("{USAGE}\n{}", stress::USAGE);
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}\n{}", stress::USAGE);
            ExitCode::from(2)
        }
    }
}

fn test(cargo_args: Vec<OsString>) -> ExitCode {
    if let Err(message) = ensure_test_packages() {
        eprintln!("xtask: {message}");
        return ExitCode::from(2);
    }
    let (mut command, _) = cargo();
    command.args(["test", "--workspace"]).args(&cargo_args);
    let _autogroups_off = autogroups::turn_off();
    run(&mut command)
}

fn demo(demo_args: Vec<OsString>) -> ExitCode {
    let (mut build, _) = cargo();
    build.args(["build", "--release", "--features", "testbed", "--bin", "fuse-supervisor"]);
    build.args(["--bin", "fuse-supervisor-testbed"]);
    let built = run(&mut build);
    if built != ExitCode::SUCCESS {
        return built;
    }
    let target = env::var_os("CARGO_TARGET_DIR").map_or_else(|| stress::workspace_root().join("target"), Into::into);
    run(Command::new(target.join("release/fuse-supervisor-testbed")).arg("demo").args(&demo_args))
}

/// Runs `command` and exits as it did.
fn run(command: &mut Command) -> ExitCode {
    match command.status() {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => ExitCode::from(status.code().and_then(|code| u8::try_from(code).ok()).unwrap_or(1)),
        Err(err) => {
            eprintln!("xtask: cannot run {}: {err}", command.get_program().to_string_lossy());
            ExitCode::FAILURE
        }
    }
}

/// The cargo that runs this task (so a toolchain override carries over),
/// without what `cargo run` set for this task alone: build scripts that
/// read a package's variables (ring's reads `CARGO_MANIFEST_DIR` and
/// `CARGO_PKG_NAME`) would see xtask's and rerun, rebuilding ring and all
/// that depends on it, the whole crate included, once under `cargo xtask`
/// and again under a plain `cargo test`.
pub(crate) fn cargo() -> (Command, OsString) {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(&cargo);
    for (name, _) in env::vars_os() {
        let set_by_run = name.to_str().is_some_and(|name| {
            name.starts_with("CARGO_PKG_")
                || name.starts_with("CARGO_MANIFEST_")
                || ["CARGO_CRATE_NAME", "CARGO_BIN_NAME", "CARGO_PRIMARY_PACKAGE"].contains(&name)
        });
        if set_by_run {
            command.env_remove(&name);
        }
    }
    (command, cargo)
}

/// Installs what `TEST_PACKAGES` lacks here, or says in one line why not.
fn ensure_test_packages() -> Result<(), String> {
    let search_path = env::var_os("PATH").unwrap_or_default();
    let missing = missing_packages(&search_path);
    if missing.is_empty() {
        return Ok(());
    }
    let manager = PackageManager::find(&search_path);
    let Some(manager) = manager.filter(|_| is_root()) else {
        return Err(missing_message(&missing, manager));
    };
    for package in &missing {
        eprintln!(
            "xtask: installing {} with {}: the tests run {} as {}",
            manager.package_of(package),
            manager.program(),
            package.program,
            package.used_for
        );
    }
    install(manager, &missing)?;
    let still_missing = missing_packages(&search_path);
    if still_missing.is_empty() {
        Ok(())
    } else {
        Err(format!("installed, yet still missing: {}", missing_message(&still_missing, Some(manager))))
    }
}

fn install(manager: PackageManager, missing: &[SystemPackage]) -> Result<(), String> {
    let packages = manager.packages_for(missing);
    let steps: Vec<Vec<&str>> = match manager {
        // A fresh machine's package lists are empty or stale.
        PackageManager::Apt => vec![vec!["update", "-qq"], [&["install", "-y", "-qq"][..], &packages].concat()],
        PackageManager::Dnf => vec![[&["install", "-y", "-q"][..], &packages].concat()],
    };
    for step in steps {
        let status = Command::new(manager.program())
            .args(&step)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|err| format!("cannot run {}: {err}", manager.program()))?;
        if !status.success() {
            return Err(format!("`{} {}` failed ({status})", manager.program(), step.join(" ")));
        }
    }
    Ok(())
}

/// Whether the effective user is root, from `/proc/self/status` (the
/// standard library has no `geteuid`, and this crate takes no dependency).
fn is_root() -> bool {
    fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            .is_some_and(|effective| effective == "0")
    })
}

#[cfg(test)]
mod tests {
    use super::system_packages::*;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    fn package(program: &str) -> SystemPackage {
        *TEST_PACKAGES.iter().find(|package| package.program == program).unwrap()
    }

    #[test]
    fn the_message_names_each_program_its_package_and_one_install_line() {
        let missing = [package("bindfs"), package("unshare"), package("nsenter")];
        let message = missing_message(&missing, Some(PackageManager::Apt));
        assert_eq!(
            message,
            "the tests need programs that are not installed: \
             bindfs (package bindfs: the third-party FUSE daemon of the heal tests), \
             unshare (package util-linux: the private namespaces of the process and sidecar tests), \
             nsenter (package util-linux: entering a pod's namespaces in the sidecar tests); \
             install them with `apt-get install -y bindfs util-linux`, or run `cargo xtask test` as root, which does"
        );
        assert!(!message.contains('\n'));
        assert_eq!(PackageManager::Dnf.install_line(&[package("umount")]), "dnf install -y util-linux");
    }

    #[test]
    fn without_a_known_package_manager_the_message_still_names_the_programs() {
        let message = missing_message(&[package("bindfs")], None);
        assert!(message.contains("bindfs (the third-party FUSE daemon"), "{message}");
        assert!(message.contains("the distribution's package manager"), "{message}");
    }

    #[test]
    fn only_executable_files_on_the_search_path_count() {
        let dir = std::env::temp_dir().join(format!("xtask-path-{}", std::process::id()));
        fs::create_dir_all(dir.join("bindfs-is-a-directory/bindfs")).unwrap();
        fs::write(dir.join("bindfs"), "").unwrap();
        fs::write(dir.join("unshare"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(dir.join("unshare"), fs::Permissions::from_mode(0o755)).unwrap();
        let search_path = std::env::join_paths([dir.join("bindfs-is-a-directory"), dir.clone()]).unwrap();

        assert_eq!(find_program("unshare", &search_path), Some(dir.join("unshare")));
        assert_eq!(find_program("bindfs", &search_path), None, "neither a directory nor a file without x");
        let missing: Vec<&str> = missing_packages(&search_path).iter().map(|package| package.program).collect();
        // All but unshare, and but a helper this machine has off PATH.
        let off_path = |program: &&str| locate(&package(program), std::ffi::OsStr::new("")).is_some();
        let expected: Vec<&str> =
            TEST_PACKAGES.iter().map(|package| package.program).filter(|p| *p != "unshare" && !off_path(p)).collect();
        assert_eq!(missing, expected);
        assert!(missing.starts_with(&[
            "bindfs",
            "fusermount3",
            "nsenter",
            "setpriv",
            "prlimit",
            "umount",
            "runc",
            "busybox"
        ]));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_helper_off_the_search_path_is_found_in_its_packages_directory() {
        let dir = std::env::temp_dir().join(format!("xtask-libexec-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("sftp-server"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(dir.join("sftp-server"), fs::Permissions::from_mode(0o755)).unwrap();
        let also_in: &'static [&'static str] = Box::leak(Box::new([&*dir.to_string_lossy().into_owned().leak()]));
        let helper = SystemPackage { also_in, ..package("sftp-server") };
        let empty = std::ffi::OsStr::new("");
        assert_eq!(locate(&helper, empty), Some(dir.join("sftp-server")));
        assert_eq!(locate(&SystemPackage { also_in: &[], ..helper }, empty), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
