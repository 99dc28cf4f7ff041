//! The publisher thread: takes occurrences off the queue, resolves pod
//! names, lets the correlator decide, and carries the writes out through
//! the kube client on a current-thread runtime of its own.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::runtime::Runtime;
use tracing::{debug, info, warn};

use super::occurrence::{Occurrence, Regarding};
use super::resolve::Resolver;
use super::series::{Correlator, Observed, Write};
use super::{EventCounters, Message};

/// Occurrences taken off the queue at once (one kubelet call serves them).
const BATCH: usize = 256;
/// Longest wait for one API write.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the final counts may take at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Sleep when no series is open (any message wakes it).
const IDLE: Duration = Duration::from_secs(3600);

pub(super) struct Publisher {
    pub inbox: Receiver<Message>,
    pub correlator: Correlator,
    pub resolver: Resolver,
    pub runtime: Runtime,
    pub client: kube::Client,
    pub counters: Arc<EventCounters>,
    /// In a streak of failed writes: logged once, at its start.
    pub failing: bool,
}

impl Publisher {
    pub fn run(mut self) {
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            let wait = self.correlator.next_due().map_or(IDLE, |due| due.saturating_duration_since(Instant::now()));
            let first = match self.inbox.recv_timeout(wait) {
                Ok(message) => Some(message),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            let mut stop = false;
            for message in first.into_iter().chain(self.inbox.try_iter().take(BATCH)) {
                match message {
                    Message::Occurrence(occurrence) => batch.push(occurrence),
                    Message::Stop => stop = true,
                }
            }
            let now = Instant::now();
            for write in self.correlator.due(now) {
                self.write(write);
            }
            self.publish(&mut batch, now);
            if stop {
                break;
            }
        }
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        for write in self.correlator.close_all() {
            if Instant::now() >= deadline {
                break;
            }
            self.write(write);
        }
        debug!("event publisher stopped");
    }

    fn publish(&mut self, batch: &mut Vec<Occurrence>, now: Instant) {
        let correlator = &self.correlator;
        let needs_name =
            batch.iter().filter(|occurrence| !correlator.is_open(occurrence)).filter_map(
                |occurrence| match &occurrence.regarding {
                    Regarding::Uid(uid) => Some(uid.as_str()),
                    Regarding::Pod(_) => None,
                },
            );
        self.resolver.prepare(needs_name, now);
        for occurrence in batch.drain(..) {
            let (reason, uid) = (occurrence.reason, occurrence.regarding.uid().to_owned());
            let resolver = &self.resolver;
            match self.correlator.observe(occurrence, now, |uid| resolver.get(uid)) {
                Observed::Write(write) => self.write(write),
                Observed::Folded | Observed::Limited => {
                    debug!(reason = reason.as_str(), pod_uid = uid, "event held back by the limiter");
                    self.counters.limited.fetch_add(1, Ordering::Relaxed);
                }
                Observed::Unresolved => {
                    debug!(reason = reason.as_str(), pod_uid = uid, "no pod name for event; dropped");
                    self.counters.unresolved.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn write(&mut self, write: Write) {
        let result = match &write {
            Write::Create { event, .. } => self.create(event),
            Write::Patch { namespace, name, series, .. } => {
                let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
                let patch = Patch::Merge(serde_json::json!({ "series": series }));
                self.runtime.block_on(async {
                    tokio::time::timeout(REQUEST_TIMEOUT, api.patch(name, &PatchParams::default(), &patch)).await
                })
            }
        };
        match (result, write) {
            (Ok(Ok(_)), _) => self.succeeded(),
            // The Event expired or was deleted: write it again, series included.
            (Ok(Err(kube::Error::Api(status))), Write::Patch { key, .. }) if status.is_not_found() => {
                if let Some(write) = self.correlator.recreate(&key) {
                    let result = match &write {
                        Write::Create { event, .. } => self.create(event),
                        Write::Patch { .. } => return,
                    };
                    match result {
                        Ok(Ok(_)) => self.succeeded(),
                        Ok(Err(err)) => self.failed(&write, &err.to_string()),
                        Err(_elapsed) => self.failed(&write, &format!("timed out after {REQUEST_TIMEOUT:?}")),
                    }
                }
            }
            (Ok(Err(err)), write) => self.failed(&write, &err.to_string()),
            (Err(_elapsed), write) => self.failed(&write, &format!("timed out after {REQUEST_TIMEOUT:?}")),
        }
    }

    fn create(&self, event: &Event) -> Result<kube::Result<Event>, tokio::time::error::Elapsed> {
        let namespace = event.metadata.namespace.as_deref().unwrap_or_default();
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        self.runtime
            .block_on(async { tokio::time::timeout(REQUEST_TIMEOUT, api.create(&PostParams::default(), event)).await })
    }

    fn succeeded(&mut self) {
        self.counters.written.fetch_add(1, Ordering::Relaxed);
        if self.failing {
            self.failing = false;
            info!("publishing Kubernetes events again");
        }
    }

    fn failed(&mut self, write: &Write, err: &str) {
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        let (key, namespace, name) = match write {
            Write::Create { key, event } => {
                // The next occurrence starts afresh.
                self.correlator.forget(key);
                let meta = &event.metadata;
                (key, meta.namespace.as_deref().unwrap_or_default(), meta.name.as_deref().unwrap_or_default())
            }
            Write::Patch { key, namespace, name, .. } => (key, namespace.as_str(), name.as_str()),
        };
        self.log_failure(key.1.as_str(), namespace, name, err);
    }

    fn log_failure(&mut self, reason: &str, namespace: &str, name: &str, err: &str) {
        if self.failing {
            debug!(reason, namespace, event = name, err, "cannot publish event");
        } else {
            warn!(
                reason,
                namespace,
                event = name,
                err,
                "cannot publish event (the service account needs create and patch on events.k8s.io events); \
                 further failures are logged at debug level until one succeeds"
            );
            self.failing = true;
        }
    }
}
