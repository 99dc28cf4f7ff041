//! The mountinfo parser against captured kernel tables, synthetic node tables
//! and malformed input; the reader against the real `/proc`.

use std::borrow::Cow;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use fuse_supervisor_engine::model::mountinfo::{
    Escaped, Field, MountInfo, MountInfoReader, ParseErrorKind, Propagation, parse_line, parse_lines, parse_table,
    parse_table_with,
};
use fuse_supervisor_sys::mountinfo_poll::priority_pending;
use fuse_supervisor_testbed::{synthetic_table, system};

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/mountinfo").join(name);
    std::fs::read(&path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()))
}

fn by_id<'a>(table: &'a [MountInfo<'a>], id: u32) -> &'a MountInfo<'a> {
    table.iter().find(|mount| mount.mount_id == id).unwrap_or_else(|| panic!("no mount {id}"))
}

fn path(field: &Escaped<'_>) -> PathBuf {
    field.to_path().into_owned()
}

const VALID: &str = "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue";

// ---- captured tables -------------------------------------------------------

#[test]
fn fluid_example_every_field() {
    let text = fixture("fluid-example.txt");
    let table = parse_table(&text).unwrap();
    assert_eq!(table.len(), 15);

    let pod = by_id(&table, 1426);
    assert_eq!(pod.parent_id, 2229);
    assert_eq!(pod.dev(), (0, 380));
    assert_eq!((pod.major, pod.minor), (0, 380));
    assert_eq!(pod.root.raw(), b"/");
    assert!(!pod.root_deleted);
    assert_eq!(
        path(&pod.mount_point),
        Path::new(
            "/var/lib/kubelet/pods/3d75de38-885a-479a-893e-39048cbf9941/volumes/kubernetes.io~csi/default-shared-data/mount"
        )
    );
    assert_eq!(pod.mount_options, "rw,nosuid,nodev,relatime");
    assert_eq!(pod.propagation, Propagation { shared: Some(236), ..Propagation::default() });
    assert_eq!(pod.fs_type, "fuse.jindofs-fuse");
    assert_eq!(pod.source.raw(), b"jindofs-fuse");
    assert_eq!(pod.super_options, "rw,user_id=0,group_id=0,allow_other");
    assert!(pod.is_fuse());

    let global = by_id(&table, 1650);
    assert_eq!(global.parent_id, 2222);
    assert_eq!(global.dev(), (0, 371));
    assert_eq!(global.root.raw(), b"/");
    assert_eq!(path(&global.mount_point), Path::new("/runtime-mnt/jindo/default/shared-data/jindofs-fuse"));
    assert_eq!(global.mount_options, "rw,nosuid,nodev,relatime");
    assert_eq!(global.propagation.shared, Some(226));
    assert_eq!(global.propagation.master, None);
    assert_eq!(global.fs_type, "fuse.jindofs-fuse");
    assert_eq!(global.source.raw(), b"jindofs-fuse");
    assert_eq!(global.super_options, "rw,user_id=0,group_id=0,allow_other");
    assert!(global.is_fuse());

    // The example is a broken bind: another connection and peer group.
    assert_ne!(pod.dev(), global.dev());
    assert_ne!(pod.propagation.shared, global.propagation.shared);

    let fuse: Vec<u32> = table.iter().filter(|m| m.is_fuse()).map(|m| m.mount_id).collect();
    assert_eq!(fuse, [1426, 1650]);
    let kubelet = by_id(&table, 2229);
    assert_eq!((kubelet.fs_type, kubelet.source.raw()), ("ext4", &b"/dev/vdb"[..]));
    let runtime = by_id(&table, 2222);
    assert_eq!(path(&runtime.root), Path::new("/runtime-mnt"));
    let rootfs = by_id(&table, 2200);
    assert_eq!((rootfs.parent_id, rootfs.fs_type), (2150, "overlay"));
    assert!(rootfs.super_options.contains(",upperdir="));
}

#[test]
fn escapes_in_mount_points_roots_and_sources() {
    let text = fixture("escapes.txt");
    let table = parse_table(&text).unwrap();
    assert_eq!(table.len(), 7);

    let space = by_id(&table, 91);
    assert_eq!(space.mount_point.raw(), br"/tmp/mi/cap/mnt/with\040space");
    assert_eq!(path(&space.mount_point), Path::new("/tmp/mi/cap/mnt/with space"));
    assert_eq!(&*space.source.unescaped(), b"my source");
    assert!(space.mount_point.has_escapes());

    let tab = by_id(&table, 92);
    assert_eq!(path(&tab.mount_point), Path::new("/tmp/mi/cap/mnt/tab\there"));
    assert_eq!(&*tab.source.unescaped(), b"tab\tsource");

    let newline = by_id(&table, 93);
    assert_eq!(path(&newline.mount_point), Path::new("/tmp/mi/cap/mnt/new\nline"));
    assert_eq!(&*newline.source.unescaped(), b"new\nline\\src");

    let backslash = by_id(&table, 94);
    assert_eq!(path(&backslash.mount_point), Path::new(r"/tmp/mi/cap/mnt/back\slash"));
    assert_eq!(&*backslash.source.unescaped(), br"back\slash");

    let bound = by_id(&table, 95);
    assert_eq!(path(&bound.root), Path::new("/src/sub dir\ttab\nnl\\back"));
    assert_eq!(bound.dev(), by_id(&table, 90).dev());

    let empty_source = by_id(&table, 96);
    assert_eq!(empty_source.source.raw(), b"");
    assert_eq!((empty_source.fs_type, empty_source.super_options), ("tmpfs", "rw"));

    // No escape: borrowed, no allocation.
    let plain = by_id(&table, 90);
    assert!(matches!(plain.mount_point.unescaped(), Cow::Borrowed(_)));
    assert!(matches!(plain.mount_point.to_path(), Cow::Borrowed(_)));
    assert!(matches!(space.mount_point.to_path(), Cow::Owned(_)));
}

#[test]
fn deleted_roots_are_flagged_and_stripped() {
    let text = fixture("deleted.txt");
    let table = parse_table(&text).unwrap();
    let roots: Vec<(u32, PathBuf, bool)> = table.iter().map(|m| (m.mount_id, path(&m.root), m.root_deleted)).collect();
    assert_eq!(
        roots,
        [
            (90, PathBuf::from("/"), false),
            (91, PathBuf::from("/gone"), true),
            (92, PathBuf::from("/gone with space"), true),
            (93, PathBuf::from("/keep/gone-sub"), true),
            (94, PathBuf::from("/gone-file"), true),
        ]
    );
    // The mount point is untouched.
    assert_eq!(path(&by_id(&table, 91).mount_point), Path::new("/tmp/mi/cap2/bind1"));
}

#[test]
fn deleted_suffix_only_at_the_end_of_the_root() {
    let line = b"1 0 0:1 /a//deletedx /m rw - tmpfs t rw";
    let mount = parse_line(line, 1).unwrap();
    assert!(!mount.root_deleted);
    assert_eq!(mount.root.raw(), b"/a//deletedx");
    let line = b"1 0 0:1 / /m//deleted rw - tmpfs t rw";
    let mount = parse_line(line, 1).unwrap();
    assert_eq!(mount.mount_point.raw(), b"/m//deleted", "only the root carries the marker");
}

#[test]
fn every_optional_field_form() {
    let text = fixture("propagation-host.txt");
    let table = parse_table(&text).unwrap();
    let forms: Vec<(u32, Propagation)> = table.iter().map(|m| (m.mount_id, m.propagation)).collect();
    let none = Propagation::default();
    assert_eq!(
        forms,
        [
            (90, none),
            (91, Propagation { shared: Some(1), ..none }),
            (92, Propagation { shared: Some(2), master: Some(1), ..none }),
            (93, Propagation { master: Some(2), ..none }),
            (94, Propagation { unbindable: true, ..none }),
            (95, Propagation { shared: Some(3), ..none }),
            (96, Propagation { shared: Some(3), ..none }),
        ]
    );

    let text = fixture("propagation-chroot.txt");
    let table = parse_table(&text).unwrap();
    assert!(table.iter().all(|m| m.parent_id == 90), "the parent is outside the root");
    assert!(!table.iter().any(|m| m.mount_point.raw() == b"/"));
    let slave = by_id(&table, 93);
    assert_eq!(path(&slave.mount_point), Path::new("/c"));
    assert_eq!(slave.propagation, Propagation { master: Some(2), propagate_from: Some(1), ..none });
}

#[test]
fn unknown_optional_tags_are_ignored() {
    let line = b"36 35 98:0 / /m rw future_tag shared:7 other:12 x - ext3 /dev/root rw";
    let mount = parse_line(line, 1).unwrap();
    assert_eq!(mount.propagation, Propagation { shared: Some(7), ..Propagation::default() });
    assert_eq!(mount.fs_type, "ext3");
    let line = b"36 35 98:0 / /m rw unbindable propagate_from:3 - ext3 /dev/root rw";
    let mount = parse_line(line, 1).unwrap();
    assert_eq!(mount.propagation, Propagation { propagate_from: Some(3), unbindable: true, ..Propagation::default() });
}

#[test]
fn fuse_bindfs_peers() {
    let text = fixture("fuse-bindfs.txt");
    let table = parse_table(&text).unwrap();
    let fuse: Vec<&MountInfo<'_>> = table.iter().filter(|m| m.is_fuse()).collect();
    assert_eq!(fuse.len(), 3);
    assert!(fuse.iter().all(|m| m.fs_type == "fuse.bindfs" && m.dev() == (0, 46)));
    assert!(fuse.iter().all(|m| m.propagation.shared == Some(2)));
    assert_eq!(fuse[0].source.raw(), b"bindfs");
}

#[test]
fn fuse_types() {
    for (fs_type, fuse) in [("fuse", true), ("fuse.juicefs", true), ("fuseblk", true), ("fusectl", false)] {
        let line = format!("1 0 0:1 / /m rw - {fs_type} src rw");
        assert_eq!(parse_line(line.as_bytes(), 1).unwrap().is_fuse(), fuse, "{fs_type}");
    }
}

#[test]
fn vm_host_capture_parses() {
    let text = fixture("vm-host.txt");
    let table = parse_table(&text).unwrap();
    assert_eq!(table.len(), text.iter().filter(|&&b| b == b'\n').count());
    assert!(table.iter().any(|m| m.mount_point.raw() == b"/"));
}

// ---- synthetic node tables -----------------------------------------------

#[test]
fn synthetic_10k_table() {
    let text = synthetic_table(10_000);
    let table = parse_table(text.as_bytes()).unwrap();
    assert_eq!(table.len(), 10_000);
    let mut ids: Vec<u32> = table.iter().map(|m| m.mount_id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 10_000);

    let expected_fuse = text.lines().filter(|line| line.contains(" - fuse.")).count();
    let fuse = parse_lines(text.as_bytes()).filter(|m| m.as_ref().unwrap().is_fuse()).count();
    assert_eq!(fuse, expected_fuse);
    assert!(fuse > 1000, "{fuse} FUSE mounts");
    assert!(table.iter().any(
        |m| m.mount_point.raw().ends_with(b"/mount") && m.mount_point.raw().starts_with(b"/var/lib/kubelet/pods/")
    ));
    assert!(table.iter().any(|m| m.root.has_escapes()), "some subPath roots carry escapes");
    assert!(table.iter().any(|m| m.propagation.master.is_some()));

    // Every pod bind is a peer of a global mount with the same device.
    let globals: Vec<&MountInfo<'_>> =
        table.iter().filter(|m| m.is_fuse() && m.mount_point.raw().starts_with(b"/runtime-mnt/")).collect();
    for bind in table.iter().filter(|m| m.is_fuse() && m.mount_point.raw().starts_with(b"/var/lib/kubelet/pods/")) {
        assert!(globals.iter().any(|g| g.dev() == bind.dev() && g.propagation.shared == bind.propagation.shared));
    }
}

#[test]
fn a_hundred_pod_node_is_a_few_hundred_lines() {
    let text = synthetic_table(600);
    let pods: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4)?.strip_prefix("/var/lib/kubelet/pods/"))
        .map(|rest| &rest[..36])
        .collect();
    assert!((80..=130).contains(&pods.len()), "{} pods", pods.len());
}

#[test]
fn duplicated_ids_keep_the_last_line() {
    let text = synthetic_table(10_000);
    let lines: Vec<&str> = text.lines().collect();
    // A non-atomic read: the kernel re-listed 500 mounts, and one of them
    // changed in between.
    let mut reread = text.clone();
    for line in &lines[4000..4500] {
        reread.push_str(line);
        reread.push('\n');
    }
    let changed = lines[4100].replacen(" rw,", " ro,", 1);
    reread.push_str(&changed);
    reread.push('\n');

    let table = parse_table(reread.as_bytes()).unwrap();
    assert_eq!(table.len(), 10_000);
    let changed_id: u32 = changed.split(' ').next().unwrap().parse().unwrap();
    let kept = by_id(&table, changed_id);
    assert!(kept.mount_options.starts_with("ro,"));
    assert_eq!(table.last().unwrap().mount_id, changed_id, "kept at its last place");
    // Lines not duplicated stay in order.
    assert_eq!(table[0].mount_id, 22);
}

#[test]
fn parse_table_with_keeps_like_parse_table() {
    let text = synthetic_table(2_000);
    let lines: Vec<&str> = text.lines().collect();
    let fuse_line = lines.iter().position(|line| line.contains(" - fuse.")).unwrap();
    // Re-listed: a FUSE mount (now a tmpfs in its last line), and a tmpfs.
    let mut reread = text.clone();
    let now_tmpfs = lines[fuse_line].split(" - ").next().unwrap().to_owned() + " - tmpfs tmpfs rw";
    let plain_line = lines.iter().position(|line| line.contains(" - tmpfs ")).unwrap();
    for line in [now_tmpfs.as_str(), lines[plain_line]] {
        reread.push_str(line);
        reread.push('\n');
    }
    for table in [&text, &reread] {
        let all = parse_table(table.as_bytes()).unwrap();
        let kept = parse_table_with(table.as_bytes(), |m| m.is_fuse().then_some(m.mount_id)).unwrap();
        let expected: Vec<u32> = all.iter().filter(|m| m.is_fuse()).map(|m| m.mount_id).collect();
        assert_eq!(kept.items, expected);
        assert_eq!(kept.total_mounts, all.len());
    }
    let dropped: u32 = lines[fuse_line].split(' ').next().unwrap().parse().unwrap();
    let kept = parse_table_with(reread.as_bytes(), |m| m.is_fuse().then_some(m.mount_id));
    assert!(!kept.unwrap().items.contains(&dropped), "its last line is not FUSE");
    let err = parse_table_with(format!("{text}bad line\n").as_bytes(), |_| Some(()));
    assert_eq!(err.unwrap_err().line, 2_001);
}

// ---- malformed input ---------------------------------------------------------

fn error_of(text: &str) -> (usize, Field, ParseErrorKind) {
    let err = parse_table(text.as_bytes()).expect_err(text);
    (err.line, err.field, err.kind)
}

#[test]
fn empty_file_and_trailing_newline() {
    assert!(parse_table(b"").unwrap().is_empty());
    assert_eq!(parse_lines(b"").count(), 0);
    let with = parse_table(format!("{VALID}\n{VALID}\n").as_bytes()).unwrap().len();
    let without = parse_table(format!("{VALID}\n{VALID}").as_bytes()).unwrap().len();
    assert_eq!((with, without), (1, 1), "same mount ID twice");
    assert_eq!(parse_lines(format!("{VALID}\n{VALID}").as_bytes()).count(), 2);
    assert!(parse_line(format!("{VALID}\n").as_bytes(), 1).is_ok());
}

#[test]
fn malformed_lines_name_line_and_field() {
    use Field::*;
    use ParseErrorKind::*;
    let good = "1 0 0:1 / / rw - ext4 /dev/sda rw\n";
    let cases: &[(&str, Field, ParseErrorKind)] = &[
        ("hello world", MountId, InvalidNumber("hello".into())),
        ("\u{1}\u{2}\u{3}", MountId, InvalidNumber("\u{1}\u{2}\u{3}".into())),
        ("-1 35 98:0 / /m rw - ext3 /dev/root rw", MountId, InvalidNumber("-1".into())),
        ("99999999999 35 98:0 / /m rw - ext3 /dev/root rw", MountId, InvalidNumber("99999999999".into())),
        ("36 x 98:0 / /m rw - ext3 /dev/root rw", ParentId, InvalidNumber("x".into())),
        ("36  98:0 / /m rw - ext3 /dev/root rw", ParentId, Missing),
        ("36 35 98 / /m rw - ext3 /dev/root rw", Device, InvalidDevice("98".into())),
        ("36 35 98:x / /m rw - ext3 /dev/root rw", Device, InvalidDevice("98:x".into())),
        ("36 35 :0 / /m rw - ext3 /dev/root rw", Device, InvalidDevice(":0".into())),
        ("36 35 98:0:1 / /m rw - ext3 /dev/root rw", Device, InvalidDevice("98:0:1".into())),
        ("36 35 98:0 /a\\04 /m rw - ext3 /dev/root rw", Root, InvalidEscape("/a\\04".into())),
        ("36 35 98:0 / /m\\400 rw - ext3 /dev/root rw", MountPoint, InvalidEscape("/m\\400".into())),
        ("36 35 98:0 / /m\\ rw - ext3 /dev/root rw", MountPoint, InvalidEscape("/m\\".into())),
        ("36 35 98:0 / /m rw - ext3 /dev/r\\x00t rw", Source, InvalidEscape("/dev/r\\x00t".into())),
        ("36 35 98:0 / /m rw shared:x - ext3 /dev/root rw", OptionalFields, InvalidNumber("shared:x".into())),
        ("36 35 98:0 / /m rw master: - ext3 /dev/root rw", OptionalFields, InvalidNumber("master:".into())),
        (
            "36 35 98:0 / /m rw propagate_from:-2 - ext3 /dev/root rw",
            OptionalFields,
            InvalidNumber("propagate_from:-2".into()),
        ),
        ("36 35 98:0 / /m rw shared:1 ext3 /dev/root rw", Separator, Missing),
        ("36 35 98:0 / /m rw -- ext3 /dev/root rw", Separator, Missing),
        ("36 35 98:0 / /m rw - ", FsType, Missing),
        ("36 35 98:0 / /m rw -", FsType, Missing),
        ("36 35 98:0 / /m rw - ext3", Source, Missing),
        ("36 35 98:0 / /m rw - ext3 /dev/root", SuperOptions, Missing),
        ("36 35 98:0 / /m rw - ext3 /dev/root ", SuperOptions, Missing),
        ("", MountId, Missing),
    ];
    for (line, field, kind) in cases {
        // As line 3 of a table, between good lines: the number is the line's.
        let text = format!("{good}{}{line}\n{}", good.replace("1 0", "2 1"), good.replace("1 0", "3 1"));
        assert_eq!(error_of(&text), (3, *field, kind.clone()), "{line:?}");
        let err = parse_line(line.as_bytes(), 7).expect_err(line);
        assert_eq!((err.line, err.field), (7, *field), "{line:?}");
    }
}

/// A NUL in a path, a relative mount point and a CRLF line end: lines the
/// kernel never writes, refused like any other malformed line.
#[test]
fn what_the_kernel_never_writes_is_refused() {
    let good = "1 0 0:1 / / rw - ext4 /dev/sda rw\n";
    let cases: &[(&str, Field, &str)] = &[
        ("36 35 98:0 /a\\000b /m rw - ext3 /dev/root rw", Field::Root, "NUL"),
        ("36 35 98:0 / /m\\000 rw - ext3 /dev/root rw", Field::MountPoint, "NUL"),
        ("36 35 98:0 / /m rw - ext3 /dev/r\\000t rw", Field::Source, "NUL"),
        ("36 35 98:0 / m rw - ext3 /dev/root rw", Field::MountPoint, "relative path `m`"),
        ("36 35 98:0 / .\\040m rw - ext3 /dev/root rw", Field::MountPoint, "relative path `.\\040m`"),
        ("36 35 98:0 / /m rw - ext3 /dev/root rw\r", Field::SuperOptions, "carriage return"),
    ];
    for (line, field, says) in cases {
        let text = format!("{good}{}{line}\n{}", good.replace("1 0", "2 1"), good.replace("1 0", "3 1"));
        let err = parse_table(text.as_bytes()).expect_err(line);
        assert_eq!((err.line, err.field), (3, *field), "{line:?}");
        assert!(err.to_string().contains(says), "{line:?}: {err}");
        assert_eq!(parse_lines(text.as_bytes()).filter(Result::is_err).count(), 1, "{line:?}");
        let err = parse_line(line.as_bytes(), 7).expect_err(line);
        assert_eq!((err.line, err.field), (7, *field), "{line:?}");
    }
    // CRLF on every line, and on a last line without its newline.
    let crlf = format!("{}\r\n{}\r\n", VALID, VALID.replace("36 35", "37 35"));
    assert_eq!(parse_table(crlf.as_bytes()).expect_err("CRLF").line, 1);
    assert_eq!(parse_table(format!("{VALID}\n{VALID}\r").as_bytes()).expect_err("CR at the end").line, 2);
    // Escapes the kernel does write, `#` among them (`mangle` escapes it), still decode.
    let line = "36 35 98:0 / /m\\040\\011\\012\\134 rw - tmpfs a\\043b rw";
    let mount = parse_line(line.as_bytes(), 1).unwrap();
    assert_eq!(path(&mount.mount_point), Path::new("/m \t\n\\"));
    assert_eq!(&*mount.source.unescaped(), b"a#b");
}

#[test]
fn not_utf8_options() {
    let err = parse_line(b"1 0 0:1 / / r\xffw - ext4 /dev/sda rw", 1).unwrap_err();
    assert_eq!((err.field, err.kind), (Field::MountOptions, ParseErrorKind::NotUtf8("r\u{fffd}w".into())));
    let err = parse_line(b"1 0 0:1 / / rw - ext4 /dev/sda rw,x=\xff", 1).unwrap_err();
    assert_eq!(err.field, Field::SuperOptions);
    // Paths need not be UTF-8.
    let mount = parse_line(b"1 0 0:1 /\xff /\xfe rw - ext4 /dev/\xfd rw", 1).unwrap();
    assert_eq!(mount.mount_point.unescaped().as_ref(), b"/\xfe");
}

#[test]
fn every_truncation_of_a_line_is_an_error_or_a_shorter_super_options() {
    let line = "36 35 98:0 /mnt\\0401 /mnt2 rw,noatime shared:2 master:1 - fuse.juicefs JuiceFS:vol rw,allow_other";
    let super_start = line.rfind(' ').unwrap() + 1;
    for cut in 0..line.len() {
        let truncated = &line.as_bytes()[..cut];
        match parse_line(truncated, 5) {
            Ok(mount) => {
                assert!(cut > super_start, "cut at {cut} parsed: {truncated:?}");
                assert_eq!(mount.super_options, &line[super_start..cut]);
            }
            Err(err) => {
                assert!(cut <= super_start, "cut at {cut}: {err}");
                assert_eq!(err.line, 5);
            }
        }
    }
    // Cut in the middle of each field: that field or the next is named.
    let at = |text: &str| parse_line(&line.as_bytes()[..line.find(text).unwrap()], 1).unwrap_err().field;
    assert_eq!(at(" 35"), Field::ParentId);
    assert_eq!(at(":0 "), Field::Device);
    assert_eq!(at(" /mnt\\"), Field::Root);
    assert_eq!(at("401 "), Field::Root, "cut inside an escape");
    assert_eq!(at(" /mnt2"), Field::MountPoint);
    assert_eq!(at(" rw,noatime"), Field::MountOptions);
    assert_eq!(at(" shared"), Field::Separator);
    assert_eq!(at("2 master"), Field::OptionalFields);
    assert_eq!(at(" - "), Field::Separator);
    assert_eq!(at(" fuse.juicefs"), Field::FsType);
    assert_eq!(at(" JuiceFS"), Field::Source);
    assert_eq!(at(" rw,allow"), Field::SuperOptions);
}

#[test]
fn parse_lines_goes_on_after_an_error() {
    let text = format!("{VALID}\nnot a mount\n\n{}\n", VALID.replace("36 35", "37 35"));
    let results: Vec<_> = parse_lines(text.as_bytes()).collect();
    assert_eq!(results.len(), 4);
    assert_eq!(results[0].as_ref().unwrap().mount_id, 36);
    let errors: Vec<(usize, Field)> =
        results[1..3].iter().map(|r| r.as_ref().map(|_| ()).unwrap_err()).map(|e| (e.line, e.field)).collect();
    assert_eq!(errors, [(2, Field::MountId), (3, Field::MountId)]);
    assert_eq!(results[3].as_ref().unwrap().mount_id, 37);
}

#[test]
fn embedded_newline_in_parse_line() {
    let text = format!("{VALID}\n{VALID}");
    let err = parse_line(text.as_bytes(), 4).unwrap_err();
    assert_eq!((err.line, err.column, err.kind), (4, VALID.len() + 1, ParseErrorKind::EmbeddedNewline));
}

#[test]
fn error_message_names_line_column_and_field() {
    let text = format!("{VALID}\n{}", VALID.replace("master:1", "shared:x"));
    let err = parse_table(text.as_bytes()).unwrap_err();
    assert_eq!(err.to_string(), "mountinfo line 2, column 35: field `peer group`: invalid number in `shared:x`");
    let err = parse_table(b"1 2 3:4 / /a rw").unwrap_err();
    assert_eq!(err.to_string(), "mountinfo line 1, column 16: field `separator`: missing, the line ends before it");
}

// ---- the reader ---------------------------------------------------------------

#[test]
fn reads_and_parses_the_real_proc_self_mountinfo() {
    let mut reader = MountInfoReader::open(Path::new("/proc/self/mountinfo")).unwrap();
    let text = reader.read().unwrap().to_vec();
    let table = parse_table(&text).unwrap();
    assert!(!table.is_empty());
    assert!(table.iter().any(|m| m.mount_point.raw() == b"/"), "no `/` in:\n{}", String::from_utf8_lossy(&text));
    assert!(reader.last_read_count() >= 1);
    // The buffer is reused and the second read sees the same table.
    let again = parse_table(reader.read().unwrap()).unwrap().len();
    assert_eq!(again, table.len());
    assert_eq!(reader.buffer(), &text[..]);
}

#[test]
fn reads_a_plain_file_once() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/mountinfo/fluid-example.txt");
    let mut reader = MountInfoReader::from_file(std::fs::File::open(&path).unwrap());
    assert_eq!(reader.read().unwrap(), &fixture("fluid-example.txt")[..]);
    assert_eq!(reader.last_read_count(), 1);
}

#[test]
fn a_released_buffer_reads_the_same_table_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mountinfo");
    let text = synthetic_table(2_000);
    assert!(text.len() > 256 * 1024, "large enough to be released");
    std::fs::write(&path, &text).unwrap();
    let mut reader = MountInfoReader::open(&path).unwrap();
    assert_eq!(reader.read().unwrap(), text.as_bytes());
    reader.release_buffer();
    assert!(reader.buffer().is_empty());
    assert_eq!(reader.read().unwrap(), text.as_bytes());
}

/// A shell in its own private mount namespace (`unshare -m`, which makes
/// every mount private), mounting on request; killed when dropped.
struct NamespaceShell {
    child: Child,
}

impl Drop for NamespaceShell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn priority_event_reports_a_change_and_read_consumes_it() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let script = format!(
        "echo ready; read _; mount -t tmpfs pollpri-test '{0}' && echo mounted; read _; \
         mount -t tmpfs pollpri-again '{0}' && echo mounted; read _",
        target.display()
    );
    let child = Command::new(system::program("unshare"))
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot run unshare (util-linux): {err}"));
    let mut shell = NamespaceShell { child };
    let mut stdout = BufReader::new(shell.child.stdout.take().unwrap());
    let mut stdin = shell.child.stdin.take().unwrap();
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    if line.trim() != "ready" {
        let mut stderr = String::new();
        let _ = std::io::Read::read_to_string(shell.child.stderr.as_mut().unwrap(), &mut stderr);
        panic!("unshare -m failed (the test needs root): {stderr}");
    }
    // `unshare` execs the shell: its pid is the child's.
    let mountinfo = format!("/proc/{}/mountinfo", shell.child.id());
    let mut reader = MountInfoReader::open(Path::new(&mountinfo)).unwrap();
    let before = parse_table(reader.read().unwrap()).unwrap().len();
    assert!(!priority_pending(reader.as_fd()).unwrap(), "no change yet");

    writeln!(stdin, "mount").unwrap();
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "mounted");
    assert!(priority_pending(reader.as_fd()).unwrap(), "the mount is reported");
    assert!(!priority_pending(reader.as_fd()).unwrap(), "polling consumed it");

    let text = reader.read().unwrap().to_vec();
    let table = parse_table(&text).unwrap();
    assert_eq!(table.len(), before + 1);
    let mounted = table.iter().find(|m| m.source.raw() == b"pollpri-test").expect("new mount listed");
    assert_eq!(mounted.mount_point.to_path(), target.as_path());
    reader.read().unwrap();
    assert!(!reader.last_read_took_in_change(), "nothing changed since");

    // A change made after a check and before the read: the read says so.
    assert!(!reader.changed_since_read().unwrap());
    writeln!(stdin, "mount").unwrap();
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "mounted");
    reader.read().unwrap();
    assert!(reader.last_read_took_in_change(), "the mount made after the check is a change");
    drop(shell);
}
