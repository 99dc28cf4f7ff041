use std::time::{Duration, UNIX_EPOCH};

use super::*;

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn fixture(name: &str) -> PodList {
    let path = format!("{}/../fixtures/kubelet/{name}", env!("CARGO_MANIFEST_DIR"));
    let body = std::fs::read(&path).unwrap_or_else(|err| panic!("{path}: {err}"));
    PodList::from_slice(&body).unwrap_or_else(|err| panic!("{path}: {err}: {}", err.source))
}

fn by_name<'a>(list: &'a PodList, prefix: &str) -> &'a Pod {
    list.items.iter().find(|pod| pod.metadata.name.starts_with(prefix)).unwrap()
}

fn id(status: &ContainerStatus) -> &str {
    status.container_id.as_deref().unwrap()
}

#[test]
fn every_fixture_parses() {
    let dir = format!("{}/../fixtures/kubelet", env!("CARGO_MANIFEST_DIR"));
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".json"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 4, "{names:?}");
    for name in names {
        let list = fixture(&name);
        assert!(!list.items.is_empty(), "{name}");
        for pod in &list.items {
            assert!(!pod.metadata.uid.is_empty() && !pod.spec.node_name.is_empty(), "{name}");
            for status in pod.status.container_statuses.iter().chain(&pod.status.init_container_statuses) {
                assert!(id(status).starts_with("containerd://") && id(status).len() == 13 + 64, "{name}");
                assert!(pod.container(&status.name).is_some(), "{name}: {} has no spec", status.name);
            }
        }
    }
}

#[test]
fn juicefs_mount_pod_and_its_restart() {
    let before = fixture("juicefs-mount-pod.json");
    let after = fixture("juicefs-mount-pod-restarted.json");
    let mount_pod = by_name(&before, "juicefs-node-a-pvc-");
    assert_eq!(mount_pod.metadata.labels["app.kubernetes.io/name"], "juicefs-mount");
    assert_eq!(mount_pod.spec.restart_policy.as_deref(), Some("Always"));
    let owned: Vec<_> = mount_pod.bidirectional_host_paths().collect();
    assert_eq!(
        owned,
        [BidirectionalHostPath { container: "jfs-mount", host_path: "/var/lib/juicefs/volume", mount_path: "/jfs" }]
    );
    // The CSI node pod holds the same directory Bidirectional too.
    let csi_node = by_name(&before, "juicefs-csi-node-");
    assert!(csi_node.bidirectional_host_paths().any(|b| b.host_path == "/var/lib/juicefs/volume"));
    assert!(csi_node.bidirectional_host_paths().any(|b| b.host_path == "/var/lib/kubelet"));

    let app = by_name(&before, "web-");
    assert_eq!(app.volume("data").unwrap().persistent_volume_claim.as_ref().unwrap().claim_name, "juicefs-pvc");
    assert_eq!(
        by_name(&before, "inline-reader").volume("scratch").unwrap().csi.as_ref().unwrap().driver,
        "csi.juicefs.com"
    );

    let old = before.pod(&mount_pod.metadata.uid).unwrap().container_status("jfs-mount").unwrap();
    let new = after.pod(&mount_pod.metadata.uid).unwrap().container_status("jfs-mount").unwrap();
    assert_ne!(id(old), id(new));
    assert_eq!((old.restart_count, new.restart_count), (0, 1));
    assert!(new.started_at().unwrap() > old.started_at().unwrap());
    let last = new.last_state.terminated.as_ref().unwrap();
    assert_eq!((last.exit_code, last.reason.as_deref()), (137, Some("OOMKilled")));
    assert_eq!(last.container_id.as_deref(), Some(id(old)));
    // Nothing else on the node changed.
    for pod in before.items.iter().filter(|pod| pod.metadata.uid != mount_pod.metadata.uid) {
        assert_eq!(Some(pod), after.pod(&pod.metadata.uid));
    }
}

#[test]
fn fluid_fuse_daemonset() {
    let list = fixture("fluid-fuse-daemonset.json");
    let fuse = by_name(&list, "shared-data-fuse-");
    let owned: Vec<_> = fuse.bidirectional_host_paths().collect();
    assert_eq!(owned.len(), 1);
    assert_eq!((owned[0].container, owned[0].host_path), ("juicefs-fuse", "/runtime-mnt/juicefs/default/shared-data"));
    let csi = by_name(&list, "csi-nodeplugin-fluid-");
    assert!(csi.bidirectional_host_paths().any(|b| b.host_path == "/runtime-mnt"));
    let app = by_name(&list, "trainer-0");
    assert_eq!(app.volume("dataset").unwrap().persistent_volume_claim.as_ref().unwrap().claim_name, "shared-data");
    assert!(app.container_status("trainer").unwrap().is_running());
}

#[test]
fn native_sidecar_and_job() {
    let list = fixture("native-sidecar-and-job.json");
    let pod = by_name(&list, "inference-");
    let sidecar = pod.container("fuse-sidecar").unwrap();
    assert!(sidecar.is_native_sidecar() && !pod.container("init-config").unwrap().is_native_sidecar());
    let mount = &sidecar.volume_mounts[0];
    assert!(mount.is_bidirectional() && pod.volume(&mount.name).unwrap().host_path.is_none());
    // Native sidecars report in initContainerStatuses.
    let status = pod.container_status("fuse-sidecar").unwrap();
    assert!(pod.status.container_statuses.iter().all(|s| s.name != "fuse-sidecar"));
    assert!(status.is_running() && status.restart_count == 1);
    assert_eq!(status.last_state.terminated.as_ref().unwrap().reason.as_deref(), Some("Error"));
    assert_eq!(pod.container("app").unwrap().volume_mounts[0].mount_propagation.as_deref(), Some("HostToContainer"));
    let init = pod.container_status("init-config").unwrap();
    assert_eq!(init.state.terminated.as_ref().unwrap().reason.as_deref(), Some("Completed"));

    let job = by_name(&list, "etl-");
    assert_eq!(job.spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(job.status.phase.as_deref(), Some("Succeeded"));
    for status in &job.status.container_statuses {
        let done = status.state.terminated.as_ref().unwrap();
        assert_eq!(done.exit_code, 0);
        assert!(!status.is_running() && status.started_at().is_some());
        assert!(done.finished_at.unwrap() > done.started_at.unwrap());
    }
}

#[test]
fn timestamps_in_every_rfc3339_shape() {
    // 2025-03-04T05:06:07Z
    let base = at(1_741_064_767);
    assert_eq!(Timestamp::parse("2025-03-04T05:06:07Z").unwrap().0, base);
    assert_eq!(Timestamp::parse("2025-03-04T05:06:07.250Z").unwrap().0, base + Duration::from_millis(250));
    assert_eq!(Timestamp::parse("2025-03-04T05:06:07.123456789Z").unwrap().0, base + Duration::from_nanos(123_456_789));
    assert_eq!(Timestamp::parse("2025-03-04T07:06:07+02:00").unwrap().0, base);
    assert_eq!(Timestamp::parse("2025-03-03T23:36:07-05:30").unwrap().0, base);
    assert_eq!(Timestamp::parse("1970-01-01T00:00:00Z").unwrap().0, UNIX_EPOCH);
    assert_eq!(Timestamp::parse("1969-12-31T23:59:59Z").unwrap().0, UNIX_EPOCH - Duration::from_secs(1));
    assert_eq!(Timestamp(base).to_string(), "2025-03-04T05:06:07Z");
    for bad in ["", "2025-03-04", "2025-03-04T05:06:07", "2025-13-04T05:06:07Z", "yesterday"] {
        assert!(Timestamp::parse(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn a_malformed_pod_is_skipped_and_the_others_are_kept() {
    let body = br#"{"kind":"PodList","items":[
        {"metadata":{"namespace":"ns","name":"first","uid":"u1"}},
        {"metadata":{"namespace":"ns","name":"late","uid":"u2"},"status":{"containerStatuses":[
            {"name":"c","state":{"running":{"startedAt":"2025-03-04T05:06:07"}}}]}},
        {"metadata":{"namespace":"ns","name":"numbered","uid":42}},
        "not a pod",
        {"metadata":{"namespace":"ns","name":"last","uid":"u5"}}]}"#;
    let list = PodList::from_slice(body).unwrap();
    let names: Vec<&str> = list.items.iter().map(|pod| pod.metadata.name.as_str()).collect();
    assert_eq!(names, ["first", "last"]);
    let skipped: Vec<(usize, &str, &str, &str)> =
        list.skipped.iter().map(|pod| (pod.index, pod.name.as_str(), pod.uid.as_str(), pod.field.as_str())).collect();
    assert_eq!(
        skipped,
        [
            (1, "late", "u2", "status.containerStatuses[0].state.running.startedAt"),
            (2, "numbered", "42", "metadata.uid"),
            (3, "", "", "."),
        ]
    );
    assert!(list.skipped[0].problem.contains("invalid RFC 3339 timestamp \"2025-03-04T05:06:07\""));
    assert_eq!(list.skipped[0].namespace, "ns");
    assert!(list.skipped[2].problem.contains("expected struct Pod"), "{}", list.skipped[2].problem);
}

#[test]
fn a_body_that_is_not_a_list_of_pods_names_where_it_broke() {
    let err = PodList::from_slice(br#"{"items":[{"spec":{"containers":[}]}"#).unwrap_err();
    assert_eq!(err.path, "items[0].spec.containers[0]");
    assert_eq!((err.line, err.column), (1, 34));
    let err = PodList::from_slice(br#"{"kind":"PodList","items":{"metadata":{}}}"#).unwrap_err();
    assert_eq!(err.path, "items");
    assert!(PodList::from_slice(b"").is_err());
    assert_eq!(PodList::from_slice(br#"{"items":[{"metadata":{"uid":7}}]} x"#).unwrap_err().path, ".");
}

#[test]
fn nulls_and_absent_fields_default() {
    let list = PodList::from_slice(
        br#"{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[{"metadata":{"name":"p","labels":null},
        "spec":{"volumes":null,"containers":[{"name":"c","volumeMounts":null}]},
        "status":{"containerStatuses":[{"name":"c","state":{"running":{"startedAt":null}},"lastState":{}}]}}]}"#,
    )
    .unwrap();
    let pod = &list.items[0];
    assert!(pod.metadata.labels.is_empty() && pod.spec.volumes.is_empty());
    let status = pod.container_status("c").unwrap();
    assert!(status.is_running() && status.started_at().is_none() && status.container_id.is_none());
    assert_eq!(PodList::from_slice(br#"{"items":null}"#).unwrap(), PodList::default());
    assert_eq!(PodList::from_slice(b"{}").unwrap(), PodList::default());
}

#[test]
fn started_at_prefers_the_running_instance() {
    let status: ContainerStatus = serde_json::from_str(
        r#"{"name":"c","restartCount":1,"state":{"running":{"startedAt":"2025-03-04T05:06:08Z"}},
        "lastState":{"terminated":{"exitCode":137,"reason":"OOMKilled","startedAt":"2025-03-04T05:00:00Z",
        "finishedAt":"2025-03-04T05:06:07Z","containerID":"containerd://aa"}}}"#,
    )
    .unwrap();
    assert_eq!(status.started_at(), Some(at(1_741_064_768)));
    let old = status.last_state.terminated.as_ref().unwrap();
    assert_eq!((old.exit_code, old.reason.as_deref()), (137, Some("OOMKilled")));
    assert_eq!(old.finished_at.unwrap().0, at(1_741_064_767));

    let exited: ContainerStatus = serde_json::from_str(
        r#"{"name":"c","state":{"terminated":{"exitCode":0,"startedAt":"2025-03-04T05:06:07Z"}}}"#,
    )
    .unwrap();
    assert_eq!(exited.started_at(), Some(at(1_741_064_767)));
    let waiting: ContainerStatus =
        serde_json::from_str(r#"{"name":"c","state":{"waiting":{"reason":"CrashLoopBackOff"}}}"#).unwrap();
    assert_eq!(waiting.started_at(), None);
}
