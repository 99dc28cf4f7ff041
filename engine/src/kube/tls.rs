//! The kubelet's TLS: its certificates, and a verifier that accepts exactly
//! one pinned serving certificate.
use std::path::Path;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use super::KubeletError;

/// Reads every certificate of a PEM file.
pub(super) fn read_certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, KubeletError> {
    let fail = |source| KubeletError::ReadTrust { what, path: path.to_path_buf(), source };
    let certs = CertificateDer::pem_file_iter(path).map_err(fail)?.collect::<Result<Vec<_>, _>>().map_err(fail)?;
    if certs.is_empty() {
        return Err(fail(rustls::pki_types::pem::Error::NoItemsFound));
    }
    Ok(certs)
}

/// Accepts exactly one certificate (or, with none pinned, any) and checks
/// that the handshake is signed by the presented certificate's key.
#[derive(Debug)]
pub(super) struct ExactCert {
    pub(super) pinned: Option<CertificateDer<'static>>,
    pub(super) algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for ExactCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match &self.pinned {
            Some(pinned) if pinned.as_ref() != end_entity.as_ref() => {
                Err(rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
            }
            _ => Ok(ServerCertVerified::assertion()),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
