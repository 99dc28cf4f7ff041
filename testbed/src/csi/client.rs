//! A blocking CSI client over a unix socket, calling as the kubelet calls.
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use super::api::{self, identity_client::IdentityClient, node_client::NodeClient};
use super::{CsiError, io_step};

/// How long one call may take (a FUSE daemon's start included).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The CSI Identity and Node services at one socket. Connects lazily: a
/// socket with nothing behind it answers each call `UNAVAILABLE`.
pub struct CsiClient {
    socket: PathBuf,
    runtime: tokio::runtime::Runtime,
    channel: Channel,
}

impl CsiClient {
    pub fn connect(socket: &Path) -> Result<CsiClient, CsiError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_step("start the CSI client's runtime"))?;
        let path = socket.to_path_buf();
        // The URI is required and ignored: every connection is to the socket.
        let endpoint = Endpoint::from_static("http://localhost").timeout(CALL_TIMEOUT);
        let channel = runtime.block_on(async {
            endpoint.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
            }))
        });
        Ok(CsiClient { socket: socket.to_path_buf(), runtime, channel })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.channel.clone())
    }

    fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone())
    }

    pub fn get_plugin_info(&self) -> Result<api::GetPluginInfoResponse, tonic::Status> {
        let mut client = self.identity();
        self.answer(async move { client.get_plugin_info(api::GetPluginInfoRequest {}).await })
    }

    pub fn probe(&self) -> Result<api::ProbeResponse, tonic::Status> {
        let mut client = self.identity();
        self.answer(async move { client.probe(api::ProbeRequest {}).await })
    }

    pub fn get_plugin_capabilities(&self) -> Result<api::GetPluginCapabilitiesResponse, tonic::Status> {
        let mut client = self.identity();
        self.answer(async move { client.get_plugin_capabilities(api::GetPluginCapabilitiesRequest {}).await })
    }

    pub fn node_get_capabilities(&self) -> Result<api::NodeGetCapabilitiesResponse, tonic::Status> {
        let mut client = self.node();
        self.answer(async move { client.node_get_capabilities(api::NodeGetCapabilitiesRequest {}).await })
    }

    pub fn node_get_info(&self) -> Result<api::NodeGetInfoResponse, tonic::Status> {
        let mut client = self.node();
        self.answer(async move { client.node_get_info(api::NodeGetInfoRequest {}).await })
    }

    pub fn stage(&self, request: api::NodeStageVolumeRequest) -> Result<(), tonic::Status> {
        let mut client = self.node();
        self.answer(async move { client.node_stage_volume(request).await }).map(drop)
    }

    pub fn unstage(&self, volume_id: &str, staging_path: &str) -> Result<(), tonic::Status> {
        let request =
            api::NodeUnstageVolumeRequest { volume_id: volume_id.into(), staging_target_path: staging_path.into() };
        let mut client = self.node();
        self.answer(async move { client.node_unstage_volume(request).await }).map(drop)
    }

    pub fn publish(&self, request: api::NodePublishVolumeRequest) -> Result<(), tonic::Status> {
        let mut client = self.node();
        self.answer(async move { client.node_publish_volume(request).await }).map(drop)
    }

    pub fn unpublish(&self, volume_id: &str, target_path: &str) -> Result<(), tonic::Status> {
        let request = api::NodeUnpublishVolumeRequest { volume_id: volume_id.into(), target_path: target_path.into() };
        let mut client = self.node();
        self.answer(async move { client.node_unpublish_volume(request).await }).map(drop)
    }

    fn answer<T>(
        &self,
        call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        self.runtime.block_on(call).map(tonic::Response::into_inner)
    }
}
