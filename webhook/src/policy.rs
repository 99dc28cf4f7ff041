//! Which volume mounts of a pod get `mountPropagation: HostToContainer`:
//! a pure function of the pod, the selection and the volume cache.
//!
//! A heal reaches a running container only through a slave mount, which is
//! what HostToContainer makes; with the default (None, a private mount) the
//! container keeps the dead FUSE connection until it restarts.
use std::collections::{HashMap, HashSet};

use json_patch::jsonptr::{PointerBuf, Token};
use k8s_openapi::api::core::v1::{Container, Pod, Volume, VolumeMount};

use super::cache::{Unresolved, Verdict, VolumeCache};
use super::selection::Selection;

/// The value written where `mountPropagation` is absent.
pub const HOST_TO_CONTAINER: &str = "HostToContainer";

/// Which containers of the pod may be changed.
#[derive(Debug, Clone, Copy)]
pub enum Scope<'a> {
    /// Pod CREATE: every container, init container and ephemeral container.
    WholePod,
    /// An update of the `ephemeralcontainers` subresource: only the
    /// ephemeral containers not in the old pod (the others are immutable).
    NewEphemeral { old: &'a Pod },
}

/// One mount to change: `/spec/<field>/<index>/volumeMounts/<mount>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountChange {
    /// `initContainers`, `containers` or `ephemeralContainers`.
    pub field: &'static str,
    pub index: usize,
    pub mount: usize,
    pub container: String,
    pub volume: String,
}

impl MountChange {
    /// The JSON pointer of the `mountPropagation` field to add.
    pub fn pointer(&self) -> PointerBuf {
        PointerBuf::from_tokens([
            Token::from("spec"),
            Token::from(self.field),
            Token::from(self.index),
            Token::from("volumeMounts"),
            Token::from(self.mount),
            Token::from("mountPropagation"),
        ])
    }
}

/// What to do with one pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub changes: Vec<MountChange>,
    /// Mounts (of volumes that might be selected) left alone because the
    /// volume's driver is not known now, with the reason, once per volume.
    pub unresolved: Vec<(String, Unresolved)>,
    /// The pod carries the opt-out annotation: nothing was looked at.
    pub opted_out: bool,
}

/// The plan for one pod in `namespace`.
pub fn plan(pod: &Pod, namespace: &str, scope: Scope<'_>, selection: &Selection, cache: &VolumeCache) -> Plan {
    let opted_out = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(selection.opt_out_annotation()))
        .is_some_and(|value| value.eq_ignore_ascii_case("true"));
    if opted_out {
        return Plan { opted_out: true, ..Plan::default() };
    }
    let Some(spec) = &pod.spec else {
        return Plan::default();
    };
    // One verdict per volume, asked only when a mount in scope uses it.
    let volumes: HashMap<&str, &Volume> = spec.volumes.iter().flatten().map(|v| (v.name.as_str(), v)).collect();
    let mut verdicts: HashMap<&str, Verdict> = HashMap::new();
    let mut plan = Plan::default();

    let old_ephemeral: Option<HashSet<&str>> = match scope {
        Scope::WholePod => None,
        Scope::NewEphemeral { old } => Some(
            old.spec
                .iter()
                .flat_map(|spec| spec.ephemeral_containers.iter().flatten())
                .map(|c| c.name.as_str())
                .collect(),
        ),
    };
    let mut groups: Vec<(&'static str, ContainerMounts<'_>)> = Vec::with_capacity(3);
    if old_ephemeral.is_none() {
        groups.push(("initContainers", spec.init_containers.iter().flatten().map(container_mounts).collect()));
        groups.push(("containers", spec.containers.iter().map(container_mounts).collect()));
    }
    groups.push((
        "ephemeralContainers",
        spec.ephemeral_containers
            .iter()
            .flatten()
            .map(|c| (c.name.as_str(), c.volume_mounts.as_deref().unwrap_or_default()))
            .collect(),
    ));

    for (field, containers) in groups {
        for (index, (container, mounts)) in containers.into_iter().enumerate() {
            if old_ephemeral.as_ref().is_some_and(|old| old.contains(container)) {
                continue;
            }
            for (mount_index, mount) in mounts.iter().enumerate() {
                // An explicit value, None and Bidirectional included, is the user's.
                if mount.mount_propagation.is_some() {
                    continue;
                }
                let Some(volume) = volumes.get(mount.name.as_str()) else {
                    continue;
                };
                let verdict = *verdicts
                    .entry(volume.name.as_str())
                    .or_insert_with(|| volume_verdict(volume, namespace, selection, cache));
                match verdict {
                    Verdict::Selected => plan.changes.push(MountChange {
                        field,
                        index,
                        mount: mount_index,
                        container: container.to_owned(),
                        volume: volume.name.clone(),
                    }),
                    Verdict::NotSelected => {}
                    Verdict::Unresolved(reason) => {
                        if !plan.unresolved.iter().any(|(name, _)| *name == volume.name) {
                            plan.unresolved.push((volume.name.clone(), reason));
                        }
                    }
                }
            }
        }
    }
    plan
}

/// Each container's name and mounts, in the order of the pod spec.
type ContainerMounts<'p> = Vec<(&'p str, &'p [VolumeMount])>;

fn container_mounts(container: &Container) -> (&str, &[VolumeMount]) {
    (container.name.as_str(), container.volume_mounts.as_deref().unwrap_or_default())
}

fn volume_verdict(volume: &Volume, namespace: &str, selection: &Selection, cache: &VolumeCache) -> Verdict {
    if let Some(csi) = &volume.csi {
        // An inline CSI volume names its driver; no cache needed.
        return if selection.has_driver(&csi.driver) { Verdict::Selected } else { Verdict::NotSelected };
    }
    if let Some(claim) = &volume.persistent_volume_claim {
        return cache.claim_verdict(namespace, &claim.claim_name, selection);
    }
    if let Some(template) = volume.ephemeral.as_ref().and_then(|ephemeral| ephemeral.volume_claim_template.as_ref()) {
        // A generic ephemeral volume: its claim is made after the pod, from
        // this template, so the class decides.
        return cache.class_verdict(template.spec.storage_class_name.as_deref(), selection);
    }
    Verdict::NotSelected
}
