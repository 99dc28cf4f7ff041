//! The admission webhook: reviews from `fixtures/admission/` through the
//! policy, the HTTPS server end to end with a certificate rotation, and the
//! watches that feed the volume cache against kube's mock service.
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuse_supervisor_testbed::admission::{
    EBS_DRIVER, JUICEFS_CLASS, JUICEFS_DRIVER, JUICEFS_PV, claim, class, fixture_cache, list_fixture_cluster, volume,
};
use fuse_supervisor_webhook::{
    self as webhook, CertStore, DEFAULT_OPT_OUT_ANNOTATION, Limits, Metrics, Outcome, Selection, Server, State,
    Unresolved, Verdict, VolumeCache,
};
use http::{Request, Response};
use kube::client::Body;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/admission").join(name);
    std::fs::read(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

fn juicefs() -> Selection {
    Selection::new([JUICEFS_DRIVER.to_owned()], [], DEFAULT_OPT_OUT_ANNOTATION)
}

/// The review's decision and the patch's `add` paths (each must add
/// HostToContainer), from the encoded response as the API server reads it.
fn answer(fixture_name: &str, selection: &Selection, cache: &VolumeCache) -> (webhook::Reviewed, Vec<String>) {
    let reviewed = webhook::review(&fixture(fixture_name), selection, cache).expect("the review is answered");
    let response: Value = serde_json::from_slice(&reviewed.response).expect("the response is JSON");
    assert_eq!(response["kind"], "AdmissionReview");
    assert_eq!(response["apiVersion"], "admission.k8s.io/v1");
    let request: Value = serde_json::from_slice(&fixture(fixture_name)).unwrap();
    assert_eq!(response["response"]["uid"], request["request"]["uid"], "the uid goes back");
    assert_eq!(response["response"]["allowed"], true, "a pod is never refused");
    let paths = match decode_patch(&response["response"]) {
        None => Vec::new(),
        Some(operations) => operations
            .iter()
            .map(|operation| {
                assert_eq!(operation["op"], "add");
                assert_eq!(operation["value"], "HostToContainer");
                operation["path"].as_str().unwrap().to_owned()
            })
            .collect(),
    };
    (reviewed, paths)
}

/// The JSONPatch of a response: Go's `[]byte`, so base64 in JSON.
fn decode_patch(response: &Value) -> Option<Vec<Value>> {
    let patch = response.get("patch")?;
    assert_eq!(response["patchType"], "JSONPatch");
    assert!(patch.is_string(), "the patch is a base64 string, not {patch}");
    let bytes: k8s_openapi::ByteString = serde_json::from_value(patch.clone()).expect("the patch is base64");
    let bytes = bytes.0;
    Some(serde_json::from_slice(&bytes).expect("the patch is a JSON list"))
}

/// The pod after the API server applied the patch.
fn patched_pod(fixture_name: &str, response: &[u8]) -> Value {
    let request: Value = serde_json::from_slice(&fixture(fixture_name)).unwrap();
    let mut pod = request["request"]["object"].clone();
    let response: Value = serde_json::from_slice(response).unwrap();
    if let Some(operations) = decode_patch(&response["response"]) {
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(operations)).unwrap();
        json_patch::patch(&mut pod, &patch).expect("the patch applies to the pod");
    }
    pod
}

fn propagation(pod: &Value, field: &str, container: usize, mount: usize) -> Option<String> {
    pod["spec"][field][container]["volumeMounts"][mount]["mountPropagation"].as_str().map(str::to_owned)
}

#[test]
fn pvc_of_a_selected_driver_is_patched_whole_and_subpath() {
    let (reviewed, paths) = answer("pvc-selected-driver.json", &juicefs(), &fixture_cache());
    assert_eq!(reviewed.outcome, Outcome::Patched);
    assert_eq!(
        paths,
        [
            "/spec/containers/0/volumeMounts/0/mountPropagation",
            "/spec/containers/0/volumeMounts/1/mountPropagation",
            "/spec/containers/1/volumeMounts/0/mountPropagation",
        ]
    );
    assert_eq!(reviewed.namespace, "data");
    assert_eq!(reviewed.pod, "web-7c9d8f6b5d-");
    let pod = patched_pod("pvc-selected-driver.json", &reviewed.response);
    assert_eq!(propagation(&pod, "containers", 0, 0).as_deref(), Some("HostToContainer"));
    assert_eq!(propagation(&pod, "containers", 1, 0).as_deref(), Some("HostToContainer"));
    // The ConfigMap and the service-account token are not FUSE volumes.
    assert_eq!(propagation(&pod, "containers", 0, 2), None);
    assert_eq!(propagation(&pod, "containers", 0, 3), None);
    assert_eq!(pod["spec"]["containers"][0]["volumeMounts"][1]["subPath"], "logs/web");
}

#[test]
fn explicit_values_are_never_overridden() {
    let (reviewed, paths) = answer("explicit-none.json", &juicefs(), &fixture_cache());
    // Only the subPath mount of `web` had no value.
    assert_eq!(paths, ["/spec/containers/0/volumeMounts/1/mountPropagation"]);
    assert_eq!(reviewed.outcome, Outcome::Patched);
    let pod = patched_pod("explicit-none.json", &reviewed.response);
    assert_eq!(propagation(&pod, "containers", 0, 0).as_deref(), Some("None"));
    assert_eq!(propagation(&pod, "containers", 1, 0).as_deref(), Some("HostToContainer"));

    let (reviewed, paths) = answer("bidirectional.json", &juicefs(), &fixture_cache());
    assert_eq!(reviewed.outcome, Outcome::Unchanged);
    assert!(paths.is_empty());
    let response: Value = serde_json::from_slice(&reviewed.response).unwrap();
    assert!(response["response"].get("patch").is_none() && response["response"].get("patchType").is_none());
}

#[test]
fn volumes_of_other_drivers_are_untouched_unless_their_class_is_selected() {
    let (reviewed, paths) = answer("unrelated-driver.json", &juicefs(), &fixture_cache());
    assert_eq!(reviewed.outcome, Outcome::Unchanged);
    assert!(paths.is_empty());

    let by_class = Selection::new([], ["gp3".to_owned()], DEFAULT_OPT_OUT_ANNOTATION);
    let (reviewed, paths) = answer("unrelated-driver.json", &by_class, &fixture_cache());
    assert_eq!(reviewed.outcome, Outcome::Patched);
    assert_eq!(paths, ["/spec/containers/0/volumeMounts/0/mountPropagation"]);
    let by_driver = Selection::new([EBS_DRIVER.to_owned()], [], DEFAULT_OPT_OUT_ANNOTATION);
    assert_eq!(answer("unrelated-driver.json", &by_driver, &fixture_cache()).1.len(), 1);
}

#[test]
fn inline_csi_volume_is_patched_without_the_cache() {
    // An inline volume names its driver: no watch needs to have listed.
    let (reviewed, paths) = answer("inline-csi.json", &juicefs(), &VolumeCache::new());
    assert_eq!(reviewed.outcome, Outcome::Patched);
    assert_eq!(paths, ["/spec/containers/0/volumeMounts/0/mountPropagation"]);
    assert_eq!(reviewed.pod, "inline-reader");
}

#[test]
fn init_containers_native_sidecars_and_generic_ephemeral_volumes_are_patched() {
    let (reviewed, paths) = answer("init-containers.json", &juicefs(), &fixture_cache());
    assert_eq!(reviewed.outcome, Outcome::Patched);
    assert_eq!(
        paths,
        [
            "/spec/initContainers/0/volumeMounts/0/mountPropagation",
            "/spec/initContainers/1/volumeMounts/0/mountPropagation",
            "/spec/containers/0/volumeMounts/0/mountPropagation",
            // The claim template names juicefs-sc, provisioned by the driver.
            "/spec/containers/0/volumeMounts/1/mountPropagation",
        ]
    );
    let pod = patched_pod("init-containers.json", &reviewed.response);
    assert_eq!(propagation(&pod, "initContainers", 1, 1), None, "the emptyDir is left alone");
}

#[test]
fn only_the_new_ephemeral_container_is_patched() {
    let (reviewed, paths) = answer("ephemeral-container.json", &juicefs(), &fixture_cache());
    assert_eq!(reviewed.outcome, Outcome::Patched);
    // debugger-7xk2d was in the old pod: its spec is immutable now.
    assert_eq!(
        paths,
        [
            "/spec/ephemeralContainers/1/volumeMounts/0/mountPropagation",
            "/spec/ephemeralContainers/1/volumeMounts/1/mountPropagation",
        ]
    );
    assert_eq!(reviewed.pod, "web-7c9d8f6b5d-q8m4x");
}

#[test]
fn opt_out_annotation_admits_unchanged() {
    let (reviewed, paths) = answer("opt-out.json", &juicefs(), &fixture_cache());
    assert_eq!(reviewed.outcome, Outcome::OptedOut);
    assert!(paths.is_empty());
    // Another annotation key configured: the same pod is patched.
    let other = Selection::new([JUICEFS_DRIVER.to_owned()], [], "example.com/other");
    assert_eq!(answer("opt-out.json", &other, &fixture_cache()).0.outcome, Outcome::Patched);
}

#[test]
fn cache_not_ready_admits_unchanged_and_says_why() {
    let cache = VolumeCache::new();
    let (reviewed, paths) = answer("pvc-selected-driver.json", &juicefs(), &cache);
    assert_eq!(reviewed.outcome, Outcome::Unresolved);
    assert!(paths.is_empty());
    assert_eq!(reviewed.plan.unresolved, [("data".to_owned(), Unresolved::CacheNotReady)]);

    // Two of three watches listed: still not ready.
    cache.replace([claim("data", "juicefs-pvc", Some(JUICEFS_PV), Some(JUICEFS_CLASS))]);
    cache.replace([volume(JUICEFS_PV, Some(JUICEFS_DRIVER), JUICEFS_CLASS)]);
    assert!(!cache.is_ready());
    assert_eq!(answer("pvc-selected-driver.json", &juicefs(), &cache).0.outcome, Outcome::Unresolved);
    cache.replace::<k8s_openapi::api::storage::v1::StorageClass>([]);
    assert_eq!(answer("pvc-selected-driver.json", &juicefs(), &cache).0.outcome, Outcome::Patched);
}

#[test]
fn claims_resolve_through_their_volume_or_class() {
    let cache = fixture_cache();
    let selection = juicefs();
    // Created just now, not seen by the watch yet.
    assert_eq!(cache.claim_verdict("data", "brand-new", &selection), Verdict::Unresolved(Unresolved::ClaimUnknown));
    // Unbound (WaitForFirstConsumer): the class's provisioner decides.
    cache.apply(&claim("data", "pending", None, Some(JUICEFS_CLASS)));
    assert_eq!(cache.claim_verdict("data", "pending", &selection), Verdict::Selected);
    cache.apply(&claim("data", "pending-gp3", None, Some("gp3")));
    assert_eq!(cache.claim_verdict("data", "pending-gp3", &selection), Verdict::NotSelected);
    cache.apply(&claim("data", "pending-unknown-class", None, Some("fresh-class")));
    assert_eq!(
        cache.claim_verdict("data", "pending-unknown-class", &selection),
        Verdict::Unresolved(Unresolved::ClassUnknown)
    );
    // Bound to an NFS PV whose class is JuiceFS's: the PV's source decides
    // for drivers, the class for classes.
    cache.apply(&volume("nfs-pv", None, JUICEFS_CLASS));
    cache.apply(&claim("data", "on-nfs", Some("nfs-pv"), Some(JUICEFS_CLASS)));
    assert_eq!(cache.claim_verdict("data", "on-nfs", &selection), Verdict::NotSelected);
    let by_class = Selection::new([], [JUICEFS_CLASS.to_owned()], DEFAULT_OPT_OUT_ANNOTATION);
    assert_eq!(cache.claim_verdict("data", "on-nfs", &by_class), Verdict::Selected);
    // Generic ephemeral volumes without a class get the default one (gp3).
    assert_eq!(cache.class_verdict(None, &selection), Verdict::NotSelected);
    cache.apply(&class(JUICEFS_CLASS, JUICEFS_DRIVER, true));
    cache.apply(&class("gp3", EBS_DRIVER, false));
    assert_eq!(cache.class_verdict(None, &selection), Verdict::Selected);
    // Deleted claims are forgotten; a namespace is part of the name.
    cache.delete(&claim("data", "pending", None, Some(JUICEFS_CLASS)));
    assert_eq!(cache.claim_verdict("data", "pending", &selection), Verdict::Unresolved(Unresolved::ClaimUnknown));
    assert_eq!(cache.claim_verdict("other", "juicefs-pvc", &selection), Verdict::Unresolved(Unresolved::ClaimUnknown));
}

#[test]
fn malformed_reviews_are_clear_errors() {
    let cache = fixture_cache();
    let cases = [
        ("malformed-truncated.json", "the body is not an AdmissionReview of a Pod"),
        ("malformed-v1beta1.json", "expected kind AdmissionReview of apiVersion admission.k8s.io/v1"),
        ("malformed-mounts-not-a-list.json", "at request.object.spec.containers[0].volumeMounts"),
        ("malformed-no-request.json", "the AdmissionReview has no request"),
    ];
    for (name, expected) in cases {
        let err = webhook::review(&fixture(name), &juicefs(), &cache).expect_err(name);
        let message = fuse_supervisor_engine::errors::error_chain(&err);
        assert!(message.contains(expected), "{name}: {message}");
    }
    for garbage in [&b""[..], b"null", b"[]", b"{\"kind\":42}", &[0xff, 0xfe, 0x00]] {
        assert!(webhook::review(garbage, &juicefs(), &cache).is_err());
    }
}

// --- The server, over HTTPS ---

/// A CA named `name` and a serving certificate for 127.0.0.1 it signed.
struct Pair {
    ca: CertificateDer<'static>,
    cert_pem: String,
    key_pem: String,
}

fn pair(name: &str) -> Pair {
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name.push(DnType::CommonName, name);
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, format!("{name} webhook"));
    let cert = params.signed_by(&key, &ca).unwrap();
    Pair { ca: CertificateDer::from(ca.der().to_vec()), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
}

/// A Secret volume as the kubelet lays it out: `tls.crt -> ..data/tls.crt`,
/// `..data -> ..<timestamp>`, replaced by renaming a new `..data` over it.
fn publish(dir: &Path, cert_pem: &str, key_pem: &str, generation: u32) {
    let version = dir.join(format!("..2025_06_03_09_00_0{generation}.000000001"));
    std::fs::create_dir(&version).unwrap();
    std::fs::write(version.join("tls.crt"), cert_pem).unwrap();
    std::fs::write(version.join("tls.key"), key_pem).unwrap();
    let staged = dir.join("..data_tmp");
    std::os::unix::fs::symlink(version.file_name().unwrap(), &staged).unwrap();
    std::fs::rename(&staged, dir.join("..data")).unwrap();
    for file in ["tls.crt", "tls.key"] {
        if !dir.join(file).exists() {
            std::os::unix::fs::symlink(Path::new("..data").join(file), dir.join(file)).unwrap();
        }
    }
}

struct Answer {
    status: u16,
    body: Vec<u8>,
    /// The server's leaf certificate, for HTTPS.
    peer: Option<CertificateDer<'static>>,
}

/// One HTTP/1.1 exchange on a new connection; `roots` None for plain HTTP.
fn call(addr: SocketAddr, roots: Option<&[CertificateDer<'static>]>, method: &str, path: &str, body: &[u8]) -> Answer {
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    let mut raw = Vec::new();
    let peer = match roots {
        None => {
            sock.write_all(request.as_bytes()).unwrap();
            sock.write_all(body).unwrap();
            sock.read_to_end(&mut raw).unwrap();
            None
        }
        Some(roots) => {
            let mut store = rustls::RootCertStore::empty();
            for root in roots {
                store.add(root.clone()).unwrap();
            }
            let config =
                rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_root_certificates(store)
                    .with_no_client_auth();
            let name = ServerName::try_from("127.0.0.1").unwrap();
            let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, sock);
            tls.write_all(request.as_bytes()).unwrap();
            tls.write_all(body).unwrap();
            tls.flush().unwrap();
            // hyper closes after the response; rustls reports a missing
            // close_notify as UnexpectedEof, which is fine here.
            if let Err(err) = tls.read_to_end(&mut raw) {
                assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
            }
            tls.conn.peer_certificates().map(|chain| chain[0].clone().into_owned())
        }
    };
    let split = raw.windows(4).position(|window| window == b"\r\n\r\n").expect("a complete response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Answer { status, body, peer }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|window| window == b"\r\n").unwrap();
        let size = usize::from_str_radix(std::str::from_utf8(&raw[..line_end]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return body;
        }
        body.extend_from_slice(&raw[line_end + 2..line_end + 2 + size]);
        raw = &raw[line_end + 2 + size + 2..];
    }
}

fn metric(text: &str, line_start: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(line_start).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {line_start} in\n{text}"))
}

#[test]
fn https_round_trip_with_certificate_rotation() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (pair("webhook-ca-1"), pair("webhook-ca-2"));
    publish(dir.path(), &first.cert_pem, &first.key_pem, 1);

    let certs = CertStore::load(dir.path().join("tls.crt"), dir.path().join("tls.key")).unwrap();
    let metrics = Arc::new(Metrics::new());
    let reload_metrics = metrics.clone();
    let _watch = certs.watch(move |result| reload_metrics.certificate_reloaded(result.is_ok())).unwrap();
    let cache = Arc::new(VolumeCache::new());
    let state = Arc::new(State::new(juicefs(), cache.clone(), metrics));
    let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = runtime.block_on(Server::start(local, local, certs.server_config().unwrap(), state)).unwrap();
    let (https, plain) = (server.https_addr(), server.metrics_addr());
    let both = [first.ca.clone(), second.ca.clone()];

    // Cache not ready: answered, unchanged, not ready for the Service.
    let review = fixture("pvc-selected-driver.json");
    let answer = call(https, Some(&both), "POST", "/mutate", &review);
    assert_eq!(answer.status, 200);
    let response: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(response["response"]["allowed"], true);
    assert!(response["response"].get("patch").is_none());
    assert_eq!(answer.peer.as_ref(), Some(&certs.chain()[0]));
    assert_eq!(call(plain, None, "GET", "/readyz", b"").status, 503);
    assert_eq!(call(plain, None, "GET", "/healthz", b"").status, 200);

    // Ready: patched.
    list_fixture_cluster(&cache);
    assert_eq!(call(plain, None, "GET", "/readyz", b"").status, 200);
    assert_eq!(call(https, Some(&both), "GET", "/readyz", b"").status, 200);
    let answer = call(https, Some(&both), "POST", "/mutate", &review);
    assert_eq!(answer.status, 200);
    let pod = patched_pod("pvc-selected-driver.json", &answer.body);
    assert_eq!(propagation(&pod, "containers", 0, 1).as_deref(), Some("HostToContainer"));

    // Malformed: HTTP 400 and a Status that says what is wrong.
    let answer = call(https, Some(&both), "POST", "/mutate", &fixture("malformed-mounts-not-a-list.json"));
    assert_eq!(answer.status, 400);
    let status: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["code"], 400);
    assert!(status["message"].as_str().unwrap().contains("request.object.spec.containers[0].volumeMounts"), "{status}");
    // Reviews never over plain HTTP.
    assert_eq!(call(plain, None, "POST", "/mutate", &review).status, 404);

    let text = String::from_utf8(call(plain, None, "GET", "/metrics", b"").body).unwrap();
    assert_eq!(metric(&text, "fuse_supervisor_webhook_admissions_total{result=\"unresolved\"}"), 1);
    assert_eq!(metric(&text, "fuse_supervisor_webhook_admissions_total{result=\"patched\"}"), 1);
    assert_eq!(metric(&text, "fuse_supervisor_webhook_admissions_total{result=\"error\"}"), 1);
    assert_eq!(metric(&text, "fuse_supervisor_webhook_mounts_patched_total"), 3);
    assert_eq!(metric(&text, "fuse_supervisor_webhook_unresolved_volumes_total{reason=\"cache_not_ready\"}"), 1);
    assert_eq!(metric(&text, "fuse_supervisor_webhook_cache_ready"), 1);

    // Rotation: the kubelet swaps `..data`; the next handshake serves the
    // new certificate, with no restart.
    publish(dir.path(), &second.cert_pem, &second.key_pem, 2);
    let served = |roots: &[CertificateDer<'static>]| call(https, Some(roots), "GET", "/healthz", b"").peer;
    let deadline = Instant::now() + Duration::from_secs(10);
    while served(&both) != Some(leaf(&second)) {
        assert!(Instant::now() < deadline, "the new certificate was not served within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(call(https, Some(std::slice::from_ref(&second.ca)), "POST", "/mutate", &review).status, 200);
    assert_eq!(certs.chain()[0], leaf(&second));

    // A broken pair (a certificate that is not one) is refused and the
    // second pair stays in service.
    publish(dir.path(), "not a certificate", &second.key_pem, 3);
    let failed = |text: &str| {
        text.lines()
            .any(|line| line.starts_with("fuse_supervisor_webhook_certificate_reloads_total{result=\"failed\"}"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = String::from_utf8(call(plain, None, "GET", "/metrics", b"").body).unwrap();
        if failed(&text) {
            assert!(metric(&text, "fuse_supervisor_webhook_certificate_reloads_total{result=\"ok\"}") >= 1);
            break;
        }
        assert!(Instant::now() < deadline, "the broken pair was not noticed within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(served(std::slice::from_ref(&second.ca)), Some(leaf(&second)));

    runtime.block_on(server.shutdown());
    // Closed: nothing listens any more.
    assert!(TcpStream::connect(https).is_err() && TcpStream::connect(plain).is_err());
}

fn leaf(pair: &Pair) -> CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject as _;
    CertificateDer::from_pem_slice(pair.cert_pem.as_bytes()).unwrap()
}

// --- The server's limits, against clients that take too much ---

/// The default limits with the timeouts shortened to seconds.
fn short_limits() -> Limits {
    let second = Duration::from_secs(1);
    Limits {
        handshake_timeout: second,
        header_timeout: second,
        idle_timeout: 2 * second,
        request_deadline: 2 * second,
        max_streams: 4,
        ..Limits::default()
    }
}

/// A server within `limits`, its runtime and its certificate; shut down
/// when dropped.
struct LimitedServer {
    runtime: tokio::runtime::Runtime,
    server: Option<Server>,
    pair: Pair,
    _dir: tempfile::TempDir,
}

impl LimitedServer {
    fn start(limits: Limits) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pair = pair("limits-ca");
        publish(dir.path(), &pair.cert_pem, &pair.key_pem, 1);
        let certs = CertStore::load(dir.path().join("tls.crt"), dir.path().join("tls.key")).unwrap();
        let state = Arc::new(State::new(juicefs(), Arc::new(fixture_cache()), Arc::new(Metrics::new())));
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let tls = certs.server_config().unwrap();
        let server = runtime.block_on(Server::start_with(local, local, tls, state, limits)).unwrap();
        LimitedServer { runtime, server: Some(server), pair, _dir: dir }
    }

    fn server(&self) -> &Server {
        self.server.as_ref().unwrap()
    }

    /// A TCP connection to the HTTPS port that gives up reading after a
    /// generous while, so a server that never closes fails the test.
    fn connect(&self) -> TcpStream {
        let sock = TcpStream::connect(self.server().https_addr()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        sock
    }

    /// A TLS connection to the HTTPS port offering `alpn`, handshake done.
    fn tls(&self, alpn: &[u8]) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.pair.ca.clone()).unwrap();
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        let name = ServerName::try_from("127.0.0.1").unwrap();
        let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, self.connect());
        while tls.conn.is_handshaking() {
            tls.conn.complete_io(&mut tls.sock).unwrap();
        }
        assert_eq!(tls.conn.alpn_protocol(), Some(alpn), "ALPN not agreed");
        tls
    }
}

impl Drop for LimitedServer {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            self.runtime.block_on(server.shutdown());
        }
    }
}

/// Reads one HTTP/1.1 response with a Content-Length: its status and body.
/// Reads no further, so a connection the server closes afterwards (with a
/// reset, for bytes it left unread) does not matter.
fn read_response(stream: &mut impl std::io::Read) -> (u16, Value) {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte).expect("a response head");
        raw.push(byte[0]);
    }
    let head = String::from_utf8(raw).unwrap().to_ascii_lowercase();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|length| length.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Content-Length in {head}"));
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).expect("the response body");
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Whether the server closed the connection: a read ends (end of file or
/// reset) instead of timing out. Reads and drops whatever comes first.
fn closed_by_server(stream: &mut impl std::io::Read) -> bool {
    let mut sink = [0u8; 4096];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(err) => return !matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }
}

fn mutate_head(length: &str, extra: &str) -> String {
    format!("POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{length}{extra}\r\n")
}

#[test]
fn a_body_over_the_limit_is_refused_with_413() {
    let limited = LimitedServer::start(short_limits());
    let max = Limits::default().max_body;

    // Declared: refused before a byte of it is sent (curl waits for the
    // answer to its Expect before it sends a large body).
    let mut tls = limited.tls(b"http/1.1");
    let declared = format!("Content-Length: {}\r\n", 2 * max);
    tls.write_all(mutate_head(&declared, "Expect: 100-continue\r\n").as_bytes()).unwrap();
    tls.flush().unwrap();
    let (status, body) = read_response(&mut tls);
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["code"], 413);
    assert_eq!(body["reason"], "RequestEntityTooLarge");
    let message = body["message"].as_str().unwrap();
    assert!(message.contains(&format!("{} bytes; at most {max}", 2 * max)), "{message}");

    // Undeclared (chunked): refused once the limit is passed. The chunks
    // stop right past it, so the server reads all that was sent.
    let mut tls = limited.tls(b"http/1.1");
    tls.write_all(mutate_head("Transfer-Encoding: chunked\r\n", "").as_bytes()).unwrap();
    let chunk = vec![b' '; 64 * 1024];
    for _ in 0..max / chunk.len() {
        tls.write_all(format!("{:x}\r\n", chunk.len()).as_bytes()).unwrap();
        tls.write_all(&chunk).unwrap();
        tls.write_all(b"\r\n").unwrap();
    }
    tls.write_all(b"1\r\n \r\n").unwrap();
    tls.flush().unwrap();
    let (status, body) = read_response(&mut tls);
    assert_eq!(status, 413, "{body}");
    assert!(body["message"].as_str().unwrap().contains(&format!("longer than {max} bytes")), "{body}");

    // A review within the limit is still answered.
    let review = fixture("pvc-selected-driver.json");
    let answer =
        call(limited.server().https_addr(), Some(std::slice::from_ref(&limited.pair.ca)), "POST", "/mutate", &review);
    assert_eq!(answer.status, 200);
}

#[test]
fn a_body_that_trickles_in_is_answered_408_at_the_request_deadline() {
    let limited = LimitedServer::start(short_limits());
    let mut tls = limited.tls(b"http/1.1");
    tls.write_all(mutate_head("Content-Length: 100\r\n", "").as_bytes()).unwrap();
    tls.write_all(b"{\"kind\":").unwrap();
    tls.flush().unwrap();
    let (status, body) = read_response(&mut tls);
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["code"], 408);
    assert!(body["message"].as_str().unwrap().contains("did not arrive within 2s"), "{body}");
}

#[test]
fn idle_and_silent_connections_are_closed() {
    let limited = LimitedServer::start(short_limits());
    // No TLS handshake at all.
    assert!(closed_by_server(&mut limited.connect()), "a silent TCP connection stayed open");
    // Plain HTTP, not a byte sent (neither HTTP/1 nor HTTP/2 yet).
    let mut plain = TcpStream::connect(limited.server().metrics_addr()).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    assert!(closed_by_server(&mut plain), "a silent plain connection stayed open");
    // HTTP/1: a head that never ends.
    let mut tls = limited.tls(b"http/1.1");
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n").unwrap();
    tls.flush().unwrap();
    assert!(closed_by_server(&mut tls), "an unfinished head kept its connection");
    // HTTP/1: kept alive after an answer, then nothing.
    let mut tls = limited.tls(b"http/1.1");
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    tls.flush().unwrap();
    let mut head = [0u8; 12];
    tls.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    assert!(closed_by_server(&mut tls), "an idle kept-alive connection stayed open");
    // HTTP/2: settings exchanged, then nothing: a GOAWAY, then the close.
    let mut h2 = limited.tls(b"h2");
    h2_start(&mut h2);
    let frames = h2_frames_until_closed(&mut h2);
    assert!(frames.iter().any(|frame| frame.kind == GOAWAY), "no GOAWAY before the close: {frames:?}");
}

#[test]
fn http2_streams_beyond_the_limit_are_refused() {
    let limits = short_limits();
    let limited = LimitedServer::start(limits);
    let mut h2 = limited.tls(b"h2");
    let settings = h2_start(&mut h2);
    assert_eq!(settings.get(&SETTINGS_MAX_CONCURRENT_STREAMS), Some(&limits.max_streams), "{settings:?}");
    assert_eq!(settings.get(&SETTINGS_MAX_HEADER_LIST_SIZE), Some(&limits.max_head), "{settings:?}");

    // Reviews whose bodies never come hold their streams; one more than
    // the limit is refused at once, the others answered at the deadline.
    let streams: Vec<u32> = (0..=limits.max_streams).map(|i| 2 * i + 1).collect();
    for &stream in &streams {
        h2.write_all(&h2_frame(HEADERS, END_HEADERS, stream, &post_mutate_headers())).unwrap();
    }
    h2.flush().unwrap();
    let extra = *streams.last().unwrap();
    let mut answered = Vec::new();
    let mut refused = Vec::new();
    while answered.len() < streams.len() - 1 {
        let frame = h2_read_frame(&mut h2).expect("the server answers every stream");
        match frame.kind {
            RST_STREAM if frame.payload == REFUSED_STREAM.to_be_bytes() => refused.push(frame.stream),
            // After an answer, the body the client never ended is not wanted.
            RST_STREAM => {
                assert!(answered.contains(&frame.stream), "stream {} reset unanswered: {frame:?}", frame.stream)
            }
            HEADERS => answered.push(frame.stream),
            _ => {}
        }
    }
    assert_eq!(refused, [extra], "the stream over the limit, and only it, is refused");
    answered.sort_unstable();
    assert_eq!(answered, streams[..streams.len() - 1], "each held stream is answered (408) at the deadline");
}

// A client of HTTP/2 frames (RFC 9113), only as far as these tests go.

const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const SETTINGS_MAX_HEADER_LIST_SIZE: u16 = 0x6;
const REFUSED_STREAM: u32 = 0x7;

#[derive(Debug)]
struct Frame {
    kind: u8,
    stream: u32,
    payload: Vec<u8>,
}

fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut frame = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    frame.extend([kind, flags]);
    frame.extend(stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// The next frame; None once the server closed the connection.
fn h2_read_frame(stream: &mut impl std::io::Read) -> Option<Frame> {
    let mut head = [0u8; 9];
    stream.read_exact(&mut head).ok()?;
    let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; length];
    stream.read_exact(&mut payload).ok()?;
    let stream_id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    Some(Frame { kind: head[3], stream: stream_id, payload })
}

fn h2_frames_until_closed(stream: &mut impl std::io::Read) -> Vec<Frame> {
    std::iter::from_fn(|| h2_read_frame(stream)).collect()
}

/// The preface and settings both ways; returns the server's settings.
fn h2_start(stream: &mut (impl std::io::Read + std::io::Write)) -> std::collections::BTreeMap<u16, u32> {
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    stream.write_all(&h2_frame(SETTINGS, 0, 0, &[])).unwrap();
    stream.flush().unwrap();
    let settings = loop {
        let frame = h2_read_frame(stream).expect("the server's settings");
        if frame.kind == SETTINGS && frame.stream == 0 && !frame.payload.is_empty() {
            break frame.payload;
        }
    };
    stream.write_all(&h2_frame(SETTINGS, ACK, 0, &[])).unwrap();
    stream.flush().unwrap();
    settings
        .chunks_exact(6)
        .map(|setting| {
            (
                u16::from_be_bytes([setting[0], setting[1]]),
                u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]),
            )
        })
        .collect()
}

/// `POST /mutate` in HPACK: static-table names, literal values, no Huffman.
fn post_mutate_headers() -> Vec<u8> {
    let mut block = vec![0x83, 0x87]; // :method POST, :scheme https
    for (name_index, value) in [(4u8, "/mutate"), (1, "127.0.0.1")] {
        // Literal without indexing, indexed name (:path, :authority).
        block.push(name_index);
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

// --- The watches, against kube's mock service ---

fn list_body(kind: &str, api_version: &str, items: Vec<Value>) -> Vec<u8> {
    json!({"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": "5000"}, "items": items})
        .to_string()
        .into_bytes()
}

fn to_value<T: serde::Serialize>(object: T) -> Value {
    serde_json::to_value(object).unwrap()
}

#[test]
fn watches_fill_the_cache_and_follow_changes() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let cache = Arc::new(VolumeCache::new());
        let metrics = Arc::new(Metrics::new());
        let feeds = webhook::feed_cache(&client, &cache, &metrics);

        // The API server: lists, then one watch of PVCs that adds a claim
        // and deletes another; later watches hang as a quiet watch would.
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            let mut pvc_watches = 0;
            while let Some((request, respond)) = handle.next_request().await {
                let path = request.uri().path().to_owned();
                let query = request.uri().query().unwrap_or_default().to_owned();
                let body = match (path.as_str(), query.contains("watch=true")) {
                    ("/api/v1/persistentvolumeclaims", false) => list_body(
                        "PersistentVolumeClaimList",
                        "v1",
                        vec![to_value(claim("data", "juicefs-pvc", Some(JUICEFS_PV), Some(JUICEFS_CLASS)))],
                    ),
                    ("/api/v1/persistentvolumes", false) => list_body(
                        "PersistentVolumeList",
                        "v1",
                        vec![to_value(volume(JUICEFS_PV, Some(JUICEFS_DRIVER), JUICEFS_CLASS))],
                    ),
                    ("/apis/storage.k8s.io/v1/storageclasses", false) => {
                        list_body("StorageClassList", "storage.k8s.io/v1", vec![])
                    }
                    ("/api/v1/persistentvolumeclaims", true) if pvc_watches == 0 => {
                        pvc_watches += 1;
                        let added = json!({"type": "ADDED", "object": to_value(claim("data", "late", Some(JUICEFS_PV), None))});
                        let deleted = json!({"type": "DELETED", "object": to_value(claim("data", "juicefs-pvc", Some(JUICEFS_PV), None))});
                        format!("{added}\n{deleted}\n").into_bytes()
                    }
                    (_, true) => {
                        held.push(respond);
                        continue;
                    }
                    (other, false) => panic!("unexpected request {other}?{query}"),
                };
                respond.send_response(Response::builder().status(200).body(Body::from(body)).unwrap());
            }
        });

        let selection = juicefs();
        let deadline = Instant::now() + Duration::from_secs(10);
        while cache.claim_verdict("data", "late", &selection) != Verdict::Selected {
            assert!(Instant::now() < deadline, "the watched claim did not arrive");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(cache.is_ready());
        let gone = Instant::now() + Duration::from_secs(10);
        while cache.claim_verdict("data", "juicefs-pvc", &selection) != Verdict::Unresolved(Unresolved::ClaimUnknown) {
            assert!(Instant::now() < gone, "the deleted claim stayed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for feed in feeds {
            feed.abort();
        }
        server.abort();
    });
}
