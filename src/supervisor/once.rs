//! `heal --once`: one scan, its plan printed, carried out unless dry.
use std::collections::BTreeSet;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;

use fuse_supervisor_sys::ns;

use fuse_supervisor_engine::errors::error_chain;
use fuse_supervisor_engine::heal::probe::ProbeOutcome;
use fuse_supervisor_engine::heal::{Executor, Prepared};
use fuse_supervisor_engine::model::mountinfo::MountInfoReader;
use fuse_supervisor_engine::model::source::TextTable;
use fuse_supervisor_engine::model::table::TargetKind;
use fuse_supervisor_engine::plan;

use super::{Config, Event, Supervisor, SupervisorError};

/// What `heal --once` did.
#[derive(Debug, Default)]
pub struct OnceSummary {
    pub planned: usize,
    pub healed: usize,
    pub failed: usize,
}

/// One scan: prints the plan to `out` and, unless `dry_run`, carries it
/// out. Like `run`, it moves the calling thread into the namespace.
pub fn heal_once(config: &Config, dry_run: bool, out: &mut dyn io::Write) -> Result<OnceSummary, SupervisorError> {
    ns::join_mount_namespace(&config.mount_namespace)
        .map_err(|source| SupervisorError::Namespace { path: config.mount_namespace.clone(), source })?;
    let reader = MountInfoReader::open(Path::new("/proc/thread-self/mountinfo"))
        .map_err(|source| SupervisorError::Open { what: "/proc/thread-self/mountinfo".into(), source })?;
    let (events, inbox) = mpsc::channel();
    let mut supervisor = Supervisor::new(config, Box::new(TextTable::new(reader)), events, Arc::default())?;
    let mut summary = OnceSummary::default();
    let Some(classified) = supervisor.read_table() else { return Ok(summary) };
    // The read may have learned binds of sources too; the targets no peer
    // group maps are located by their layouts, as `run` and `status` do.
    if supervisor.learn_and_locate(&classified) | supervisor.state_dirty {
        supervisor.journal.save()?;
    }
    let batches = plan::plan(&classified, &supervisor.journal, &BTreeSet::new());
    let _ = writeln!(
        out,
        "{} broken target(s) in {} source(s)",
        batches.iter().map(|b| b.targets.len()).sum::<usize>(),
        batches.len()
    );
    for batch in &batches {
        for target in &batch.targets {
            summary.planned += 1;
            let owner = match target.kind {
                TargetKind::SourceBind => "a bind of the source".to_owned(),
                _ => format!("pod {}", target.pod_uid),
            };
            let _ = writeln!(
                out,
                "  {} ({owner}) <- {}{}{}",
                target.path.display(),
                batch.source.path.display(),
                if target.root_in_source.as_os_str().is_empty() { "" } else { "/" },
                target.root_in_source.display()
            );
        }
    }
    if dry_run {
        return Ok(summary);
    }
    for batch in &batches {
        supervisor.start_probe(batch);
        let report = match inbox.recv_timeout(config.probe_timeout) {
            Ok(Event::Probed(report)) => report,
            _ => {
                let _ = writeln!(
                    out,
                    "source {} did not answer within {:?}; not healed",
                    batch.source.path.display(),
                    config.probe_timeout
                );
                summary.failed += batch.targets.len();
                continue;
            }
        };
        let ProbeOutcome::Live(handles) = report.outcome else {
            let _ = writeln!(out, "source {} is not serving; not healed", batch.source.path.display());
            summary.failed += batch.targets.len();
            continue;
        };
        for outcome in supervisor.executor.heal(batch, Prepared::default(), &handles) {
            match outcome.result {
                Ok(_) => {
                    summary.healed += 1;
                    let _ = writeln!(
                        out,
                        "healed {} ({} stale layer(s) removed)",
                        outcome.path.display(),
                        outcome.layers_removed
                    );
                }
                Err(err) => {
                    summary.failed += 1;
                    let _ = writeln!(out, "failed {}: {}", outcome.path.display(), error_chain(&err));
                }
            }
        }
    }
    if let Some(classified) = supervisor.read_table()
        && (supervisor.learn_and_locate(&classified) | supervisor.state_dirty)
    {
        supervisor.journal.save()?;
    }
    Ok(summary)
}
