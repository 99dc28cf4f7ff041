//! `/healthz` under a slow-loris attack on the node agent's metrics server:
//! attackers open connections and send one byte of a request head every few
//! seconds, reconnecting whenever the server closes one, while a probe asks
//! `/healthz` as the kubelet does. Prints, per attack, what the probes got
//! (status codes, resets, timeouts), how long they took (median, 99th
//! percentile, worst) and how many attack connections the
//! server closed. Then a flood: clients sending complete `/healthz`
//! requests back to back. A measurement, not a test: it prints numbers.
//!
//! ```text
//! cargo bench --bench slow_loris [-- --seconds 20 --byte-every-ms 4000 --probe-every-ms 200
//!     --attacks 16x1,64x1,64x8,256x32 --flood 8]
//! ```
//!
//! An attack `CxP` is C connections spread over P peer addresses
//! (127.0.0.2, 127.0.0.3, …: loopback answers all of 127.0.0.0/8). The
//! server runs in this process, on 127.0.0.1, with a supervisor loop that
//! answers its liveness pings at once. Every flag is also an environment
//! variable (`SLOW_LORIS_BENCH_SECONDS`, ...). Needs no root.
use std::collections::BTreeMap;
use std::io::{self, Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use fuse_supervisor::metrics::Metrics;
use fuse_supervisor::metrics::MetricsServer;
use fuse_supervisor_engine::health::{Health, Pong};
use socket2::{Domain, Socket, Type};

#[allow(dead_code)]
mod common;

/// What the attackers send, a byte at a time: a request head that never ends.
const SLOW_HEAD: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: node\r\nX-Slow: ";
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

struct Attack {
    connections: usize,
    peers: usize,
}

fn main() {
    let flags = common::Flags::new("SLOW_LORIS_BENCH");
    let window = Duration::from_secs(flags.number("seconds", "20"));
    let byte_every = Duration::from_millis(flags.number("byte-every-ms", "4000"));
    let probe_every = Duration::from_millis(flags.number("probe-every-ms", "200"));
    let attacks = flags.list("attacks", "16x1,64x1,64x8,256x32", |item| {
        let (connections, peers) = item.split_once('x')?;
        Some(Attack { connections: connections.parse().ok()?, peers: peers.parse().ok()? })
    });

    let health = Arc::new(Health::new());
    let (pings, inbox) = mpsc::channel::<Pong>();
    health.attach(move |pong| pings.send(pong).is_ok());
    std::thread::spawn(move || inbox.into_iter().for_each(Pong::answer));
    health.set_ready();
    let local = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let server = MetricsServer::start(local, Arc::new(Metrics::new()), health).expect("the metrics server starts");
    let addr = server.local_addr();
    println!(
        "slow loris on {addr}: one byte every {byte_every:?}, reconnecting when closed; /healthz every \
         {probe_every:?} for {window:?}"
    );
    let flooders: usize = flags.number("flood", "8");
    for attack in &attacks {
        let (probes, closed) = run(addr, attack, window, byte_every, probe_every);
        println!(
            "{:>3} connections from {:>2} peer(s): {}; attack connections closed by the server: {closed}",
            attack.connections,
            attack.peers,
            probes.summary()
        );
        // The next attack starts on an empty server.
        std::thread::sleep(byte_every.max(Duration::from_secs(6)));
    }
    if flooders > 0 {
        let probes = flood(addr, flooders, window, probe_every);
        println!("flood of complete /healthz requests on {flooders} connections: {}", probes.summary());
    }
    server.stop();
}

/// `flooders` clients sending complete `GET /healthz` requests back to back
/// from 127.0.0.2 while the probe asks as before; the probes' outcomes.
fn flood(addr: SocketAddr, flooders: usize, window: Duration, probe_every: Duration) -> Probes {
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..flooders)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let Ok(mut stream) = connect_from(Ipv4Addr::new(127, 0, 0, 2), addr) else { continue };
                    let _ = stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: node\r\n\r\n");
                    let _ = stream.read_to_end(&mut Vec::new());
                }
            })
        })
        .collect();
    probe_through(addr, window, probe_every, &stop, clients)
}

/// Probes `/healthz` every `probe_every` for `window`, then stops the
/// attackers and waits for them; the probes' outcomes.
fn probe_through(
    addr: SocketAddr,
    window: Duration,
    probe_every: Duration,
    stop: &AtomicBool,
    attackers: Vec<std::thread::JoinHandle<()>>,
) -> Probes {
    let mut probes = Probes::default();
    let end = Instant::now() + window;
    while Instant::now() < end {
        let start = Instant::now();
        let outcome = probe(addr);
        probes.latencies.push(start.elapsed());
        *probes.outcomes.entry(outcome).or_insert(0) += 1;
        std::thread::sleep(probe_every);
    }
    stop.store(true, Ordering::SeqCst);
    for attacker in attackers {
        let _ = attacker.join();
    }
    probes
}

/// What the probes got, by outcome, and how long each took.
#[derive(Default)]
struct Probes {
    outcomes: BTreeMap<String, usize>,
    latencies: Vec<Duration>,
}

impl Probes {
    /// "99 probes, 200: 99; median 0.3 ms, p99 1.2 ms, max 2.0 ms"
    fn summary(&self) -> String {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let at = |quantile: f64| {
            let index = ((sorted.len() as f64 - 1.0) * quantile).round() as usize;
            sorted.get(index).map_or(0.0, |latency| latency.as_secs_f64() * 1000.0)
        };
        let seen: Vec<String> = self.outcomes.iter().map(|(outcome, count)| format!("{outcome}: {count}")).collect();
        format!(
            "{} probes, {}; median {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            sorted.len(),
            seen.join(", "),
            at(0.5),
            at(0.99),
            at(1.0)
        )
    }
}

/// The probes' outcomes and how many attack connections were closed.
fn run(
    addr: SocketAddr,
    attack: &Attack,
    window: Duration,
    byte_every: Duration,
    probe_every: Duration,
) -> (Probes, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let closed = Arc::new(AtomicUsize::new(0));
    let attackers: Vec<_> = (0..attack.connections)
        .map(|i| {
            let peer = Ipv4Addr::new(127, 0, 0, 2 + (i % attack.peers.max(1)) as u8);
            let (stop, closed) = (Arc::clone(&stop), Arc::clone(&closed));
            std::thread::spawn(move || slow_client(addr, peer, byte_every, &stop, &closed))
        })
        .collect();
    // Let every attacker connect and send its first bytes.
    std::thread::sleep(Duration::from_millis(500));
    let probes = probe_through(addr, window, probe_every, &stop, attackers);
    (probes, closed.load(Ordering::SeqCst))
}

/// One connection at a time from `peer`, a byte every `byte_every`; a new
/// one whenever the server closes it.
fn slow_client(addr: SocketAddr, peer: Ipv4Addr, byte_every: Duration, stop: &AtomicBool, closed: &AtomicUsize) {
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut stream) = connect_from(peer, addr) else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        let mut sent = 0;
        loop {
            if stream.write_all(&SLOW_HEAD[sent % SLOW_HEAD.len()..][..1]).is_err() || is_closed(&stream) {
                closed.fetch_add(1, Ordering::SeqCst);
                break;
            }
            sent += 1;
            if !sleep_unless_stopped(byte_every, stop) {
                return;
            }
        }
    }
}

fn connect_from(peer: Ipv4Addr, addr: SocketAddr) -> io::Result<TcpStream> {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    socket.bind(&SocketAddrV4::new(peer, 0).into())?;
    socket.connect(&addr.into())?;
    Ok(socket.into())
}

/// Whether the server closed or reset the connection (a read that would not
/// block returns end of file or an error).
fn is_closed(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let _ = stream.set_nonblocking(true);
    let closed = match (&*stream).read(&mut byte) {
        Ok(_) => true,
        Err(err) => err.kind() != io::ErrorKind::WouldBlock,
    };
    let _ = stream.set_nonblocking(false);
    closed
}

/// Sleeps `pause` in short steps; false if asked to stop meanwhile.
fn sleep_unless_stopped(pause: Duration, stop: &AtomicBool) -> bool {
    let end = Instant::now() + pause;
    while Instant::now() < end {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    !stop.load(Ordering::SeqCst)
}

/// `GET /healthz` as the kubelet sends it: "200", another status, or what
/// went wrong.
fn probe(addr: SocketAddr) -> String {
    let attempt = || -> io::Result<String> {
        let mut stream = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)?;
        stream.set_read_timeout(Some(PROBE_TIMEOUT))?;
        stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: node\r\nUser-Agent: kube-probe/1.33\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response.split(' ').nth(1).unwrap_or("empty answer").to_owned())
    };
    match attempt() {
        Ok(status) => status,
        Err(err) if err.kind() == io::ErrorKind::WouldBlock => "timed out".to_owned(),
        Err(err) if err.kind() == io::ErrorKind::ConnectionReset => "reset".to_owned(),
        Err(err) => format!("{:?}", err.kind()),
    }
}
