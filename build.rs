//! Generates the gRPC clients of the test world (feature `testbed`) from
//! the protos vendored under `proto/`, with a protobuf compiler written in
//! Rust (`protox`), so no system `protoc` is needed. The node agent's build
//! (no `testbed`) compiles nothing here.

fn main() {
    #[cfg(feature = "testbed")]
    grpc_clients::main();
}

#[cfg(feature = "testbed")]
mod grpc_clients {
    use std::path::Path;

    /// Each vendored proto the test world talks: its directory under
    /// `proto/` and its file. A new one (the CSI spec, …) is one more row.
    const PROTOS: &[(&str, &str)] = &[("proto/cri", "api.proto")];

    pub fn main() {
        for (dir, file) in PROTOS {
            if let Err(err) = compile_client(Path::new(dir), file) {
                // A build script reports by failing; cargo prints this line.
                panic!("cannot generate the gRPC client of {dir}/{file}: {err}");
            }
        }
    }

    /// Writes the messages and the client of `dir/file` to `OUT_DIR`, as
    /// `<package>.rs` (`tonic::include_proto!("<package>")` takes it in).
    fn compile_client(dir: &Path, file: &str) -> Result<(), Box<dyn std::error::Error>> {
        println!("cargo:rerun-if-changed={}", dir.join(file).display());
        let descriptors = protox::compile([file], [dir])?;
        // The proto is their documentation: its comments are not rustdoc
        // (`<placeholders>`, bare links, indented examples) and would fail
        // `cargo doc` and the doctests.
        let mut messages = prost_build::Config::new();
        messages.disable_comments(["."]);
        tonic_prost_build::configure()
            .build_server(false)
            .build_transport(false)
            .disable_comments(["."])
            .compile_fds_with_config(descriptors, messages)?;
        Ok(())
    }
}
