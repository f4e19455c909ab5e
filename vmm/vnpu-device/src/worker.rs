//! The worker thread: a thin shell that runs one vNPU's device core
//! (`device_core::DeviceCore`) on a thread of its own. It sleeps in an
//! event-manager loop on two eventfds, the doorbell (an ioeventfd, so a
//! guest's doorbell write wakes it without a vCPU exit to userspace) and
//! the control channel (ring set-up, reset and mailbox commands posted by
//! the vCPU thread), hands each wake-up to the core, and polls the ring
//! for a while after requests. The vCPU thread never waits for it.

use std::sync::Arc;
use std::time::Instant;

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use vnpu_abi::device::{self as abi, regs};

use crate::device_core::{mark_failed, DeviceCore, Shared};
use crate::msi::lock;

impl MutEventSubscriber for DeviceCore {
    fn init(&mut self, ops: &mut EventOps) {
        let shared = Arc::clone(self.shared());
        let ok = ops.add(Events::new(&shared.control_evt, EventSet::IN)).is_ok()
            && ops.add(Events::new(&shared.doorbell, EventSet::IN)).is_ok();
        if !ok {
            // Without its events the core cannot serve the guest; the
            // device reports the failure instead of hanging requests.
            self.fail_and_stop(abi::ERR_QUEUE_BROKEN);
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let shared = Arc::clone(self.shared());
        // Reading resets the eventfd counters; EAGAIN (already zero) is fine.
        if events.fd() == std::os::fd::AsRawFd::as_raw_fd(&shared.control_evt) {
            let _ = shared.control_evt.read();
        } else {
            let _ = shared.doorbell.read();
        }
        // Control messages first: a ring enabled just before a doorbell
        // must exist when the doorbell is served.
        self.handle_controls();
        if !self.stopped() {
            self.drain_ring();
            poll_ring(self);
        }
    }
}

/// Polls the ring for the core's polling window after the last request,
/// with doorbells suppressed (`VRING_USED_F_NO_NOTIFY`), so back-to-back
/// requests skip both the doorbell exit and the thread wake-up. Control
/// work is looked at between requests, and a stop ends the polling at
/// once, however full the guest keeps its ring.
fn poll_ring(core: &mut DeviceCore) {
    let window = core.poll_window();
    if window.is_zero() {
        return;
    }
    let mut deadline = Instant::now() + window;
    loop {
        if !core.suppress_doorbells() {
            return;
        }
        let mut spins = 0u32;
        loop {
            if core.ring_pending() {
                core.drain_ring();
                deadline = Instant::now() + window;
            }
            if core.has_controls() {
                core.handle_controls();
            }
            if core.stopped() {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && Instant::now() >= deadline {
                break;
            }
            std::hint::spin_loop();
        }
        // Re-enable doorbells, then look once more: a request posted in
        // between would otherwise wait for a doorbell that never comes.
        match core.allow_doorbells() {
            Some(true) => {
                core.drain_ring();
                if core.stopped() {
                    return;
                }
                deadline = Instant::now() + window;
            }
            _ => return,
        }
    }
}

/// Starts the worker thread for `worker`; it runs until [`Control::Stop`].
/// Should it panic (a host bug), the vNPU is left in a failed state the
/// driver can read (`ERR_DEVICE_FAULT`), never a silent hang.
pub(crate) fn spawn(worker: DeviceCore, name: String) -> std::io::Result<std::thread::JoinHandle<()>> {
    let shared = Arc::clone(worker.shared());
    std::thread::Builder::new().name(name).spawn(move || {
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(worker)));
        if served.is_err() {
            died(&shared);
        }
    })
}

/// The worker's event loop.
fn serve(worker: DeviceCore) {
    let mut em = match EventManager::<DeviceCore>::new() {
        Ok(em) => em,
        Err(_) => return,
    };
    let id = em.add_subscriber(worker);
    loop {
        match em.subscriber_mut(id) {
            Ok(w) if !w.stopped() => {}
            _ => return,
        }
        if em.run().is_err() {
            return;
        }
    }
}

/// Puts the vNPU of a worker that panicked in its failed state and wakes
/// a driver waiting on an interrupt.
fn died(shared: &Shared) {
    shared.dead.store(true, std::sync::atomic::Ordering::Release);
    lock(&shared.controls).clear();
    {
        let mut r = lock(&shared.regs);
        mark_failed(&mut r, abi::ERR_DEVICE_FAULT);
        // No reset will ever complete.
        r.set_u32(regs::QUEUE_ENABLE, 0);
        r.update_u32(regs::STATUS, |s| s & !abi::STATUS_RESETTING);
        // A mailbox command in flight ends with an error.
        if r.u32(regs::MBOX_STATUS) == abi::MBOX_BUSY {
            r.set_u32(regs::MBOX_STATUS, abi::ST_EXEC_FAULT);
        }
    }
    shared.notify(abi::INT_QUEUE, regs::QUEUE_VECTOR);
    shared.notify(abi::INT_MAILBOX, regs::MBOX_VECTOR);
}
