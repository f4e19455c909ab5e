//! The worker's event loop: doorbells and control work by eventfd, and
//! polling the ring for a while after requests.

use super::*;

impl MutEventSubscriber for Worker {
    fn init(&mut self, ops: &mut EventOps) {
        let ok = ops.add(Events::new(&self.shared.control_evt, EventSet::IN)).is_ok()
            && ops.add(Events::new(&self.shared.doorbell, EventSet::IN)).is_ok();
        if !ok {
            // Without its events the worker cannot serve the guest; the
            // device reports the failure instead of hanging requests.
            self.fail(abi::ERR_QUEUE_BROKEN);
            self.stopped = true;
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        // Reading resets the eventfd counters; EAGAIN (already zero) is fine.
        if events.fd() == std::os::fd::AsRawFd::as_raw_fd(&self.shared.control_evt) {
            let _ = self.shared.control_evt.read();
        } else {
            let _ = self.shared.doorbell.read();
        }
        // Control messages first: a ring enabled just before a doorbell
        // must exist when the doorbell is served.
        self.handle_controls();
        if !self.stopped {
            self.drain_ring();
            self.poll_ring();
        }
    }
}

impl Worker {
    /// Whether the driver has posted requests not yet taken.
    pub(super) fn ring_pending(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| {
            q.avail_idx(&self.mem, std::sync::atomic::Ordering::Acquire).is_ok_and(|i| i.0 != q.next_avail())
        })
    }

    /// Polls the ring for `opts.poll` after the last request, with doorbells
    /// suppressed (`VRING_USED_F_NO_NOTIFY`), so back-to-back requests skip
    /// both the doorbell exit and the thread wake-up.
    pub(super) fn poll_ring(&mut self) {
        if self.opts.poll.is_zero() {
            return;
        }
        let mut deadline = Instant::now() + self.opts.poll;
        loop {
            let Some(q) = self.queue.as_mut() else { return };
            if q.disable_notification(&self.mem).is_err() {
                return;
            }
            let mut spins = 0u32;
            loop {
                if self.ring_pending() {
                    self.drain_ring();
                    deadline = Instant::now() + self.opts.poll;
                }
                if !lock(&self.shared.controls).is_empty() {
                    self.handle_controls();
                    if self.stopped {
                        return;
                    }
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && Instant::now() >= deadline {
                    break;
                }
                std::hint::spin_loop();
            }
            // Re-enable doorbells, then look once more: a request posted in
            // between would otherwise wait for a doorbell that never comes.
            let Some(q) = self.queue.as_mut() else { return };
            match q.enable_notification(&self.mem) {
                Ok(true) => {
                    self.drain_ring();
                    deadline = Instant::now() + self.opts.poll;
                }
                _ => return,
            }
        }
    }
}
