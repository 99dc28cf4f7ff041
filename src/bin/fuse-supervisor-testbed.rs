//! `fuse-supervisor-testbed`: the test world's programs and the demo
//! (`fuse_supervisor_testbed::programs`).
fn main() -> std::process::ExitCode {
    fuse_supervisor_testbed::programs::main()
}
