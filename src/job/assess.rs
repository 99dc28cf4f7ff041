//! What one kubelet answer says about a pod with a FUSE container: a pure
//! function of the pod and the name of that container.
use std::fmt;

use fuse_supervisor_engine::kube::pods::runtime_id;
use fuse_supervisor_engine::kube::{ContainerStatus, Pod};

/// How an application container ended, as the kubelet reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppExit {
    pub container: String,
    pub exit_code: i32,
    /// `Completed`, `Error`, `OOMKilled`...
    pub reason: Option<String>,
}

/// `app=0 (Completed), side=1 (Error)`: for logs.
pub struct Exits<'a>(pub &'a [AppExit]);

impl fmt::Display for Exits<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, exit) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{}={}", exit.container, exit.exit_code)?;
            if let Some(reason) = &exit.reason {
                write!(f, " ({reason})")?;
            }
        }
        Ok(())
    }
}

/// An application container that runs now, by its current instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    pub container: String,
    /// The runtime's ID (`containerd://` and the like stripped).
    pub container_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assessment {
    /// `restartPolicy: Always` (or unset, which the API server defaults to
    /// Always): the pod never completes; never touched.
    RestartAlways,
    /// The FUSE container is an init container with `restartPolicy:
    /// Always`: the kubelet itself stops it after the app containers.
    NativeSidecar,
    /// Nothing but the FUSE container: no work whose end to wait for.
    NoApplication,
    /// The FUSE container does not run (any more): nothing to end.
    FuseNotRunning,
    /// Some application containers have not finished: watch the running
    /// ones; the others are waiting to (re)start.
    Working { running: Vec<Running>, waiting: Vec<String> },
    /// `OnFailure` and a non-zero exit: the kubelet restarts that container,
    /// so the pod is not done.
    AwaitingRestart { exits: Vec<AppExit> },
    /// Every application container has terminated for good: end the FUSE
    /// container.
    Finished { exits: Vec<AppExit> },
}

impl Assessment {
    pub fn name(&self) -> &'static str {
        match self {
            Assessment::RestartAlways => "restart-always",
            Assessment::NativeSidecar => "native-sidecar",
            Assessment::NoApplication => "no-application",
            Assessment::FuseNotRunning => "fuse-not-running",
            Assessment::Working { .. } => "working",
            Assessment::AwaitingRestart { .. } => "awaiting-restart",
            Assessment::Finished { .. } => "finished",
        }
    }
}

/// Assesses `pod`, whose container `fuse` serves its FUSE mount.
pub fn assess(pod: &Pod, fuse: &str) -> Assessment {
    if pod.spec.init_containers.iter().any(|c| c.name == fuse && c.is_native_sidecar()) {
        return Assessment::NativeSidecar;
    }
    let policy = pod.spec.restart_policy.as_deref().unwrap_or("Always");
    if policy == "Always" {
        return Assessment::RestartAlways;
    }
    if !pod.status.container_statuses.iter().any(|s| s.name == fuse && s.is_running()) {
        return Assessment::FuseNotRunning;
    }
    let apps: Vec<&str> = pod.spec.containers.iter().map(|c| c.name.as_str()).filter(|name| *name != fuse).collect();
    if apps.is_empty() {
        return Assessment::NoApplication;
    }
    let (mut running, mut waiting, mut exits) = (Vec::new(), Vec::new(), Vec::new());
    for app in apps {
        let status = pod.status.container_statuses.iter().find(|s| s.name == app);
        match status.map(|s| (s, &s.state)) {
            Some((status, state)) if state.running.is_some() => match current_id(status) {
                Some(id) => running.push(Running { container: app.to_owned(), container_id: id.to_owned() }),
                None => waiting.push(app.to_owned()),
            },
            Some((_, state)) if state.terminated.is_some() => {
                // Checked just above.
                let Some(done) = state.terminated.as_ref() else { continue };
                exits.push(AppExit {
                    container: app.to_owned(),
                    exit_code: done.exit_code,
                    reason: done.reason.clone(),
                });
            }
            _ => waiting.push(app.to_owned()),
        }
    }
    if !running.is_empty() || !waiting.is_empty() {
        return Assessment::Working { running, waiting };
    }
    if policy == "OnFailure" && exits.iter().any(|exit| exit.exit_code != 0) {
        return Assessment::AwaitingRestart { exits };
    }
    Assessment::Finished { exits }
}

fn current_id(status: &ContainerStatus) -> Option<&str> {
    status.container_id.as_deref().map(runtime_id).filter(|id| !id.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fuse_supervisor_engine::kube::PodList;

    fn pod(policy: Option<&str>, statuses: serde_json::Value) -> Pod {
        let mut spec = serde_json::json!({"containers": [{"name": "app"}, {"name": "worker"}, {"name": "fluid-fuse"}]});
        if let Some(policy) = policy {
            spec["restartPolicy"] = policy.into();
        }
        let list = serde_json::json!({"items": [{"metadata": {"name": "p", "uid": "u"}, "spec": spec,
            "status": {"containerStatuses": statuses}}]});
        PodList::from_slice(&serde_json::to_vec(&list).unwrap()).unwrap().items.remove(0)
    }

    fn running(name: &str, id: &str) -> serde_json::Value {
        serde_json::json!({"name": name, "containerID": format!("containerd://{id}"),
            "state": {"running": {"startedAt": "2025-03-04T05:06:07Z"}}})
    }

    fn exited(name: &str, code: i32, reason: &str) -> serde_json::Value {
        serde_json::json!({"name": name, "containerID": "containerd://old",
            "state": {"terminated": {"exitCode": code, "reason": reason}}})
    }

    #[test]
    fn never_finishes_whatever_the_exit_codes() {
        let statuses = serde_json::json!([
            exited("app", 0, "Completed"),
            exited("worker", 2, "Error"),
            running("fluid-fuse", "f")
        ]);
        let Assessment::Finished { exits } = assess(&pod(Some("Never"), statuses), "fluid-fuse") else { panic!() };
        assert_eq!(Exits(&exits).to_string(), "app=0 (Completed), worker=2 (Error)");
    }

    #[test]
    fn on_failure_waits_for_a_clean_finish() {
        let failed = serde_json::json!([
            exited("app", 0, "Completed"),
            exited("worker", 1, "Error"),
            running("fluid-fuse", "f")
        ]);
        assert!(matches!(assess(&pod(Some("OnFailure"), failed), "fluid-fuse"), Assessment::AwaitingRestart { .. }));
        let clean = serde_json::json!([
            exited("app", 0, "Completed"),
            exited("worker", 0, "Completed"),
            running("fluid-fuse", "f")
        ]);
        assert!(matches!(assess(&pod(Some("OnFailure"), clean), "fluid-fuse"), Assessment::Finished { .. }));
    }

    #[test]
    fn working_lists_running_ids_and_waiting_containers() {
        let statuses = serde_json::json!([running("app", "a1"),
            {"name": "worker", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}, running("fluid-fuse", "f")]);
        assert_eq!(
            assess(&pod(Some("OnFailure"), statuses), "fluid-fuse"),
            Assessment::Working {
                running: vec![Running { container: "app".into(), container_id: "a1".into() }],
                waiting: vec!["worker".into()]
            }
        );
    }

    #[test]
    fn always_native_sidecars_and_a_stopped_fuse_are_left_alone() {
        let done = serde_json::json!([
            exited("app", 0, "Completed"),
            exited("worker", 0, "Completed"),
            running("fluid-fuse", "f")
        ]);
        assert_eq!(assess(&pod(Some("Always"), done.clone()), "fluid-fuse"), Assessment::RestartAlways);
        assert_eq!(assess(&pod(None, done.clone()), "fluid-fuse"), Assessment::RestartAlways);
        let fuse_done = serde_json::json!([exited("app", 0, "Completed"), exited("fluid-fuse", 0, "Completed")]);
        assert_eq!(assess(&pod(Some("Never"), fuse_done), "fluid-fuse"), Assessment::FuseNotRunning);
        let mut native = pod(Some("Never"), done);
        native.spec.containers.retain(|c| c.name != "fluid-fuse");
        native.spec.init_containers.push(fuse_supervisor_engine::kube::Container {
            name: "fluid-fuse".into(),
            restart_policy: Some("Always".into()),
            ..Default::default()
        });
        assert_eq!(assess(&native, "fluid-fuse"), Assessment::NativeSidecar);
        assert_eq!(runtime_id("containerd://abc"), "abc");
        assert_eq!(runtime_id("abc"), "abc");
    }
}
