//! The serving certificate: read from PEM files and re-read when they
//! change, without a timer.
//!
//! cert-manager (through a Secret volume) and the kubelet replace a Secret's
//! files by swapping the `..data` symlink of the volume's directory, and a
//! manual rotation usually renames or rewrites the files; inotify on the
//! directories holding the two files sees all of these. Every handshake asks
//! [`CertStore`] for the pair current at that moment, so a new pair serves
//! the next connection without a restart. A pair that fails to load (a key
//! written before its certificate, a typo) is logged and the old pair kept.
use std::io;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};

use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use fuse_supervisor_engine::errors::chain;
use fuse_supervisor_engine::watch::dir_changes::{Changes, DirChanges};
use fuse_supervisor_engine::watch::thread::{ThreadError, Waiting, Watching, Woken};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the certificate chain {}", path.display())]
    Certificates {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("no certificate in {}", path.display())]
    NoCertificate { path: PathBuf },
    #[error("cannot read the private key {}", path.display())]
    Key {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("cannot use the key {} with the certificate {}", key.display(), cert.display())]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: Box<rustls::Error>,
    },
    #[error("cannot build the TLS server configuration")]
    Config(#[source] Box<rustls::Error>),
    #[error("cannot watch {} for certificate changes", dir.display())]
    Watch {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Thread(#[from] ThreadError),
}

/// The current certificate and key, and where they come from.
#[derive(Debug)]
pub struct CertStore {
    cert_file: PathBuf,
    key_file: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
}

impl CertStore {
    /// Loads the pair once; fails if it cannot.
    pub fn load(cert_file: impl Into<PathBuf>, key_file: impl Into<PathBuf>) -> Result<Arc<Self>, TlsError> {
        let (cert_file, key_file) = (cert_file.into(), key_file.into());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let current = read_pair(&cert_file, &key_file, &provider)?;
        Ok(Arc::new(CertStore { cert_file, key_file, provider, current: RwLock::new(Arc::new(current)) }))
    }

    /// Re-reads both files. Ok(false) when they hold the pair served already.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let fresh = read_pair(&self.cert_file, &self.key_file, &self.provider)?;
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if current.cert == fresh.cert {
            return Ok(false);
        }
        *current = Arc::new(fresh);
        Ok(true)
    }

    /// The certificate served now (its chain, leaf first).
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.current().cert.clone()
    }

    fn current(&self) -> Arc<CertifiedKey> {
        self.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// A server configuration that asks this store at every handshake,
    /// offering HTTP/2 and HTTP/1.1.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, TlsError> {
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|err| TlsError::Config(Box::new(err)))?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Watches the directories of both files from a thread of its own
    /// and reloads on every change until the returned handle is dropped.
    /// `reloaded` is told of each attempt (`Ok(false)`: nothing new).
    pub fn watch(
        self: &Arc<Self>,
        reloaded: impl Fn(&Result<bool, TlsError>) + Send + 'static,
    ) -> Result<CertWatch, TlsError> {
        let dir = watched_dir(&self.cert_file);
        let setup = |source| TlsError::Watch { dir: dir.clone(), source };
        let mut changes = DirChanges::new().map_err(setup)?;
        for file in [&self.cert_file, &self.key_file] {
            let dir = watched_dir(file);
            changes.watch(&dir, Changes::Files).map_err(|source| TlsError::Watch { dir, source })?;
        }
        let waker = Watching::stop_waker("cert-watch")?;
        let mut waiting = Waiting::new(&waker).map_err(setup)?;
        waiting.add_readable(changes.as_fd(), CHANGED).map_err(setup)?;
        let store = self.clone();
        let watching =
            Watching::start("cert-watch", waker, move || store.watch_loop(&mut changes, &mut waiting, reloaded))?;
        Ok(CertWatch { _watching: watching })
    }

    fn watch_loop(&self, changes: &mut DirChanges, waiting: &mut Waiting, reloaded: impl Fn(&Result<bool, TlsError>)) {
        loop {
            match waiting.wait(None) {
                Ok(Woken::Ready(_)) => {}
                Ok(Woken::Stop) => return,
                Err(err) => {
                    tracing::error!(err = %chain(&err), "certificate watch failed; certificates are no longer reloaded");
                    return;
                }
            }
            let changed = match changes.drain() {
                Ok(changed) => changed,
                Err(err) => {
                    tracing::error!(err = %chain(&err), "cannot read certificate change events; certificates are no longer reloaded");
                    return;
                }
            };
            if changed {
                // One reload per burst: a `..data` swap or a rewrite of
                // both files arrives as several events at once.
                reloaded(&self.reload());
            }
        }
    }
}

const CHANGED: u64 = 0;

/// The certificate watch thread; stopped and joined on drop.
#[derive(Debug)]
pub struct CertWatch {
    _watching: Watching,
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// The directory holding `file`, with symlinks in the directory's own path
/// resolved (the watch refuses a symlink); the file itself may be one.
fn watched_dir(file: &Path) -> PathBuf {
    let dir = match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf())
}

fn read_pair(cert_file: &Path, key_file: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Certificates { path: cert_file.to_path_buf(), source })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate { path: cert_file.to_path_buf() });
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|source| TlsError::Key { path: key_file.to_path_buf(), source })?;
    CertifiedKey::from_der(chain, key, provider).map_err(|err| TlsError::Mismatch {
        cert: cert_file.to_path_buf(),
        key: key_file.to_path_buf(),
        source: Box::new(err),
    })
}
