//! What a probe pays for being made by the FUSE call helper: one call
//! (`statfs`, then one subdirectory opened) made in this process, then the
//! same call through the helper process, on a plain directory so that only
//! the hand-over is measured, not a daemon.
//!
//! `cargo bench --bench fuse_calls -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Command;

use criterion::{Criterion, criterion_group, criterion_main};
use fuse_supervisor_engine::heal::fuse_calls::{self, Answer};
use fuse_supervisor_engine::heal::priority::HealPriority;

fn probe_call(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a directory");
    std::fs::create_dir(dir.path().join("sub")).expect("a subdirectory");
    let root = fuse_supervisor_sys::resolve::open_path(dir.path()).expect("open the directory");
    let subdirs = [PathBuf::from("sub")];
    let call = || match fuse_calls::ask(black_box(root.as_fd()), true, &subdirs) {
        Answer::Opened(opened) => opened.len(),
        Answer::StatfsFailed(err) => panic!("statfs: {err}"),
    };

    let mut group = c.benchmark_group("probe_call");
    group.bench_function("in_process", |b| b.iter(call));
    let mut helper = Command::new(env!("CARGO_BIN_EXE_fuse-supervisor"));
    helper.arg(fuse_calls::SUBCOMMAND);
    fuse_calls::start_helper(helper, HealPriority::OFF).expect("start the helper");
    group.bench_function("through_helper", |b| b.iter(call));
    group.finish();
}

criterion_group!(benches, probe_call);
criterion_main!(benches);
