//! The process's file descriptor table and its limit.
//!
//! A heal holds a few descriptors per target at once (a handle on each
//! stale layer, each new top, the source's directories): thousands on a
//! large node.
use std::io;
use std::os::fd::AsFd;

use rustix::fs::{Mode, OFlags};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Raises the limit on open files as far as the process may: both limits to
/// the kernel's ceiling (`fs.nr_open`) where it can raise the hard limit (a
/// privileged agent can: a heal holds a descriptor or more per target, and a
/// dense node's volume has 10,000), else the soft limit to the hard one
/// (container runtimes often start processes at 1024). Returns the new soft
/// limit; None means unlimited.
pub fn raise_open_file_limit() -> io::Result<Option<u64>> {
    let limit = getrlimit(Resource::Nofile);
    let ceiling = std::fs::read_to_string("/proc/sys/fs/nr_open").ok().and_then(|text| text.trim().parse::<u64>().ok());
    if let (Some(ceiling), Some(maximum)) = (ceiling, limit.maximum)
        && ceiling > maximum
        && setrlimit(Resource::Nofile, Rlimit { current: Some(ceiling), maximum: Some(ceiling) }).is_ok()
    {
        return Ok(Some(ceiling));
    }
    if limit.current != limit.maximum {
        setrlimit(Resource::Nofile, Rlimit { current: limit.maximum, maximum: limit.maximum })?;
    }
    Ok(limit.maximum)
}

/// The soft limit on open files; None means unlimited.
pub fn open_file_limit() -> Option<u64> {
    getrlimit(Resource::Nofile).current
}

/// Grows the descriptor table so that descriptors below `count` fit without
/// growing it again. The kernel grows the table of a process with several
/// threads only after a full RCU grace period (`expand_fdtable` calls
/// `synchronize_rcu`: 10 ms or more), inside whichever call opened the
/// descriptor that did not fit; measured here, that added 16 ms to the first
/// heal of 100 targets. Growing it while the process has one thread costs
/// nothing, and the table never shrinks. `count` is capped below the limit.
pub fn reserve_descriptors(count: u32) -> io::Result<()> {
    let limit = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    let last = u64::from(count).min(limit).saturating_sub(1);
    let Ok(last) = i32::try_from(last) else { return Ok(()) };
    if last < 3 {
        return Ok(());
    }
    // A copy at or above `last`: the table must reach it.
    let root = rustix::fs::open(c"/", OFlags::PATH | OFlags::CLOEXEC, Mode::empty())?;
    let copy = rustix::io::fcntl_dupfd_cloexec(root.as_fd(), last)?;
    drop(copy);
    Ok(())
}

/// Whether `err` is the want of a descriptor: the process's open-file
/// limit reached (EMFILE) or the system's (ENFILE).
pub fn out_of_descriptors(err: &io::Error) -> bool {
    let raw = err.raw_os_error();
    raw == Some(rustix::io::Errno::MFILE.raw_os_error()) || raw == Some(rustix::io::Errno::NFILE.raw_os_error())
}

/// EMFILE: what a call that needed a descriptor past the open-file limit
/// fails with.
pub fn too_many_open_files() -> io::Error {
    io::Error::from_raw_os_error(rustix::io::Errno::MFILE.raw_os_error())
}

/// The size of the descriptor table (`FDSize` in /proc/self/status).
pub fn descriptor_table_size() -> io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("FDSize:"))
        .and_then(|size| size.trim().parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no FDSize in /proc/self/status"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_grown_ahead() {
        raise_open_file_limit().unwrap();
        let limit = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
        let wanted = 8192.min(limit);
        reserve_descriptors(u32::try_from(wanted).unwrap()).unwrap();
        assert!(descriptor_table_size().unwrap() >= wanted);
    }
}
