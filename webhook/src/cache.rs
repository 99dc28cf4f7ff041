//! What the webhook knows of the cluster's storage: per PVC its bound PV and
//! class, per PV its CSI driver and class, per StorageClass its provisioner.
//!
//! Filled by watches ([`feed`]), read on every admission without a single
//! API call. Only these few strings are kept, not the objects: a cluster
//! with 100k claims costs a few MiB. Tests fill it through [`VolumeCache::apply`]
//! and [`VolumeCache::replace`], exactly as the watches do.
use std::collections::HashMap;
use std::fmt::Debug;
use std::pin::pin;
use std::sync::{Arc, PoisonError, RwLock};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource, ResourceExt as _};
use serde::de::DeserializeOwned;

use super::selection::Selection;

/// The annotation that marks the default StorageClass.
const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";

/// Whether a volume belongs to a selected driver or class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Selected,
    NotSelected,
    /// Not known now; the pod is admitted without a change for this volume.
    Unresolved(Unresolved),
}

/// Why a volume's driver is not known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unresolved {
    /// A watch has not finished its first list yet.
    CacheNotReady,
    /// No such claim in the cache (created just now, or in flight).
    ClaimUnknown,
    /// Claim unbound with no class to go by (static binding pending), or
    /// bound to a PV the cache has not seen and without a class.
    VolumeUnknown,
    /// The claim's class (or the default class) is not in the cache.
    ClassUnknown,
}

impl Unresolved {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Unresolved::CacheNotReady => "cache_not_ready",
            Unresolved::ClaimUnknown => "claim_unknown",
            Unresolved::VolumeUnknown => "volume_unknown",
            Unresolved::ClassUnknown => "class_unknown",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimEntry {
    /// `spec.volumeName`: the PV once bound.
    pub volume: Option<String>,
    /// `spec.storageClassName`; `Some("")` is "no class" (static binding).
    pub class: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeEntry {
    /// `spec.csi.driver`; None for any other volume source.
    pub driver: Option<String>,
    pub class: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassEntry {
    /// For a CSI class, the driver name.
    pub provisioner: String,
    pub default: bool,
}

/// An object the cache keeps a projection of.
pub trait Watched: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static {
    type Entry: Send;
    /// For logs and metrics.
    const KIND: &'static str;
    fn entry(&self) -> Self::Entry;
    #[doc(hidden)]
    fn table(tables: &mut Tables) -> &mut Table<Self::Entry>;
}

impl Watched for PersistentVolumeClaim {
    type Entry = ClaimEntry;
    const KIND: &'static str = "PersistentVolumeClaim";
    fn entry(&self) -> ClaimEntry {
        let spec = self.spec.as_ref();
        ClaimEntry {
            volume: spec.and_then(|spec| spec.volume_name.clone()).filter(|name| !name.is_empty()),
            class: spec.and_then(|spec| spec.storage_class_name.clone()),
        }
    }
    fn table(tables: &mut Tables) -> &mut Table<ClaimEntry> {
        &mut tables.claims
    }
}

impl Watched for PersistentVolume {
    type Entry = VolumeEntry;
    const KIND: &'static str = "PersistentVolume";
    fn entry(&self) -> VolumeEntry {
        let spec = self.spec.as_ref();
        VolumeEntry {
            driver: spec.and_then(|spec| spec.csi.as_ref()).map(|csi| csi.driver.clone()),
            class: spec.and_then(|spec| spec.storage_class_name.clone()).filter(|class| !class.is_empty()),
        }
    }
    fn table(tables: &mut Tables) -> &mut Table<VolumeEntry> {
        &mut tables.volumes
    }
}

impl Watched for StorageClass {
    type Entry = ClassEntry;
    const KIND: &'static str = "StorageClass";
    fn entry(&self) -> ClassEntry {
        ClassEntry {
            provisioner: self.provisioner.clone(),
            default: self.annotations().get(DEFAULT_CLASS_ANNOTATION).is_some_and(|value| value == "true"),
        }
    }
    fn table(tables: &mut Tables) -> &mut Table<ClassEntry> {
        &mut tables.classes
    }
}

/// Entries by namespace ("" for cluster-scoped objects), then name: two
/// levels so that a lookup by `&str` allocates nothing.
#[derive(Debug)]
pub struct Table<E> {
    entries: HashMap<String, HashMap<String, E>>,
    /// The first full list arrived.
    synced: bool,
}

impl<E> Default for Table<E> {
    fn default() -> Self {
        Table { entries: HashMap::new(), synced: false }
    }
}

impl<E> Table<E> {
    fn get(&self, namespace: &str, name: &str) -> Option<&E> {
        self.entries.get(namespace)?.get(name)
    }

    fn insert(&mut self, namespace: String, name: String, entry: E) {
        self.entries.entry(namespace).or_default().insert(name, entry);
    }

    fn remove(&mut self, namespace: &str, name: &str) {
        if let Some(names) = self.entries.get_mut(namespace) {
            names.remove(name);
            if names.is_empty() {
                self.entries.remove(namespace);
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Tables {
    claims: Table<ClaimEntry>,
    volumes: Table<VolumeEntry>,
    classes: Table<ClassEntry>,
}

impl Tables {
    fn ready(&self) -> bool {
        self.claims.synced && self.volumes.synced && self.classes.synced
    }

    fn claim_verdict(&self, namespace: &str, claim: &str, selection: &Selection) -> Verdict {
        let Some(claim) = self.claims.get(namespace, claim) else {
            return Verdict::Unresolved(Unresolved::ClaimUnknown);
        };
        if let Some(volume) = claim.volume.as_deref().and_then(|name| self.volumes.get("", name)) {
            // The PV decides: its driver is the one that will mount it.
            let class = volume.class.as_deref().or(claim.class.as_deref());
            let selected = volume.driver.as_deref().is_some_and(|driver| selection.has_driver(driver))
                || class.is_some_and(|class| selection.has_class(class));
            return if selected { Verdict::Selected } else { Verdict::NotSelected };
        }
        match claim.class.as_deref() {
            // Unbound (or bound to a PV not seen yet): its class will
            // provision it. A stored claim without a class had no default
            // class when it was created.
            Some(class) if !class.is_empty() => self.class_verdict(Some(class), selection),
            _ if claim.volume.is_none() && selection.drivers_empty() => Verdict::NotSelected,
            _ => Verdict::Unresolved(Unresolved::VolumeUnknown),
        }
    }

    /// `class` None: the default class (a claim template without a class
    /// gets it when its claim is created).
    fn class_verdict(&self, class: Option<&str>, selection: &Selection) -> Verdict {
        if class.is_some_and(|class| selection.has_class(class)) {
            return Verdict::Selected;
        }
        if selection.drivers_empty() {
            return Verdict::NotSelected;
        }
        let entry = match class {
            Some(name) => self.classes.get("", name),
            None => self.classes.entries.get("").and_then(|classes| classes.values().find(|class| class.default)),
        };
        match (class, entry) {
            (_, Some(entry)) if selection.has_driver(&entry.provisioner) => Verdict::Selected,
            (_, Some(_)) => Verdict::NotSelected,
            // No default class: the claim stays without one, nothing provisions it.
            (None, None) => Verdict::NotSelected,
            (Some(_), None) => Verdict::Unresolved(Unresolved::ClassUnknown),
        }
    }
}

/// The cache. Cheap to read from many admissions at once.
#[derive(Debug, Default)]
pub struct VolumeCache {
    tables: RwLock<Tables>,
}

impl VolumeCache {
    pub fn new() -> Self {
        Self::default()
    }

    // A panic while holding the lock leaves plain maps behind, still
    // consistent entry by entry: keep serving rather than poison every
    // admission after it.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tables> {
        self.tables.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tables> {
        self.tables.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every watch has listed once.
    pub fn is_ready(&self) -> bool {
        self.read().ready()
    }

    /// An object added or changed.
    pub fn apply<K: Watched>(&self, object: &K) {
        let entry = object.entry();
        let (namespace, name) = (object.namespace().unwrap_or_default(), object.name_any());
        K::table(&mut self.write()).insert(namespace, name, entry);
    }

    /// An object deleted.
    pub fn delete<K: Watched>(&self, object: &K) {
        let (namespace, name) = (object.namespace().unwrap_or_default(), object.name_any());
        K::table(&mut self.write()).remove(&namespace, &name);
    }

    /// A full list: replaces every entry of the kind and marks it synced.
    pub fn replace<K: Watched>(&self, objects: impl IntoIterator<Item = K>) {
        let mut table = Table::default();
        for object in objects {
            table.insert(object.namespace().unwrap_or_default(), object.name_any(), object.entry());
        }
        table.synced = true;
        *K::table(&mut self.write()) = table;
    }

    /// Whether a pod's PVC volume is of a selected driver or class.
    pub fn claim_verdict(&self, namespace: &str, claim: &str, selection: &Selection) -> Verdict {
        let tables = self.read();
        if !tables.ready() {
            return Verdict::Unresolved(Unresolved::CacheNotReady);
        }
        tables.claim_verdict(namespace, claim, selection)
    }

    /// Whether a claim of this class (None: the default class), as in a
    /// generic ephemeral volume's template, is selected.
    pub fn class_verdict(&self, class: Option<&str>, selection: &Selection) -> Verdict {
        if class.is_some_and(|class| selection.has_class(class)) {
            return Verdict::Selected;
        }
        let tables = self.read();
        if !tables.ready() {
            return Verdict::Unresolved(Unresolved::CacheNotReady);
        }
        tables.class_verdict(class, selection)
    }
}

/// Keeps one kind of the cache current: list, then watch, relisting after
/// a watch ends or fails (kube's watcher, with its default back-off). Runs
/// until the task is dropped. A relist is buffered and swapped in whole,
/// so admissions keep reading the last full view meanwhile.
pub async fn feed<K: Watched>(api: Api<K>, cache: Arc<VolumeCache>, on_error: impl Fn(&'static str)) {
    // Any semantic: the first list is served from the API server's watch
    // cache, not from etcd; the watch that follows brings it up to date.
    let config = watcher::Config::default().any_semantic();
    let mut events = pin!(watcher::watcher(api, config).default_backoff());
    let mut relist: Option<Vec<K>> = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => relist = Some(Vec::new()),
            Ok(Event::InitApply(object)) => relist.get_or_insert_with(Vec::new).push(object),
            Ok(Event::InitDone) => {
                let objects = relist.take().unwrap_or_default();
                tracing::info!(kind = K::KIND, count = objects.len(), "listed");
                cache.replace(objects);
            }
            Ok(Event::Apply(object)) => cache.apply(&object),
            Ok(Event::Delete(object)) => cache.delete(&object),
            Err(err) => {
                tracing::warn!(kind = K::KIND, err = %fuse_supervisor_engine::errors::chain(&err), "watch failed; retrying with back-off");
                on_error(K::KIND);
            }
        }
    }
}
