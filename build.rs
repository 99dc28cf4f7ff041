//! Generates Rust code from the protos vendored under `proto/`, with a
//! protobuf compiler written in Rust (`protox`), so no system `protoc` is
//! needed. The CSI spec's messages are the node agent's own (its CSI
//! proxy reads and records them); the gRPC clients and servers of the
//! test world (feature `testbed`: the kubelet stand-in's CRI and CSI
//! clients, the test world's CSI node plugin) are generated only there.

use std::path::Path;

/// One vendored proto: its directory under `proto/`, its file, and what
/// the node agent's build (no `testbed`) needs of it.
struct Proto {
    dir: &'static str,
    file: &'static str,
    in_product: bool,
}

const PROTOS: &[Proto] = &[
    Proto { dir: "proto/cri", file: "api.proto", in_product: false },
    Proto { dir: "proto/csi", file: "csi.proto", in_product: true },
];

/// Whether this build has the test world, whose gRPC services are
/// generated too.
const TESTBED: bool = cfg!(feature = "testbed");

fn main() {
    for proto in PROTOS {
        if !(proto.in_product || TESTBED) {
            continue;
        }
        if let Err(err) = compile(Path::new(proto.dir), proto.file) {
            // A build script reports by failing; cargo prints this line.
            panic!("cannot generate the Rust code of {}/{}: {err}", proto.dir, proto.file);
        }
    }
}

/// Writes the messages of `dir/file` (and, with the test world, its
/// clients and servers) to `OUT_DIR`, as `<package>.rs`
/// (`include!(concat!(env!("OUT_DIR"), "/<package>.rs"))` takes it in).
fn compile(dir: &Path, file: &str) -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={}", dir.join(file).display());
    let descriptors = protox::compile([file], [dir])?;
    // The proto is their documentation: its comments are not rustdoc
    // (`<placeholders>`, bare links, indented examples) and would fail
    // `cargo doc` and the doctests.
    let mut messages = prost_build::Config::new();
    messages.disable_comments(["."]);
    tonic_prost_build::configure()
        .build_client(TESTBED)
        .build_server(TESTBED)
        .build_transport(false)
        .disable_comments(["."])
        .compile_fds_with_config(descriptors, messages)?;
    Ok(())
}
