//! Prometheus metrics: a [`Reporter`] that counts what the loop reports,
//! and the HTTP server ([`server`]) that exposes them in the OpenMetrics
//! text format beside `/healthz` and `/readyz`.
//!
//! Every metric is a public field of [`Metrics`], registered by one line
//! of the table below: a publisher outside the loop (the Kubernetes event
//! queue, the process watcher) feeds its own through an `Arc<Metrics>`.
use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use fuse_supervisor_engine::heal::Healed;
use fuse_supervisor_engine::report::{Report, Reporter, ScanCounts};

pub mod server;

pub use server::{MetricsServer, ServeError};

/// Every metric name starts with this and an underscore.
pub const PREFIX: &str = "fuse_supervisor";

/// What `/metrics` answers with (the OpenMetrics text format).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Heal latency runs from a fraction of a millisecond (one target, a
/// table wake-up away) to minutes (a source that answers its probe late).
const LATENCY_BUCKETS: [f64; 18] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
/// An outage includes the daemon's own restart: seconds to an hour.
const OUTAGE_BUCKETS: [f64; 16] =
    [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0];
/// One kubelet call: about 2 ms on a node, at most the call's timeout.
const KUBELET_BUCKETS: [f64; 13] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot encode the metrics in the OpenMetrics text format")]
    Encode(#[source] std::fmt::Error),
}

/// `state` label: healthy, broken, healing, failed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

/// `result` label of heals: stacked, propagated, failed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// `code` label: the HTTP status, or `none` when no status came back.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: String,
}

/// `event` label of process events, named by the process watcher.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub event: &'static str,
}

/// Labels of `restages`: the CSI driver, and how the re-staging went.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestageLabel {
    pub driver: String,
    pub result: &'static str,
}

/// Labels of `resyncs`: which watcher lost events, and why.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResyncLabel {
    pub watch: &'static str,
    pub reason: &'static str,
}

/// Declares [`Metrics`] and registers each field: one line per metric,
/// `field: Type = initial value, "name" [in Unit], "help";` (counters get
/// `_total` and units their suffix when encoded).
/// Where `kube_events_dropped` is counted: the Events publisher.
struct DroppedSource(Box<dyn Fn() -> u64 + Send + Sync>);

impl std::fmt::Debug for DroppedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DroppedSource")
    }
}

macro_rules! metrics {
    (@register $registry:ident, $field:ident, $name:literal, $help:literal) => {
        $registry.register($name, $help, $field.clone())
    };
    (@register $registry:ident, $field:ident, $name:literal, $help:literal, $unit:ident) => {
        $registry.register_with_unit($name, $help, Unit::$unit, $field.clone())
    };
    ($( $(#[$doc:meta])* $field:ident: $ty:ty = $init:expr, $name:literal $(in $unit:ident)?, $help:literal; )*) => {
        /// Every metric of the supervisor, and the registry that encodes them.
        #[derive(Debug)]
        pub struct Metrics {
            registry: Registry,
            kube_events_dropped_source: OnceLock<DroppedSource>,
            $( $(#[$doc])* pub $field: $ty, )*
        }

        impl Metrics {
            /// Every metric registered, none with a value yet.
            fn registered() -> Self {
                let mut registry = Registry::with_prefix(PREFIX);
                $(
                    let $field: $ty = $init;
                    metrics!(@register registry, $field, $name, $help $(, $unit)?);
                )*
                Metrics { registry, kube_events_dropped_source: OnceLock::new(), $( $field ),* }
            }
        }
    };
}

metrics! {
    targets: Family<StateLabel, Gauge> = Family::default(), "targets",
        "FUSE bind targets in pod directories by state, at the last scan";
    sources: Gauge = Gauge::default(), "sources", "FUSE global mounts (sources) outside the pod directories, at the last scan";
    mounts: Gauge = Gauge::default(), "mounts", "Mounts in the watched mount table, at the last scan";
    scans: Counter = Counter::default(), "scans", "Scans of the mount table";
    mount_table_events: Counter = Counter::default(), "mount_table_events",
        "Wake-ups for a mount-table change (in poll mode: timer ticks)";
    targets_broken: Counter = Counter::default(), "targets_broken", "Targets found broken (one per outage)";
    heals: Family<ResultLabel, Counter> = Family::default(), "heals",
        "Heals of targets by result: stacked, propagated (the kernel's propagation had done it) or failed";
    heal_latency: Histogram = Histogram::new(LATENCY_BUCKETS), "heal_latency" in Seconds,
        "From the wake-up on the new global mount to the target healed";
    heal_source_wait: Histogram = Histogram::new(LATENCY_BUCKETS), "heal_source_wait" in Seconds,
        "Of heal_latency, the wait for the new global mount to answer its probe: the FUSE daemon's own start-up";
    heal_outage: Histogram = Histogram::new(OUTAGE_BUCKETS), "heal_outage" in Seconds,
        "From the start of the outage (the daemon's death when it was seen, else the target first seen broken) to healed";
    stale_layers_removed: Counter = Counter::default(), "stale_layers_removed",
        "Stale mount layers removed from under healed targets";
    container_heals: Family<ResultLabel, Counter> = Family::default(), "container_heals",
        "Mounts of dead connections in containers' namespaces dealt with after a host heal, by result: replaced (one live layer), stacked (the dead one under it), propagated (live already), failed (retried), refused (the container changed its mount; retried at its next mount change), given_up (its namespace missed the deadline)";
    daemon_deaths: Counter = Counter::default(), "daemon_deaths",
        "Deaths of FUSE daemons seen by the process watcher (their targets went Degraded)";
    death_retractions: Counter = Counter::default(), "death_retractions",
        "Targets back from Degraded without a heal: a process not seen before still served the connection when its known daemon exited (daemon_deaths counts those deaths too)";
    daemon_flapping: Counter = Counter::default(), "daemon_flapping",
        "Sources found healed more than --flapping-heals times within --flapping-window (once per window each)";
    dead_sources_detached: Counter = Counter::default(), "dead_sources_detached",
        "Dead daemons' own mounts detached from their source paths once nobody held the connection";
    daemon_restarts: Counter = Counter::default(), "daemon_restarts",
        "Restarts of a FUSE daemon's pod confirmed by the kubelet";
    resyncs: Family<ResyncLabel, Counter> = Family::default(), "resyncs",
        "Views read again from scratch after a watcher lost events, by watch (pods, mounts, processes) and reason (overflow: the kernel's queue or buffer; backlog: events faster than they were read)";
    kubelet_requests: Family<CodeLabel, Counter> = Family::default(), "kubelet_requests",
        "Kubelet /pods requests by HTTP status (none: no answer)";
    kubelet_request_duration: Histogram = Histogram::new(KUBELET_BUCKETS), "kubelet_request_duration" in Seconds,
        "Duration of kubelet /pods requests";
    process_events: Family<EventLabel, Counter> = Family::default(), "process_events",
        "Events of watched FUSE daemon processes by kind";
    restages: Family<RestageLabel, Counter> = Family::default(), "restages",
        "Re-stagings of CSI volumes through their driver (--restage), by driver and result: restaged, by_driver (the driver staged by itself: no call), no_record, record_removed (unstaged meanwhile: no call), no_pods (no call), and per failed attempt refused, no_secrets (refused, recorded without secrets), failed (no answer)";
    kube_events_dropped: Counter = Counter::default(), "kube_events_dropped",
        "Kubernetes Events dropped (queue full or rate-limited)";
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// The label values known in advance: their series are exposed (at zero)
/// from the start, so that a rate over them begins at the first scrape.
const STATES: [&str; 4] = ["healthy", "broken", "healing", "failed"];
const HEAL_RESULTS: [&str; 3] = ["stacked", "propagated", "failed"];
const CONTAINER_HEAL_RESULTS: [&str; 6] = ["replaced", "stacked", "propagated", "failed", "refused", "given_up"];
/// Every way a watcher can lose events: the pod directories' inotify queue
/// (or the watcher's own limit), the fanotify queue of mount events, the
/// proc connector's socket buffer. (Mountinfo's flag and pidfds lose none.)
const RESYNCS: [(&str, &str); 4] =
    [("pods", "overflow"), ("pods", "backlog"), ("mounts", "overflow"), ("processes", "overflow")];

impl Metrics {
    /// Families whose label values come with the events (HTTP codes,
    /// process events) appear at their first event.
    pub fn new() -> Self {
        let metrics = Metrics::registered();
        for state in STATES {
            // Creating the series is the point; the guard goes at once.
            let _ = metrics.targets.get_or_create(&StateLabel { state });
        }
        for result in HEAL_RESULTS {
            let _ = metrics.heals.get_or_create(&ResultLabel { result });
        }
        for result in CONTAINER_HEAL_RESULTS {
            let _ = metrics.container_heals.get_or_create(&ResultLabel { result });
        }
        for (watch, reason) in RESYNCS {
            let _ = metrics.resyncs.get_or_create(&ResyncLabel { watch, reason });
        }
        metrics
    }

    /// Makes `kube_events_dropped` follow a count kept by the Events
    /// publisher, read at each scrape. Only the first call counts.
    pub fn follow_kube_events_dropped(&self, dropped: impl Fn() -> u64 + Send + Sync + 'static) {
        let _ = self.kube_events_dropped_source.set(DroppedSource(Box::new(dropped)));
    }

    /// The OpenMetrics text exposition, `# EOF` included.
    pub fn encode(&self) -> Result<String, MetricsError> {
        if let Some(DroppedSource(dropped)) = self.kube_events_dropped_source.get() {
            let (now, shown) = (dropped(), self.kube_events_dropped.get());
            if now > shown {
                self.kube_events_dropped.inc_by(now - shown);
            }
        }
        let mut text = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut text, &self.registry).map_err(MetricsError::Encode)?;
        Ok(text)
    }

    fn set_targets(&self, counts: &ScanCounts) {
        let states = [
            ("healthy", counts.healthy),
            ("broken", counts.broken),
            ("healing", counts.healing),
            ("failed", counts.failed),
        ];
        for (state, count) in states {
            self.targets.get_or_create(&StateLabel { state }).set(gauge_value(count));
        }
    }

    fn heal(&self, result: &'static str) {
        self.heals.get_or_create(&ResultLabel { result }).inc();
    }
}

fn gauge_value(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

impl Reporter for Metrics {
    fn report(&self, report: &Report<'_>) {
        match report {
            Report::TableChanged => {
                self.mount_table_events.inc();
            }
            Report::Scanned(counts) => {
                self.scans.inc();
                self.set_targets(counts);
                self.sources.set(gauge_value(counts.sources));
                self.mounts.set(gauge_value(counts.mounts));
            }
            Report::TargetBroken(_) => {
                self.targets_broken.inc();
            }
            Report::TargetHealed { heal, .. } => {
                self.heal(match heal.how {
                    Healed::Stacked => "stacked",
                    Healed::Propagated => "propagated",
                });
                self.heal_latency.observe(heal.latency.as_secs_f64());
                if let Some(wait) = heal.source_wait {
                    self.heal_source_wait.observe(wait.as_secs_f64());
                }
                if let Some(outage) = heal.outage {
                    self.heal_outage.observe(outage.as_secs_f64());
                }
                self.stale_layers_removed.inc_by(heal.layers_removed as u64);
            }
            Report::HealFailed { .. } => self.heal("failed"),
            Report::ContainerHealed { result, .. } => {
                self.container_heals.get_or_create(&ResultLabel { result }).inc();
            }
            // Each of its heals was counted as a ContainerHealed.
            Report::ContainersHealed { .. } => {}
            Report::Resynced { watch, reason } => {
                self.resyncs.get_or_create(&ResyncLabel { watch, reason }).inc();
            }
            Report::DaemonDied { .. } => {
                self.daemon_deaths.inc();
            }
            Report::DeathRetracted { .. } => {
                self.death_retractions.inc();
            }
            Report::DaemonFlapping { .. } => {
                self.daemon_flapping.inc();
            }
            Report::DeadSourceDetached { .. } => {
                self.dead_sources_detached.inc();
            }
            Report::ProcessEvent { kind } => {
                self.process_events.get_or_create(&EventLabel { event: kind }).inc();
            }
            Report::DaemonRestarted { .. } => {
                self.daemon_restarts.inc();
            }
            Report::Restage(outcome) => {
                let label = RestageLabel { driver: outcome.driver.clone(), result: outcome.result.label() };
                self.restages.get_or_create(&label).inc();
            }
            Report::VolumeRestage { .. } => {}
            Report::KubeletAnswered { result, took } => {
                let code = match result {
                    Ok(()) => Some(200),
                    Err(err) => err.status_code(),
                };
                let code = code.map_or_else(|| "none".to_owned(), |code| code.to_string());
                self.kubelet_requests.get_or_create(&CodeLabel { code }).inc();
                self.kubelet_request_duration.observe(took.as_secs_f64());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, SystemTime};

    use fuse_supervisor_testbed::series_value;

    use super::*;
    use fuse_supervisor_engine::kube::{KubeletAuthz, KubeletError};
    use fuse_supervisor_engine::report::{HealReport, TargetEvent};

    fn value(metrics: &Metrics, series: &str) -> Option<f64> {
        series_value(&metrics.encode().unwrap(), series)
    }

    fn target() -> TargetEvent<'static> {
        TargetEvent {
            target: Path::new("/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount"),
            pod_uid: "p",
            source: Path::new("/runtime-mnt/fuse"),
            broken_since: None,
        }
    }

    #[test]
    fn every_family_with_known_labels_is_exposed_before_it_has_a_value_and_the_text_ends_with_eof() {
        let text = Metrics::new().encode().unwrap();
        for name in [
            "targets",
            "sources",
            "mounts",
            "scans",
            "mount_table_events",
            "targets_broken",
            "heals",
            "heal_latency_seconds",
            "heal_source_wait_seconds",
            "heal_outage_seconds",
            "stale_layers_removed",
            "daemon_restarts",
            "kubelet_request_duration_seconds",
            "kube_events_dropped",
            "resyncs",
        ] {
            assert!(text.contains(&format!("# HELP {PREFIX}_{name} ")), "{name} missing:\n{text}");
        }
        for state in STATES {
            assert!(text.contains(&format!("{PREFIX}_targets{{state=\"{state}\"}} 0\n")), "{state}:\n{text}");
        }
        for (family, results) in [("heals", &HEAL_RESULTS[..]), ("container_heals", &CONTAINER_HEAL_RESULTS[..])] {
            for result in results {
                let series = format!("{PREFIX}_{family}_total{{result=\"{result}\"}} 0\n");
                assert!(text.contains(&series), "{series}:\n{text}");
            }
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn heals_count_by_result_with_latency_outage_and_layers() {
        let metrics = Metrics::new();
        let stacked = HealReport {
            how: Healed::Stacked,
            latency: Duration::from_millis(3),
            source_wait: Some(Duration::from_millis(2)),
            outage: Some(Duration::from_secs(2)),
            layers_removed: 1,
        };
        let propagated = HealReport {
            how: Healed::Propagated,
            source_wait: None,
            outage: None,
            layers_removed: 2,
            ..stacked.clone()
        };
        metrics.report(&Report::TargetBroken(&target()));
        metrics.report(&Report::TargetHealed { target: &target(), heal: &stacked });
        metrics.report(&Report::TargetHealed { target: &target(), heal: &propagated });
        metrics.report(&Report::HealFailed {
            target: &target(),
            error: "cannot stack",
            attempts: 1,
            retry_in: Duration::from_millis(100),
        });
        assert_eq!(value(&metrics, "fuse_supervisor_targets_broken_total"), Some(1.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_heals_total{result="stacked"}"#), Some(1.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_heals_total{result="propagated"}"#), Some(1.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_heals_total{result="failed"}"#), Some(1.0));
        assert_eq!(value(&metrics, "fuse_supervisor_heal_latency_seconds_count"), Some(2.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_heal_latency_seconds_bucket{le="0.0025"}"#), Some(0.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_heal_latency_seconds_bucket{le="0.005"}"#), Some(2.0));
        // Only the heal that waited for its source's probe is observed.
        assert_eq!(value(&metrics, "fuse_supervisor_heal_source_wait_seconds_count"), Some(1.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_heal_source_wait_seconds_bucket{le="0.001"}"#), Some(0.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_heal_source_wait_seconds_bucket{le="0.0025"}"#), Some(1.0));
        // Only the heal whose outage is known is observed.
        assert_eq!(value(&metrics, "fuse_supervisor_heal_outage_seconds_count"), Some(1.0));
        assert_eq!(value(&metrics, "fuse_supervisor_heal_outage_seconds_sum"), Some(2.0));
        assert_eq!(value(&metrics, "fuse_supervisor_stale_layers_removed_total"), Some(3.0));
    }

    #[test]
    fn a_scan_sets_targets_by_state_sources_and_mounts() {
        let metrics = Metrics::new();
        let counts = ScanCounts { mounts: 40, sources: 2, healthy: 5, broken: 3, healing: 0, failed: 1 };
        metrics.report(&Report::TableChanged);
        metrics.report(&Report::Scanned(&counts));
        metrics.report(&Report::Scanned(&ScanCounts { healthy: 9, broken: 0, failed: 0, ..counts }));
        assert_eq!(value(&metrics, "fuse_supervisor_mount_table_events_total"), Some(1.0));
        assert_eq!(value(&metrics, "fuse_supervisor_scans_total"), Some(2.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_targets{state="healthy"}"#), Some(9.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_targets{state="broken"}"#), Some(0.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_targets{state="failed"}"#), Some(0.0));
        assert_eq!(value(&metrics, "fuse_supervisor_sources"), Some(2.0));
        assert_eq!(value(&metrics, "fuse_supervisor_mounts"), Some(40.0));
    }

    #[test]
    fn kubelet_requests_count_by_status_code_or_none() {
        let metrics = Metrics::new();
        let forbidden = KubeletError::Forbidden {
            addr: "10.0.0.1:10250".into(),
            authz: KubeletAuthz::NodesPods,
            body: String::new(),
        };
        let unavailable = KubeletError::Status { addr: "10.0.0.1:10250".into(), code: 503, body: String::new() };
        let refused = KubeletError::Connect {
            addr: "10.0.0.1:10250".into(),
            source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        let took = Duration::from_millis(2);
        for result in [Ok(()), Ok(()), Err(&forbidden), Err(&unavailable), Err(&refused)] {
            metrics.report(&Report::KubeletAnswered { result, took });
        }
        assert_eq!(value(&metrics, r#"fuse_supervisor_kubelet_requests_total{code="200"}"#), Some(2.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_kubelet_requests_total{code="403"}"#), Some(1.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_kubelet_requests_total{code="503"}"#), Some(1.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_kubelet_requests_total{code="none"}"#), Some(1.0));
        assert_eq!(value(&metrics, "fuse_supervisor_kubelet_request_duration_seconds_count"), Some(5.0));
    }

    #[test]
    fn process_events_and_daemon_deaths_are_counted_from_reports() {
        let metrics = Metrics::new();
        for kind in ["exited", "exited", "lost"] {
            metrics.report(&Report::ProcessEvent { kind });
        }
        let targets = [PathBuf::from("/pods/a")];
        metrics.report(&Report::DaemonDied {
            source: Path::new("/src"),
            pid: 7,
            at: SystemTime::now(),
            targets: &targets,
        });
        assert_eq!(value(&metrics, r#"fuse_supervisor_process_events_total{event="exited"}"#), Some(2.0));
        assert_eq!(value(&metrics, r#"fuse_supervisor_process_events_total{event="lost"}"#), Some(1.0));
        assert_eq!(value(&metrics, "fuse_supervisor_daemon_deaths_total"), Some(1.0));
    }

    #[test]
    fn resyncs_count_by_watch_and_reason_from_zero() {
        let metrics = Metrics::new();
        let series = |watch: &str, reason: &str| {
            format!("fuse_supervisor_resyncs_total{{watch=\"{watch}\",reason=\"{reason}\"}}")
        };
        for (watch, reason) in RESYNCS {
            assert_eq!(value(&metrics, &series(watch, reason)), Some(0.0), "{watch} {reason}");
        }
        metrics.report(&Report::Resynced { watch: "pods", reason: "overflow" });
        metrics.report(&Report::Resynced { watch: "mounts", reason: "overflow" });
        metrics.report(&Report::Resynced { watch: "mounts", reason: "overflow" });
        assert_eq!(value(&metrics, &series("pods", "overflow")), Some(1.0));
        assert_eq!(value(&metrics, &series("mounts", "overflow")), Some(2.0));
        assert_eq!(value(&metrics, &series("pods", "backlog")), Some(0.0));
        assert_eq!(value(&metrics, &series("processes", "overflow")), Some(0.0));
    }

    #[test]
    fn dropped_kubernetes_events_follow_the_publishers_count_at_each_scrape() {
        let metrics = Metrics::new();
        let dropped = Arc::new(AtomicU64::new(0));
        let source = dropped.clone();
        metrics.follow_kube_events_dropped(move || source.load(Ordering::Relaxed));
        assert_eq!(value(&metrics, "fuse_supervisor_kube_events_dropped_total"), Some(0.0));
        dropped.store(5, Ordering::Relaxed);
        assert_eq!(value(&metrics, "fuse_supervisor_kube_events_dropped_total"), Some(5.0));
        assert_eq!(value(&metrics, "fuse_supervisor_kube_events_dropped_total"), Some(5.0), "read again, not added");
        dropped.store(8, Ordering::Relaxed);
        assert_eq!(value(&metrics, "fuse_supervisor_kube_events_dropped_total"), Some(8.0));
    }
}
