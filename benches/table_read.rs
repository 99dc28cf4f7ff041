//! What one read of a tenant's mount table bomb costs the reader
//! (`fuse_supervisor_engine::model::namespace_table::read`): the keeper reads
//! a namespace so when it learns it, and the search at a daemon's death reads
//! every namespace that may hold the dead connection again, on the loop, at
//! the heal priority.
//!
//! A namespace of `--binds` binds at mount points of `--path-bytes` (the
//! table bomb test's 6,000 at 29 KB by default), of a directory with one
//! FUSE volume's (bindfs) on top, as the test makes it, or with
//! `--fuse-binds on` every bind of the FUSE volume, read
//! `--reads` times by each way the agent reads tables (listmount/statmount,
//! then mountinfo streamed): the wall time and the reading thread's CPU time
//! of each read, and what the read kept and left out.
//!
//! A benchmark, not a test: it prints numbers.
//!
//! ```text
//! cargo bench --bench table_read [-- --binds 6000 --path-bytes 29000 --fuse-binds off --reads 10]
//! ```
//!
//! Every flag is also an environment variable (`TABLE_READ_BENCH_BINDS`…).
//! Needs root and /dev/fuse; everything is made inside a sandbox's private
//! mount namespace, and every process it starts is killed at the end.
use std::path::Path;
use std::time::{Duration, Instant};

use fuse_supervisor_engine::model::namespace_table::{self, TableCaps, TableReads};
use fuse_supervisor_testbed::Sandbox;
use fuse_supervisor_testbed::bomb::{BombOptions, MountBomb};
use fuse_supervisor_testbed::scenario::{Daemon, FuseSource};

#[allow(dead_code)]
mod common;

use common::{Flags, summary_ms};

fn main() {
    if !common::is_root() {
        eprintln!("table_read bench: needs root (mount namespaces, FUSE); not run");
        return;
    }
    let flags = Flags::new("TABLE_READ_BENCH");
    let binds: usize = flags.number("binds", "6000");
    let path_bytes: usize = flags.number("path-bytes", "29000");
    let reads: usize = flags.number("reads", "10");
    let fuse_binds = flags.on_off("fuse-binds", "off");

    let sandbox = Sandbox::new().expect("sandbox");
    let source = FuseSource::start(&sandbox, Daemon::Bindfs, "shared-data").expect("start bindfs");
    let dir = sandbox.root().join("bomb");
    let options = BombOptions { dir, binds, path_bytes, fuse: Some(source.path.clone()), fuse_binds };
    let bomb = MountBomb::start(&sandbox, &options).expect("the bomb");
    let of = if fuse_binds { "a FUSE volume" } else { "a directory, one FUSE volume's on top" };
    println!("a namespace of {binds} binds of {of}, at {path_bytes}-byte mount points (pid {})", bomb.pid());
    for (name, way) in [("listmount", TableReads::Auto), ("mountinfo", TableReads::Mountinfo)] {
        namespace_table::set_table_reads(way);
        let (mut walls, mut cpus) = (Vec::with_capacity(reads), Vec::with_capacity(reads));
        let mut last = None;
        for _ in 0..reads {
            let (started, cpu_before) = (Instant::now(), thread_cpu());
            let read = namespace_table::read(Path::new("/proc"), bomb.pid(), &TableCaps::DEFAULT)
                .expect("read the bomb's table")
                .expect("the bomb is there");
            walls.push(started.elapsed());
            cpus.push(thread_cpu().saturating_sub(cpu_before));
            last = Some(read);
        }
        let last = last.expect("one read at least");
        println!(
            "{name:>9}: wall {}; CPU {}; {} mounts listed, {} FUSE kept, {:?}, read by {:?}",
            summary_ms(walls),
            summary_ms(cpus),
            last.total_mounts,
            last.fuse_mounts.len(),
            last.overflow,
            last.read_by,
        );
    }
    namespace_table::set_table_reads(TableReads::Auto);
}

/// The calling thread's CPU time so far (`/proc/thread-self/schedstat`'s
/// first field, in nanoseconds).
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    let nanos = stat.split(' ').next().and_then(|ns| ns.parse().ok()).expect("time on the CPU");
    Duration::from_nanos(nanos)
}
