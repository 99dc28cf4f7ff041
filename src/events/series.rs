//! Which API writes occurrences become: the limiter decides whether an
//! occurrence is written now, and repeats of an event are folded into the
//! events.k8s.io series of the Event already written.
//!
//! Shaped like client-go's `tools/events` broadcaster: events are the same
//! when their regarding object and reason (hence action) are, whatever the
//! note says (the note of an Event cannot change after creation); a series
//! stays open while repeats come within [`SERIES_WINDOW`] of each other,
//! and its final count is written when it closes. Unlike client-go, every
//! repeat the limiter allows is written at once (its count and
//! `lastObservedTime`), and repeats it refuses are still counted, so the
//! next write (or the one when the series closes) carries the true count.
//! Pure: the caller passes the time and carries the writes out.
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;

use super::limiter::Limiter;
use super::occurrence::{Occurrence, PodRef, Reason, Regarding};

/// A repeat later than this after the last one starts a new Event
/// (client-go: `finishTime`).
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// The events' `reportingController`.
pub const CONTROLLER: &str = "fuse-supervisor";
/// API limits of events.k8s.io/v1 (apiserver validation).
const NOTE_LIMIT: usize = 1024;
const INSTANCE_LIMIT: usize = 128;
const NAME_LIMIT: usize = 253;

/// Events are the same when their regarding pod (by UID) and reason are.
pub type SeriesKey = (String, Reason);

/// One API write.
#[derive(Clone, Debug, PartialEq)]
pub enum Write {
    /// POST a new Event.
    Create { key: SeriesKey, event: Box<Event> },
    /// PATCH an Event's series.
    Patch { key: SeriesKey, namespace: String, name: String, series: EventSeries },
}

/// What became of one occurrence.
#[derive(Clone, Debug, PartialEq)]
pub enum Observed {
    Write(Write),
    /// Refused by the limiter, counted into the open series.
    Folded,
    /// Refused by the limiter, with no series to count it in.
    Limited,
    /// The regarding pod could not be resolved to a name.
    Unresolved,
}

#[derive(Debug)]
struct Series {
    /// The Event as created (name, namespace, note): recreated from this
    /// if it disappeared (events expire, an hour by default).
    event: Event,
    /// Occurrences so far, the first included.
    count: i32,
    /// The count the last write carried.
    written: i32,
    last_seen: Instant,
    last_observed: SystemTime,
}

/// Limiter and open series, keyed by (pod UID, reason).
#[derive(Debug)]
pub struct Correlator {
    instance: String,
    limiter: Limiter<SeriesKey>,
    open: HashMap<SeriesKey, Series>,
    /// No series closes before this; may be early, never late.
    next_due: Option<Instant>,
    /// Nanosecond stamp of the last Event name given out.
    last_stamp: u64,
}

impl Correlator {
    /// `instance` is the events' `reportingInstance` (`fuse-supervisor-<node>`).
    pub fn new(instance: &str, limiter: Limiter<SeriesKey>) -> Self {
        Correlator {
            instance: truncate(instance, INSTANCE_LIMIT).to_owned(),
            limiter,
            open: HashMap::new(),
            next_due: None,
            last_stamp: 0,
        }
    }

    /// Whether this occurrence's event has a series open, so it needs no
    /// pod name to be written.
    pub fn is_open(&self, occurrence: &Occurrence) -> bool {
        self.open.contains_key(&(occurrence.regarding.uid().to_owned(), occurrence.reason))
    }

    /// When the next series may close: call [`Correlator::due`] then.
    pub fn next_due(&self) -> Option<Instant> {
        self.next_due
    }

    /// Takes one occurrence at `now`. Call [`Correlator::due`] with the
    /// same `now` first, so a series that closed writes its count before
    /// the same event starts a new one.
    pub fn observe(
        &mut self,
        occurrence: Occurrence,
        now: Instant,
        resolve: impl FnOnce(&str) -> Option<PodRef>,
    ) -> Observed {
        let key = (occurrence.regarding.uid().to_owned(), occurrence.reason);
        if let Some(series) = self.open.get(&key)
            && now.saturating_duration_since(series.last_seen) >= SERIES_WINDOW
        {
            self.open.remove(&key);
        }
        if let Some(series) = self.open.get_mut(&key) {
            series.count = series.count.saturating_add(1);
            series.last_seen = now;
            series.last_observed = occurrence.at;
            if !self.limiter.allow(key.clone(), now) {
                return Observed::Folded;
            }
            series.written = series.count;
            let (namespace, name) = names(&series.event);
            let series = event_series(series.count, series.last_observed);
            return Observed::Write(Write::Patch { key, namespace, name, series });
        }
        // Resolved before the limiter, so an unknown pod takes no token.
        let pod = match occurrence.regarding {
            Regarding::Pod(pod) => pod,
            Regarding::Uid(ref uid) => match resolve(uid) {
                Some(pod) => pod,
                None => return Observed::Unresolved,
            },
        };
        if !self.limiter.allow(key.clone(), now) {
            return Observed::Limited;
        }
        let event = self.event(&pod, occurrence.reason, &occurrence.note, occurrence.at);
        self.open.insert(
            key.clone(),
            Series { event: event.clone(), count: 1, written: 1, last_seen: now, last_observed: occurrence.at },
        );
        let due = now + SERIES_WINDOW;
        self.next_due = Some(self.next_due.map_or(due, |next| next.min(due)));
        Observed::Write(Write::Create { key, event: Box::new(event) })
    }

    /// Closes the series with no repeat for [`SERIES_WINDOW`]; returns the
    /// final counts not yet written.
    pub fn due(&mut self, now: Instant) -> Vec<Write> {
        if self.next_due.is_none_or(|next| next > now) {
            return Vec::new();
        }
        let mut writes = Vec::new();
        self.open.retain(|key, series| {
            if now.saturating_duration_since(series.last_seen) < SERIES_WINDOW {
                return true;
            }
            if series.count > series.written {
                let (namespace, name) = names(&series.event);
                let final_count = event_series(series.count, series.last_observed);
                writes.push(Write::Patch { key: key.clone(), namespace, name, series: final_count });
            }
            false
        });
        self.next_due = self.open.values().map(|series| series.last_seen + SERIES_WINDOW).min();
        writes
    }

    /// Closes every series (at shutdown); returns the counts not yet written.
    pub fn close_all(&mut self) -> Vec<Write> {
        self.next_due = None;
        self.open
            .drain()
            .filter(|(_, series)| series.count > series.written)
            .map(|(key, series)| {
                let (namespace, name) = names(&series.event);
                Write::Patch { key, namespace, name, series: event_series(series.count, series.last_observed) }
            })
            .collect()
    }

    /// A create failed: the next occurrence starts afresh.
    pub fn forget(&mut self, key: &SeriesKey) {
        self.open.remove(key);
    }

    /// A series patch found no Event (it expired or was deleted): the Event
    /// again, under a new name, with the series so far.
    pub fn recreate(&mut self, key: &SeriesKey) -> Option<Write> {
        let stamp = self.stamp(SystemTime::now());
        let series = self.open.get_mut(key)?;
        let pod = series.event.regarding.as_ref().and_then(|pod| pod.name.as_deref()).unwrap_or("pod");
        series.event.metadata.name = Some(event_name(pod, stamp));
        let mut event = series.event.clone();
        event.series = Some(event_series(series.count, series.last_observed));
        series.written = series.count;
        Some(Write::Create { key: key.clone(), event: Box::new(event) })
    }

    /// Open series (for tests and sizing).
    pub fn open_series(&self) -> usize {
        self.open.len()
    }

    fn event(&mut self, pod: &PodRef, reason: Reason, note: &str, at: SystemTime) -> Event {
        let stamp = self.stamp(at);
        Event {
            metadata: ObjectMeta {
                name: Some(event_name(&pod.name, stamp)),
                namespace: Some(pod.namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(micro_time(at)),
            reporting_controller: Some(CONTROLLER.to_owned()),
            reporting_instance: Some(self.instance.clone()),
            action: Some(reason.action().to_owned()),
            reason: Some(reason.as_str().to_owned()),
            regarding: Some(ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                namespace: Some(pod.namespace.clone()),
                name: Some(pod.name.clone()),
                uid: Some(pod.uid.clone()),
                ..ObjectReference::default()
            }),
            note: Some(truncate(note, NOTE_LIMIT).to_owned()),
            type_: Some(reason.event_type().to_owned()),
            ..Event::default()
        }
    }

    /// Nanoseconds since the epoch, unique among this correlator's names.
    fn stamp(&mut self, at: SystemTime) -> u64 {
        let nanos = at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.as_nanos() as u64);
        self.last_stamp = nanos.max(self.last_stamp + 1);
        self.last_stamp
    }
}

/// `<pod>.<hex nanoseconds>`, like client-go's event names.
fn event_name(pod: &str, stamp: u64) -> String {
    let suffix = format!(".{stamp:x}");
    let pod = truncate(pod, NAME_LIMIT - suffix.len()).trim_end_matches(['-', '.']);
    format!("{pod}{suffix}")
}

fn names(event: &Event) -> (String, String) {
    (event.metadata.namespace.clone().unwrap_or_default(), event.metadata.name.clone().unwrap_or_default())
}

fn event_series(count: i32, last_observed: SystemTime) -> EventSeries {
    EventSeries { count, last_observed_time: micro_time(last_observed) }
}

fn micro_time(at: SystemTime) -> MicroTime {
    // Out of jiff's range only for times thousands of years away.
    MicroTime(Timestamp::try_from(at).unwrap_or_else(|_| Timestamp::now()))
}

/// At most `limit` bytes, cut at a character boundary.
fn truncate(text: &str, limit: usize) -> &str {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::super::limiter::{BURST, REFILL_EVERY};
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn pod(uid: &str) -> PodRef {
        PodRef { namespace: "apps".into(), name: format!("web-{uid}"), uid: uid.into() }
    }

    fn occurrence(uid: &str, reason: Reason, note: &str) -> Occurrence {
        Occurrence { reason, regarding: Regarding::Uid(uid.into()), note: note.into(), at: SystemTime::now() }
    }

    fn correlator() -> Correlator {
        Correlator::new("fuse-supervisor-node-1", Limiter::default())
    }

    fn observe(correlator: &mut Correlator, uid: &str, reason: Reason, now: Instant) -> Observed {
        correlator.observe(occurrence(uid, reason, "note"), now, |uid| Some(pod(uid)))
    }

    fn patch_count(observed: &Observed) -> i32 {
        match observed {
            Observed::Write(Write::Patch { series, .. }) => series.count,
            other => panic!("expected a series patch, got {other:?}"),
        }
    }

    #[test]
    fn the_first_occurrence_creates_an_event_about_the_pod() {
        let mut correlator = correlator();
        let observed = observe(&mut correlator, "u1", Reason::MountBroken, Instant::now());
        let Observed::Write(Write::Create { key, event }) = observed else { panic!("{observed:?}") };
        assert_eq!(key, ("u1".to_owned(), Reason::MountBroken));
        assert_eq!(event.metadata.namespace.as_deref(), Some("apps"));
        assert!(event.metadata.name.as_deref().unwrap().starts_with("web-u1."));
        let regarding = event.regarding.as_ref().unwrap();
        assert_eq!(
            (regarding.kind.as_deref(), regarding.name.as_deref(), regarding.uid.as_deref()),
            (Some("Pod"), Some("web-u1"), Some("u1"))
        );
        assert_eq!(event.reason.as_deref(), Some("FuseMountBroken"));
        assert_eq!(event.action.as_deref(), Some("Detect"));
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.reporting_controller.as_deref(), Some("fuse-supervisor"));
        assert_eq!(event.reporting_instance.as_deref(), Some("fuse-supervisor-node-1"));
        assert!(event.series.is_none() && event.event_time.is_some());
    }

    #[test]
    fn repeats_patch_the_series_with_the_running_count() {
        let mut correlator = correlator();
        let t0 = Instant::now();
        let Observed::Write(Write::Create { event, .. }) = observe(&mut correlator, "u1", Reason::MountHealed, t0)
        else {
            panic!("first occurrence not created")
        };
        for (n, expected) in (1..4).zip(2..) {
            let observed = observe(&mut correlator, "u1", Reason::MountHealed, t0 + MINUTE * n);
            assert_eq!(patch_count(&observed), expected);
            let Observed::Write(Write::Patch { name, namespace, .. }) = observed else { unreachable!() };
            assert_eq!(Some(name), event.metadata.name.clone());
            assert_eq!(namespace, "apps");
        }
        // Another reason on the same pod is another event.
        assert!(matches!(
            observe(&mut correlator, "u1", Reason::MountBroken, t0 + MINUTE * 4),
            Observed::Write(Write::Create { .. })
        ));
    }

    #[test]
    fn refused_repeats_are_counted_and_written_when_the_series_closes() {
        let mut correlator = correlator();
        let t0 = Instant::now();
        // A crash loop: one occurrence every 10 s for five minutes.
        let mut writes = 0;
        let mut folded = 0;
        for n in 0..=30 {
            match observe(&mut correlator, "u1", Reason::MountBroken, t0 + Duration::from_secs(10 * n)) {
                Observed::Write(_) => writes += 1,
                Observed::Folded => folded += 1,
                other => panic!("{other:?}"),
            }
        }
        // 25 writes (1 create, 24 patches), then the refill: one more at 300 s.
        assert_eq!((writes, folded), (BURST + 1, 31 - BURST - 1));
        // One more, folded: only the final count carries it.
        assert!(matches!(
            observe(&mut correlator, "u1", Reason::MountBroken, t0 + Duration::from_secs(310)),
            Observed::Folded
        ));
        let last = t0 + Duration::from_secs(310);
        assert!(correlator.due(last + SERIES_WINDOW - Duration::from_secs(1)).is_empty());
        let closed = correlator.due(last + SERIES_WINDOW);
        assert_eq!(closed.len(), 1);
        assert_eq!(patch_count(&Observed::Write(closed[0].clone())), 32);
        assert_eq!((correlator.open_series(), correlator.next_due()), (0, None));
    }

    #[test]
    fn a_series_written_in_full_closes_without_a_write() {
        let mut correlator = correlator();
        let t0 = Instant::now();
        observe(&mut correlator, "u1", Reason::MountBroken, t0);
        observe(&mut correlator, "u1", Reason::MountBroken, t0 + MINUTE);
        assert!(correlator.due(t0 + MINUTE + SERIES_WINDOW).is_empty());
        assert_eq!(correlator.open_series(), 0);
    }

    #[test]
    fn a_repeat_after_the_window_starts_a_new_event() {
        let mut correlator = correlator();
        let t0 = Instant::now();
        observe(&mut correlator, "u1", Reason::MountBroken, t0);
        let later = t0 + SERIES_WINDOW;
        assert!(correlator.due(later).is_empty());
        assert!(matches!(
            observe(&mut correlator, "u1", Reason::MountBroken, later),
            Observed::Write(Write::Create { .. })
        ));
    }

    #[test]
    fn an_event_the_limiter_refuses_without_a_series_is_dropped() {
        // One token an hour: the series closes after six minutes, and the
        // next occurrence finds neither a series nor a token.
        let mut correlator = Correlator::new("i", Limiter::new(1, Duration::from_secs(3600)));
        let t0 = Instant::now();
        observe(&mut correlator, "u1", Reason::MountBroken, t0);
        let closed = t0 + SERIES_WINDOW + MINUTE;
        assert!(correlator.due(closed).is_empty());
        assert_eq!(observe(&mut correlator, "u1", Reason::MountBroken, closed), Observed::Limited);
    }

    #[test]
    fn an_unresolved_pod_takes_no_token() {
        let mut correlator = Correlator::new("i", Limiter::new(1, REFILL_EVERY));
        let t0 = Instant::now();
        let unknown = correlator.observe(occurrence("u1", Reason::MountBroken, "n"), t0, |_| None);
        assert_eq!(unknown, Observed::Unresolved);
        assert!(matches!(observe(&mut correlator, "u1", Reason::MountBroken, t0), Observed::Write(_)));
    }

    #[test]
    fn a_vanished_event_is_recreated_with_its_series() {
        let mut correlator = correlator();
        let t0 = Instant::now();
        let Observed::Write(Write::Create { key, event: first }) =
            observe(&mut correlator, "u1", Reason::HealFailed, t0)
        else {
            panic!()
        };
        observe(&mut correlator, "u1", Reason::HealFailed, t0 + MINUTE);
        let Some(Write::Create { event, .. }) = correlator.recreate(&key) else { panic!() };
        assert_ne!(event.metadata.name, first.metadata.name);
        assert_eq!(event.series.as_ref().map(|series| series.count), Some(2));
        assert_eq!((event.note.clone(), event.regarding.clone()), (first.note.clone(), first.regarding.clone()));
        // Later repeats patch the new one.
        let Observed::Write(Write::Patch { name, .. }) =
            observe(&mut correlator, "u1", Reason::HealFailed, t0 + MINUTE * 2)
        else {
            panic!()
        };
        assert_eq!(Some(name), event.metadata.name);
    }

    #[test]
    fn close_all_writes_pending_counts() {
        let mut correlator = Correlator::new("i", Limiter::new(1, REFILL_EVERY));
        let t0 = Instant::now();
        for _ in 0..3 {
            observe(&mut correlator, "u1", Reason::MountBroken, t0);
        }
        observe(&mut correlator, "u2", Reason::MountBroken, t0);
        let writes = correlator.close_all();
        assert_eq!(writes.len(), 1);
        assert_eq!(patch_count(&Observed::Write(writes[0].clone())), 3);
    }

    #[test]
    fn names_and_notes_stay_within_api_limits() {
        let mut correlator = correlator();
        let long = PodRef { namespace: "ns".into(), name: "a".repeat(300), uid: "u".into() };
        let event = correlator.event(&long, Reason::MountBroken, &"é".repeat(600), SystemTime::now());
        assert!(event.metadata.name.unwrap().len() <= NAME_LIMIT);
        let note = event.note.unwrap();
        assert!(note.len() <= NOTE_LIMIT && note.chars().all(|c| c == 'é'));
        assert_eq!(event_name("pod-", 255), "pod.ff");
    }
}
