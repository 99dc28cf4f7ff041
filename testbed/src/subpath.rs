//! The kubelet's preparation of a subPath before it starts a container, by
//! the system calls it makes (`doBindSubPath` in the kubelet's
//! `volume/util/subpath`), so that a test restarts a container the way a
//! node does and sees whether anything a heal left behind makes it fail:
//!
//! 1. resolve the volume and the subPath (`lstat` of each component, as
//!    `filepath.EvalSymlinks`), open the volume with `O_RDONLY|O_NOFOLLOW`
//!    (a real open: a dead FUSE mount answers `ENOTCONN`) and each component
//!    below it with `O_PATH|O_NOFOLLOW`, refusing a symlink (`fstat`);
//! 2. the bind target `volume-subpaths/<volume>/<container>/<index>`: a
//!    mount point already (its device differs from its parent's, or the
//!    table lists it) is kept when it is the same file as the subPath (`lstat`
//!    of both: device and inode), and otherwise unmounted (plain `umount(2)`);
//!    a missing one is created (a directory for a directory, else a file);
//! 3. bind `/proc/self/fd/<N>`, the opened subPath, onto the target.
//!
//! Everything runs on the calling thread: call it through
//! [`super::Sandbox::run`].
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use fuse_supervisor_sys::{mount, resolve};

/// What the preparation found at the bind target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubpathPrepared {
    /// Mounted already with the subPath itself: kept as it is.
    AlreadyMounted,
    /// Bound afresh from the opened subPath (after unmounting whatever else
    /// was mounted there).
    Bound,
}

#[derive(Debug, thiserror::Error)]
pub enum SubpathError {
    #[error("{step} {path}")]
    Io {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("subPath {path} is outside its volume {volume}")]
    Outside { path: PathBuf, volume: PathBuf },
    #[error("unexpected symlink found at {path}")]
    Symlink { path: PathBuf },
}

fn io_error<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> SubpathError + 'a {
    move |source| SubpathError::Io { step, path: path.to_path_buf(), source }
}

/// Prepares `target` for the subPath `subpath` (relative) of the volume
/// mounted at `volume`, as the kubelet does before each start of a container
/// that mounts it.
pub fn prepare(volume: &Path, subpath: &Path, target: &Path) -> Result<SubpathPrepared, SubpathError> {
    let volume = fs::canonicalize(volume).map_err(io_error("error resolving symlinks in", volume))?;
    let wanted = volume.join(subpath);
    let path = fs::canonicalize(&wanted).map_err(io_error("error resolving symlinks in", &wanted))?;
    let opened = safe_open(&volume, &path)?;
    if is_mount_point(target)? {
        if same_file(&path, target)? {
            return Ok(SubpathPrepared::AlreadyMounted);
        }
        mount::unmount(target).map_err(io_error("error unmounting", target))?;
    }
    let parent = target.parent().unwrap_or(Path::new("/"));
    fs::create_dir_all(parent).map_err(io_error("error creating directory", parent))?;
    let kind = fs::symlink_metadata(&path).map_err(io_error("lstat failed on", &path))?;
    let created = if kind.is_dir() { fs::create_dir(target) } else { fs::write(target, b"") };
    match created {
        Err(err) if err.kind() != io::ErrorKind::AlreadyExists => return Err(io_error("error creating", target)(err)),
        _ => {}
    }
    let source = PathBuf::from(format!("/proc/self/fd/{}", opened.as_raw_fd()));
    mount::bind(&source, target).map_err(io_error("error bind-mounting the opened subPath onto", target))?;
    Ok(SubpathPrepared::Bound)
}

/// Opens `path` one component at a time beneath `volume`, following no
/// symlink: a handle on the subPath nobody can redirect afterwards.
fn safe_open(volume: &Path, path: &Path) -> Result<OwnedFd, SubpathError> {
    let relative = path
        .strip_prefix(volume)
        .map_err(|_| SubpathError::Outside { path: path.to_path_buf(), volume: volume.to_path_buf() })?;
    let mut current = volume.to_path_buf();
    let mut parent = resolve::open_read_nofollow(volume).map_err(io_error("cannot open", volume))?;
    for component in relative.components() {
        let Component::Normal(name) = component else {
            return Err(SubpathError::Outside { path: path.to_path_buf(), volume: volume.to_path_buf() });
        };
        current.push(name);
        let child = resolve::open_component_nofollow(parent.as_fd(), Path::new(name))
            .map_err(io_error("cannot open", &current))?;
        let file = fs::File::from(child);
        let metadata = file.metadata().map_err(io_error("error running fstat on", &current))?;
        if metadata.file_type().is_symlink() {
            return Err(SubpathError::Symlink { path: current });
        }
        parent = file.into();
    }
    Ok(parent)
}

/// The kubelet's `IsNotMountPoint`, negated: another device than the
/// parent's, or listed in the mount table. A missing path is not one.
fn is_mount_point(target: &Path) -> Result<bool, SubpathError> {
    let metadata = match fs::metadata(target) {
        Ok(metadata) => metadata,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(io_error("error checking for a mount", target)(err)),
    };
    let parent = target.parent().unwrap_or(Path::new("/"));
    let parent = fs::metadata(parent).map_err(io_error("error checking for a mount", parent))?;
    if parent.dev() != metadata.dev() {
        return Ok(true);
    }
    let table = fs::read_to_string("/proc/thread-self/mountinfo")
        .map_err(io_error("cannot read the mount table for", target))?;
    Ok(super::sandbox::mount_points(&table).any(|point| point == target))
}

/// `os.SameFile` of the two `lstat`s.
fn same_file(path: &Path, target: &Path) -> Result<bool, SubpathError> {
    let at_path = fs::symlink_metadata(path).map_err(io_error("stat failed on", path))?;
    let at_target = fs::symlink_metadata(target).map_err(io_error("lstat failed on", target))?;
    Ok(at_path.dev() == at_target.dev() && at_path.ino() == at_target.ino())
}
