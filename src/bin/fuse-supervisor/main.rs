//! The `fuse-supervisor` command line: one module per command, the flags
//! they share in `cli` and `node`.
use std::process::ExitCode;

use clap::Parser;

mod check_config;
mod cli;
mod csi_proxy;
mod flags;
mod heal;
mod kubelet;
mod node;
mod run;
mod status;

use cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.check_config {
        return finish(check_config::check_config(cli.command));
    }
    finish(match cli.command {
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
    })
}

fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fuse-supervisor: {err:#}");
            ExitCode::FAILURE
        }
    }
}
