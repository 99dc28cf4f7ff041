//! The `fuse-supervisor` command line: one module per command, the flags
//! they share in `cli` and `node`.
use std::process::ExitCode;

use clap::Parser;

mod cli;
mod csi_proxy;
mod flags;
mod heal;
mod kubelet;
mod node;
mod run;
mod status;
#[cfg(feature = "testbed")]
mod testbed;
mod webhook;

use cli::{Cli, Command};

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Run { node, kubelet, job, daemons, watch, serve, events, log } => {
            run::command(node, kubelet, *job, daemons, watch, serve, events, log)
        }
        Command::Status { node, json, mountinfo, csi_records } => {
            status::status(&node, json, mountinfo.as_deref(), &csi_records)
        }
        Command::Heal { node, log, dry_run, .. } => {
            log.init();
            node::prepare_process();
            node.config().and_then(|config| heal::heal_once(&config, dry_run))
        }
        Command::FuseCalls { realtime_priority, log } => {
            log.init();
            run::serve_fuse_calls(realtime_priority)
        }
        Command::CsiProxy { proxy, log } => {
            log.init();
            csi_proxy::command(proxy)
        }
        Command::Webhook { webhook, log } => {
            log.init();
            fuse_supervisor::webhook::run(webhook.config()).map_err(Into::into)
        }
        #[cfg(feature = "testbed")]
        Command::Demo { cycles, daemon, no_mount_over_stale } => testbed::demo(cycles, daemon, !no_mount_over_stale),
        #[cfg(feature = "testbed")]
        Command::Internal(command) => testbed::internal(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fuse-supervisor: {err:#}");
            ExitCode::FAILURE
        }
    }
}
