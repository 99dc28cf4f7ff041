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
mod reader;
mod scan;
#[cfg(feature = "testbed")]
mod synthetic;

use dedup::SeenIds;
use error::quote;
pub use error::{Field, ParseError, ParseErrorKind, QUOTE_LIMIT};

pub use escaped::Escaped;
pub use reader::{MountInfoReader, take_change_flag};
#[doc(hidden)]
#[cfg(feature = "testbed")]
pub use synthetic::synthetic_table;

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
            field: Field::SuperOptions,
            kind: ParseErrorKind::EmbeddedNewline,
        });
    }
    Ok(mount)
}

/// Parses the line of `text` that starts at `start`; returns the start of the
/// next line too, also after an error.
///
/// The line's end is found first, with one vectorised search: the super
/// options, most of a kubelet node's bytes (overlay `lowerdir=` lists), are
/// then taken whole without being scanned again, and every field search is
/// bounded by the line, so a short line never runs into the next.
#[inline(always)]
fn parse_at<'a>(
    text: &'a [u8],
    text_utf8: Utf8<'a>,
    start: usize,
    line_number: usize,
) -> (Result<MountInfo<'a>, ParseError>, usize) {
    let rest = text.get(start..).unwrap_or_default();
    // One search finds the line's end and whether it has any escape (rare):
    // without one, escaped fields are split like plain ones.
    let (end, escapes) = match memchr::memchr2(b'\n', b'\\', rest) {
        Some(at) if rest[at] == b'\\' => {
            (memchr::memchr(b'\n', &rest[at..]).map_or(text.len(), |newline| start + at + newline), true)
        }
        found => (found.map_or(text.len(), |at| start + at), false),
    };
    let mut fields = Fields { text, text_utf8, pos: start, end, escapes, ended: false, line_number };
    let mount = fields.mount_info().map_err(|failure| *failure);
    (mount, end + 1)
}

/// A parse error inside the parser: boxed, so that every field's `Result`
/// stays small on the success path.
type Failure = Box<ParseError>;

/// A cursor over the space-separated fields of one line of a table.
struct Fields<'a> {
    text: &'a [u8],
    text_utf8: Utf8<'a>,
    /// Start of the next field; once `ended`, the line's end.
    pos: usize,
    /// The line's end: its newline, or the end of the text.
    end: usize,
    /// The line has a backslash somewhere.
    escapes: bool,
    /// The last field taken ran to the end of the line.
    ended: bool,
    line_number: usize,
}

impl<'a> Fields<'a> {
    #[inline(always)]
    fn mount_info(&mut self) -> Result<MountInfo<'a>, Failure> {
        let mount_id = self.number(Field::MountId)?;
        let parent_id = self.number(Field::ParentId)?;
        let (major, minor) = self.device()?;
        let root = self.escaped(Field::Root)?;
        let (root, root_deleted) = match root.raw().strip_suffix(b"//deleted") {
            Some(stripped) => (Escaped::new(stripped), true),
            None => (root, false),
        };
        let mount_point = self.escaped(Field::MountPoint)?;
        if mount_point.raw().first() != Some(&b'/') {
            return Err(self.error(Field::MountPoint, ParseErrorKind::RelativePath(quote(mount_point.raw()))));
        }
        let mount_options = self.text(Field::MountOptions)?;
        let propagation = self.optional_fields()?;
        let fs_type = self.text(Field::FsType)?;
        let source = self.escaped(Field::Source)?;
        let super_options = self.rest(Field::SuperOptions)?;
        Ok(MountInfo {
            mount_id,
            parent_id,
            major,
            minor,
            root,
            root_deleted,
            mount_point,
            mount_options,
            propagation,
            fs_type,
            source,
            super_options,
        })
    }

    #[cold]
    #[inline(never)]
    fn error(&self, field: Field, kind: ParseErrorKind) -> Failure {
        Box::new(ParseError { line: self.line_number, field, kind })
    }

    #[cold]
    #[inline(never)]
    fn missing(&self, field: Field) -> Failure {
        self.error(field, ParseErrorKind::Missing)
    }

    /// What is left of the line.
    #[inline(always)]
    fn remaining(&self) -> &'a [u8] {
        // `pos <= end <= text.len()` always holds; `get` keeps a broken
        // invariant from panicking (the next field is then missing).
        self.text.get(self.pos..self.end).unwrap_or_default()
    }

    /// Moves past the field that ends at `at` (a space, or the line's end).
    #[inline(always)]
    fn finish_field(&mut self, at: usize) {
        if at < self.end {
            self.pos = at + 1;
        } else {
            self.pos = self.end;
            self.ended = true;
        }
    }

    /// The end of the field that starts at `pos`: the next space, or the
    /// line's end. Control bytes other than the newline are part of a field
    /// (the kernel leaves them unescaped).
    #[inline(always)]
    fn field_end(&self) -> usize {
        scan::find_space(self.remaining()).map_or(self.end, |at| self.pos + at)
    }

    /// The next field, up to the next space or the end of the line.
    #[inline(always)]
    fn plain(&mut self, field: Field) -> Result<&'a [u8], Failure> {
        if self.ended {
            return Err(self.missing(field));
        }
        let (start, at) = (self.pos, self.field_end());
        self.finish_field(at);
        Ok(&self.text[start..at])
    }

    /// A decimal number ended by a space or the line's end. The usual
    /// number is read digit by digit in place; anything else (empty, too
    /// long, not digits) goes the slow way, which names the error.
    #[inline(always)]
    fn number(&mut self, field: Field) -> Result<u32, Failure> {
        if !self.ended
            && let Some((value, len)) = leading_u32(self.remaining(), b' ')
        {
            self.finish_field(self.pos + len);
            return Ok(value);
        }
        self.number_slow(field)
    }

    #[cold]
    #[inline(never)]
    fn number_slow(&mut self, field: Field) -> Result<u32, Failure> {
        let text = self.plain(field)?;
        if text.is_empty() {
            return Err(self.missing(field));
        }
        parse_u32(text).ok_or_else(|| self.error(field, ParseErrorKind::InvalidNumber(quote(text))))
    }

    #[inline(always)]
    fn device(&mut self) -> Result<(u32, u32), Failure> {
        if !self.ended {
            let rest = self.remaining();
            if let Some((major, colon)) = leading_u32(rest, b':')
                && let Some((minor, len)) = rest.get(colon + 1..).and_then(|after| leading_u32(after, b' '))
            {
                self.finish_field(self.pos + colon + 1 + len);
                return Ok((major, minor));
            }
        }
        self.device_slow()
    }

    #[cold]
    #[inline(never)]
    fn device_slow(&mut self) -> Result<(u32, u32), Failure> {
        let text = self.plain(Field::Device)?;
        if text.is_empty() {
            return Err(self.missing(Field::Device));
        }
        text.iter()
            .position(|&byte| byte == b':')
            .and_then(|colon| Some((parse_u32(&text[..colon])?, parse_u32(&text[colon + 1..])?)))
            .ok_or_else(|| self.error(Field::Device, ParseErrorKind::InvalidDevice(quote(text))))
    }

    /// A field the kernel escapes; each escape is checked here so that
    /// `Escaped::unescaped` cannot meet a bad one. Only the source may be
    /// empty.
    #[inline(always)]
    fn escaped(&mut self, field: Field) -> Result<Escaped<'a>, Failure> {
        if self.ended {
            return Err(self.missing(field));
        }
        let start = self.pos;
        let at = if self.escapes { self.escaped_field_end(field)? } else { self.field_end() };
        self.finish_field(at);
        let raw = &self.text[start..at];
        if raw.is_empty() && field != Field::Source {
            return Err(self.missing(field));
        }
        Ok(Escaped::new(raw))
    }

    /// The end of an escaped field on a line that has a backslash: escapes
    /// are skipped (`\040` is a space inside the field) and checked.
    #[inline(never)]
    fn escaped_field_end(&self, field: Field) -> Result<usize, Failure> {
        let line = &self.text[..self.end];
        let mut at = self.pos;
        loop {
            at = scan::find_space_or_backslash(&line[at..]).map_or(self.end, |found| at + found);
            if line.get(at) != Some(&b'\\') {
                return Ok(at);
            }
            let bad = || quote(&self.text[self.pos..self.field_end()]);
            match escaped::decode_escape(&line[at + 1..]) {
                Some(0) => return Err(self.error(field, ParseErrorKind::EscapedNul(bad()))),
                Some(_) => at += 4,
                None => return Err(self.error(field, ParseErrorKind::InvalidEscape(bad()))),
            }
        }
    }

    /// A non-empty field that must be UTF-8 (options, fs type).
    #[inline(always)]
    fn text(&mut self, field: Field) -> Result<&'a str, Failure> {
        let start = self.pos;
        let text = self.plain(field)?;
        self.utf8(field, start, text)
    }

    /// Everything left on the line: the super options. Taken whole, so that a
    /// filesystem that prints a space unescaped in its options does not break
    /// the line.
    #[inline(always)]
    fn rest(&mut self, field: Field) -> Result<&'a str, Failure> {
        if self.ended {
            return Err(self.missing(field));
        }
        let (start, text) = (self.pos, self.remaining());
        if text.last() == Some(&b'\r') {
            return Err(self.error(field, ParseErrorKind::CarriageReturn));
        }
        self.pos = self.end;
        self.ended = true;
        self.utf8(field, start, text)
    }

    /// `text`, which starts at `start` in the whole text, as a `str`.
    #[inline(always)]
    fn utf8(&self, field: Field, start: usize, text: &'a [u8]) -> Result<&'a str, Failure> {
        if text.is_empty() {
            return Err(self.missing(field));
        }
        if let Utf8::Valid(whole) = self.text_utf8 {
            // Fields start and end at ASCII bytes, so this is a char boundary;
            // `get` checks it anyway, and falls through if it were not.
            if let Some(text) = whole.get(start..start + text.len()) {
                return Ok(text);
            }
        }
        std::str::from_utf8(text).map_err(|_| self.error(field, ParseErrorKind::NotUtf8(quote(text))))
    }

    /// The optional fields up to and including the `-` separator.
    #[inline(always)]
    fn optional_fields(&mut self) -> Result<Propagation, Failure> {
        let mut propagation = Propagation::default();
        loop {
            let tag = self.plain(Field::Separator)?;
            let slot = match tag {
                b"-" => return Ok(propagation),
                b"unbindable" => {
                    propagation.unbindable = true;
                    continue;
                }
                _ if tag.starts_with(b"shared:") => &mut propagation.shared,
                _ if tag.starts_with(b"master:") => &mut propagation.master,
                _ if tag.starts_with(b"propagate_from:") => &mut propagation.propagate_from,
                // proc(5): readers must ignore tags they do not know.
                _ => continue,
            };
            let colon = tag.iter().position(|&byte| byte == b':').unwrap_or(0);
            *slot = Some(
                parse_u32(&tag[colon + 1..])
                    .ok_or_else(|| self.error(Field::OptionalFields, ParseErrorKind::InvalidNumber(quote(tag))))?,
            );
        }
    }
}

/// The whole text as a `str`, if it is valid UTF-8 (nearly always): checking
/// it at once is several times faster than checking every option field.
#[derive(Clone, Copy)]
enum Utf8<'a> {
    Valid(&'a str),
    Invalid,
}

impl<'a> Utf8<'a> {
    fn check(text: &'a [u8]) -> Self {
        std::str::from_utf8(text).map_or(Utf8::Invalid, Utf8::Valid)
    }
}

/// The decimal number at the start of `text`, if it has one to nine digits
/// (so it cannot overflow) and is followed by `terminator`, or, for a
/// space, by the end of the line; with the number of digits.
#[inline(always)]
fn leading_u32(text: &[u8], terminator: u8) -> Option<(u32, usize)> {
    let mut value = 0u32;
    let mut len = 0;
    while let Some(&byte) = text.get(len) {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            break;
        }
        if len == 9 {
            return None;
        }
        value = value * 10 + u32::from(digit);
        len += 1;
    }
    let ended = match text.get(len) {
        Some(&byte) => byte == terminator,
        None => terminator == b' ',
    };
    (len > 0 && ended).then_some((value, len))
}

/// A decimal `u32`: digits only, at least one, no overflow.
#[inline]
fn parse_u32(text: &[u8]) -> Option<u32> {
    if text.is_empty() || text.len() > 10 {
        return None;
    }
    let mut value: u64 = 0;
    for &byte in text {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        value = value * 10 + u64::from(digit);
    }
    u32::try_from(value).ok()
}

#[cfg(test)]
mod tests;
