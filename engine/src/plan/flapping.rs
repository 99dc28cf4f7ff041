//! A daemon that keeps crashing: each restart is healed quietly, so the
//! heals of each source are counted over a sliding window and a source
//! healed more than a limit within it is said to be flapping, once per
//! window, so that operators see a crash loop rather than a stream of heals.
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::model::table::Dev;

/// `--flapping-heals` and `--flapping-window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlappingPolicy {
    /// More heals than this within `window` is flapping.
    pub heals: u32,
    pub window: Duration,
}

impl Default for FlappingPolicy {
    fn default() -> Self {
        FlappingPolicy { heals: 5, window: Duration::from_secs(600) }
    }
}

/// The heals of each source within the window.
#[derive(Debug, Default)]
pub struct Flapping {
    policy: FlappingPolicy,
    sources: HashMap<PathBuf, SourceHeals>,
}

#[derive(Debug, Default)]
struct SourceHeals {
    /// The connection last counted: the targets of one restart are healed
    /// one by one, or in several batches, and count once.
    last: Option<Dev>,
    at: VecDeque<Instant>,
    said_at: Option<Instant>,
}

impl Flapping {
    pub fn new(policy: FlappingPolicy) -> Self {
        Flapping { policy, sources: HashMap::new() }
    }

    /// A heal of targets of `source` onto its connection `dev` at `now`.
    /// Returns the heals within the window when they make the source
    /// flapping and that was not said within the last window.
    pub fn healed(&mut self, source: &Path, dev: Dev, now: Instant) -> Option<usize> {
        let window = self.policy.window;
        let heals = self.sources.entry(source.to_path_buf()).or_default();
        if heals.last == Some(dev) {
            return None;
        }
        heals.last = Some(dev);
        heals.at.push_back(now);
        while heals.at.front().is_some_and(|first| now.saturating_duration_since(*first) > window) {
            heals.at.pop_front();
        }
        let flapping = heals.at.len() > self.policy.heals as usize;
        let said_lately = heals.said_at.is_some_and(|said| now.saturating_duration_since(said) < window);
        if !flapping || said_lately {
            return None;
        }
        heals.said_at = Some(now);
        Some(heals.at.len())
    }

    /// Forgets the sources `keep` rejects (unmounted for good).
    pub fn retain(&mut self, mut keep: impl FnMut(&Path) -> bool) {
        self.sources.retain(|source, _| keep(source));
    }

    pub fn policy(&self) -> FlappingPolicy {
        self.policy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "/var/lib/juicefs/volume/pvc-1";

    fn dev(minor: u32) -> Dev {
        Dev { major: 0, minor }
    }

    #[test]
    fn more_heals_than_the_limit_within_the_window_is_said_once() {
        let mut flapping = Flapping::new(FlappingPolicy { heals: 3, window: Duration::from_secs(60) });
        let start = Instant::now();
        let source = Path::new(SOURCE);
        for minor in 1..=3 {
            assert_eq!(flapping.healed(source, dev(minor), start + Duration::from_secs(u64::from(minor))), None);
        }
        assert_eq!(flapping.healed(source, dev(4), start + Duration::from_secs(4)), Some(4));
        assert_eq!(flapping.healed(source, dev(5), start + Duration::from_secs(5)), None, "said once per window");
        // A window later, still crashing: said again.
        let later = start + Duration::from_secs(70);
        for minor in 6..=9 {
            let said = flapping.healed(source, dev(minor), later + Duration::from_secs(u64::from(minor)));
            assert_eq!(said, (minor == 9).then_some(4), "heal {minor}");
        }
    }

    #[test]
    fn the_targets_of_one_restart_count_once_and_old_heals_leave_the_window() {
        let mut flapping = Flapping::new(FlappingPolicy { heals: 1, window: Duration::from_secs(10) });
        let start = Instant::now();
        let source = Path::new(SOURCE);
        assert_eq!(flapping.healed(source, dev(1), start), None);
        assert_eq!(flapping.healed(source, dev(1), start), None, "another target of the same restart");
        assert_eq!(flapping.healed(source, dev(2), start + Duration::from_secs(11)), None, "the first left the window");
        assert_eq!(flapping.healed(source, dev(3), start + Duration::from_secs(12)), Some(2));
        assert_eq!(flapping.healed(Path::new("/other"), dev(4), start), None, "counted per source");
    }
}
