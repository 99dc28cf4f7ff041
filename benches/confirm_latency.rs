//! The kubelet's share of the heal latency: one pod on a demofs source,
//! crashed and restarted K times while `fuse-supervisor run` heals, once with
//! `--kubelet none` and once confirming each restart with the HTTPS kubelet
//! stand-in serving a full node (110 pods plus the source's owner). Prints
//! the supervisor's heal latency (its wake on the new mount to the heal done)
//! for both, and the `/pods` round trip inside it.
//!
//! ```text
//! cargo bench --bench confirm_latency [-- --cycles 20]
//! ```
//! (or `CONFIRM_BENCH_CYCLES`).
//! Needs root and /dev/fuse; runs in a private mount namespace.
use std::path::Path;
use std::time::{Duration, SystemTime};

use fuse_supervisor_testbed::kubelet::{KubeletStandIn, full_node_pods, fuse_owner_pod, pod_list_body};
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource, Restart, SupervisorProcess, wait_for};
use fuse_supervisor_testbed::{ContainerReader, Sandbox};
use serde_json::Value;

#[allow(dead_code)]
mod common;

use common::Flags;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
const TIMEOUT: Duration = Duration::from_secs(30);
const TOKEN: &str = "bench-token";

fn main() {
    let cycles: usize = Flags::new("CONFIRM_BENCH").number("cycles", "20");
    println!("heal latency with and without kubelet confirmation, {cycles} cycles each, 1 pod, demofs");
    let (none, _) = run(cycles, false);
    let (confirmed, kubelet) = run(cycles, true);
    report("heal, --kubelet none", &none);
    report("heal, kubelet confirms", &confirmed);
    report("  of which /pods round trip", &kubelet);
}

/// Heal latencies and kubelet round trips, in microseconds.
fn run(cycles: usize, confirm: bool) -> (Vec<u64>, Vec<u64>) {
    let binary = Path::new(BINARY);
    let sandbox = Sandbox::new().expect("sandbox");
    let mut source = FuseSource::start(&sandbox, Daemon::DemoFs, "bench").expect("daemon");
    let target = source.bind_volume(&sandbox, "app-pod", "data").expect("bind");
    let reader = ContainerReader::spawn(&sandbox, "app", &target, Path::new("data.txt")).expect("reader");
    let kubelet = KubeletStandIn::start().expect("stand-in");
    kubelet.set_token(Some(TOKEN));
    let host_path = sandbox.runtime_root().display().to_string();
    let node = |instance: u32| {
        let Value::Object(mut list) = serde_json::from_slice(&full_node_pods(110)).expect("node") else {
            panic!("a pod list is an object")
        };
        let mut items = list.remove("items").and_then(|items| items.as_array().cloned()).unwrap_or_default();
        items.push(fuse_owner_pod("fuse-owner", "owner-uid", &host_path, instance, SystemTime::now()));
        pod_list_body(items)
    };
    kubelet.set_pods(node(0));
    let args: Vec<String> = if confirm {
        let files = sandbox.root().join("credentials");
        let (ca, token, pem) = (files.join("ca.pem"), files.join("token"), kubelet.ca_pem().to_owned());
        let (ca_path, token_path) = (ca.display().to_string(), token.display().to_string());
        sandbox
            .run(move || {
                std::fs::create_dir_all(files)?;
                std::fs::write(ca, pem)?;
                std::fs::write(token, TOKEN)
            })
            .expect("credentials");
        let url = format!("https://127.0.0.1:{}", kubelet.port());
        vec!["--kubelet".into(), url, "--kubelet-ca-file".into(), ca_path, "--kubelet-token-file".into(), token_path]
    } else {
        vec!["--kubelet".into(), "none".into()]
    };
    let state = sandbox.root().join(if confirm { "state-confirm" } else { "state-none" });
    let supervisor = SupervisorProcess::start_with(&sandbox, binary, &state, args).expect("supervisor");
    let (mut heals, mut round_trips) = (Vec::new(), Vec::new());
    for cycle in 1..=cycles {
        source.crash().expect("crash");
        reader.wait_until(TIMEOUT, |seen| seen.error().is_some()).expect("crash seen");
        kubelet.set_pods(node(cycle as u32));
        let healed_before = count(&supervisor, "\"message\":\"healed\"");
        source.restart(&sandbox, Restart::UnmountThenMount).expect("restart");
        let expected = source.expected_content();
        reader.wait_until(TIMEOUT, |seen| seen.content() == Some(expected.as_str())).expect("reads again");
        wait_for("the heal is logged", TIMEOUT, || count(&supervisor, "\"message\":\"healed\"") > healed_before)
            .expect("healed");
        let log = supervisor.log();
        let healed = log.iter().rev().find(|line| line.contains("\"message\":\"healed\"")).expect("healed line");
        heals.push(field(healed, "latency_us"));
        if confirm {
            let line = log.iter().rev().find(|line| line.contains("kubelet confirms")).expect("confirmation");
            round_trips.push(field(line, "kubelet_us"));
        }
    }
    drop(supervisor);
    (heals, round_trips)
}

fn count(supervisor: &SupervisorProcess, needle: &str) -> usize {
    supervisor.log().iter().filter(|line| line.contains(needle)).count()
}

fn field(line: &str, name: &str) -> u64 {
    let json: Value = serde_json::from_str(line).expect("a JSON log line");
    json["fields"][name].as_u64().unwrap_or_else(|| panic!("no {name} in {line}"))
}

fn report(what: &str, samples: &[u64]) {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let at = |p: f64| sorted[((sorted.len() as f64 - 1.0) * p).round() as usize];
    println!("{what:<30} p50 {:>6} µs   p99 {:>6} µs   (n = {})", at(0.5), at(0.99), sorted.len());
}
