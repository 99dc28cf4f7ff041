//! The process's one kubelet client, shared by the restart confirmation,
//! the Job lifecycle and the Events' pod names, with the last `/pods` list
//! it got: a user that only needs a pod's name finds it there instead of
//! calling again.
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use super::{KubeletClient, KubeletConfig, KubeletError, PodList};

/// A handle on the shared client; clones share it. Files are read at
/// [`Kubelet::load`] (the CA or pinned certificate) and at every call (the
/// token), through the calling thread's view of the files: use it only from
/// threads that stay in the process's own mount namespace.
#[derive(Clone)]
pub struct Kubelet {
    shared: Arc<Shared>,
}

struct Shared {
    config: KubeletConfig,
    client: OnceLock<KubeletClient>,
    last: Mutex<Option<Listed>>,
}

/// One successful `/pods` answer and when it arrived.
#[derive(Clone)]
pub struct Listed {
    pub pods: Arc<PodList>,
    pub at: Instant,
}

impl Kubelet {
    /// Reads nothing yet: flags are checked before anything starts.
    pub fn new(config: KubeletConfig) -> Self {
        Kubelet { shared: Arc::new(Shared { config, client: OnceLock::new(), last: Mutex::new(None) }) }
    }

    /// Loads the CA or pinned certificate, once for every user (see
    /// [`KubeletClient::new`]). Each user calls it as it starts, so that a
    /// bad file stops the start rather than failing a later call.
    pub fn load(&self) -> Result<&KubeletClient, KubeletError> {
        if let Some(client) = self.shared.client.get() {
            return Ok(client);
        }
        let client = KubeletClient::new(self.shared.config.clone())?;
        // Two users loading at once: both loaded the same files, one is kept.
        Ok(self.shared.client.get_or_init(|| client))
    }

    pub fn config(&self) -> &KubeletConfig {
        &self.shared.config
    }

    /// Calls `/pods`, and keeps a successful answer as the last list.
    pub fn pods(&self) -> Result<Arc<PodList>, KubeletError> {
        let pods = Arc::new(self.load()?.pods()?);
        *self.shared.last.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Listed { pods: pods.clone(), at: Instant::now() });
        Ok(pods)
    }

    /// The last successful answer of any user of this client, without a call.
    pub fn last_listed(&self) -> Option<Listed> {
        self.shared.last.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

#[cfg(any(test, feature = "testbed"))]
impl Kubelet {
    /// As if `/pods` had just answered `pods` (for tests).
    pub fn set_last_listed(&self, pods: PodList) {
        *self.shared.last.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Listed { pods: Arc::new(pods), at: Instant::now() });
    }
}

impl std::fmt::Debug for Kubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let config = &self.shared.config;
        f.debug_struct("Kubelet").field("host", &config.host).field("port", &config.port).finish_non_exhaustive()
    }
}
