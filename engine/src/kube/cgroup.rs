//! Which container a process is in, from its `/proc/<pid>/cgroup`.
//!
//! Every CRI runtime puts a container's processes in a cgroup named after
//! its ID: `cri-containerd-<id>.scope` (containerd, systemd driver),
//! `.../pod<uid>/<id>` (cgroupfs driver), `crio-<id>.scope` (CRI-O),
//! `docker-<id>.scope` (cri-dockerd). The kubelet reports the same ID in
//! `containerID`, so the last component of a process's cgroup path naming
//! that ID ties process to container, on cgroup v1 and v2 alike, and from
//! inside a cgroup namespace (where the path is relative but still ends in
//! the container's directory). Nothing needs the runtime's socket.
use super::PodList;
use super::pods::runtime_id;

/// IDs shorter than this are not trusted to name one container.
pub const MIN_ID_LEN: usize = 12;

/// Whether a `/proc/<pid>/cgroup` text puts the process in container `id`.
pub fn in_container(cgroups: &str, id: &str) -> bool {
    cgroups.lines().any(|line| {
        let path = line.splitn(3, ':').nth(2).unwrap_or_default();
        let last = path.rsplit('/').next().unwrap_or_default();
        last == id || last.strip_suffix(".scope").is_some_and(|scope| scope.ends_with(&format!("-{id}")))
    })
}

/// A container of the kubelet's pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodContainer {
    pub namespace: String,
    pub pod: String,
    pub pod_uid: String,
    pub container: String,
}

/// The container of `pods` (init containers included) whose ID the
/// `/proc/<pid>/cgroup` text `cgroups` names.
pub fn container_of(cgroups: &str, pods: &PodList) -> Option<PodContainer> {
    pods.items.iter().find_map(|pod| {
        let statuses = pod.status.container_statuses.iter().chain(&pod.status.init_container_statuses);
        statuses
            .filter_map(|status| Some((status, runtime_id(status.container_id.as_deref()?))))
            .find(|(_, id)| id.len() >= MIN_ID_LEN && in_container(cgroups, id))
            .map(|(status, _)| PodContainer {
                namespace: pod.metadata.namespace.clone(),
                pod: pod.metadata.name.clone(),
                pod_uid: pod.metadata.uid.clone(),
                container: status.name.clone(),
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::{ContainerStatus, Pod};

    const ID: &str = "4f1bd2c7e0a94b5f8c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b";
    const OTHER: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";

    #[test]
    fn cgroup_paths_of_every_runtime() {
        let systemd = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-{ID}.scope\n"
        );
        assert!(in_container(&systemd, ID));
        assert!(in_container(&format!("12:memory:/kubepods/burstable/pod1234/{ID}\n1:cpu:/\n"), ID));
        assert!(in_container(&format!("0::/../crio-{ID}.scope\n"), ID));
        assert!(in_container(&format!("0::/system.slice/docker-{ID}.scope\n"), ID));
        // A sibling container's ID merely starting the same: no.
        assert!(!in_container(&format!("0::/kubepods/pod1/{ID}ff\n"), ID));
        assert!(!in_container("0::/user.slice/session-2.scope\n", ID));
    }

    fn pod(namespace: &str, name: &str, containers: &[(&str, Option<String>)], init: &[(&str, Option<String>)]) -> Pod {
        let status = |(name, id): &(&str, Option<String>)| ContainerStatus {
            name: name.to_string(),
            container_id: id.clone(),
            ..Default::default()
        };
        let mut pod = Pod::default();
        pod.metadata.namespace = namespace.into();
        pod.metadata.name = name.into();
        pod.metadata.uid = format!("uid-{name}");
        pod.status.container_statuses = containers.iter().map(status).collect();
        pod.status.init_container_statuses = init.iter().map(status).collect();
        pod
    }

    #[test]
    fn a_process_is_mapped_to_its_pod_and_container_by_its_cgroup() {
        let pods = PodList {
            items: vec![
                pod("default", "reader", &[("app", Some(format!("containerd://{OTHER}"))), ("waiting", None)], &[]),
                pod(
                    "data",
                    "trainer",
                    &[("main", Some("containerd://".into()))],
                    &[("sync", Some(format!("cri-o://{ID}")))],
                ),
            ],
            ..Default::default()
        };
        let systemd = format!("0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{OTHER}.scope\n");
        let app = PodContainer {
            namespace: "default".into(),
            pod: "reader".into(),
            pod_uid: "uid-reader".into(),
            container: "app".into(),
        };
        assert_eq!(container_of(&systemd, &pods), Some(app));
        let sidecar = PodContainer {
            namespace: "data".into(),
            pod: "trainer".into(),
            pod_uid: "uid-trainer".into(),
            container: "sync".into(),
        };
        assert_eq!(container_of(&format!("0::/../crio-{ID}.scope\n"), &pods), Some(sidecar));
        // Not a pod's container (the host's, an unshared process'), and an
        // empty ID that would match any path: no owner.
        assert_eq!(container_of("0::/system.slice/sshd.service\n", &pods), None);
        assert_eq!(container_of("0::/\n", &pods), None);
        assert_eq!(container_of(&systemd, &PodList::default()), None);
    }
}
