//! Byte search eight bytes at a time (SWAR), in safe code: `memchr` is not a
//! dependency, and a plain byte loop is several times slower on the long paths
//! of a kubelet node's table.

const LOW_SEVEN: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;
const ONES: u64 = 0x0101_0101_0101_0101;

/// The high bit of each byte of `word` that equals `byte`, exactly (no carry
/// crosses bytes).
#[inline(always)]
fn marks(word: u64, byte: u8) -> u64 {
    let diff = word ^ (ONES * u64::from(byte));
    // High bit of (low seven bits + 0x7f) | diff is set iff the byte is non-zero.
    !(((diff & LOW_SEVEN).wrapping_add(LOW_SEVEN)) | diff) & HIGH_BITS
}

#[inline(always)]
fn first_mark(marks: u64) -> usize {
    // Little-endian load: the lowest set bit is the earliest byte.
    (marks.trailing_zeros() / 8) as usize
}

/// Index of the first `needle` in `haystack` at or after `from`, or
/// `haystack.len()` when there is none.
#[inline]
pub(super) fn find_byte(haystack: &[u8], from: usize, needle: u8) -> usize {
    let mut at = from;
    while let Some(chunk) = haystack.get(at..).and_then(|rest| rest.first_chunk::<8>()) {
        let found = marks(u64::from_le_bytes(*chunk), needle);
        if found != 0 {
            return at + first_mark(found);
        }
        at += 8;
    }
    while at < haystack.len() {
        if haystack[at] == needle {
            return at;
        }
        at += 1;
    }
    haystack.len()
}

/// The high bit of each byte of `word` below `bound` (at most 0x80). Only the
/// lowest mark is exact: a borrow out of a marked byte can mark the next one.
#[inline(always)]
fn marks_below(word: u64, bound: u8) -> u64 {
    word.wrapping_sub(ONES * u64::from(bound)) & !word & HIGH_BITS
}

/// Index of the first control byte or space (`< 0x21`: the field separators
/// space and newline, and the rare unescaped control byte a caller skips) at
/// or after `from`, or `haystack.len()`. With `backslash`, a backslash stops
/// the search too.
#[inline]
pub(super) fn find_separator(haystack: &[u8], from: usize, backslash: bool) -> usize {
    let mut at = from;
    while let Some(chunk) = haystack.get(at..).and_then(|rest| rest.first_chunk::<8>()) {
        let word = u64::from_le_bytes(*chunk);
        let mut found = marks_below(word, 0x21);
        if backslash {
            found |= marks(word, b'\\');
        }
        if found != 0 {
            return at + first_mark(found);
        }
        at += 8;
    }
    while at < haystack.len() {
        let byte = haystack[at];
        if byte < 0x21 || (backslash && byte == b'\\') {
            return at;
        }
        at += 1;
    }
    haystack.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_like_a_byte_loop() {
        let text: Vec<u8> = (0..300u32)
            .map(|i| {
                [b'a', b' ', b'\\', b'\n', 0x80, 0xff, 0x01, 0x21, 0x20]
                    [(i.wrapping_mul(2_654_435_761) >> 13) as usize % 9]
            })
            .collect();
        for from in 0..text.len() + 1 {
            for needle in [b' ', b'\\', b'\n', 0x80, 0xff, b'z'] {
                let expected = text[from..].iter().position(|&b| b == needle).map_or(text.len(), |i| i + from);
                assert_eq!(find_byte(&text, from, needle), expected, "from {from} needle {needle}");
            }
        }
        for from in 0..text.len() + 1 {
            for backslash in [false, true] {
                let expected = text[from..]
                    .iter()
                    .position(|&b| b < 0x21 || (backslash && b == b'\\'))
                    .map_or(text.len(), |i| i + from);
                assert_eq!(find_separator(&text, from, backslash), expected);
            }
        }
    }
}
