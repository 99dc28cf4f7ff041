//! Every parser of outside input, fuzzed with mutations of the captured
//! inputs in `fixtures/` (see `fuse_supervisor_testbed::fuzz`), checking
//! properties, not only that nothing panics: a mountinfo line that parses
//! prints back to the same mount, a malformed line never hides the others'
//! mounts, no pod of a PodList is dropped without being named, a state file
//! that loads saves back to itself, and every error names the input and
//! where in it. The kubelet's HTTP framing is hyper's.
//!
//! `FUZZ_CASES` mutants per target (3,000 by default: a few seconds in
//! all); a long run: `FUZZ_CASES=1000000 cargo test --release --test fuzz
//! --lib -- fuzz --nocapture`, which prints executions per second.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fuse_supervisor_engine::kube::pods::PodList;
use fuse_supervisor_engine::model::mountinfo::{self, MountInfo, ParseErrorKind, parse_line, parse_lines};
use fuse_supervisor_engine::model::state::{Journal, StateError};
use fuse_supervisor_engine::model::table::{Dev, Snapshot};
use fuse_supervisor_engine::plan::layout::SourceLayouts;
use fuse_supervisor_engine::watch::pods::{VolData, VolDataError};
use fuse_supervisor_sys::fanotify::{self, MountEvent};
use fuse_supervisor_sys::proc_connector::{self, ProcEvent, TimedEvent};
use fuse_supervisor_sys::process::ExitStatus;
use fuse_supervisor_testbed::fuzz::{Fuzzer, mountinfo_line, repo};
use fuse_supervisor_webhook::{DEFAULT_OPT_OUT_ANNOTATION, ReviewError, Selection, VolumeCache, review};
use serde_json::Value;

fn fixtures(dir: &str) -> PathBuf {
    repo().join("fixtures").join(dir)
}

/// Line `n` (1-based) of `text`, as the parser splits lines.
fn line_count(text: &[u8]) -> usize {
    text.split(|&byte| byte == b'\n').count()
}

#[test]
fn fuzz_mountinfo() {
    let dictionary = [
        " - ",
        "shared:",
        "master:",
        "propagate_from:",
        "unbindable",
        "\\040",
        "\\134",
        "\\000",
        "\\9",
        "//deleted",
        "fuse.",
        "fuseblk",
        "\r",
        "\n",
        "/var/lib/kubelet/pods/",
        "/volumes/",
        "/volume-subpaths/",
        "4294967296",
    ];
    Fuzzer::new("mountinfo", &repo()).corpus_dir(&fixtures("mountinfo"), "txt").dictionary(dictionary).run(|text| {
        let mut well_formed = Vec::new();
        let mut malformed = Vec::new();
        for (index, line) in parse_lines(text).enumerate() {
            match line {
                Ok(mount) => {
                    // Prints back to the same mount.
                    let printed = mountinfo_line(&mount);
                    let again = parse_line(&printed, 1)
                        .unwrap_or_else(|err| panic!("{mount:?} printed as {printed:?} does not parse: {err}"));
                    assert_eq!(again, mount, "printed as {:?}", String::from_utf8_lossy(&printed));
                    well_formed.push(mount);
                }
                Err(err) => {
                    // Named by its line, column and field.
                    assert_eq!(err.line, index + 1);
                    let named = format!("mountinfo line {}, column {}: field `{}`: ", index + 1, err.column, err.field);
                    assert!(err.to_string().starts_with(&named), "{err}");
                    let line = text.split(|&byte| byte == b'\n').nth(index).unwrap_or_default();
                    column_names_the_field(&err, line);
                    malformed.push(err);
                }
            }
        }
        assert!(well_formed.len() + malformed.len() <= line_count(text));

        // The strict parse refuses the first malformed line; the lenient
        // one keeps every well-formed line and names every other.
        match (mountinfo::parse_table(text), malformed.first()) {
            (Ok(mounts), None) => assert_eq!(mounts, last_of_each_id(&well_formed)),
            (Err(err), Some(first)) => assert_eq!(&err, first),
            (result, first) => panic!("strict parse {result:?}, first malformed line {first:?}"),
        }
        let (snapshot, errors) = Snapshot::parse_lenient(text);
        assert_eq!(errors, malformed, "every malformed line is named");
        let kept: Vec<(u32, Dev, PathBuf)> =
            snapshot.fuse_mounts.iter().map(|m| (m.mount_id, m.dev, m.mount_point.clone())).collect();
        let expected: Vec<(u32, Dev, PathBuf)> = last_of_each_id(&well_formed)
            .iter()
            .filter(|m| m.is_fuse())
            .map(|m| (m.mount_id, Dev::from(m.dev()), m.mount_point.to_path().into_owned()))
            .collect();
        assert_eq!(kept, expected, "every well-formed FUSE mount is kept");
        if malformed.is_empty() {
            let strict = Snapshot::parse(text).expect("a table without malformed lines parses");
            assert_eq!(strict.fuse_mounts, snapshot.fuse_mounts);
        }
    });
}

/// The column of a malformed line's error is where its field starts in
/// `line`: after a space, at the line's start, or one past its end for a
/// field the line ends before; a quoted field is the text there.
fn column_names_the_field(err: &mountinfo::ParseError, line: &[u8]) {
    let at = err.column - 1;
    assert!(err.column >= 1 && at <= line.len(), "{err}: outside the line's {} bytes", line.len());
    let starts_a_field = at == 0 || line.get(at - 1) == Some(&b' ');
    match &err.kind {
        ParseErrorKind::Missing => assert!(starts_a_field || at == line.len(), "{err}"),
        ParseErrorKind::EmbeddedNewline => {}
        ParseErrorKind::InvalidNumber(quoted)
        | ParseErrorKind::InvalidDevice(quoted)
        | ParseErrorKind::InvalidEscape(quoted)
        | ParseErrorKind::EscapedNul(quoted)
        | ParseErrorKind::RelativePath(quoted) => {
            assert!(starts_a_field, "{err}");
            // A quote cut inside a character ends in a replacement.
            let quoted = quoted.trim_end_matches('\u{fffd}');
            let here = String::from_utf8_lossy(&line[at..]);
            assert!(here.starts_with(quoted), "{err}: the line has {here:?} there");
        }
        _ => assert!(starts_a_field, "{err}"),
    }
}

/// A table's mounts as deduplication leaves them: the last line of each
/// mount ID, at its place.
fn last_of_each_id<'a>(mounts: &[MountInfo<'a>]) -> Vec<MountInfo<'a>> {
    let last: HashMap<u32, usize> = mounts.iter().enumerate().map(|(index, m)| (m.mount_id, index)).collect();
    mounts.iter().enumerate().filter(|(index, m)| last[&m.mount_id] == *index).map(|(_, m)| *m).collect()
}

#[test]
fn fuzz_kubelet_pod_list() {
    let dictionary = [
        "\"items\"",
        "null",
        "[]",
        "{}",
        "\"startedAt\"",
        "\"2024-05-01T10:00:00Z\"",
        "\"containerStatuses\"",
        "\"metadata\"",
        "\"uid\"",
        "1e999",
        "\"\\u0000\"",
        "true",
        "-1",
        "\"running\"",
        "\"terminated\"",
    ];
    Fuzzer::new("pod-list", &repo()).corpus_dir(&fixtures("kubelet"), "json").dictionary(dictionary).run(|body| {
        let parsed = PodList::from_slice(body);
        let json: Option<Value> = serde_json::from_slice(body).ok();
        match (parsed, json) {
            (Ok(list), Some(json)) => {
                // No pod left out unnamed.
                let items = json.get("items").and_then(Value::as_array).map_or(0, Vec::len);
                assert_eq!(list.items.len() + list.skipped.len(), items, "pods read and skipped");
                let mut previous = None;
                for skipped in &list.skipped {
                    assert!(skipped.index < items && previous < Some(skipped.index), "{skipped:?}");
                    assert!(!skipped.problem.is_empty(), "{skipped:?}");
                    previous = Some(skipped.index);
                }
            }
            // serde_json skips the fields nobody reads without checking
            // their strings' UTF-8, which is harmless; any other break of
            // the syntax must be refused.
            (Ok(list), None) if std::str::from_utf8(body).is_ok() => {
                panic!("not JSON, yet read as {} pods", list.items.len())
            }
            (Ok(_), None) => {}
            (Err(err), _) => {
                assert!(err.line >= 1, "{err}: no line");
                let chain = format!("{err}: {}", err.source);
                assert!(chain.contains(&format!("line {} column {}", err.line, err.column)), "{chain}");
            }
        }
    });
}

#[test]
fn fuzz_vol_data() {
    let path = Path::new("/var/lib/kubelet/pods/uid/volumes/kubernetes.io~csi/pv/vol_data.json");
    let dictionary = [
        "\"specVolID\"",
        "\"volumeHandle\"",
        "\"driverName\"",
        "\"volumeLifecycleMode\"",
        "\"Ephemeral\"",
        "\"\"",
        "null",
        "{",
        "}",
        "[]",
        "0",
    ];
    Fuzzer::new("vol-data", &repo()).corpus_dir(&fixtures("vol_data"), "json").dictionary(dictionary).run(|bytes| {
        match VolData::parse(bytes, path) {
            Ok(data) => {
                let json: Value = serde_json::from_slice(bytes).expect("read, so it is JSON");
                assert_eq!(json["volumeHandle"].as_str(), Some(&*data.volume_handle));
                assert_eq!(json["driverName"].as_str(), Some(&*data.driver_name));
                assert_eq!(json["specVolID"].as_str(), Some(&*data.spec_vol_id));
            }
            Err(err) => {
                assert!(err.to_string().contains(&path.display().to_string()), "{err}");
                if let VolDataError::Syntax { source, .. } = &err {
                    assert!(source.line() >= 1, "{err}: {source}");
                }
            }
        }
    });
}

#[test]
fn fuzz_layout_config() {
    let config = Path::new("/etc/fuse-supervisor/layouts.toml");
    let dictionary = [
        "[[rule]]",
        "driver = ",
        "source = ",
        "{volumeHandle}",
        "{volumeHandleSha256}",
        "{podUID}",
        "{",
        "}",
        "\"",
        "'''",
        "\n",
        "=",
        "é",
    ];
    Fuzzer::new("layout-config", &repo()).corpus_dir(&fixtures("layout-config"), "toml").dictionary(dictionary).run(
        |bytes| {
            let Ok(text) = std::str::from_utf8(bytes) else { return };
            if let Err(err) = SourceLayouts::new(Path::new("/var/lib/kubelet")).with_rules(text, config) {
                let message = err.to_string();
                let prefix = format!("layout config {} line ", config.display());
                let line: usize = message
                    .strip_prefix(&prefix)
                    .and_then(|rest| rest.split(':').next())
                    .and_then(|line| line.parse().ok())
                    .unwrap_or_else(|| panic!("{message}: no file and line"));
                assert!((1..=line_count(bytes)).contains(&line), "{message}: line {line} of {}", line_count(bytes));
            }
        },
    );
}

#[test]
fn fuzz_state_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let dictionary = ["\"version\"", "1", "2", "\"targets\"", "\"sources\"", "null", "{}", "[]", "\"dev\"", "-1"];
    Fuzzer::new("state-file", &repo()).corpus(state_files(dir.path())).dictionary(dictionary).run(|bytes| {
        match Journal::parse(bytes, &path) {
            Ok(journal) => {
                // Saves back to a file that loads to the same.
                journal.save().expect("save");
                let saved = std::fs::read(&path).unwrap();
                let again = Journal::parse(&saved, &path).expect("a saved state file loads");
                assert_eq!(again.mappings(), journal.mappings());
                again.save().unwrap();
                assert_eq!(std::fs::read(&path).unwrap(), saved, "saving is a fixed point");
            }
            Err(err) => {
                assert!(err.to_string().contains(&path.display().to_string()), "{err}");
                if let StateError::Invalid { .. } = err {
                    let (line, column) = err.position().expect("a syntax error has a position");
                    assert!(line >= 1 && line <= line_count(bytes), "{err}: line {line} column {column}");
                }
            }
        }
    });
}

/// State files as `run` writes them, from the unit tests' kinds of records.
fn state_files(dir: &Path) -> Vec<Vec<u8>> {
    use fuse_supervisor_engine::model::state::Mapping;
    use fuse_supervisor_engine::model::table::TargetKind;
    let mut journal = Journal::load(dir).unwrap();
    let mut files = vec![b"{\"version\":1}".to_vec()];
    for (index, kind) in [TargetKind::Volume, TargetKind::Subpath, TargetKind::SourceBind].into_iter().enumerate() {
        let source = PathBuf::from(format!("/runtime-mnt/juicefs/default/data-{index}/juicefs-fuse"));
        journal.sight_source(&source, 40 + index as u32, Some(std::time::SystemTime::UNIX_EPOCH));
        let mapping = Mapping {
            source,
            root_in_source: if kind == TargetKind::Subpath { "sub/dir".into() } else { PathBuf::new() },
            source_mount_id: 40 + index as u32,
            peer_group: Some(7),
            dev: Dev { major: 0, minor: 50 + index as u32 },
            pod_uid: format!("pod-{index}"),
            kind,
        };
        journal.record(Path::new(&format!("/var/lib/kubelet/pods/pod-{index}/volumes/x/mount")), mapping);
        journal.save().unwrap();
        files.push(std::fs::read(dir.join("state.json")).unwrap());
    }
    files
}

#[test]
fn fuzz_admission_review() {
    let selection = Selection::new(["csi.juicefs.com".to_owned()], [], DEFAULT_OPT_OUT_ANNOTATION);
    let cache = VolumeCache::new();
    let dictionary = [
        "\"mountPropagation\"",
        "\"HostToContainer\"",
        "\"volumeMounts\"",
        "\"csi\"",
        "\"CREATE\"",
        "\"UPDATE\"",
        "\"ephemeralContainers\"",
        "null",
        "[]",
        "{}",
        "\"admission.k8s.io/v1\"",
    ];
    Fuzzer::new("admission", &repo()).corpus_dir(&fixtures("admission"), "json").dictionary(dictionary).run(|body| {
        match review(body, &selection, &cache) {
            Ok(reviewed) => {
                let answer: Value = serde_json::from_slice(&reviewed.response).expect("the answer is JSON");
                assert_eq!(answer["response"]["uid"].as_str(), Some(reviewed.uid.as_str()));
                assert_eq!(answer["response"]["allowed"], Value::Bool(true), "this webhook never refuses");
            }
            Err(ReviewError::Malformed { path, source }) => {
                assert!(!path.is_empty());
                assert!(source.line() >= 1 || source.is_data(), "{source}: no position");
            }
            Err(_) => {}
        }
    });
}

/// fanotify's `fanotify_event_metadata` (24 bytes) and a mount record.
fn fanotify_event(mask: u64, mount_id: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; 40];
    bytes[0..4].copy_from_slice(&40u32.to_ne_bytes());
    bytes[4] = 3;
    bytes[6..8].copy_from_slice(&24u16.to_ne_bytes());
    bytes[8..16].copy_from_slice(&mask.to_ne_bytes());
    bytes[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
    bytes[24] = 7;
    bytes[26..28].copy_from_slice(&16u16.to_ne_bytes());
    bytes[32..40].copy_from_slice(&mount_id.to_ne_bytes());
    bytes
}

const FAN_MNT_ATTACH: u64 = 0x0100_0000;
const FAN_MNT_DETACH: u64 = 0x0200_0000;
const FAN_Q_OVERFLOW: u64 = 0x4000;

fn encode_mount_events(events: &[MountEvent]) -> Vec<u8> {
    let mut read = Vec::new();
    for event in events {
        read.extend(match *event {
            MountEvent::Attached(id) => fanotify_event(FAN_MNT_ATTACH, id),
            MountEvent::Detached(id) => fanotify_event(FAN_MNT_DETACH, id),
            MountEvent::Moved(id) => fanotify_event(FAN_MNT_ATTACH | FAN_MNT_DETACH, id),
            MountEvent::Overflow => {
                let mut overflow = fanotify_event(FAN_Q_OVERFLOW, 0);
                overflow.truncate(24);
                overflow[0..4].copy_from_slice(&24u32.to_ne_bytes());
                overflow
            }
        });
    }
    read
}

fn decode_mount_events(read: &[u8]) -> (Result<usize, fanotify::DecodeError>, Vec<MountEvent>, Vec<i32>) {
    let (mut events, mut fds) = (Vec::new(), Vec::new());
    let result = fanotify::decode_events(read, |event| events.push(event), |fd| fds.push(fd));
    (result, events, fds)
}

#[test]
fn fuzz_fanotify_mount_events() {
    let samples = [
        vec![MountEvent::Attached(0x1_0000_0001)],
        vec![MountEvent::Attached(5), MountEvent::Detached(6), MountEvent::Moved(7)],
        vec![MountEvent::Detached(u64::MAX), MountEvent::Overflow, MountEvent::Attached(0)],
    ];
    for sample in &samples {
        let (result, events, _) = decode_mount_events(&encode_mount_events(sample));
        assert_eq!((result.unwrap(), &events), (sample.len(), sample));
    }
    let corpus = samples.iter().map(|sample| encode_mount_events(sample));
    let dictionary = [&3u32.to_ne_bytes()[..], &24u16.to_ne_bytes(), &40u32.to_ne_bytes(), &[7, 0, 16, 0]];
    Fuzzer::new("fanotify", &repo()).corpus(corpus).dictionary(dictionary).run(|read| {
        let (result, events, fds) = decode_mount_events(read);
        match result {
            Ok(count) => {
                assert_eq!(count, events.len());
                // What decodes encodes back to what decodes the same.
                let (again, same, _) = decode_mount_events(&encode_mount_events(&events));
                assert_eq!((again.ok(), &same), (Some(count), &events));
            }
            Err(err) => {
                assert!(err.offset < read.len() && err.len == read.len(), "{err}");
                assert!(err.to_string().starts_with(&format!("fanotify event at byte {} of a", err.offset)), "{err}");
                // The events before the bad one were handed over, exactly.
                let (before, handled, _) = decode_mount_events(&read[..err.offset]);
                assert_eq!((before.ok(), &handled), (Some(events.len()), &events));
            }
        }
        // Every fd handed back came from a whole, checked header.
        assert!(fds.len() <= read.len() / 24, "{fds:?}");
    });
}

/// A datagram of process events as the kernel sends them: per event a
/// `nlmsghdr` (16 bytes), a `cn_msg` (20) and a `proc_event` (16 + 24).
fn encode_proc_events(events: &[TimedEvent]) -> Vec<u8> {
    let mut datagram = Vec::new();
    for timed in events {
        let (what, data): (u32, [u32; 4]) = match timed.event {
            ProcEvent::Fork { parent_tgid, child_pid, child_tgid } => (1, [0, parent_tgid, child_pid, child_tgid]),
            ProcEvent::Exec { pid, tgid } => (2, [pid, tgid, 0, 0]),
            ProcEvent::Exit { pid, tgid, status } => (0x8000_0000, [pid, tgid, wait_status(status), 17]),
            ProcEvent::Other { what } => (what, [0; 4]),
        };
        let mut message = Vec::with_capacity(76);
        message.extend_from_slice(&76u32.to_ne_bytes());
        message.extend_from_slice(&3u16.to_ne_bytes());
        message.extend_from_slice(&[0; 10]);
        for word in [1u32, 1, 0, 0] {
            message.extend_from_slice(&word.to_ne_bytes());
        }
        message.extend_from_slice(&40u16.to_ne_bytes());
        message.extend_from_slice(&0u16.to_ne_bytes());
        message.extend_from_slice(&what.to_ne_bytes());
        message.extend_from_slice(&1u32.to_ne_bytes());
        message.extend_from_slice(&timed.timestamp_ns.to_ne_bytes());
        for word in data {
            message.extend_from_slice(&word.to_ne_bytes());
        }
        message.resize(76, 0);
        datagram.extend(message);
    }
    datagram
}

/// The wait status that decodes to `status`.
fn wait_status(status: ExitStatus) -> u32 {
    match status {
        ExitStatus::Exited(code) => u32::from(code) << 8,
        ExitStatus::Signaled { signal, core_dumped } => signal as u32 | if core_dumped { 0x80 } else { 0 },
    }
}

fn decode_proc_events(datagram: &[u8]) -> Vec<TimedEvent> {
    let mut events = Vec::new();
    proc_connector::decode_datagram(datagram, &mut events);
    events
}

#[test]
fn fuzz_proc_connector_messages() {
    let at = |event, timestamp_ns| TimedEvent { event, timestamp_ns };
    let sample = vec![
        at(ProcEvent::Exit { pid: 10, tgid: 10, status: ExitStatus::Signaled { signal: 9, core_dumped: false } }, 1),
        at(ProcEvent::Exit { pid: 11, tgid: 10, status: ExitStatus::Exited(3) }, 2),
        at(ProcEvent::Exec { pid: 12, tgid: 12 }, 3),
        at(ProcEvent::Fork { parent_tgid: 1, child_pid: 13, child_tgid: 13 }, u64::MAX),
        at(ProcEvent::Other { what: 0x200 }, 5),
    ];
    assert_eq!(decode_proc_events(&encode_proc_events(&sample)), sample);
    let corpus = [encode_proc_events(&sample), encode_proc_events(&sample[..1])];
    let dictionary = [&76u32.to_ne_bytes()[..], &1u32.to_ne_bytes(), &0x8000_0000u32.to_ne_bytes()];
    Fuzzer::new("proc-connector", &repo()).corpus(corpus).dictionary(dictionary).run(|datagram| {
        let events = decode_proc_events(datagram);
        assert!(events.len() <= datagram.len() / 52, "more events than room for them");
        assert_eq!(decode_proc_events(&encode_proc_events(&events)), events, "decoded events encode back");
        let _ = proc_connector::decode_ack(datagram);
    });
}
