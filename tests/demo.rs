//! The demo end to end: it must heal every container in every cycle and
//! say so only then. Needs root and /dev/fuse.
use std::path::PathBuf;

use fuse_supervisor_testbed::demo::{self, DemoOptions, DemoReport, HealKind};

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");

fn run_demo(options: &DemoOptions) -> (DemoReport, String) {
    let mut output = Vec::new();
    let result = demo::run(options, &mut output);
    let output = String::from_utf8_lossy(&output).into_owned();
    match result {
        Ok(report) => (report, output),
        Err(err) => panic!("demo failed: {err}\n{err:?}\noutput:\n{output}"),
    }
}

fn assert_every_container_recovered(report: &DemoReport, cycles: usize) {
    assert_eq!(report.cycles.len(), cycles);
    for cycle in &report.cycles {
        assert_eq!(cycle.pods.len(), 3, "cycle {}", cycle.number);
        for pod in &cycle.pods {
            // A container that never failed was not part of the demo.
            assert!(!pod.errors.is_empty(), "cycle {}: {} saw no error", cycle.number, pod.pod);
            assert!(!pod.outage.is_zero(), "cycle {}: {} has no outage", cycle.number, pod.pod);
        }
        assert!(cycle.layers.iter().all(|(_, layers)| *layers >= 1), "cycle {}: {:?}", cycle.number, cycle.layers);
    }
}

#[test]
fn unmount_then_mount_cycles_heal_every_container_and_end_flat() {
    let options = DemoOptions { cycles: 2, mount_over_stale: false, ..DemoOptions::new(PathBuf::from(BINARY)) };
    let (report, output) = run_demo(&options);
    assert_every_container_recovered(&report, 2);
    assert_eq!(report.mounts_at_end, report.mounts_at_start, "{output}");
    for cycle in &report.cycles {
        assert_eq!(cycle.mounts_after, cycle.mounts_before, "cycle {}\n{output}", cycle.number);
        assert!(cycle.layers.iter().all(|(_, layers)| *layers == 1), "cycle {}: {:?}", cycle.number, cycle.layers);
        // The subPath target is always the supervisor's own stack.
        let stacked_subpath = cycle.heals.iter().any(|heal| heal.pod == "pod-c" && heal.kind == HealKind::Stacked);
        assert!(stacked_subpath, "cycle {}: {:?}\n{output}", cycle.number, cycle.heals);
    }
    assert!(output.contains("every container read its volume again"), "{output}");
}

#[test]
fn both_restart_styles_heal_every_container() {
    let options = DemoOptions { cycles: 2, ..DemoOptions::new(PathBuf::from(BINARY)) };
    let (report, output) = run_demo(&options);
    assert_every_container_recovered(&report, 2);
    let [first, second] = &report.cycles[..] else { unreachable!("two cycles asserted above") };
    assert!(!first.landed_on_stale);
    assert_eq!(first.mounts_after, first.mounts_before, "{output}");
    // A daemon that would mount over its stale mount finds a directory:
    // the supervisor detached the dead mount first (it waits for that, as a
    // pod's restart would), and every layer count is back to one.
    assert!(!second.landed_on_stale, "{output}");
    assert!(!report.stale_layers_expected());
    assert!(second.layers.iter().all(|(_, layers)| *layers == 1), "{:?}", second.layers);
    assert_eq!(second.mounts_after, second.mounts_before, "{output}");
    assert!(output.contains("the supervisor detached the dead global mount"), "{output}");
    assert!(output.contains("(back to the start)"), "{output}");
}
