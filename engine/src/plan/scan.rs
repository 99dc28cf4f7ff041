//! The one pipeline every program runs over a read of the mount table, in
//! this order:
//!
//! 1. [`classify`]: the FUSE mounts sorted into sources and targets, the
//!    binds of a source (a CSI staging path) told apart from the daemon's
//!    own mount;
//! 2. [`learn_and_locate`]: the mappings the peer groups show learnt into
//!    the journal, then the sources of the targets still unmapped located
//!    by their layouts (and recorded);
//! 3. the plan ([`super::plan`]) or the report (`status`) from what is
//!    known then.
//!
//! The loop, `heal --once` and `status` run it. Between steps 1 and 2 the
//! loop reports the heals that propagation made: that compares the table
//! with the journal as it was before it learns.
use std::collections::BTreeSet;

use super::layout::SourceLayouts;
use super::locate::{Located, VolDataCache, locate_unmapped};
use super::{learn, separate_source_binds};
use crate::model::state::Journal;
use crate::model::table::{Classified, Layout, Snapshot};

/// Step 1: a read of the table classified. Returns whether the journal
/// changed (binds of sources learnt or forgotten).
pub fn classify(snapshot: Snapshot, layout: &Layout, journal: &mut Journal) -> (Classified, bool) {
    let mut classified = Classified::from_snapshot(snapshot, layout);
    let changed = separate_source_binds(&mut classified, layout, journal);
    (classified, changed)
}

/// What step 2 found.
#[derive(Debug, Default)]
pub struct Learnt {
    /// Whether the journal changed.
    pub changed: bool,
    /// The targets located by a layout (recorded in the journal already).
    pub located: Vec<Located>,
    /// The pods of the targets that no layout located.
    pub unmapped_pods: BTreeSet<String>,
}

/// Step 2: learns what the peer groups show, then locates the sources of
/// the targets still unmapped by `layouts` and records them.
pub fn learn_and_locate(
    classified: &Classified,
    layout: &Layout,
    layouts: &SourceLayouts,
    journal: &mut Journal,
    vol_data: &mut VolDataCache,
) -> Learnt {
    let mut changed = learn(classified, layout, journal);
    let (located, unmapped_pods) = locate_unmapped(classified, journal, layouts, layout, vol_data);
    for found in &located {
        changed |= journal.record(&found.target, found.mapping.clone());
    }
    Learnt { changed, located, unmapped_pods }
}
