//! Confirming through the kubelet that a source's owner really restarted
//! before its targets are rebound onto the new mount.
//!
//! The owner of a global mount is the container that made it: the one on
//! this node whose hostPath volume contains the mount path with
//! Bidirectional propagation, or, for a FUSE sidecar, the container of the
//! target's own pod that mounts with Bidirectional propagation.
use std::io;
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::error;

use crate::kube::pods::{Container, ContainerStatus, Pod, PodList};
use crate::kube::{KubeletClient, KubeletError};
use crate::model::state::Owner;

/// One `/pods` call and how long it took.
pub struct Answer {
    pub pods: Result<PodList, KubeletError>,
    pub took: Duration,
}

/// Calls the kubelet on a thread of its own, one call at a time, so a slow
/// kubelet never holds up the loop. Requests made while a call is running
/// are folded into one more call after it.
pub struct Asker {
    /// Dropping it ends the thread after its current call; nobody waits
    /// for that (a call may take up to the kubelet timeout).
    requests: Option<Sender<()>>,
    in_flight: bool,
    asked_again: bool,
}

impl Asker {
    /// Starts the thread; every answer is passed to `deliver`, which
    /// returns false when nobody listens any more.
    pub fn spawn(client: KubeletClient, deliver: impl Fn(Answer) -> bool + Send + 'static) -> io::Result<Self> {
        let (requests, inbox) = mpsc::channel::<()>();
        std::thread::Builder::new().name("kubelet".into()).spawn(move || {
            while inbox.recv().is_ok() {
                let started = Instant::now();
                let pods = client.pods();
                if !deliver(Answer { pods, took: started.elapsed() }) {
                    return;
                }
            }
        })?;
        Ok(Asker { requests: Some(requests), in_flight: false, asked_again: false })
    }

    /// Asks for a fresh `/pods` answer.
    pub fn ask(&mut self) {
        if self.in_flight {
            self.asked_again = true;
            return;
        }
        if let Some(requests) = &self.requests
            && requests.send(()).is_ok()
        {
            self.in_flight = true;
        } else {
            error!("kubelet thread is gone");
        }
    }

    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Notes that an answer arrived; asks again if that was requested.
    pub fn answered(&mut self) {
        self.in_flight = false;
        if std::mem::take(&mut self.asked_again) {
            self.ask();
        }
    }
}

/// What one `/pods` answer says about a replaced source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The owner's container started after the replaced mount appeared.
    Restarted(Owner),
    /// The owner is known but shows no restart yet (the kubelet's status
    /// lags the container by up to a relist period).
    NotYet(Owner),
    /// No pod on this node owns the source: a daemon outside Kubernetes,
    /// or a pod the kubelet no longer lists.
    NoOwner,
}

/// Finds the owner of `source` in `pods`; see [`owners_of`].
pub fn owner_of<'a>(pods: &'a PodList, source: &Path, target_pods: &[&str]) -> Option<(&'a Pod, &'a Container)> {
    owners_of(pods, source, target_pods).into_iter().next()
}

/// The pods that may own `source`, equally likely, in list order. Pods
/// named in `target_pods` (the UIDs of the broken targets' pods) are
/// searched for a FUSE sidecar when no hostPath owner exists.
///
/// The deepest hostPath wins: a FUSE pod mounting /var/lib/juicefs/volume
/// owns its mounts over a CSI node plugin mounting all of /var/lib. At equal
/// depth (every JuiceFS mount pod, and the JuiceFS CSI node pod, mount
/// /var/lib/juicefs/volume), a pod whose name carries the directory the
/// source lies in below the hostPath wins: mount pods are named after it.
pub fn owners_of<'a>(pods: &'a PodList, source: &Path, target_pods: &[&str]) -> Vec<(&'a Pod, &'a Container)> {
    let live = || pods.items.iter().filter(|pod| !is_finished(pod));
    let mut ranked: Vec<((usize, bool), &Pod, &Container)> = live()
        .flat_map(|pod| {
            pod.bidirectional_host_paths().filter_map(move |mount| {
                let host = Path::new(mount.host_path);
                let below = source.strip_prefix(host).ok()?;
                let named = below
                    .components()
                    .next()
                    .and_then(|first| first.as_os_str().to_str())
                    .is_some_and(|first| pod.metadata.name.contains(first));
                Some(((host.components().count(), named), pod, pod.container(mount.container)?))
            })
        })
        .collect();
    if let Some(best) = ranked.iter().map(|(rank, _, _)| *rank).max() {
        ranked.retain(|(rank, _, _)| *rank == best);
        return ranked.into_iter().map(|(_, pod, container)| (pod, container)).collect();
    }
    live()
        .filter(|pod| target_pods.contains(&pod.metadata.uid.as_str()))
        .filter_map(|pod| {
            let mut containers = pod.spec.containers.iter().chain(&pod.spec.init_containers);
            Some((pod, containers.find(|c| c.volume_mounts.iter().any(|m| m.is_bidirectional()))?))
        })
        .collect()
}

fn is_finished(pod: &Pod) -> bool {
    matches!(pod.status.phase.as_deref(), Some("Succeeded" | "Failed"))
}

/// Judges whether the owner of `source` restarted after the replaced mount
/// was first seen (`replaced_seen`; None when the supervisor never saw it).
/// `known` is the owner recorded at the last confirmation.
pub fn judge(
    pods: &PodList,
    source: &Path,
    target_pods: &[&str],
    replaced_seen: Option<SystemTime>,
    known: Option<&Owner>,
) -> Verdict {
    let owners = owners_of(pods, source, target_pods);
    let verdicts = owners.iter().map(|(pod, container)| {
        let status = pod.container_status(&container.name);
        let owner = Owner {
            namespace: pod.metadata.namespace.clone(),
            pod: pod.metadata.name.clone(),
            pod_uid: pod.metadata.uid.clone(),
            container: container.name.clone(),
            container_id: status.and_then(|status| status.container_id.clone()),
            started_at: status.filter(|status| status.is_running()).and_then(ContainerStatus::started_at),
        };
        match status {
            Some(status) if restarted(status, &owner, replaced_seen, known) => Verdict::Restarted(owner),
            _ => Verdict::NotYet(owner),
        }
    });
    // Of owners equally likely, the one that restarted is the one that
    // mounted anew; none restarted: the first is reported as waited for.
    let mut first = None;
    for verdict in verdicts {
        if matches!(verdict, Verdict::Restarted(_)) {
            return verdict;
        }
        first.get_or_insert(verdict);
    }
    first.unwrap_or(Verdict::NoOwner)
}

/// A running container restarted if it is not the container last
/// confirmed, or if it started after the replaced mount appeared, or if its
/// previous run ended after that. Kubelet timestamps have one-second
/// precision: a start is compared strictly against the precise sighting
/// (the old container started before it mounted, so it never passes), an
/// end against the sighting's whole second.
fn restarted(
    status: &ContainerStatus,
    owner: &Owner,
    replaced_seen: Option<SystemTime>,
    known: Option<&Owner>,
) -> bool {
    if !status.is_running() {
        return false;
    }
    // Another pod (a replaced DaemonSet pod) is caught by its start time.
    if let Some(known) = known
        && known.pod_uid == owner.pod_uid
        && known.container == owner.container
        && known.container_id.is_some()
        && known.container_id != owner.container_id
    {
        return true;
    }
    let Some(seen) = replaced_seen else {
        // Never saw the old mount (started after the crash): any earlier
        // termination of this container is the best evidence there is.
        return status.last_state.terminated.is_some();
    };
    let started_later = owner.started_at.is_some_and(|started| started > seen);
    let ended_later = status
        .last_state
        .terminated
        .as_ref()
        .and_then(|terminated| terminated.finished_at)
        .is_some_and(|finished| finished.0 >= whole_second(seen));
    started_later || ended_later
}

fn whole_second(at: SystemTime) -> SystemTime {
    let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    UNIX_EPOCH + Duration::from_secs(since_epoch.as_secs())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const SOURCE: &str = "/var/lib/juicefs/volume/pvc-1-abc";

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn rfc3339(secs: u64) -> String {
        crate::kube::pods::Timestamp(at(secs)).to_string()
    }

    /// A FUSE pod publishing through a Bidirectional hostPath, and an app
    /// pod (uid "app") with a FUSE sidecar of its own.
    fn pods(started: u64, container_id: &str, last_finished: Option<u64>) -> PodList {
        let last_state = match last_finished {
            Some(finished) => json!({"terminated": {"exitCode": 137, "finishedAt": rfc3339(finished)}}),
            None => json!({}),
        };
        serde_json::from_value(json!({"items": [
            {
                "metadata": {"name": "csi-node", "namespace": "kube-system", "uid": "csi"},
                "spec": {
                    "volumes": [{"name": "lib", "hostPath": {"path": "/var/lib"}}],
                    "containers": [{"name": "plugin", "volumeMounts": [
                        {"name": "lib", "mountPath": "/var/lib", "mountPropagation": "Bidirectional"}]}]
                },
                "status": {"phase": "Running", "containerStatuses": [{"name": "plugin", "containerID": "containerd://p",
                    "state": {"running": {"startedAt": rfc3339(10)}}}]}
            },
            {
                "metadata": {"name": "juicefs-mount", "namespace": "kube-system", "uid": "mount"},
                "spec": {
                    "volumes": [{"name": "jfs", "hostPath": {"path": "/var/lib/juicefs/volume"}}],
                    "containers": [{"name": "jfs-mount", "volumeMounts": [
                        {"name": "jfs", "mountPath": "/jfs", "mountPropagation": "Bidirectional"}]}]
                },
                "status": {"phase": "Running", "containerStatuses": [{"name": "jfs-mount", "containerID": container_id,
                    "restartCount": 1, "state": {"running": {"startedAt": rfc3339(started)}}, "lastState": last_state}]}
            },
            {
                "metadata": {"name": "app", "namespace": "default", "uid": "app"},
                "spec": {
                    "volumes": [{"name": "cache", "emptyDir": {}}],
                    "containers": [
                        {"name": "main", "volumeMounts": [{"name": "cache", "mountPath": "/data", "mountPropagation": "HostToContainer"}]},
                        {"name": "fuse", "volumeMounts": [{"name": "cache", "mountPath": "/mnt", "mountPropagation": "Bidirectional"}]}
                    ]
                },
                "status": {"phase": "Running", "containerStatuses": [
                    {"name": "fuse", "containerID": "containerd://s", "state": {"running": {"startedAt": rfc3339(started)}}}]}
            }
        ]}))
        .unwrap()
    }

    #[test]
    fn the_deepest_bidirectional_host_path_owns_the_source() {
        let pods = pods(100, "containerd://b", None);
        let (pod, container) = owner_of(&pods, Path::new(SOURCE), &[]).unwrap();
        assert_eq!((pod.metadata.name.as_str(), container.name.as_str()), ("juicefs-mount", "jfs-mount"));
        // Only the CSI plugin's /var/lib covers a path elsewhere.
        let (pod, _) = owner_of(&pods, Path::new("/var/lib/kubelet/plugins/x/globalmount"), &[]).unwrap();
        assert_eq!(pod.metadata.name, "csi-node");
        // Component-wise: /var/library is not under /var/lib.
        assert!(owner_of(&pods, Path::new("/var/library/x"), &[]).is_none());
    }

    #[test]
    fn at_equal_depth_the_pod_named_after_the_source_directory_owns_it() {
        let mount_pod = |name: &str, uid: &str, container_id: &str| {
            json!({
                "metadata": {"name": name, "namespace": "kube-system", "uid": uid},
                "spec": {
                    "volumes": [{"name": "jfs", "hostPath": {"path": "/var/lib/juicefs/volume"}}],
                    "containers": [{"name": "jfs-mount", "volumeMounts": [
                        {"name": "jfs", "mountPath": "/var/lib/juicefs/volume", "mountPropagation": "Bidirectional"}]}]
                },
                "status": {"phase": "Running", "containerStatuses": [{"name": "jfs-mount", "containerID": container_id,
                    "state": {"running": {"startedAt": rfc3339(10)}}}]}
            })
        };
        let pods: PodList = serde_json::from_value(json!({"items": [
            mount_pod("juicefs-csi-node-x7k2p", "csi", "containerd://c"),
            mount_pod("juicefs-node-a-pvc-2-ghijkl", "other", "containerd://o"),
            mount_pod("juicefs-node-a-pvc-1-abcdef", "mine", "containerd://m"),
        ]}))
        .unwrap();
        let source = Path::new("/var/lib/juicefs/volume/pvc-1-abcdef");
        let owners = owners_of(&pods, source, &[]);
        assert_eq!(owners.len(), 1);
        assert_eq!(owners[0].0.metadata.uid, "mine");
        // Another mount pod with the same container name is not a restart
        // of the one last confirmed.
        let Verdict::NotYet(known) = judge(&pods, source, &[], Some(at(100)), None) else { panic!() };
        let unrelated = Path::new("/var/lib/juicefs/volume/pvc-3-zzzzzz");
        assert_eq!(owners_of(&pods, unrelated, &[]).len(), 3, "all equally likely");
        assert!(matches!(judge(&pods, unrelated, &[], Some(at(100)), Some(&known)), Verdict::NotYet(_)));
    }

    #[test]
    fn a_sidecar_of_the_targets_pod_owns_a_source_no_host_path_covers() {
        let pods = pods(100, "containerd://b", None);
        let (pod, container) = owner_of(&pods, Path::new("/run/fuse/x"), &["app"]).unwrap();
        assert_eq!((pod.metadata.name.as_str(), container.name.as_str()), ("app", "fuse"));
        assert_eq!(judge(&pods, Path::new("/run/fuse/x"), &["other"], Some(at(50)), None), Verdict::NoOwner);
    }

    #[test]
    fn a_start_after_the_replaced_mount_appeared_is_a_restart() {
        let seen = at(100) + Duration::from_millis(300);
        let verdict = judge(&pods(101, "containerd://b", None), Path::new(SOURCE), &[], Some(seen), None);
        let Verdict::Restarted(owner) = verdict else { panic!("{verdict:?}") };
        assert_eq!(owner.pod_uid, "mount");
        assert_eq!(owner.container_id.as_deref(), Some("containerd://b"));
        assert_eq!(owner.started_at, Some(at(101)));
        // The container that made the replaced mount started before it was
        // seen, in the same second at the latest: not a restart.
        let verdict = judge(&pods(100, "containerd://b", None), Path::new(SOURCE), &[], Some(seen), None);
        assert!(matches!(verdict, Verdict::NotYet(_)), "{verdict:?}");
    }

    #[test]
    fn a_previous_run_that_ended_after_the_sighting_is_a_restart_within_the_same_second() {
        let seen = at(100) + Duration::from_millis(300);
        let verdict = judge(&pods(100, "containerd://b", Some(100)), Path::new(SOURCE), &[], Some(seen), None);
        assert!(matches!(verdict, Verdict::Restarted(_)), "{verdict:?}");
        let verdict = judge(&pods(100, "containerd://b", Some(99)), Path::new(SOURCE), &[], Some(seen), None);
        assert!(matches!(verdict, Verdict::NotYet(_)), "{verdict:?}");
    }

    #[test]
    fn another_container_than_the_one_last_confirmed_is_a_restart() {
        let pods = pods(50, "containerd://b", None);
        let Verdict::NotYet(mut known) = judge(&pods, Path::new(SOURCE), &[], Some(at(100)), None) else { panic!() };
        assert!(matches!(judge(&pods, Path::new(SOURCE), &[], Some(at(100)), Some(&known)), Verdict::NotYet(_)));
        known.container_id = Some("containerd://a".into());
        assert!(matches!(judge(&pods, Path::new(SOURCE), &[], Some(at(100)), Some(&known)), Verdict::Restarted(_)));
    }

    #[test]
    fn without_a_sighting_only_an_earlier_termination_counts() {
        let verdict = judge(&pods(50, "containerd://b", None), Path::new(SOURCE), &[], None, None);
        assert!(matches!(verdict, Verdict::NotYet(_)), "{verdict:?}");
        let verdict = judge(&pods(50, "containerd://b", Some(49)), Path::new(SOURCE), &[], None, None);
        assert!(matches!(verdict, Verdict::Restarted(_)), "{verdict:?}");
    }

    #[test]
    fn a_waiting_container_has_not_restarted_yet() {
        let mut pods = pods(101, "containerd://b", None);
        let status = &mut pods.items[1].status.container_statuses[0];
        status.state = Default::default();
        let verdict = judge(&pods, Path::new(SOURCE), &[], Some(at(100)), None);
        assert!(matches!(verdict, Verdict::NotYet(Owner { started_at: None, .. })), "{verdict:?}");
    }
}
