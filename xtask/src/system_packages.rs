//! The system packages whose programs the tests run: one table for
//! `cargo xtask test`, which installs what is missing, and for the test bed,
//! which fails a test that needs a missing program with the same message.
//!
//! Standard library only, and self-contained: the test bed compiles this
//! file into itself by path (`testbed/src/system.rs`).

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A program the tests run, and the package that installs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SystemPackage {
    /// What the tests run, looked up on `PATH`.
    pub program: &'static str,
    /// The package that has it on Debian and Ubuntu.
    pub deb: &'static str,
    /// The package that has it on Fedora and RHEL.
    pub rpm: &'static str,
    /// What the tests need it for, said when it is missing.
    pub used_for: &'static str,
    /// Directories off `PATH` where the package puts it (a helper program
    /// such as `sftp-server`), looked in after `PATH`.
    pub also_in: &'static [&'static str],
}

/// Everything the tests run that a minimal system may lack (a shell and
/// coreutils are taken for granted).
pub const TEST_PACKAGES: &[SystemPackage] = &[
    SystemPackage {
        program: "bindfs",
        deb: "bindfs",
        rpm: "bindfs",
        used_for: "the third-party FUSE daemon of the heal tests",
        also_in: &[],
    },
    SystemPackage {
        program: "fusermount3",
        deb: "fuse3",
        rpm: "fuse3",
        used_for: "libfuse's mount helper, which bindfs falls back to",
        also_in: &[],
    },
    SystemPackage {
        program: "unshare",
        deb: "util-linux",
        rpm: "util-linux",
        used_for: "the private namespaces of the process and sidecar tests",
        also_in: &[],
    },
    SystemPackage {
        program: "nsenter",
        deb: "util-linux",
        rpm: "util-linux",
        used_for: "entering a pod's namespaces in the sidecar tests",
        also_in: &[],
    },
    SystemPackage {
        program: "setpriv",
        deb: "util-linux",
        rpm: "util-linux",
        used_for: "running the supervisor without CAP_SYS_ADMIN in the node-fault tests",
        also_in: &[],
    },
    SystemPackage {
        program: "prlimit",
        deb: "util-linux",
        rpm: "util-linux",
        used_for: "a low open-file limit for the supervisor alone in the node-fault tests",
        also_in: &[],
    },
    SystemPackage {
        program: "umount",
        deb: "mount",
        rpm: "util-linux",
        used_for: "a FUSE container unmounting its dead mount in the sidecar tests",
        also_in: &[],
    },
    SystemPackage {
        program: "runc",
        deb: "runc",
        rpm: "runc",
        used_for: "the real OCI containers of the top tier of the heal tests",
        also_in: &[],
    },
    SystemPackage {
        program: "busybox",
        deb: "busybox-static",
        rpm: "busybox",
        used_for: "the static root filesystem of those containers",
        also_in: &[],
    },
    SystemPackage {
        program: "rclone",
        deb: "rclone",
        rpm: "rclone",
        used_for: "a third-party FUSE daemon of the heal tests (`rclone mount` of a local directory)",
        also_in: &[],
    },
    SystemPackage {
        program: "sshfs",
        deb: "sshfs",
        rpm: "fuse-sshfs",
        used_for: "a third-party FUSE daemon of the heal tests (SFTP over a pipe, no network)",
        also_in: &[],
    },
    SystemPackage {
        program: "sftp-server",
        deb: "openssh-sftp-server",
        rpm: "openssh-server",
        used_for: "the SFTP server that sshfs talks to over a pipe in the heal tests",
        also_in: &["/usr/lib/openssh", "/usr/libexec/openssh", "/usr/libexec"],
    },
    SystemPackage {
        program: "kubectl",
        deb: "kubernetes-client",
        rpm: "kubernetes-client",
        used_for: "`kubectl kustomize`, which the manifests test renders deploy/'s kustomizations with",
        also_in: &[],
    },
    SystemPackage {
        program: "containerd",
        deb: "containerd",
        rpm: "containerd",
        used_for: "the container runtime of the CRI tier of the heal tests (a private instance per test)",
        also_in: &[],
    },
    SystemPackage {
        program: "ctr",
        deb: "containerd",
        rpm: "containerd",
        used_for: "importing the CRI tier's locally built image into that containerd",
        also_in: &[],
    },
];

/// The distribution's package manager, which names the packages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackageManager {
    Apt,
    Dnf,
}

impl PackageManager {
    /// The one on `search_path`, if it is one this table knows.
    pub fn find(search_path: &OsStr) -> Option<Self> {
        if find_program("apt-get", search_path).is_some() {
            Some(Self::Apt)
        } else if find_program("dnf", search_path).is_some() {
            Some(Self::Dnf)
        } else {
            None
        }
    }

    pub fn program(self) -> &'static str {
        match self {
            Self::Apt => "apt-get",
            Self::Dnf => "dnf",
        }
    }

    pub fn package_of(self, package: &SystemPackage) -> &'static str {
        match self {
            Self::Apt => package.deb,
            Self::Dnf => package.rpm,
        }
    }

    /// The distinct package names that provide `missing`, in table order.
    pub fn packages_for(self, missing: &[SystemPackage]) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = Vec::new();
        for package in missing {
            let name = self.package_of(package);
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// The command line that installs `missing`.
    pub fn install_line(self, missing: &[SystemPackage]) -> String {
        format!("{} install -y {}", self.program(), self.packages_for(missing).join(" "))
    }
}

/// The packages of `TEST_PACKAGES` whose program is not on `search_path`
/// (nor where the package puts it off `PATH`).
pub fn missing_packages(search_path: &OsStr) -> Vec<SystemPackage> {
    TEST_PACKAGES.iter().filter(|package| locate(package, search_path).is_none()).copied().collect()
}

/// Where `package`'s program is: on `search_path`, else in one of the
/// package's own directories.
pub fn locate(package: &SystemPackage, search_path: &OsStr) -> Option<PathBuf> {
    find_program(package.program, search_path).or_else(|| {
        package
            .also_in
            .iter()
            .map(|dir| Path::new(dir).join(package.program))
            .find(|candidate| is_executable(candidate))
    })
}

/// Where `program` is on `search_path` (a `PATH`-style list), if anywhere,
/// as an executable file.
pub fn find_program(program: &str, search_path: &OsStr) -> Option<PathBuf> {
    std::env::split_paths(search_path).map(|dir| dir.join(program)).find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    path.metadata().is_ok_and(|metadata| metadata.is_file() && metadata.permissions().mode() & 0o111 != 0)
}

/// The one line that says what is missing, what for, and how to install it.
pub fn missing_message(missing: &[SystemPackage], manager: Option<PackageManager>) -> String {
    let programs: Vec<String> = missing
        .iter()
        .map(|package| match manager {
            Some(manager) => {
                format!("{} (package {}: {})", package.program, manager.package_of(package), package.used_for)
            }
            None => format!("{} ({})", package.program, package.used_for),
        })
        .collect();
    let install = match manager {
        Some(manager) => format!("`{}`", manager.install_line(missing)),
        None => "the distribution's package manager".to_owned(),
    };
    format!(
        "the tests need programs that are not installed: {}; install them with {install}, or run `cargo xtask test` as root, which does",
        programs.join(", ")
    )
}
