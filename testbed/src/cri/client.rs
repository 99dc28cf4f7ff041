//! A blocking CRI client over containerd's unix socket: the calls the
//! kubelet makes to run a pod, and `ExecSync` to look inside a container.
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use super::api::{self, image_service_client::ImageServiceClient, runtime_service_client::RuntimeServiceClient};
use super::{CriError, io_step};

/// How long one CRI call may take (a container start included).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What a command run in a container with `ExecSync` left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl ExecOutput {
    pub fn succeeded(&self) -> bool {
        self.exit_code == 0
    }
}

/// The CRI `RuntimeService` and `ImageService` of one containerd, each call
/// run to completion on a runtime of its own.
pub struct CriClient {
    socket: PathBuf,
    runtime: tokio::runtime::Runtime,
    channel: Channel,
}

impl CriClient {
    /// Connects to the CRI at `socket` (a unix socket).
    pub fn connect(socket: &Path) -> Result<CriClient, CriError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_step("start the CRI client's runtime"))?;
        let path = socket.to_path_buf();
        // The URI is required and ignored: every connection is to the socket.
        let endpoint = Endpoint::from_static("http://containerd.invalid").timeout(CALL_TIMEOUT);
        let connected = runtime.block_on(endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        })));
        let channel = connected.map_err(|source| CriError::Connect { socket: socket.to_path_buf(), source })?;
        Ok(CriClient { socket: socket.to_path_buf(), runtime, channel })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn runtime_service(&self) -> RuntimeServiceClient<Channel> {
        RuntimeServiceClient::new(self.channel.clone())
    }

    /// `Version`: the runtime's name and version.
    pub fn version(&self) -> Result<api::VersionResponse, CriError> {
        let request = api::VersionRequest { version: "v1".into() };
        self.call("Version", |mut client| async move { client.version(request).await })
    }

    /// `ListImages`: the names of every image the CRI knows.
    pub fn image_names(&self) -> Result<Vec<String>, CriError> {
        let mut images = ImageServiceClient::new(self.channel.clone());
        let listed = self.runtime.block_on(images.list_images(api::ListImagesRequest { filter: None }));
        let listed = listed.map_err(|status| CriError::Call { call: "ListImages", status })?.into_inner();
        Ok(listed.images.into_iter().flat_map(|image| image.repo_tags).collect())
    }

    /// `RunPodSandbox`: the new sandbox's ID.
    pub fn run_pod_sandbox(&self, config: api::PodSandboxConfig) -> Result<String, CriError> {
        let request = api::RunPodSandboxRequest { config: Some(config), runtime_handler: String::new() };
        let answer = self.call("RunPodSandbox", |mut client| async move { client.run_pod_sandbox(request).await })?;
        Ok(answer.pod_sandbox_id)
    }

    /// `CreateContainer` in the sandbox `pod` (made from `pod_config`): the new container's ID.
    pub fn create_container(
        &self,
        pod: &str,
        config: api::ContainerConfig,
        pod_config: api::PodSandboxConfig,
    ) -> Result<String, CriError> {
        let request = api::CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(config),
            sandbox_config: Some(pod_config),
        };
        let answer =
            self.call("CreateContainer", |mut client| async move { client.create_container(request).await })?;
        Ok(answer.container_id)
    }

    pub fn start_container(&self, id: &str) -> Result<(), CriError> {
        let request = api::StartContainerRequest { container_id: id.into() };
        self.call("StartContainer", |mut client| async move { client.start_container(request).await }).map(drop)
    }

    /// `ExecSync` of `command` in container `id`, waiting at most `timeout`.
    pub fn exec_sync(&self, id: &str, command: &[&str], timeout: Duration) -> Result<ExecOutput, CriError> {
        let request = api::ExecSyncRequest {
            container_id: id.into(),
            cmd: command.iter().map(|arg| (*arg).to_owned()).collect(),
            timeout: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX).max(1),
        };
        let answer = self.call("ExecSync", |mut client| async move { client.exec_sync(request).await })?;
        Ok(ExecOutput {
            exit_code: answer.exit_code,
            stdout: String::from_utf8_lossy(&answer.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&answer.stderr).into_owned(),
        })
    }

    /// The host pid of container `id`'s first process, from its verbose
    /// status (containerd's `info` carries it).
    pub fn container_pid(&self, id: &str) -> Result<u32, CriError> {
        let request = api::ContainerStatusRequest { container_id: id.into(), verbose: true };
        let answer =
            self.call("ContainerStatus", |mut client| async move { client.container_status(request).await })?;
        let info = answer.info.get("info").ok_or(CriError::Incomplete { call: "ContainerStatus", what: "info" })?;
        serde_json::from_str::<serde_json::Value>(info)
            .ok()
            .and_then(|info| info.get("pid")?.as_u64())
            .and_then(|pid| u32::try_from(pid).ok())
            .filter(|pid| *pid > 0)
            .ok_or(CriError::Incomplete { call: "ContainerStatus", what: "a pid in its info" })
    }

    /// `StopContainer` with no grace period (SIGKILL), as the tests need no
    /// graceful exit.
    pub fn stop_container(&self, id: &str) -> Result<(), CriError> {
        let request = api::StopContainerRequest { container_id: id.into(), timeout: 0 };
        self.call("StopContainer", |mut client| async move { client.stop_container(request).await }).map(drop)
    }

    pub fn remove_container(&self, id: &str) -> Result<(), CriError> {
        let request = api::RemoveContainerRequest { container_id: id.into() };
        self.call("RemoveContainer", |mut client| async move { client.remove_container(request).await }).map(drop)
    }

    pub fn stop_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let request = api::StopPodSandboxRequest { pod_sandbox_id: id.into() };
        self.call("StopPodSandbox", |mut client| async move { client.stop_pod_sandbox(request).await }).map(drop)
    }

    pub fn remove_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let request = api::RemovePodSandboxRequest { pod_sandbox_id: id.into() };
        self.call("RemovePodSandbox", |mut client| async move { client.remove_pod_sandbox(request).await }).map(drop)
    }

    /// The IDs of every pod sandbox, whatever its state.
    pub fn pod_sandboxes(&self) -> Result<Vec<String>, CriError> {
        let request = api::ListPodSandboxRequest { filter: None };
        let answer = self.call("ListPodSandbox", |mut client| async move { client.list_pod_sandbox(request).await })?;
        Ok(answer.items.into_iter().map(|pod| pod.id).collect())
    }

    /// The IDs of every container, whatever its state.
    pub fn containers(&self) -> Result<Vec<String>, CriError> {
        let request = api::ListContainersRequest { filter: None };
        let answer = self.call("ListContainers", |mut client| async move { client.list_containers(request).await })?;
        Ok(answer.containers.into_iter().map(|container| container.id).collect())
    }

    fn call<T, F>(
        &self,
        call: &'static str,
        request: impl FnOnce(RuntimeServiceClient<Channel>) -> F,
    ) -> Result<T, CriError>
    where
        F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let answer = self.runtime.block_on(request(self.runtime_service()));
        answer.map(tonic::Response::into_inner).map_err(|status| CriError::Call { call, status })
    }
}

impl std::fmt::Debug for CriClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CriClient").field("socket", &self.socket).finish()
    }
}
