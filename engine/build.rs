//! Generates the CSI spec's messages from the proto vendored under
//! `proto/csi`, with a protobuf compiler written in Rust (`protox`), so no
//! system `protoc` is needed. The CSI proxy reads and records them; the
//! test world generates its own gRPC clients and servers over these types.

use std::path::Path;

fn main() {
    let dir = Path::new("../proto/csi");
    if let Err(err) = compile(dir, "csi.proto") {
        // A build script reports by failing; cargo prints this line.
        panic!("cannot generate the Rust code of {}/csi.proto: {err}", dir.display());
    }
}

/// Writes the messages of `dir/file` to `OUT_DIR` as `<package>.rs`
/// (`include!(concat!(env!("OUT_DIR"), "/<package>.rs"))` takes it in).
fn compile(dir: &Path, file: &str) -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={}", dir.join(file).display());
    let descriptors = protox::compile([file], [dir])?;
    // The proto is their documentation: its comments are not rustdoc
    // (`<placeholders>`, bare links, indented examples) and would fail
    // `cargo doc` and the doctests.
    let mut messages = prost_build::Config::new();
    messages.disable_comments(["."]);
    messages.compile_fds(descriptors)?;
    Ok(())
}
