//! Realistic Kubernetes node tables of any size, for tests and benchmarks.

use std::fmt::Write;

/// A host mountinfo table of exactly `mounts` lines (at least the base
/// mounts), shaped like a Kubernetes node's: the node's own mounts, FUSE
/// global mounts under `/runtime-mnt/…` and CSI staging `globalmount`s, and per
/// pod a sandbox `shm`, one overlay rootfs per container, a projected token
/// tmpfs, sometimes a secret tmpfs, and for most pods a FUSE volume bind (a
/// peer of its global mount) and sometimes a subPath bind. About 6 mounts a
/// pod, so a 100-pod node is ~600 lines; 10,000 lines are ~3.4 MB (the
/// overlay lines of containerd are long).
/// Deterministic: the same `mounts` gives the same text.
pub fn synthetic_table(mounts: usize) -> String {
    let mut node = Node::default();
    node.base();
    let globals = (mounts / 400).max(1);
    for index in 0..globals {
        node.global(index);
    }
    while node.lines < mounts {
        node.pod();
    }
    // Pods come whole; cut the last one at the requested size.
    let mut text = node.text;
    let end = text.match_indices('\n').nth(mounts.max(node.base_lines) - 1).map_or(text.len(), |(at, _)| at + 1);
    text.truncate(end);
    text
}

const ROOT_ID: u32 = 22;
const RUN_ID: u32 = 27;
const KUBELET_ID: u32 = 38;
const RUNTIME_MNT_ID: u32 = 39;
const SNAPSHOTS: &str = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots";

/// Parent ID, device, mount point, mount options, fs type, source, super
/// options, root (empty for `/`).
type BaseMount = (u32, (u32, u32), &'static str, &'static str, &'static str, &'static str, &'static str, &'static str);

/// A FUSE global mount pods bind from.
struct Global {
    minor: u32,
    peer_group: u32,
    fs_type: String,
    source: String,
    pv: String,
    subdirs: [&'static str; 3],
}

struct Node {
    text: String,
    lines: usize,
    base_lines: usize,
    next_id: u32,
    next_minor: u32,
    next_peer_group: u32,
    next_snapshot: u32,
    globals: Vec<Global>,
    random: u64,
}

impl Default for Node {
    fn default() -> Self {
        Node {
            text: String::new(),
            lines: 0,
            base_lines: 0,
            next_id: ROOT_ID,
            next_minor: 45,
            next_peer_group: 1,
            next_snapshot: 1,
            globals: Vec::new(),
            random: 0x9e37_79b9_7f4a_7c15,
        }
    }
}

impl Node {
    /// splitmix64: deterministic, no dependency.
    fn next_random(&mut self) -> u64 {
        self.random = self.random.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.random;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next_random() % 100 < percent
    }

    fn hex(&mut self, digits: usize) -> String {
        let mut out = String::with_capacity(digits);
        while out.len() < digits {
            let _ = write!(out, "{:016x}", self.next_random());
        }
        out.truncate(digits);
        out
    }

    fn uuid(&mut self) -> String {
        let hex = self.hex(32);
        format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
    }

    fn new_minor(&mut self) -> u32 {
        self.next_minor += 1;
        self.next_minor
    }

    fn new_peer_group(&mut self) -> u32 {
        self.next_peer_group += 1;
        self.next_peer_group
    }

    /// Appends one line and returns its mount ID.
    #[allow(clippy::too_many_arguments)]
    fn line(
        &mut self,
        parent: u32,
        dev: (u32, u32),
        root: &str,
        mount_point: &str,
        options: &str,
        optional: &str,
        fs_type: &str,
        source: &str,
        super_options: &str,
    ) -> u32 {
        let id = self.next_id;
        self.next_id += 1;
        let separator = if optional.is_empty() { "" } else { " " };
        let _ = writeln!(
            self.text,
            "{id} {parent} {}:{} {root} {mount_point} {options}{separator}{optional} - {fs_type} {source} {super_options}",
            dev.0, dev.1
        );
        self.lines += 1;
        id
    }

    fn base(&mut self) {
        let base: [BaseMount; 18] = [
            (1, (259, 1), "/", "rw,relatime", "ext4", "/dev/nvme0n1p1", "rw,discard,errors=remount-ro", ""),
            (ROOT_ID, (0, 22), "/sys", "rw,nosuid,nodev,noexec,relatime", "sysfs", "sysfs", "rw", ""),
            (ROOT_ID, (0, 23), "/proc", "rw,nosuid,nodev,noexec,relatime", "proc", "proc", "rw", ""),
            (
                ROOT_ID,
                (0, 5),
                "/dev",
                "rw,nosuid,relatime",
                "devtmpfs",
                "devtmpfs",
                "rw,size=32823040k,nr_inodes=8205760,mode=755,inode64",
                "",
            ),
            (
                25,
                (0, 24),
                "/dev/pts",
                "rw,nosuid,noexec,relatime",
                "devpts",
                "devpts",
                "rw,gid=5,mode=620,ptmxmode=000",
                "",
            ),
            (
                ROOT_ID,
                (0, 25),
                "/run",
                "rw,nosuid,nodev,noexec,relatime",
                "tmpfs",
                "tmpfs",
                "rw,size=6574000k,mode=755,inode64",
                "",
            ),
            (25, (0, 26), "/dev/shm", "rw,nosuid,nodev", "tmpfs", "tmpfs", "rw,inode64", ""),
            (
                27,
                (0, 27),
                "/run/lock",
                "rw,nosuid,nodev,noexec,relatime",
                "tmpfs",
                "tmpfs",
                "rw,size=5120k,inode64",
                "",
            ),
            (
                23,
                (0, 28),
                "/sys/fs/cgroup",
                "rw,nosuid,nodev,noexec,relatime",
                "cgroup2",
                "cgroup2",
                "rw,nsdelegate,memory_recursiveprot",
                "",
            ),
            (23, (0, 29), "/sys/fs/pstore", "rw,nosuid,nodev,noexec,relatime", "pstore", "pstore", "rw", ""),
            (23, (0, 30), "/sys/fs/bpf", "rw,nosuid,nodev,noexec,relatime", "bpf", "bpf", "rw,mode=700", ""),
            (
                24,
                (0, 31),
                "/proc/sys/fs/binfmt_misc",
                "rw,relatime",
                "autofs",
                "systemd-1",
                "rw,fd=29,pgrp=1,timeout=0,minproto=5,maxproto=5,direct,pipe_ino=17455",
                "",
            ),
            (25, (0, 20), "/dev/mqueue", "rw,nosuid,nodev,noexec,relatime", "mqueue", "mqueue", "rw", ""),
            (25, (0, 32), "/dev/hugepages", "rw,relatime", "hugetlbfs", "hugetlbfs", "rw,pagesize=2M", ""),
            (23, (0, 7), "/sys/kernel/debug", "rw,nosuid,nodev,noexec,relatime", "debugfs", "debugfs", "rw", ""),
            (
                ROOT_ID,
                (259, 2),
                "/boot/efi",
                "rw,relatime",
                "vfat",
                "/dev/nvme0n1p15",
                "rw,fmask=0077,dmask=0077,codepage=437,iocharset=iso8859-1,shortname=mixed,errors=remount-ro",
                "",
            ),
            // The kubelet directory on its own disk, and the Fluid runtime
            // directory: shared, so binds into them are peers on the host.
            (
                ROOT_ID,
                (259, 16),
                "/var/lib/kubelet",
                "rw,relatime",
                "xfs",
                "/dev/nvme1n1",
                "rw,attr2,inode64,logbufs=8,logbsize=32k,noquota",
                "",
            ),
            (
                ROOT_ID,
                (259, 1),
                "/runtime-mnt",
                "rw,relatime",
                "ext4",
                "/dev/nvme0n1p1",
                "rw,discard,errors=remount-ro",
                "/runtime-mnt",
            ),
        ];
        for (parent, dev, mount_point, options, fs_type, source, super_options, root) in base {
            let peer_group = self.new_peer_group();
            let mut optional = format!("shared:{peer_group}");
            if mount_point == "/runtime-mnt" {
                // Bound onto itself, made a slave of the root and shared again
                // (the usual preparation of a directory for Bidirectional
                // hostPath volumes): both shared and master.
                optional.push_str(" master:1");
            }
            let root = if root.is_empty() { "/" } else { root };
            self.line(parent, dev, root, mount_point, options, &optional, fs_type, source, super_options);
        }
        debug_assert_eq!(self.next_id, RUNTIME_MNT_ID + 1);
        self.base_lines = self.lines;
    }

    fn global(&mut self, index: usize) {
        let minor = self.new_minor();
        let peer_group = self.new_peer_group();
        let namespace = ["default", "ml-team", "data-eng", "kubeflow"][index % 4];
        let dataset = format!("dataset-{index}");
        let optional = format!("shared:{peer_group}");
        let fuse_options = "rw,nosuid,nodev,relatime";
        let (fs_type, source, mount_point) = match index % 3 {
            0 => (
                "fuse.juicefs".to_owned(),
                format!("JuiceFS:{dataset}"),
                format!("/runtime-mnt/juicefs/{namespace}/{dataset}/juicefs-fuse"),
            ),
            1 => (
                "fuse.jindofs-fuse".to_owned(),
                "jindofs-fuse".to_owned(),
                format!("/runtime-mnt/jindo/{namespace}/{dataset}/jindofs-fuse"),
            ),
            _ => (
                "fuse.alluxio-fuse".to_owned(),
                "alluxio-fuse".to_owned(),
                format!("/runtime-mnt/alluxio/{namespace}/{dataset}/alluxio-fuse"),
            ),
        };
        let super_options = "rw,user_id=0,group_id=0,default_permissions,allow_other";
        self.line(
            RUNTIME_MNT_ID,
            (0, minor),
            "/",
            &mount_point,
            fuse_options,
            &optional,
            &fs_type,
            &source,
            super_options,
        );
        if index.is_multiple_of(3) {
            // The JuiceFS CSI driver also stages the volume per node.
            let staging =
                format!("/var/lib/kubelet/plugins/kubernetes.io/csi/csi.juicefs.com/{}/globalmount", self.hex(64));
            self.line(KUBELET_ID, (0, minor), "/", &staging, fuse_options, &optional, &fs_type, &source, super_options);
        }
        self.globals.push(Global {
            minor,
            peer_group,
            fs_type,
            source,
            pv: format!("{namespace}-{dataset}"),
            subdirs: ["/models/bert", "/team\\040data/run-7", "/checkpoints"],
        });
    }

    /// A container's rootfs: the pause image has one layer, apps a few.
    fn overlay_rootfs(&mut self, container_id: &str, layers: u64) {
        let minor = self.new_minor();
        let mut lower = String::new();
        for layer in 0..layers {
            let snapshot = 1 + (self.next_random() % 4000) as u32;
            let separator = if layer == 0 { "" } else { ":" };
            let _ = write!(lower, "{separator}{SNAPSHOTS}/{snapshot}/fs");
        }
        self.next_snapshot += 1;
        let upper = self.next_snapshot + 4000;
        let mount_point = format!("/run/containerd/io.containerd.runtime.v2.task/k8s.io/{container_id}/rootfs");
        let super_options = format!(
            "rw,lowerdir={lower},upperdir={SNAPSHOTS}/{upper}/fs,workdir={SNAPSHOTS}/{upper}/work,uuid=on,nouserxattr"
        );
        self.line(RUN_ID, (0, minor), "/", &mount_point, "rw,relatime", "", "overlay", "overlay", &super_options);
    }

    fn pod(&mut self) {
        let pod_uid = self.uuid();
        let pods = format!("/var/lib/kubelet/pods/{pod_uid}");
        let sandbox = self.hex(64);

        let shm = format!("/run/containerd/io.containerd.grpc.v1.cri/sandboxes/{sandbox}/shm");
        let minor = self.new_minor();
        self.line(
            RUN_ID,
            (0, minor),
            "/",
            &shm,
            "rw,nosuid,nodev,noexec,relatime",
            "",
            "tmpfs",
            "shm",
            "rw,size=65536k,inode64",
        );
        self.overlay_rootfs(&sandbox, 1);

        let token = format!("{pods}/volumes/kubernetes.io~projected/kube-api-access-{}", &self.hex(5));
        let minor = self.new_minor();
        self.line(
            KUBELET_ID,
            (0, minor),
            "/",
            &token,
            "rw,relatime",
            "",
            "tmpfs",
            "tmpfs",
            "rw,size=15728640k,inode64,noswap",
        );
        if self.chance(30) {
            let secret = format!("{pods}/volumes/kubernetes.io~secret/app-tls");
            let minor = self.new_minor();
            self.line(
                KUBELET_ID,
                (0, minor),
                "/",
                &secret,
                "rw,relatime",
                "",
                "tmpfs",
                "tmpfs",
                "rw,size=15728640k,inode64,noswap",
            );
        }

        let containers = 1 + usize::from(self.chance(35));
        let mut container_ids = Vec::with_capacity(containers);
        for _ in 0..containers {
            let container_id = self.hex(64);
            let layers = 1 + self.next_random() % 4;
            self.overlay_rootfs(&container_id, layers);
            container_ids.push(container_id);
        }

        if !self.chance(75) {
            return;
        }
        let which = (self.next_random() % self.globals.len() as u64) as usize;
        let (minor, peer_group, fs_type, source, pv, subdirs) = {
            let global = &self.globals[which];
            (
                global.minor,
                global.peer_group,
                global.fs_type.clone(),
                global.source.clone(),
                global.pv.clone(),
                global.subdirs,
            )
        };
        let optional = format!("shared:{peer_group}");
        let fuse_options = "rw,nosuid,nodev,relatime";
        let super_options = "rw,user_id=0,group_id=0,default_permissions,allow_other";
        let target = format!("{pods}/volumes/kubernetes.io~csi/{pv}/mount");
        self.line(KUBELET_ID, (0, minor), "/", &target, fuse_options, &optional, &fs_type, &source, super_options);
        if self.chance(25) {
            let subdir = subdirs[(self.next_random() % 3) as usize];
            let container = format!("app-{}", container_ids.len() - 1);
            let target = format!("{pods}/volume-subpaths/{pv}/{container}/0");
            self.line(
                KUBELET_ID,
                (0, minor),
                subdir,
                &target,
                fuse_options,
                &optional,
                &fs_type,
                &source,
                super_options,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn has_exactly_the_requested_lines() {
        for mounts in [0, 1, 18, 19, 100, 1000] {
            let table = synthetic_table(mounts);
            assert_eq!(table.lines().count(), mounts.max(18), "{mounts}");
            assert!(table.ends_with('\n'));
        }
        assert_eq!(synthetic_table(500), synthetic_table(500));
    }
}
