//! `status`: every FUSE source and target of a table, as a person or a
//! bug report needs them.
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Serialize;

use fuse_supervisor_engine::model::state::{DaemonDeath, Journal, Owner};
use fuse_supervisor_engine::model::table::{Dev, Layout, Snapshot, TargetKind};
use fuse_supervisor_engine::plan::layout::SourceLayouts;
use fuse_supervisor_engine::plan::locate::VolDataCache;
use fuse_supervisor_engine::plan::{self, Assessment, scan};

#[derive(Debug, Serialize)]
pub struct SourceRow {
    pub path: PathBuf,
    pub fs_type: String,
    pub dev: Dev,
    pub peer_group: Option<u32>,
    pub layers: usize,
    /// The pod and container serving it, as last confirmed by the kubelet.
    pub owner: Option<Owner>,
    /// The running supervisor saw the daemon serving this mount die.
    pub daemon_died: Option<DaemonDeath>,
}

#[derive(Debug, Serialize)]
pub struct TargetRow {
    pub path: PathBuf,
    pub pod_uid: String,
    pub kind: TargetKind,
    pub state: &'static str,
    pub source: Option<PathBuf>,
    /// The layout that named the source of a target never seen as its peer
    /// (none when the peer group or the state file did).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub located_by: Option<String>,
    pub dev: Dev,
    pub peer_group: Option<u32>,
    pub layers: usize,
}

/// A CSI proxy's record of a `NodeStageVolume` or `NodePublishVolume`
/// (never its request: it holds the secrets).
#[derive(Debug, Serialize)]
pub struct CsiRecordRow {
    pub call: &'static str,
    pub driver: Option<String>,
    pub volume_id: String,
    pub path: PathBuf,
    pub secrets: fuse_supervisor_engine::csi::records::Secrets,
    pub recorded_at: String,
    /// Of a stage: `staged` (a live source at its path) or `waiting for its
    /// driver` (its daemon died, or its dead mount was detached); of a
    /// publish: `published`.
    pub state: &'static str,
}

#[derive(Debug, Serialize)]
pub struct Status {
    pub total_mounts: usize,
    pub sources: Vec<SourceRow>,
    pub targets: Vec<TargetRow>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub csi_records: Vec<CsiRecordRow>,
}

impl Status {
    /// Runs the pipeline over `snapshot` ([`scan`]) with `journal` (a copy
    /// of the state file, or an empty one): the sources of the targets no
    /// peer group maps are located by their layouts (with the
    /// `vol_data.json`s under the kubelet root where there are any, from the
    /// target path alone otherwise), and reports.
    pub fn new(snapshot: Snapshot, layout: &Layout, layouts: &SourceLayouts, journal: &mut Journal) -> Self {
        let (classified, _) = scan::classify(snapshot, layout, journal);
        let classified = &classified;
        let mut vol_data = VolDataCache::new(layout.pods_dir().to_path_buf());
        let learnt = scan::learn_and_locate(classified, layout, layouts, journal, &mut vol_data);
        let mut located_by: std::collections::HashMap<_, _> =
            learnt.located.into_iter().map(|found| (found.target, found.layout.to_string())).collect();
        let mut sources: Vec<SourceRow> = classified
            .sources
            .values()
            .map(|stack| SourceRow {
                path: stack.path.clone(),
                fs_type: stack.top().fs_type.clone(),
                dev: stack.top().dev,
                peer_group: stack.top().peer_group,
                layers: stack.layers.len(),
                owner: journal.source(&stack.path).and_then(|record| record.owner.clone()),
                daemon_died: journal.source(&stack.path).and_then(|record| record.daemon_died),
            })
            .collect();
        // A dead daemon's mount detached from its source path: no layer is
        // left there, but its targets wait for the daemon's return.
        let detached = journal.deaths().filter(|(path, _)| !classified.sources.contains_key(*path));
        sources.extend(detached.map(|(path, death)| SourceRow {
            path: path.to_path_buf(),
            fs_type: "-".to_owned(),
            dev: death.dev,
            peer_group: None,
            layers: 0,
            owner: journal.source(path).and_then(|record| record.owner.clone()),
            daemon_died: Some(*death),
        }));
        sources.sort_by(|a, b| a.path.cmp(&b.path));
        let targets = classified
            .targets
            .iter()
            .map(|(path, target)| {
                let mapping = journal.get(path);
                let assessment = plan::assess(target, mapping, classified);
                // Its daemon died and nothing replaced the mount yet: the
                // table alone would call it healthy.
                let dead = mapping
                    .and_then(|mapping| journal.source(&mapping.source))
                    .and_then(|record| record.daemon_died)
                    .is_some_and(|death| death.dev == target.stack.top().dev);
                let located_by = located_by.remove(path);
                let state = match assessment {
                    Assessment::Healthy | Assessment::SourceDown if dead => "degraded",
                    // The running supervisor would probe it; a report says
                    // what the table shows: not on its source's connection.
                    Assessment::Unknown if located_by.is_some() => Assessment::Broken.name(),
                    _ => assessment.name(),
                };
                TargetRow {
                    path: path.clone(),
                    pod_uid: target.pod_uid.clone(),
                    kind: target.kind,
                    state,
                    source: mapping.map(|m| m.source.clone()),
                    located_by,
                    dev: target.stack.top().dev,
                    peer_group: target.stack.top().peer_group,
                    layers: target.stack.layers.len(),
                }
            })
            .collect();
        Status { total_mounts: classified.total_mounts, sources, targets, csi_records: Vec::new() }
    }

    /// Adds the CSI proxies' records, each stage (and each publish of a
    /// driver without a staging step, which mounts at the pod's target)
    /// with whether its mount is live or waits for its driver (`run
    /// --restage` calls it again once the driver answers).
    pub fn with_csi_records(mut self, records: &[fuse_supervisor_engine::csi::records::Record]) -> Self {
        use fuse_supervisor_engine::csi::records::Request;
        let sources = &self.sources;
        self.csi_records = records
            .iter()
            .map(|record| {
                let path = PathBuf::from(record.request.path());
                let live = || {
                    sources.iter().any(|source| {
                        source.path == path
                            && source.layers > 0
                            && source.daemon_died.is_none_or(|death| death.dev != source.dev)
                    })
                };
                // A publish that mounts (a driver without a staging step)
                // is live or waits as a stage does.
                let state = match &record.request {
                    Request::Publish(_) if record.request.driver_mounted_target().is_none() => "published",
                    Request::Publish(_) if live() => "published",
                    Request::Stage(_) if live() => "staged",
                    _ => "waiting for its driver",
                };
                CsiRecordRow {
                    call: match record.request.call() {
                        fuse_supervisor_engine::csi::records::Call::NodeStageVolume => "stage",
                        fuse_supervisor_engine::csi::records::Call::NodePublishVolume => "publish",
                    },
                    driver: record.driver.clone(),
                    volume_id: record.request.volume_id().to_owned(),
                    path,
                    secrets: record.secrets,
                    recorded_at: record
                        .recorded_at
                        .format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default(),
                    state,
                }
            })
            .collect();
        self
    }

    pub fn broken(&self) -> usize {
        self.targets.iter().filter(|t| t.state == Assessment::Broken.name()).count()
    }

    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let group = |g: Option<u32>| g.map_or("-".to_owned(), |g| g.to_string());
        let _ = writeln!(
            out,
            "{} mounts, {} FUSE sources, {} FUSE targets",
            self.total_mounts,
            self.sources.len(),
            self.targets.len()
        );
        let _ = writeln!(out, "\nSOURCES\n{:<8} {:<6} {:<6} {:<20} PATH  (OWNER)", "DEV", "GROUP", "LAYERS", "TYPE");
        for s in &self.sources {
            let mut owner = s.owner.as_ref().map_or(String::new(), |owner| {
                format!("  ({}/{} container {})", owner.namespace, owner.pod, owner.container)
            });
            if let Some(death) = s.daemon_died.filter(|death| death.dev == s.dev) {
                let ago = death.at.elapsed().map_or(String::new(), |ago| format!(" {}s ago", ago.as_secs()));
                match death.pid {
                    // Dead before any search found it (see `died_unseen`).
                    0 => {
                        let _ = write!(owner, "  DEGRADED: daemon died{ago}, before it was found");
                    }
                    pid => {
                        let _ = write!(owner, "  DEGRADED: daemon pid {pid} died{ago}");
                    }
                }
                if s.layers == 0 {
                    owner.push_str(", its dead mount detached");
                }
            }
            let _ = writeln!(
                out,
                "{:<8} {:<6} {:<6} {:<20} {}{owner}",
                s.dev,
                group(s.peer_group),
                s.layers,
                s.fs_type,
                s.path.display()
            );
        }
        let _ = writeln!(
            out,
            "\nTARGETS\n{:<13} {:<8} {:<6} {:<6} {:<36} {:<8} PATH  <-  SOURCE",
            "STATE", "DEV", "GROUP", "LAYERS", "POD", "KIND"
        );
        for t in &self.targets {
            let kind = t.kind.name();
            let mut source = t.source.as_ref().map_or("?".to_owned(), |s| s.display().to_string());
            if let Some(layout) = &t.located_by {
                let _ = write!(source, "  (located by layout {layout})");
            }
            let _ = writeln!(
                out,
                "{:<13} {:<8} {:<6} {:<6} {:<36} {:<8} {}  <-  {}",
                t.state,
                t.dev,
                group(t.peer_group),
                t.layers,
                t.pod_uid,
                kind,
                t.path.display(),
                source
            );
        }
        if !self.csi_records.is_empty() {
            let _ = writeln!(
                out,
                "\nCSI RECORDS\n{:<22} {:<8} {:<24} {:<24} {:<9} PATH",
                "STATE", "CALL", "DRIVER", "VOLUME", "SECRETS"
            );
            for r in &self.csi_records {
                let secrets = match r.secrets {
                    fuse_supervisor_engine::csi::records::Secrets::Recorded => "recorded",
                    fuse_supervisor_engine::csi::records::Secrets::Omitted => "omitted",
                    fuse_supervisor_engine::csi::records::Secrets::None => "none",
                };
                let _ = writeln!(
                    out,
                    "{:<22} {:<8} {:<24} {:<24} {:<9} {}",
                    r.state,
                    r.call,
                    r.driver.as_deref().unwrap_or("?"),
                    r.volume_id,
                    secrets,
                    r.path.display()
                );
            }
        }
        out
    }
}
