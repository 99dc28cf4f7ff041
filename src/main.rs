//! The `fuse-supervisor` command line.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use fuse_supervisor::demo::DemoOptions;
use fuse_supervisor::demofs::{self, DemoFsOptions};
use fuse_supervisor::state::Journal;
use fuse_supervisor::status::Status;
use fuse_supervisor::supervisor::{self, Config, Shutdown};
use fuse_supervisor::table::{Classified, Layout, Snapshot};
use fuse_supervisor::testbed::container::{self, ContainerOptions};
use fuse_supervisor::testbed::scenario::Daemon;

/// Heals the FUSE bind mounts of Kubernetes pods when the FUSE daemon behind
/// them restarts, reaching containers that are still running.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Watch the node and heal broken FUSE mounts as they appear.
    Run {
        #[command(flatten)]
        node: NodeArgs,
        #[command(flatten)]
        log: LogArgs,
    },
    /// List every FUSE source and target with its state.
    Status {
        #[command(flatten)]
        node: NodeArgs,
        /// Print JSON instead of a table.
        #[arg(long, env = "FUSE_SUPERVISOR_JSON")]
        json: bool,
        /// Read a captured mountinfo table instead of the live namespace.
        #[arg(long, value_name = "FILE", env = "FUSE_SUPERVISOR_MOUNTINFO")]
        mountinfo: Option<PathBuf>,
    },
    /// Scan once, print the heal plan and carry it out.
    Heal {
        /// Heal once and exit (the only mode; `run` heals continuously).
        #[arg(long, required = true)]
        once: bool,
        /// Print the plan without mounting anything.
        #[arg(long, env = "FUSE_SUPERVISOR_DRY_RUN")]
        dry_run: bool,
        #[command(flatten)]
        node: NodeArgs,
        #[command(flatten)]
        log: LogArgs,
    },
    /// A self-contained demo in a private mount namespace: a FUSE daemon
    /// crashes and restarts while the supervisor heals three pods (needs
    /// root and /dev/fuse; never touches the machine's own mounts).
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
    },
    /// Building blocks of the demo and the tests; not for users.
    #[command(hide = true, subcommand)]
    Internal(Internal),
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DemoDaemon {
    Demofs,
    Bindfs,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Node")]
struct NodeArgs {
    /// The kubelet's root directory; pod targets live under <root>/pods.
    #[arg(long, default_value = "/var/lib/kubelet", env = "FUSE_SUPERVISOR_KUBELET_ROOT")]
    kubelet_root: PathBuf,
    /// Where the learned target → source mapping is kept.
    #[arg(long, default_value = "/var/lib/fuse-supervisor", env = "FUSE_SUPERVISOR_STATE_DIR")]
    state_dir: PathBuf,
    /// The mount namespace to watch and heal (the host's by default).
    #[arg(long, default_value = "/proc/1/ns/mnt", env = "FUSE_SUPERVISOR_MOUNT_NAMESPACE")]
    mount_namespace: PathBuf,
    /// A directory in that namespace for a private staging tmpfs, where
    /// new mounts are parked while the stale layers under them are removed.
    #[arg(long, default_value = "/run/fuse-supervisor", env = "FUSE_SUPERVISOR_STAGING_DIR")]
    staging_dir: PathBuf,
    /// How long a FUSE source may take to answer a health probe.
    #[arg(long, default_value = "2s", value_parser = parse_duration, env = "FUSE_SUPERVISOR_PROBE_TIMEOUT")]
    probe_timeout: Duration,
}

impl NodeArgs {
    fn config(&self) -> Config {
        Config {
            kubelet_root: self.kubelet_root.clone(),
            state_dir: self.state_dir.clone(),
            mount_namespace: self.mount_namespace.clone(),
            staging_dir: self.staging_dir.clone(),
            probe_timeout: self.probe_timeout,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Logging")]
struct LogArgs {
    #[arg(long, value_enum, default_value = "text", env = "FUSE_SUPERVISOR_LOG_FORMAT")]
    log_format: LogFormat,
    /// Filter in tracing's env-filter syntax.
    #[arg(long, default_value = "info", env = "FUSE_SUPERVISOR_LOG")]
    log: String,
}

impl LogArgs {
    fn init(&self) {
        let filter = tracing_subscriber::EnvFilter::new(&self.log);
        let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
        match self.log_format {
            LogFormat::Json => builder.json().init(),
            LogFormat::Text => builder.init(),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Internal {
    /// Serve the built-in FUSE filesystem.
    Demofs {
        #[arg(long)]
        backing: PathBuf,
        #[arg(long)]
        mountpoint: PathBuf,
        #[arg(long, default_value = "demofs")]
        name: String,
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
    },
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let number: u64 = number.parse().map_err(|_| format!("`{text}` is not a duration like 500ms, 2s or 1m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(number)),
        "s" | "" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number * 60)),
        _ => Err(format!("`{text}`: unknown unit `{unit}` (use ms, s or m)")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run { node, log } => {
            log.init();
            run(&node.config())
        }
        Command::Status { node, json, mountinfo } => status(&node, json, mountinfo.as_deref()),
        Command::Heal { node, log, dry_run, .. } => {
            log.init();
            heal_once(&node.config(), dry_run)
        }
        Command::Demo { cycles, daemon, no_mount_over_stale } => demo(cycles, daemon, !no_mount_over_stale),
        Command::Internal(Internal::Demofs { backing, mountpoint, name }) => {
            demofs::serve(&DemoFsOptions { backing, mountpoint, name }).map_err(Into::into)
        }
        Command::Internal(Internal::Container { volume, rootfs, hide, read, interval_ms }) => {
            container::run(&ContainerOptions {
                volume,
                rootfs,
                hide,
                read,
                interval: Duration::from_millis(interval_ms),
            })
            .map_err(Into::into)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fuse-supervisor: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn demo(cycles: usize, daemon: DemoDaemon, mount_over_stale: bool) -> anyhow::Result<()> {
    let binary = std::env::current_exe().context("cannot find the fuse-supervisor binary")?;
    let daemon = match daemon {
        DemoDaemon::Demofs => Daemon::DemoFs,
        DemoDaemon::Bindfs => Daemon::Bindfs,
    };
    let options = DemoOptions { cycles, daemon, mount_over_stale, ..DemoOptions::new(binary) };
    fuse_supervisor::demo::run(&options, &mut std::io::stdout().lock())?;
    Ok(())
}

fn run(config: &Config) -> anyhow::Result<()> {
    let shutdown = Shutdown::new().context("cannot create the shutdown eventfd")?;
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
        .context("cannot install signal handlers")?;
    let on_signal = shutdown.clone();
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        if signals.forever().next().is_some() {
            tracing::info!("signal received; shutting down");
            on_signal.request();
        }
    })?;
    // The loop thread moves into the watched namespace; main stays put.
    let config = config.clone();
    let supervisor =
        std::thread::Builder::new().name("supervisor".into()).spawn(move || supervisor::run(&config, &shutdown))?;
    supervisor.join().map_err(|_| anyhow::anyhow!("supervisor thread panicked"))??;
    Ok(())
}

fn heal_once(config: &Config, dry_run: bool) -> anyhow::Result<()> {
    let config = config.clone();
    let summary = std::thread::spawn(move || supervisor::heal_once(&config, dry_run, &mut std::io::stdout()))
        .join()
        .map_err(|_| anyhow::anyhow!("heal thread panicked"))??;
    anyhow::ensure!(summary.failed == 0, "{} of {} target(s) not healed", summary.failed, summary.planned);
    Ok(())
}

fn status(node: &NodeArgs, json: bool, mountinfo: Option<&Path>) -> anyhow::Result<()> {
    let table = match mountinfo {
        Some(file) => fs::read(file).with_context(|| format!("cannot read {}", file.display()))?,
        None => read_namespace_table(&node.mount_namespace)?,
    };
    let snapshot = Snapshot::parse(&table).with_context(|| match mountinfo {
        Some(file) => format!("in {}", file.display()),
        None => "in the live mount table".to_owned(),
    })?;
    let layout = Layout::new(&node.kubelet_root);
    let classified = Classified::new(&snapshot, &layout);
    // The state file tells where stale targets came from (offline too, when
    // the report came with one); without it only peer groups can.
    let mut journal = match Journal::load(&node.state_dir) {
        Ok(journal) => journal,
        Err(err) => {
            eprintln!("fuse-supervisor: {err:#}; going on without it");
            Journal::in_memory()
        }
    };
    let status = Status::new(&classified, &layout, &mut journal);
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", status.to_text());
    }
    Ok(())
}

/// Reads the mount table of a namespace from a thread that joined it.
fn read_namespace_table(namespace: &Path) -> anyhow::Result<Vec<u8>> {
    let namespace = namespace.to_path_buf();
    std::thread::spawn(move || -> anyhow::Result<Vec<u8>> {
        fuse_supervisor_sys::ns::join_mount_namespace(&namespace)
            .with_context(|| format!("cannot join mount namespace {}", namespace.display()))?;
        fs::read("/proc/thread-self/mountinfo").context("cannot read /proc/thread-self/mountinfo")
    })
    .join()
    .map_err(|_| anyhow::anyhow!("namespace reader panicked"))?
}
