//! The BAR 0 register window as the guest sees it: which writes are
//! plain storage, which start control work for the core (ring enable and
//! reset, mailbox commands), which raise interrupts (`docs/device-interface.md`).
//! Runs on the vCPU thread (or the vfio-user thread) under the register
//! lock only; the work a write starts is posted to the core.

use vnpu_abi::device::{self as abi, regs};

use super::{Control, Shared};
use crate::low32;
use crate::msi::lock;

/// Little-endian value of a register write of 1 to 8 bytes.
fn value(data: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(b)
}

impl Shared {
    /// A guest read of BAR 0 (bytes past the registers read 0).
    pub(crate) fn register_read(&self, offset: u64, data: &mut [u8]) {
        lock(&self.regs).read(offset, data);
    }

    /// A guest write to BAR 0: a register's side effect, control work
    /// posted to the core, or plain storage (to add a register: its
    /// offset in `vnpu_abi::device::regs`, its rule here, its start-up
    /// value in `initial_registers` and whether a restored state keeps it
    /// in `RegFile::resume`; `docs/architecture.md`).
    pub(crate) fn register_write(&self, offset: u64, data: &[u8]) {
        let v = value(data);
        match offset {
            regs::DOORBELL => {
                // Reached only while the ioeventfd is not registered.
                let _ = self.doorbell.write(1);
            }
            regs::CAL_NOP => {}
            regs::CAL_LOOPBACK => self.irq.raise(abi::LOOPBACK_VECTOR),
            regs::INT_TEST => {
                // A vector number past u16 names no vector: nothing to raise.
                if let Ok(v) = u16::try_from(v) {
                    self.irq.raise(v)
                }
            }
            regs::INT_STATUS => lock(&self.regs).update_u32(regs::INT_STATUS, |s| s & !low32(v)),
            regs::QUEUE_ENABLE if v & 1 == 1 => {
                let c = {
                    let mut r = lock(&self.regs);
                    if r.u32(regs::QUEUE_ENABLE) != 0
                        || r.u32(regs::STATUS) & (abi::STATUS_RESETTING | abi::STATUS_FAILED) != 0
                    {
                        return;
                    }
                    r.set_u32(regs::QUEUE_ENABLE, 1);
                    Control::Enable {
                        size: r.u32(regs::QUEUE_SIZE),
                        desc: r.u64(regs::QUEUE_DESC),
                        avail: r.u64(regs::QUEUE_AVAIL),
                        used: r.u64(regs::QUEUE_USED),
                    }
                };
                self.post(c);
            }
            regs::QUEUE_ENABLE | regs::DEVICE_RESET => {
                if offset == regs::DEVICE_RESET && v & 1 == 0 {
                    return;
                }
                lock(&self.regs).update_u32(regs::STATUS, |s| s | abi::STATUS_RESETTING);
                self.post(Control::Reset);
            }
            regs::MBOX_CMD => {
                let c = {
                    let mut r = lock(&self.regs);
                    if r.u32(regs::MBOX_STATUS) == abi::MBOX_BUSY {
                        return;
                    }
                    r.set_u32(regs::MBOX_CMD, low32(v));
                    r.set_u32(regs::MBOX_STATUS, abi::MBOX_BUSY);
                    let mut args = [0u64; 6];
                    for (i, a) in args.iter_mut().enumerate() {
                        *a = r.u64(regs::MBOX_ARG0 + 8 * i as u64);
                    }
                    Control::Mailbox { cmd: low32(v), args }
                };
                self.post(c);
            }
            _ => {
                let mut r = lock(&self.regs);
                // The ring's registers are frozen while it is enabled.
                let ring = (regs::QUEUE_SIZE..regs::QUEUE_ENABLE).contains(&offset);
                if !(ring && r.u32(regs::QUEUE_ENABLE) != 0) {
                    r.store(offset, data);
                }
            }
        }
    }
}
