//! Fields the kernel prints with octal escapes.

use std::borrow::Cow;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

/// A field as the kernel printed it (borrowed); unescaped on demand, without
/// allocating when there is no escape.
///
/// The kernel writes a space, tab, newline or backslash in a path or source as
/// a backslash and three octal digits (`\040`, `\011`, `\012`, `\134`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Escaped<'a> {
    // Only the bytes: a flag for "has escapes" would make every parsed
    // mount 24 bytes bigger, and the copies cost more than the look-up in
    // `unescaped` for the few mounts whose path is wanted.
    raw: &'a [u8],
}

impl<'a> Escaped<'a> {
    /// Wraps text as the kernel prints it (for tests and fakes; the parser
    /// builds these itself).
    pub fn new(raw: &'a [u8]) -> Self {
        Escaped { raw }
    }

    /// The bytes as printed, escapes included.
    pub fn raw(&self) -> &'a [u8] {
        self.raw
    }

    /// Whether the field contains an escape (and `unescaped` would allocate).
    pub fn has_escapes(&self) -> bool {
        self.raw.contains(&b'\\')
    }

    /// The field with escapes decoded; borrowed when there is none. A
    /// backslash not followed by three octal digits is kept as is (the parser
    /// rejects those, so only `Escaped::new` can bring one here).
    pub fn unescaped(&self) -> Cow<'a, [u8]> {
        if !self.has_escapes() {
            return Cow::Borrowed(self.raw);
        }
        let mut decoded = Vec::with_capacity(self.raw.len());
        let mut rest = self.raw;
        while let Some((&byte, tail)) = rest.split_first() {
            match (byte, decode_escape(tail)) {
                (b'\\', Some(value)) => {
                    decoded.push(value);
                    rest = &tail[3..];
                }
                _ => {
                    decoded.push(byte);
                    rest = tail;
                }
            }
        }
        Cow::Owned(decoded)
    }

    /// The field as a path, unescaped; borrowed when there is no escape.
    pub fn to_path(&self) -> Cow<'a, Path> {
        match self.unescaped() {
            Cow::Borrowed(bytes) => Cow::Borrowed(Path::new(OsStr::from_bytes(bytes))),
            Cow::Owned(bytes) => Cow::Owned(PathBuf::from(OsString::from_vec(bytes))),
        }
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Escaped").field(&String::from_utf8_lossy(self.raw)).finish()
    }
}

/// The byte of an escape's three octal digits (what follows the backslash),
/// or `None` if `digits` does not start with a valid one (`\000` to `\377`).
pub(super) fn decode_escape(digits: &[u8]) -> Option<u8> {
    let [high @ b'0'..=b'3', middle @ b'0'..=b'7', low @ b'0'..=b'7', ..] = *digits else {
        return None;
    };
    Some((high - b'0') << 6 | (middle - b'0') << 3 | (low - b'0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_four_escapes_the_kernel_writes() {
        let field = Escaped::new(br"/a\040b\011c\012d\134e");
        assert_eq!(&*field.unescaped(), b"/a b\tc\nd\\e");
        assert_eq!(field.to_path(), Path::new("/a b\tc\nd\\e"));
    }

    #[test]
    fn borrows_without_escapes() {
        let field = Escaped::new(b"/var/lib/kubelet");
        assert!(matches!(field.unescaped(), Cow::Borrowed(_)));
        assert!(matches!(field.to_path(), Cow::Borrowed(_)));
    }

    #[test]
    fn keeps_an_invalid_escape_literally() {
        assert_eq!(&*Escaped::new(br"/a\09\").unescaped(), br"/a\09\");
        assert_eq!(decode_escape(b"400"), None);
        assert_eq!(decode_escape(b"377"), Some(0xff));
    }
}
