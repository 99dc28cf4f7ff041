//! The `fuse-supervisor` command line.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fuse_supervisor::demofs::{self, DemoFsOptions};
use fuse_supervisor::testbed::container::{self, ContainerOptions};

#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Building blocks of the demo and the tests; not for users.
    #[command(hide = true, subcommand)]
    Internal(Internal),
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
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
