//! The vNPU PCI function's guest interface: BAR 0 register offsets, the
//! control mailbox, the request header and status block of the command
//! ring, and every status code. The VMM's device and the guest driver both
//! use these definitions; `docs/device-interface.md` is the prose version.

use crate::program::{le_u32, le_u64};

/// PCI vendor ID of the vNPU function (and of the host bridge).
pub const VENDOR_ID: u16 = 0x5650;
/// PCI device ID of the vNPU function.
pub const DEVICE_ID: u16 = 0x0001;
/// PCI class code: processing accelerator.
pub const CLASS: u32 = 0x12_00_00;
/// Value of `ABI_VERSION` (major << 16 | minor). Minor 1 added program
/// registration (`OP_REGISTER`, `OP_RUN_REGISTERED`, `OP_UNREGISTER`);
/// minor 2 spread programs (program container version 2,
/// [`crate::program::FLAG_SPREAD`]).
pub const ABI_VERSION: u32 = 1 << 16 | 2;
/// The vfio-user `VERSION` capability in which a VMM names its device
/// session and asks the board daemon to resume it after a restart, and
/// the daemon answers whether it did (`docs/vfio-user.md`, "Daemon
/// restarts").
pub const SESSION_CAPABILITY: &str = "vnpu-session";
/// Programs a vNPU keeps registered at once.
pub const MAX_REGISTERED: usize = 64;
/// Most instructions all of a vNPU's registered programs may hold together
/// (each at most `program::MAX_INSTRUCTIONS`): bounds the host memory a
/// guest can keep allocated through `REGISTER` (256 MiB per vNPU: an
/// `Instr` is 64 bytes).
pub const MAX_REGISTERED_INSTRUCTIONS: usize = 1 << 22;
/// `MAGIC` as a little-endian u32 (the bytes `"VNPU"`).
pub const MAGIC: u32 = u32::from_le_bytes(*b"VNPU");
/// Size of BAR 0 (registers on page 0, doorbells on page 1).
pub const BAR0_SIZE: u64 = 0x4000;
/// Size of BAR 2 (MSI-X table at 0, PBA at [`MSIX_PBA_OFFSET`]).
pub const BAR2_SIZE: u64 = 0x2000;
/// Offset of the PBA in BAR 2.
pub const MSIX_PBA_OFFSET: u64 = 0x1000;
/// MSI-X vectors of the function.
pub const MSIX_VECTORS: u16 = 8;
/// Largest ring the device accepts (`QUEUE_SIZE_MAX`).
pub const QUEUE_SIZE_MAX: u16 = 256;
/// `QUEUE_VECTOR` / `MBOX_VECTOR` value meaning "no interrupt".
pub const NO_VECTOR: u32 = 0xffff;
/// Vector the `CAL_LOOPBACK` doorbell raises (see [`regs::CAL_LOOPBACK`]).
pub const LOOPBACK_VECTOR: u16 = 7;
/// Largest program a `RUN` request may carry, in bytes.
pub const MAX_PROGRAM_BYTES: u32 = 16 << 20;

/// BAR 0 register offsets. All registers are little-endian; u64 registers
/// may be accessed as two u32 halves.
pub mod regs {
    /// u32, RO: [`super::MAGIC`].
    pub const MAGIC: u64 = 0x000;
    /// u32, RO: [`super::ABI_VERSION`].
    pub const ABI_VERSION: u64 = 0x004;
    /// u32, RO: `STATUS_*` bits.
    pub const STATUS: u64 = 0x008;
    /// u32, RO: device error code (`ERR_*`), 0 for none; cleared by `DEVICE_RESET`.
    pub const ERROR: u64 = 0x00c;
    /// u32, RO: chips of the vNPU board.
    pub const NUM_CHIPS: u64 = 0x010;
    /// u32, RO: cores per chip.
    pub const CORES_PER_CHIP: u64 = 0x014;
    /// u32, RO: systolic arrays per core.
    pub const SA_PER_CORE: u64 = 0x018;
    /// u32, RO: vector units per core.
    pub const VU_PER_CORE: u64 = 0x01c;
    /// u64, RO: SRAM bytes per core.
    pub const SRAM_PER_CORE: u64 = 0x020;
    /// u64, RO: HBM bytes per core.
    pub const HBM_PER_CORE: u64 = 0x028;
    /// u32, RO: PE rows of each SA.
    pub const SA_ROWS: u64 = 0x030;
    /// u32, RO: PE columns of each SA.
    pub const SA_COLS: u64 = 0x034;
    /// u32, RO: f32 lanes of each VU.
    pub const VU_LANES: u64 = 0x038;
    /// u32, RO: core clock in MHz.
    pub const CLOCK_MHZ: u64 = 0x03c;
    /// u32, WO (reads 0): writing `v` raises MSI-X vector `v`.
    pub const INT_TEST: u64 = 0x040;
    /// u32, RW1C: `INT_*` bits of events that raised (or would have raised) an interrupt.
    pub const INT_STATUS: u64 = 0x044;
    /// u32, RO: [`super::QUEUE_SIZE_MAX`].
    pub const QUEUE_SIZE_MAX: u64 = 0x048;
    /// u32, RW: ring size, a power of two in 1..=`QUEUE_SIZE_MAX`.
    pub const QUEUE_SIZE: u64 = 0x04c;
    /// u64, RW: guest-physical address of the descriptor table (16-byte aligned).
    pub const QUEUE_DESC: u64 = 0x050;
    /// u64, RW: guest-physical address of the available ring (2-byte aligned).
    pub const QUEUE_AVAIL: u64 = 0x058;
    /// u64, RW: guest-physical address of the used ring (4-byte aligned).
    pub const QUEUE_USED: u64 = 0x060;
    /// u32, RW: write 1 to enable the ring (checked at once), 0 to disable it.
    pub const QUEUE_ENABLE: u64 = 0x068;
    /// u32, RW: MSI-X vector for request completions, or [`super::NO_VECTOR`].
    pub const QUEUE_VECTOR: u64 = 0x06c;
    /// u32, RW: MSI-X vector for mailbox completions, or [`super::NO_VECTOR`].
    pub const MBOX_VECTOR: u64 = 0x070;
    /// u32, RO: requests completed since the ring was enabled (wraps).
    pub const COMPLETED: u64 = 0x074;
    /// u32, WO: writing 1 disables the ring and clears `ERROR` and the failed state.
    pub const DEVICE_RESET: u64 = 0x078;
    /// u32, RW: writing a `MBOX_*` command starts it (the arguments must be written first).
    pub const MBOX_CMD: u64 = 0x080;
    /// u32, RO: `MBOX_BUSY` while a command runs, then its status code (`STATUS_*` codes below).
    pub const MBOX_STATUS: u64 = 0x084;
    /// u64 x 6, RW: mailbox arguments 0..=5.
    pub const MBOX_ARG0: u64 = 0x088;
    /// u64, RO: the result of the last mailbox command.
    pub const MBOX_RESULT: u64 = 0x0b8;
    /// End of page 0's registers.
    pub const END: u64 = 0x0c0;
    /// Page 1, WO: any write tells the device the available ring has new
    /// requests. An ioeventfd: the write does not leave the kernel.
    pub const DOORBELL: u64 = 0x1000;
    /// Page 1, WO, calibration: an ioeventfd that nothing consumes (the raw
    /// cost of a doorbell write).
    pub const CAL_NOP: u64 = 0x1100;
    /// Page 1, WO, calibration: an ioeventfd that is also the irqfd of
    /// MSI-X vector [`super::LOOPBACK_VECTOR`], so the write becomes an
    /// interrupt inside the kernel (the raw cost of doorbell + MSI). The
    /// vector's route exists once the guest has raised it through
    /// `INT_TEST`; MSI-X masking does not apply to this path.
    pub const CAL_LOOPBACK: u64 = 0x1200;
}

/// `STATUS` bit: the vNPU is configured and takes requests.
pub const STATUS_READY: u32 = 1 << 0;
/// `STATUS` bit: the ring is enabled.
pub const STATUS_QUEUE_READY: u32 = 1 << 1;
/// `STATUS` bit: the device stopped processing the ring after a fatal ring
/// error (`ERROR` says which); `DEVICE_RESET` recovers.
pub const STATUS_FAILED: u32 = 1 << 2;
/// `STATUS` bit: a reset (`DEVICE_RESET`, or `QUEUE_ENABLE` = 0) is in
/// progress; the ring registers may be written again once it clears.
pub const STATUS_RESETTING: u32 = 1 << 3;

/// `INT_STATUS` bit: a request completed.
pub const INT_QUEUE: u32 = 1 << 0;
/// `INT_STATUS` bit: a mailbox command completed.
pub const INT_MAILBOX: u32 = 1 << 1;
/// `INT_STATUS` bit: the host changed the vNPU's grant (a live remap):
/// `QUERY_GRANT` returns the new one; a configuration beyond it has been
/// shrunk to it. Raised on `MBOX_VECTOR`.
pub const INT_GRANT: u32 = 1 << 2;

/// `ERROR`: `QUEUE_ENABLE` with a size or addresses the device refuses.
pub const ERR_QUEUE_INVALID: u32 = 0x100;
/// `ERROR`: the ring itself could not be read or written (fatal until reset).
pub const ERR_QUEUE_BROKEN: u32 = 0x101;
/// `ERROR`: a request had no status block; it was completed with length 0.
pub const ERR_NO_STATUS_BLOCK: u32 = 0x102;
/// `ERROR`: an unknown mailbox command was written.
pub const ERR_MBOX_UNKNOWN: u32 = 0x103;
/// `ERROR`: the device's worker stopped on an internal fault (a bug of the
/// host, never the guest's request): `FAILED` is set for good; requests
/// and mailbox commands are no longer served. The driver sees it as a
/// failed device instead of waiting.
pub const ERR_DEVICE_FAULT: u32 = 0x104;

/// Mailbox: `MBOX_STATUS` while a command runs.
pub const MBOX_BUSY: u32 = 0xffff_ffff;
/// Mailbox command: (re)configure the vNPU. Args: SAs, VUs, SRAM bytes, HBM
/// bytes per core, cores per chip, chips. Each must be within what the
/// host granted (the VM's `--vnpu`); SRAM and HBM are reallocated zeroed.
pub const MBOX_CONFIGURE: u32 = 1;
/// Mailbox command: release the configuration (requests then fail with
/// `ST_NOT_CONFIGURED` until the next `MBOX_CONFIGURE`).
pub const MBOX_RELEASE: u32 = 2;
/// Mailbox command: write the counter block to guest memory. Args: guest
/// address, buffer length. Result: bytes written.
pub const MBOX_READ_COUNTERS: u32 = 3;
/// Mailbox command: zero the counters.
pub const MBOX_RESET_COUNTERS: u32 = 4;
/// Mailbox command: result = the granted maximum as `sa | vu << 16 | cores << 32 | chips << 48`.
pub const MBOX_QUERY_GRANT: u32 = 5;

/// Request opcodes (header `opcode`).
pub const OP_NOP: u32 = 0;
/// Run the program carried in the request's readable descriptors.
pub const OP_RUN: u32 = 1;
/// Decode and verify the program carried in the request once and keep
/// it; the handle comes back in the status block's `detail`.
pub const OP_REGISTER: u32 = 2;
/// Run the registered program named by the header's `handle` (no program
/// descriptors; not verified again).
pub const OP_RUN_REGISTERED: u32 = 3;
/// Forget the registered program named by the header's `handle`.
pub const OP_UNREGISTER: u32 = 4;
/// Header flag: complete without raising an interrupt (the driver polls).
pub const FLAG_NO_INTERRUPT: u32 = 1 << 0;

/// Status codes, in the status block (`status`) and in `MBOX_STATUS`.
pub const ST_OK: u32 = 0;
/// The descriptor chain or header is malformed.
pub const ST_BAD_REQUEST: u32 = 1;
/// Unknown request opcode.
pub const ST_UNKNOWN_OPCODE: u32 = 2;
/// The program does not decode.
pub const ST_BAD_PROGRAM: u32 = 3;
/// The verifier refused the program; `detail` = stream << 16 | instruction.
pub const ST_VERIFY_FAILED: u32 = 4;
/// The program faulted while running (guest DMA fault, deadlock).
pub const ST_EXEC_FAULT: u32 = 5;
/// The program did not finish within its cycle budget.
pub const ST_BUDGET_EXHAUSTED: u32 = 6;
/// The vNPU has no configuration (released).
pub const ST_NOT_CONFIGURED: u32 = 7;
/// The program is larger than [`MAX_PROGRAM_BYTES`].
pub const ST_TOO_LARGE: u32 = 8;
/// The header names a core the vNPU does not have.
pub const ST_BAD_CORE: u32 = 9;
/// A mailbox argument is invalid.
pub const ST_BAD_ARGUMENT: u32 = 10;
/// A mailbox configuration exceeds the host's grant.
pub const ST_EXCEEDS_GRANT: u32 = 11;
/// A mailbox buffer in guest memory could not be written.
pub const ST_BAD_ADDRESS: u32 = 12;
/// No registered program has the header's handle.
pub const ST_BAD_HANDLE: u32 = 13;
/// All [`MAX_REGISTERED`] handles are in use.
pub const ST_NO_SPACE: u32 = 14;
/// The board daemon restarted while the request (or mailbox command) ran:
/// it may have run in part and its results are not there; submit it again.
pub const ST_RETRY: u32 = 15;

/// A short name for a status code.
pub fn status_name(code: u32) -> &'static str {
    match code {
        ST_OK => "ok",
        ST_BAD_REQUEST => "bad request",
        ST_UNKNOWN_OPCODE => "unknown opcode",
        ST_BAD_PROGRAM => "bad program",
        ST_VERIFY_FAILED => "verifier refused the program",
        ST_EXEC_FAULT => "execution fault",
        ST_BUDGET_EXHAUSTED => "cycle budget exhausted",
        ST_NOT_CONFIGURED => "vNPU not configured",
        ST_TOO_LARGE => "program too large",
        ST_BAD_CORE => "no such core",
        ST_BAD_ARGUMENT => "bad argument",
        ST_EXCEEDS_GRANT => "exceeds the host's grant",
        ST_BAD_ADDRESS => "bad guest address",
        ST_BAD_HANDLE => "no such program handle",
        ST_NO_SPACE => "no free program handle",
        ST_RETRY => "device restarted: retry",
        _ => "unknown status",
    }
}

/// Size of [`RequestHeader`] on the wire.
pub const HEADER_BYTES: usize = 32;

/// The first (device-readable) descriptor of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestHeader {
    /// `OP_*`.
    pub opcode: u32,
    /// `FLAG_*`.
    pub flags: u32,
    /// Echoed in the status block.
    pub tag: u64,
    /// Core of the vNPU to run on (chip * cores_per_chip + core).
    pub core: u32,
    /// Registered program (`OP_RUN_REGISTERED`, `OP_UNREGISTER`).
    pub handle: u32,
    /// Cycle budget; 0 for the device's default.
    pub max_cycles: u64,
}

impl RequestHeader {
    /// Wire format.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&self.opcode.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..20].copy_from_slice(&self.core.to_le_bytes());
        b[20..24].copy_from_slice(&self.handle.to_le_bytes());
        b[24..32].copy_from_slice(&self.max_cycles.to_le_bytes());
        b
    }

    /// Parses the wire format.
    pub fn from_bytes(b: &[u8; HEADER_BYTES]) -> Self {
        let u32_at = |o| le_u32(b, o);
        let u64_at = |o| le_u64(b, o);
        Self {
            opcode: u32_at(0),
            flags: u32_at(4),
            tag: u64_at(8),
            core: u32_at(16),
            handle: u32_at(20),
            max_cycles: u64_at(24),
        }
    }
}

/// Size of [`StatusBlock`] on the wire.
pub const STATUS_BYTES: usize = 64;

/// The last (device-writable) descriptor of a request: its completion.
/// Cycle counts are simulated NPU cycles; `wall_ns` is host time spent on
/// the request (verification and simulation), a different clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatusBlock {
    /// `ST_*`.
    pub status: u32,
    /// For `ST_VERIFY_FAILED` and `ST_EXEC_FAULT`: stream << 16 | instruction
    /// index, or 0xffff_ffff when no instruction is to blame.
    pub detail: u32,
    /// The request's tag.
    pub tag: u64,
    /// Simulated cycles from start to the last engine's end.
    pub cycles: u64,
    /// Active cycles summed over the SAs.
    pub sa_active: u64,
    /// Active cycles summed over the VUs.
    pub vu_active: u64,
    /// Active cycles of the DMA engine.
    pub dma_active: u64,
    /// Floating-point operations performed.
    pub flops: u64,
    /// Host nanoseconds spent on the request.
    pub wall_ns: u64,
}

impl StatusBlock {
    /// Wire format.
    pub fn to_bytes(&self) -> [u8; STATUS_BYTES] {
        let mut b = [0u8; STATUS_BYTES];
        b[0..4].copy_from_slice(&self.status.to_le_bytes());
        b[4..8].copy_from_slice(&self.detail.to_le_bytes());
        let words = [
            self.tag,
            self.cycles,
            self.sa_active,
            self.vu_active,
            self.dma_active,
            self.flops,
            self.wall_ns,
        ];
        for (i, w) in words.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// Parses the wire format.
    pub fn from_bytes(b: &[u8; STATUS_BYTES]) -> Self {
        let u32_at = |o| le_u32(b, o);
        let u64_at = |o| le_u64(b, o);
        Self {
            status: u32_at(0),
            detail: u32_at(4),
            tag: u64_at(8),
            cycles: u64_at(16),
            sa_active: u64_at(24),
            vu_active: u64_at(32),
            dma_active: u64_at(40),
            flops: u64_at(48),
            wall_ns: u64_at(56),
        }
    }
}

/// Counter block written by `MBOX_READ_COUNTERS`: a header of
/// [`COUNTERS_HEADER_BYTES`] then one [`COUNTERS_ENGINE_BYTES`] record per
/// engine (SAs, then VUs, then DMA, each core in turn).
///
/// Header: u32 version (1), u32 engine records, u64 requests completed,
/// u64 requests failed, u64 simulated cycles (sum over requests), u64
/// FLOPs, u64 bytes moved, u64 host nanoseconds, u64 reserved.
pub const COUNTERS_HEADER_BYTES: usize = 64;
/// Engine record: u8 kind (0 DMA, 1 SA, 2 VU), u8 reserved, u16 index,
/// u32 core, u64 active cycles, u64 stall cycles, u64 instructions, u64
/// FLOPs, u64 bytes.
pub const COUNTERS_ENGINE_BYTES: usize = 48;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_formats_round_trip() {
        let h =
            RequestHeader { opcode: 1, flags: 1, tag: u64::MAX - 5, core: 3, handle: 7, max_cycles: 1 << 40 };
        assert_eq!(RequestHeader::from_bytes(&h.to_bytes()), h);
        let s = StatusBlock {
            status: 4,
            detail: 0x0002_0003,
            tag: 9,
            cycles: 1 << 33,
            sa_active: 2,
            vu_active: 3,
            dma_active: 4,
            flops: 5,
            wall_ns: 6,
        };
        assert_eq!(StatusBlock::from_bytes(&s.to_bytes()), s);
        assert_eq!(MAGIC.to_le_bytes(), *b"VNPU");
    }
}
