//! What a malformed mountinfo line is refused with: the line, the column
//! and name of the field, and what was wrong, with the offending text quoted.
use std::fmt;

/// A field of a mountinfo line, named in parse errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    MountId,
    ParentId,
    Device,
    Root,
    MountPoint,
    MountOptions,
    OptionalFields,
    Separator,
    FsType,
    Source,
    SuperOptions,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Field::MountId => "mount ID",
            Field::ParentId => "parent ID",
            Field::Device => "major:minor",
            Field::Root => "root",
            Field::MountPoint => "mount point",
            Field::MountOptions => "mount options",
            // The only optional fields that can be wrong are the peer-group
            // numbers; unknown tags are ignored.
            Field::OptionalFields => "peer group",
            Field::Separator => "separator",
            Field::FsType => "fs type",
            Field::Source => "source",
            Field::SuperOptions => "super options",
        })
    }
}

/// A malformed mountinfo line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("mountinfo line {line}, column {column}: field `{field}`: {kind}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// 1-based byte column in the line where the field starts (one past the
    /// line's last byte for a missing field; the newline's for a newline
    /// inside a line).
    pub column: usize,
    pub field: Field,
    pub kind: ParseErrorKind,
}

/// What was wrong with a field. The texts quote the field as printed, cut to
/// [`QUOTE_LIMIT`] bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseErrorKind {
    /// The line ends before this field (a truncated line, or an empty one).
    Missing,
    InvalidNumber(String),
    InvalidDevice(String),
    /// A backslash not followed by three octal digits (`\000`–`\377`).
    InvalidEscape(String),
    /// `\000`: a NUL byte, which no path or name can hold.
    EscapedNul(String),
    /// A mount point that does not start with `/`.
    RelativePath(String),
    /// The line ends in `\r` (a CRLF line end).
    CarriageReturn,
    NotUtf8(String),
    /// `parse_line` was given more than one line.
    EmbeddedNewline,
}

/// How much of a bad field an error quotes.
pub const QUOTE_LIMIT: usize = 80;

impl fmt::Display for ParseErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseErrorKind::Missing => f.write_str("missing, the line ends before it"),
            ParseErrorKind::InvalidNumber(text) => write!(f, "invalid number in `{text}`"),
            ParseErrorKind::InvalidDevice(text) => {
                write!(f, "invalid device `{text}`, expected major:minor")
            }
            ParseErrorKind::InvalidEscape(text) => {
                write!(f, "invalid escape in `{text}`, expected a backslash and three octal digits")
            }
            ParseErrorKind::EscapedNul(text) => write!(f, "escaped NUL byte (`\\000`) in `{text}`"),
            ParseErrorKind::RelativePath(text) => {
                write!(f, "relative path `{text}`, the kernel prints mount points from `/`")
            }
            ParseErrorKind::CarriageReturn => {
                f.write_str("the line ends in a carriage return (CRLF); the kernel ends lines with a newline alone")
            }
            ParseErrorKind::NotUtf8(text) => write!(f, "not UTF-8: `{text}`"),
            ParseErrorKind::EmbeddedNewline => f.write_str("newline inside the line"),
        }
    }
}

pub(super) fn quote(text: &[u8]) -> String {
    String::from_utf8_lossy(&text[..text.len().min(QUOTE_LIMIT)]).into_owned()
}
