//! The webhook's Prometheus metrics (OpenMetrics text on `/metrics`).
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::cache::Unresolved;
use super::review::Outcome;
use fuse_supervisor_engine::errors::chain;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// Every counter of the webhook; shared by the server's tasks.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    admissions: Family<ResultLabel, Counter>,
    mounts_patched: Counter,
    unresolved: Family<ReasonLabel, Counter>,
    latency: Histogram,
    watch_errors: Family<KindLabel, Counter>,
    cert_reloads: Family<ResultLabel, Counter>,
    cache_ready: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut metrics = Metrics {
            registry: Registry::with_prefix("fuse_supervisor_webhook"),
            admissions: Family::default(),
            mounts_patched: Counter::default(),
            unresolved: Family::default(),
            // 10 µs to 0.16 s: the work is tens of microseconds; a slow
            // tail would come from the runtime, not the policy.
            latency: Histogram::new(exponential_buckets(1e-5, 4.0, 8)),
            watch_errors: Family::default(),
            cert_reloads: Family::default(),
            cache_ready: Gauge::default(),
        };
        let registry = &mut metrics.registry;
        registry.register(
            "admissions",
            "Admission reviews answered, by result: patched, unchanged, unresolved (a volume's driver was \
             not known, e.g. the cache not ready: admitted unchanged), opted_out, skipped, error (malformed review)",
            metrics.admissions.clone(),
        );
        registry.register(
            "mounts_patched",
            "Volume mounts given mountPropagation HostToContainer",
            metrics.mounts_patched.clone(),
        );
        registry.register(
            "unresolved_volumes",
            "Pod volumes whose CSI driver was not known at admission, by reason",
            metrics.unresolved.clone(),
        );
        registry.register(
            "admission_duration_seconds",
            "Time from a review's body read to its answer encoded",
            metrics.latency.clone(),
        );
        registry.register(
            "watch_errors",
            "Failed lists or watches of PVs, PVCs or StorageClasses (retried with back-off)",
            metrics.watch_errors.clone(),
        );
        registry.register(
            "certificate_reloads",
            "Reloads of the serving certificate and key, by result (ok, failed: the old pair is kept)",
            metrics.cert_reloads.clone(),
        );
        registry.register("cache_ready", "1 once every watch has listed, 0 before", metrics.cache_ready.clone());
        metrics
    }

    /// One review answered with `outcome` (None: an error).
    pub fn admitted(
        &self,
        outcome: Option<Outcome>,
        mounts: usize,
        unresolved: &[(String, Unresolved)],
        took: Duration,
    ) {
        let result = outcome.map_or("error", Outcome::as_str);
        self.admissions.get_or_create(&ResultLabel { result }).inc();
        self.mounts_patched.inc_by(mounts as u64);
        for (_, reason) in unresolved {
            self.unresolved.get_or_create(&ReasonLabel { reason: reason.as_str() }).inc();
        }
        self.latency.observe(took.as_secs_f64());
    }

    pub fn watch_failed(&self, kind: &'static str) {
        self.watch_errors.get_or_create(&KindLabel { kind }).inc();
    }

    pub fn certificate_reloaded(&self, ok: bool) {
        self.cert_reloads.get_or_create(&ResultLabel { result: if ok { "ok" } else { "failed" } }).inc();
    }

    pub fn set_cache_ready(&self, ready: bool) {
        self.cache_ready.set(i64::from(ready));
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail; a metric that failed to encode
        // would be a bug in the crate, and an empty page says so plainly.
        if let Err(err) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::error!(err = %chain(&err), "cannot encode metrics");
        }
        text
    }
}
