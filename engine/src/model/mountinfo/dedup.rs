//! One line per mount: a non-atomic read of a large table can list a mount
//! twice (the kernel's position moved while the table changed); the last
//! line is the newer one.

use std::collections::HashSet;

/// IDs below this go in a bitmap (at most 2 MiB); the kernel allocates the
/// lowest free ID, so real ones are small. Larger ones go in a set.
const BITMAP_ID_LIMIT: u32 = 1 << 24;

/// The mount IDs seen so far in a table, in one pass.
#[derive(Debug, Default)]
pub(super) struct SeenIds {
    bits: Vec<u64>,
    large: HashSet<u32>,
    distinct: usize,
    repeated: bool,
}

impl SeenIds {
    /// Notes `id`; returns whether it is the first time.
    #[inline]
    pub(super) fn insert(&mut self, id: u32) -> bool {
        let first = if id < BITMAP_ID_LIMIT {
            let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
            if word >= self.bits.len() {
                // Grown in steps, not to the exact word: IDs mostly rise.
                self.bits.resize((word + 1).next_power_of_two().max(64), 0);
            }
            let first = self.bits[word] & bit == 0;
            self.bits[word] |= bit;
            first
        } else {
            self.large.insert(id)
        };
        self.distinct += usize::from(first);
        self.repeated |= !first;
        first
    }

    /// Some ID was seen twice.
    pub(super) fn repeated(&self) -> bool {
        self.repeated
    }

    /// How many different IDs were seen.
    pub(super) fn distinct(&self) -> usize {
        self.distinct
    }
}

/// For each line of a table whose mount IDs are `ids` (in table order),
/// whether it is the last line of its ID: the one to keep.
pub(super) fn last_of_each_id(ids: &[u32]) -> Vec<bool> {
    let mut seen = SeenIds::default();
    let mut keep: Vec<bool> = ids.iter().rev().map(|&id| seen.insert(id)).collect();
    keep.reverse();
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_flags_repeats_small_and_large() {
        let mut seen = SeenIds::default();
        for id in [5, 700, 4_000_000_000, 5] {
            seen.insert(id);
        }
        assert!(seen.repeated());
        assert_eq!(seen.distinct(), 3);
        assert!(!seen.insert(4_000_000_000));
        assert!(seen.insert(4_000_000_001));
    }

    #[test]
    fn keeps_the_last_line_of_each_id() {
        assert_eq!(
            last_of_each_id(&[1, 2, 1, 3, 2, 4_000_000_000, 4_000_000_000]),
            [false, false, true, true, true, false, true]
        );
        assert!(last_of_each_id(&[]).is_empty());
    }
}
