//! Generates the test world's gRPC clients and servers (the kubelet
//! stand-in's CRI and CSI clients, the test world's CSI node plugin) from the protos vendored under `proto/`, with a protobuf compiler
//! written in Rust (`protox`), so no system `protoc` is needed. The CSI
//! messages are the engine's (`fuse_supervisor_engine::csi::api`): only the
//! services are generated here, over them.

use std::path::Path;

fn main() {
    let cri = compile(Path::new("../proto/cri"), "api.proto", None);
    let csi = compile(Path::new("../proto/csi"), "csi.proto", Some((".csi.v1", "::fuse_supervisor_engine::csi::api")));
    for (proto, result) in [("../proto/cri/api.proto", cri), ("../proto/csi/csi.proto", csi)] {
        if let Err(err) = result {
            // A build script reports by failing; cargo prints this line.
            panic!("cannot generate the Rust code of {proto}: {err}");
        }
    }
}

/// Writes the clients and servers of `dir/file`, and its messages unless
/// `extern_messages` names where they are (proto package, Rust path), to
/// `OUT_DIR` as `<package>.rs` (`include!(concat!(env!("OUT_DIR"),
/// "/<package>.rs"))` takes it in).
fn compile(dir: &Path, file: &str, extern_messages: Option<(&str, &str)>) -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={}", dir.join(file).display());
    let descriptors = protox::compile([file], [dir])?;
    // The proto is their documentation: its comments are not rustdoc
    // (`<placeholders>`, bare links, indented examples) and would fail
    // `cargo doc` and the doctests.
    let mut messages = prost_build::Config::new();
    messages.disable_comments(["."]);
    let mut builder = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        .disable_comments(["."]);
    if let Some((package, path)) = extern_messages {
        builder = builder.extern_path(package, path);
    }
    builder.compile_fds_with_config(descriptors, messages)?;
    Ok(())
}
