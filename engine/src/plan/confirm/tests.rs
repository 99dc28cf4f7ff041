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

const GRACE: Duration = Duration::from_secs(10);

/// An error that repeats until the configuration changes.
fn refused_by_kubelet() -> Result<Arc<PodList>, KubeletError> {
    Err(KubeletError::Unauthorized { addr: "127.0.0.1:10250".into(), token_file: None })
}

fn timed_out() -> Result<Arc<PodList>, KubeletError> {
    Err(KubeletError::Timeout {
        addr: "127.0.0.1:10250".into(),
        phase: crate::kube::TimeoutPhase::Connect,
        limit: Duration::from_secs(1),
    })
}

/// A journal that saw the source's first mount (ID 1) at second 100.
fn journal() -> Journal {
    let mut journal = Journal::in_memory();
    journal.sight_source(Path::new(SOURCE), 1, Some(at(100)));
    journal
}

fn gate(confirmations: &mut Confirmations, mount_id: u32, in_flight: bool, now: Instant) -> Gate {
    confirmations.gate(Path::new(SOURCE), mount_id, 1, Vec::new, in_flight, now)
}

#[test]
fn a_replaced_source_asks_once_then_heals_when_the_owner_restarted() {
    let now = Instant::now();
    let mut confirmations = Confirmations::new(GRACE);
    assert_eq!(gate(&mut confirmations, 2, false, now), Gate::Ask { first: true });
    assert_eq!(gate(&mut confirmations, 2, true, now), Gate::Wait, "the call on its way serves it");
    let decided = confirmations.answered(&Ok(Arc::new(pods(200, "containerd://new", None))), &journal(), now);
    assert!(matches!(&decided[..], [(_, Decision::Restarted(owner))] if owner.pod == "juicefs-mount"));
    assert_eq!(gate(&mut confirmations, 2, false, now), Gate::Heal);
    assert_eq!(confirmations.next_deadline(), None);
}

#[test]
fn an_owner_not_restarted_yet_is_rechecked_sooner_then_later() {
    let now = Instant::now();
    let mut confirmations = Confirmations::new(GRACE);
    gate(&mut confirmations, 2, false, now);
    let not_yet = Ok(Arc::new(pods(50, "containerd://old", None)));
    let decided = confirmations.answered(&not_yet, &journal(), now);
    let [(_, Decision::NotYet { first: true, recheck_in, .. })] = &decided[..] else { panic!("{decided:?}") };
    assert_eq!(confirmations.next_deadline(), Some(now + *recheck_in));
    assert_eq!(gate(&mut confirmations, 2, false, now), Gate::Wait, "not due yet");
    let due = now + *recheck_in;
    assert_eq!(gate(&mut confirmations, 2, false, due), Gate::Ask { first: false });
    let decided = confirmations.answered(&not_yet, &journal(), due);
    let [(_, Decision::NotYet { first: false, recheck_in: later, .. })] = &decided[..] else { panic!() };
    assert!(later > recheck_in);
}

#[test]
fn a_failing_kubelet_is_retried_until_the_grace_is_over_then_heals_on_evidence() {
    let start = Instant::now();
    let mut confirmations = Confirmations::new(GRACE);
    gate(&mut confirmations, 2, false, start);
    let decided = confirmations.answered(&timed_out(), &journal(), start);
    assert!(matches!(decided[..], [(_, Decision::Failing { .. })]));
    let retry = confirmations.next_deadline().unwrap();
    assert!(retry <= start + GRACE);
    assert_eq!(gate(&mut confirmations, 2, false, retry), Gate::Ask { first: false });
    let decided = confirmations.answered(&timed_out(), &journal(), start + GRACE);
    assert!(matches!(decided[..], [(_, Decision::GraceOver { grace: GRACE })]));
    assert_eq!(gate(&mut confirmations, 2, false, start + GRACE), Gate::Heal);
}

#[test]
fn a_refusing_kubelet_heals_on_evidence_at_once() {
    assert!(refused_by_kubelet().is_err_and(|err| !err.is_retryable()));
    let now = Instant::now();
    let mut confirmations = Confirmations::new(GRACE);
    gate(&mut confirmations, 2, false, now);
    let decided = confirmations.answered(&refused_by_kubelet(), &journal(), now);
    assert!(matches!(decided[..], [(_, Decision::Refused)]));
    assert_eq!(gate(&mut confirmations, 2, false, now), Gate::Heal);
}

#[test]
fn a_newer_mount_at_the_source_waits_afresh_and_healed_sources_are_forgotten() {
    let now = Instant::now();
    let mut confirmations = Confirmations::new(GRACE);
    gate(&mut confirmations, 2, false, now);
    confirmations.answered(&refused_by_kubelet(), &journal(), now);
    assert_eq!(gate(&mut confirmations, 3, false, now), Gate::Ask { first: true });
    confirmations.retain(|_| false);
    assert!(confirmations.answered(&refused_by_kubelet(), &journal(), now).is_empty());
}
