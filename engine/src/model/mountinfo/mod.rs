//! Parser of `/proc/<pid>/mountinfo` (proc(5)), zero-copy over the read buffer.
//!
//! One line per mount:
//!
//! ```text
//! 36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//! (1)(2) (3)  (4)   (5)      (6)      (7)   (8) (9)    (10)        (11)
//! ```
//!
//! mount ID, parent ID, `major:minor`, root, mount point, mount options, zero
//! or more optional fields, `-`, fs type, source, super options. Fields are
//! separated by exactly one space; the kernel escapes space, tab, newline and
//! backslash in the root, mount point, fs type and source as `\ooo`. The
//! source can be empty (`mount -t tmpfs "" /x` prints `tmpfs  rw`).
//!
//! Deleted roots: the kernel prints the root with `dentry_path`, which appends
//! `//deleted` when the dentry was unlinked (a bind of a since-removed
//! directory or file). A real path never contains `//`, so the suffix is
//! unambiguous; it is stripped and reported as [`MountInfo::root_deleted`].
//! The mount point has no such marker: it is printed with `__d_path`, which
//! adds none, and since Linux 3.18 unlinking a mount point (from a namespace
//! where it is not one) detaches every mount on it, so a deleted mount point
//! never appears in the table (verified on 6.18).
//!
//! Refused as malformed, because the kernel never writes them: an escaped NUL
//! (`\000`; no path or name holds one), a mount point that does not start
//! with `/` (it prints them from the reader's root, and skips mounts outside
//! it), and a line ending in a carriage return (CRLF: a table that went
//! through another system's tools).

mod dedup;
mod error;
mod escaped;
mod fields;
mod reader;
mod scan;
mod stream;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use dedup::SeenIds;
pub use error::{Field, ParseError, ParseErrorKind, QUOTE_LIMIT};
use fields::{Utf8, parse_at};

pub use escaped::Escaped;
pub use reader::{MountInfoReader, take_change_flag};
pub use stream::{CappedLine, CappedLines};

/// One line of a mountinfo table, borrowed from the buffer it was parsed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountInfo<'a> {
    pub mount_id: u32,
    pub parent_id: u32,
    pub major: u32,
    pub minor: u32,
    /// Path of the mount's root inside its filesystem, without `//deleted`.
    pub root: Escaped<'a>,
    /// The root's dentry was unlinked (the kernel printed `…//deleted`).
    pub root_deleted: bool,
    pub mount_point: Escaped<'a>,
    /// Per-mount options (`rw,nosuid,relatime`).
    pub mount_options: &'a str,
    pub propagation: Propagation,
    /// `fuse`, `fuse.<subtype>`, `fuseblk`, `ext4`, …
    pub fs_type: &'a str,
    pub source: Escaped<'a>,
    /// Per-superblock options, as printed (a filesystem may escape in them).
    pub super_options: &'a str,
}

impl MountInfo<'_> {
    /// A FUSE mount: `fuse`, `fuse.<subtype>` or `fuseblk`.
    pub fn is_fuse(&self) -> bool {
        is_fuse_type(self.fs_type)
    }

    /// `(major, minor)` of the mount's superblock.
    pub fn dev(&self) -> (u32, u32) {
        (self.major, self.minor)
    }
}

/// `fuse`, `fuseblk` and `fuse.<subtype>`: the types a FUSE daemon mounts.
pub fn is_fuse_type(fs_type: &str) -> bool {
    match fs_type.strip_prefix("fuse") {
        Some(rest) => rest.is_empty() || rest == "blk" || rest.starts_with('.'),
        None => false,
    }
}

/// A root read with `statmount`, which prints it as mountinfo does, without
/// the `//deleted` marker (see the module's doc). A FUSE dentry is also
/// unhashed, and so marked, when its revalidation fails on a dead
/// connection: the path is still the one the mount was made from, and it is
/// what a heal looks up in the new daemon's tree.
pub fn without_deleted_marker(root: PathBuf) -> PathBuf {
    match root.as_os_str().as_bytes().strip_suffix(b"//deleted") {
        Some(live) => PathBuf::from(OsStr::from_bytes(live)),
        None => root,
    }
}

/// The optional fields: propagation state of the mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Propagation {
    /// `shared:N`: peer group N.
    pub shared: Option<u32>,
    /// `master:N`: slave of peer group N.
    pub master: Option<u32>,
    /// `propagate_from:N`: receives from peer group N (the closest dominant
    /// group visible from the reader's root, when the master is not).
    pub propagate_from: Option<u32>,
    /// `unbindable`.
    pub unbindable: bool,
}

/// Parses a whole table. Duplicate mount IDs (a non-atomic read) keep the last
/// line, at that line's place. An empty text is an empty table (a process
/// whose root is not a mount point sees no line for mounts outside it).
pub fn parse_table(text: &[u8]) -> Result<Vec<MountInfo<'_>>, ParseError> {
    // A guess from typical line lengths; counting the lines first costs more
    // than the vector's few regrowths.
    let mut mounts = Vec::with_capacity(text.len() / 256 + 1);
    let mut seen = SeenIds::default();
    for_each_line(
        text,
        |mount| {
            seen.insert(mount.mount_id);
            mounts.push(mount);
        },
        Err,
    )?;
    if seen.repeated() {
        let ids: Vec<u32> = mounts.iter().map(|mount| mount.mount_id).collect();
        let mut keep = dedup::last_of_each_id(&ids).into_iter();
        mounts.retain(|_| keep.next().unwrap_or(true));
    }
    Ok(mounts)
}

/// What [`parse_table_with`] kept of a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept<T> {
    /// What `keep` returned, in table order, one per mount.
    pub items: Vec<T>,
    /// How many mounts the table lists (after deduplication), kept or not.
    pub total_mounts: usize,
    /// The lines that did not parse, in order ([`parse_table_lenient_with`]
    /// only: the strict parse stops at the first).
    pub malformed: Vec<ParseError>,
}

/// Parses a whole table, keeping only what `keep` makes of a line (for
/// callers that want a few mounts, e.g. the FUSE ones, and nothing borrowed).
/// Deduplicated like [`parse_table`]: an item is dropped when a later line
/// lists its mount again, even if `keep` skipped that later line. Stops at
/// the first malformed line.
pub fn parse_table_with<'a, T>(
    text: &'a [u8],
    keep: impl FnMut(&MountInfo<'a>) -> Option<T>,
) -> Result<Kept<T>, ParseError> {
    kept_lines(text, keep, Err)
}

/// [`parse_table_with`] past malformed lines: every well-formed line is
/// handed to `keep`, and every malformed one is in [`Kept::malformed`]. For
/// the loop, where one line the kernel should never have written must not
/// hide every other mount (and so every other target) of the table.
pub fn parse_table_lenient_with<'a, T>(text: &'a [u8], keep: impl FnMut(&MountInfo<'a>) -> Option<T>) -> Kept<T> {
    let mut malformed = Vec::new();
    let kept = kept_lines(text, keep, |err| {
        malformed.push(err);
        Ok(())
    });
    // Lenient: `kept_lines` fails only when the malformed-line handler does.
    let mut kept = kept.unwrap_or_else(|_| Kept { items: Vec::new(), total_mounts: 0, malformed: Vec::new() });
    kept.malformed = malformed;
    kept
}

/// The well-formed lines' items; `malformed` says whether a malformed line
/// stops the parse (its error returned) or not (`Ok`).
#[inline(always)]
fn kept_lines<'a, T>(
    text: &'a [u8],
    mut keep: impl FnMut(&MountInfo<'a>) -> Option<T>,
    malformed: impl FnMut(ParseError) -> Result<(), ParseError>,
) -> Result<Kept<T>, ParseError> {
    let mut items = Vec::new();
    let mut item_lines = Vec::new();
    let mut seen = SeenIds::default();
    // The index of the line among the well-formed ones.
    let mut line = 0;
    for_each_line(
        text,
        |mount| {
            seen.insert(mount.mount_id);
            if let Some(item) = keep(&mount) {
                items.push(item);
                item_lines.push(line);
            }
            line += 1;
        },
        malformed,
    )?;
    if seen.repeated() {
        // Rare (an inconsistent read): parse again for every line's ID.
        let ids: Vec<u32> = parse_lines(text).filter_map(|mount| Some(mount.ok()?.mount_id)).collect();
        let last = dedup::last_of_each_id(&ids);
        let mut lines = item_lines.into_iter();
        items.retain(|_| lines.next().is_some_and(|line| last.get(line).copied().unwrap_or(true)));
    }
    Ok(Kept { items, total_mounts: seen.distinct(), malformed: Vec::new() })
}

/// Calls `each` with every well-formed line of a table, in order, and
/// `malformed` with the error of every other line; stops at the first error
/// `malformed` returns.
#[inline(always)]
fn for_each_line<'a>(
    text: &'a [u8],
    mut each: impl FnMut(MountInfo<'a>),
    mut malformed: impl FnMut(ParseError) -> Result<(), ParseError>,
) -> Result<(), ParseError> {
    let text_utf8 = Utf8::check(text);
    let (mut start, mut line_number) = (0, 0);
    while start < text.len() {
        line_number += 1;
        let (mount, next_start) = parse_at(text, text_utf8, start, line_number);
        match mount {
            Ok(mount) => each(mount),
            Err(err) => malformed(err)?,
        }
        start = next_start;
    }
    Ok(())
}

/// Line by line, without collecting (for callers that filter, e.g. FUSE mounts
/// only). Does not deduplicate. A final line without a newline is parsed; an
/// empty line in the middle is an error.
pub fn parse_lines(text: &[u8]) -> impl Iterator<Item = Result<MountInfo<'_>, ParseError>> {
    Lines { text, text_utf8: Utf8::check(text), start: 0, line_number: 0 }
}

struct Lines<'a> {
    text: &'a [u8],
    text_utf8: Utf8<'a>,
    start: usize,
    line_number: usize,
}

impl<'a> Iterator for Lines<'a> {
    type Item = Result<MountInfo<'a>, ParseError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.start >= self.text.len() {
            return None;
        }
        self.line_number += 1;
        let (mount, next_start) = parse_at(self.text, self.text_utf8, self.start, self.line_number);
        self.start = next_start;
        Some(mount)
    }
}

/// Parses one line (`line_number` is 1-based, for errors). A trailing newline
/// is allowed; a newline inside is an error.
pub fn parse_line(line: &[u8], line_number: usize) -> Result<MountInfo<'_>, ParseError> {
    let (mount, next_start) = parse_at(line, Utf8::check(line), 0, line_number);
    let mount = mount?;
    if next_start < line.len() {
        return Err(ParseError {
            line: line_number,
            column: next_start,
            field: Field::SuperOptions,
            kind: ParseErrorKind::EmbeddedNewline,
        });
    }
    Ok(mount)
}

#[cfg(test)]
mod tests;
