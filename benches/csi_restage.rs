//! Re-staging through the CSI driver after its node plugin restarts
//! (`run --restage`): from the restarted plugin's socket answering `Probe`
//! (the agent's "the driver answers again") to the last of N runc
//! containers reading its volume again, split into the driver's own
//! `NodeStageVolume` (the agent's `took_us`: bindfs started and mounted)
//! and the agent's share (the probe's wake-up, the checks and the detach
//! before the call; the host heal and every container's after it), with
//! `--restage-grace 0s` (the grace is a configured wait, added as it is).
//! With a driver without a staging step (`publish`), each pod's bindfs is
//! mounted at its target and each target published again: the driver's
//! share is then the longest of the cycle's `NodePublishVolume` calls.
//!
//! Each container's reader is a busybox shell that forks `usleep` between
//! reads: at the default 10 ms, 100 readers fork 10,000 times a second and
//! saturate two CPUs by themselves (`--reader-interval-ms` eases them).
//!
//! `cargo bench --bench csi_restage [-- --sizes 10,100 --cycles 5
//! --drivers stage,publish --reader-interval-ms 10]`; needs root, /dev/fuse,
//! runc and bindfs.
use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

use fuse_supervisor_engine::csi::api::{self, volume_capability};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::csi::{
    CsiClient, CsiPluginProcess, CsiProxyProcess, PluginFlags, staging_path, vol_data_json,
};
use fuse_supervisor_testbed::runc::{Runc, RuncContainer, RuncSpec, VolumePropagation};
use fuse_supervisor_testbed::scenario::{self, SupervisorProcess};

#[allow(dead_code)]
mod common;

use common::{Flags, log_lines, timestamp};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const DRIVER: &str = "fuse.csi.bench";
const TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    if !common::is_root() {
        eprintln!("csi_restage bench: needs root (mount namespaces, /dev/fuse, runc); not run");
        return;
    }
    let flags = Flags::new("CSI_RESTAGE_BENCH");
    let sizes = flags.list("sizes", "10", |size| size.parse::<usize>().ok());
    let cycles: usize = flags.number("cycles", "5");
    let drivers = flags.list("drivers", "stage,publish", |driver| match driver {
        "stage" => Some(false),
        "publish" => Some(true),
        _ => None,
    });
    let interval = Duration::from_millis(flags.number("reader-interval-ms", "10"));
    println!(
        "re-staging a bindfs volume after its CSI plugin restarts, {cycles} restarts, --restage-grace 0s, readers every {interval:?}"
    );
    for publish_only in drivers {
        for &size in &sizes {
            let figures = measure(size, cycles, publish_only, interval);
            let (kind, call) = match publish_only {
                false => ("a driver that stages", "NodeStageVolume  "),
                true => ("a driver without a staging step", "NodePublishVolume"),
            };
            println!("{size} containers, {kind}");
            println!("  driver answers → last container reads    {}", summary(&figures.total));
            println!("    the driver's {call}          {}", summary(&figures.driver));
            println!("    ours (checks, detach, heals)           {}", summary(&figures.ours));
        }
    }
}

#[derive(Default)]
struct Figures {
    total: Vec<u64>,
    driver: Vec<u64>,
    ours: Vec<u64>,
}

fn measure(size: usize, cycles: usize, publish_only: bool, interval: Duration) -> Figures {
    let binary = Path::new(BINARY);
    let sandbox = Sandbox::new().expect("sandbox");
    let root = sandbox.root().to_path_buf();
    let plugin_dir = sandbox.kubelet_root().join("plugins").join(DRIVER);
    let dir = plugin_dir.clone();
    sandbox.run(move || fs::create_dir_all(dir)).unwrap();
    let flags = PluginFlags { publish_only, ..PluginFlags::default() };
    let mut plugin = CsiPluginProcess::start(&sandbox, &root.join("csi/plugin.sock"), DRIVER, flags).expect("plugin");
    let proxy = CsiProxyProcess::start(
        &sandbox,
        binary,
        &plugin_dir.join("csi.sock"),
        plugin.socket(),
        &root.join("run/records"),
        true,
    )
    .expect("proxy");
    let kubelet = CsiClient::connect(proxy.outside_listen()).unwrap();
    let backing = root.join("backing");
    let dir = backing.clone();
    sandbox.run(move || fs::create_dir_all(&dir).and_then(|()| fs::write(dir.join("data.txt"), "bench"))).unwrap();
    let capability = api::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(volume_capability::MountVolume::default())),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter.into(),
        }),
    };
    let context = HashMap::from([("daemon".into(), "bindfs".into()), ("source".into(), backing.display().to_string())]);
    // The kubelet sends a staging path exactly when the driver stages.
    let staging = match publish_only {
        false => staging_path(&sandbox.kubelet_root(), DRIVER, "bench-vol").display().to_string(),
        true => String::new(),
    };
    if !publish_only {
        kubelet
            .stage(api::NodeStageVolumeRequest {
                volume_id: "bench-vol".into(),
                staging_target_path: staging.clone(),
                volume_capability: Some(capability.clone()),
                volume_context: context.clone(),
                ..Default::default()
            })
            .expect("stage");
    }
    let runc = Runc::new(&sandbox).expect("runc image");
    let mut containers: Vec<RuncContainer> = Vec::new();
    for index in 0..size {
        let (uid, pv) = (format!("pod-{index}"), "pv-bench".to_owned());
        let target = sandbox.pod_volume_dir(&uid, &pv);
        let (dir, data) = (target.parent().unwrap().to_path_buf(), vol_data_json(DRIVER, "bench-vol", &pv, &uid));
        sandbox
            .run(move || fs::create_dir_all(&dir).and_then(|()| fs::write(dir.join("vol_data.json"), data)))
            .unwrap();
        kubelet
            .publish(api::NodePublishVolumeRequest {
                volume_id: "bench-vol".into(),
                staging_target_path: staging.clone(),
                target_path: target.display().to_string(),
                volume_capability: Some(capability.clone()),
                volume_context: context.clone(),
                ..Default::default()
            })
            .expect("publish");
        let propagation = if index % 2 == 0 { VolumePropagation::HostToContainer } else { VolumePropagation::None };
        let spec = RuncSpec::reader(uid, target, propagation, "data.txt", interval);
        containers.push(runc.start(&spec).expect("container"));
    }
    let args = [
        "--kubelet".to_owned(),
        "none".into(),
        "--log".into(),
        "info".into(),
        "--restage".into(),
        DRIVER.into(),
        "--csi-records".into(),
        root.join("run").display().to_string(),
        "--csi-socket".into(),
        format!("{DRIVER}={}", plugin.socket().display()),
        "--restage-grace".into(),
        "0s".into(),
    ];
    let agent = SupervisorProcess::start_with(&sandbox, binary, &root.join("state"), args).expect("agent");
    agent.wait_for_log(TIMEOUT, |line| line.contains("\"mount namespaces walked\"")).unwrap();
    let mut figures = Figures::default();
    // Per cycle: one daemon and one call, or one of each per pod.
    let per_cycle = if publish_only { size } else { 1 };
    let (waiting_line, done_line) = match publish_only {
        false => ("waiting for the driver to stage the volume again", "volume staged again"),
        true => ("waiting for the driver to publish the volume again", "volume published again"),
    };
    for cycle in 0..cycles {
        let (seen, next) = (cycle * per_cycle, (cycle + 1) * per_cycle);
        let watching = || log_lines(&agent, "watching the FUSE daemon").len() >= next;
        scenario::wait_for("the agent watching the daemons", TIMEOUT, watching).unwrap();
        plugin.kill().expect("kill the plugin");
        for container in &containers {
            container.wait_until(TIMEOUT, |seen| seen.error().is_some()).expect("the outage seen");
        }
        let waiting = || log_lines(&agent, waiting_line).len() >= next;
        scenario::wait_for("the agent waiting for the driver", TIMEOUT, waiting).unwrap();
        plugin.restart(&sandbox).expect("restart the plugin");
        let mut last = SystemTime::UNIX_EPOCH;
        for container in &containers {
            let seen = container.wait_until(TIMEOUT, |seen| seen.content() == Some("bench")).expect("reads again");
            last = last.max(seen.at);
        }
        let called = || log_lines(&agent, done_line).len() >= next;
        scenario::wait_for("the agent's calls", TIMEOUT, called).unwrap();
        // The first task of the cycle to see the driver answer.
        let answered = log_lines(&agent, "the driver answers again")[seen..next].iter().map(timestamp).min();
        let answered = answered.expect("the driver answered");
        let done = log_lines(&agent, done_line);
        let took = done[seen..next].iter().map(|line| line["fields"]["took_us"].as_u64().expect("took_us")).max();
        let took = took.expect("a call");
        let total = last.duration_since(answered).unwrap_or_default().as_micros() as u64;
        figures.total.push(total);
        figures.driver.push(took);
        figures.ours.push(total.saturating_sub(took));
    }
    drop(containers);
    figures
}

fn summary(micros: &[u64]) -> String {
    let mut micros = micros.to_vec();
    micros.sort_unstable();
    let at = |q: f64| micros[((micros.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    format!("p50 {:.1} ms  max {:.1} ms  ({} restarts)", at(0.5), at(1.0), micros.len())
}
