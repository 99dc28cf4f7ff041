//! A thread that calls the kubelet for whoever asks.
use std::io;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

use tracing::error;

use std::sync::Arc;

use super::{Kubelet, KubeletError, PodList};

/// One `/pods` call and how long it took.
pub struct Answer {
    pub pods: Result<Arc<PodList>, KubeletError>,
    pub took: Duration,
}

/// Calls the kubelet on a thread of its own, one call at a time, so a slow
/// kubelet never holds up the loop. Requests made while a call is running
/// are folded into one more call after it.
pub struct Asker {
    /// Dropping it ends the thread after its current call; nobody waits
    /// for that (a call may take up to the kubelet timeout).
    requests: Option<Sender<()>>,
    in_flight: bool,
    asked_again: bool,
}

impl Asker {
    /// Starts the thread; every answer is passed to `deliver`, which
    /// returns false when nobody listens any more.
    pub fn spawn(kubelet: Kubelet, deliver: impl Fn(Answer) -> bool + Send + 'static) -> io::Result<Self> {
        let (requests, inbox) = mpsc::channel::<()>();
        std::thread::Builder::new().name("kubelet".into()).spawn(move || {
            while inbox.recv().is_ok() {
                let started = Instant::now();
                let pods = kubelet.pods();
                if !deliver(Answer { pods, took: started.elapsed() }) {
                    return;
                }
            }
        })?;
        Ok(Asker { requests: Some(requests), in_flight: false, asked_again: false })
    }

    /// Asks for a fresh `/pods` answer.
    pub fn ask(&mut self) {
        if self.in_flight {
            self.asked_again = true;
            return;
        }
        if let Some(requests) = &self.requests
            && requests.send(()).is_ok()
        {
            self.in_flight = true;
        } else {
            error!("kubelet thread is gone");
        }
    }

    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Notes that an answer arrived; asks again if that was requested.
    pub fn answered(&mut self) {
        self.in_flight = false;
        if std::mem::take(&mut self.asked_again) {
            self.ask();
        }
    }
}
