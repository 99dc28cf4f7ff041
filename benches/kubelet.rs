//! One kubelet `/pods` round trip against the HTTPS stand-in (a new TCP and
//! TLS connection per call, as the client makes), for an empty node and a
//! full one (110 pods), and the parse of the full node's body alone.
//! Prints percentiles; `cargo bench --bench kubelet`.
use std::hint::black_box;
use std::time::{Duration, Instant};

use fuse_supervisor_engine::kube::{KubeletClient, KubeletConfig, KubeletTls, PodList};
use fuse_supervisor_testbed::kubelet::{KubeletStandIn, full_node_pods};

const SAMPLES: usize = 300;

fn main() {
    let kubelet = KubeletStandIn::start().expect("the stand-in starts");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ca = dir.path().join("ca.pem");
    let token = dir.path().join("token");
    std::fs::write(&ca, kubelet.ca_pem()).expect("write the CA");
    std::fs::write(&token, "bench-token\n").expect("write the token");
    kubelet.set_token(Some("bench-token"));
    let client = KubeletClient::new(KubeletConfig {
        port: kubelet.port(),
        token_file: Some(token),
        ..KubeletConfig::new("127.0.0.1", KubeletTls::CaFile(ca))
    })
    .expect("the client starts");

    kubelet.set_pods(&br#"{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[]}"#[..]);
    report("round trip, 0 pods", measure(|| client.pods().expect("pods").items.len()));

    let body = full_node_pods(110);
    println!("full node: 110 pods, {} KiB of JSON", body.len() / 1024);
    kubelet.set_pods(body.clone());
    report("round trip, 110 pods", measure(|| client.pods().expect("pods").items.len()));
    report("parse only, 110 pods", measure(|| PodList::from_slice(black_box(&body)).expect("parses").items.len()));
}

fn measure(mut call: impl FnMut() -> usize) -> Vec<Duration> {
    for _ in 0..SAMPLES / 10 {
        black_box(call());
    }
    let mut samples: Vec<Duration> = (0..SAMPLES)
        .map(|_| {
            let started = Instant::now();
            black_box(call());
            started.elapsed()
        })
        .collect();
    samples.sort();
    samples
}

fn report(what: &str, samples: Vec<Duration>) {
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    println!(
        "{what:<22} p50 {:>9.3?}  p90 {:>9.3?}  p99 {:>9.3?}  max {:>9.3?}  ({} samples)",
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0),
        samples.len()
    );
}
