//! The container image of the CRI tier, built here with no registry: one
//! layer holding the static busybox and links to the applets the tests run,
//! its config (`sleep`, so it serves as the pause image too) and manifest,
//! in an OCI image layout packed as a tar for `ctr images import`.
//!
//! containerd names an image of an OCI layout after its
//! `io.containerd.image.name` annotation; without it the import makes up a
//! name the CRI cannot be asked for.
use std::path::Path;

use sha2::{Digest, Sha256};

/// What the containers run: busybox links in `/bin`.
const APPLETS: [&str; 12] =
    ["sh", "cat", "ls", "sleep", "echo", "touch", "rm", "mkdir", "stat", "grep", "head", "true"];
/// Directories an image's root has, for runc's mounts and the kubelet's files.
const DIRECTORIES: [&str; 6] = ["bin", "dev", "etc", "proc", "sys", "tmp"];

/// The image every container runs, by the name the CRI asks for.
pub const BUSYBOX: &str = "localhost/fuse-supervisor/busybox:test";
/// The same image, as containerd's `sandbox_image` (the pause container).
pub const PAUSE: &str = "localhost/fuse-supervisor/pause:test";

/// An OCI image layout as a tar: the busybox image named [`BUSYBOX`] and
/// [`PAUSE`]. `busybox` is the static binary.
pub fn oci_archive(busybox: &[u8]) -> Vec<u8> {
    let layer = layer_tar(busybox);
    let config = serde_json::json!({
        "architecture": goarch(),
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sleep", "2147483647"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [digest(&layer)]},
    })
    .to_string();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", config.as_bytes()),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar", &layer)],
    })
    .to_string();
    let named = |name: &str| {
        let mut entry = descriptor("application/vnd.oci.image.manifest.v1+json", manifest.as_bytes());
        entry["annotations"] = serde_json::json!({
            "io.containerd.image.name": name,
            "org.opencontainers.image.ref.name": "test",
        });
        entry
    };
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [named(BUSYBOX), named(PAUSE)]}).to_string();

    let mut archive = Tar::default();
    archive.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644);
    archive.file("index.json", index.as_bytes(), 0o644);
    archive.directory("blobs");
    archive.directory("blobs/sha256");
    for blob in [&layer[..], config.as_bytes(), manifest.as_bytes()] {
        archive.file(&format!("blobs/sha256/{}", hex(blob)), blob, 0o644);
    }
    archive.finish()
}

fn layer_tar(busybox: &[u8]) -> Vec<u8> {
    let mut layer = Tar::default();
    for dir in DIRECTORIES {
        layer.directory(dir);
    }
    layer.file("bin/busybox", busybox, 0o755);
    for applet in APPLETS {
        layer.symlink(&format!("bin/{applet}"), "busybox");
    }
    layer.finish()
}

/// `{mediaType, digest, size}` of `blob`.
fn descriptor(media_type: &str, blob: &[u8]) -> serde_json::Value {
    serde_json::json!({"mediaType": media_type, "digest": digest(blob), "size": blob.len()})
}

fn digest(blob: &[u8]) -> String {
    format!("sha256:{}", hex(blob))
}

fn hex(blob: &[u8]) -> String {
    Sha256::digest(blob).iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The OCI name of this machine's architecture (Go's `GOARCH`): containerd
/// imports only the platform it runs.
fn goarch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// A ustar archive in memory: entries owned by root, dated 1970, names
/// under 100 bytes (all of this module's are).
#[derive(Default)]
struct Tar {
    bytes: Vec<u8>,
}

impl Tar {
    fn file(&mut self, name: &str, content: &[u8], mode: u32) {
        self.header(name, b'0', mode, content.len(), "");
        self.bytes.extend_from_slice(content);
        self.pad();
    }

    fn directory(&mut self, name: &str) {
        self.header(&format!("{name}/"), b'5', 0o755, 0, "");
    }

    fn symlink(&mut self, name: &str, target: &str) {
        self.header(name, b'2', 0o777, 0, target);
    }

    fn header(&mut self, name: &str, kind: u8, mode: u32, size: usize, link: &str) {
        let mut header = [0u8; 512];
        let mut put = |at: usize, field: &[u8]| header[at..at + field.len()].copy_from_slice(field);
        put(0, name.as_bytes());
        put(100, format!("{mode:07o}\0").as_bytes());
        put(108, b"0000000\0");
        put(116, b"0000000\0");
        put(124, format!("{size:011o}\0").as_bytes());
        put(136, b"00000000000\0");
        // The checksum is summed with its own field as spaces.
        put(148, b"        ");
        put(156, &[kind]);
        put(157, link.as_bytes());
        put(257, b"ustar\x0000");
        let sum: u32 = header.iter().map(|&byte| u32::from(byte)).sum();
        header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        self.bytes.extend_from_slice(&header);
    }

    fn pad(&mut self) {
        let rest = self.bytes.len() % 512;
        if rest != 0 {
            self.bytes.resize(self.bytes.len() + 512 - rest, 0);
        }
    }

    /// The archive with its end: two zero blocks.
    fn finish(mut self) -> Vec<u8> {
        self.bytes.resize(self.bytes.len() + 1024, 0);
        self.bytes
    }
}

/// Writes [`oci_archive`] of the busybox at `busybox` to `archive`.
pub fn write_archive(busybox: &Path, archive: &Path) -> std::io::Result<()> {
    let busybox = std::fs::read(busybox)?;
    std::fs::write(archive, oci_archive(&busybox))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries of a ustar archive: (name, type flag, size, link target).
    fn entries(archive: &[u8]) -> Vec<(String, u8, usize, String)> {
        let text = |field: &[u8]| String::from_utf8_lossy(field).trim_end_matches('\0').to_owned();
        let mut found = Vec::new();
        let mut at = 0;
        while at + 512 <= archive.len() && archive[at] != 0 {
            let header = &archive[at..at + 512];
            let size = usize::from_str_radix(text(&header[124..135]).trim(), 8).unwrap();
            let checksum = u32::from_str_radix(text(&header[148..154]).trim(), 8).unwrap();
            let mut blank = header.to_vec();
            blank[148..156].fill(b' ');
            assert_eq!(checksum, blank.iter().map(|&byte| u32::from(byte)).sum::<u32>());
            found.push((text(&header[..100]), header[156], size, text(&header[157..257])));
            at += 512 + size.div_ceil(512) * 512;
        }
        found
    }

    #[test]
    fn the_layout_names_both_images_and_holds_every_blob_it_points_to() {
        let archive = oci_archive(b"not really busybox");
        let found = entries(&archive);
        let names: Vec<&str> = found.iter().map(|(name, ..)| name.as_str()).collect();
        assert_eq!(names[..4], ["oci-layout", "index.json", "blobs/", "blobs/sha256/"]);
        // After the layout file's header and its one block, and its own header.
        let index_at = 512 * 3;
        let index_size = found[1].2;
        let index: serde_json::Value = serde_json::from_slice(&archive[index_at..index_at + index_size]).unwrap();
        let manifests = index["manifests"].as_array().unwrap();
        let named: Vec<&str> =
            manifests.iter().map(|entry| entry["annotations"]["io.containerd.image.name"].as_str().unwrap()).collect();
        assert_eq!(named, [BUSYBOX, PAUSE]);
        let digest = manifests[0]["digest"].as_str().unwrap().trim_start_matches("sha256:");
        assert!(names.contains(&format!("blobs/sha256/{digest}").as_str()), "{names:?}");
        assert_eq!(found.iter().filter(|(name, ..)| name.starts_with("blobs/sha256/") && name.len() > 13).count(), 3);
    }

    #[test]
    fn the_layer_links_the_applets_to_busybox() {
        let layer = layer_tar(b"#!");
        let found = entries(&layer);
        assert!(found.contains(&("bin/busybox".into(), b'0', 2, String::new())), "{found:?}");
        assert!(found.contains(&("bin/sh".into(), b'2', 0, "busybox".into())), "{found:?}");
        assert!(found.contains(&("proc/".into(), b'5', 0, String::new())), "{found:?}");
    }
}
