//! Ctrl-C during the demo.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use signal_hook::SigId;
use signal_hook::consts::{SIGINT, SIGTERM};

use super::DemoError;

/// SIGINT/SIGTERM set a flag checked between steps; a second one exits at
/// once (the kernel still takes the namespace and the children with us).
pub(super) struct Interrupt {
    flag: Arc<AtomicBool>,
    handlers: Vec<SigId>,
}

impl Interrupt {
    pub(super) fn install() -> Result<Self, DemoError> {
        let flag = Arc::new(AtomicBool::new(false));
        let mut interrupt = Interrupt { flag: Arc::clone(&flag), handlers: Vec::new() };
        for signal in [SIGINT, SIGTERM] {
            // Registered first, so it sees the flag before this signal sets it.
            let exit = signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&flag))
                .map_err(DemoError::Signals)?;
            interrupt.handlers.push(exit);
            let set = signal_hook::flag::register(signal, Arc::clone(&flag)).map_err(DemoError::Signals)?;
            interrupt.handlers.push(set);
        }
        Ok(interrupt)
    }

    pub(super) fn requested(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    pub(super) fn check(&self) -> Result<(), DemoError> {
        if self.requested() { Err(DemoError::Interrupted) } else { Ok(()) }
    }
}

impl Drop for Interrupt {
    fn drop(&mut self) {
        for handler in self.handlers.drain(..) {
            signal_hook::low_level::unregister(handler);
        }
    }
}
