//! Pod UID → namespace and name, through the local kubelet's `/pods`:
//! reports name application pods by UID only, and an event needs the name.
//! Cached by UID; one call answers every miss of a batch; the API server
//! is never asked.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::occurrence::PodRef;
use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::kube::{Kubelet, KubeletError, PodList};

/// A UID the kubelet did not list is not asked about again for this long
/// (its pod is gone, or not yet admitted).
const UNKNOWN_FOR: Duration = Duration::from_secs(60);
/// After a failed call, misses wait this long for the next one.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// Lists the pods of this node.
pub trait PodNames: Send {
    fn pods(&mut self) -> Result<Vec<PodRef>, KubeletError>;

    /// The pods of the last list another user of the same kubelet client
    /// asked for, without a call: a UID names the same pod for its life, so
    /// a list of any age names the pods it has.
    fn last_listed(&self) -> Option<Vec<PodRef>> {
        None
    }
}

impl PodNames for Kubelet {
    fn pods(&mut self) -> Result<Vec<PodRef>, KubeletError> {
        Kubelet::pods(self).map(|pods| pod_refs(&pods))
    }

    fn last_listed(&self) -> Option<Vec<PodRef>> {
        Kubelet::last_listed(self).map(|listed| pod_refs(&listed.pods))
    }
}

fn pod_refs(list: &PodList) -> Vec<PodRef> {
    let listed = list.items.iter().map(|pod| (&pod.metadata.namespace, &pod.metadata.name, &pod.metadata.uid));
    // A pod skipped for a field outside its metadata still has its name.
    let named_but_unreadable = list
        .skipped
        .iter()
        .filter(|pod| {
            !pod.field.starts_with("metadata") && [&pod.namespace, &pod.name, &pod.uid].iter().all(|s| !s.is_empty())
        })
        .map(|pod| (&pod.namespace, &pod.name, &pod.uid));
    listed
        .chain(named_but_unreadable)
        .map(|(namespace, name, uid)| PodRef { namespace: namespace.clone(), name: name.clone(), uid: uid.clone() })
        .collect()
}

/// The cache in front of [`PodNames`].
pub struct Resolver {
    source: Option<Box<dyn PodNames>>,
    /// The pods of the last successful call: a pod that left the node
    /// leaves the cache with the next call.
    known: HashMap<String, PodRef>,
    /// Misses not to ask about before the instant.
    unknown: HashMap<String, Instant>,
    failing: bool,
    /// Calls made (for tests).
    calls: usize,
}

impl Resolver {
    /// `None` resolves nothing (no kubelet configured).
    pub fn new(source: Option<Box<dyn PodNames>>) -> Self {
        Resolver { source, known: HashMap::new(), unknown: HashMap::new(), failing: false, calls: 0 }
    }

    /// Makes sure every UID is looked up: one kubelet call if any is neither
    /// cached nor recently missed.
    pub fn prepare<'a>(&mut self, uids: impl IntoIterator<Item = &'a str>, now: Instant) {
        self.unknown.retain(|_, until| *until > now);
        let mut missing: Vec<&str> =
            uids.into_iter().filter(|uid| !self.known.contains_key(*uid) && !self.unknown.contains_key(*uid)).collect();
        if missing.is_empty() {
            return;
        }
        let Some(source) = self.source.as_mut() else {
            return;
        };
        if let Some(listed) = source.last_listed() {
            for pod in listed {
                if missing.contains(&pod.uid.as_str()) {
                    self.known.insert(pod.uid.clone(), pod);
                }
            }
            missing.retain(|uid| !self.known.contains_key(*uid));
            if missing.is_empty() {
                return;
            }
        }
        self.calls += 1;
        match source.pods() {
            Ok(pods) => {
                if self.failing {
                    self.failing = false;
                    debug!("kubelet lists pods again for events");
                }
                self.known = pods.into_iter().map(|pod| (pod.uid.clone(), pod)).collect();
                missing.retain(|uid| !self.known.contains_key(*uid));
                for uid in missing {
                    debug!(pod_uid = uid, "pod not on the kubelet; its events are dropped");
                    self.unknown.insert(uid.to_owned(), now + UNKNOWN_FOR);
                }
            }
            Err(err) => {
                if !self.failing {
                    warn!(err = %chain(&err), "cannot list pods for events: events about application pods are dropped until it can");
                    self.failing = true;
                }
                for uid in missing {
                    self.unknown.insert(uid.to_owned(), now + RETRY_AFTER);
                }
            }
        }
    }

    pub fn get(&self, uid: &str) -> Option<PodRef> {
        self.known.get(uid).cloned()
    }

    pub fn calls(&self) -> usize {
        self.calls
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Answers with the pods it holds, or an error when it holds none.
    #[derive(Clone, Default)]
    struct Node(Arc<Mutex<Option<Vec<PodRef>>>>);

    impl Node {
        fn set(&self, uids: &[&str]) {
            let pods = uids
                .iter()
                .map(|uid| PodRef { namespace: "ns".into(), name: format!("pod-{uid}"), uid: (*uid).into() })
                .collect();
            *self.0.lock().unwrap() = Some(pods);
        }
    }

    impl PodNames for Node {
        fn pods(&mut self) -> Result<Vec<PodRef>, KubeletError> {
            self.0.lock().unwrap().clone().ok_or_else(|| KubeletError::Status {
                addr: "127.0.0.1:10250".into(),
                code: 503,
                body: "starting".into(),
            })
        }
    }

    #[test]
    fn one_call_answers_every_miss_and_the_cache_the_rest() {
        let node = Node::default();
        node.set(&["a", "b", "c"]);
        let mut resolver = Resolver::new(Some(Box::new(node.clone())));
        let now = Instant::now();
        resolver.prepare(["a", "b", "a"], now);
        assert_eq!(resolver.calls(), 1);
        assert_eq!(resolver.get("b").map(|pod| pod.name), Some("pod-b".to_owned()));
        resolver.prepare(["a", "c"], now);
        assert_eq!(resolver.calls(), 1);
    }

    /// The kubelet client shared with the confirmation, whose last list
    /// holds the pods `last` names.
    struct Shared {
        node: Node,
        last: Node,
    }

    impl PodNames for Shared {
        fn pods(&mut self) -> Result<Vec<PodRef>, KubeletError> {
            self.node.pods()
        }

        fn last_listed(&self) -> Option<Vec<PodRef>> {
            self.last.0.lock().unwrap().clone()
        }
    }

    #[test]
    fn a_pod_in_another_users_last_list_is_named_without_a_call() {
        let (node, last) = (Node::default(), Node::default());
        node.set(&["a", "b"]);
        last.set(&["a"]);
        let mut resolver = Resolver::new(Some(Box::new(Shared { node, last: last.clone() })));
        let now = Instant::now();
        resolver.prepare(["a"], now);
        assert_eq!((resolver.calls(), resolver.get("a").map(|pod| pod.name)), (0, Some("pod-a".to_owned())));
        // A pod newer than that list is asked for.
        resolver.prepare(["a", "b"], now);
        assert_eq!(resolver.calls(), 1);
        assert!(resolver.get("b").is_some());
    }

    #[test]
    fn a_pod_not_listed_is_not_asked_about_again_for_a_while() {
        let node = Node::default();
        node.set(&["a"]);
        let mut resolver = Resolver::new(Some(Box::new(node.clone())));
        let now = Instant::now();
        resolver.prepare(["ghost"], now);
        resolver.prepare(["ghost"], now + Duration::from_secs(1));
        assert_eq!((resolver.calls(), resolver.get("ghost")), (1, None));
        node.set(&["a", "ghost"]);
        resolver.prepare(["ghost"], now + UNKNOWN_FOR);
        assert_eq!(resolver.calls(), 2);
        assert!(resolver.get("ghost").is_some());
    }

    #[test]
    fn a_failing_kubelet_is_asked_again_after_a_pause() {
        let node = Node::default();
        let mut resolver = Resolver::new(Some(Box::new(node.clone())));
        let now = Instant::now();
        resolver.prepare(["a"], now);
        resolver.prepare(["a"], now + Duration::from_secs(1));
        assert_eq!(resolver.calls(), 1);
        node.set(&["a"]);
        resolver.prepare(["a"], now + RETRY_AFTER);
        assert_eq!(resolver.calls(), 2);
        assert!(resolver.get("a").is_some());
    }

    #[test]
    fn without_a_kubelet_nothing_resolves() {
        let mut resolver = Resolver::new(None);
        resolver.prepare(["a"], Instant::now());
        assert_eq!((resolver.calls(), resolver.get("a")), (0, None));
    }
}
