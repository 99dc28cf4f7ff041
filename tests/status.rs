//! `fuse-supervisor status` offline, on a captured table: what it says about
//! the files it is given. Mounts nothing.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(path)
}

/// `status --mountinfo <the layouts fixture>` with a state directory of its
/// own (empty unless the test writes one) and `extra` arguments.
fn status(state_dir: &Path, extra: &[&Path]) -> Output {
    Command::new(BINARY)
        .arg("status")
        .arg("--mountinfo")
        .arg(fixture("mountinfo/layouts.txt"))
        .arg("--state-dir")
        .arg(state_dir)
        .args(extra)
        // Only what the test gives counts, whatever the environment sets.
        .env_remove("FUSE_SUPERVISOR_LAYOUT_CONFIG")
        .output()
        .expect("run status")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn status_refuses_a_layout_config_that_run_refuses() {
    let state = TempDir::new().unwrap();
    let missing = state.path().join("no-such-rules.toml");
    for (config, says) in [
        (missing.as_path(), "cannot read layout config".to_owned()),
        (&fixture("layout-config/bad-syntax.toml"), "bad-syntax.toml line 3".to_owned()),
        (&fixture("layout-config/unknown-placeholder.toml"), "unknown-placeholder.toml line 7".to_owned()),
    ] {
        let output = status(state.path(), &[Path::new("--layout-config"), config]);
        assert!(!output.status.success(), "{} accepted: {}", config.display(), stderr(&output));
        assert!(stderr(&output).contains(&says), "{}: {}", config.display(), stderr(&output));
    }
    let output = status(state.path(), &[Path::new("--layout-config"), &fixture("layout-config/rules.toml")]);
    assert!(output.status.success(), "{}", stderr(&output));
}

/// A captured Fluid node (the two mounts of Fluid's own recovery design)
/// with no kubelet tree and no state file: the pod's CSI volume is named
/// `<namespace>-<dataset>`, which the Fluid layout turns into the dataset's
/// global mount, and the target is not on that mount's connection.
#[test]
fn status_of_a_captured_fluid_node_locates_the_source_by_layout_and_calls_the_target_broken() {
    let state = TempDir::new().unwrap();
    let output = Command::new(BINARY)
        .args(["status", "--json", "--mountinfo"])
        .arg(fixture("mountinfo/fluid-example.txt"))
        .arg("--state-dir")
        .arg(state.path())
        .args(["--kubelet-root", "/var/lib/kubelet", "--fluid-mount-root", "/runtime-mnt"])
        .env_remove("FUSE_SUPERVISOR_LAYOUT_CONFIG")
        .output()
        .expect("run status");
    assert!(output.status.success(), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let targets = report["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 1, "{report}");
    let target = &targets[0];
    assert_eq!(target["state"], "broken", "{target}");
    assert_eq!(target["source"], "/runtime-mnt/jindo/default/shared-data/jindofs-fuse", "{target}");
    assert_eq!(target["located_by"], "fluid", "{target}");
}

#[test]
fn status_with_a_bad_state_file_says_where_it_is_bad_and_goes_on() {
    let state = TempDir::new().unwrap();
    let file = state.path().join("state.json");
    for (contents, says) in [
        (&b"{\"version\": 1, \"targets\": {,}}"[..], "key must be a string at line 1 column 28"),
        (b"", "EOF while parsing a value at line 1 column 0"),
    ] {
        std::fs::write(&file, contents).unwrap();
        let output = status(state.path(), &[]);
        assert!(output.status.success(), "{}", stderr(&output));
        let stderr = stderr(&output);
        assert!(stderr.contains(&file.display().to_string()) && stderr.contains(says), "{says}: {stderr}");
        assert!(String::from_utf8_lossy(&output.stdout).contains("FUSE targets"), "no report");
        assert_eq!(std::fs::read(&file).unwrap(), contents, "status changed the state file");
    }
}
