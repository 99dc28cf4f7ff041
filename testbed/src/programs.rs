//! `fuse-supervisor-testbed`: the demo, and the programs the tests and the
//! demo start as processes of their own (the built-in FUSE filesystem, the
//! container model, a hostile tenant, the CSI node plugin…).
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use fuse_supervisor_sys::mount::Propagation;

use crate::bomb::{self, BombOptions};
use crate::container::{self, ContainerOptions};
use crate::csi::plugin::{self as csi_plugin, PluginOptions};
use crate::demo::DemoOptions;
use crate::demofs::{self, DemoFsOptions, DemoFsRole, ReplayedInit};
use crate::scenario::Daemon;

/// The test world of fuse-supervisor: the demo, and the programs its tests
/// run.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    program: Program,
}

/// Runs the program the command line names; what `fuse-supervisor-testbed`
/// does.
pub fn main() -> ExitCode {
    match run(Cli::parse().program) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fuse-supervisor-testbed: {err:#}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DemoDaemon {
    Demofs,
    Bindfs,
}

#[derive(Debug, Subcommand)]
enum Program {
    /// The demo: a FUSE daemon crashes and restarts while the node agent
    /// heals three pods (needs root and /dev/fuse; never touches the
    /// machine's own mounts).
    Demo {
        /// Kill/restart cycles of the FUSE daemon.
        #[arg(long, default_value_t = 4)]
        cycles: usize,
        /// The FUSE daemon: the built-in demofs, or bindfs if installed.
        #[arg(long, value_enum, default_value = "demofs")]
        daemon: DemoDaemon,
        /// Restart only by unmount-then-mount (no final mount-over-stale).
        #[arg(long)]
        no_mount_over_stale: bool,
        /// The node agent's binary [default: fuse-supervisor beside this one].
        #[arg(long, value_name = "PATH")]
        agent: Option<PathBuf>,
    },
    /// Serve the built-in FUSE filesystem.
    Demofs {
        #[arg(long)]
        backing: PathBuf,
        #[arg(long)]
        mountpoint: PathBuf,
        #[arg(long, default_value = "demofs")]
        name: String,
        /// Mount, then on SIGUSR1 hand the connection to a successor process
        /// and exit, writing the successor's pid to this file.
        #[arg(long, value_name = "PID_FILE", conflicts_with = "device_on_stdin")]
        hand_off_on_signal: Option<PathBuf>,
        /// Serve the connection already mounted at the mountpoint through the
        /// /dev/fuse descriptor on stdin.
        #[arg(long)]
        device_on_stdin: bool,
        /// With --device-on-stdin: the connection's INIT request (hex), taken
        /// by a watchdog, to hand the FUSE library first.
        #[arg(long, value_name = "HEX", requires_all = ["device_on_stdin", "inode_journal"], value_parser = parse_hex_request)]
        init_request: Option<HexRequest>,
        /// With --init-request: pass the library's answer to it on to the
        /// kernel (the watchdog's first child).
        #[arg(long, requires = "init_request")]
        answer_init: bool,
        /// With --init-request: where the watchdog's children record the
        /// inode numbers they give the kernel, for the next child.
        #[arg(long, value_name = "PATH", requires = "init_request")]
        inode_journal: Option<PathBuf>,
        /// Mount and keep the connection while a child process serves it,
        /// writing the child's pid to this file; after the child dies,
        /// start another on SIGUSR1.
        #[arg(long, value_name = "PID_FILE", conflicts_with_all = ["device_on_stdin", "hand_off_on_signal"])]
        watchdog: Option<PathBuf>,
        /// Mount, and answer nothing (requests wait) until SIGUSR1, then serve.
        #[arg(long, conflicts_with_all = ["device_on_stdin", "hand_off_on_signal", "watchdog"])]
        answer_on_signal: bool,
        /// Mount and serve, but hold every lookup unanswered until SIGUSR1.
        #[arg(long, conflicts_with_all = ["device_on_stdin", "hand_off_on_signal", "watchdog", "answer_on_signal"])]
        hold_lookups_until_signal: bool,
        /// Mount and answer every request until N lookups were answered;
        /// from the next lookup on, answer no request of any kind until
        /// SIGUSR1. N = the path components a probe looks up (0: its
        /// statfs answers, the first lookup hangs).
        #[arg(long, value_name = "N", group = "hostile", conflicts_with_all = OTHER_ROLES)]
        hang_after_lookups: Option<u32>,
        /// Mount and serve with entry and attribute timeouts of zero, but
        /// hold every lookup of NAME (in any directory) until SIGUSR1.
        #[arg(long, value_name = "NAME", group = "hostile", conflicts_with_all = OTHER_ROLES)]
        hang_lookup: Option<std::ffi::OsString>,
        /// With --hang-lookup: answer the first M lookups of NAME first.
        #[arg(long, value_name = "M", requires = "hang_lookup", default_value_t = 0)]
        hang_lookup_after: u32,
        /// Mount and serve with replies at the extremes FUSE accepts: an
        /// absurd statfs, extreme attributes, 100,000 made-up 255-byte
        /// names after every listing.
        #[arg(long, group = "hostile", conflicts_with_all = OTHER_ROLES)]
        odd_replies: bool,
    },
    /// Run a container-model reader.
    Container {
        #[arg(long)]
        volume: PathBuf,
        #[arg(long)]
        rootfs: PathBuf,
        #[arg(long)]
        hide: Vec<PathBuf>,
        #[arg(long)]
        read: PathBuf,
        #[arg(long, default_value_t = 2)]
        interval_ms: u64,
        /// The volume private in the container (`None`), not a slave
        /// (`HostToContainer`).
        #[arg(long)]
        private: bool,
        /// While the volume fails, read again when the container's mount
        /// table changes (or after the interval at the latest).
        #[arg(long)]
        wake_on_mount_change: bool,
    },
    /// A tenant that makes its mount table huge: BINDS binds at the end of
    /// a chain of directories PATH_BYTES long, in a namespace of its own;
    /// prints `ready <namespace inode>`, then sleeps.
    MountBomb {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        binds: usize,
        #[arg(long)]
        path_bytes: usize,
        #[arg(long)]
        fuse: Option<PathBuf>,
        /// The binds are of the FUSE directory: every one a FUSE mount.
        #[arg(long, requires = "fuse")]
        fuse_binds: bool,
    },
    /// Run PROGRAM under a seccomp filter that refuses CALLS with ERRNO
    /// and allows every other call, as a container runtime's profile
    /// would (tests/node_faults.rs).
    RefuseCalls {
        #[arg(long, value_enum)]
        calls: RefusedCalls,
        #[arg(long, value_enum)]
        errno: RefusedWith,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        program: Vec<std::ffi::OsString>,
    },
    /// The test world's CSI node plugin (`testbed::csi::plugin`): serves
    /// the CSI Identity and Node services on SOCKET, mounting bindfs,
    /// sshfs or rclone per volume as its own children.
    CsiPlugin {
        #[arg(long, value_name = "SOCKET")]
        socket: PathBuf,
        #[arg(long, default_value = "fuse.csi.test")]
        name: String,
        #[arg(long, default_value = "node")]
        node_id: String,
        /// Advertise no STAGE_UNSTAGE_VOLUME: mount in NodePublishVolume.
        #[arg(long)]
        no_stage_unstage: bool,
        /// NodeStageVolume answers OK whenever /proc/mounts lists the path.
        #[arg(long)]
        trust_proc_mounts: bool,
        /// Append a line per Node call (its name and volume) to FILE.
        #[arg(long, value_name = "FILE")]
        call_log: Option<PathBuf>,
        /// NodeStageVolume never answers (a hung driver).
        #[arg(long)]
        hang_stage: bool,
    },
}

/// The demofs roles a hostile one (the `hostile` group, one at most)
/// excludes.
const OTHER_ROLES: [&str; 5] =
    ["device_on_stdin", "hand_off_on_signal", "watchdog", "answer_on_signal", "hold_lookups_until_signal"];

/// Which calls `refuse-calls` refuses.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum RefusedCalls {
    /// open_tree, move_mount, fsopen, fsconfig, fsmount, fspick,
    /// mount_setattr, open_tree_attr.
    NewMountApi,
    Setns,
}

/// What `refuse-calls` answers them with.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum RefusedWith {
    /// EPERM: a profile that forbids them.
    Eperm,
    /// ENOSYS: what the runtimes' default profiles answer calls they do not list.
    Enosys,
}

/// Installs the filter on this process and executes `program` under it.
fn refuse_calls(calls: RefusedCalls, errno: RefusedWith, program: &[std::ffi::OsString]) -> anyhow::Result<()> {
    use fuse_supervisor_sys::seccomp;
    use std::os::unix::process::CommandExt as _;

    let numbers: Vec<u32> = match calls {
        RefusedCalls::NewMountApi => seccomp::NEW_MOUNT_API.iter().map(|(_, number)| *number).collect(),
        RefusedCalls::Setns => vec![seccomp::SETNS.1],
    };
    let errno = match errno {
        RefusedWith::Eperm => seccomp::EPERM,
        RefusedWith::Enosys => seccomp::ENOSYS,
    };
    let (name, args) = program.split_first().context("no program to run")?;
    seccomp::refuse(&numbers, errno).context("install the seccomp filter")?;
    let err = std::process::Command::new(name).args(args).exec();
    Err(err).with_context(|| format!("execute {}", name.to_string_lossy()))
}

/// A FUSE request's bytes, given in hex: how a demofs watchdog hands its
/// connection's INIT to a child.
#[derive(Debug, Clone)]
struct HexRequest(Vec<u8>);

fn parse_hex_request(text: &str) -> Result<HexRequest, String> {
    demofs::init_request_from_hex(text).map(HexRequest).ok_or_else(|| format!("`{text}` is not hex"))
}

fn demo(cycles: usize, daemon: DemoDaemon, mount_over_stale: bool, agent: Option<PathBuf>) -> anyhow::Result<()> {
    let binary = match agent {
        Some(agent) => agent,
        None => crate::beside_this_program("fuse-supervisor").context("cannot find the fuse-supervisor binary")?,
    };
    let daemon = match daemon {
        DemoDaemon::Demofs => Daemon::DemoFs,
        DemoDaemon::Bindfs => Daemon::Bindfs,
    };
    let options = DemoOptions { cycles, daemon, mount_over_stale, ..DemoOptions::new(binary) };
    crate::demo::run(&options, &mut std::io::stdout().lock())?;
    Ok(())
}

fn run(program: Program) -> anyhow::Result<()> {
    match program {
        Program::Demo { cycles, daemon, no_mount_over_stale, agent } => {
            demo(cycles, daemon, !no_mount_over_stale, agent)
        }
        Program::Demofs {
            backing,
            mountpoint,
            name,
            hand_off_on_signal,
            device_on_stdin,
            init_request,
            answer_init,
            inode_journal,
            watchdog,
            answer_on_signal,
            hold_lookups_until_signal,
            hang_after_lookups,
            hang_lookup,
            hang_lookup_after,
            odd_replies,
        } => {
            // Both or neither: clap requires the one with the other.
            let watchdog_child = init_request.zip(inode_journal);
            let role = match (hand_off_on_signal, watchdog, watchdog_child) {
                (Some(pid_file), _, _) => DemoFsRole::HandOffOnSignal { pid_file },
                (None, Some(pid_file), _) => DemoFsRole::Watchdog { pid_file },
                (None, None, Some((HexRequest(request), inode_journal))) => DemoFsRole::WatchdogChild {
                    init: ReplayedInit { request, answer_kernel: answer_init },
                    inode_journal,
                },
                (None, None, None) if device_on_stdin => DemoFsRole::DeviceOnStdin,
                (None, None, None) if answer_on_signal => DemoFsRole::AnswerOnSignal,
                (None, None, None) if hold_lookups_until_signal => DemoFsRole::HoldLookupsUntilSignal,
                (None, None, None) => match (hang_after_lookups, hang_lookup) {
                    (Some(answered), _) => DemoFsRole::HangAfterLookups { answered },
                    (None, Some(name)) => DemoFsRole::HangLookup { name, answered_first: hang_lookup_after },
                    (None, None) if odd_replies => DemoFsRole::OddReplies,
                    (None, None) => DemoFsRole::Serve,
                },
            };
            demofs::serve(&DemoFsOptions { backing, mountpoint, name, role }).map_err(Into::into)
        }
        Program::Container { volume, rootfs, hide, read, interval_ms, private, wake_on_mount_change } => {
            container::run(&ContainerOptions {
                volume,
                rootfs,
                hide,
                read,
                interval: Duration::from_millis(interval_ms),
                propagation: if private { Propagation::Private } else { Propagation::Slave },
                wake_on_mount_change,
            })
        }
        .map_err(Into::into),
        Program::MountBomb { dir, binds, path_bytes, fuse, fuse_binds } => {
            bomb::run(&BombOptions { dir, binds, path_bytes, fuse, fuse_binds }).map_err(Into::into)
        }
        Program::RefuseCalls { calls, errno, program } => refuse_calls(calls, errno, &program),
        Program::CsiPlugin { socket, name, node_id, no_stage_unstage, trust_proc_mounts, call_log, hang_stage } => {
            csi_plugin::run(PluginOptions {
                socket,
                name,
                node_id,
                stage_unstage: !no_stage_unstage,
                trust_proc_mounts,
                answer_only: false,
                call_log,
                hang_stage,
            })
            .context("the CSI plugin failed")
        }
    }
}
