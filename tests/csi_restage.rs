//! Re-staging through the CSI driver after its node plugin restarts
//! (`run --restage`), with real parts: the test world's CSI node plugin
//! (bindfs, sshfs as its own children) staged and published through the
//! CSI proxy with the kubelet's paths, runc containers reading the volumes
//! (HostToContainer and None, a subPath among them), and the agent. The
//! plugin is killed (its daemons die with it) and started again with no
//! mount, as real plugins are: the agent stages each volume again with the
//! recorded request and the containers read again, one layer each, the
//! mount count back where it was. The cases the agent must not act in (a
//! pod deleted, a volume unstaged, a driver that stages by itself) make no
//! call; a driver that never answers holds neither the loop nor the exit.
//! A driver without a staging step (its daemons mount at the pods'
//! targets) gets each pod's volume published again instead. No secret
//! reaches any output. Needs root, /dev/fuse, runc, bindfs and
//! sshfs; every process and mount lives in the test's sandbox.
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuse_supervisor_engine::csi::api::{self, volume_capability};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::csi::{
    CsiClient, CsiPluginProcess, CsiProxyProcess, PluginFlags, staging_path, vol_data_json,
};
use fuse_supervisor_testbed::runc::{Runc, RuncContainer, RuncSpec, VolumePropagation};
use fuse_supervisor_testbed::scenario::{self, SupervisorProcess};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const DRIVER: &str = "fuse.csi.test";
const SECRET: &str = "restage-s3cr3t-never-shown";
const TIMEOUT: Duration = Duration::from_secs(30);
const READ_INTERVAL: Duration = Duration::from_millis(10);

/// How a pod mounts its volume in its container.
#[derive(Clone, Copy)]
enum Mounted {
    Whole(VolumePropagation),
    SubPath(VolumePropagation),
}

struct Pod {
    uid: String,
    container: RuncContainer,
    /// Its publish target.
    target: PathBuf,
    expected: String,
    /// Its container's mount table before the outage.
    baseline: BTreeMap<(PathBuf, String), usize>,
}

struct Volume {
    handle: String,
    stage: api::NodeStageVolumeRequest,
    pods: Vec<Pod>,
}

/// Declared so that containers, the agent, the proxy and the plugin go
/// before the sandbox.
struct World {
    volumes: Vec<Volume>,
    agent: Option<SupervisorProcess>,
    proxy: CsiProxyProcess,
    plugin: CsiPluginProcess,
    kubelet: CsiClient,
    runc: Runc,
    call_log: PathBuf,
    sandbox: Sandbox,
}

fn table_of(container: &RuncContainer) -> BTreeMap<(PathBuf, String), usize> {
    let mut table = BTreeMap::new();
    for mount in container.mounts().expect("the container's mount table") {
        *table.entry((mount.mount_point, mount.fs_type)).or_insert(0) += 1;
    }
    table
}

fn mount_capability() -> api::VolumeCapability {
    api::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(volume_capability::MountVolume::default())),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter.into(),
        }),
    }
}

impl World {
    /// The plugin on `csi/plugin.sock` (named to the agent by
    /// `--csi-socket`), the proxy the kubelet dials on
    /// `plugins/<driver>/csi.sock`, the records in `run/records`.
    fn new(trust_proc_mounts: bool) -> World {
        World::with_plugin(PluginFlags { trust_proc_mounts, ..PluginFlags::default() })
    }

    fn with_plugin(flags: PluginFlags) -> World {
        let sandbox = Sandbox::new().expect("a sandbox (needs root)");
        let root = sandbox.root().to_path_buf();
        let plugin_dir = sandbox.kubelet_root().join("plugins").join(DRIVER);
        let dir = plugin_dir.clone();
        sandbox.run(move || fs::create_dir_all(dir)).unwrap();
        let call_log = root.join("plugin-calls.log");
        let flags = PluginFlags { call_log: Some(call_log.clone()), ..flags };
        let plugin = CsiPluginProcess::start(&sandbox, &root.join("csi/plugin.sock"), DRIVER, flags)
            .expect("the CSI plugin starts");
        let record_dir = root.join("run/records");
        let proxy = CsiProxyProcess::start(
            &sandbox,
            Path::new(BINARY),
            &plugin_dir.join("csi.sock"),
            plugin.socket(),
            &record_dir,
            true,
        )
        .expect("the CSI proxy starts");
        let kubelet = CsiClient::connect(proxy.outside_listen()).unwrap();
        let runc = Runc::new(&sandbox).expect("the runc image");
        let call_log = sandbox.outside_path(&call_log);
        World { volumes: Vec::new(), agent: None, proxy, plugin, kubelet, runc, call_log, sandbox }
    }

    /// Whether the plugin has no staging step: its daemons mount at the
    /// pods' targets.
    fn publish_only(&self) -> bool {
        self.plugin.flags().publish_only
    }

    /// Stages a volume served by `daemon` through the proxy, as the kubelet
    /// does (unless the driver has no staging step), then publishes it to
    /// each pod and starts its container.
    fn add_volume(&mut self, handle: &str, daemon: &str, pods: &[(&str, Mounted)]) {
        let backing = self.sandbox.root().join("backing").join(handle);
        let (dir, content) = (backing.clone(), format!("data of {handle}"));
        self.sandbox
            .run(move || {
                fs::create_dir_all(dir.join("sub"))?;
                fs::write(dir.join("data.txt"), &content)?;
                fs::write(dir.join("sub/inner.txt"), format!("inner {content}"))
            })
            .unwrap();
        let stage = api::NodeStageVolumeRequest {
            volume_id: handle.into(),
            publish_context: HashMap::new(),
            staging_target_path: staging_path(&self.sandbox.kubelet_root(), DRIVER, handle).display().to_string(),
            volume_capability: Some(mount_capability()),
            secrets: HashMap::from([("password".into(), SECRET.into())]),
            volume_context: HashMap::from([
                ("daemon".into(), daemon.into()),
                ("source".into(), backing.display().to_string()),
            ]),
        };
        if !self.publish_only() {
            self.kubelet.stage(stage.clone()).expect("NodeStageVolume through the proxy");
        }
        let mut volume = Volume { handle: handle.into(), stage, pods: Vec::new() };
        for (uid, mounted) in pods {
            let pod = self.publish(&volume, uid, *mounted);
            volume.pods.push(pod);
        }
        self.volumes.push(volume);
    }

    fn publish(&self, volume: &Volume, uid: &str, mounted: Mounted) -> Pod {
        let pv = format!("pv-{}", volume.handle);
        let target = self.sandbox.pod_volume_dir(uid, &pv);
        let (dir, data) = (target.parent().unwrap().to_path_buf(), vol_data_json(DRIVER, &volume.handle, &pv, uid));
        self.sandbox
            .run(move || fs::create_dir_all(&dir).and_then(|()| fs::write(dir.join("vol_data.json"), data)))
            .unwrap();
        let publish = api::NodePublishVolumeRequest {
            volume_id: volume.handle.clone(),
            publish_context: HashMap::new(),
            // The kubelet sends one exactly when the driver stages.
            staging_target_path: match self.publish_only() {
                true => String::new(),
                false => volume.stage.staging_target_path.clone(),
            },
            target_path: target.display().to_string(),
            volume_capability: Some(mount_capability()),
            readonly: false,
            secrets: HashMap::from([("token".into(), SECRET.into())]),
            volume_context: volume.stage.volume_context.clone(),
        };
        self.kubelet.publish(publish).expect("NodePublishVolume through the proxy");
        let (volume_path, propagation, read, expected) = match mounted {
            Mounted::Whole(propagation) => {
                (target.clone(), propagation, "data.txt", format!("data of {}", volume.handle))
            }
            Mounted::SubPath(propagation) => {
                // The kubelet binds a subPath from the published target.
                let subpath = self.sandbox.subpath_dir(uid, &pv, "app", 0);
                self.sandbox.bind(&target.join("sub"), &subpath).expect("bind the subPath");
                (subpath, propagation, "inner.txt", format!("inner data of {}", volume.handle))
            }
        };
        let spec = RuncSpec::reader(uid, volume_path, propagation, read, READ_INTERVAL);
        let container = self.runc.start(&spec).unwrap_or_else(|err| panic!("start container {uid}: {err}"));
        let baseline = table_of(&container);
        Pod { uid: uid.into(), container, target, expected, baseline }
    }

    /// The agent with `--restage` for the test's driver, once it walked the
    /// node's mount namespaces.
    fn start_agent(&mut self, extra: &[&str]) {
        let state_dir = self.sandbox.root().join("state");
        // The proxy's directory is one of those in it, as on a node.
        let records = self.sandbox.root().join("run");
        let mut args: Vec<String> =
            ["--kubelet", "none", "--restage", DRIVER, "--csi-records"].map(str::to_owned).into();
        args.push(records.display().to_string());
        args.push("--csi-socket".into());
        args.push(format!("{DRIVER}={}", self.plugin.socket().display()));
        args.extend(extra.iter().map(|arg| (*arg).to_owned()));
        let agent =
            SupervisorProcess::start_with(&self.sandbox, Path::new(BINARY), &state_dir, &args).expect("the agent");
        agent.wait_for_log(TIMEOUT, |line| line.contains("\"mount namespaces walked\"")).unwrap();
        self.agent = Some(agent);
    }

    fn agent(&self) -> &SupervisorProcess {
        self.agent.as_ref().expect("the agent runs")
    }

    /// Where the plugin's daemons mount: each volume's staging path, or
    /// each pod's target for a driver without a staging step.
    fn daemon_mounts(&self) -> Vec<String> {
        match self.publish_only() {
            false => self.volumes.iter().map(|volume| volume.stage.staging_target_path.clone()).collect(),
            true => self.pods().map(|pod| pod.target.display().to_string()).collect(),
        }
    }

    fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.volumes.iter().flat_map(|volume| &volume.pods)
    }

    /// The agent watches every daemon of the plugin that holds a FUSE
    /// connection: their deaths will be seen.
    fn daemons_watched(&self) {
        let log = |agent: &SupervisorProcess| agent.log().join("\n");
        let mounts = self.daemon_mounts();
        scenario::wait_for("the agent watching the plugin's daemons", TIMEOUT, || {
            let log = log(self.agent());
            let watched = mounts.iter().filter(|mount| {
                log.lines().any(|line| line.contains("\"watching the FUSE daemon\"") && line.contains(mount.as_str()))
            });
            watched.count() == mounts.len()
        })
        .unwrap_or_else(|err| panic!("{err}\n{}", log(self.agent())));
    }

    /// Kills the plugin (its daemons die with it); every container sees it.
    fn kill_plugin(&mut self) {
        self.plugin.kill().expect("kill the plugin");
        for pod in self.volumes.iter().flat_map(|volume| &volume.pods) {
            pod.container
                .wait_until(TIMEOUT, |seen| seen.error().is_some())
                .unwrap_or_else(|err| panic!("container {} does not see the outage: {err}", pod.uid));
        }
    }

    /// The agent has handed every volume's death over and waits for the driver.
    fn agent_waits_for_driver(&self, count: usize) {
        let message = match self.publish_only() {
            false => "\"waiting for the driver to stage the volume again\"",
            true => "\"waiting for the driver to publish the volume again\"",
        };
        let waiting = |agent: &SupervisorProcess| agent.log().iter().filter(|line| line.contains(message)).count();
        scenario::wait_for("the agent waiting for the driver", TIMEOUT, || waiting(self.agent()) >= count)
            .unwrap_or_else(|err| panic!("{err}\n{}", self.agent().log().join("\n")));
    }

    fn restart_plugin(&mut self) {
        self.plugin.restart(&self.sandbox).expect("restart the plugin");
    }

    fn reads_again(&self, pod: &Pod) {
        pod.container.wait_until(TIMEOUT, |seen| seen.content() == Some(pod.expected.as_str())).unwrap_or_else(|err| {
            panic!(
                "container {} does not read {:?} again: {err}\n{}",
                pod.uid,
                pod.expected,
                self.agent().log().join("\n")
            )
        });
    }

    /// One layer at each container's volume, its table as before.
    fn settled(&self, pod: &Pod) {
        scenario::wait_for("the container's baseline mount table", TIMEOUT, || {
            table_of(&pod.container) == pod.baseline
        })
        .unwrap_or_else(|err| {
            panic!("container {}: {err}: now {:?}, before {:?}", pod.uid, table_of(&pod.container), pod.baseline)
        });
        let layers = pod.container.volume_mounts().expect("the container's volume mounts");
        assert_eq!(layers.len(), 1, "container {}: {layers:?}", pod.uid);
    }

    /// A pod deleted as the kubelet does it when the driver cannot answer:
    /// its container gone, its target detached and its directory removed.
    fn delete_pod(&self, pod: Pod) {
        let (target, pod_dir) = (pod.target.clone(), self.sandbox.kubelet_root().join("pods").join(&pod.uid));
        drop(pod.container);
        self.sandbox
            .run(move || {
                let _ = fuse_supervisor_sys::mount::detach(&target);
                fs::remove_dir_all(pod_dir)
            })
            .unwrap();
    }

    /// Every container reads again, one layer at its volume, its table and
    /// the node's mount count (`baseline`) as before the outage.
    fn all_read_again_as_before(&self, baseline: usize) {
        for pod in self.pods() {
            self.reads_again(pod);
        }
        for pod in self.pods() {
            self.settled(pod);
        }
        let count = || self.sandbox.count_mounts_under(self.sandbox.root());
        scenario::wait_for("the node's baseline mount count", TIMEOUT, || count() == baseline)
            .unwrap_or_else(|err| panic!("{err}: {} now, {baseline} before", count()));
    }

    /// How many `NodeStageVolume` calls the plugin had for `handle`.
    fn stage_calls(&self, handle: &str) -> usize {
        self.calls("NodeStageVolume", handle)
    }

    /// How many calls `method` the plugin had for `handle`.
    fn calls(&self, method: &str, handle: &str) -> usize {
        let log = fs::read_to_string(&self.call_log).unwrap_or_default();
        log.lines().filter(|line| *line == format!("{method} {handle}")).count()
    }

    fn metric(&self, result: &str) -> f64 {
        let series = format!("fuse_supervisor_restages_total{{driver=\"{DRIVER}\",result=\"{result}\"}}");
        self.agent().metric(&series).expect("the metrics endpoint").unwrap_or(0.0)
    }

    /// Waits for the agent to count `count` re-stage outcomes `result`: the
    /// loop counts what the re-stage task reports after its log line.
    fn counted(&self, result: &str, count: f64) {
        scenario::wait_for(&format!("{count} re-stage outcomes {result}"), TIMEOUT, || self.metric(result) >= count)
            .unwrap_or_else(|err| panic!("{err}: {} counted", self.metric(result)));
        assert_eq!(self.metric(result), count, "re-stage outcomes {result}");
    }

    /// Waits for the agent's log line `message` about `handle`.
    fn logged(&self, message: &str, handle: &str) {
        let volume = format!("\"volume_id\":\"{handle}\"");
        let message = format!("\"message\":\"{message}\"");
        self.agent()
            .wait_for_log(TIMEOUT, |line| line.contains(&message) && line.contains(&volume))
            .unwrap_or_else(|err| panic!("{err}"));
    }

    /// `status --json` in the sandbox, with the records: the state of each
    /// stage record by volume; no secret in what it prints.
    fn record_states(&self) -> BTreeMap<String, String> {
        self.status_records("stage", "volume_id")
    }

    /// The state of each record of `call` by its field `key`, as `status
    /// --json` prints it.
    fn status_records(&self, call: &str, key: &str) -> BTreeMap<String, String> {
        let mut command = std::process::Command::new(BINARY);
        command.args(["status", "--json", "--kubelet-root"]).arg(self.sandbox.kubelet_root());
        command.arg("--state-dir").arg(self.sandbox.root().join("state"));
        command.args(["--mount-namespace", "/proc/self/ns/mnt", "--csi-records"]).arg(self.sandbox.root().join("run"));
        command.stdout(std::process::Stdio::piped());
        let mut child = self.sandbox.spawn(command).expect("run status");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.take_stdout().expect("its stdout"), &mut out).unwrap();
        assert!(child.wait().expect("status exits").success(), "{out}");
        assert!(!out.contains(SECRET), "status prints the secret");
        let report: serde_json::Value = serde_json::from_str(&out).expect("status's JSON");
        let records = report["csi_records"].as_array().cloned().unwrap_or_default();
        records
            .iter()
            .filter(|record| record["call"] == call)
            .map(|record| (record[key].as_str().unwrap().to_owned(), record["state"].as_str().unwrap().to_owned()))
            .collect()
    }

    /// No output of the agent, the proxy, the state file or the metrics
    /// holds the secret.
    fn no_secret_anywhere(&self) {
        let agent = self.agent().log().join("\n");
        assert!(!agent.contains(SECRET), "the agent's log holds the secret");
        assert!(!self.proxy.log().contains(SECRET), "the proxy's log holds the secret");
        let (_, metrics) = self.agent().http_get("/metrics").expect("metrics");
        assert!(!metrics.contains(SECRET), "the metrics hold the secret");
        let state = self.sandbox.outside_path(&self.sandbox.root().join("state"));
        for entry in fs::read_dir(&state).expect("the state directory").flatten() {
            let text = fs::read(entry.path()).unwrap_or_default();
            assert!(!String::from_utf8_lossy(&text).contains(SECRET), "{} holds the secret", entry.path().display());
        }
    }
}

/// Two volumes (bindfs and sshfs), four pods: whole volumes and a subPath,
/// HostToContainer and None. The plugin is killed and started again with
/// no mount: the agent stages each volume again, once, with the recorded
/// request, and every container reads again, one layer at its volume, the
/// node's mount count as before; no output holds a secret.
#[test]
fn a_restarted_plugin_gets_every_volume_staged_again_and_every_container_reads() {
    let mut world = World::new(false);
    world.add_volume(
        "bindfs-vol",
        "bindfs",
        &[
            ("pod-a", Mounted::Whole(VolumePropagation::HostToContainer)),
            ("pod-b", Mounted::SubPath(VolumePropagation::None)),
        ],
    );
    world.add_volume(
        "sshfs-vol",
        "sshfs",
        &[
            ("pod-c", Mounted::Whole(VolumePropagation::None)),
            ("pod-d", Mounted::SubPath(VolumePropagation::HostToContainer)),
        ],
    );
    world.start_agent(&[]);
    world.daemons_watched();
    let baseline = world.sandbox.count_mounts_under(world.sandbox.root());
    let staged =
        BTreeMap::from([("bindfs-vol".to_owned(), "staged".to_owned()), ("sshfs-vol".to_owned(), "staged".to_owned())]);
    assert_eq!(world.record_states(), staged);
    world.kill_plugin();
    world.agent_waits_for_driver(2);
    let waiting = staged.keys().map(|volume| (volume.clone(), "waiting for its driver".to_owned())).collect();
    assert_eq!(world.record_states(), waiting);
    world.restart_plugin();
    world.all_read_again_as_before(baseline);
    for volume in &world.volumes {
        world.logged("volume staged again", &volume.handle);
        assert_eq!(world.stage_calls(&volume.handle), 2, "the kubelet's call and the agent's, for {}", volume.handle);
    }
    world.counted("restaged", 2.0);
    assert_eq!(world.metric("failed"), 0.0);
    assert_eq!(world.record_states(), staged);
    world.no_secret_anywhere();
}

/// During the outage a pod is deleted (its volume's only one) and another
/// volume is unstaged by the kubelet once the driver answers: neither is
/// staged again; a third volume, still used, is.
#[test]
fn a_deleted_pod_and_an_unstaged_volume_are_not_staged_again() {
    let mut world = World::new(false);
    world.add_volume("kept", "bindfs", &[("pod-kept", Mounted::Whole(VolumePropagation::HostToContainer))]);
    world.add_volume("deleted", "bindfs", &[("pod-deleted", Mounted::Whole(VolumePropagation::None))]);
    world.add_volume("unstaged", "bindfs", &[("pod-unstaged", Mounted::Whole(VolumePropagation::None))]);
    // A grace long enough for the kubelet's unstage below to land in it.
    world.start_agent(&["--restage-grace", "3s"]);
    world.daemons_watched();
    world.kill_plugin();
    world.agent_waits_for_driver(3);
    // The deleted pod: its container gone, its target and directory removed.
    let deleted = world.volumes.remove(1);
    world.delete_pod(deleted.pods.into_iter().next().unwrap());
    world.restart_plugin();
    // The kubelet unpublishes and unstages the other once the driver answers.
    let unstaged = &world.volumes[1];
    let pod = &unstaged.pods[0];
    world.kubelet.unpublish(&unstaged.handle, &pod.target.display().to_string()).expect("NodeUnpublishVolume");
    world.kubelet.unstage(&unstaged.handle, &unstaged.stage.staging_target_path).expect("NodeUnstageVolume");
    world.reads_again(&world.volumes[0].pods[0]);
    world.logged("volume staged again", "kept");
    world.logged("no running pod uses the volume: not staged again", "deleted");
    world.logged("the volume was unstaged: not staged again", "unstaged");
    assert_eq!(world.stage_calls("kept"), 2);
    assert_eq!(world.stage_calls("deleted"), 1, "the deleted pod's volume was staged again");
    assert_eq!(world.stage_calls("unstaged"), 1, "the unstaged volume was staged again");
    world.counted("no_pods", 1.0);
    world.counted("record_removed", 1.0);
}

/// A driver that stages its volume again by itself (as ceph-csi's healer
/// does) within the grace is not called a second time; its new mount is
/// healed as any.
#[test]
fn a_driver_that_stages_by_itself_is_not_called_again() {
    let mut world = World::new(false);
    world.add_volume("self-healed", "bindfs", &[("pod-a", Mounted::Whole(VolumePropagation::HostToContainer))]);
    world.start_agent(&["--restage-grace", "3s"]);
    world.daemons_watched();
    world.kill_plugin();
    world.agent_waits_for_driver(1);
    // The plugin mounts on a directory, not on the dead mount.
    world.agent().wait_for_log(TIMEOUT, |line| line.contains("\"message\":\"dead source detached")).unwrap();
    world.restart_plugin();
    // The driver's own healer, straight to its socket.
    let driver = CsiClient::connect(world.plugin.outside_socket()).unwrap();
    driver.stage(world.volumes[0].stage.clone()).expect("the driver stages by itself");
    world.reads_again(&world.volumes[0].pods[0]);
    world.settled(&world.volumes[0].pods[0]);
    world.logged("the driver staged the volume by itself: no call", "self-healed");
    assert_eq!(world.stage_calls("self-healed"), 2, "the kubelet's and the driver's own, not the agent's");
    world.counted("by_driver", 1.0);
    assert_eq!(world.metric("restaged"), 0.0);
}

/// A driver whose `NodeStageVolume` answers OK whenever `/proc/mounts`
/// lists the path: with the dead mount left at the staging path (the agent
/// does not detach dead sources here), the agent detaches it before its
/// call, so the driver mounts for real.
#[test]
fn a_driver_trusting_proc_mounts_is_not_fooled_by_the_dead_entry() {
    let mut world = World::new(true);
    world.add_volume("trusting", "bindfs", &[("pod-a", Mounted::Whole(VolumePropagation::HostToContainer))]);
    world.start_agent(&["--detach-dead-sources", "off"]);
    world.daemons_watched();
    world.kill_plugin();
    world.agent_waits_for_driver(1);
    world.restart_plugin();
    world.reads_again(&world.volumes[0].pods[0]);
    world.settled(&world.volumes[0].pods[0]);
    world.logged("volume staged again", "trusting");
}

/// A driver that never answers `NodeStageVolume`: the loop still answers
/// `/healthz` while the call hangs, and SIGTERM ends the agent.
#[test]
fn a_hung_driver_holds_neither_the_loop_nor_the_exit() {
    let mut world = World::new(false);
    world.add_volume("hung", "bindfs", &[("pod-a", Mounted::Whole(VolumePropagation::None))]);
    world.start_agent(&["--restage-grace", "100ms"]);
    world.daemons_watched();
    world.kill_plugin();
    world.agent_waits_for_driver(1);
    let hung = PluginFlags { hang_stage: true, ..world.plugin.flags().clone() };
    world.plugin.restart_with(&world.sandbox, hung).unwrap();
    scenario::wait_for("the agent's call to the hung driver", TIMEOUT, || world.stage_calls("hung") == 2).unwrap();
    let (status, _) = world.agent().http_get("/healthz").expect("/healthz while the call hangs");
    assert_eq!(status, 200);
    let agent = world.agent.take().unwrap();
    let exited = agent.terminate_within(TIMEOUT).expect("the agent exits on SIGTERM while the driver hangs");
    assert!(exited.success(), "{exited:?}");
}

/// The agent is killed during the outage (after it detached the dead
/// staging mount) and started again: it stages the volume again from the
/// records alone.
#[test]
fn an_agent_restarted_during_the_outage_stages_from_the_records() {
    let mut world = World::new(false);
    world.add_volume("survivor", "sshfs", &[("pod-a", Mounted::Whole(VolumePropagation::HostToContainer))]);
    world.start_agent(&[]);
    world.daemons_watched();
    world.kill_plugin();
    world.agent_waits_for_driver(1);
    world.agent().wait_for_log(TIMEOUT, |line| line.contains("\"message\":\"dead source detached")).unwrap();
    world.agent.take().unwrap().kill().expect("kill the agent");
    world.start_agent(&[]);
    world.agent_waits_for_driver(1);
    world.restart_plugin();
    world.reads_again(&world.volumes[0].pods[0]);
    world.settled(&world.volumes[0].pods[0]);
    world.logged("volume staged again", "survivor");
    world.no_secret_anywhere();
}

/// A driver without a staging step (its daemons mount at each pod's
/// target, bindfs and sshfs; two pods published before the agent starts,
/// two while it runs): killed and started again with no mount, it
/// gets each pod's volume published again with the recorded request, and
/// every container reads again (whole volumes and subPaths,
/// HostToContainer and None), one layer at its volume, the node's mount
/// count as before; no output holds a secret.
#[test]
fn a_restarted_plugin_without_staging_gets_every_pod_published_again() {
    let mut world = World::with_plugin(PluginFlags { publish_only: true, ..PluginFlags::default() });
    world.add_volume(
        "bindfs-pub",
        "bindfs",
        &[
            ("pod-a", Mounted::Whole(VolumePropagation::HostToContainer)),
            ("pod-b", Mounted::SubPath(VolumePropagation::None)),
        ],
    );
    world.start_agent(&[]);
    // Published while the agent runs: learnt from the new records alone.
    world.add_volume(
        "sshfs-pub",
        "sshfs",
        &[
            ("pod-c", Mounted::Whole(VolumePropagation::None)),
            ("pod-d", Mounted::SubPath(VolumePropagation::HostToContainer)),
        ],
    );
    world.daemons_watched();
    let baseline = world.sandbox.count_mounts_under(world.sandbox.root());
    let targets: Vec<String> = world.daemon_mounts();
    let states = |state: &str| targets.iter().map(|target| (target.clone(), state.to_owned())).collect();
    assert_eq!(world.status_records("publish", "path"), states("published"));
    world.kill_plugin();
    world.agent_waits_for_driver(4);
    assert_eq!(world.status_records("publish", "path"), states("waiting for its driver"));
    world.restart_plugin();
    world.all_read_again_as_before(baseline);
    for volume in &world.volumes {
        world.logged("volume published again", &volume.handle);
        assert_eq!(world.calls("NodePublishVolume", &volume.handle), 4, "the kubelet's 2 and the agent's 2");
        assert_eq!(world.stage_calls(&volume.handle), 0);
    }
    world.counted("restaged", 4.0);
    assert_eq!(world.metric("failed"), 0.0);
    assert_eq!(world.status_records("publish", "path"), states("published"));
    world.no_secret_anywhere();
}

/// A driver without a staging step: during the outage one pod is deleted
/// and another unpublished by the kubelet once the driver answers; neither
/// is published again, and the third pod is.
#[test]
fn a_deleted_pod_and_an_unpublished_target_are_not_published_again() {
    let mut world = World::with_plugin(PluginFlags { publish_only: true, ..PluginFlags::default() });
    world.add_volume(
        "shared",
        "bindfs",
        &[
            ("pod-kept", Mounted::Whole(VolumePropagation::HostToContainer)),
            ("pod-deleted", Mounted::Whole(VolumePropagation::None)),
            ("pod-unpublished", Mounted::Whole(VolumePropagation::None)),
        ],
    );
    // A grace long enough for the kubelet's unpublish below to land in it.
    world.start_agent(&["--restage-grace", "3s"]);
    world.daemons_watched();
    world.kill_plugin();
    world.agent_waits_for_driver(3);
    let deleted = world.volumes[0].pods.remove(1);
    world.delete_pod(deleted);
    world.restart_plugin();
    let unpublished = world.volumes[0].pods.remove(1);
    world.kubelet.unpublish("shared", &unpublished.target.display().to_string()).expect("NodeUnpublishVolume");
    drop(unpublished.container);
    world.reads_again(&world.volumes[0].pods[0]);
    world.settled(&world.volumes[0].pods[0]);
    world.counted("restaged", 1.0);
    world.counted("no_pods", 1.0);
    world.counted("record_removed", 1.0);
    world.logged("its pod is gone or terminating: not published again", "shared");
    world.logged("the volume was unpublished: not published again", "shared");
    assert_eq!(world.calls("NodePublishVolume", "shared"), 4, "the kubelet's 3 and the agent's 1");
}
