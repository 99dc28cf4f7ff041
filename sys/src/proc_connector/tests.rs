use super::*;

/// A received message as the kernel builds it: nlmsghdr, cn_msg, proc_event.
fn kernel_message(ack: u32, what: u32, timestamp_ns: u64, data: &[u32]) -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(&what.to_ne_bytes());
    payload.extend_from_slice(&1u32.to_ne_bytes());
    payload.extend_from_slice(&timestamp_ns.to_ne_bytes());
    for word in data {
        payload.extend_from_slice(&word.to_ne_bytes());
    }
    payload.resize(EVENT_LEN, 0);
    control_message(ack, &payload)
}

#[test]
fn control_message_layout_matches_the_abi() {
    let message = control_message(7, &proc_input(PROC_CN_MCAST_LISTEN, PROC_EVENT_EXIT | PROC_EVENT_EXEC));
    assert_eq!(message.len(), 44);
    assert_eq!(u32_at(&message, 0), Some(44));
    assert_eq!(&message[4..6], &NLMSG_DONE.to_ne_bytes());
    assert_eq!(u32_at(&message, 16), Some(CN_IDX_PROC));
    assert_eq!(u32_at(&message, 20), Some(CN_VAL_PROC));
    assert_eq!(u32_at(&message, 28), Some(7));
    assert_eq!(&message[32..34], &8u16.to_ne_bytes());
    assert_eq!(u32_at(&message, 36), Some(1));
    assert_eq!(u32_at(&message, 40), Some(0x8000_0002));
}

#[test]
fn decodes_exit_exec_fork_and_ack() {
    let mut events = Vec::new();
    decode_datagram(&kernel_message(0, PROC_EVENT_EXIT, 42, &[10, 10, 9, 17, 1, 1]), &mut events);
    decode_datagram(&kernel_message(0, PROC_EVENT_EXIT, 43, &[11, 10, 3 << 8, 17, 1, 1]), &mut events);
    decode_datagram(&kernel_message(0, PROC_EVENT_EXEC, 44, &[12, 12]), &mut events);
    decode_datagram(&kernel_message(0, PROC_EVENT_FORK, 45, &[1, 1, 13, 13]), &mut events);
    decode_datagram(&kernel_message(0, 0x200, 46, &[13, 13]), &mut events);
    let kinds: Vec<ProcEvent> = events.iter().map(|timed| timed.event).collect();
    assert_eq!(
        kinds,
        vec![
            ProcEvent::Exit { pid: 10, tgid: 10, status: ExitStatus::Signaled { signal: 9, core_dumped: false } },
            ProcEvent::Exit { pid: 11, tgid: 10, status: ExitStatus::Exited(3) },
            ProcEvent::Exec { pid: 12, tgid: 12 },
            ProcEvent::Fork { parent_tgid: 1, child_pid: 13, child_tgid: 13 },
            ProcEvent::Other { what: 0x200 },
        ]
    );
    assert_eq!(events[0].timestamp_ns, 42);
    assert_eq!(decode_ack(&kernel_message(5, PROC_EVENT_NONE, 0, &[1])), Some((5, 1)));
    assert_eq!(decode_ack(&kernel_message(5, PROC_EVENT_EXEC, 0, &[1, 1])), None);
}

#[test]
fn truncated_or_foreign_messages_are_ignored() {
    let mut events = Vec::new();
    let message = kernel_message(0, PROC_EVENT_EXIT, 1, &[10, 10, 0, 17, 1, 1]);
    decode_datagram(&message[..30], &mut events);
    let mut foreign = message.clone();
    foreign[16..20].copy_from_slice(&9u32.to_ne_bytes());
    decode_datagram(&foreign, &mut events);
    assert!(events.is_empty());
}

#[test]
fn kernel_timestamps_map_to_instants_in_the_past() {
    let clock = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let now_ns = clock.tv_sec as u64 * 1_000_000_000 + clock.tv_nsec as u64;
    let then = monotonic_instant(now_ns - 50_000_000);
    let age = then.elapsed();
    assert!(age >= Duration::from_millis(50) && age < Duration::from_secs(5), "{age:?}");
}

/// Events until one matches `found` (or 10 s pass), from a real subscription.
fn events_until(connector: &ProcConnector, found: impl Fn(&ProcEvent) -> bool) -> Vec<ProcEvent> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    let mut batch = Vec::new();
    while Instant::now() < deadline {
        let mut fds = [PollFd::new(connector, PollFlags::IN)];
        let _ = rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 100_000_000 }));
        batch.clear();
        connector.read_events(&mut batch).unwrap();
        seen.extend(batch.iter().map(|timed| timed.event));
        if seen.iter().any(&found) {
            break;
        }
    }
    seen
}

fn options(filter: Option<EventTypes>) -> Options {
    Options { receive_buffer: Some(4 << 20), filter, ack_timeout: Duration::from_secs(5) }
}

#[test]
fn kernel_filter_delivers_only_the_asked_types() {
    let exits_only = EventTypes { exit: true, ..EventTypes::default() };
    let connector = ProcConnector::subscribe(options(Some(exits_only))).unwrap();
    assert!(connector.kernel_filter(), "Linux 6.6+ filters events");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let seen = events_until(&connector, |event| matches!(event, ProcEvent::Exit { tgid, .. } if *tgid == pid));
    assert!(
        seen.contains(&ProcEvent::Exit { pid, tgid: pid, status: ExitStatus::Exited(0) }),
        "exit of {pid} not seen in {seen:?}"
    );
    assert!(seen.iter().all(|event| matches!(event, ProcEvent::Exit { .. })), "{seen:?}");
}

#[test]
fn without_a_filter_forks_and_execs_come_too() {
    let connector = ProcConnector::subscribe(options(None)).unwrap();
    assert!(!connector.kernel_filter());
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let seen = events_until(&connector, |event| matches!(event, ProcEvent::Exit { tgid, .. } if *tgid == pid));
    assert!(seen.iter().any(|event| matches!(event, ProcEvent::Fork { child_tgid, .. } if *child_tgid == pid)));
    assert!(seen.contains(&ProcEvent::Exec { pid, tgid: pid }), "{seen:?}");
}

/// Every read up to the end of the queue; whether one of them said Lost.
fn read_to_the_end(connector: &ProcConnector) -> bool {
    let mut batch = Vec::new();
    loop {
        batch.clear();
        match connector.read_events(&mut batch).unwrap() {
            ReadOutcome::More => {}
            ReadOutcome::Lost => return true,
            ReadOutcome::Drained => return false,
        }
    }
}

/// Exits of short processes: more than a minimal receive buffer holds.
fn burst() {
    for _ in 0..200 {
        std::process::Command::new("true").status().unwrap();
    }
}

/// The kernel says `ENOBUFS` once per congestion and drops silently until
/// the queue has been read empty: a loss reported at the `ENOBUFS` itself,
/// with the queue still full, would have missed the second burst here.
#[test]
fn a_loss_is_reported_again_for_every_overflow_after_the_queue_was_read() {
    let exits_only = EventTypes { exit: true, ..EventTypes::default() };
    let options = Options { receive_buffer: Some(1), ..options(Some(exits_only)) };
    let connector = ProcConnector::subscribe(options).unwrap();
    burst();
    let mut batch = Vec::new();
    let first = connector.read_events(&mut batch).unwrap();
    assert_eq!(first, ReadOutcome::Lost, "the first overflow, its queue read to the end in the same batch");
    burst();
    assert!(read_to_the_end(&connector), "the second overflow is reported too");
}
