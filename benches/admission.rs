//! Admission latency of the webhook for one pod of 20 containers × 10
//! mounts (half of them on the selected driver, so 100 mounts patched):
//! the work of one review (decode, policy, patch, encode), its decode and
//! its policy alone, and a round trip over HTTPS on a kept-alive connection as the API
//! server holds one. Prints percentiles; `cargo bench --bench admission`
//! (`--containers N --mounts N --samples N`, or ADMISSION_BENCH_*).
use std::hint::black_box;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_supervisor_testbed::admission::{JUICEFS_DRIVER, fixture_cache, large_pod_review};
use fuse_supervisor_webhook::policy::{self, Scope};
use fuse_supervisor_webhook::{
    self as webhook, CertStore, DEFAULT_OPT_OUT_ANNOTATION, Metrics, Outcome, Selection, Server, State,
};
use k8s_openapi::api::core::v1::Pod;
use kube::core::admission::AdmissionReview;
use rcgen::{CertificateParams, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};

#[allow(dead_code)]
mod common;

fn main() {
    let flags = common::Flags::new("ADMISSION_BENCH");
    let containers: usize = flags.number("containers", "20");
    let mounts: usize = flags.number("mounts", "10");
    let samples: usize = flags.number("samples", "2000");

    let body = large_pod_review(containers, mounts);
    let selection = Selection::new([JUICEFS_DRIVER.to_owned()], [], DEFAULT_OPT_OUT_ANNOTATION);
    let cache = Arc::new(fixture_cache());
    let reviewed = webhook::review(&body, &selection, &cache).expect("the review is answered");
    assert_eq!(reviewed.outcome, Outcome::Patched);
    println!(
        "pod: {containers} containers × {mounts} mounts (+1 pinned None each), {} KiB review; {} mounts patched, \
         {} KiB response",
        body.len() / 1024,
        reviewed.plan.changes.len(),
        reviewed.response.len() / 1024
    );

    report(
        "review (the work)",
        measure(samples, || webhook::review(black_box(&body), &selection, &cache).map(|r| r.response.len()).ok()),
    );
    report(
        "decode only",
        measure(samples, || serde_json::from_slice::<AdmissionReview<Pod>>(black_box(&body)).ok().map(|_| 0)),
    );
    let decoded: AdmissionReview<Pod> = serde_json::from_slice(&body).expect("the review decodes");
    let pod = decoded.request.and_then(|request| request.object).expect("a pod");
    report(
        "policy only",
        measure(samples, || {
            Some(policy::plan(black_box(&pod), "data", Scope::WholePod, &selection, &cache).changes.len())
        }),
    );

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let key = KeyPair::generate().expect("a key");
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params").self_signed(&key).expect("cert");
    std::fs::write(dir.path().join("tls.crt"), cert.pem()).expect("write the certificate");
    std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).expect("write the key");
    let certs = CertStore::load(dir.path().join("tls.crt"), dir.path().join("tls.key")).expect("the pair loads");
    let state = Arc::new(State::new(selection, cache, Arc::new(Metrics::new())));
    let local: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    let tls = certs.server_config().expect("a TLS configuration");
    let server = runtime.block_on(Server::start(local, local, tls, state)).expect("the server starts");
    let mut client = KeptAlive::connect(server.https_addr(), cert.der().clone());
    report("HTTPS round trip", measure(samples, || Some(client.post("/mutate", &body))));
    runtime.block_on(server.shutdown());
}

fn measure(samples: usize, mut call: impl FnMut() -> Option<usize>) -> Vec<Duration> {
    for _ in 0..samples / 10 {
        black_box(call().expect("the call succeeds"));
    }
    let mut times: Vec<Duration> = (0..samples)
        .map(|_| {
            let started = Instant::now();
            black_box(call().expect("the call succeeds"));
            started.elapsed()
        })
        .collect();
    times.sort();
    times
}

fn report(what: &str, sorted: Vec<Duration>) {
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    println!(
        "{what:<20} p50 {:>9.1?}  p99 {:>9.1?}  max {:>9.1?}  ({} samples)",
        at(0.5),
        at(0.99),
        at(1.0),
        sorted.len()
    );
}

/// One HTTPS connection reused for every request, as the API server does.
struct KeptAlive {
    tls: BufReader<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>,
    host: String,
}

impl KeptAlive {
    fn connect(addr: SocketAddr, server_cert: CertificateDer<'static>) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(server_cert).expect("the certificate is a root");
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = ServerName::try_from("127.0.0.1").expect("a name");
        let conn = rustls::ClientConnection::new(Arc::new(config), name).expect("a TLS client");
        let sock = TcpStream::connect(addr).expect("connect");
        sock.set_nodelay(true).expect("nodelay");
        KeptAlive { tls: BufReader::new(rustls::StreamOwned::new(conn, sock)), host: addr.to_string() }
    }

    /// The response body's length; panics on anything but 200.
    fn post(&mut self, path: &str, body: &[u8]) -> usize {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        let stream = self.tls.get_mut();
        stream.write_all(head.as_bytes()).expect("send");
        stream.write_all(body).expect("send");
        stream.flush().expect("send");
        let (mut status, mut length) = (String::new(), 0usize);
        self.tls.read_line(&mut status).expect("a status line");
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        loop {
            let mut line = String::new();
            self.tls.read_line(&mut line).expect("a header");
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().expect("a length");
            }
        }
        let mut response = vec![0; length];
        self.tls.read_exact(&mut response).expect("the body");
        length
    }
}
