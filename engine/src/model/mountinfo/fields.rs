//! The parser of one mountinfo line: a cursor over its space-separated
//! fields, bounded by the line's end.
use super::error::quote;
use super::{Escaped, Field, MountInfo, ParseError, ParseErrorKind, Propagation};
use super::{escaped, scan};

/// Parses the line of `text` that starts at `start`; returns the start of the
/// next line too, also after an error.
///
/// The line's end is found first, with one vectorised search: the super
/// options, most of a kubelet node's bytes (overlay `lowerdir=` lists), are
/// then taken whole without being scanned again, and every field search is
/// bounded by the line, so a short line never runs into the next.
#[inline(always)]
pub(super) fn parse_at<'a>(
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
    let mut fields = Fields {
        text,
        text_utf8,
        pos: start,
        end,
        escapes,
        ended: false,
        line_number,
        line_start: start,
        field_start: start,
    };
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
    /// Where the line starts in the text, and where the field being read
    /// does: an error names the field's 1-based byte column.
    line_start: usize,
    field_start: usize,
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
        let column = self.field_start - self.line_start + 1;
        Box::new(ParseError { line: self.line_number, column, field, kind })
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
        self.field_start = self.pos;
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
        self.field_start = self.pos;
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
        self.field_start = self.pos;
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
pub(super) enum Utf8<'a> {
    Valid(&'a str),
    Invalid,
}

impl<'a> Utf8<'a> {
    pub(super) fn check(text: &'a [u8]) -> Self {
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
pub(super) fn parse_u32(text: &[u8]) -> Option<u32> {
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
