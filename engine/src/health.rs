//! Liveness and readiness of the supervisor loop, for `/healthz` and
//! `/readyz`.
//!
//! An idle loop sleeps on its channel with no timer, so there is no
//! heartbeat to look at: liveness is asked of the loop itself. A ping goes
//! into its event channel, and a loop that answers within the wait is alive.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};
use std::time::Duration;

type Ping = Box<dyn Fn(Pong) -> bool + Send>;

/// Shared by the loop, which attaches itself and says when it is ready,
/// and the HTTP server, which asks.
#[derive(Default)]
pub struct Health {
    ready: AtomicBool,
    /// Why the state file cannot be saved, while it cannot: healing goes
    /// on, so the supervisor stays ready, but `/readyz` says it.
    state_problem: Mutex<Option<String>>,
    /// Puts a ping into the loop's channel; false when the loop is gone.
    ping: Mutex<Option<Ping>>,
}

/// The reply slot of one ping; the loop answers with [`Pong::answer`].
#[derive(Debug)]
pub struct Pong(mpsc::SyncSender<()>);

impl Pong {
    pub fn answer(self) {
        // The asker may have given up waiting; nobody else needs the answer.
        let _ = self.0.try_send(());
    }
}

impl Health {
    pub fn new() -> Self {
        Health::default()
    }

    /// Called by the loop: `ping` sends a [`Pong`] into its channel and
    /// says whether it could.
    pub fn attach(&self, ping: impl Fn(Pong) -> bool + Send + 'static) {
        *self.ping.lock().unwrap_or_else(PoisonError::into_inner) = Some(Box::new(ping));
    }

    /// Called by the loop on its way out: neither alive nor ready any more.
    pub fn detach(&self) {
        self.ready.store(false, Ordering::SeqCst);
        *self.ping.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The first scan is done: targets are known and broken ones planned.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Called by the state writer when saves start failing and when one
    /// works again (None).
    pub fn set_state_problem(&self, problem: Option<String>) {
        *self.state_problem.lock().unwrap_or_else(PoisonError::into_inner) = problem;
    }

    pub fn state_problem(&self) -> Option<String> {
        self.state_problem.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Whether the loop answered a ping within `wait`.
    pub fn is_alive(&self, wait: Duration) -> bool {
        let (reply, answered) = mpsc::sync_channel(1);
        let sent = match &*self.ping.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(ping) => ping(Pong(reply)),
            None => false,
        };
        sent && answered.recv_timeout(wait).is_ok()
    }
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let attached = self.ping.lock().unwrap_or_else(PoisonError::into_inner).is_some();
        f.debug_struct("Health").field("ready", &self.is_ready()).field("attached", &attached).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    /// A loop thread that answers pings until its channel closes.
    fn answering_loop(health: &Health) -> std::thread::JoinHandle<usize> {
        let (events, inbox) = mpsc::channel::<Pong>();
        health.attach(move |pong| events.send(pong).is_ok());
        std::thread::spawn(move || {
            let mut answered = 0;
            for pong in inbox {
                pong.answer();
                answered += 1;
            }
            answered
        })
    }

    #[test]
    fn a_loop_that_answers_is_alive_and_not_after_detaching() {
        let health = Arc::new(Health::new());
        let thread = answering_loop(&health);
        assert!(health.is_alive(WAIT));
        assert!(health.is_alive(WAIT));
        health.detach();
        assert!(!health.is_alive(WAIT), "a detached loop answered");
        assert_eq!(thread.join().unwrap(), 2);
    }

    #[test]
    fn a_loop_that_does_not_answer_is_not_alive() {
        let health = Health::new();
        assert!(!health.is_alive(WAIT), "alive with no loop attached");
        // Takes pings but never answers: a loop stuck in a heal.
        let (events, stuck) = mpsc::channel::<Pong>();
        health.attach(move |pong| events.send(pong).is_ok());
        assert!(!health.is_alive(Duration::from_millis(20)));
        assert_eq!(stuck.try_iter().count(), 1, "the ping did not reach the loop");
    }

    #[test]
    fn ready_after_the_first_scan_until_detached() {
        let health = Health::new();
        assert!(!health.is_ready());
        health.set_ready();
        assert!(health.is_ready());
        health.detach();
        assert!(!health.is_ready());
    }
}
