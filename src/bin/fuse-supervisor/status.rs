//! `status`: every FUSE source and target, live or from a captured table.
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use fuse_supervisor::status::Status;
use fuse_supervisor_engine::model::state::Journal;
use fuse_supervisor_engine::model::table::{Layout, Snapshot};

use crate::node::NodeArgs;

pub(crate) fn status(node: &NodeArgs, json: bool, mountinfo: Option<&Path>, csi_records: &Path) -> anyhow::Result<()> {
    // Checked as `run` checks it, so that a broken file shows before it is
    // deployed; the report locates by them the sources of targets that no
    // peer group or state file maps.
    let layouts = node.layouts()?;
    let table = match mountinfo {
        Some(file) => fs::read(file).with_context(|| format!("cannot read {}", file.display()))?,
        None => read_namespace_table(&node.mount_namespace)?,
    };
    let snapshot = Snapshot::parse(&table).with_context(|| match mountinfo {
        Some(file) => format!("in {}", file.display()),
        None => "in the live mount table".to_owned(),
    })?;
    // Live only: a captured table comes without the node's records.
    let records = match mountinfo {
        None => read_namespace_records(&node.mount_namespace, csi_records),
        Some(_) => Vec::new(),
    };
    let mut layout = Layout::new(&node.kubelet_root);
    // A driver without a staging step mounts at the pods' targets: each is
    // a source, as `run --restage` takes it.
    layout.set_driver_mounted(
        records.iter().filter_map(|record| record.request.driver_mounted_target()).map(PathBuf::from).collect(),
    );
    // The state file tells where stale targets came from (offline too, when
    // the report came with one); without it only peer groups can. A bad one
    // is only reported (with where it is bad): `status` changes nothing.
    let mut journal = match Journal::load(&node.state_dir) {
        Ok(journal) => journal,
        Err(err) => {
            eprintln!("fuse-supervisor: {:#}; going on without it", anyhow::Error::new(err));
            Journal::in_memory()
        }
    };
    let mut status = Status::new(snapshot, &layout, &layouts, &mut journal);
    if mountinfo.is_none() {
        status = status.with_csi_records(&records);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", status.to_text());
    }
    Ok(())
}

/// The CSI proxies' records under `dir` in the namespace, none where there
/// is no such directory (no proxy on the node) or it cannot be read (said).
fn read_namespace_records(namespace: &Path, dir: &Path) -> Vec<fuse_supervisor_engine::csi::records::Record> {
    let (namespace, dir) = (namespace.to_path_buf(), dir.to_path_buf());
    let read = std::thread::spawn(move || {
        fuse_supervisor_sys::ns::join_mount_namespace(&namespace).ok()?;
        match fuse_supervisor_engine::csi::restage::read_records(&dir) {
            Ok(records) => Some(records),
            Err(fuse_supervisor_engine::csi::records::RecordError::ReadDir { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Some(Vec::new())
            }
            Err(err) => {
                eprintln!("fuse-supervisor: {:#}; CSI records not shown", anyhow::Error::new(err));
                None
            }
        }
    });
    read.join().ok().flatten().unwrap_or_default()
}

/// Reads the mount table of a namespace from a thread that joined it.
pub(crate) fn read_namespace_table(namespace: &Path) -> anyhow::Result<Vec<u8>> {
    let namespace = namespace.to_path_buf();
    std::thread::spawn(move || -> anyhow::Result<Vec<u8>> {
        fuse_supervisor_sys::ns::join_mount_namespace(&namespace)
            .with_context(|| format!("cannot join mount namespace {}", namespace.display()))?;
        fs::read("/proc/thread-self/mountinfo").context("cannot read /proc/thread-self/mountinfo")
    })
    .join()
    .map_err(|_| anyhow::anyhow!("namespace reader panicked"))?
}
