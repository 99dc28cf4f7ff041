//! `--check-config`: what a command would run with, checked as its start
//! checks it, as JSON, without running it. The manifests' contract test
//! runs every container's args and env of deploy/ through it.
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;

use clap::{CommandFactory, ValueEnum};
use fuse_supervisor_engine::flag_env;
use fuse_supervisor_engine::watch::processes::Backend;

use crate::cli::{Cli, Command};
use crate::flags::OnOff;
use crate::run::ProcessWatchArg;

/// Prints what `command` would run with, as JSON, after the checks its
/// start makes; a `FUSE_SUPERVISOR_*` variable that no flag of `command`
/// reads is an error.
pub(crate) fn check_config(command: Command) -> anyhow::Result<()> {
    let name = command_name(&command);
    let cli = Cli::command();
    let read: BTreeSet<&OsStr> = cli
        .find_subcommand(name)
        .into_iter()
        .flat_map(|sub| sub.get_arguments())
        .filter_map(|arg| arg.get_env())
        .collect();
    let unread = flag_env::unread(&read);
    anyhow::ensure!(unread.is_empty(), "`{name}` reads no {}", unread.join(", "));
    let summary = match command {
        Command::Run { node, kubelet, job, daemons, serve, events, .. } => {
            let config = node.config()?;
            let restage = daemons.restage.config(&config.kubelet_root);
            let confirmation = kubelet.confirmation()?;
            let lifecycle = job.config(confirmation.as_ref(), &config)?;
            let mode = match (job.sidecar.sidecar, job.sidecar.sidecar_namespaces) {
                (true, true) => "sidecar-namespaces",
                (true, false) => "sidecar",
                (false, _) => "node",
            };
            let connector = matches!(daemons.process_watch, ProcessWatchArg::Connector)
                || lifecycle.as_ref().is_some_and(|job| matches!(job.watcher, Backend::ProcConnector));
            let authz = kubelet.kubelet_authz.to_possible_value().map(|value| value.get_name().to_owned());
            serde_json::json!({
                "command": name,
                "mode": mode,
                "mount_namespace": config.mount_namespace,
                "kubelet_root": config.kubelet_root,
                "state_dir": config.state_dir,
                "staging_dir": config.staging_dir,
                "realtime_priority": node.realtime_priority,
                "kubelet_authz": confirmation.is_some().then_some(authz),
                "events": events.events == OnOff::On,
                "job_lifecycle": lifecycle.is_some(),
                "process_connector": connector,
                "metrics_addr": serve.metrics_addr.0,
                "restage": restage.as_ref().map(|restage| {
                    let sockets: BTreeMap<&String, std::path::PathBuf> =
                        restage.drivers.iter().map(|driver| (driver, restage.socket_of(driver))).collect();
                    serde_json::json!({ "drivers": restage.drivers, "records": restage.records, "sockets": sockets })
                }),
            })
        }
        Command::CsiProxy { proxy, .. } => {
            let config = proxy.config();
            serde_json::json!({
                "command": name,
                "proxy_listen": config.listen,
                "driver_socket": config.driver_socket,
                "record_dir": config.record_dir,
                "record_secrets": config.record_secrets,
            })
        }
        _ => serde_json::json!({ "command": name }),
    };
    println!("{summary}");
    Ok(())
}

/// The command's name on the command line.
fn command_name(command: &Command) -> &'static str {
    match command {
        Command::Run { .. } => "run",
        Command::Status { .. } => "status",
        Command::Heal { .. } => "heal",
        Command::FuseCalls { .. } => "fuse-calls",
        Command::CsiProxy { .. } => "csi-proxy",
    }
}
