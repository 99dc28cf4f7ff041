//! A token bucket per key, shaped like client-go's event spam filter: a
//! burst of [`BURST`] writes, then one every [`REFILL_EVERY`].
//!
//! Each key keeps one instant, the time its bucket will be full again (the
//! "theoretical arrival time" of the generic cell rate algorithm): a write is
//! allowed while that lies less than `BURST - 1` refills ahead, and each
//! allowed write pushes it one refill further. That is a token bucket with
//! integer arithmetic and one `Instant` per key; a key whose bucket is full
//! again holds nothing a fresh key would not, so it can be forgotten.
use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Writes allowed at once per key (client-go: `defaultSpamBurst`).
pub const BURST: u32 = 25;
/// One more write per key is allowed after each such interval (client-go:
/// `defaultSpamQPS` = 1/300).
pub const REFILL_EVERY: Duration = Duration::from_secs(300);
/// Keys kept before full buckets are swept out.
const SWEEP_ABOVE: usize = 1024;

/// Token buckets by key.
#[derive(Debug)]
pub struct Limiter<K> {
    burst: u32,
    refill: Duration,
    /// When each key's bucket is full again.
    full_at: HashMap<K, Instant>,
    sweep_at: usize,
}

impl<K: Hash + Eq> Default for Limiter<K> {
    fn default() -> Self {
        Self::new(BURST, REFILL_EVERY)
    }
}

impl<K: Hash + Eq> Limiter<K> {
    /// `burst` must be at least 1.
    pub fn new(burst: u32, refill: Duration) -> Self {
        Limiter { burst: burst.max(1), refill, full_at: HashMap::new(), sweep_at: SWEEP_ABOVE }
    }

    /// Takes a token of `key`'s bucket at `now`; false when it is empty.
    pub fn allow(&mut self, key: K, now: Instant) -> bool {
        if self.full_at.len() >= self.sweep_at {
            self.full_at.retain(|_, full_at| *full_at > now);
            self.sweep_at = (self.full_at.len() * 2).max(SWEEP_ABOVE);
        }
        let full_at = self.full_at.entry(key).or_insert(now);
        let start = (*full_at).max(now);
        // `burst - 1` refills ahead is the last token; one more is empty.
        if start.duration_since(now) > self.refill * (self.burst - 1) {
            return false;
        }
        *full_at = start + self.refill;
        true
    }

    /// Keys with a bucket that is not full (for tests and sizing).
    pub fn tracked(&self) -> usize {
        self.full_at.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn a_burst_of_25_then_one_per_five_minutes() {
        let mut limiter = Limiter::default();
        let t0 = Instant::now();
        let allowed = (0..40).filter(|_| limiter.allow("pod/FuseMountBroken", t0)).count();
        assert_eq!(allowed, 25);
        // Just under one refill: still empty.
        assert!(!limiter.allow("pod/FuseMountBroken", t0 + REFILL_EVERY - Duration::from_secs(1)));
        // One refill: exactly one token.
        assert!(limiter.allow("pod/FuseMountBroken", t0 + REFILL_EVERY));
        assert!(!limiter.allow("pod/FuseMountBroken", t0 + REFILL_EVERY));
        // Ten more minutes: two more, not three.
        let later = t0 + REFILL_EVERY + 10 * MINUTE;
        assert_eq!((0..5).filter(|_| limiter.allow("pod/FuseMountBroken", later)).count(), 2);
    }

    #[test]
    fn keys_have_buckets_of_their_own() {
        let mut limiter = Limiter::default();
        let t0 = Instant::now();
        for _ in 0..25 {
            assert!(limiter.allow(("a", "FuseMountBroken"), t0));
        }
        assert!(!limiter.allow(("a", "FuseMountBroken"), t0));
        assert!(limiter.allow(("a", "FuseMountHealed"), t0));
        assert!(limiter.allow(("b", "FuseMountBroken"), t0));
    }

    #[test]
    fn an_idle_key_refills_to_the_burst_and_no_further() {
        let mut limiter = Limiter::default();
        let t0 = Instant::now();
        for _ in 0..25 {
            assert!(limiter.allow("k", t0));
        }
        // 25 refills restore the whole burst; a day more adds nothing.
        let later = t0 + REFILL_EVERY * 25 + 24 * 60 * MINUTE;
        assert_eq!((0..30).filter(|_| limiter.allow("k", later)).count(), 25);
    }

    #[test]
    fn spaced_writes_never_run_out() {
        let mut limiter = Limiter::default();
        let t0 = Instant::now();
        for n in 0..100u32 {
            assert!(limiter.allow("k", t0 + REFILL_EVERY * n), "write {n}");
        }
    }

    #[test]
    fn full_buckets_are_forgotten_when_many_keys_pile_up() {
        let mut limiter = Limiter::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        for key in 0..SWEEP_ABOVE {
            assert!(limiter.allow(key, t0));
        }
        assert_eq!(limiter.tracked(), SWEEP_ABOVE);
        // All of them are full again by then: the next key sweeps them out.
        assert!(limiter.allow(SWEEP_ABOVE, t0 + Duration::from_secs(10)));
        assert_eq!(limiter.tracked(), 1);
        // Forgetting a full bucket changes nothing: key 0 has its burst.
        let later = t0 + Duration::from_secs(10);
        assert!(limiter.allow(0, later) && limiter.allow(0, later) && !limiter.allow(0, later));
    }
}
