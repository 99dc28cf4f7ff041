//! Parsing a mountinfo table: ours against the `procfs` crate, on synthetic
//! Kubernetes node tables of 1k, 10k and 100k mounts.
//!
//! `cargo bench --bench parse -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fuse_supervisor_engine::model::mountinfo::{parse_lines, parse_table};
use fuse_supervisor_engine::model::table::{Classified, Layout, Snapshot};
use fuse_supervisor_testbed::synthetic_table;
use procfs::FromBufRead;
use procfs::process::MountInfos;

fn parse(c: &mut Criterion) {
    let mut group = c.benchmark_group("mountinfo");
    for mounts in [1_000, 10_000, 100_000] {
        let table = synthetic_table(mounts);
        let bytes = table.as_bytes();
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        // A 100k table takes procfs tens of milliseconds; fewer samples keep
        // the run short.
        group.sample_size(if mounts >= 100_000 { 20 } else { 100 });

        group.bench_with_input(BenchmarkId::new("parse_table", mounts), bytes, |b, text| {
            b.iter(|| parse_table(black_box(text)).expect("synthetic tables parse").len())
        });

        group.bench_with_input(BenchmarkId::new("parse_lines_fuse_only", mounts), bytes, |b, text| {
            b.iter(|| {
                parse_lines(black_box(text)).filter(|mount| mount.as_ref().is_ok_and(|mount| mount.is_fuse())).count()
            })
        });

        // What the supervisor does per table change: parse, keep the FUSE
        // mounts, classify them into sources and pod targets.
        let layout = Layout::new(Path::new("/var/lib/kubelet"));
        group.bench_with_input(BenchmarkId::new("parse_and_classify", mounts), bytes, |b, text| {
            b.iter(|| {
                let snapshot = Snapshot::parse(black_box(text)).expect("synthetic tables parse");
                Classified::from_snapshot(snapshot, &layout).targets.len()
            })
        });

        group.bench_with_input(BenchmarkId::new("procfs_mountinfos", mounts), bytes, |b, text| {
            b.iter(|| MountInfos::from_buf_read(black_box(text)).expect("synthetic tables parse").0.len())
        });
    }
    group.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
