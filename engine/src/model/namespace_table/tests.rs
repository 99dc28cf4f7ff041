use super::*;

const ROOT: &str = "1 0 8:1 / / rw shared:1 - ext4 /dev/sda1 rw\n";

fn streamed(table: &str, caps: &TableCaps) -> NamespaceTable {
    stream(table.as_bytes(), caps).unwrap()
}

fn fuse_line(id: u32, parent: u32, minor: u32, mount_point: &str) -> String {
    format!("{id} {parent} 0:{minor} / {mount_point} rw - fuse.bindfs bindfs rw\n")
}

fn mount_points(table: &NamespaceTable) -> Vec<&str> {
    table.fuse_mounts.iter().map(|mount| mount.mount_point.to_str().unwrap()).collect()
}

#[test]
fn a_line_over_the_cap_is_skipped_and_counted() {
    let long = format!("/deep/{}", "d".repeat(200));
    let table = format!(
        "{ROOT}{}{}{}",
        fuse_line(20, 1, 50, "/volume"),
        fuse_line(21, 1, 50, &long),
        fuse_line(22, 1, 51, "/other")
    );
    let caps = TableCaps { line_bytes: 128, ..TableCaps::DEFAULT };
    let read = streamed(&table, &caps);
    assert_eq!(mount_points(&read), ["/volume", "/other"]);
    assert_eq!(read.overflow, Overflow { long_mounts: 1, ..Overflow::default() });
    assert_eq!(read.total_mounts, 4);
    assert!(read.receives, "the root is shared");
    assert_eq!(read.read_by, ReadBy::Mountinfo);
}

/// A reader is told of a streamed table's mounts as a mount per KiB of
/// each line begun: a tenant's long lines cost what their text does.
#[test]
fn a_streamed_line_counts_a_mount_per_kib_begun() {
    // About 3,000 bytes: three KiB begun; the other under one.
    let long = fuse_line(21, 1, 50, &format!("/deep/{}", "d".repeat(2950)));
    assert!((2048..3072).contains(&long.len()), "{}", long.len());
    let short = fuse_line(22, 1, 50, &format!("/deeper/{}", "d".repeat(600)));
    assert!(short.len() < 1024, "{}", short.len());
    let table = format!("{ROOT}{long}{short}");
    let mut counted = Vec::new();
    let read = stream_counted(table.as_bytes(), &TableCaps::DEFAULT, &mut |mounts| counted.push(mounts)).unwrap();
    assert_eq!(read.total_mounts, 3);
    assert_eq!(counted, [1, 3, 1]);
    // Over the cap, a line counts as the cap's KiB, however long it was.
    let caps = TableCaps { line_bytes: 1024, ..TableCaps::DEFAULT };
    let mut counted = Vec::new();
    stream_counted(table.as_bytes(), &caps, &mut |mounts| counted.push(mounts)).unwrap();
    assert_eq!(counted, [1, 2, 1]);
}

#[test]
fn fuse_mounts_past_a_namespace_cap_are_left_out_and_counted() {
    let mut table = ROOT.to_owned();
    for id in 0..10 {
        table.push_str(&fuse_line(20 + id, 1, 50, &format!("/v{id}")));
    }
    let by_count = streamed(&table, &TableCaps { fuse_mounts: 4, ..TableCaps::DEFAULT });
    assert_eq!(mount_points(&by_count), ["/v0", "/v1", "/v2", "/v3"]);
    assert_eq!(by_count.overflow.unkept_fuse_mounts, 6);
    // Each kept mount's text: "/", "/vN", "fuse.bindfs", "bindfs": 21 bytes.
    let by_text = streamed(&table, &TableCaps { kept_text_bytes: 21 * 3, ..TableCaps::DEFAULT });
    assert_eq!(mount_points(&by_text), ["/v0", "/v1", "/v2"]);
    assert_eq!(by_text.overflow.unkept_fuse_mounts, 7);
    assert!(by_text.overflow.any());
    assert!(!streamed(ROOT, &TableCaps::DEFAULT).overflow.any());
}

#[test]
fn the_fuse_mounts_other_mounts_are_on_are_named() {
    let table = format!(
        "{ROOT}{}{}{}{}",
        fuse_line(20, 1, 50, "/volume"),
        "30 20 0:60 / /volume/config rw - tmpfs tmpfs rw\n",
        fuse_line(21, 1, 51, "/bare"),
        "31 1 0:61 / /elsewhere rw - tmpfs tmpfs rw\n",
    );
    let read = streamed(&table, &TableCaps::DEFAULT);
    assert_eq!(read.with_mounts_on, BTreeSet::from([20]));
}

/// This process's own namespace, read both ways, says the same.
#[test]
fn listmount_and_the_stream_agree_on_a_real_namespace() {
    assert!(listmount_names_namespaces(), "this kernel (6.11+) names namespaces to listmount");
    let proc = Path::new("/proc");
    let pid = std::process::id();
    let listed = read(proc, pid, &TableCaps::DEFAULT).unwrap().expect("this process's namespace");
    assert_eq!(listed.read_by, ReadBy::Listmount);
    let file = File::open(format!("/proc/{pid}/mountinfo")).unwrap();
    let text = stream(file, &TableCaps::DEFAULT).unwrap();
    assert_eq!((listed.receives, listed.total_mounts), (text.receives, text.total_mounts));
    let devices = |table: &NamespaceTable| table.fuse_mounts.iter().map(|mount| mount.dev).collect::<Vec<_>>();
    assert_eq!(devices(&listed), devices(&text));
    assert_eq!(listed.with_mounts_on, text.with_mounts_on);
}
