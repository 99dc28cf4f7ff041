//! What one report becomes: an owned occurrence of an event, made on the
//! loop thread (a few small strings) and published on another.
use std::fmt::Write as _;
use std::path::{Component, Path};
use std::time::{Duration, SystemTime};

use fuse_supervisor_engine::csi::records::Call;
use fuse_supervisor_engine::csi::restage::{RestageOutcome, RestageResult};
use fuse_supervisor_engine::heal::Healed;
use fuse_supervisor_engine::model::state::Owner;
use fuse_supervisor_engine::report::{ContainersHealed, Report};

/// The events the supervisor publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A pod's FUSE volume mount lost its connection (Warning, on the pod).
    MountBroken,
    /// A pod's FUSE volume mount was healed (Normal, on the pod).
    MountHealed,
    /// A heal of a pod's FUSE volume mount failed; it is retried (Warning, on the pod).
    HealFailed,
    /// The kubelet confirmed that a FUSE daemon's container restarted (Normal, on the daemon's pod).
    DaemonRestarted,
    /// A mount reported broken at its daemon's exit was not: another
    /// process still served it (Normal, on the pod).
    MountRestored,
    /// A dead daemon's own mount was detached from its source path, so
    /// that its restart can mount there (Normal, on the daemon's pod).
    SourceDetached,
    /// A FUSE daemon keeps crashing: its source was healed more than the
    /// limit within the window (Warning, on the daemon's pod).
    DaemonFlapping,
    /// Containers of a pod were healed in their own mount namespaces after
    /// the host heal (Normal, on the pod).
    ContainersHealed,
    /// Some containers of a pod were given up on for this heal: their mount
    /// namespace was not done within the deadline (Warning, on the pod).
    ContainersGivenUp,
    /// Containers of a pod were healed, but their new mounts lack what the
    /// dead ones had: a mount nested in the volume, an idmapping (Warning,
    /// on the pod, naming the mount points).
    ContainersNotCarried,
    /// A pod's CSI volume was staged again through its driver, or the
    /// driver staged it by itself (Normal, on the pod).
    VolumeRestaged,
    /// A pod's CSI volume could not be staged again: no record, the driver
    /// refused, the record holds no secrets (Warning, on the pod).
    VolumeNotRestaged,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MountBroken => "FuseMountBroken",
            Reason::MountHealed => "FuseMountHealed",
            Reason::HealFailed => "FuseHealFailed",
            Reason::DaemonRestarted => "FuseDaemonRestarted",
            Reason::MountRestored => "FuseMountRestored",
            Reason::SourceDetached => "FuseSourceDetached",
            Reason::DaemonFlapping => "FuseDaemonFlapping",
            Reason::ContainersHealed => "FuseContainersHealed",
            Reason::ContainersGivenUp => "FuseContainerHealGivenUp",
            Reason::ContainersNotCarried => "FuseContainerMountsNotCarried",
            Reason::VolumeRestaged => "FuseVolumeRestaged",
            Reason::VolumeNotRestaged => "FuseVolumeNotRestaged",
        }
    }

    /// The event's `action`: what the supervisor did about the pod.
    pub fn action(self) -> &'static str {
        match self {
            Reason::MountBroken | Reason::MountRestored => "Detect",
            Reason::MountHealed
            | Reason::HealFailed
            | Reason::ContainersHealed
            | Reason::ContainersGivenUp
            | Reason::ContainersNotCarried => "Heal",
            Reason::DaemonRestarted => "Confirm",
            Reason::SourceDetached => "Detach",
            Reason::DaemonFlapping => "Detect",
            Reason::VolumeRestaged | Reason::VolumeNotRestaged => "Restage",
        }
    }

    /// `Normal` or `Warning`.
    pub fn event_type(self) -> &'static str {
        match self {
            Reason::MountBroken
            | Reason::HealFailed
            | Reason::DaemonFlapping
            | Reason::ContainersGivenUp
            | Reason::ContainersNotCarried
            | Reason::VolumeNotRestaged => "Warning",
            Reason::MountHealed
            | Reason::DaemonRestarted
            | Reason::MountRestored
            | Reason::SourceDetached
            | Reason::ContainersHealed
            | Reason::VolumeRestaged => "Normal",
        }
    }
}

/// A pod by name, as an event's `regarding` needs it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The pod an event is about: reports name application pods by UID only,
/// which the publisher resolves through the kubelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Regarding {
    Uid(String),
    Pod(PodRef),
}

impl Regarding {
    /// The pod of a FUSE daemon, as the kubelet last confirmed it.
    fn owner(owner: &Owner) -> Self {
        Regarding::Pod(PodRef {
            namespace: owner.namespace.clone(),
            name: owner.pod.clone(),
            uid: owner.pod_uid.clone(),
        })
    }

    pub fn uid(&self) -> &str {
        match self {
            Regarding::Uid(uid) => uid,
            Regarding::Pod(pod) => &pod.uid,
        }
    }
}

/// One event to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Occurrence {
    pub reason: Reason,
    pub regarding: Regarding,
    pub note: String,
    /// When it happened (the event's `eventTime`, or a series' `lastObservedTime`).
    pub at: SystemTime,
}

impl Occurrence {
    /// The event a report calls for, if any; `now` stands in for unknown times.
    pub fn from_report(report: &Report<'_>, now: SystemTime) -> Option<Occurrence> {
        if report.target().is_some_and(|target| target.pod_uid.is_empty()) {
            return None; // A source's bind outside the pods: no pod to tell (its log lines say it).
        }
        let (reason, regarding, note, at) = match report {
            Report::TargetBroken(target) => (
                Reason::MountBroken,
                Regarding::Uid(target.pod_uid.to_owned()),
                format!(
                    "FUSE volume mount {} lost its connection: its source {} is gone or was replaced; \
                     it is healed once a live source answers",
                    pod_path(target.target, target.pod_uid),
                    target.source.display()
                ),
                target.broken_since.unwrap_or(now),
            ),
            Report::TargetHealed { target, heal } => {
                let mut note = format!(
                    "FUSE volume mount {} healed from {} by {}: outage ",
                    pod_path(target.target, target.pod_uid),
                    target.source.display(),
                    match heal.how {
                        Healed::Stacked => "stacking the new mount",
                        Healed::Propagated => "propagation",
                    }
                );
                match heal.outage {
                    Some(outage) => note.push_str(&human(outage)),
                    None => note.push_str("unknown"),
                }
                let layers = heal.layers_removed;
                let _ = write!(
                    note,
                    ", heal latency {}, {layers} stale layer{} removed",
                    human(heal.latency),
                    if layers == 1 { "" } else { "s" }
                );
                (Reason::MountHealed, Regarding::Uid(target.pod_uid.to_owned()), note, now)
            }
            Report::HealFailed { target, error, attempts, retry_in } => (
                Reason::HealFailed,
                Regarding::Uid(target.pod_uid.to_owned()),
                format!(
                    "cannot heal FUSE volume mount {} from {} (attempt {attempts}): {error}; retrying in {}",
                    pod_path(target.target, target.pod_uid),
                    target.source.display(),
                    human(*retry_in)
                ),
                now,
            ),
            Report::DeathRetracted { target, pids } => (
                Reason::MountRestored,
                Regarding::Uid(target.pod_uid.to_owned()),
                format!(
                    "FUSE volume mount {} was not broken after all: the daemon of {} exited, but process {} still \
                     serves it",
                    pod_path(target.target, target.pod_uid),
                    target.source.display(),
                    pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                ),
                now,
            ),
            Report::DaemonRestarted { source, owner } => (
                Reason::DaemonRestarted,
                Regarding::owner(owner),
                format!(
                    "container {} restarted and mounted {} again; the pods using it are being healed",
                    owner.container,
                    source.display()
                ),
                owner.started_at.unwrap_or(now),
            ),
            Report::DeadSourceDetached { source, owner: Some(owner) } => (
                Reason::SourceDetached,
                Regarding::owner(owner),
                format!(
                    "the dead FUSE mount at {} was detached so that container {} can mount there again; the pods \
                     using it stay broken until it does",
                    source.display(),
                    owner.container
                ),
                now,
            ),
            Report::DaemonFlapping { source, heals, window, owner: Some(owner) } => (
                Reason::DaemonFlapping,
                Regarding::owner(owner),
                format!(
                    "container {} keeps crashing: the pods using {} were healed after {heals} restarts within {}",
                    owner.container,
                    source.display(),
                    human(*window)
                ),
                now,
            ),
            Report::ContainersHealed { source, heals } => (
                if heals.given_up > 0 {
                    Reason::ContainersGivenUp
                } else if !heals.not_carried.is_empty() {
                    Reason::ContainersNotCarried
                } else {
                    Reason::ContainersHealed
                },
                Regarding::Pod(PodRef {
                    namespace: heals.namespace.clone(),
                    name: heals.pod.clone(),
                    uid: heals.pod_uid.clone(),
                }),
                containers_note(source, heals),
                now,
            ),
            Report::VolumeRestage { outcome, pod_uid } => {
                let (reason, note) = restage_note(outcome)?;
                (reason, Regarding::Uid((*pod_uid).to_owned()), note, now)
            }
            // A death is published through the FuseMountBroken of each target;
            // a detach from a source no pod is known to serve, in the log.
            Report::TableChanged
            | Report::Scanned(_)
            | Report::KubeletAnswered { .. }
            | Report::DaemonDied { .. }
            | Report::DeadSourceDetached { owner: None, .. }
            | Report::DaemonFlapping { owner: None, .. }
            | Report::ProcessEvent { .. }
            | Report::ContainerHealed { .. }
            | Report::Resynced { .. }
            | Report::Restage(_) => return None,
        };
        Some(Occurrence { reason, regarding, note, at })
    }
}

/// The Event of a re-staging's outcome on each pod of the volume: the
/// driver, volume and status code, never the driver's message (it may
/// quote the request's secrets). None for the outcomes that end in no
/// call because nothing needs one (unstaged, no pod).
fn restage_note(outcome: &RestageOutcome) -> Option<(Reason, String)> {
    let volume = &outcome.volume_id;
    let (driver, path) = (&outcome.driver, outcome.path.display());
    let retry = outcome.retry_in.map(|retry| format!("; retrying in {}", human(retry))).unwrap_or_default();
    let code = outcome.code.map(fuse_supervisor_engine::csi::unary::code_name).unwrap_or("no answer");
    // What was mounted again, and how: the volume's global mount, or (a
    // driver without a staging step) the pod's own mount of it.
    let (verb, done, call, mount) = match outcome.call {
        Call::NodeStageVolume => ("stage", "staged", "NodeStageVolume", "global mount"),
        Call::NodePublishVolume => ("publish", "published", "NodePublishVolume", "FUSE mount"),
    };
    Some(match outcome.result {
        RestageResult::Restaged => (
            Reason::VolumeRestaged,
            format!(
                "CSI volume {volume} {done} again through driver {driver} at {path} after its {mount} died                  ({call} took {}); its mounts are healed from the new one",
                human(outcome.took.unwrap_or_default())
            ),
        ),
        RestageResult::ByDriver => (
            Reason::VolumeRestaged,
            format!(
                "CSI driver {driver} {done} volume {volume} again by itself at {path}; its mounts are healed from it"
            ),
        ),
        RestageResult::NoRecord => (
            Reason::VolumeNotRestaged,
            format!(
                "the {mount} {path} of CSI driver {driver} died and cannot be {done} again: no record of its                  {call} (the CSI proxy was not in front of the driver when it was called); the pod stays                  broken until it is recreated"
            ),
        ),
        RestageResult::Refused => (
            Reason::VolumeNotRestaged,
            format!("CSI driver {driver} refused to {verb} volume {volume} again at {path}: {code}{retry}"),
        ),
        RestageResult::NoSecrets => (
            Reason::VolumeNotRestaged,
            format!(
                "CSI driver {driver} refused to {verb} volume {volume} again at {path} ({code}): the record holds no                  secrets (the proxy runs with --record-secrets off){retry}"
            ),
        ),
        RestageResult::Failed => (
            Reason::VolumeNotRestaged,
            format!("CSI driver {driver} did not answer {call} for volume {volume} at {path}{retry}"),
        ),
        RestageResult::RecordRemoved | RestageResult::NoPods => return None,
    })
}

/// `FUSE volume mounts from <source> healed inside 2 containers, each in
/// its own mount namespace: 1 replaced by the live mount, 1 live again with
/// the new mount stacked on the dead one, which stays beneath until the
/// container exits; containers app, sync`: what `kubectl describe pod`
/// shows a user who knows the pod's containers, not the supervisor. The
/// names come last: a note is cut at 1024 bytes, and a pod with many
/// containers loses names, not the counts.
fn containers_note(source: &Path, heals: &ContainersHealed) -> String {
    let names = heals.containers.iter().map(String::as_str).collect::<Vec<_>>().join(", ");
    let (inside, listed) = match heals.containers.len() {
        1 => (format!("container {names}, in its own mount namespace"), String::new()),
        count => (format!("{count} containers, each in its own mount namespace"), format!("; containers {names}")),
    };
    let mut hows = Vec::new();
    if heals.replaced > 0 {
        hows.push(format!("{} replaced by the live mount", heals.replaced));
    }
    if heals.stacked > 0 {
        hows.push(format!(
            "{} live again with the new mount stacked on the dead one, which stays beneath until the container exits",
            heals.stacked
        ));
    }
    if heals.given_up > 0 {
        hows.push(format!(
            "{} given up on: the container's mount namespace was not done in time (its own mounts held the heal); \
             tried again at the source's next heal",
            heals.given_up
        ));
    }
    if !heals.not_carried.is_empty() {
        hows.push(format!(
            "not carried over to the new mounts (lost with the dead ones): {}",
            heals.not_carried.join(", ")
        ));
    }
    format!("FUSE volume mounts from {} healed inside {inside}: {}{listed}", source.display(), hows.join(", "))
}

/// The target's path within its pod directory (`volumes/…/mount`), which
/// is what a pod's owner recognises; the whole path when it is not under one.
fn pod_path(target: &Path, pod_uid: &str) -> String {
    let mut components = target.components();
    while let Some(component) = components.next() {
        if component == Component::Normal(pod_uid.as_ref()) {
            return components.as_path().display().to_string();
        }
    }
    target.display().to_string()
}

/// `850µs`, `2.7ms`, `1.4s`, `3m12s`.
pub fn human(duration: Duration) -> String {
    let micros = duration.as_micros();
    if micros < 1_000 {
        format!("{micros}µs")
    } else if micros < 1_000_000 {
        format!("{}ms", one_decimal(micros as f64 / 1e3))
    } else if micros < 60_000_000 {
        format!("{}s", one_decimal(micros as f64 / 1e6))
    } else {
        let secs = duration.as_secs();
        format!("{}m{}s", secs / 60, secs % 60)
    }
}

/// `2.7`, and `400` rather than `400.0`.
fn one_decimal(value: f64) -> String {
    let text = format!("{value:.1}");
    match text.strip_suffix(".0") {
        Some(whole) => whole.to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use fuse_supervisor_engine::model::state::Owner;
    use fuse_supervisor_engine::report::{HealReport, TargetEvent};

    fn target<'a>(path: &'a Path, source: &'a Path) -> TargetEvent<'a> {
        TargetEvent { target: path, pod_uid: "uid-1", source, broken_since: None }
    }

    #[test]
    fn a_healed_target_names_outage_latency_and_layers() {
        let path = PathBuf::from("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~csi/pv-1/mount");
        let source = PathBuf::from("/runtime/shared");
        let heal = HealReport {
            how: Healed::Stacked,
            latency: Duration::from_micros(2_700),
            source_wait: Some(Duration::from_micros(1_100)),
            outage: Some(Duration::from_millis(1_400)),
            layers_removed: 1,
        };
        let report = Report::TargetHealed { target: &target(&path, &source), heal: &heal };
        let now = SystemTime::now();
        let occurrence = Occurrence::from_report(&report, now).unwrap();
        assert_eq!(occurrence.reason, Reason::MountHealed);
        assert_eq!(occurrence.regarding, Regarding::Uid("uid-1".into()));
        assert_eq!(occurrence.at, now);
        assert_eq!(
            occurrence.note,
            "FUSE volume mount volumes/kubernetes.io~csi/pv-1/mount healed from /runtime/shared by stacking \
             the new mount: outage 1.4s, heal latency 2.7ms, 1 stale layer removed"
        );
    }

    #[test]
    fn a_broken_target_dates_from_the_start_of_its_outage() {
        let path = PathBuf::from("/elsewhere/mount");
        let source = PathBuf::from("/runtime/shared");
        let since = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let event = TargetEvent { broken_since: Some(since), ..target(&path, &source) };
        let occurrence = Occurrence::from_report(&Report::TargetBroken(&event), SystemTime::now()).unwrap();
        assert_eq!((occurrence.reason.as_str(), occurrence.reason.event_type()), ("FuseMountBroken", "Warning"));
        assert_eq!(occurrence.at, since);
        assert!(occurrence.note.starts_with("FUSE volume mount /elsewhere/mount lost its connection"));
    }

    #[test]
    fn a_restart_is_about_the_owner_pod() {
        let owner = Owner {
            namespace: "kube-system".into(),
            pod: "juicefs-mount".into(),
            pod_uid: "owner-uid".into(),
            container: "jfs-mount".into(),
            container_id: None,
            started_at: None,
        };
        let report = Report::DaemonRestarted { source: Path::new("/var/lib/juicefs/volume/pv"), owner: &owner };
        let occurrence = Occurrence::from_report(&report, SystemTime::now()).unwrap();
        assert_eq!(
            occurrence.regarding,
            Regarding::Pod(PodRef {
                namespace: "kube-system".into(),
                name: "juicefs-mount".into(),
                uid: "owner-uid".into()
            })
        );
        assert_eq!(occurrence.reason.action(), "Confirm");
    }

    #[test]
    fn a_retracted_death_restores_the_mount() {
        let path = PathBuf::from("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~csi/pv-1/mount");
        let source = PathBuf::from("/runtime/shared");
        let report = Report::DeathRetracted { target: &target(&path, &source), pids: &[41, 42] };
        let occurrence = Occurrence::from_report(&report, SystemTime::now()).unwrap();
        assert_eq!((occurrence.reason.as_str(), occurrence.reason.event_type()), ("FuseMountRestored", "Normal"));
        assert_eq!(occurrence.regarding, Regarding::Uid("uid-1".into()));
        assert!(occurrence.note.ends_with("process 41, 42 still serves it"), "{}", occurrence.note);
    }

    #[test]
    fn table_changes_make_no_event() {
        assert_eq!(Occurrence::from_report(&Report::TableChanged, SystemTime::now()), None);
    }

    #[test]
    fn durations_read_at_their_scale() {
        let cases = [
            (Duration::from_micros(850), "850µs"),
            (Duration::from_millis(400), "400ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_secs(192), "3m12s"),
        ];
        for (duration, text) in cases {
            assert_eq!(human(duration), text);
        }
    }

    #[test]
    fn containers_healed_in_their_own_namespaces_are_one_event_on_their_pod() {
        let heals = ContainersHealed {
            namespace: "data".into(),
            pod: "trainer".into(),
            pod_uid: "uid-1".into(),
            containers: ["sync".to_owned(), "app".to_owned()].into(),
            replaced: 1,
            stacked: 1,
            given_up: 0,
            not_carried: Vec::new(),
        };
        let report = Report::ContainersHealed { source: Path::new("/mnt/juicefs"), heals: &heals };
        let occurrence = Occurrence::from_report(&report, SystemTime::now()).unwrap();
        assert_eq!(occurrence.reason.as_str(), "FuseContainersHealed");
        assert_eq!((occurrence.reason.event_type(), occurrence.reason.action()), ("Normal", "Heal"));
        let pod = PodRef { namespace: "data".into(), name: "trainer".into(), uid: "uid-1".into() };
        assert_eq!(occurrence.regarding, Regarding::Pod(pod));
        assert_eq!(
            occurrence.note,
            "FUSE volume mounts from /mnt/juicefs healed inside 2 containers, each in its own mount namespace: 1 \
             replaced by the live mount, 1 live again with the new mount stacked on the dead one, which stays beneath \
             until the container exits; containers app, sync"
        );
        let one = ContainersHealed { containers: ["app".to_owned()].into(), replaced: 2, stacked: 0, ..heals };
        let report = Report::ContainersHealed { source: Path::new("/mnt/juicefs"), heals: &one };
        assert_eq!(
            Occurrence::from_report(&report, SystemTime::now()).unwrap().note,
            "FUSE volume mounts from /mnt/juicefs healed inside container app, in its own mount namespace: 2 \
             replaced by the live mount"
        );
        // Many containers: the counts come before the names, which the
        // 1024-byte cut of a note may take.
        let many = ContainersHealed {
            containers: (0..200).map(|n| format!("worker-with-a-long-name-{n:03}")).collect(),
            replaced: 200,
            stacked: 0,
            ..one
        };
        let report = Report::ContainersHealed { source: Path::new("/mnt/juicefs"), heals: &many };
        let note = Occurrence::from_report(&report, SystemTime::now()).unwrap().note;
        assert!(note.len() > 1024 && note[..1024].contains("200 replaced by the live mount"), "{note}");
    }

    #[test]
    fn nested_mounts_not_carried_over_are_a_warning_naming_them() {
        let heals = ContainersHealed {
            namespace: "data".into(),
            pod: "trainer".into(),
            pod_uid: "uid-1".into(),
            containers: ["app".to_owned()].into(),
            replaced: 1,
            not_carried: vec!["/data/config in app".into()],
            ..ContainersHealed::default()
        };
        let report = Report::ContainersHealed { source: Path::new("/mnt/juicefs"), heals: &heals };
        let occurrence = Occurrence::from_report(&report, SystemTime::now()).unwrap();
        assert_eq!(occurrence.reason.as_str(), "FuseContainerMountsNotCarried");
        assert_eq!(occurrence.reason.event_type(), "Warning");
        assert!(
            occurrence
                .note
                .contains("not carried over to the new mounts (lost with the dead ones): /data/config in app"),
            "{}",
            occurrence.note
        );
    }

    #[test]
    fn containers_given_up_on_are_a_warning_on_their_pod() {
        let heals = ContainersHealed {
            namespace: "data".into(),
            pod: "trainer".into(),
            pod_uid: "uid-1".into(),
            containers: ["app".to_owned(), "tenant".to_owned()].into(),
            replaced: 1,
            stacked: 0,
            given_up: 1,
            not_carried: Vec::new(),
        };
        let report = Report::ContainersHealed { source: Path::new("/mnt/juicefs"), heals: &heals };
        let occurrence = Occurrence::from_report(&report, SystemTime::now()).unwrap();
        assert_eq!(occurrence.reason.as_str(), "FuseContainerHealGivenUp");
        assert_eq!((occurrence.reason.event_type(), occurrence.reason.action()), ("Warning", "Heal"));
        assert!(occurrence.note.contains("1 replaced by the live mount, 1 given up on"), "{}", occurrence.note);
    }
}
