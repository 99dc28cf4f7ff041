//! The test world's CSI node plugin (`fuse-supervisor-testbed
//! csi-plugin`): it speaks the real CSI Identity and Node API on a unix
//! socket and mounts a third-party FUSE daemon per volume, as the drivers
//! whose daemons live in their node-plugin container do (ceph-fuse,
//! rclone CSI drivers, csi-s3).
//!
//! A volume's `volume_context` names its daemon (`daemon`: `bindfs`,
//! `sshfs` or `rclone`) and the directory it serves (`source`).
//! `NodeStageVolume` mounts the daemon at the staging path as a child of
//! the plugin; `NodePublishVolume` binds the staging path (or its
//! `subdir` from the context) onto the target, read-only when asked; the
//! unstage and unpublish calls detach. Every daemon (and sshfs's
//! `sftp-server`) dies with the plugin (`SIGKILL` when the plugin's main
//! thread ends, which spawns them all): a plugin killed takes its mounts'
//! daemons with it, and one started again serves its socket and knows no
//! mount, as real plugins do.
//!
//! Two variants: without `STAGE_UNSTAGE_VOLUME` (`--no-stage-unstage`), the
//! daemon is mounted at the target in `NodePublishVolume`; with
//! `--trust-proc-mounts`, `NodeStageVolume` answers OK whenever
//! `/proc/mounts` lists the staging path, dead or not, the common wrong
//! success.
use std::collections::HashMap;
use std::fs;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use fuse_supervisor_sys::mount;
use fuse_supervisor_sys::process::kill_with_parent;
use tonic::{Request, Response, Status};

use super::api::{self, identity_server::Identity, node_server::Node};
use super::serve_identity_and_node;
use crate::observe::fuse_connections_in;
use crate::system::program;

/// How long a daemon may take to mount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(10);
const MOUNT_POLL: Duration = Duration::from_millis(10);

/// What `fuse-supervisor-testbed csi-plugin` was asked.
#[derive(Debug, Clone)]
pub struct PluginOptions {
    pub socket: PathBuf,
    pub name: String,
    pub node_id: String,
    /// Advertise `STAGE_UNSTAGE_VOLUME` (the daemon mounts at the staging
    /// path) or not (it mounts at the target).
    pub stage_unstage: bool,
    /// `NodeStageVolume` answers OK when `/proc/mounts` lists the path.
    pub trust_proc_mounts: bool,
    /// Answer every call OK after checking its fields, mounting nothing:
    /// a driver that costs nothing, for the proxy's bench.
    pub answer_only: bool,
    /// Where each Node call is appended as a line (its name and volume):
    /// how a test tells how often the driver was asked.
    pub call_log: Option<PathBuf>,
    /// `NodeStageVolume` never answers: a hung driver.
    pub hang_stage: bool,
}

/// Serves until SIGTERM (or until killed).
pub fn run(options: PluginOptions) -> io::Result<()> {
    // One thread: the daemons' death signal follows the thread that
    // spawned them, and this one lives as long as the plugin.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        match fs::remove_file(&options.socket) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
            _ => {}
        }
        if let Some(dir) = options.socket.parent() {
            fs::create_dir_all(dir)?;
        }
        let listener = tokio::net::UnixListener::bind(&options.socket)?;
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let shutdown = async move {
            terminate.recv().await;
        };
        serve(options, listener, shutdown).await;
        Ok(())
    })
}

/// Serves the plugin on `listener` until `shutdown` completes.
pub async fn serve(options: PluginOptions, listener: tokio::net::UnixListener, shutdown: impl Future<Output = ()>) {
    let plugin = std::sync::Arc::new(Plugin { options, daemons: Mutex::new(HashMap::new()) });
    serve_identity_and_node(listener, SharedPlugin(plugin.clone()), SharedPlugin(plugin), shutdown).await;
}

/// A volume's daemon and its helper, killed when dropped.
struct Mounted {
    daemon: Child,
    helper: Option<Child>,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        for child in std::iter::once(&mut self.daemon).chain(self.helper.as_mut()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Plugin {
    options: PluginOptions,
    /// The daemon of each mount point it mounted.
    daemons: Mutex<HashMap<PathBuf, Mounted>>,
}

#[derive(Clone)]
struct SharedPlugin(std::sync::Arc<Plugin>);

impl Plugin {
    /// Appends `call volume` to the call log, if there is one.
    fn log_call(&self, call: &str, volume_id: &str) {
        let Some(log) = &self.options.call_log else { return };
        let line = format!("{call} {volume_id}\n");
        let appended = fs::OpenOptions::new().create(true).append(true).open(log).and_then(|mut file| {
            use std::io::Write as _;
            file.write_all(line.as_bytes())
        });
        if let Err(err) = appended {
            eprintln!("csi plugin: cannot append to {}: {err}", log.display());
        }
    }

    fn daemons(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Mounted>> {
        self.daemons.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the daemon it started for `path` still runs.
    fn serves(&self, path: &Path) -> bool {
        self.daemons().get_mut(path).is_some_and(|mounted| matches!(mounted.daemon.try_wait(), Ok(None)))
    }

    /// Mounts the daemon `context` names at `path`, as a child.
    async fn mount_daemon(&self, context: &HashMap<String, String>, path: &Path) -> Result<(), Status> {
        if self.options.answer_only || self.serves(path) {
            return Ok(());
        }
        let source = context.get("source").ok_or_else(|| Status::invalid_argument("volume_context has no source"))?;
        let source = Path::new(source);
        if !source.is_dir() {
            return Err(Status::not_found(format!("source {} does not exist", source.display())));
        }
        let daemon = context.get("daemon").map_or("bindfs", String::as_str);
        fs::create_dir_all(path).map_err(|err| Status::internal(format!("mkdir {}: {err}", path.display())))?;
        let before = fuse_connections_in(&mountinfo(), path);
        let mut mounted = spawn_daemon(daemon, source, path)
            .map_err(|err| Status::internal(format!("cannot start {daemon}: {err}")))?;
        let deadline = tokio::time::Instant::now() + MOUNT_TIMEOUT;
        while fuse_connections_in(&mountinfo(), path).difference(&before).next().is_none() {
            if let Ok(Some(status)) = mounted.daemon.try_wait() {
                return Err(Status::internal(format!("{daemon} exited before it mounted: {status}")));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Status::deadline_exceeded(format!("{daemon} did not mount within {MOUNT_TIMEOUT:?}")));
            }
            tokio::time::sleep(MOUNT_POLL).await;
        }
        self.daemons().insert(path.to_path_buf(), mounted);
        Ok(())
    }

    /// Detaches whatever is mounted at `path` and stops its daemon.
    fn unmount(&self, path: &Path) -> Result<(), Status> {
        if self.options.answer_only {
            return Ok(());
        }
        match mount::detach(path) {
            Ok(()) => {}
            // Not a mount point (EINVAL) or gone (ENOENT): already undone.
            Err(err) if matches!(err.kind(), io::ErrorKind::InvalidInput | io::ErrorKind::NotFound) => {}
            Err(err) => return Err(Status::internal(format!("detach {}: {err}", path.display()))),
        }
        self.daemons().remove(path);
        Ok(())
    }
}

fn spawn_daemon(daemon: &str, source: &Path, path: &Path) -> io::Result<Mounted> {
    let mut helper = None;
    let mut command = match daemon {
        "bindfs" => {
            let mut command = Command::new(program("bindfs"));
            command.args(["-f", "-o", "allow_other"]).arg(source).arg(path);
            command.stdin(Stdio::null()).stdout(Stdio::null());
            command
        }
        "rclone" => {
            let mut command = Command::new(program("rclone"));
            // An empty configuration: a local path needs no remote.
            command.arg("mount").arg(source).arg(path).args(["--config", "/dev/null"]);
            command.args(["--allow-other", "--log-level", "ERROR"]);
            command.stdin(Stdio::null()).stdout(Stdio::null());
            command
        }
        "sshfs" => {
            // Passive mode: SFTP over pipes to a local sftp-server, no network.
            let (from_sshfs, to_server) = io::pipe()?;
            let (from_server, to_sshfs) = io::pipe()?;
            let mut server = Command::new(program("sftp-server"));
            server.stdin(from_sshfs).stdout(to_sshfs).stderr(Stdio::inherit());
            helper = Some(kill_with_parent(&mut server).spawn()?);
            let mut command = Command::new(program("sshfs"));
            command.args(["-f", "-o", "passive,allow_other"]).arg(format!("localhost:{}", source.display())).arg(path);
            command.stdin(from_server).stdout(to_server);
            command
        }
        other => return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("unknown daemon {other}"))),
    };
    command.stderr(Stdio::inherit());
    let daemon = kill_with_parent(&mut command).spawn()?;
    Ok(Mounted { daemon, helper })
}

fn mountinfo() -> String {
    fs::read_to_string("/proc/self/mountinfo").unwrap_or_default()
}

/// Whether `/proc/mounts` lists `path` as a mount point (octal escapes
/// of spaces and the like left as they are: the tests' paths have none).
fn listed_in_proc_mounts(path: &Path) -> bool {
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    let path = path.to_string_lossy();
    mounts.lines().any(|line| line.split(' ').nth(1) == Some(&*path))
}

fn required<'a>(field: &'static str, value: &'a str) -> Result<&'a Path, Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is empty")));
    }
    Ok(Path::new(value))
}

#[tonic::async_trait]
impl Identity for SharedPlugin {
    async fn get_plugin_info(
        &self,
        _: Request<api::GetPluginInfoRequest>,
    ) -> Result<Response<api::GetPluginInfoResponse>, Status> {
        Ok(Response::new(api::GetPluginInfoResponse {
            name: self.0.options.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: HashMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<api::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<api::GetPluginCapabilitiesResponse>, Status> {
        // A node-only plugin: no controller service.
        Ok(Response::new(api::GetPluginCapabilitiesResponse { capabilities: Vec::new() }))
    }

    async fn probe(&self, _: Request<api::ProbeRequest>) -> Result<Response<api::ProbeResponse>, Status> {
        Ok(Response::new(api::ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Node for SharedPlugin {
    async fn node_stage_volume(
        &self,
        request: Request<api::NodeStageVolumeRequest>,
    ) -> Result<Response<api::NodeStageVolumeResponse>, Status> {
        let request = request.into_inner();
        let plugin = &self.0;
        plugin.log_call("NodeStageVolume", &request.volume_id);
        if plugin.options.hang_stage {
            return std::future::pending().await;
        }
        if !plugin.options.stage_unstage {
            return Err(Status::unimplemented("this plugin does not stage"));
        }
        required("volume_id", &request.volume_id)?;
        let path = required("staging_target_path", &request.staging_target_path)?;
        if request.volume_capability.is_none() {
            return Err(Status::invalid_argument("volume_capability is missing"));
        }
        if plugin.options.trust_proc_mounts && listed_in_proc_mounts(path) {
            return Ok(Response::new(api::NodeStageVolumeResponse {}));
        }
        plugin.mount_daemon(&request.volume_context, path).await?;
        Ok(Response::new(api::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<api::NodeUnstageVolumeRequest>,
    ) -> Result<Response<api::NodeUnstageVolumeResponse>, Status> {
        let request = request.into_inner();
        required("volume_id", &request.volume_id)?;
        self.0.unmount(required("staging_target_path", &request.staging_target_path)?)?;
        Ok(Response::new(api::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<api::NodePublishVolumeRequest>,
    ) -> Result<Response<api::NodePublishVolumeResponse>, Status> {
        let request = request.into_inner();
        let plugin = &self.0;
        plugin.log_call("NodePublishVolume", &request.volume_id);
        required("volume_id", &request.volume_id)?;
        let target = required("target_path", &request.target_path)?;
        if plugin.options.stage_unstage {
            let staging = required("staging_target_path", &request.staging_target_path)?;
            let source = match request.volume_context.get("subdir") {
                Some(subdir) => staging.join(subdir),
                None => staging.to_path_buf(),
            };
            if !(plugin.options.answer_only || listed_in_proc_mounts(target)) {
                fs::create_dir_all(target)
                    .and_then(|()| mount::bind(&source, target))
                    .map_err(|err| Status::internal(format!("bind onto {}: {err}", target.display())))?;
            }
        } else {
            plugin.mount_daemon(&request.volume_context, target).await?;
        }
        if request.readonly && !plugin.options.answer_only {
            mount::remount_bind_read_only(target)
                .map_err(|err| Status::internal(format!("read-only {}: {err}", target.display())))?;
        }
        Ok(Response::new(api::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<api::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<api::NodeUnpublishVolumeResponse>, Status> {
        let request = request.into_inner();
        required("volume_id", &request.volume_id)?;
        self.0.unmount(required("target_path", &request.target_path)?)?;
        Ok(Response::new(api::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<api::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<api::NodeGetVolumeStatsResponse>, Status> {
        Err(Status::unimplemented("NodeGetVolumeStats"))
    }

    async fn node_expand_volume(
        &self,
        _: Request<api::NodeExpandVolumeRequest>,
    ) -> Result<Response<api::NodeExpandVolumeResponse>, Status> {
        Err(Status::unimplemented("NodeExpandVolume"))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<api::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<api::NodeGetCapabilitiesResponse>, Status> {
        use api::node_service_capability::{Rpc, Type, rpc};
        let capabilities = if self.0.options.stage_unstage {
            let stage = Rpc { r#type: rpc::Type::StageUnstageVolume.into() };
            vec![api::NodeServiceCapability { r#type: Some(Type::Rpc(stage)) }]
        } else {
            Vec::new()
        };
        Ok(Response::new(api::NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _: Request<api::NodeGetInfoRequest>,
    ) -> Result<Response<api::NodeGetInfoResponse>, Status> {
        Ok(Response::new(api::NodeGetInfoResponse {
            node_id: self.0.options.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}
