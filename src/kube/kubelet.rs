//! The process's one kubelet client, shared by the restart confirmation,
//! the Job lifecycle and the Events' pod names, with the last `/pods` list
//! it got: a user that only needs a pod's name finds it there instead of
//! calling again.
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::{KubeletClient, KubeletConfig, KubeletError, PodList};

/// A handle on the shared client; clones share it. The token file is read
/// at every call, through the calling thread's view of the files: call it
/// only from threads that stay in the process's own mount namespace.
#[derive(Clone)]
pub struct Kubelet {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Kubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kubelet").field("addr", &self.shared.client.addr()).finish_non_exhaustive()
    }
}

struct Shared {
    client: KubeletClient,
    last: Mutex<Option<Listed>>,
}

/// One successful `/pods` answer and when it arrived.
#[derive(Clone)]
pub struct Listed {
    pub pods: Arc<PodList>,
    pub at: Instant,
}

impl Kubelet {
    /// Loads the CA or pinned certificate (see [`KubeletClient::new`]).
    pub fn new(config: KubeletConfig) -> Result<Self, KubeletError> {
        Ok(Self::from_client(KubeletClient::new(config)?))
    }

    pub fn from_client(client: KubeletClient) -> Self {
        Kubelet { shared: Arc::new(Shared { client, last: Mutex::new(None) }) }
    }

    /// Calls `/pods`, and keeps a successful answer as the last list.
    pub fn pods(&self) -> Result<Arc<PodList>, KubeletError> {
        let pods = Arc::new(self.shared.client.pods()?);
        *self.shared.last.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Listed { pods: pods.clone(), at: Instant::now() });
        Ok(pods)
    }

    /// The last successful answer of any user of this client, without a call.
    pub fn last_listed(&self) -> Option<Listed> {
        self.shared.last.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}
