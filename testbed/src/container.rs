//! The container model of the fast test tier: a process whose mount
//! namespace is made the way runc makes one, reading one volume in a loop.
//!
//! Stdout carries one line per *change* of what it sees:
//!
//! ```text
//! <unix-nanos> ok <file content, escaped> | <sorted entry names, escaped, comma-separated>
//! <unix-nanos> err <errno name, e.g. ENOTCONN>
//! ```
//!
//! Escaping keeps a value on one line and free of the separators: `\` → `\\`,
//! and newline, `|`, `,` and other control characters → `\xNN`.
use std::fs;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuse_supervisor_sys::mount::{self, Propagation};
use fuse_supervisor_sys::poll::Poller;
use fuse_supervisor_sys::{ns, process};

/// A process that sets up its mount namespace the way runc does and then
/// reads one volume in a loop, reporting what it sees on stdout.
#[derive(Debug, Clone)]
pub struct ContainerOptions {
    /// Host path of the pod's volume (the target).
    pub volume: PathBuf,
    /// Directory that becomes the container's root filesystem.
    pub rootfs: PathBuf,
    /// Host directories the container must not see (kubelet and runtime roots).
    pub hide: Vec<PathBuf>,
    /// File to read, relative to the volume.
    pub read: PathBuf,
    /// Pause between reads.
    pub interval: Duration,
    /// The volume's propagation in the container: `Slave` as with
    /// `mountPropagation: HostToContainer`, `Private` as with `None`.
    pub propagation: Propagation,
    /// While the volume fails, read again as soon as the container's mount
    /// table changes (`POLLPRI` on its own mountinfo), or after `interval`
    /// at the latest, instead of every `interval`: a reader that costs
    /// nothing while it waits, and reads again the moment a heal (or
    /// propagation) changes its namespace.
    pub wake_on_mount_change: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("cannot unshare the mount namespace")]
    Unshare(#[source] io::Error),
    #[error("cannot make {path} {propagation:?}")]
    Propagation {
        path: PathBuf,
        propagation: Propagation,
        #[source]
        source: io::Error,
    },
    #[error("cannot create volume directory {path} in the rootfs")]
    CreateVolumeDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot bind volume {volume} onto {target}")]
    BindVolume {
        volume: PathBuf,
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot detach hidden tree {path} (it must be a mount point)")]
    Hide {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write an observation to stdout")]
    Output(#[source] io::Error),
    #[error("cannot watch the container's mount table")]
    WatchTable(#[source] io::Error),
}

/// The calling thread's mount table, polled for changes.
struct MountChanges {
    poller: Poller,
    _table: fs::File,
}

impl MountChanges {
    fn open() -> io::Result<Self> {
        let table = fs::File::open("/proc/thread-self/mountinfo")?;
        let poller = Poller::new()?;
        poller.add_priority(table.as_fd(), 0)?;
        Ok(MountChanges { poller, _table: table })
    }

    /// Until the table changes (each change is reported once: the poll
    /// itself takes note of it), or `timeout`.
    fn wait(&self, timeout: Duration) -> io::Result<()> {
        self.poller.wait(&mut Vec::new(), Some(timeout))
    }
}

/// Builds the container's namespace, then reads forever (until killed or
/// stdout closes). Never returns `Ok`.
pub fn run(options: &ContainerOptions) -> Result<(), ContainerError> {
    // Propagation unchanged: the copies stay peers of the parent namespace's
    // shared mounts, exactly what the next step turns into slaves.
    ns::unshare_mount_namespace().map_err(ContainerError::Unshare)?;
    set_propagation(Path::new("/"), Propagation::Slave, true)?;
    let mount_point = options.rootfs.join("volume");
    fs::create_dir_all(&mount_point)
        .map_err(|source| ContainerError::CreateVolumeDir { path: mount_point.clone(), source })?;
    mount::bind(&options.volume, &mount_point).map_err(|source| ContainerError::BindVolume {
        volume: options.volume.clone(),
        target: mount_point.clone(),
        source,
    })?;
    set_propagation(&mount_point, options.propagation, false)?;
    // What pivot_root does to the old root: the host trees leave this namespace.
    for hidden in &options.hide {
        mount::detach(hidden).map_err(|source| ContainerError::Hide { path: hidden.clone(), source })?;
    }
    let file = mount_point.join(&options.read);
    // This namespace's table, as it is now: polled, never read.
    let table = match options.wake_on_mount_change {
        true => Some(MountChanges::open().map_err(ContainerError::WatchTable)?),
        false => None,
    };
    let mut stdout = io::stdout().lock();
    let mut last = None;
    loop {
        let seen = observe(&file, &mount_point);
        let reads = seen.starts_with("ok");
        if last.as_ref() != Some(&seen) {
            writeln!(stdout, "{} {}", unix_nanos(SystemTime::now()), seen)
                .and_then(|()| stdout.flush())
                .map_err(ContainerError::Output)?;
            last = Some(seen);
        }
        match &table {
            Some(table) if !reads => table.wait(options.interval).map_err(ContainerError::WatchTable)?,
            _ => std::thread::sleep(options.interval),
        }
    }
}

fn set_propagation(path: &Path, propagation: Propagation, recursive: bool) -> Result<(), ContainerError> {
    mount::set_propagation(path, propagation, recursive).map_err(|source| ContainerError::Propagation {
        path: path.to_path_buf(),
        propagation,
        source,
    })
}

/// One reading of the volume, already in its output form (minus the time).
fn observe(file: &Path, dir: &Path) -> String {
    let read = || -> io::Result<String> {
        let content = fs::read(file)?;
        let mut entries = fs::read_dir(dir)?
            .map(|entry| entry.map(|entry| escape(entry.file_name().as_encoded_bytes())))
            .collect::<io::Result<Vec<_>>>()?;
        entries.sort();
        Ok(format!("ok {} | {}", escape(&content), entries.join(",")))
    };
    read().unwrap_or_else(|err| format!("err {}", errno_name(&err)))
}

fn unix_nanos(at: SystemTime) -> u128 {
    // Before 1970 only with a broken clock; 0 is as good an answer as any.
    at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_nanos())
}

/// See the module docs for the rules.
pub(crate) fn escape(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '|' | ',' => out.push_str(&format!("\\x{:02x}", c as u32)),
                c if c.is_control() && (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
                c => out.push(c),
            }
        }
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    out
}

/// Inverse of [`escape`] (invalid UTF-8 comes back lossily).
pub(crate) fn unescape(text: &str) -> String {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        match (first, tail) {
            (b'\\', [b'\\', tail @ ..]) => {
                bytes.push(b'\\');
                rest = tail;
            }
            (b'\\', [b'x', a, b, tail @ ..]) if let Some(byte) = hex_byte(*a, *b) => {
                bytes.push(byte);
                rest = tail;
            }
            _ => {
                bytes.push(first);
                rest = tail;
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn hex_byte(high: u8, low: u8) -> Option<u8> {
    let digit = |d: u8| (d as char).to_digit(16);
    u8::try_from(digit(high)? * 16 + digit(low)?).ok()
}

/// The symbolic name of an error's errno (`ENOTCONN`), `E<number>` for
/// unnamed ones, `E?<kind>` for errors without an errno.
pub(crate) fn errno_name(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(errno) => process::errno_name(errno).map_or_else(|| format!("E{errno}"), str::to_string),
        None => format!("E?{:?}", err.kind()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_round_trips_separators_and_newlines() {
        let raw = "a|b,c\\d\ne\u{7f}é";
        let escaped = escape(raw.as_bytes());
        assert!(!escaped.contains(['|', ',', '\n']), "{escaped}");
        assert_eq!(unescape(&escaped), raw);
    }

    #[test]
    fn errno_names() {
        assert_eq!(errno_name(&io::Error::from_raw_os_error(107)), "ENOTCONN");
        assert_eq!(errno_name(&io::Error::from_raw_os_error(2)), "ENOENT");
    }
}
