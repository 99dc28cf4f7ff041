use super::*;
use crate::model::table::{Classified, Layout as TableLayout, Snapshot};

const KUBELET: &str = "/var/lib/kubelet";

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(path)
}

fn vol_data(name: &str) -> VolData {
    VolData::read(&fixture(&format!("vol_data/{name}"))).unwrap()
}

fn table() -> Classified {
    let text = fs::read(fixture("mountinfo/layouts.txt")).unwrap();
    Classified::new(&Snapshot::parse(&text).unwrap(), &TableLayout::new(Path::new(KUBELET)))
}

fn layouts() -> SourceLayouts {
    SourceLayouts::new(Path::new(KUBELET)).with_rules_from(&fixture("layout-config/rules.toml")).unwrap()
}

/// Locates the source of the target at `path` in the fixture table.
fn locate(
    layouts: &SourceLayouts,
    classified: &Classified,
    path: &str,
    data: Option<&VolData>,
) -> Option<LocatedSource> {
    let sources: Vec<SourceMount<'_>> = classified.sources.values().map(SourceMount::from).collect();
    let target = &classified.targets[Path::new(path)];
    let pods = Path::new(KUBELET).join("pods");
    let info = TargetInfo::from_path(&pods, &target.stack.path, &target.stack.top().root).unwrap().with_vol_data(data);
    layouts.locate(&info, &sources)
}

fn whole_volume<'a>(volume: &'a str, root: &'a Path, data: &'a VolData) -> TargetInfo<'a> {
    TargetInfo {
        pod_uid: "u",
        volume,
        kind: TargetKind::Volume,
        plugin: Some(CSI_PLUGIN_DIR),
        root,
        vol_data: Some(data),
    }
}

fn pod_volume(uid_suffix: u32, volume: &str) -> String {
    format!("{KUBELET}/pods/1a2b3c4d-0000-4000-8000-00000000000{uid_suffix}/volumes/kubernetes.io~csi/{volume}/mount")
}

#[test]
fn csi_staging_by_volume_handle_hash() {
    let (layouts, table) = (layouts(), table());
    let data = vol_data("s3-persistent-selinux.json");
    let found = locate(&layouts, &table, &pod_volume(1, "s3-pv"), Some(&data)).unwrap();
    assert_eq!(found.layout, LayoutName::CsiStaging);
    let hash = sha256_hex("s3-csi-driver-volume");
    let staging = format!("plugins/kubernetes.io/csi/s3.csi.aws.com/{hash}/globalmount");
    assert_eq!(found.path, Path::new(KUBELET).join(staging));
    assert_eq!(found.root_in_source, Path::new(""));
    // The same hash is mounted under two drivers' directories: each
    // driver finds only its own, a third finds nothing.
    let mut other = data.clone();
    other.driver_name = "other.csi.example.com".into();
    let found = locate(&layouts, &table, &pod_volume(1, "s3-pv"), Some(&other)).unwrap();
    assert!(found.path.starts_with(Path::new(KUBELET).join("plugins/kubernetes.io/csi/other.csi.example.com")));
    other.driver_name = "missing.csi.example.com".into();
    assert_eq!(locate(&layouts, &table, &pod_volume(1, "s3-pv"), Some(&other)), None);
    // Without vol_data the handle is unknown.
    assert_eq!(locate(&layouts, &table, &pod_volume(1, "s3-pv"), None), None);
}

#[test]
fn sha256_is_the_kubelets() {
    // sha256("abc"), the FIPS 180-2 test vector.
    assert_eq!(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

#[test]
fn csi_staging_before_1_24_by_pv_name() {
    let (layouts, table) = (layouts(), table());
    let data = vol_data("pre-1.16.json");
    let found = locate(&layouts, &table, &pod_volume(2, "pv-legacy"), Some(&data)).unwrap();
    assert_eq!(found.layout, LayoutName::CsiStagingByPv);
    assert_eq!(found.path, Path::new(KUBELET).join("plugins/kubernetes.io/csi/pv/pv-legacy/globalmount"));
    // Without vol_data, the directory name is the PV name.
    assert_eq!(locate(&layouts, &table, &pod_volume(2, "pv-legacy"), None).unwrap().path, found.path);
    // Nor is a volume of another plugin that has the same name.
    let sources: Vec<SourceMount<'_>> = table.sources.values().map(SourceMount::from).collect();
    let empty_dir = TargetInfo {
        pod_uid: "u",
        volume: "pv-legacy",
        kind: TargetKind::Volume,
        plugin: Some("kubernetes.io~empty-dir"),
        root: Path::new("/"),
        vol_data: None,
    };
    assert_eq!(layouts.locate(&empty_dir, &sources), None);
    // An inline ephemeral volume is never staged.
    let mut inline = data.clone();
    inline.lifecycle_mode = LifecycleMode::Ephemeral;
    assert_eq!(locate(&layouts, &table, &pod_volume(2, "pv-legacy"), Some(&inline)), None);
}

#[test]
fn juicefs_mount_pod_with_random_suffix() {
    let (layouts, table) = (layouts(), table());
    let data = vol_data("juicefs-persistent.json");
    let pv = "pvc-5f0c7a4e-2b1d-4c6e-9a3f-8d2e1b7c4a90";
    let found = locate(&layouts, &table, &pod_volume(3, pv), Some(&data)).unwrap();
    assert_eq!(found.layout, LayoutName::JuiceFs);
    assert_eq!(found.path, Path::new(&format!("/var/lib/juicefs/volume/{pv}-qxzvbt")));
    // The CSI driver binds the PV's subdirectory of the file system.
    assert_eq!(found.root_in_source, Path::new(pv));

    // A subPath of it: its root is the subdirectory within.
    let subpath = format!("{KUBELET}/pods/1a2b3c4d-0000-4000-8000-000000000003/volume-subpaths/data/app/0");
    let found = locate(&layouts, &table, &subpath, Some(&data)).unwrap();
    assert_eq!(found.root_in_source, Path::new(pv).join("logs"));
    // Without vol_data a subPath's volume name says nothing of the PV.
    assert_eq!(locate(&layouts, &table, &subpath, None), None);
}

#[test]
fn juicefs_near_misses_do_not_match() {
    let layouts = layouts();
    let pv = "pvc-5f0c7a4e-2b1d-4c6e-9a3f-8d2e1b7c4a90";
    let data = vol_data("juicefs-persistent.json");
    let target = whole_volume(pv, Path::new("/"), &data);
    for near_miss in [
        format!("/var/lib/juicefs/volume/{pv}-0-abcdef"),
        format!("/var/lib/juicefs/volume/{pv}-abcdefg"),
        format!("/var/lib/juicefs/volume/{pv}-ABCDEF"),
        format!("/var/lib/juicefs/volume/{pv}x"),
        format!("/var/lib/juicefs/volume/{pv}-abcdef/sub"),
        format!("/var/lib/juicefs/other/{pv}-abcdef"),
    ] {
        let source = [SourceMount { path: Path::new(&near_miss), root: Path::new("/") }];
        assert_eq!(layouts.locate(&target, &source), None, "{near_miss}");
    }
    // Another driver's volume with the same handle is not JuiceFS's.
    let mut other = data.clone();
    other.driver_name = "other.csi.example.com".into();
    let source_path = format!("/var/lib/juicefs/volume/{pv}-abcdef");
    let source = [SourceMount { path: Path::new(&source_path), root: Path::new("/") }];
    assert!(layouts.locate(&target, &source).is_some());
    assert_eq!(layouts.locate(&TargetInfo { vol_data: Some(&other), ..target }, &source), None);
    // Before v0.21: no suffix.
    let source_path = format!("/var/lib/juicefs/volume/{pv}");
    let source = [SourceMount { path: Path::new(&source_path), root: Path::new("/") }];
    assert!(layouts.locate(&target, &source).is_some());
}

#[test]
fn fluid_runtime_fuse_mount_by_namespace_and_dataset() {
    let (layouts, table) = (layouts(), table());
    let data = vol_data("fluid-persistent.json");
    let found = locate(&layouts, &table, &pod_volume(4, "default-shared-data"), Some(&data)).unwrap();
    assert_eq!(found.layout, LayoutName::Fluid);
    assert_eq!(found.path, Path::new("/runtime-mnt/jindo/default/shared-data/jindofs-fuse"));
    assert_eq!(found.root_in_source, Path::new(""));
    // `default/shared/data/jindofs-fuse` is one level too deep, and
    // `alluxio/default/shared-data2` another dataset: neither matched.
    let all = layouts.candidates(
        &TargetInfo::from_path(
            &Path::new(KUBELET).join("pods"),
            Path::new(&pod_volume(4, "default-shared-data")),
            Path::new("/"),
        )
        .unwrap()
        .with_vol_data(Some(&data)),
        &table.sources.values().map(SourceMount::from).collect::<Vec<_>>(),
    );
    assert_eq!(all, vec![found]);
}

#[test]
fn fluid_names_with_dashes_that_split_two_ways_are_ambiguous() {
    let layouts = SourceLayouts::new(Path::new(KUBELET));
    let data = vol_data("fluid-persistent.json");
    let target = whole_volume("default-shared-data", Path::new("/"), &data);
    let one = Path::new("/runtime-mnt/jindo/default/shared-data/jindofs-fuse");
    let other = Path::new("/runtime-mnt/jindo/default-shared/data/jindofs-fuse");
    let root = Path::new("/");
    let both = [SourceMount { path: one, root }, SourceMount { path: other, root }];
    assert_eq!(layouts.locate(&target, &both[1..]).unwrap().path, other);
    assert_eq!(layouts.locate(&target, &both), None, "two datasets fit: no guess");
    assert_eq!(layouts.candidates(&target, &both).len(), 2);
    for near_miss in [
        "/runtime-mnt/jindo/default/shared-data/cache",
        "/runtime-mnt/jindo/default/shared-data/alluxio-fuse",
        "/runtime-mntx/jindo/default/shared-data/jindofs-fuse",
        "/runtime-mnt/jindo/default/shared-data2/jindofs-fuse",
    ] {
        let source = [SourceMount { path: Path::new(near_miss), root }];
        assert_eq!(layouts.locate(&target, &source), None, "{near_miss}");
    }
}

#[test]
fn user_rule_for_a_driver() {
    let (layouts, table) = (layouts(), table());
    let data = vol_data("user-rule-persistent.json");
    let found = locate(&layouts, &table, &pod_volume(5, "pv-share-7"), Some(&data)).unwrap();
    assert_eq!(found.layout, LayoutName::UserRule { driver: "nfs-fuse.example.com".into() });
    assert_eq!(found.path, Path::new("/mnt/fuse/nfs-fuse.example.com").join(sha256_hex("share-7")));
    // Without the rule nothing knows this driver.
    let bare = SourceLayouts::new(Path::new(KUBELET));
    assert_eq!(locate(&bare, &table, &pod_volume(5, "pv-share-7"), Some(&data)), None);
}

#[test]
fn a_source_whose_root_does_not_contain_the_targets_is_no_match() {
    let layouts = SourceLayouts::new(Path::new(KUBELET));
    let data = vol_data("fluid-persistent.json");
    let target = whole_volume("default-shared-data", Path::new("/other"), &data);
    let path = Path::new("/runtime-mnt/jindo/default/shared-data/jindofs-fuse");
    assert_eq!(layouts.locate(&target, &[SourceMount { path, root: Path::new("/data") }]), None);
    let found = layouts.locate(&target, &[SourceMount { path, root: Path::new("/") }]).unwrap();
    assert_eq!(found.root_in_source, Path::new("other"));
}

#[test]
fn rule_values_cannot_climb_out_of_the_template() {
    let rules =
        parse_rules("[[rule]]\ndriver = \"d\"\nsource = \"/mnt/{volumeHandle}/x\"\n", Path::new("c.toml")).unwrap();
    let expand = |handle: &str| {
        let mut data = vol_data("user-rule-persistent.json");
        data.driver_name = "d".into();
        data.volume_handle = handle.into();
        let target = whole_volume("v", Path::new("/"), &data);
        rules[0].expand(&target, Path::new(KUBELET))
    };
    assert_eq!(expand("../../etc"), None);
    assert_eq!(expand("bucket/prefix"), Some(PathBuf::from("/mnt/bucket/prefix/x")));
}

#[test]
fn target_paths_give_pod_volume_and_kind() {
    let pods = Path::new("/k/pods");
    let root = Path::new("/");
    let csi = TargetInfo::from_path(pods, Path::new("/k/pods/u1/volumes/kubernetes.io~csi/pv1/mount"), root).unwrap();
    assert_eq!((csi.pod_uid, csi.volume, csi.kind), ("u1", "pv1", TargetKind::Volume));
    let empty_dir =
        TargetInfo::from_path(pods, Path::new("/k/pods/u1/volumes/kubernetes.io~empty-dir/fuse"), root).unwrap();
    assert_eq!((empty_dir.volume, empty_dir.kind), ("fuse", TargetKind::Volume));
    let sub = TargetInfo::from_path(pods, Path::new("/k/pods/u1/volume-subpaths/data/app/0"), root).unwrap();
    assert_eq!((sub.volume, sub.kind), ("data", TargetKind::Subpath));
    for other in [
        "/k/pods/u1/volumes/kubernetes.io~csi/pv1/mount/deeper",
        "/k/pods/u1/volumes/kubernetes.io~csi",
        "/k/pods/u1/volume-subpaths/data/app",
        "/k/pods/u1/plugins/x/y",
        "/elsewhere/u1/volumes/p/v",
    ] {
        assert!(TargetInfo::from_path(pods, Path::new(other), root).is_none(), "{other}");
    }
}
