use super::fields::parse_u32;
use super::*;

#[test]
fn parses_the_proc5_example() {
    let line = b"36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue";
    let mount = parse_line(line, 1).unwrap();
    assert_eq!((mount.mount_id, mount.parent_id), (36, 35));
    assert_eq!(mount.dev(), (98, 0));
    assert_eq!(mount.root.raw(), b"/mnt1");
    assert_eq!(mount.mount_point.raw(), b"/mnt2");
    assert_eq!(mount.mount_options, "rw,noatime");
    assert_eq!(mount.propagation, Propagation { master: Some(1), ..Propagation::default() });
    assert_eq!(mount.fs_type, "ext3");
    assert_eq!(mount.source.raw(), b"/dev/root");
    assert_eq!(mount.super_options, "rw,errors=continue");
    assert!(!mount.is_fuse() && !mount.root_deleted);
}

#[test]
fn recognises_fuse_types() {
    for fs_type in ["fuse", "fuse.juicefs", "fuse.jindofs-fuse", "fuseblk"] {
        assert!(is_fuse_type(fs_type), "{fs_type}");
    }
    for fs_type in ["fusectl", "fuseblk2", "ext4", "", "fus"] {
        assert!(!is_fuse_type(fs_type), "{fs_type}");
    }
}

#[test]
fn parses_u32_strictly() {
    assert_eq!(parse_u32(b"0"), Some(0));
    assert_eq!(parse_u32(b"4294967295"), Some(u32::MAX));
    assert_eq!(parse_u32(b"4294967296"), None);
    assert_eq!(parse_u32(b"99999999999"), None);
    for bad in [&b""[..], b"-1", b"+1", b"1a", b" 1"] {
        assert_eq!(parse_u32(bad), None);
    }
}

#[test]
fn dedup_keeps_the_last_line_in_its_place() {
    let text = b"1 0 0:1 / / rw - a x rw\n2 1 0:2 / /a rw - a x rw\n1 0 0:3 / / rw - a x rw\n";
    let mounts = parse_table(text).unwrap();
    let ids: Vec<_> = mounts.iter().map(|m| (m.mount_id, m.minor)).collect();
    assert_eq!(ids, [(2, 2), (1, 3)]);
}

#[test]
fn dedup_with_huge_ids_sorts() {
    let text = b"4000000000 0 0:1 / / rw - a x rw\n2 1 0:2 / /a rw - a x rw\n4000000000 0 0:3 / / rw - a x rw\n";
    let ids: Vec<_> = parse_table(text).unwrap().iter().map(|m| (m.mount_id, m.minor)).collect();
    assert_eq!(ids, [(2, 2), (4_000_000_000, 3)]);
}

#[test]
fn a_statmount_root_loses_its_deleted_marker_as_a_parsed_one_does() {
    let line = b"95 167 0:88 /sub//deleted /volume rw - fuse src rw";
    let parsed = parse_line(line, 1).unwrap();
    assert!(parsed.root_deleted);
    let stripped = without_deleted_marker(PathBuf::from("/sub//deleted"));
    assert_eq!(stripped.as_os_str().as_bytes(), parsed.root.raw());
    assert_eq!(without_deleted_marker(PathBuf::from("/sub")), PathBuf::from("/sub"));
    assert_eq!(without_deleted_marker(PathBuf::from("/")), PathBuf::from("/"));
}
