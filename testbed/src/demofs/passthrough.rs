//! A read-only passthrough filesystem: every inode is a path under the backing
//! directory, and every answer comes from that path at the time of asking.
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, Metadata};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuse_supervisor_sys::fuse as sys_fuse;
use fuser::{
    BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request, TimeOrNow,
};

use super::lookup_gate::{self, LookupGate};

/// How long the kernel may trust an entry or attribute before asking again:
/// short, so that changes in the backing directory show up quickly.
const TTL: Duration = Duration::from_secs(1);

/// How many made-up entries `--odd-replies` appends to every listing.
const ODD_ENTRIES: u64 = 100_000;

/// Where the made-up entries' inode numbers start: far above any number the
/// table hands out.
const ODD_INODES: u64 = 1 << 62;

/// The longest name a directory entry may have (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// Inode numbers are never reused within one mount, so one generation is enough.
const GENERATION: Generation = Generation(0);

/// Inode numbers handed to the kernel, each bound to one backing path for the
/// life of the mount. Number 1 is the root; numbers only grow.
#[derive(Debug)]
pub(crate) struct InodeTable {
    /// `paths[n - 1]` is the backing path of inode `n`.
    paths: Vec<PathBuf>,
    numbers: HashMap<PathBuf, u64>,
    /// Where each new number's path is appended (NUL-terminated), for the
    /// next process serving the same connection: the kernel keeps using the
    /// numbers it was given.
    journal: Option<File>,
}

impl InodeTable {
    pub(crate) fn new(root: PathBuf) -> Self {
        Self { numbers: HashMap::from([(root.clone(), INodeNo::ROOT.0)]), paths: vec![root], journal: None }
    }

    /// A table that starts with the numbers an earlier process serving the
    /// connection wrote to `journal`, and writes its own there too.
    pub(crate) fn with_journal(root: PathBuf, journal: &Path) -> io::Result<Self> {
        let mut table = Self::new(root);
        let mut file = std::fs::OpenOptions::new().create(true).read(true).append(true).open(journal)?;
        let mut recorded = Vec::new();
        io::Read::read_to_end(&mut file, &mut recorded)?;
        for path in recorded.split(|byte| *byte == 0).filter(|path| !path.is_empty()) {
            table.number(Path::new(OsStr::from_bytes(path)));
        }
        table.journal = Some(file);
        Ok(table)
    }

    pub(crate) fn path(&self, ino: INodeNo) -> Option<&Path> {
        let index = usize::try_from(ino.0.checked_sub(1)?).ok()?;
        self.paths.get(index).map(PathBuf::as_path)
    }

    /// The number of `path`, given a new one the first time it is seen.
    pub(crate) fn number(&mut self, path: &Path) -> INodeNo {
        if let Some(&number) = self.numbers.get(path) {
            return INodeNo(number);
        }
        self.paths.push(path.to_path_buf());
        // A usize always fits in a u64 on the targets Linux FUSE runs on.
        let number = self.paths.len() as u64;
        self.numbers.insert(path.to_path_buf(), number);
        // Before the kernel hears of the number: a successor must know it.
        if let Some(journal) = &mut self.journal {
            let entry = [path.as_os_str().as_bytes(), b"\0"].concat();
            if let Err(err) = io::Write::write_all(journal, &entry) {
                tracing::warn!(path = %path.display(), %err, "cannot record an inode number for a successor");
            }
        }
        INodeNo(number)
    }
}

/// One entry of a directory listing, as the kernel is given it.
#[derive(Debug, Clone)]
struct ListedEntry {
    ino: INodeNo,
    kind: FileType,
    name: std::ffi::OsString,
}

#[derive(Debug, Default)]
struct Handles {
    next: u64,
    /// Shared so that a read runs without holding the table lock.
    files: HashMap<u64, Arc<File>>,
    /// A directory's listing is taken once, at opendir, so that the offsets
    /// handed out in readdir stay valid however the directory changes.
    listings: HashMap<u64, Vec<ListedEntry>>,
}

impl Handles {
    fn allocate(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

/// The filesystem served over FUSE.
#[derive(Debug)]
pub(crate) struct PassthroughFs {
    backing: PathBuf,
    inodes: Mutex<InodeTable>,
    handles: Mutex<Handles>,
    /// Where lookups wait, for a daemon that holds them.
    lookup_gate: Option<Arc<LookupGate>>,
    /// How long the kernel may trust entries and attributes.
    ttl: Duration,
    /// Extreme but accepted replies (see [`PassthroughFs::with_odd_replies`]).
    odd: bool,
}

/// Locks `mutex`, ignoring poisoning: every critical section here leaves the
/// tables consistent at each step, so a panic in one cannot corrupt them.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The errno of `err`; `EIO` when it carries none.
fn errno(err: &io::Error) -> Errno {
    Errno::from_i32(err.raw_os_error().unwrap_or(0))
}

fn file_type(metadata: &Metadata) -> FileType {
    FileType::from_std(metadata.file_type()).unwrap_or(FileType::RegularFile)
}

fn timestamp(seconds: i64, nanoseconds: i64) -> SystemTime {
    let nanoseconds = u32::try_from(nanoseconds).unwrap_or(0);
    match u64::try_from(seconds) {
        Ok(seconds) => UNIX_EPOCH + Duration::new(seconds, nanoseconds),
        Err(_) => {
            UNIX_EPOCH - Duration::from_secs(seconds.unsigned_abs()) + Duration::from_nanos(u64::from(nanoseconds))
        }
    }
}

fn attributes(ino: INodeNo, metadata: &Metadata) -> FileAttr {
    FileAttr {
        ino,
        size: metadata.size(),
        blocks: metadata.blocks(),
        atime: timestamp(metadata.atime(), metadata.atime_nsec()),
        mtime: timestamp(metadata.mtime(), metadata.mtime_nsec()),
        ctime: timestamp(metadata.ctime(), metadata.ctime_nsec()),
        crtime: UNIX_EPOCH,
        kind: file_type(metadata),
        // The permission bits only: the file type travels in `kind`.
        perm: (metadata.mode() & 0o7777) as u16,
        nlink: u32::try_from(metadata.nlink()).unwrap_or(u32::MAX),
        uid: metadata.uid(),
        gid: metadata.gid(),
        // FUSE carries 32-bit device numbers; wider ones are truncated.
        rdev: metadata.rdev() as u32,
        blksize: u32::try_from(metadata.blksize()).unwrap_or(4096),
        flags: 0,
    }
}

impl PassthroughFs {
    pub(crate) fn new(backing: PathBuf) -> Self {
        Self::with_inodes(InodeTable::new(backing.clone()), backing)
    }

    /// Serves with the inode numbers `journal` records, recording new ones
    /// there (see [`InodeTable::with_journal`]).
    pub(crate) fn with_inode_journal(backing: PathBuf, journal: &Path) -> io::Result<Self> {
        Ok(Self::with_inodes(InodeTable::with_journal(backing.clone(), journal)?, backing))
    }

    fn with_inodes(inodes: InodeTable, backing: PathBuf) -> Self {
        Self {
            inodes: Mutex::new(inodes),
            backing,
            handles: Mutex::new(Handles::default()),
            lookup_gate: None,
            ttl: TTL,
            odd: false,
        }
    }

    /// Entries and attributes valid for `ttl` (zero: every path walk
    /// through the mount asks the daemon again).
    pub(crate) fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Replies a FUSE server may send and the kernel accepts, at their
    /// extremes: a `statfs` of absurd figures (every count `u64::MAX`, a block
    /// size of `u32::MAX`, a fragment size of 0), attributes with the most
    /// links and blocks and times ~35,000 years ahead, and every listing
    /// followed by 100,000 entries with 255-byte names that no lookup finds.
    pub(crate) fn with_odd_replies(mut self) -> Self {
        self.odd = true;
        self
    }

    /// The attributes to send for `ino`, made extreme if replies are odd.
    fn reply_attributes(&self, ino: INodeNo, metadata: &Metadata) -> FileAttr {
        let mut attributes = attributes(ino, metadata);
        if self.odd {
            let far = UNIX_EPOCH + Duration::from_secs(1 << 40);
            attributes.nlink = u32::MAX;
            attributes.blocks = u64::MAX;
            (attributes.atime, attributes.mtime, attributes.ctime) = (far, far, far);
        }
        attributes
    }

    /// Holds every lookup's answer at `gate` until it opens.
    pub(crate) fn holding_lookups_at(mut self, gate: Arc<LookupGate>) -> Self {
        self.lookup_gate = Some(gate);
        self
    }

    fn path(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        lock(&self.inodes).path(ino).map(Path::to_path_buf).ok_or(Errno::ENOENT)
    }

    /// The backing path and metadata of `ino`, without following a symlink.
    fn stat(&self, ino: INodeNo) -> Result<(PathBuf, Metadata), Errno> {
        let path = self.path(ino)?;
        let metadata = std::fs::symlink_metadata(&path).map_err(|err| errno(&err))?;
        Ok((path, metadata))
    }

    fn list(&self, ino: INodeNo) -> Result<Vec<ListedEntry>, Errno> {
        let (path, metadata) = self.stat(ino)?;
        if !metadata.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        let mut children = Vec::new();
        for entry in std::fs::read_dir(&path).map_err(|err| errno(&err))? {
            let entry = entry.map_err(|err| errno(&err))?;
            let kind = match entry.file_type() {
                Ok(file_type) => FileType::from_std(file_type).unwrap_or(FileType::RegularFile),
                // Removed while listing: leave it out.
                Err(_) => continue,
            };
            children.push((entry.file_name(), kind));
        }
        children.sort_by(|left, right| left.0.cmp(&right.0));

        let mut inodes = lock(&self.inodes);
        let parent_ino = match path.parent() {
            Some(parent) if path != self.backing => inodes.number(parent),
            _ => INodeNo::ROOT,
        };
        let mut listing = vec![
            ListedEntry { ino, kind: FileType::Directory, name: ".".into() },
            ListedEntry { ino: parent_ino, kind: FileType::Directory, name: "..".into() },
        ];
        for (name, kind) in children {
            let ino = inodes.number(&path.join(&name));
            listing.push(ListedEntry { ino, kind, name });
        }
        Ok(listing)
    }
}

impl Filesystem for PassthroughFs {
    /// Allows idmapped mounts of the filesystem (Linux 6.12+; the mount is
    /// `default_permissions`, which the kernel requires for it), as a
    /// driver serving user-namespace pods does; an older kernel is not asked.
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let _ = config.add_capabilities(InitFlags::FUSE_ALLOW_IDMAP);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        // The kernel resolves "." and ".." itself; refuse them anyway so that
        // no inode ever names a path outside the backing directory.
        if name.as_bytes().contains(&b'/') || name == "." || name == ".." {
            reply.error(Errno::ENOENT);
            return;
        }
        let path = match self.path(parent) {
            Ok(parent) => parent.join(name),
            Err(err) => return reply.error(err),
        };
        let answer = std::fs::symlink_metadata(&path)
            .map(|metadata| (self.ttl, self.reply_attributes(lock(&self.inodes).number(&path), &metadata), GENERATION))
            .map_err(|err| errno(&err));
        match &self.lookup_gate {
            Some(gate) => gate.answer_or_hold(name, reply, answer),
            None => lookup_gate::send(reply, answer),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.stat(ino) {
            Ok((_, metadata)) => reply.attr(&self.ttl, &self.reply_attributes(ino, &metadata)),
            Err(err) => reply.error(err),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let target = self.path(ino).and_then(|path| std::fs::read_link(&path).map_err(|err| errno(&err)));
        match target {
            Ok(target) => reply.data(target.as_os_str().as_bytes()),
            Err(err) => reply.error(err),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let file = self.path(ino).and_then(|path| File::open(&path).map_err(|err| errno(&err)));
        match file {
            Ok(file) => {
                let mut handles = lock(&self.handles);
                let fh = handles.allocate();
                handles.files.insert(fh, Arc::new(file));
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(err) => reply.error(err),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(file) = lock(&self.handles).files.get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        let mut buffer = vec![0; size as usize];
        let mut filled = 0;
        while filled < buffer.len() {
            match file.read_at(&mut buffer[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(count) => filled += count,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return reply.error(errno(&err)),
            }
        }
        reply.data(&buffer[..filled]);
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // Nothing is ever written, so there is nothing to flush.
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        lock(&self.handles).files.remove(&fh.0);
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.list(ino) {
            Ok(listing) => {
                let mut handles = lock(&self.handles);
                let fh = handles.allocate();
                handles.listings.insert(fh, listing);
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(err) => reply.error(err),
        }
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let handles = lock(&self.handles);
        let Some(listing) = handles.listings.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        // An entry's offset is its position plus one: the offset the kernel
        // passes back to continue after it.
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let mut full = false;
        for (index, entry) in listing.iter().enumerate().skip(start) {
            full = reply.add(entry.ino, index as u64 + 1, entry.kind, &entry.name);
            if full {
                break;
            }
        }
        let listed = listing.len() as u64;
        drop(handles);
        if self.odd && !full {
            // Made up from their position: nothing to keep per handle.
            for index in offset.max(listed)..listed + ODD_ENTRIES {
                let number = index - listed;
                let name = odd_name(number);
                if reply.add(INodeNo(ODD_INODES + number), index + 1, FileType::RegularFile, &name) {
                    break;
                }
            }
        }
        reply.ok();
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        lock(&self.handles).listings.remove(&fh.0);
        reply.ok();
    }

    // Every change is refused as on a read-only filesystem, rather than with
    // fuser's default ENOSYS, which callers would misread.

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mkdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, _mode: u32, _umask: u32, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(&self, _req: &Request, _parent: INodeNo, _link_name: &OsStr, _target: &Path, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(&self, _req: &Request, _ino: INodeNo, _newparent: INodeNo, _newname: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        if self.odd {
            let most = u64::MAX;
            return reply.statfs(most, most, most, most, most, u32::MAX, u32::MAX, 0);
        }
        match sys_fuse::fs_usage(&self.backing) {
            Ok(usage) => reply.statfs(
                usage.blocks,
                usage.blocks_free,
                usage.blocks_available,
                usage.files,
                usage.files_free,
                u32::try_from(usage.block_size).unwrap_or(4096),
                u32::try_from(usage.name_max).unwrap_or(255),
                u32::try_from(usage.fragment_size).unwrap_or(4096),
            ),
            Err(err) => reply.error(errno(&err)),
        }
    }
}

/// The `number`th made-up entry's name: the number, then `x` up to 255 bytes.
fn odd_name(number: u64) -> std::ffi::OsString {
    format!("{number:x<NAME_MAX$}").into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_names_are_255_bytes_and_distinct() {
        assert_eq!(odd_name(0).len(), NAME_MAX);
        assert_eq!(odd_name(ODD_ENTRIES - 1).len(), NAME_MAX);
        assert_ne!(odd_name(1), odd_name(10));
        assert!(odd_name(7).to_string_lossy().starts_with("7xx"));
    }

    #[test]
    fn root_is_inode_one_and_numbers_are_stable() {
        let mut table = InodeTable::new(PathBuf::from("/backing"));
        assert_eq!(table.path(INodeNo::ROOT), Some(Path::new("/backing")));
        let file = table.number(Path::new("/backing/a"));
        let other = table.number(Path::new("/backing/b"));
        assert_ne!(file, other);
        assert_ne!(file, INodeNo::ROOT);
        assert_eq!(table.number(Path::new("/backing/a")), file);
        assert_eq!(table.path(other), Some(Path::new("/backing/b")));
        assert_eq!(table.path(INodeNo(0)), None);
        assert_eq!(table.path(INodeNo(99)), None);
    }

    #[test]
    fn a_journal_hands_the_numbers_to_the_next_table() {
        let dir = tempfile::tempdir().unwrap();
        let journal = dir.path().join("inodes");
        let mut first = InodeTable::with_journal(PathBuf::from("/backing"), &journal).unwrap();
        let (a, b) = (first.number(Path::new("/backing/a")), first.number(Path::new("/backing/b c")));
        drop(first);
        let mut next = InodeTable::with_journal(PathBuf::from("/backing"), &journal).unwrap();
        assert_eq!(next.path(a), Some(Path::new("/backing/a")));
        assert_eq!(next.path(b), Some(Path::new("/backing/b c")));
        let c = next.number(Path::new("/backing/c"));
        assert!(c.0 > b.0, "{c:?} reuses a number");
        assert_eq!(
            InodeTable::with_journal(PathBuf::from("/backing"), &journal).unwrap().path(c),
            Some(Path::new("/backing/c"))
        );
    }

    #[test]
    fn timestamps_before_the_epoch_survive() {
        assert_eq!(timestamp(-1, 500_000_000), UNIX_EPOCH - Duration::from_millis(500));
        assert_eq!(timestamp(2, 0), UNIX_EPOCH + Duration::from_secs(2));
    }
}
