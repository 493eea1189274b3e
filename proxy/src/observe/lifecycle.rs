//! Where the process is in its life: serving, draining (SIGTERM: no new connections, the work
//! in flight finishing; `/readyz` and the API's `/health` answer 503), or closing (the grace
//! period is over: streams still running end with an error event). The requests being served
//! are counted here, so a drain knows when nothing is left.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::watch;

/// Requests being served in this process, every route (a WebSocket connection counts while
/// it is open).
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// One request being served: counted while it lives.
#[derive(Debug)]
pub struct Active(());

impl Active {
    pub fn start() -> Active {
        ACTIVE.fetch_add(1, Ordering::AcqRel);
        Active(())
    }

    /// How many are being served now.
    pub fn count() -> usize {
        ACTIVE.load(Ordering::Acquire)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
pub struct Lifecycle {
    draining: AtomicBool,
    closing: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle { draining: AtomicBool::new(false), closing: watch::Sender::new(false) }
    }
}

impl Lifecycle {
    /// SIGTERM came: no longer ready.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The grace period is over: what still runs ends now.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Resolves (`wait_for(|c| *c)`) once [`Lifecycle::close`] was called.
    pub fn closing(&self) -> watch::Receiver<bool> {
        self.closing.subscribe()
    }
}
