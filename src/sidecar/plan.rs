//! Which stale FUSE mounts of the pod's containers to heal, and from which
//! live mount: a pure function of what one scan of the pod's processes saw.
use std::collections::{BTreeMap, BTreeSet};

use fuse_supervisor_engine::heal::in_namespace::{InNamespaceHeal, LiveSource};
use fuse_supervisor_engine::model::table::{Dev, FuseMount, root_within};

/// A mount namespace of the pod, as one scan saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceView {
    /// The namespace's inode (`stat /proc/<pid>/ns/mnt`): its identity.
    pub id: u64,
    /// A process in it, through which it is read and entered.
    pub pid: u32,
    pub mounts: Vec<ObservedMount>,
}

/// A FUSE mount and whether a live daemon serves its connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedMount {
    pub mount: FuseMount,
    pub serving: Serving,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serving {
    /// A daemon in this very namespace serves it: a live source.
    FromHere,
    /// A daemon elsewhere serves it: a healthy copy.
    FromElsewhere,
    /// No process holds its connection: the daemon is gone.
    Nobody,
}

/// What a scan calls for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SidecarPlan {
    pub heals: Vec<InNamespaceHeal>,
    /// Stale mounts of application containers with no live mount of the
    /// same filesystem anywhere yet (the daemon has not come back).
    pub waiting: Vec<(u64, FuseMount)>,
}

/// The filesystem a FUSE mount shows: the same type and source field is
/// the same storage, whichever connection serves it.
fn filesystem(mount: &FuseMount) -> (&str, &str) {
    (&mount.fs_type, &mount.source)
}

/// `namespaces` are every mount namespace of the pod except the
/// supervisor's own. Those where a daemon serves a mount are FUSE
/// containers; the others are application containers, whose dead FUSE
/// mounts are healed from a live mount of the same filesystem.
pub fn plan(namespaces: &[NamespaceView]) -> SidecarPlan {
    let mut live: BTreeMap<(&str, &str), Vec<LiveSource>> = BTreeMap::new();
    for namespace in namespaces {
        for observed in namespace.mounts.iter().filter(|observed| observed.serving == Serving::FromHere) {
            live.entry(filesystem(&observed.mount)).or_default().push(LiveSource {
                namespace: namespace.id,
                pid: namespace.pid,
                mount: observed.mount.clone(),
            });
        }
    }
    let fuse_namespaces: BTreeSet<u64> = live.values().flatten().map(|source| source.namespace).collect();
    let mut plan = SidecarPlan::default();
    let apps = namespaces.iter().filter(|namespace| !fuse_namespaces.contains(&namespace.id));
    for namespace in apps {
        for observed in namespace.mounts.iter().filter(|observed| observed.serving == Serving::Nobody) {
            let target = &observed.mount;
            let candidates = live.get(&filesystem(target)).map_or(&[][..], Vec::as_slice);
            // The source whose root contains the target's, the closest first:
            // a whole-filesystem mount serves every subPath.
            let chosen = candidates
                .iter()
                .filter(|source| source.mount.dev != target.dev)
                .filter_map(|source| Some((root_within(&source.mount.root, &target.root)?, source)))
                .min_by_key(|(subdir, source)| (subdir.components().count(), source.mount.mount_id));
            match chosen {
                Some((subdir, source)) => plan.heals.push(InNamespaceHeal {
                    source: source.clone(),
                    subdir,
                    namespace: namespace.id,
                    pid: namespace.pid,
                    target: target.clone(),
                    target_unique_id: None,
                }),
                None => plan.waiting.push((namespace.id, target.clone())),
            }
        }
    }
    plan
}

/// Devices of the mounts a plan heals from, by namespace: the daemons to
/// watch are those serving them.
pub fn live_devices(namespaces: &[NamespaceView]) -> Vec<Dev> {
    let mut devices: Vec<Dev> = namespaces
        .iter()
        .flat_map(|namespace| &namespace.mounts)
        .filter(|observed| observed.serving == Serving::FromHere)
        .map(|observed| observed.mount.dev)
        .collect();
    devices.sort_unstable();
    devices.dedup();
    devices
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use fuse_supervisor_engine::model::table::Snapshot;

    /// The FUSE container: its daemon's new mount (0:77) over nothing, the
    /// old one gone.
    const FUSE_CONTAINER: &str = "\
1 0 0:20 / / rw - overlay overlay rw
50 1 0:77 / /mnt/fuse rw,nosuid,nodev - fuse.demofs demofs rw,user_id=0,group_id=0
";
    /// An application container: the volume (0:55, dead) and a subPath of it.
    const APP: &str = "\
2 0 0:21 / / rw - overlay overlay rw
60 2 0:55 / /data rw,nosuid,nodev master:3 - fuse.demofs demofs rw,user_id=0,group_id=0
61 2 0:55 /sub /sub-data rw,nosuid,nodev - fuse.demofs demofs rw,user_id=0,group_id=0
62 2 0:56 / /other rw,nosuid,nodev - fuse.sshfs host:/x rw,user_id=0,group_id=0
";

    fn view(id: u64, pid: u32, table: &str, serving: impl Fn(&FuseMount) -> Serving) -> NamespaceView {
        let snapshot = Snapshot::parse(table.as_bytes()).unwrap();
        let mounts =
            snapshot.fuse_mounts.into_iter().map(|mount| ObservedMount { serving: serving(&mount), mount }).collect();
        NamespaceView { id, pid, mounts }
    }

    fn live_is(dev: u32) -> impl Fn(&FuseMount) -> Serving {
        move |mount| if mount.dev.minor == dev { Serving::FromHere } else { Serving::Nobody }
    }

    #[test]
    fn dead_volume_and_subpath_are_healed_from_the_live_mount() {
        let namespaces = [view(10, 100, FUSE_CONTAINER, live_is(77)), view(20, 200, APP, |_| Serving::Nobody)];
        let plan = plan(&namespaces);
        let heals: Vec<(&str, &str, u32, u32)> = plan
            .heals
            .iter()
            .map(|heal| {
                (
                    heal.target.mount_point.to_str().unwrap(),
                    heal.subdir.to_str().unwrap(),
                    heal.source.mount.mount_id,
                    heal.pid,
                )
            })
            .collect();
        assert_eq!(heals, [("/data", "", 50, 200), ("/sub-data", "sub", 50, 200)]);
        assert!(plan.heals.iter().all(|heal| heal.source.pid == 100 && heal.namespace == 20));
        // sshfs has no live mount of its own filesystem: it waits.
        assert_eq!(plan.waiting.len(), 1);
        assert_eq!(plan.waiting[0].1.mount_point, PathBuf::from("/other"));
    }

    #[test]
    fn nothing_is_healed_while_the_daemon_is_gone() {
        let namespaces = [view(10, 100, FUSE_CONTAINER, |_| Serving::Nobody), view(20, 200, APP, |_| Serving::Nobody)];
        let plan = plan(&namespaces);
        assert!(plan.heals.is_empty());
        // Without a live daemon nothing marks the FUSE container as one:
        // its dead mount waits beside the application's three.
        assert_eq!(plan.waiting.len(), 4);
    }

    #[test]
    fn served_copies_and_the_fuse_container_are_left_alone() {
        let healthy = view(20, 200, APP, |_| Serving::FromElsewhere);
        // The FUSE container also holds a dead old mount: never a target.
        let fuse = FUSE_CONTAINER.to_owned() + "51 1 0:55 / /mnt/old rw - fuse.demofs demofs rw\n";
        let namespaces = [view(10, 100, &fuse, live_is(77)), healthy];
        let plan = plan(&namespaces);
        assert_eq!(plan, SidecarPlan::default());
        assert_eq!(live_devices(&namespaces), [Dev { major: 0, minor: 77 }]);
    }

    #[test]
    fn a_subpath_source_serves_only_what_lies_inside_it() {
        // The live mount is itself rooted at /sub: the whole-volume target
        // cannot come from it, the subPath one can (from its root).
        let fuse = "50 1 0:77 /sub /mnt/fuse rw - fuse.demofs demofs rw\n";
        let namespaces = [view(10, 100, fuse, live_is(77)), view(20, 200, APP, |_| Serving::Nobody)];
        let plan = plan(&namespaces);
        assert_eq!(plan.heals.len(), 1);
        assert_eq!(plan.heals[0].target.mount_point, PathBuf::from("/sub-data"));
        assert_eq!(plan.heals[0].subdir, PathBuf::new());
        assert_eq!(plan.waiting.len(), 2);
    }
}
