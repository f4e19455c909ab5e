//! The `vnpu_ring` fuzz target's harness: a detached device core driven
//! through its BAR 0 registers, as a guest drives it.

use std::sync::Arc;

use npu_model::config::{HBM_SLICE, SRAM_SLICE};
use npu_model::BoardConfig;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vnpu_abi::device::{regs, BAR0_SIZE};
use vnpu_device::device_core::DeviceCore;
use vnpu_device::{DeviceOptions, MsiSink};
use vnpu_pci::MsiMessage;
use vnpu_spec::VnpuSpec;

/// Guest memory of the harness: rings, descriptors and programs live here.
const MEM: usize = 16 << 10;

/// Interrupts go nowhere (a fuzz run raises many).
struct Discard;

impl MsiSink for Discard {
    fn deliver(&self, _: MsiMessage) {}
}

/// Up to 8 little-endian bytes of `b` from `o` (missing bytes read 0).
fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut x = [0u8; 8];
    for (i, v) in b.iter().skip(o).take(8).enumerate() {
        x[i] = *v;
    }
    u64::from_le_bytes(x)
}

/// Drives a detached device core from fuzzer bytes: an operation count,
/// that many 16-byte operations (ring set-up with any size and addresses,
/// device reset, mailbox commands with any arguments, ring drains, a
/// write of any width to any BAR 0 offset), then guest memory contents
/// (repeated to fill it). After each operation the core handles the
/// control work it started, as its worker thread would. Nothing here may
/// panic the core.
pub fn drive_ring(data: &[u8]) {
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]) else { return };
    let Some((&n, rest)) = data.split_first() else { return };
    let (ops, init) = rest.split_at(rest.len().min(16 * usize::from(n)));
    if !init.is_empty() {
        let fill: Vec<u8> = init.iter().copied().cycle().take(MEM).collect();
        let _ = mem.write_slice(&fill, GuestAddress(0));
    }
    // The smallest segments a vNPU can have keep each run fast (HBM is
    // allocated lazily); a guest's CONFIGURE within them succeeds.
    let Ok(grant) = VnpuSpec::new(1, 2, 2, 2, SRAM_SLICE, HBM_SLICE) else { return };
    let opts = DeviceOptions { poll: std::time::Duration::ZERO, ..Default::default() };
    let Ok(mut core) = DeviceCore::detached(mem, &BoardConfig::default(), grant, opts, Arc::new(Discard))
    else {
        return;
    };
    let mem_len = MEM as u64;
    for op in ops.chunks(16) {
        let byte = |i: usize| op.get(i).copied().unwrap_or(0);
        match op[0] % 5 {
            0 => {
                let size = u64::from(op.get(1).copied().unwrap_or(8));
                core.register_write(regs::QUEUE_SIZE, &size.to_le_bytes()[..4]);
                core.register_write(regs::QUEUE_DESC, &(u64_at(op, 2) % (mem_len + 64)).to_le_bytes());
                core.register_write(regs::QUEUE_AVAIL, &(u64_at(op, 6) % mem_len).to_le_bytes());
                core.register_write(regs::QUEUE_USED, &(u64_at(op, 10) % mem_len).to_le_bytes());
                core.register_write(regs::QUEUE_ENABLE, &1u32.to_le_bytes());
            }
            1 => core.register_write(regs::DEVICE_RESET, &1u32.to_le_bytes()),
            2 => {
                let args = [u64_at(op, 2) % 4, u64_at(op, 4) % 4, u64_at(op, 6), u64_at(op, 8), 1, 1];
                for (i, a) in (0u64..).zip(args) {
                    core.register_write(regs::MBOX_ARG0 + 8 * i, &a.to_le_bytes());
                }
                core.register_write(regs::MBOX_CMD, &u32::from(byte(1) % 7).to_le_bytes());
            }
            3 => core.drain_ring(),
            _ => {
                // Any offset (past BAR 0 too), any width of 1 to 8 bytes.
                let offset = u64::from(u16::from_le_bytes([byte(1), byte(2)])) % (BAR0_SIZE + 16);
                let width = usize::from(byte(3) % 8) + 1;
                let value = u64_at(op, 4).to_le_bytes();
                core.register_write(offset, &value[..width]);
                let mut back = [0u8; 8];
                core.register_read(offset, &mut back[..width]);
            }
        }
        core.handle_controls();
        if core.stopped() {
            return;
        }
    }
}
