//! What the demo prints: the timeline of each cycle, the summary, and the
//! supervisor's log lines it reads them from.
use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{DemoReport, HealKind, HealRecord};
use crate::scenario::Restart;

pub(super) fn describe_batch<'h>(heals: impl Iterator<Item = &'h HealRecord>) -> String {
    let heals: Vec<&HealRecord> = heals.collect();
    let names: Vec<String> = heals
        .iter()
        .map(|heal| match heal.kind {
            HealKind::Stacked => heal.pod.clone(),
            _ => format!("{} (by propagation)", heal.pod),
        })
        .collect();
    let removed: Vec<u64> = heals.iter().map(|heal| heal.layers_removed).collect();
    let removed = match removed.as_slice() {
        [] => String::new(),
        [only] => format!("{} removed", plural(*only, "stale layer")),
        [first, rest @ ..] if rest.iter().all(|n| n == first) => {
            format!("{} removed from each", plural(*first, "stale layer"))
        }
        _ => {
            let each: Vec<String> = heals.iter().map(|heal| format!("{} {}", heal.pod, heal.layers_removed)).collect();
            format!("stale layers removed: {}", each.join(", "))
        }
    };
    let latency =
        heals.iter().find_map(|heal| heal.latency).map_or_else(String::new, |l| format!("latency {}, ", millis(l)));
    format!("supervisor healed {}: {} ({latency}{removed})", plural(heals.len() as u64, "target"), names.join(", "))
}

pub(super) fn plural(count: u64, noun: &str) -> String {
    if count == 1 { format!("1 {noun}") } else { format!("{count} {noun}s") }
}

pub(super) fn style_name(style: Restart) -> &'static str {
    match style {
        Restart::UnmountThenMount => "unmount, then mount",
        Restart::MountOverStale => "mount over stale",
        Restart::InPlace => "in place",
    }
}

pub(super) fn millis(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

/// Timestamped lines of one phase, printed in time order relative to the kill.
pub(super) struct Timeline {
    pub(super) start: SystemTime,
    pub(super) events: Vec<(SystemTime, String)>,
}

impl Timeline {
    pub(super) fn new(start: SystemTime) -> Self {
        Timeline { start, events: Vec::new() }
    }

    pub(super) fn add(&mut self, at: SystemTime, text: String) {
        self.events.push((at, text));
    }

    /// The events so far, sorted, as text; and forgets them.
    pub(super) fn take(&mut self) -> String {
        // Stable: events logged at the same instant keep their order.
        self.events.sort_by_key(|(at, _)| *at);
        let mut text = String::new();
        for (at, line) in self.events.drain(..) {
            let offset = at.duration_since(self.start).unwrap_or_default();
            // Writing to a String cannot fail.
            let _ = writeln!(text, "   +{:.3}s  {line}", offset.as_secs_f64());
        }
        text.truncate(text.trim_end().len());
        text
    }
}

/// The final table.
pub(super) fn summary(report: &DemoReport) -> String {
    let pods: Vec<&str> =
        report.cycles.first().map_or_else(Vec::new, |c| c.pods.iter().map(|p| p.pod.as_str()).collect());
    let layer_names: Vec<&str> =
        report.cycles.first().map_or_else(Vec::new, |c| c.layers.iter().map(|(name, _)| name.as_str()).collect());
    let mut text = format!(
        "\n── summary ({}; outage: from the kill to the container's first correct read)\n{:<6} {:<20}",
        report.daemon.name(),
        "cycle",
        "restart"
    );
    for pod in &pods {
        let _ = write!(text, " {pod:>9}");
    }
    let _ = writeln!(text, " {:>13} {:>9}   FUSE layers ({})", "heal latency", "mounts", layer_names.join("/"));
    for cycle in &report.cycles {
        let _ = write!(text, "{:<6} {:<20}", cycle.number, style_name(cycle.style));
        for pod in &cycle.pods {
            let _ = write!(text, " {:>9}", millis(pod.outage));
        }
        // The batch latency of the supervisor's own heals; none when the kernel did it all.
        let latency = cycle.heals.iter().filter_map(|heal| heal.latency).max().map_or_else(|| "—".to_owned(), millis);
        let mounts = format!("{} → {}", cycle.mounts_before, cycle.mounts_after);
        let layers: Vec<String> = cycle.layers.iter().map(|(_, count)| count.to_string()).collect();
        let _ = writeln!(text, " {latency:>13} {mounts:>9}   {}", layers.join("/"));
    }
    let verdict =
        if report.mounts_at_end == report.mounts_at_start { "back to the start" } else { "NOT back to the start" };
    let _ = write!(
        text,
        "mounts under the sandbox: {} at the start, {} at the end ({verdict})",
        report.mounts_at_start, report.mounts_at_end
    );
    text
}

/// One line of the supervisor's JSON log.
pub(super) struct LogEntry {
    pub(super) at: Option<SystemTime>,
    pub(super) level: String,
    pub(super) message: String,
    pub(super) fields: serde_json::Map<String, serde_json::Value>,
}

impl LogEntry {
    pub(super) fn parse(line: &str) -> Option<Self> {
        let serde_json::Value::Object(mut line) = serde_json::from_str(line).ok()? else { return None };
        let serde_json::Value::Object(fields) = line.remove("fields")? else { return None };
        let message = fields.get("message")?.as_str()?.to_owned();
        let at = line.get("timestamp").and_then(serde_json::Value::as_str).and_then(parse_utc_timestamp);
        let level = line.get("level").and_then(serde_json::Value::as_str).unwrap_or("").to_owned();
        Some(LogEntry { at, level, message, fields })
    }

    pub(super) fn field_str(&self, name: &str) -> Option<&str> {
        self.fields.get(name).and_then(serde_json::Value::as_str)
    }
}

/// `2025-01-31T12:34:56.123456Z`, as tracing-subscriber writes it.
pub(super) fn parse_utc_timestamp(text: &str) -> Option<SystemTime> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut date = date.splitn(3, '-').map(str::parse::<i64>);
    let (year, month, day) = (date.next()?.ok()?, date.next()?.ok()?, date.next()?.ok()?);
    let (clock, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut clock = clock.splitn(3, ':').map(str::parse::<u64>);
    let (hour, minute, second) = (clock.next()?.ok()?, clock.next()?.ok()?, clock.next()?.ok()?);
    let digits = fraction.len().min(9);
    let nanos = fraction.get(..digits)?.parse::<u64>().ok()? * 10u64.pow(9 - digits as u32);
    let days = u64::try_from(days_from_civil(year, month, day)).ok()?;
    let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second;
    Some(UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_nanos(nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
pub(super) fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tracing_timestamps() {
        let at = parse_utc_timestamp("2024-03-01T00:00:01.500000Z").unwrap();
        assert_eq!(at.duration_since(UNIX_EPOCH).unwrap(), Duration::from_millis(1_709_251_201_500));
        assert_eq!(parse_utc_timestamp("1970-01-01T00:00:00Z"), Some(UNIX_EPOCH));
        assert_eq!(parse_utc_timestamp("garbage"), None);
    }

    #[test]
    fn parses_heal_lines() {
        let line = r#"{"timestamp":"2024-03-01T00:00:01.000001Z","level":"INFO","fields":{"message":"healed","target":"/k/pods/a","how":"stacked","layers_removed":1,"latency_us":812},"target":"fuse_supervisor::supervisor"}"#;
        let entry = LogEntry::parse(line).unwrap();
        assert_eq!(entry.message, "healed");
        assert_eq!(entry.field_str("target"), Some("/k/pods/a"));
        assert_eq!(entry.fields.get("latency_us").and_then(serde_json::Value::as_u64), Some(812));
        assert!(LogEntry::parse("not json").is_none());
    }
}
