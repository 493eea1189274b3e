//! Open WebSocket connections, against `[websocket] max_connections`, and the notice that the
//! server is shutting down (each connection finishes its response in flight, then closes).

use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus::IntGauge;
use tokio::sync::watch;

#[derive(Debug)]
pub struct Connections {
    open: AtomicUsize,
    draining: watch::Sender<bool>,
    /// `warmpath_ws_connections`.
    gauge: IntGauge,
}

impl Connections {
    pub fn new(gauge: IntGauge) -> Connections {
        Connections { open: AtomicUsize::new(0), draining: watch::channel(false).0, gauge }
    }

    /// A slot for one more connection, or the number open when `max` are.
    pub fn open(&self, max: usize) -> Result<ConnectionSlot<'_>, usize> {
        let open = self.open.fetch_add(1, Ordering::AcqRel) + 1;
        let slot = ConnectionSlot { connections: self };
        if open > max {
            return Err(open - 1);
        }
        self.gauge.set(open as i64);
        Ok(slot)
    }

    /// Connections open now.
    pub fn count(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Every connection finishes its response in flight, then closes (1012).
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    /// Changes to `true` when the server starts draining.
    pub fn draining(&self) -> watch::Receiver<bool> {
        self.draining.subscribe()
    }
}

/// One open connection; closing it (dropping the slot) frees its place.
#[derive(Debug)]
pub struct ConnectionSlot<'a> {
    connections: &'a Connections,
}

impl Drop for ConnectionSlot<'_> {
    fn drop(&mut self) {
        let c = self.connections;
        let n = c.open.fetch_sub(1, Ordering::AcqRel) - 1;
        c.gauge.set(n as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_holds_and_slots_free_their_place() {
        let c = Connections::new(IntGauge::new("g", "g").expect("gauge"));
        let a = c.open(2).expect("first");
        let b = c.open(2).expect("second");
        assert_eq!(c.open(2).err(), Some(2), "refused at the cap");
        assert_eq!(c.gauge.get(), 2);
        drop(a);
        assert_eq!(c.gauge.get(), 1);
        let _c = c.open(2).expect("a freed place");
        drop(b);
        assert_eq!(c.gauge.get(), 1);
    }
}
