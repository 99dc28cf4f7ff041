//! The cluster the webhook's tests and benchmark assume, and the reviews
//! they send: the storage objects of `fixtures/admission/README.md` and a
//! generated pod of any size.
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use serde_json::{Value, json};

use fuse_supervisor_webhook::VolumeCache;

pub const JUICEFS_DRIVER: &str = "csi.juicefs.com";
pub const JUICEFS_CLASS: &str = "juicefs-sc";
pub const JUICEFS_PV: &str = "pvc-3f1e9b2c-7d45-4a80-b6e1-9c2d5f8a0e37";
pub const EBS_DRIVER: &str = "ebs.csi.aws.com";
pub const EBS_PV: &str = "pvc-8b0d4e6f-2a19-4c73-9e58-1d7b3c6f9a42";

/// A PVC as the API server stores it; `volume` None while unbound.
pub fn claim(namespace: &str, name: &str, volume: Option<&str>, class: Option<&str>) -> PersistentVolumeClaim {
    let mut spec = json!({
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "10Gi"}},
        "volumeMode": "Filesystem",
    });
    if let Some(class) = class {
        spec["storageClassName"] = class.into();
    }
    if let Some(volume) = volume {
        spec["volumeName"] = volume.into();
    }
    let phase = if volume.is_some() { "Bound" } else { "Pending" };
    from_json(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1001"},
        "spec": spec,
        "status": {"phase": phase},
    }))
}

/// A CSI PV (`driver` Some) or an NFS one.
pub fn volume(name: &str, driver: Option<&str>, class: &str) -> PersistentVolume {
    let source = match driver {
        Some(driver) => json!({"csi": {"driver": driver, "volumeHandle": name}}),
        None => json!({"nfs": {"server": "nfs.example", "path": "/export"}}),
    };
    let mut spec = json!({
        "accessModes": ["ReadWriteMany"],
        "capacity": {"storage": "10Gi"},
        "persistentVolumeReclaimPolicy": "Delete",
        "storageClassName": class,
        "volumeMode": "Filesystem",
    });
    if let (Some(spec), Some(source)) = (spec.as_object_mut(), source.as_object()) {
        spec.extend(source.clone());
    }
    from_json(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "resourceVersion": "1002"},
        "spec": spec,
    }))
}

pub fn class(name: &str, provisioner: &str, default: bool) -> StorageClass {
    from_json(json!({
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": name,
            "resourceVersion": "1003",
            "annotations": {"storageclass.kubernetes.io/is-default-class": default.to_string()},
        },
        "provisioner": provisioner,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }))
}

/// The fixtures' cluster, every watch listed.
pub fn fixture_cache() -> VolumeCache {
    let cache = VolumeCache::new();
    list_fixture_cluster(&cache);
    cache
}

/// Fills `cache` with the fixtures' cluster, as the three first lists would.
pub fn list_fixture_cluster(cache: &VolumeCache) {
    cache.replace([
        claim("data", "juicefs-pvc", Some(JUICEFS_PV), Some(JUICEFS_CLASS)),
        claim("data", "pgdata-ebs", Some(EBS_PV), Some("gp3")),
    ]);
    cache.replace([volume(JUICEFS_PV, Some(JUICEFS_DRIVER), JUICEFS_CLASS), volume(EBS_PV, Some(EBS_DRIVER), "gp3")]);
    cache.replace([class(JUICEFS_CLASS, JUICEFS_DRIVER, false), class("gp3", EBS_DRIVER, true)]);
}

/// A Pod CREATE review of `containers` containers with `mounts` mounts
/// each, spread over `mounts` PVC volumes alternating between the JuiceFS
/// and the EBS claim (so half the mounts are patched), with one extra
/// mount per container that already says None. Compact JSON, as sent.
pub fn large_pod_review(containers: usize, mounts: usize) -> Vec<u8> {
    let volumes: Vec<Value> = (0..mounts)
        .map(|index| {
            let claim = if index % 2 == 0 { "juicefs-pvc" } else { "pgdata-ebs" };
            json!({"name": format!("vol-{index}"), "persistentVolumeClaim": {"claimName": claim}})
        })
        .collect();
    let containers: Vec<Value> = (0..containers)
        .map(|index| {
            let mut volume_mounts: Vec<Value> = (0..mounts)
                .map(|mount| json!({"name": format!("vol-{mount}"), "mountPath": format!("/mnt/{mount}")}))
                .collect();
            volume_mounts.push(json!({"name": "vol-0", "mountPath": "/mnt/pinned", "mountPropagation": "None"}));
            json!({
                "name": format!("worker-{index}"),
                "image": "registry.example/worker:1.0",
                "args": ["--shard", index.to_string()],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                "volumeMounts": volume_mounts,
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent",
            })
        })
        .collect();
    let review = json!({
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": "f0e1d2c3-b4a5-4968-8776-5a4b3c2d1e0f",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "",
            "namespace": "data",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {"generateName": "workers-", "namespace": "data", "creationTimestamp": null,
                             "labels": {"app": "workers"}},
                "spec": {
                    "volumes": volumes,
                    "containers": containers,
                    "restartPolicy": "Always",
                    "dnsPolicy": "ClusterFirst",
                    "schedulerName": "default-scheduler",
                    "securityContext": {},
                    "enableServiceLinks": true,
                },
                "status": {},
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
        },
    });
    review.to_string().into_bytes()
}

fn from_json<T: serde::de::DeserializeOwned>(value: Value) -> T {
    // Built above from literals of the right shape; a failure is a bug in
    // this file, and only tests and benchmarks call it.
    serde_json::from_value(value).unwrap_or_else(|err| panic!("testbed object does not decode: {err}"))
}
