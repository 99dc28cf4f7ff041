//! The contract between the manifests under `deploy/` and the binary they run.
//!
//! Each container that runs the fuse-supervisor image has its `args` and
//! `env` parsed by the program's own command line (`--check-config` of
//! `fuse-supervisor` or `fuse-supervisor-webhook`, which also refuses a
//! `FUSE_SUPERVISOR_*` variable that no flag of the command reads, and runs
//! the checks the command's start runs)
//! and gets back what it would run. From that, the tables below name the
//! pod fields, capabilities and API calls the code needs and where; the
//! manifests must grant exactly those. Probe and scrape paths are asked of
//! the binary's own HTTP servers, and every metric the monitoring files
//! query must be in what `/metrics` answers.
//!
//! Kustomizations are rendered here, for the two fields they use
//! (`resources` and `images`; any other field fails the test), and each
//! rendering must be `kubectl kustomize`'s: kubectl is a test package
//! (Debian's `kubernetes-client`, whose kubectl 1.20 carries kustomize 2.0,
//! is the oldest renderer the kustomizations are checked with), so a
//! machine without it fails the test with the line naming it.
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use fuse_supervisor::metrics::{Metrics, MetricsServer};
use fuse_supervisor_engine::health::Health;
use fuse_supervisor_engine::report::{Report, Reporter as _};
use fuse_supervisor_testbed::system;
use fuse_supervisor_webhook::{self as webhook, CertStore, Selection, Server, State, VolumeCache};
use serde::Deserialize;
use serde_json::Value;

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");
const BINARY: &str = env!("CARGO_BIN_EXE_fuse-supervisor");
/// The webhook's image: its entrypoint is its binary.
const WEBHOOK_IMAGE: &str = "fuse-supervisor-webhook";
/// The image's repository name, whatever registry `images:` points it at.
const IMAGE: &str = "fuse-supervisor";

// ---------------------------------------------------------------------------
// What the code needs. Each row names the code that needs it, for a reviewer
// who wonders why a manifest grants something.

/// What `--check-config` says a container would run.
#[derive(Debug, Clone, Deserialize)]
struct Started {
    command: String,
    /// `run`: node, sidecar or sidecar-namespaces.
    mode: Option<String>,
    mount_namespace: Option<PathBuf>,
    kubelet_root: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    #[serde(default)]
    realtime_priority: u8,
    /// None with `--kubelet none`.
    kubelet_authz: Option<String>,
    #[serde(default)]
    events: bool,
    #[serde(default)]
    job_lifecycle: bool,
    #[serde(default)]
    process_connector: bool,
    metrics_addr: Option<SocketAddr>,
    listen: Option<SocketAddr>,
    #[serde(default)]
    tls_files: Vec<PathBuf>,
    staging_dir: Option<PathBuf>,
    /// `run --restage`: the drivers, where their records are read and
    /// each driver's socket (host paths).
    restage: Option<Restage>,
    /// `csi-proxy`: its sockets and record directory (container paths).
    proxy_listen: Option<PathBuf>,
    driver_socket: Option<PathBuf>,
    record_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
struct Restage {
    drivers: Vec<String>,
    records: PathBuf,
    sockets: BTreeMap<String, PathBuf>,
}

impl Started {
    fn mode(&self) -> &str {
        self.mode.as_deref().unwrap_or_default()
    }

    fn heals(&self) -> bool {
        self.command == "run"
    }

    /// The loop joins `--mount-namespace` (the node's) and works on host paths.
    fn in_host_namespace(&self) -> bool {
        self.heals() && matches!(self.mode(), "node" | "sidecar")
    }
}

struct Capability {
    name: &'static str,
    /// Needed: it must be granted. Otherwise it may be.
    required: bool,
    when: fn(&Started) -> bool,
    why: &'static str,
}

fn capabilities() -> Vec<Capability> {
    vec![
        Capability {
            name: "SYS_ADMIN",
            required: true,
            when: Started::heals,
            why: "setns into a mount namespace (sys/src/ns.rs); open_tree, move_mount, mount_setattr, umount2 \
                  and the staging tmpfs of a heal (sys/src/mount.rs)",
        },
        Capability {
            name: "SYS_CHROOT",
            required: true,
            when: Started::heals,
            why: "setns into a mount namespace checks it too: the thread's root changes (sys/src/ns.rs)",
        },
        Capability {
            name: "SYS_PTRACE",
            required: true,
            when: Started::heals,
            why: "opening /proc/1/ns/mnt or a container's /proc/PID/ns/mnt, and reading a FUSE daemon's \
                  /proc/PID/fd, are ptrace read checks on processes with more capabilities (sys/src/ns.rs, \
                  src/supervisor/daemons/, src/sidecar/scan.rs)",
        },
        Capability {
            name: "DAC_READ_SEARCH",
            required: true,
            when: Started::heals,
            why: "a heal opens a subPath's root inside the FUSE volume, whose directories may belong to the \
                  application's user (src/heal/mod.rs, src/heal/in_namespace.rs)",
        },
        Capability {
            name: "SYS_NICE",
            required: true,
            // The namespaces sidecar's loop has no heal priority.
            when: |started| started.in_host_namespace() && started.realtime_priority > 0,
            why: "the heal path runs SCHED_FIFO at --realtime-priority (src/heal/priority.rs, sys/src/process.rs)",
        },
        Capability {
            name: "NET_ADMIN",
            required: false,
            when: |started| started.process_connector,
            why: "the netlink process connector asks for it before Linux 6.6 (sys/src/proc_connector.rs)",
        },
        Capability {
            name: "KILL",
            required: false,
            when: |started| started.job_lifecycle,
            why: "the Job lifecycle signals FUSE daemons; one running as another user than root needs it \
                  (src/kube/job/lifecycle.rs)",
        },
    ]
}

/// Pod fields that must be true exactly when the code needs them.
struct PodField {
    field: &'static str,
    when: fn(&Started) -> bool,
    why: &'static str,
}

fn pod_fields() -> Vec<PodField> {
    vec![
        PodField {
            field: "hostPID",
            when: Started::in_host_namespace,
            why: "the loop joins /proc/1/ns/mnt, the node's mount namespace only in the host's PID namespace, \
                  and finds FUSE daemons in the host's /proc (src/supervisor/, src/supervisor/daemons/)",
        },
        PodField {
            field: "shareProcessNamespace",
            when: |started| started.mode() == "sidecar-namespaces",
            why: "--sidecar-namespaces reaches the other containers' mount namespaces through their \
                  processes (src/sidecar/scan.rs)",
        },
        PodField {
            field: "hostNetwork",
            when: |started| started.process_connector,
            why: "the netlink process connector exists only in the host's network namespace \
                  (sys/src/proc_connector.rs)",
        },
    ]
}

/// One kind of API request, on `group/resource` with `verb`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Access {
    group: String,
    resource: String,
    verb: String,
    /// None: every namespace (or a cluster-scoped resource).
    namespace: Option<String>,
}

struct ApiCall {
    group: &'static str,
    resource: &'static str,
    verbs: &'static [&'static str],
    when: fn(&Started) -> bool,
    /// Only in the pod's own namespace, rather than cluster-wide.
    own_namespace: fn(&Started) -> bool,
    code: &'static str,
}

fn api_calls() -> Vec<ApiCall> {
    let sidecar = |started: &Started| started.mode().starts_with("sidecar");
    vec![
        ApiCall {
            group: "events.k8s.io",
            resource: "events",
            verbs: &["create", "patch"],
            when: |started| started.heals() && started.events,
            // A sidecar reports on its own pod; the node agent on any.
            own_namespace: sidecar,
            code: "src/kube/events/publisher.rs: creates Events, patches a series' count",
        },
        ApiCall {
            group: "",
            resource: "nodes/pods",
            verbs: &["get"],
            when: |started| started.heals() && started.kubelet_authz.as_deref() == Some("nodes-pods"),
            own_namespace: |_| false,
            code: "src/kube/client.rs: GET /pods on the node's kubelet",
        },
        ApiCall {
            group: "",
            resource: "nodes/proxy",
            verbs: &["get"],
            when: |started| started.heals() && started.kubelet_authz.as_deref() == Some("nodes-proxy"),
            own_namespace: |_| false,
            code: "src/kube/client.rs: GET /pods, as kubelets before 1.33 authorize it",
        },
        ApiCall {
            group: "",
            resource: "persistentvolumeclaims",
            verbs: &["list", "watch"],
            when: |started| started.command == "webhook",
            own_namespace: |_| false,
            code: "src/webhook/cache.rs: kube's watcher lists, then watches",
        },
        ApiCall {
            group: "",
            resource: "persistentvolumes",
            verbs: &["list", "watch"],
            when: |started| started.command == "webhook",
            own_namespace: |_| false,
            code: "src/webhook/cache.rs: kube's watcher lists, then watches",
        },
        ApiCall {
            group: "storage.k8s.io",
            resource: "storageclasses",
            verbs: &["list", "watch"],
            when: |started| started.command == "webhook",
            own_namespace: |_| false,
            code: "src/webhook/cache.rs: kube's watcher lists, then watches",
        },
    ]
}

/// Downward-API fields the manifests use, with values of the same shape.
const FIELD_SAMPLES: [(&str, &str); 5] = [
    ("status.hostIP", "10.0.0.7"),
    ("spec.nodeName", "node-a"),
    ("metadata.uid", "0d2c4a57-9f5e-4c7b-a0f4-2b7d8c1e6a93"),
    ("metadata.name", "pod-a"),
    ("metadata.namespace", "default"),
];

/// Metrics the alerts may use that the supervisor does not export: the
/// scrape's own, and kube-state-metrics' (which most Prometheus stacks run).
const FOREIGN_METRICS: [&str; 2] = ["up", "kube_daemonset_status_number_unavailable"];

// ---------------------------------------------------------------------------
// Reading and rendering the manifests.

fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let documents: Vec<Value> =
        serde_saphyr::from_multiple(&text).unwrap_or_else(|err| panic!("{}: not YAML: {err}", path.display()));
    documents.into_iter().filter(|document| !document.is_null()).collect()
}

fn strings(value: &Value) -> Vec<&str> {
    value.as_array().into_iter().flatten().filter_map(Value::as_str).collect()
}

/// `kubectl kustomize DIR`, for the fields the kustomizations here use.
fn render(dir: &Path) -> Vec<Value> {
    let path = dir.join("kustomization.yaml");
    let kustomization = yaml_documents(&path).pop().unwrap_or_else(|| panic!("{}: empty", path.display()));
    for field in kustomization.as_object().into_iter().flat_map(|fields| fields.keys()) {
        assert!(
            matches!(field.as_str(), "apiVersion" | "kind" | "resources" | "images"),
            "{}: `{field}` is not rendered by tests/manifests.rs: teach its render()",
            path.display()
        );
    }
    let mut objects = Vec::new();
    for resource in strings(&kustomization["resources"]) {
        let target = dir.join(resource);
        objects.extend(if target.is_dir() { render(&target) } else { yaml_documents(&target) });
    }
    for image in kustomization["images"].as_array().into_iter().flatten() {
        let name = image["name"].as_str().unwrap_or_default();
        for object in &mut objects {
            for container in containers_mut(object) {
                let Some(current) = container["image"].as_str() else { continue };
                let (repository, tag) = split_image(current);
                if repository != name {
                    continue;
                }
                let repository = image["newName"].as_str().unwrap_or(repository);
                let tag = image["newTag"].as_str().or(tag);
                container["image"] = Value::from(match tag {
                    Some(tag) => format!("{repository}:{tag}"),
                    None => repository.to_owned(),
                });
            }
        }
    }
    objects
}

/// (repository, tag) of an image reference; a digest is dropped.
fn split_image(image: &str) -> (&str, Option<&str>) {
    let image = image.split('@').next().unwrap_or(image);
    match image.rsplit_once(':') {
        Some((repository, tag)) if !tag.contains('/') => (repository, Some(tag)),
        _ => (image, None),
    }
}

/// The rendering must match kubectl's.
fn compare_with_kubectl(dir: &Path, ours: &[Value]) {
    let kubectl = system::program("kubectl");
    let output = Command::new(&kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err}", kubectl.display()));
    assert!(
        output.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let theirs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap_or_else(|err| panic!("kubectl's output: {err}"));
    let sorted = |objects: &[Value]| {
        let mut texts: Vec<String> = objects.iter().filter(|o| !o.is_null()).map(Value::to_string).collect();
        texts.sort();
        texts
    };
    assert_eq!(sorted(ours), sorted(&theirs), "{}: rendered differently from kubectl kustomize", dir.display());
}

fn pod_spec_pointer(kind: &str) -> Option<&'static str> {
    match kind {
        "Pod" => Some("/spec"),
        "DaemonSet" | "Deployment" | "StatefulSet" | "ReplicaSet" | "Job" => Some("/spec/template/spec"),
        "CronJob" => Some("/spec/jobTemplate/spec/template/spec"),
        _ => None,
    }
}

fn pod_spec(object: &Value) -> Option<&Value> {
    object.pointer(pod_spec_pointer(object["kind"].as_str()?)?)
}

fn containers_mut(object: &mut Value) -> Vec<&mut Value> {
    let Some(pointer) = object["kind"].as_str().and_then(pod_spec_pointer) else { return Vec::new() };
    let Some(Value::Object(pod)) = object.pointer_mut(pointer) else { return Vec::new() };
    pod.iter_mut()
        .filter(|(field, _)| matches!(field.as_str(), "initContainers" | "containers"))
        .filter_map(|(_, list)| list.as_array_mut())
        .flatten()
        .collect()
}

fn containers(pod: &Value) -> impl Iterator<Item = &Value> {
    ["initContainers", "containers"].into_iter().flat_map(|field| pod[field].as_array().into_iter().flatten())
}

fn name_of(object: &Value) -> String {
    format!("{}/{}", object["kind"].as_str().unwrap_or("?"), object["metadata"]["name"].as_str().unwrap_or("?"))
}

/// `$(NAME)` replaced by an earlier variable's value, `$$` kept as one `$`,
/// anything else left as it is: Kubernetes' expansion of env and args.
fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(after) = rest.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some((name, after)) = rest.strip_prefix("$(").and_then(|inner| inner.split_once(')')) {
            match env.iter().rev().find(|(key, _)| key == name) {
                Some((_, value)) => out.push_str(value),
                None => out.push_str(&rest[..name.len() + 3]),
            }
            rest = after;
        } else {
            out.push('$');
            rest = &rest[1..];
        }
    }
    out + rest
}

/// The container's environment as the kubelet would set it.
fn container_env(container: &Value) -> Result<Vec<(String, String)>, String> {
    let mut env = Vec::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap_or_default().to_owned();
        let value = if let Some(value) = var["value"].as_str() {
            expand(value, &env)
        } else if let Some(field) = var.pointer("/valueFrom/fieldRef/fieldPath").and_then(Value::as_str) {
            let sample = FIELD_SAMPLES.iter().find(|(path, _)| *path == field);
            sample.ok_or_else(|| format!("env {name}: no sample value for fieldRef {field}"))?.1.to_owned()
        } else if var.get("valueFrom").is_some() {
            return Err(format!(
                "env {name}: takes its value from {}, which this test cannot sample",
                var["valueFrom"]
            ));
        } else {
            String::new()
        };
        env.push((name, value));
    }
    if container.get("envFrom").is_some() {
        return Err("envFrom: its variables cannot be checked".into());
    }
    Ok(env)
}

/// Runs `binary --check-config` on a container's args and env: its own
/// parser and start checks.
fn check_config(binary: &Path, args: &[String], env: &[(String, String)]) -> Result<Started, String> {
    let output = Command::new(binary)
        .arg("--check-config")
        .args(args)
        .env_clear()
        .envs(env.iter().map(|(key, value)| (key, value)))
        .output()
        .map_err(|err| format!("cannot run {}: {err}", binary.display()))?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).trim().to_owned());
    }
    serde_json::from_slice(&output.stdout).map_err(|err| format!("--check-config printed no summary: {err}"))
}

/// The program a container of the project's image `repository` runs: the
/// node agent, or the webhook; either its image's entrypoint.
fn program_of(repository: &str) -> Result<PathBuf, String> {
    if repository != WEBHOOK_IMAGE {
        return Ok(PathBuf::from(BINARY));
    }
    // Another package's binary: `cargo test --workspace` builds it beside
    // this one.
    let webhook = Path::new(BINARY).with_file_name("fuse-supervisor-webhook");
    match webhook.is_file() {
        true => Ok(webhook),
        false => Err(format!(
            "{} is not built: cargo build -p fuse-supervisor-webhook (cargo xtask test builds it)",
            webhook.display()
        )),
    }
}

/// The project's image a container runs (its repository's last part),
/// if it runs one.
fn our_image(container: &Value) -> Option<&str> {
    let repository = split_image(container["image"].as_str()?).0.rsplit('/').next()?;
    [IMAGE, WEBHOOK_IMAGE].into_iter().find(|ours| *ours == repository)
}

/// What a container's args and env start.
fn started_as(container: &Value) -> Result<Started, String> {
    let env = container_env(container)?;
    let args: Vec<String> = strings(&container["args"]).iter().map(|arg| expand(arg, &env)).collect();
    let image = our_image(container).ok_or("not the project's image")?;
    check_config(&program_of(image)?, &args, &env)
}

// ---------------------------------------------------------------------------
// The binary's HTTP servers, asked whether they serve a path.

/// GET `path`: the status and the body.
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|err| panic!("connect {addr}: {err}"));
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.get(9..12).and_then(|code| code.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body).to_owned();
    (status, body)
}

/// The node agent's metrics server, with every family exposed.
fn node_server() -> (MetricsServer, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    // The two families that show a series only once something happened.
    metrics.report(&Report::KubeletAnswered { result: Ok(()), took: Duration::from_millis(2) });
    metrics.report(&Report::ProcessEvent { kind: "exit" });
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), metrics.clone(), Arc::new(Health::new()))
        .expect("start the metrics server");
    (server, metrics)
}

/// Whether the server `command` runs answers `path` on its plain-HTTP port
/// (a probe may well get 503 here: nothing is ready; 404 is what counts).
fn serves(command: &str, path: &str) -> bool {
    let status = match command {
        "run" => {
            let (server, _metrics) = node_server();
            http_get(server.local_addr(), path).0
        }
        "webhook" => {
            let dir = tempfile::tempdir().unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap().self_signed(&key).unwrap();
            std::fs::write(dir.path().join("tls.crt"), cert.pem()).unwrap();
            std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).unwrap();
            let certs = CertStore::load(dir.path().join("tls.crt"), dir.path().join("tls.key")).unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let selection = Selection::new(vec!["csi.example.com".to_owned()], vec![], "skip");
            let state =
                Arc::new(State::new(selection, Arc::new(VolumeCache::new()), Arc::new(webhook::Metrics::new())));
            let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
            let server = runtime.block_on(Server::start(local, local, certs.server_config().unwrap(), state)).unwrap();
            let addr = server.metrics_addr();
            // The server runs on this runtime: ask from a thread beside it.
            let path = path.to_owned();
            let asking = std::thread::spawn(move || http_get(addr, &path).0);
            runtime.block_on(async {
                while !asking.is_finished() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
            asking.join().unwrap()
        }
        _ => return false,
    };
    !matches!(status, 404 | 405 | 0)
}

// ---------------------------------------------------------------------------
// The checks.

/// Every problem with the fuse-supervisor containers of `objects`; `rbac`
/// holds the RBAC objects in force beside them (deploy/ is applied first).
fn problems(objects: &[Value], rbac: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut needs: BTreeMap<(String, String), BTreeMap<Access, String>> = BTreeMap::new();
    let mut accounts = BTreeSet::new();
    for object in objects {
        let Some(pod) = pod_spec(object) else { continue };
        let namespace = object["metadata"]["namespace"].as_str().unwrap_or("default").to_owned();
        let account = pod["serviceAccountName"].as_str().unwrap_or("default").to_owned();
        let mut pod_needs: BTreeMap<&str, (bool, &'static str)> = BTreeMap::new();
        for container in containers(pod) {
            let at = format!("{} container {}", name_of(object), container["name"].as_str().unwrap_or("?"));
            let Some(image) = container["image"].as_str() else { continue };
            if our_image(container).is_none() {
                continue;
            }
            let mut complain = |problem: String| problems.push(format!("{at}: {problem}"));
            if split_image(image).1 != Some(env!("CARGO_PKG_VERSION")) {
                complain(format!("image {image}: the tag is not this version, {}", env!("CARGO_PKG_VERSION")));
            }
            if container.get("command").is_some() {
                complain("sets command: the image's entrypoint is its program, give args only".into());
            }
            let started = match started_as(container) {
                Ok(started) => {
                    container_problems(pod, container, &started, &mut complain);
                    started
                }
                Err(err) => {
                    complain(format!("the binary refuses its args and env: {err}"));
                    continue;
                }
            };
            for field in pod_fields() {
                let entry = pod_needs.entry(field.field).or_insert((false, field.why));
                entry.0 |= (field.when)(&started);
            }
            for call in api_calls().into_iter().filter(|call| (call.when)(&started)) {
                let scope = (call.own_namespace)(&started).then(|| namespace.clone());
                for verb in call.verbs {
                    let access = Access {
                        group: call.group.into(),
                        resource: call.resource.into(),
                        verb: (*verb).into(),
                        namespace: scope.clone(),
                    };
                    needs.entry((namespace.clone(), account.clone())).or_default().insert(access, call.code.into());
                }
            }
            accounts.insert((namespace.clone(), account.clone()));
            if (started.events || started.kubelet_authz.is_some()) && pod["automountServiceAccountToken"] == false {
                complain(
                    "automountServiceAccountToken is false, but its Events or kubelet calls need the token".into(),
                );
            }
        }
        // A sidecar in another program's pod (the CSI proxy in a driver's
        // node plugin) leaves the pod's other fields to that program.
        let shared = containers(pod).any(|container| our_image(container).is_none());
        for (field, (wanted, why)) in pod_needs {
            let set = pod[field].as_bool().unwrap_or(false);
            if set != wanted && (wanted || !shared) {
                let what = if wanted { "needs" } else { "must not have" };
                problems.push(format!("{}: {what} {field}: true: {why}", name_of(object)));
            }
        }
    }
    let in_force: Vec<Value> = rbac.iter().chain(objects).cloned().collect();
    for (namespace, account) in accounts {
        let needed = needs.remove(&(namespace.clone(), account.clone())).unwrap_or_default();
        let granted = grants(&in_force, &namespace, &account, &mut problems);
        let who = format!("ServiceAccount {namespace}/{account}");
        for (access, code) in &needed {
            let covered = granted.iter().any(|grant| same_call(grant, access) && grant.namespace.is_none())
                || granted.contains(access);
            if !covered {
                problems.push(format!("{who}: not granted {} ({code})", describe(access)));
            }
        }
        for grant in &granted {
            let used = needed
                .keys()
                .any(|access| same_call(grant, access) && (grant.namespace.is_some() || access.namespace.is_none()));
            if !used {
                problems.push(format!("{who}: granted {}, which no code of it needs", describe(grant)));
            }
        }
    }
    problems
}

fn same_call(a: &Access, b: &Access) -> bool {
    (&a.group, &a.resource, &a.verb) == (&b.group, &b.resource, &b.verb)
}

fn describe(access: &Access) -> String {
    let group = if access.group.is_empty() { "core" } else { &access.group };
    let scope = access.namespace.as_deref().map_or_else(|| "cluster-wide".to_owned(), |ns| format!("in {ns}"));
    format!("{} {group}/{} {scope}", access.verb, access.resource)
}

/// What the bindings in `objects` grant a service account.
fn grants(objects: &[Value], namespace: &str, account: &str, problems: &mut Vec<String>) -> BTreeSet<Access> {
    let mut granted = BTreeSet::new();
    for binding in objects {
        let kind = binding["kind"].as_str().unwrap_or_default();
        if !matches!(kind, "ClusterRoleBinding" | "RoleBinding") {
            continue;
        }
        let binds_it = binding["subjects"].as_array().into_iter().flatten().any(|subject| {
            subject["kind"] == "ServiceAccount" && subject["name"] == account && subject["namespace"] == namespace
        });
        if !binds_it {
            continue;
        }
        let scope = (kind == "RoleBinding").then(|| binding["metadata"]["namespace"].as_str().unwrap_or("default"));
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
        let role = objects.iter().find(|role| {
            role["kind"] == role_kind
                && role["metadata"]["name"] == binding["roleRef"]["name"]
                && (role_kind == "ClusterRole" || role["metadata"]["namespace"].as_str() == scope)
        });
        let Some(role) = role else {
            problems.push(format!("{}: no {role_kind} {}", name_of(binding), binding["roleRef"]["name"]));
            continue;
        };
        for rule in role["rules"].as_array().into_iter().flatten() {
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        granted.insert(Access {
                            group: group.into(),
                            resource: resource.into(),
                            verb: verb.into(),
                            namespace: scope.map(str::to_owned),
                        });
                    }
                }
            }
        }
    }
    granted
}

/// The container's own fields against what it runs.
fn container_problems(pod: &Value, container: &Value, started: &Started, complain: &mut impl FnMut(String)) {
    let context = &container["securityContext"];
    if context["privileged"] == true {
        complain("privileged: it would get every capability and device".into());
    }
    let dropped = strings(&context["capabilities"]["drop"]);
    if !dropped.contains(&"ALL") {
        complain("capabilities.drop lacks ALL: the runtime's default set would stay".into());
    }
    let added: BTreeSet<&str> =
        strings(&context["capabilities"]["add"]).into_iter().map(|cap| cap.trim_start_matches("CAP_")).collect();
    let table = capabilities();
    for cap in table.iter().filter(|cap| cap.required && (cap.when)(started)) {
        if !added.contains(cap.name) {
            complain(format!("capability {} not added: {}", cap.name, cap.why));
        }
    }
    for name in &added {
        if !table.iter().any(|cap| cap.name == *name && (cap.when)(started)) {
            complain(format!("capability {name} added, but no code of `{}` needs it", started.command));
        }
    }
    if started.heals() {
        for profile in ["seccompProfile", "appArmorProfile"] {
            let kind = context[profile]["type"].as_str().or(pod["securityContext"][profile]["type"].as_str());
            if !matches!(kind, Some("Unconfined" | "Localhost")) {
                complain(format!(
                    "{profile} {}: the runtime's default profiles refuse mount(2) or the new mount API \
                     (open_tree, move_mount, mount_setattr), which every heal uses",
                    kind.unwrap_or("unset")
                ));
            }
        }
    }
    if started.in_host_namespace() {
        if started.mount_namespace.as_deref() != Some(Path::new("/proc/1/ns/mnt")) {
            complain(format!(
                "--mount-namespace {:?}: with hostPID the node's is /proc/1/ns/mnt",
                started.mount_namespace
            ));
        }
        state_dir_problems(pod, container, started, complain);
    }
    let ports: BTreeMap<&str, u64> = container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|port| Some((port["name"].as_str()?, port["containerPort"].as_u64()?)))
        .collect();
    for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
        let Some(spec) = container.get(probe) else { continue };
        let Some(get) = spec.get("httpGet") else {
            complain(format!("{probe}: not an httpGet probe on the health endpoints"));
            continue;
        };
        let port = match &get["port"] {
            Value::String(name) => ports.get(name.as_str()).copied(),
            port => port.as_u64(),
        };
        let served = started.metrics_addr.map(|addr| u64::from(addr.port()));
        if port.is_none() || port != served {
            complain(format!("{probe}: port {} is not where /healthz and /readyz listen ({served:?})", get["port"]));
        }
        if !matches!(get["scheme"].as_str(), None | Some("HTTP")) {
            complain(format!("{probe}: scheme {}: the health endpoints are plain HTTP", get["scheme"]));
        }
        let path = get["path"].as_str().unwrap_or("/");
        if !serves(&started.command, path) {
            complain(format!("{probe}: `{}` does not serve {path}", started.command));
        }
    }
    if let Some(listen) = started.listen
        && !ports.values().any(|port| *port == u64::from(listen.port()))
    {
        complain(format!("no containerPort for the webhook's {listen}"));
    }
    let mounts: Vec<&Value> = container["volumeMounts"].as_array().into_iter().flatten().collect();
    for file in &started.tls_files {
        let whole_directory = mounts.iter().any(|mount| {
            Some(Path::new(mount["mountPath"].as_str().unwrap_or_default())) == file.parent()
                && mount.get("subPath").is_none()
        });
        if !whole_directory {
            complain(format!(
                "{}: its directory is not a volume mount (a subPath would never be reloaded)",
                file.display()
            ));
        }
    }
}

/// The state file is written from the node's mount namespace: `--state-dir`
/// must be a host directory of the pod's, and where the container mounts
/// it, `status` in the container must find it at the same path.
fn state_dir_problems(pod: &Value, container: &Value, started: &Started, complain: &mut impl FnMut(String)) {
    let (Some(state_dir), Some(kubelet_root)) = (&started.state_dir, &started.kubelet_root) else { return };
    let uid = FIELD_SAMPLES.iter().find(|(field, _)| *field == "metadata.uid").map_or("", |(_, uid)| uid);
    let on_host = |volume: &Value| -> Option<PathBuf> {
        if let Some(path) = volume.pointer("/hostPath/path").and_then(Value::as_str) {
            return Some(PathBuf::from(path));
        }
        let name = volume["name"].as_str()?;
        volume.get("emptyDir").map(|_| kubelet_root.join(format!("pods/{uid}/volumes/kubernetes.io~empty-dir/{name}")))
    };
    let volume =
        pod["volumes"].as_array().into_iter().flatten().find(|volume| on_host(volume).as_ref() == Some(state_dir));
    let Some(volume) = volume else {
        complain(format!(
            "--state-dir {}: no volume of the pod is that directory on the node, where the state file is written",
            state_dir.display()
        ));
        return;
    };
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        if mount["name"] == volume["name"] && Path::new(mount["mountPath"].as_str().unwrap_or_default()) != state_dir {
            complain(format!("volume {} is mounted at {}, not at --state-dir", volume["name"], mount["mountPath"]));
        }
    }
}

// ---------------------------------------------------------------------------
// The tests.

fn deploy(part: &str) -> PathBuf {
    Path::new(DEPLOY).join(part)
}

fn assert_none(what: &str, problems: &[String]) {
    assert!(problems.is_empty(), "{what}:\n  {}", problems.join("\n  "));
}

#[test]
fn kustomizations_render_as_kubectl_does() {
    for dir in ["", "webhook", "monitoring"] {
        let dir = deploy(dir);
        compare_with_kubectl(&dir, &render(&dir));
    }
}

#[test]
fn the_daemonset_gets_what_the_node_agent_needs_and_no_more() {
    let base = render(&deploy(""));
    assert!(base.iter().any(|object| object["kind"] == "DaemonSet"), "no DaemonSet in deploy/");
    assert_none("deploy/", &problems(&base, &[]));
}

#[test]
fn the_webhook_gets_what_it_needs_and_no_more() {
    let webhook = render(&deploy("webhook"));
    assert!(webhook.iter().any(|object| object["kind"] == "Deployment"), "no Deployment in deploy/webhook/");
    assert_none("deploy/webhook/", &problems(&webhook, &render(&deploy(""))));
}

#[test]
fn each_example_gets_what_its_mode_needs_and_no_more() {
    let base = render(&deploy(""));
    let mut seen = 0;
    for entry in std::fs::read_dir(deploy("examples")).unwrap() {
        let path = entry.unwrap().path();
        let objects = yaml_documents(&path);
        seen += objects.iter().filter(|object| pod_spec(object).is_some()).count();
        assert_none(&path.display().to_string(), &problems(&objects, &base));
    }
    assert!(seen >= 2, "the two sidecar examples were not found");
}

/// The node path `path` of `container` is, through its hostPath volume
/// mounts (the deepest mount that holds it).
fn host_path(pod: &Value, container: &Value, path: &Path) -> Option<PathBuf> {
    let mounts = container["volumeMounts"].as_array().into_iter().flatten();
    let (mount, rest) = mounts
        .filter_map(|mount| Some((mount, path.strip_prefix(mount["mountPath"].as_str()?).ok()?)))
        .min_by_key(|(_, rest)| rest.components().count())?;
    let volume = pod["volumes"].as_array().into_iter().flatten().find(|volume| volume["name"] == mount["name"])?;
    Some(Path::new(volume.pointer("/hostPath/path")?.as_str()?).join(rest))
}

/// The value of `--flag=value` in a container's args.
fn flag_value<'a>(container: &'a Value, flag: &str) -> Option<&'a str> {
    strings(&container["args"]).into_iter().find_map(|arg| arg.strip_prefix(flag)?.strip_prefix('='))
}

/// The sidecar patch of a CSI node plugin and the agent's `--restage`
/// agree on the node's paths: the registrar registers the proxy's socket
/// (and dials it), the records go on the node's tmpfs in a directory of
/// the agent's `--csi-records`, outside its staging tmpfs, and the agent
/// dials the driver's own socket where the driver serves it.
#[test]
fn the_csi_sidecar_patch_and_the_agents_restage_flags_agree() {
    let example = yaml_documents(&deploy("examples/csi-restage-cephfs-nodeplugin.yaml"));
    let daemonset = example.iter().find(|object| object["kind"] == "DaemonSet").expect("the node plugin's DaemonSet");
    let pod = pod_spec(daemonset).unwrap();
    let is_ours = |container: &&Value| {
        container["image"].as_str().is_some_and(|image| split_image(image).0.rsplit('/').next() == Some(IMAGE))
    };
    let proxy = containers(pod).find(is_ours).expect("the csi-proxy container");
    let started = started_as(proxy).expect("the proxy's args and env");
    assert_eq!(started.command, "csi-proxy");
    let on_node = |container: &Value, path: &Option<PathBuf>| {
        let path = path.as_deref().expect("a path");
        host_path(pod, container, path).unwrap_or_else(|| panic!("{} is on no hostPath", path.display()))
    };
    let listen = on_node(proxy, &started.proxy_listen);
    let driver_socket = on_node(proxy, &started.driver_socket);
    let records = on_node(proxy, &started.record_dir);
    let registrar = containers(pod)
        .find(|container| container["image"].as_str().is_some_and(|image| image.contains("csi-node-driver-registrar")))
        .expect("the node-driver-registrar");
    let registered = flag_value(registrar, "--kubelet-registration-path").expect("--kubelet-registration-path");
    assert_eq!(Path::new(registered), listen, "the kubelet must dial the proxy");
    let dialed = flag_value(registrar, "--csi-address").expect("--csi-address");
    assert_eq!(host_path(pod, registrar, Path::new(dialed)).as_deref(), Some(listen.as_path()));
    assert!(records.starts_with("/run"), "records on the node's tmpfs, not {}", records.display());
    let driver = records.file_name().expect("a directory per driver").to_string_lossy().into_owned();

    // The agent, with --restage as the DaemonSet's comment says.
    let mut base = render(&deploy(""));
    for object in &mut base {
        for container in containers_mut(object) {
            if let Some(env) = container["env"].as_array_mut() {
                env.push(serde_json::json!({"name": "FUSE_SUPERVISOR_RESTAGE", "value": driver}));
            }
        }
    }
    assert_none("deploy/ with --restage", &problems(&base, &[]));
    let agent = base
        .iter()
        .filter_map(pod_spec)
        .flat_map(containers)
        .find(is_ours)
        .map(|container| started_as(container).expect("the agent's args and env"))
        .expect("the agent's container");
    let restage = agent.restage.expect("--restage is on");
    assert_eq!(restage.drivers, std::slice::from_ref(&driver));
    assert_eq!(records.parent(), Some(restage.records.as_path()), "the records are not where the agent reads");
    assert_eq!(restage.sockets.get(&driver), Some(&driver_socket), "the agent would not dial the driver's own socket");
    let staging = agent.staging_dir.expect("--staging-dir");
    assert!(
        !records.starts_with(&staging),
        "the agent's staging tmpfs at {} would hide the records",
        staging.display()
    );
}

#[test]
fn the_opt_in_nodes_proxy_rule_covers_the_kubelet_call_it_is_for() {
    let mut base = render(&deploy(""));
    let optional = yaml_documents(&deploy("optional/nodes-proxy.yaml"));
    // As docs/security.md says to opt in: the rule applied, the flag set.
    for object in &mut base {
        for container in containers_mut(object) {
            if let Some(env) = container["env"].as_array_mut() {
                env.push(serde_json::json!({"name": "FUSE_SUPERVISOR_KUBELET_AUTHZ", "value": "nodes-proxy"}));
            }
        }
    }
    let problems = problems(&base, &optional);
    let missing: Vec<&String> = problems.iter().filter(|problem| !problem.contains("no code of it needs")).collect();
    assert!(missing.is_empty(), "{missing:#?}");
    assert!(
        problems.iter().any(|problem| problem.contains("nodes/pods")) && problems.len() == 1,
        "with nodes-proxy only the unused nodes/pods rule should be left over: {problems:#?}"
    );
}

/// The example NetworkPolicy selects the DaemonSet's pods, in their
/// namespace, and admits to their metrics port (the one the agent is told
/// to listen on) only a pod selector and an address block, for the
/// scraper and the kubelet's probes.
#[test]
fn the_example_network_policy_guards_the_metrics_port_of_the_node_agent() {
    let base = render(&deploy(""));
    let daemonset = base.iter().find(|object| object["kind"] == "DaemonSet").expect("a DaemonSet in deploy/");
    let path = deploy("examples/networkpolicy.yaml");
    let policies: Vec<Value> =
        yaml_documents(&path).into_iter().filter(|object| object["kind"] == "NetworkPolicy").collect();
    let [policy] = policies.as_slice() else { panic!("{}: one NetworkPolicy, not {}", path.display(), policies.len()) };
    assert_eq!(policy["metadata"]["namespace"], daemonset["metadata"]["namespace"]);
    let labels = &daemonset["spec"]["template"]["metadata"]["labels"];
    let selector = policy["spec"]["podSelector"]["matchLabels"].as_object().expect("a podSelector by labels");
    assert!(!selector.is_empty() && selector.iter().all(|(key, value)| labels[key] == *value), "{selector:?}");
    assert_eq!(policy["spec"]["policyTypes"], serde_json::json!(["Ingress"]), "egress must stay open");

    let agent = containers(pod_spec(daemonset).unwrap()).find(|container| container["name"] == "fuse-supervisor");
    let agent = agent.expect("the fuse-supervisor container");
    let env = container_env(agent).unwrap();
    let listen = env.iter().find(|(name, _)| name == "FUSE_SUPERVISOR_METRICS_ADDR").expect("a metrics address");
    let rules = policy["spec"]["ingress"].as_array().expect("ingress rules");
    let [rule] = rules.as_slice() else { panic!("one ingress rule, not {rules:?}") };
    for port in rule["ports"].as_array().expect("the rule names its ports") {
        let number = match &port["port"] {
            Value::String(name) => agent["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|declared| declared["name"] == *name)
                .unwrap_or_else(|| panic!("no container port named {name}"))["containerPort"]
                .clone(),
            number => number.clone(),
        };
        assert!(listen.1.ends_with(&format!(":{number}")), "port {number}, but the agent listens on {}", listen.1);
    }
    let from = rule["from"].as_array().expect("the rule names its sources");
    let kinds: BTreeSet<&str> = from
        .iter()
        .flat_map(|source| source.as_object().into_iter().flat_map(|fields| fields.keys()))
        .map(String::as_str)
        .collect();
    assert_eq!(kinds, BTreeSet::from(["ipBlock", "namespaceSelector", "podSelector"]), "{from:?}");
}

/// The checks themselves: each way of breaking the DaemonSet that they
/// claim to catch must be caught, or they would pass anything.
#[test]
fn the_checks_refuse_a_broken_daemonset() {
    let base = render(&deploy(""));
    let broken = |change: &dyn Fn(&mut Value), expected: &str| {
        let mut objects = base.clone();
        let daemonset = objects.iter_mut().find(|object| object["kind"] == "DaemonSet").unwrap();
        change(daemonset);
        let problems = problems(&objects, &[]);
        assert!(problems.iter().any(|problem| problem.contains(expected)), "`{expected}` not found in {problems:#?}");
    };
    let spec = "/spec/template/spec";
    let container = "/spec/template/spec/containers/0";
    broken(&|ds| drop(ds.pointer_mut(spec).unwrap().as_object_mut().unwrap().remove("hostPID")), "needs hostPID");
    broken(
        &|ds| {
            let env = ds.pointer_mut(&format!("{container}/env")).unwrap().as_array_mut().unwrap();
            let var = env.iter_mut().find(|var| var["name"] == "FUSE_SUPERVISOR_STATE_DIR").unwrap();
            var["name"] = "FUSE_SUPERVISOR_STATEDIR".into();
        },
        "reads no FUSE_SUPERVISOR_STATEDIR",
    );
    broken(
        &|ds| ds.pointer_mut(&format!("{container}/args")).unwrap().as_array_mut().unwrap().push("--realtime".into()),
        "the binary refuses its args and env",
    );
    broken(
        &|ds| {
            let add = ds.pointer_mut(&format!("{container}/securityContext/capabilities/add")).unwrap();
            add.as_array_mut().unwrap().retain(|cap| cap != "SYS_NICE");
        },
        "capability SYS_NICE not added",
    );
    broken(
        &|ds| {
            let add = ds.pointer_mut(&format!("{container}/securityContext/capabilities/add")).unwrap();
            add.as_array_mut().unwrap().push("NET_RAW".into());
        },
        "capability NET_RAW added",
    );
    broken(
        &|ds| ds.pointer_mut(&format!("{container}/livenessProbe/httpGet")).unwrap()["path"] = "/livez".into(),
        "does not serve /livez",
    );
    broken(
        &|ds| ds.pointer_mut(&format!("{container}/readinessProbe/httpGet")).unwrap()["port"] = 9810.into(),
        "readinessProbe: port",
    );
    broken(
        &|ds| ds.pointer_mut(&format!("{container}/volumeMounts/0")).unwrap()["mountPath"] = "/state".into(),
        "not at --state-dir",
    );
    let mut objects = base.clone();
    let role = objects.iter_mut().find(|object| object["kind"] == "ClusterRole").unwrap();
    role["rules"].as_array_mut().unwrap().retain(|rule| !strings(&rule["resources"]).contains(&"events"));
    let problems = problems(&objects, &[]);
    assert!(
        problems.iter().any(|problem| problem.contains("not granted create events.k8s.io/events")),
        "{problems:#?}"
    );
}

/// Metric names an expression (or any text) names: the supervisor's by
/// their prefix, kube-state-metrics' by theirs.
fn named_metrics(text: &str) -> BTreeSet<&str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|token| token.starts_with("fuse_supervisor_") || token.starts_with("kube_"))
        .collect()
}

fn strings_in(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(text) => out.push(text.clone()),
        Value::Array(items) => items.iter().for_each(|item| strings_in(item, out)),
        Value::Object(fields) => fields.values().for_each(|item| strings_in(item, out)),
        _ => {}
    }
}

#[test]
fn monitoring_scrapes_the_daemonset_and_queries_only_metrics_it_exports() {
    let base = render(&deploy(""));
    let monitoring = render(&deploy("monitoring"));
    let daemonset = base.iter().find(|object| object["kind"] == "DaemonSet").expect("a DaemonSet");
    let template = &daemonset["spec"]["template"];
    let container = &template["spec"]["containers"][0];
    let started = started_as(container).expect("the DaemonSet's container starts");
    let metrics_port = started.metrics_addr.expect("metrics are served").port();

    // The PodMonitor finds the DaemonSet's pods and their metrics port.
    let monitor = monitoring.iter().find(|object| object["kind"] == "PodMonitor").expect("a PodMonitor");
    assert_eq!(monitor["metadata"]["namespace"], daemonset["metadata"]["namespace"], "PodMonitor namespace");
    for (label, value) in monitor["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels") {
        assert_eq!(&template["metadata"]["labels"][label], value, "the pods lack the PodMonitor's label {label}");
    }
    let (server, _metrics) = node_server();
    for endpoint in monitor["spec"]["podMetricsEndpoints"].as_array().expect("podMetricsEndpoints") {
        let port = container["ports"].as_array().into_iter().flatten().find(|port| port["name"] == endpoint["port"]);
        let port = port.unwrap_or_else(|| panic!("no container port named {}", endpoint["port"]));
        assert_eq!(
            port["containerPort"].as_u64(),
            Some(u64::from(metrics_port)),
            "{} is not the metrics port",
            endpoint["port"]
        );
        let path = endpoint["path"].as_str().unwrap_or("/metrics");
        assert_eq!(http_get(server.local_addr(), path).0, 200, "the scrape path {path}");
    }

    // What /metrics answers, every family with a series.
    let (status, exposition) = http_get(server.local_addr(), "/metrics");
    assert_eq!(status, 200);
    let exported: BTreeSet<&str> = exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split(['{', ' ']).next())
        .collect();
    let known = |name: &str| exported.contains(name) || FOREIGN_METRICS.contains(&name);

    let rule = monitoring.iter().find(|object| object["kind"] == "PrometheusRule").expect("a PrometheusRule");
    let mut alerts = 0;
    for group in rule["spec"]["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let expr = rule["expr"].as_str().expect("expr");
            let names = named_metrics(expr);
            assert!(
                !names.is_empty() || expr.contains("up{"),
                "{}: queries no metric of the supervisor",
                rule["alert"]
            );
            for name in names {
                assert!(known(name), "{}: {name} is not exported (exported: {exported:?})", rule["alert"]);
            }
            alerts += 1;
        }
    }
    assert!(alerts >= 4, "the four alerts of the issue");

    let path = deploy("monitoring/dashboard.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("dashboard.json is JSON");
    let mut texts = Vec::new();
    strings_in(&dashboard, &mut texts);
    let queried: BTreeSet<&str> = texts.iter().flat_map(|text| named_metrics(text)).collect();
    assert!(queried.len() >= 10, "the dashboard queries few metrics: {queried:?}");
    for name in queried {
        assert!(exported.contains(name), "dashboard.json: {name} is not exported");
    }
}
