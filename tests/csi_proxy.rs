//! The CSI proxy between a client playing the kubelet and the test world's
//! CSI node plugin, which mounts real FUSE daemons (bindfs, sshfs, rclone)
//! as its own children: every call passes unchanged, each successful stage
//! and publish is recorded exactly and removed by its unstage or unpublish,
//! a driver's error or absence comes back as the driver (or the kubelet's
//! gRPC) would give it, and no secret reaches a log or, with
//! `--record-secrets off`, a record. The plugin itself behaves as real
//! plugins do: killed, it takes its daemons with it; started again, it
//! serves its socket and knows no mount. Needs root and /dev/fuse; every
//! process and mount lives in the test's sandbox.
use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fuse_supervisor_engine::csi::api::{self, node_service_capability, volume_capability};
use fuse_supervisor_engine::csi::records::{self, Request, Secrets};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::csi::{
    CsiClient, CsiPluginProcess, CsiProxyProcess, PluginFlags, children_of, staging_path, vol_data_json,
};
use tonic::Code;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const DRIVER: &str = "fuse.csi.test";
const SECRET: &str = "pa55-w0rd-never-logged";
/// `ENOTCONN`: what a FUSE mount whose daemon died answers.
const ENOTCONN: i32 = 107;
/// `ECONNABORTED`: what it answers a request that was waiting when the
/// connection ended (a read that began before the last process holding the
/// device, a daemon's helper, let it go).
const ECONNABORTED: i32 = 103;
const EROFS: i32 = 30;
const GONE_TIMEOUT: Duration = Duration::from_secs(10);

/// One volume of the tests: its handle, daemon and pod.
struct Volume {
    handle: &'static str,
    daemon: &'static str,
    pod_uid: &'static str,
    pv: &'static str,
    read_only: bool,
}

const VOLUMES: [Volume; 2] = [
    Volume { handle: "bindfs-handle", daemon: "bindfs", pod_uid: "pod-a", pv: "pv-bindfs", read_only: false },
    Volume { handle: "sshfs-handle", daemon: "sshfs", pod_uid: "pod-b", pv: "pv-sshfs", read_only: true },
];

/// A sandbox with the plugin on `csi/plugin.sock`, the proxy on
/// `kubelet/plugins/<driver>/csi.sock` and the records in `run/records`.
struct World {
    sandbox: Sandbox,
    plugin: CsiPluginProcess,
    proxy: CsiProxyProcess,
    kubelet: CsiClient,
    direct: CsiClient,
    records: PathBuf,
}

impl World {
    fn new(record_secrets: bool, stage_unstage: bool, trust_proc_mounts: bool) -> World {
        let sandbox = Sandbox::new().expect("a sandbox (needs root)");
        let root = sandbox.root().to_path_buf();
        let plugin = CsiPluginProcess::start(
            &sandbox,
            &root.join("csi/plugin.sock"),
            DRIVER,
            PluginFlags { publish_only: !stage_unstage, trust_proc_mounts, ..PluginFlags::default() },
        )
        .expect("the CSI plugin starts");
        let listen = sandbox.kubelet_root().join("plugins").join(DRIVER).join("csi.sock");
        let dir = listen.parent().unwrap().to_path_buf();
        sandbox.run(move || fs::create_dir_all(dir)).unwrap();
        let record_dir = root.join("run/records");
        let proxy =
            CsiProxyProcess::start(&sandbox, Path::new(BINARY), &listen, plugin.socket(), &record_dir, record_secrets)
                .expect("the CSI proxy starts");
        let kubelet = CsiClient::connect(proxy.outside_listen()).unwrap();
        let direct = CsiClient::connect(plugin.outside_socket()).unwrap();
        let records = sandbox.outside_path(&record_dir);
        World { sandbox, plugin, proxy, kubelet, direct, records }
    }

    /// `backing/<handle>` with `data.txt` and `sub/inner.txt`.
    fn backing(&self, volume: &Volume) -> PathBuf {
        let backing = self.sandbox.root().join("backing").join(volume.handle);
        let (dir, handle) = (backing.clone(), volume.handle);
        self.sandbox
            .run(move || {
                fs::create_dir_all(dir.join("sub"))?;
                fs::write(dir.join("data.txt"), format!("data of {handle}"))?;
                fs::write(dir.join("sub/inner.txt"), format!("inner of {handle}"))
            })
            .unwrap();
        backing
    }

    fn stage_request(&self, volume: &Volume) -> api::NodeStageVolumeRequest {
        let staging = staging_path(&self.sandbox.kubelet_root(), DRIVER, volume.handle);
        api::NodeStageVolumeRequest {
            volume_id: volume.handle.into(),
            publish_context: HashMap::new(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(mount_capability()),
            secrets: HashMap::from([("password".into(), SECRET.into())]),
            volume_context: HashMap::from([
                ("daemon".into(), volume.daemon.into()),
                ("source".into(), self.backing(volume).display().to_string()),
            ]),
        }
    }

    /// The publish request, after writing the pod volume's `vol_data.json`
    /// as the kubelet does.
    fn publish_request(&self, volume: &Volume, stage: &api::NodeStageVolumeRequest) -> api::NodePublishVolumeRequest {
        let target = self.sandbox.pod_volume_dir(volume.pod_uid, volume.pv);
        let (dir, data) =
            (target.parent().unwrap().to_path_buf(), vol_data_json(DRIVER, volume.handle, volume.pv, volume.pod_uid));
        self.sandbox
            .run(move || fs::create_dir_all(&dir).and_then(|()| fs::write(dir.join("vol_data.json"), data)))
            .unwrap();
        let mut context = stage.volume_context.clone();
        if volume.read_only {
            context.insert("subdir".into(), "sub".into());
        }
        api::NodePublishVolumeRequest {
            volume_id: volume.handle.into(),
            publish_context: HashMap::new(),
            staging_target_path: stage.staging_target_path.clone(),
            target_path: target.display().to_string(),
            volume_capability: Some(mount_capability()),
            readonly: volume.read_only,
            secrets: HashMap::from([("token".into(), SECRET.into())]),
            volume_context: context,
        }
    }

    fn outside(&self, path: &str) -> PathBuf {
        self.sandbox.outside_path(Path::new(path))
    }

    fn read_records(&self) -> records::ReadRecords {
        records::read_all(&self.records).expect("the record directory lists")
    }
}

fn mount_capability() -> api::VolumeCapability {
    api::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(volume_capability::MountVolume::default())),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter.into(),
        }),
    }
}

fn mode_of(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn errno_reading(path: &Path) -> Option<i32> {
    fs::read(path).err().and_then(|err| err.raw_os_error())
}

/// `path` is on a FUSE connection whose daemon is gone.
fn assert_dead(path: &Path, why: &str) {
    let errno = errno_reading(path);
    assert!(matches!(errno, Some(ENOTCONN | ECONNABORTED)), "{}: {why}: read gave errno {errno:?}", path.display());
}

/// Waits until no process of `pids` is left (exited, or a zombie).
fn wait_gone(pids: &[u32]) -> Vec<u32> {
    let deadline = Instant::now() + GONE_TIMEOUT;
    loop {
        let alive: Vec<u32> = pids
            .iter()
            .copied()
            .filter(|pid| {
                fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|stat| stat.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
            })
            .collect();
        if alive.is_empty() || Instant::now() > deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn assert_no_secret(what: &str, text: &str) {
    assert!(!text.contains(SECRET), "{what} holds the secret:\n{text}");
}

#[test]
fn stages_and_publishes_through_the_proxy_are_recorded_exactly_and_removed_by_their_undoing() {
    let world = World::new(true, true, false);
    let info = world.kubelet.get_plugin_info().expect("GetPluginInfo through the proxy");
    assert_eq!(info.name, DRIVER);
    assert!(world.kubelet.probe().unwrap().ready.unwrap_or(false));
    assert!(world.kubelet.get_plugin_capabilities().unwrap().capabilities.is_empty());
    assert_eq!(world.kubelet.node_get_info().unwrap().node_id, "node");
    let capabilities = world.kubelet.node_get_capabilities().unwrap().capabilities;
    let stage_unstage = node_service_capability::rpc::Type::StageUnstageVolume as i32;
    assert!(
        capabilities.iter().any(|capability| matches!(&capability.r#type,
            Some(node_service_capability::Type::Rpc(rpc)) if rpc.r#type == stage_unstage)),
        "{capabilities:?}"
    );

    let mut sent = Vec::new();
    for volume in &VOLUMES {
        let stage = world.stage_request(volume);
        world.kubelet.stage(stage.clone()).unwrap_or_else(|status| panic!("stage {}: {status}", volume.handle));
        let publish = world.publish_request(volume, &stage);
        world.kubelet.publish(publish.clone()).unwrap_or_else(|status| panic!("publish {}: {status}", volume.handle));
        let target = world.outside(&publish.target_path);
        if volume.read_only {
            assert_eq!(fs::read_to_string(target.join("inner.txt")).unwrap(), format!("inner of {}", volume.handle));
            let written = fs::write(target.join("new.txt"), "x").unwrap_err();
            assert_eq!(written.raw_os_error(), Some(EROFS), "{}", volume.handle);
        } else {
            assert_eq!(fs::read_to_string(target.join("data.txt")).unwrap(), format!("data of {}", volume.handle));
        }
        sent.push(Request::Stage(stage));
        sent.push(Request::Publish(publish));
    }

    assert_eq!(mode_of(&world.records), 0o700);
    let read = world.read_records();
    assert!(read.corrupt.is_empty(), "{:?}", read.corrupt);
    assert_eq!(read.records.len(), sent.len(), "{:?}", read.records);
    for request in &sent {
        let record = read.records.iter().find(|record| record.request == *request);
        let record = record.unwrap_or_else(|| panic!("no record equals {request:?}: {:?}", read.records));
        assert_eq!(record.driver.as_deref(), Some(DRIVER));
        assert_eq!(record.secrets, Secrets::Recorded);
        assert_eq!(mode_of(&record.file), 0o600, "{}", record.file.display());
    }

    for request in &sent {
        if let Request::Publish(publish) = request {
            world.kubelet.unpublish(&publish.volume_id, &publish.target_path).unwrap();
        }
    }
    let left = world.read_records().records;
    assert!(left.iter().all(|record| matches!(record.request, Request::Stage(_))), "{left:?}");
    assert_eq!(left.len(), VOLUMES.len());
    for request in &sent {
        if let Request::Stage(stage) = request {
            world.kubelet.unstage(&stage.volume_id, &stage.staging_target_path).unwrap();
        }
    }
    assert!(world.read_records().records.is_empty());
    assert_eq!(wait_gone(&world.plugin.children()), Vec::<u32>::new(), "the daemons outlived their unstage");

    let log = world.proxy.log();
    assert_no_secret("the proxy's log", &log);
    assert_eq!(log.matches("recorded").count(), sent.len(), "{log}");
    assert_eq!(log.matches("record removed").count(), sent.len(), "{log}");
}

#[test]
fn driver_errors_pass_back_unchanged_and_a_driver_down_answers_unavailable() {
    let mut world = World::new(true, true, false);
    let volume = &VOLUMES[0];
    let mut stage = world.stage_request(volume);
    stage.volume_context.insert("source".into(), "/nonexistent/source".into());
    let direct = world.direct.stage(stage.clone()).unwrap_err();
    let proxied = world.kubelet.stage(stage.clone()).unwrap_err();
    assert_eq!(direct.code(), Code::NotFound);
    assert_eq!((proxied.code(), proxied.message()), (direct.code(), direct.message()));
    let mut no_capability = world.stage_request(volume);
    no_capability.volume_capability = None;
    let direct = world.direct.stage(no_capability.clone()).unwrap_err();
    let proxied = world.kubelet.stage(no_capability).unwrap_err();
    assert_eq!((proxied.code(), proxied.message()), (Code::InvalidArgument, direct.message()));
    assert!(world.read_records().records.is_empty());
    assert!(fs::read_dir(&world.records).unwrap().next().is_none(), "a refused call left a file");

    world.plugin.kill().unwrap();
    assert_eq!(world.kubelet.probe().unwrap_err().code(), Code::Unavailable);
    let status = world.kubelet.stage(world.stage_request(volume)).unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert!(world.read_records().records.is_empty());

    world.plugin.restart(&world.sandbox).unwrap();
    assert!(world.kubelet.probe().expect("Probe through the proxy once the driver is back").ready.unwrap_or(false));
    world.kubelet.stage(world.stage_request(volume)).expect("stage once the driver is back");
    assert_eq!(world.read_records().records.len(), 1);
    assert_no_secret("the proxy's log", &world.proxy.log());
    let exit = world.proxy.stop().unwrap();
    assert!(exit.success(), "the proxy exits cleanly on SIGTERM: {exit}");
    assert!(!world.proxy.outside_listen().exists(), "the proxy left its socket");
}

#[test]
fn with_record_secrets_off_no_secret_reaches_a_record_or_a_log() {
    let world = World::new(false, true, false);
    let volume = &VOLUMES[0];
    let stage = world.stage_request(volume);
    world.kubelet.stage(stage.clone()).unwrap();
    let publish = world.publish_request(volume, &stage);
    world.kubelet.publish(publish.clone()).unwrap();
    let read = world.read_records();
    assert_eq!(read.records.len(), 2, "{:?} {:?}", read.records, read.corrupt);
    for record in &read.records {
        assert_eq!(record.secrets, Secrets::Omitted);
        assert_no_secret("a record's request", &String::from_utf8_lossy(&record.request_bytes));
        let expected = match &record.request {
            Request::Stage(_) => {
                Request::Stage(api::NodeStageVolumeRequest { secrets: HashMap::new(), ..stage.clone() })
            }
            Request::Publish(_) => {
                Request::Publish(api::NodePublishVolumeRequest { secrets: HashMap::new(), ..publish.clone() })
            }
        };
        assert_eq!(record.request, expected);
    }
    for file in fs::read_dir(&world.records).unwrap() {
        let path = file.unwrap().path();
        assert_no_secret(&path.display().to_string(), &String::from_utf8_lossy(&fs::read(&path).unwrap()));
    }
    assert_no_secret("the proxy's log", &world.proxy.log());
}

#[test]
fn a_killed_plugin_takes_its_daemons_and_comes_back_with_its_socket_but_no_mount() {
    let mut world = World::new(true, true, false);
    let volumes = [
        &VOLUMES[0],
        &VOLUMES[1],
        &Volume { handle: "rclone-handle", daemon: "rclone", pod_uid: "pod-c", pv: "pv-rclone", read_only: false },
    ];
    let mut staged = Vec::new();
    for volume in volumes {
        let stage = world.stage_request(volume);
        world.kubelet.stage(stage.clone()).unwrap_or_else(|status| panic!("stage {}: {status}", volume.handle));
        let data = world.outside(&stage.staging_target_path).join("data.txt");
        assert_eq!(fs::read_to_string(&data).unwrap(), format!("data of {}", volume.handle));
        staged.push(data);
    }
    let daemons = world.plugin.children();
    // bindfs, rclone, and sshfs with its sftp-server.
    assert_eq!(daemons.len(), 4, "{daemons:?}");

    world.plugin.kill().unwrap();
    assert_eq!(wait_gone(&daemons), Vec::<u32>::new(), "daemons outlived their plugin");
    for data in &staged {
        assert_dead(data, "its daemon died with the plugin");
    }

    world.plugin.restart(&world.sandbox).unwrap();
    assert!(world.kubelet.probe().unwrap().ready.unwrap_or(false));
    assert!(world.plugin.children().is_empty(), "a restarted plugin started daemons by itself");
    for data in &staged {
        assert_dead(data, "a restarted plugin mounts nothing by itself");
    }
    assert_eq!(world.read_records().records.len(), volumes.len(), "the records outlive the plugin");
}

#[test]
fn the_variants_mount_at_publish_or_trust_proc_mounts() {
    let world = World::new(true, false, false);
    assert!(world.kubelet.node_get_capabilities().unwrap().capabilities.is_empty());
    let volume = &VOLUMES[0];
    let stage = world.stage_request(volume);
    assert_eq!(world.kubelet.stage(stage.clone()).unwrap_err().code(), Code::Unimplemented);
    let publish =
        api::NodePublishVolumeRequest { staging_target_path: String::new(), ..world.publish_request(volume, &stage) };
    world.kubelet.publish(publish.clone()).unwrap();
    let data = world.outside(&publish.target_path).join("data.txt");
    assert_eq!(fs::read_to_string(&data).unwrap(), format!("data of {}", volume.handle));
    let read = world.read_records();
    assert_eq!(read.records.len(), 1);
    assert_eq!(read.records[0].request, Request::Publish(publish.clone()));
    world.kubelet.unpublish(&publish.volume_id, &publish.target_path).unwrap();
    assert!(world.read_records().records.is_empty());
    assert_eq!(wait_gone(&children_of(world.plugin.pid().unwrap())), Vec::<u32>::new());
    drop(world);

    let mut world = World::new(true, true, true);
    let stage = world.stage_request(volume);
    world.kubelet.stage(stage.clone()).unwrap();
    let data = world.outside(&stage.staging_target_path).join("data.txt");
    world.plugin.restart(&world.sandbox).unwrap();
    assert_dead(&data, "its daemon died with the plugin");
    world.kubelet.stage(stage).expect("the wrong success: OK for a dead mount /proc/mounts lists");
    assert_dead(&data, "the wrong success mounted nothing");
}
