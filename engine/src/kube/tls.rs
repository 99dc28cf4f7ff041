//! The kubelet's TLS: its certificates, a verifier that accepts exactly one
//! pinned serving certificate, and a rustls stream over a socket whose every
//! operation is bounded by one deadline.
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Instant;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConnection, DigitallySignedStruct, SignatureScheme};

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

/// A TLS connection whose every socket operation is bounded by one deadline.
pub(super) struct TlsStream {
    pub(super) conn: ClientConnection,
    pub(super) sock: TcpStream,
    pub(super) deadline: Instant,
}

impl TlsStream {
    /// Gives the next socket operation what is left until the deadline.
    pub(super) fn arm(&self) -> io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.sock.set_read_timeout(Some(left))?;
        self.sock.set_write_timeout(Some(left))
    }

    pub(super) fn handshake(&mut self) -> io::Result<()> {
        while self.conn.is_handshaking() {
            if self.conn.wants_write() {
                self.write_tls()?;
            } else {
                self.read_tls()?;
            }
        }
        self.flush()
    }

    pub(super) fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.conn.writer().write_all(bytes)?;
        self.flush()
    }

    pub(super) fn flush(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            self.write_tls()?;
        }
        Ok(())
    }

    pub(super) fn write_tls(&mut self) -> io::Result<()> {
        self.arm()?;
        self.conn.write_tls(&mut self.sock).map_err(timed_out)?;
        Ok(())
    }

    /// Reads and processes TLS records; `Ok(false)` at the end of the stream.
    pub(super) fn read_tls(&mut self) -> io::Result<bool> {
        self.arm()?;
        let n = self.conn.read_tls(&mut self.sock).map_err(timed_out)?;
        if let Err(err) = self.conn.process_new_packets() {
            // Tell the kubelet why (an alert), then report the cause.
            let _ = self.flush();
            return Err(io::Error::new(io::ErrorKind::InvalidData, err));
        }
        if n == 0 && self.conn.is_handshaking() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the kubelet closed the connection in the handshake",
            ));
        }
        Ok(n > 0)
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.conn.reader().read(buf) {
                Ok(n) => return Ok(n),
                // No plaintext yet: read more records.
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                // The peer closed without close_notify: an end of stream
                // like any other; the HTTP framing tells if it was early.
                Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(err) => return Err(err),
            }
            self.flush()?;
            self.read_tls()?;
        }
    }
}

/// A socket timeout shows as `WouldBlock` on Linux; call it what it is.
pub(super) fn timed_out(err: io::Error) -> io::Error {
    if err.kind() == io::ErrorKind::WouldBlock { io::ErrorKind::TimedOut.into() } else { err }
}
