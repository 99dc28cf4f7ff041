//! The command line: its commands and their flags.
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::csi_proxy::CsiProxyArgs;
use crate::flags::LogArgs;
use crate::kubelet::{EventsArgs, KubeletArgs};
use crate::node::NodeArgs;
use crate::run::{DaemonArgs, JobArgs, ServeArgs, WatchArgs};

/// Heals the FUSE bind mounts of Kubernetes pods when the FUSE daemon behind
/// them restarts, reaching containers that are still running.
#[derive(Debug, Parser)]
#[command(version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Print the configuration the command's flags and this environment
    /// give, as JSON, and exit without running it; a FUSE_SUPERVISOR_*
    /// variable that no flag of the command reads is an error (a
    /// manifest's variable for a renamed flag).
    #[arg(long, global = true)]
    pub(crate) check_config: bool,
}

// Parsed once at start and matched once: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Watch the node and heal broken FUSE mounts as they appear.
    Run {
        #[command(flatten)]
        node: NodeArgs,
        #[command(flatten)]
        kubelet: KubeletArgs,
        // Sidecar mode and the Job lifecycle; boxed, or every command
        // would be as large as this one.
        #[command(flatten)]
        job: Box<JobArgs>,
        #[command(flatten)]
        daemons: DaemonArgs,
        #[command(flatten)]
        watch: WatchArgs,
        #[command(flatten)]
        serve: ServeArgs,
        #[command(flatten)]
        events: EventsArgs,
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
        /// Where the CSI proxies record (a host path, as `run --csi-records`):
        /// their records are listed, each stage live or waiting for its driver.
        #[arg(
            long,
            value_name = "DIR",
            default_value = "/run/fuse-supervisor-csi",
            env = "FUSE_SUPERVISOR_CSI_RECORDS"
        )]
        csi_records: PathBuf,
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
    /// Makes the node agent's calls that wait on FUSE servers, in a process
    /// of its own: a server that never answers then holds a thread of this
    /// helper, never the agent's exit. Started by `run`; not for users.
    #[command(hide = true)]
    FuseCalls {
        /// `SCHED_FIFO` priority of the call threads; 0 is off.
        #[arg(long, default_value_t = 0)]
        realtime_priority: u8,
        #[command(flatten)]
        log: LogArgs,
    },
    /// A sidecar of a CSI driver's node-plugin pod: passes the kubelet's
    /// CSI calls to the driver unchanged and records every successful
    /// NodeStageVolume and NodePublishVolume request, so a global mount
    /// can be staged again after the node plugin restarts.
    CsiProxy {
        #[command(flatten)]
        proxy: CsiProxyArgs,
        #[command(flatten)]
        log: LogArgs,
    },
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use fuse_supervisor_engine::watch::mount_table::{TableEvents, WatchMode};

    use super::*;
    use std::time::Duration;

    use crate::flags::parse_listen;

    #[test]
    fn csi_proxy_takes_its_sockets_and_records_secrets_unless_told_not_to() {
        let args = ["fuse-supervisor", "csi-proxy", "--listen", "/k.sock", "--driver-socket", "/d.sock"];
        let with_dir = |extra: &[&'static str]| {
            let mut all = args.to_vec();
            all.extend(["--record-dir", "/run/r"]);
            all.extend(extra);
            Cli::try_parse_from(all)
        };
        let Command::CsiProxy { proxy, .. } = with_dir(&[]).unwrap().command else { panic!("not csi-proxy") };
        let config = proxy.config();
        assert_eq!((config.listen.as_path(), config.record_secrets), (Path::new("/k.sock"), true));
        let Command::CsiProxy { proxy, .. } = with_dir(&["--record-secrets", "off"]).unwrap().command else {
            panic!("not csi-proxy")
        };
        assert!(!proxy.config().record_secrets);
        assert!(Cli::try_parse_from(args).is_err(), "--record-dir is required");
    }

    #[test]
    fn metrics_addr_is_an_address_or_off() {
        assert_eq!(parse_listen("0.0.0.0:9809").unwrap().0, Some("0.0.0.0:9809".parse().unwrap()));
        assert_eq!(parse_listen("[::]:9809").unwrap().0, Some("[::]:9809".parse().unwrap()));
        assert_eq!(parse_listen("off").unwrap().0, None);
        assert!(parse_listen("9809").unwrap_err().contains("ADDRESS:PORT"));
    }

    #[test]
    fn sidecar_namespaces_needs_sidecar_mode_and_takes_a_proc_root() {
        let args =
            ["fuse-supervisor", "run", "--sidecar", "--pod-uid", "u", "--sidecar-namespaces", "--proc-root", "/p"];
        let cli = Cli::try_parse_from(args).unwrap();
        let Command::Run { job, .. } = cli.command else { panic!("not run") };
        assert!(job.sidecar.sidecar_namespaces);
        assert_eq!(job.sidecar.proc_root, Path::new("/p"));
        assert!(Cli::try_parse_from(["fuse-supervisor", "run", "--sidecar-namespaces"]).is_err());
    }

    #[test]
    fn run_takes_the_mode_and_a_poll_period_above_zero() {
        let cli = Cli::try_parse_from(["fuse-supervisor", "run", "--mode", "poll", "--poll-period", "200ms"]).unwrap();
        let Command::Run { watch, serve, .. } = cli.command else { panic!("not run") };
        assert_eq!(watch.mode(), WatchMode::Poll { period: Duration::from_millis(200) });
        assert_eq!(serve.metrics_addr.0, Some("0.0.0.0:9809".parse().unwrap()));
        let defaults = Cli::try_parse_from(["fuse-supervisor", "run"]).unwrap();
        let Command::Run { watch, .. } = defaults.command else { panic!("not run") };
        assert_eq!(watch.mode(), WatchMode::Events(TableEvents::Auto));
        let fanotify = Cli::try_parse_from(["fuse-supervisor", "run", "--table-events", "fanotify"]).unwrap();
        let Command::Run { watch, .. } = fanotify.command else { panic!("not run") };
        assert_eq!(watch.mode(), WatchMode::Events(TableEvents::Fanotify));
        assert!(Cli::try_parse_from(["fuse-supervisor", "run", "--table-events", "inotify"]).is_err());
        assert!(Cli::try_parse_from(["fuse-supervisor", "run", "--mode", "poll", "--poll-period", "0s"]).is_err());
    }
}
