//! `status`: every FUSE source and target of a table, as a person or a
//! bug report needs them.
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Serialize;

use crate::model::state::{DaemonDeath, Journal, Owner};
use crate::model::table::{Classified, Dev, Layout, TargetKind};
use crate::plan::layout::SourceLayouts;
use crate::plan::locate::{self, VolDataCache};
use crate::plan::{self, Assessment};

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

#[derive(Debug, Serialize)]
pub struct Status {
    pub total_mounts: usize,
    pub sources: Vec<SourceRow>,
    pub targets: Vec<TargetRow>,
}

impl Status {
    /// Learns what it can from the table into `journal` (a copy of the
    /// state file, or an empty one), locates the sources of the targets it
    /// still has no mapping for by their layouts (with the `vol_data.json`s
    /// under the kubelet root where there are any, from the target path
    /// alone otherwise) and reports.
    pub fn new(classified: &mut Classified, layout: &Layout, layouts: &SourceLayouts, journal: &mut Journal) -> Self {
        plan::separate_source_binds(classified, layout, journal);
        let classified = &*classified;
        plan::learn(classified, layout, journal);
        let mut vol_data = VolDataCache::new(layout.pods_dir().to_path_buf());
        let (located, _) = locate::locate_unmapped(classified, journal, layouts, layout, &mut vol_data);
        let mut located_by = std::collections::HashMap::new();
        for found in located {
            located_by.insert(found.target.clone(), found.layout.to_string());
            journal.record(&found.target, found.mapping);
        }
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
        Status { total_mounts: classified.total_mounts, sources, targets }
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
        out
    }
}
