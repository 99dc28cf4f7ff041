//! Byte search within one line. Most fields are short (a few to a few dozen
//! bytes), where a call into `memchr` costs more than it saves: the first
//! bytes are searched a word at a time here (SWAR, in safe code), and only a
//! longer field goes on with `memchr`'s vectorised search.

const LOW_SEVEN: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;
const ONES: u64 = 0x0101_0101_0101_0101;

/// How many bytes are searched a word at a time before `memchr` takes over.
const SHORT: usize = 8;

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

/// Index of the first space in `haystack`.
#[inline(always)]
pub(super) fn find_space(haystack: &[u8]) -> Option<usize> {
    find(haystack, |word| marks(word, b' '), |byte| byte == b' ', |rest| memchr::memchr(b' ', rest))
}

/// Index of the first space or backslash in `haystack`.
#[inline(always)]
pub(super) fn find_space_or_backslash(haystack: &[u8]) -> Option<usize> {
    find(
        haystack,
        |word| marks(word, b' ') | marks(word, b'\\'),
        |byte| byte == b' ' || byte == b'\\',
        |rest| memchr::memchr2(b' ', b'\\', rest),
    )
}

#[inline(always)]
fn find(
    haystack: &[u8],
    word_marks: impl Fn(u64) -> u64,
    matches: impl Fn(u8) -> bool,
    long: impl Fn(&[u8]) -> Option<usize>,
) -> Option<usize> {
    let mut at = 0;
    while at < SHORT {
        let Some(chunk) = haystack.get(at..).and_then(|rest| rest.first_chunk::<8>()) else {
            // Fewer than eight bytes left.
            return haystack.get(at..)?.iter().position(|&byte| matches(byte)).map(|found| at + found);
        };
        let found = word_marks(u64::from_le_bytes(*chunk));
        if found != 0 {
            return Some(at + first_mark(found));
        }
        at += 8;
    }
    long(haystack.get(at..)?).map(|found| at + found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_like_a_byte_loop() {
        let text: Vec<u8> = (0..300u32)
            .map(|i| {
                [b'a', b' ', b'\\', b'\n', 0x80, 0xff, 0x01, 0x21, b'a', b'b', b'c', b'd', b'e', b'f', b'g']
                    [(i.wrapping_mul(2_654_435_761) >> 13) as usize % 15]
            })
            .collect();
        for from in 0..text.len() + 1 {
            for to in [from, from + 1, from + 7, from + 8, from + 9, from + 30, text.len()] {
                let hay = &text[from..to.min(text.len())];
                assert_eq!(find_space(hay), hay.iter().position(|&b| b == b' '), "{from}..{to}");
                assert_eq!(find_space_or_backslash(hay), hay.iter().position(|&b| b == b' ' || b == b'\\'));
            }
        }
        let long = [vec![b'x'; 100], vec![b'\\'], vec![b'y'; 10], vec![b' ']].concat();
        assert_eq!(find_space_or_backslash(&long), Some(100));
        assert_eq!(find_space(&long), Some(111));
        assert_eq!(find_space(&long[..111]), None);
    }
}
