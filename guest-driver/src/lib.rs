//! Guest driver for the vNPU PCI function (`docs/device-interface.md`).
//!
//! `no_std` and allocation-free: it runs in bare-metal guests (at CPL3,
//! as a user-space driver) and, over a fake BAR and guest memory, in the
//! host's tests. The pieces:
//!
//! - [`pci`]: find vNPU functions on bus 0, size and place BARs, enable
//!   MSI-X;
//! - [`Bar`] / [`MmioBar`]: register access;
//! - [`DmaRegion`] / [`DmaBuf`]: memory the device can DMA, with a bump
//!   allocator;
//! - [`Vnpu`]: the device: identity and hierarchy, the control mailbox,
//!   the command ring (virtio split ring, driver side), submit and wait by
//!   polling or by interrupt, and errors that carry the device's codes.
//!
//! ```no_run
//! # use vnpu_driver::*;
//! # fn demo(bar: MmioBar, dma: &mut DmaRegion, program: &[u8]) -> Result<(), Error> {
//! let mut npu = Vnpu::new(bar, dma, 64)?;
//! let h = npu.hierarchy();
//! assert!(h.sa_per_core >= 1);
//! let prog = npu.load(dma, program)?;
//! let done = npu.run(&prog, &RunOptions::default())?;
//! let _simulated_cycles = done.cycles;
//! # Ok(()) }
//! ```
//!
//! With the `std` feature, [`linux`] finds and opens the vNPU from Linux
//! user space (sysfs, huge-page DMA memory, polled completions).
#![no_std]

mod bar;
mod dma;
#[cfg(feature = "std")]
pub mod linux;
pub mod pci;

pub use bar::{Bar, MmioBar};
pub use dma::{DmaBuf, DmaError, DmaRegion};
pub use vnpu_abi::device::StatusBlock;

use core::sync::atomic::{fence, AtomicU32, Ordering};

use vnpu_abi::device::{self as abi, regs};

/// Most requests in flight (each uses four descriptors).
pub const MAX_IN_FLIGHT: usize = 64;
/// Bytes of each request's error-message buffer.
pub const MESSAGE_BYTES: usize = 256;

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;

/// What went wrong, with the device's own codes where it gave any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("not a vNPU: MAGIC reads {0:#x}")]
    NotVnpu(u32),
    #[error("device ABI {found:#x}, driver speaks {:#x}", abi::ABI_VERSION)]
    Abi { found: u32 },
    #[error("{0}")]
    Dma(#[from] DmaError),
    #[error("ring size {0} must be a power of two in 4..={max}", max = abi::QUEUE_SIZE_MAX)]
    RingSize(u16),
    #[error("the device refused the ring (ERROR {0:#x})")]
    RingRefused(u32),
    #[error("the device stopped the ring (ERROR {0:#x}); reset it")]
    DeviceFailed(u32),
    #[error("all {MAX_IN_FLIGHT} request slots are in flight")]
    RingFull,
    #[error("no such request in flight")]
    NoSuchRequest,
    #[error("request failed: {} (status {status}, detail {detail:#x})", abi::status_name(*status))]
    Request { status: u32, detail: u32 },
    #[error("mailbox command {cmd} failed: {} (status {status})", abi::status_name(*status))]
    Mailbox { cmd: u32, status: u32 },
    #[error("the device did not answer in time")]
    Timeout,
}

/// The vNPU's board, as its BAR 0 describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hierarchy {
    pub chips: u32,
    pub cores_per_chip: u32,
    pub sa_per_core: u32,
    pub vu_per_core: u32,
    pub sram_per_core: u64,
    pub hbm_per_core: u64,
    pub sa_rows: u32,
    pub sa_cols: u32,
    pub vu_lanes: u32,
    pub clock_mhz: u32,
}

/// How a request is completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wait {
    /// No interrupt; the driver polls the used ring in memory.
    #[default]
    Poll,
    /// The device raises its completion vector; the driver sleeps on the
    /// counter given to [`Vnpu::use_interrupts`] (bumped by the guest's
    /// interrupt handler) and then reads the used ring.
    Interrupt,
}

/// Options of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunOptions {
    pub wait: Wait,
    /// Core of the vNPU (chip * cores_per_chip + core).
    pub core: u32,
    /// Simulated-cycle budget; 0 for the device's default.
    pub max_cycles: u64,
}

/// A program the device verified once and keeps (`Vnpu::register`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgramHandle(pub u32);

/// A request in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    slot: usize,
    tag: u64,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    header: DmaBuf,
    status: DmaBuf,
    message: DmaBuf,
    busy: bool,
    done: bool,
    /// The request asked for a completion interrupt.
    interrupt: bool,
}

/// A vNPU function and the driver side of its command ring.
#[derive(Debug)]
pub struct Vnpu<B: Bar> {
    bar: B,
    hierarchy: Hierarchy,
    size: u16,
    desc: DmaBuf,
    avail: DmaBuf,
    used: DmaBuf,
    slots: [Option<Slot>; MAX_IN_FLIGHT],
    nslots: usize,
    avail_idx: u16,
    last_used: u16,
    next_tag: u64,
    irq_counter: Option<&'static AtomicU32>,
    irq_seen: u32,
    idle: Option<(fn(u32), u64)>,
    timeout_spins: u64,
    /// The device stopped the ring (its ERROR): requests fail at once
    /// until a reset succeeds.
    failed: Option<u32>,
    /// Requests and mailbox commands submitted again because the device
    /// answered `ST_RETRY` (its board daemon restarted while they ran).
    retried: u64,
    /// The last request [`Vnpu::submit_and_wait`] submitted (its slot holds
    /// the device's message when it failed).
    last: Option<Ticket>,
}

/// Most times one request or mailbox command is submitted again after
/// `ST_RETRY` (each answer means the board daemon restarted once more).
const MAX_RETRIES: u32 = 16;

/// Polls after an interrupt that did not complete the awaited request,
/// before reading the device's status (as long as the runtime's interrupt
/// waits spin before they halt, `guest_rt::vnpu::IDLE_AFTER_SPINS`).
const STALE_WAKE_SPINS: u32 = 1 << 14;

/// One step of a busy-wait. Deliberately not `pause`
/// (`core::hint::spin_loop`): under nested KVM a guest's `pause` can exit
/// to the hypervisor (pause-loop exiting) and cost about 25 us, ten times
/// the round trip being waited for.
#[inline(always)]
fn relax() {
    core::sync::atomic::compiler_fence(Ordering::SeqCst);
}

// The ring's indices and used elements are read and written whole: the
// device reads and writes them with single (atomic) accesses too.
fn vol_write16(b: &DmaBuf, off: usize, v: u16) {
    b.write_u16(off, v);
}

fn vol_read16(b: &DmaBuf, off: usize) -> u16 {
    b.read_u16(off)
}

fn vol_read32(b: &DmaBuf, off: usize) -> u32 {
    b.read_u32(off)
}

impl<B: Bar> Vnpu<B> {
    /// Checks the device's identity, reads its hierarchy, resets it and
    /// sets up a ring of `ring_size` entries (a power of two, 4..=256) in
    /// `dma`.
    pub fn new(bar: B, dma: &mut DmaRegion, ring_size: u16) -> Result<Self, Error> {
        let magic = bar.read32(regs::MAGIC);
        if magic != abi::MAGIC {
            return Err(Error::NotVnpu(magic));
        }
        let found = bar.read32(regs::ABI_VERSION);
        if found >> 16 != abi::ABI_VERSION >> 16 {
            return Err(Error::Abi { found });
        }
        if !ring_size.is_power_of_two() || !(4..=abi::QUEUE_SIZE_MAX).contains(&ring_size) {
            return Err(Error::RingSize(ring_size));
        }
        let n = usize::from(ring_size);
        let desc = dma.alloc(16 * n, 16)?;
        let avail = dma.alloc(6 + 2 * n, 2)?;
        let used = dma.alloc(6 + 8 * n, 4)?;
        let nslots = (n / 4).min(MAX_IN_FLIGHT);
        let mut slots = [None; MAX_IN_FLIGHT];
        for s in slots.iter_mut().take(nslots) {
            *s = Some(Slot {
                header: dma.alloc(abi::HEADER_BYTES, 8)?,
                status: dma.alloc(abi::STATUS_BYTES, 8)?,
                message: dma.alloc(MESSAGE_BYTES, 8)?,
                busy: false,
                done: false,
                interrupt: false,
            });
        }
        let mut v = Self {
            bar,
            hierarchy: Hierarchy::default(),
            size: ring_size,
            desc,
            avail,
            used,
            slots,
            nslots,
            avail_idx: 0,
            last_used: 0,
            next_tag: 1,
            irq_counter: None,
            irq_seen: 0,
            idle: None,
            timeout_spins: 1 << 36,
            failed: None,
            retried: 0,
            last: None,
        };
        v.reset()?;
        v.hierarchy = v.read_hierarchy();
        v.enable_ring()?;
        Ok(v)
    }

    /// The BAR (for registers this driver does not wrap).
    pub fn bar(&self) -> &B {
        &self.bar
    }

    /// The board as read at start-up or after the last mailbox configure.
    pub fn hierarchy(&self) -> Hierarchy {
        self.hierarchy
    }

    /// Gives up on a request after this many polls (default 2^36).
    pub fn set_timeout_spins(&mut self, spins: u64) {
        self.timeout_spins = spins.max(1);
    }

    fn read_hierarchy(&self) -> Hierarchy {
        let b = &self.bar;
        Hierarchy {
            chips: b.read32(regs::NUM_CHIPS),
            cores_per_chip: b.read32(regs::CORES_PER_CHIP),
            sa_per_core: b.read32(regs::SA_PER_CORE),
            vu_per_core: b.read32(regs::VU_PER_CORE),
            sram_per_core: b.read64(regs::SRAM_PER_CORE),
            hbm_per_core: b.read64(regs::HBM_PER_CORE),
            sa_rows: b.read32(regs::SA_ROWS),
            sa_cols: b.read32(regs::SA_COLS),
            vu_lanes: b.read32(regs::VU_LANES),
            clock_mhz: b.read32(regs::CLOCK_MHZ),
        }
    }

    fn spin_until(&self, mut done: impl FnMut() -> bool) -> Result<(), Error> {
        for _ in 0..self.timeout_spins {
            if done() {
                return Ok(());
            }
            relax();
        }
        Err(Error::Timeout)
    }

    /// Resets the device's ring and error state (requests in flight are lost).
    pub fn reset(&mut self) -> Result<(), Error> {
        self.bar.write32(regs::DEVICE_RESET, 1);
        let bar = &self.bar;
        // All ones: the device is gone (as a PCI read of a removed device
        // reads); nothing will finish resetting.
        let mut gone = false;
        self.spin_until(|| {
            let s = bar.read32(regs::STATUS);
            gone = s == u32::MAX;
            gone || s & abi::STATUS_RESETTING == 0
        })?;
        if gone {
            self.failed = Some(u32::MAX);
            return Err(Error::DeviceFailed(u32::MAX));
        }
        self.failed = None;
        for s in self.slots.iter_mut().flatten() {
            s.busy = false;
            s.done = false;
        }
        self.avail_idx = 0;
        self.last_used = 0;
        Ok(())
    }

    fn enable_ring(&mut self) -> Result<(), Error> {
        vol_write16(&self.avail, 0, 0);
        vol_write16(&self.avail, 2, 0);
        vol_write16(&self.used, 0, 0);
        vol_write16(&self.used, 2, 0);
        let b = &self.bar;
        b.write32(regs::QUEUE_SIZE, u32::from(self.size));
        b.write64(regs::QUEUE_DESC, self.desc.phys);
        b.write64(regs::QUEUE_AVAIL, self.avail.phys);
        b.write64(regs::QUEUE_USED, self.used.phys);
        fence(Ordering::SeqCst);
        b.write32(regs::QUEUE_ENABLE, 1);
        self.spin_until(|| {
            b.read32(regs::STATUS) & abi::STATUS_QUEUE_READY != 0 || b.read32(regs::ERROR) != 0
        })?;
        match b.read32(regs::ERROR) {
            0 => Ok(()),
            e => Err(Error::RingRefused(e)),
        }
    }

    /// Resets the device and sets the ring up again (after
    /// [`Error::DeviceFailed`]).
    pub fn recover(&mut self) -> Result<(), Error> {
        self.reset()?;
        self.enable_ring()
    }

    /// Completions will raise MSI-X `vector` (which the caller has
    /// programmed with [`pci::enable_msix`]); the guest's handler for it
    /// increments `counter`, which [`Wait::Interrupt`] sleeps on.
    pub fn use_interrupts(&mut self, vector: u16, counter: &'static AtomicU32) {
        self.bar.write32(regs::QUEUE_VECTOR, u32::from(vector));
        self.irq_seen = counter.load(Ordering::Acquire);
        self.irq_counter = Some(counter);
    }

    /// While waiting by interrupt, after `spins` fruitless polls call
    /// `idle(seen)`, which may sleep until the next interrupt (unless the
    /// counter already moved past `seen`): long requests then leave the
    /// CPU to others instead of spinning.
    pub fn use_idle(&mut self, idle: fn(u32), spins: u64) {
        self.idle = Some((idle, spins.max(1)));
    }

    /// Copies a program (encoded with `vnpu_abi::Program::encode`) into DMA memory.
    pub fn load(&self, dma: &mut DmaRegion, program: &[u8]) -> Result<DmaBuf, Error> {
        let b = dma.alloc(program.len().max(1), 64)?;
        b.write(0, program);
        Ok(DmaBuf { len: program.len(), ..b })
    }

    fn write_desc(&self, i: usize, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.desc.write(16 * i, &d);
    }

    /// Puts a request on the ring and rings the doorbell: `program` = None
    /// is an empty (`NOP`) request.
    pub fn submit(&mut self, program: Option<&DmaBuf>, opts: &RunOptions) -> Result<Ticket, Error> {
        let op = if program.is_some() { abi::OP_RUN } else { abi::OP_NOP };
        self.submit_op(op, program, 0, opts)
    }

    /// Submits a run of registered program `handle` (see [`Vnpu::register`]).
    pub fn submit_registered(&mut self, handle: ProgramHandle, opts: &RunOptions) -> Result<Ticket, Error> {
        self.submit_op(abi::OP_RUN_REGISTERED, None, handle.0, opts)
    }

    /// Has the device decode and verify `program` once and keep it: later
    /// runs by handle skip both (and the program copy).
    pub fn register(&mut self, program: &DmaBuf) -> Result<ProgramHandle, Error> {
        self.submit_and_wait(abi::OP_REGISTER, Some(program), 0, &RunOptions::default())
            .map(|st| ProgramHandle(st.detail))
    }

    /// Runs registered program `handle` and waits for it.
    pub fn run_registered(&mut self, handle: ProgramHandle, opts: &RunOptions) -> Result<StatusBlock, Error> {
        self.submit_and_wait(abi::OP_RUN_REGISTERED, None, handle.0, opts)
    }

    /// Forgets registered program `handle`.
    pub fn unregister(&mut self, handle: ProgramHandle) -> Result<(), Error> {
        self.submit_and_wait(abi::OP_UNREGISTER, None, handle.0, &RunOptions::default()).map(|_| ())
    }

    /// Requests and mailbox commands this driver submitted again because
    /// the device answered `ST_RETRY` (its board daemon restarted while
    /// they ran; `docs/device-interface.md`).
    pub fn retried(&self) -> u64 {
        self.retried
    }

    /// Submits a request and waits for it; one that completes with
    /// `ST_RETRY` is submitted again (up to [`MAX_RETRIES`] times).
    fn submit_and_wait(
        &mut self,
        opcode: u32,
        program: Option<&DmaBuf>,
        handle: u32,
        opts: &RunOptions,
    ) -> Result<StatusBlock, Error> {
        self.retrying(|v| {
            let t = v.submit_op(opcode, program, handle, opts)?;
            v.last = Some(t);
            v.wait(t)
        })
    }

    /// `op`, made again (up to [`MAX_RETRIES`] times, each counted in
    /// [`Vnpu::retried`]) while the device answers it with `ST_RETRY`.
    fn retrying<T>(&mut self, mut op: impl FnMut(&mut Self) -> Result<T, Error>) -> Result<T, Error> {
        let mut tries = 0;
        loop {
            match op(self) {
                Err(
                    Error::Request { status: abi::ST_RETRY, .. }
                    | Error::Mailbox { status: abi::ST_RETRY, .. },
                ) if tries < MAX_RETRIES => {
                    tries += 1;
                    self.retried += 1;
                }
                r => return r,
            }
        }
    }

    fn submit_op(
        &mut self,
        opcode: u32,
        program: Option<&DmaBuf>,
        handle: u32,
        opts: &RunOptions,
    ) -> Result<Ticket, Error> {
        // No register read here: from CPL3 each costs an MMIO exit. A
        // failed device is noticed by `wait`, and from then on here.
        if let Some(e) = self.failed {
            return Err(Error::DeviceFailed(e));
        }
        self.reap();
        let slot =
            (0..self.nslots).find(|&i| self.slots[i].is_some_and(|s| !s.busy)).ok_or(Error::RingFull)?;
        let Some(s) = self.slots[slot].as_mut() else { return Err(Error::RingFull) };
        let interrupt = opts.wait == Wait::Interrupt && self.irq_counter.is_some();
        s.busy = true;
        s.done = false;
        s.interrupt = interrupt;
        let s = *s;
        let tag = self.next_tag;
        self.next_tag += 1;
        let header = abi::RequestHeader {
            opcode,
            flags: if interrupt { 0 } else { abi::FLAG_NO_INTERRUPT },
            tag,
            core: opts.core,
            handle,
            max_cycles: opts.max_cycles,
        };
        s.header.write(0, &header.to_bytes());
        let base = 4 * slot;
        let mut i = base;
        let next = |i: usize| (i + 1) as u16;
        self.write_desc(i, s.header.phys, abi::HEADER_BYTES as u32, DESC_F_NEXT, next(i));
        if let Some(p) = program {
            i += 1;
            self.write_desc(i, p.phys, p.len as u32, DESC_F_NEXT, next(i));
        }
        if opcode != abi::OP_NOP {
            i += 1;
            self.write_desc(i, s.message.phys, MESSAGE_BYTES as u32, DESC_F_NEXT | DESC_F_WRITE, next(i));
        }
        i += 1;
        self.write_desc(i, s.status.phys, abi::STATUS_BYTES as u32, DESC_F_WRITE, 0);
        let n = usize::from(self.size);
        vol_write16(&self.avail, 4 + 2 * (usize::from(self.avail_idx) % n), base as u16);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        fence(Ordering::SeqCst);
        vol_write16(&self.avail, 2, self.avail_idx);
        fence(Ordering::SeqCst);
        // The device sets VRING_USED_F_NO_NOTIFY while it polls the ring.
        if vol_read16(&self.used, 0) & 1 == 0 {
            self.bar.write32(regs::DOORBELL, 1);
        }
        Ok(Ticket { slot, tag })
    }

    /// Moves completed requests off the used ring.
    fn reap(&mut self) {
        let n = usize::from(self.size);
        loop {
            let used_idx = vol_read16(&self.used, 2);
            if used_idx == self.last_used {
                return;
            }
            fence(Ordering::Acquire);
            let e = 4 + 8 * (usize::from(self.last_used) % n);
            let id = vol_read32(&self.used, e) as usize;
            self.last_used = self.last_used.wrapping_add(1);
            if let Some(Some(s)) = self.slots.get_mut(id / 4) {
                if s.busy {
                    s.done = true;
                }
            }
        }
    }

    /// The completion of `t` if it is done, without waiting.
    pub fn poll(&mut self, t: Ticket) -> Option<Result<StatusBlock, Error>> {
        self.reap();
        let s = self.slots.get_mut(t.slot).and_then(|s| s.as_mut())?;
        if !s.busy || !s.done {
            return None;
        }
        s.busy = false;
        s.done = false;
        let mut b = [0u8; abi::STATUS_BYTES];
        s.status.read(0, &mut b);
        let st = StatusBlock::from_bytes(&b);
        if st.tag != t.tag {
            return Some(Err(Error::NoSuchRequest));
        }
        Some(match st.status {
            abi::ST_OK => Ok(st),
            status => Err(Error::Request { status, detail: st.detail }),
        })
    }

    /// Waits for `t` (by polling, or on the interrupt counter when
    /// interrupts are in use).
    pub fn wait(&mut self, t: Ticket) -> Result<StatusBlock, Error> {
        let Some(slot) = self.slots.get(t.slot).and_then(|s| s.as_ref()).filter(|s| s.busy) else {
            return Err(Error::NoSuchRequest);
        };
        // Only a request that raises an interrupt may sleep on the counter.
        let counter = self.irq_counter.filter(|_| slot.interrupt);
        // An interrupt that did not complete the request (the device's
        // way of waking a waiter when it fails or goes away).
        let mut woke = false;
        for spin in 0..self.timeout_spins {
            if let Some(r) = self.poll(t) {
                return r;
            }
            // Such a wake-up is most often a late interrupt of a request
            // already seen done by polling: this one is then about to
            // complete. Poll a while before asking the device whether it
            // stopped: that register read is a VM exit, and a message to
            // another process when a board daemon serves the vNPU (one
            // in three batch-1 requests paid it, tens of microseconds).
            if woke {
                for _ in 0..STALE_WAKE_SPINS {
                    if let Some(r) = self.poll(t) {
                        return r;
                    }
                    relax();
                }
            }
            // After such a wake-up, and now and then, look whether the
            // device stopped the ring.
            if (woke || spin % (1 << 16) == (1 << 16) - 1)
                && self.bar.read32(regs::STATUS) & abi::STATUS_FAILED != 0
            {
                let e = self.bar.read32(regs::ERROR);
                self.failed = Some(e);
                return Err(Error::DeviceFailed(e));
            }
            woke = false;
            if let Some(c) = counter {
                // Sleep (spin) until the handler saw another interrupt.
                let seen = self.irq_seen;
                let mut spins = 0u64;
                loop {
                    let now = c.load(Ordering::Acquire);
                    if now != seen {
                        self.irq_seen = now;
                        woke = true;
                        break;
                    }
                    spins += 1;
                    if spins >= self.timeout_spins {
                        return Err(Error::Timeout);
                    }
                    // A polled request completes without an interrupt.
                    if spins.is_multiple_of(1024) && vol_read16(&self.used, 2) != self.last_used {
                        break;
                    }
                    if let Some((idle, after)) = self.idle {
                        if spins.is_multiple_of(after) {
                            idle(seen);
                        }
                    }
                    relax();
                }
            } else {
                relax();
            }
        }
        Err(Error::Timeout)
    }

    /// The device's error message for the last completion in `t`'s slot
    /// (empty when it succeeded); returns the bytes copied.
    pub fn message(&self, t: Ticket, out: &mut [u8]) -> usize {
        let Some(Some(s)) = self.slots.get(t.slot) else { return 0 };
        s.message.read(0, out);
        out.iter().position(|&b| b == 0).unwrap_or(out.len().min(MESSAGE_BYTES))
    }

    /// The device's message for the last request a blocking call ran
    /// (`run`, `run_registered`, `register`, ...), for telling why it
    /// failed; returns the bytes copied into `out`.
    pub fn last_message(&self, out: &mut [u8]) -> usize {
        self.last.map_or(0, |t| self.message(t, out))
    }

    /// Submits `program` and waits for it (again after `ST_RETRY`).
    pub fn run(&mut self, program: &DmaBuf, opts: &RunOptions) -> Result<StatusBlock, Error> {
        self.submit_and_wait(abi::OP_RUN, Some(program), 0, opts)
    }

    /// An empty request (the ring's round trip).
    pub fn nop(&mut self, wait: Wait) -> Result<StatusBlock, Error> {
        self.submit_and_wait(abi::OP_NOP, None, 0, &RunOptions { wait, ..Default::default() })
    }

    /// Runs mailbox command `cmd` with `args` and returns its result (run
    /// again when the device answers `ST_RETRY`).
    pub fn mailbox(&mut self, cmd: u32, args: &[u64]) -> Result<u64, Error> {
        self.retrying(|v| v.mailbox_once(cmd, args))
    }

    fn mailbox_once(&mut self, cmd: u32, args: &[u64]) -> Result<u64, Error> {
        let b = &self.bar;
        for (i, a) in args.iter().take(6).enumerate() {
            b.write64(regs::MBOX_ARG0 + 8 * i as u64, *a);
        }
        b.write32(regs::MBOX_CMD, cmd);
        // A device that is gone reads as all ones, which is also
        // `MBOX_BUSY`: now and then look at STATUS, which a live device
        // never reads as all ones, instead of waiting for ever.
        let (mut spins, mut gone) = (0u32, false);
        self.spin_until(|| {
            spins = spins.wrapping_add(1);
            if b.read32(regs::MBOX_STATUS) != abi::MBOX_BUSY {
                return true;
            }
            gone = spins.is_multiple_of(16) && b.read32(regs::STATUS) == u32::MAX;
            gone
        })?;
        if gone {
            self.failed = Some(u32::MAX);
            return Err(Error::DeviceFailed(u32::MAX));
        }
        match b.read32(regs::MBOX_STATUS) {
            abi::ST_OK => {
                let r = b.read64(regs::MBOX_RESULT);
                self.hierarchy = self.read_hierarchy();
                Ok(r)
            }
            status => Err(Error::Mailbox { cmd, status }),
        }
    }

    /// Reconfigures the vNPU within the host's grant (SRAM and HBM are
    /// reallocated, zeroed).
    pub fn configure(&mut self, h: &Hierarchy) -> Result<(), Error> {
        let args = [
            u64::from(h.sa_per_core),
            u64::from(h.vu_per_core),
            h.sram_per_core,
            h.hbm_per_core,
            u64::from(h.cores_per_chip),
            u64::from(h.chips),
        ];
        self.mailbox(abi::MBOX_CONFIGURE, &args).map(|_| ())
    }

    /// The host's grant: (SAs per core, VUs per core, cores per chip,
    /// chips).
    pub fn grant(&mut self) -> Result<(u32, u32, u32, u32), Error> {
        let g = self.mailbox(abi::MBOX_QUERY_GRANT, &[])?;
        let f = |s: u32| ((g >> s) & 0xffff) as u32;
        Ok((f(0), f(16), f(32), f(48)))
    }

    /// Whether the host changed the grant (a live remap) since the last
    /// call; clears the indication. The configuration has been shrunk to
    /// the new grant if it no longer fit (then [`Vnpu::hierarchy`] shows the
    /// new one and registered programs are gone).
    pub fn grant_changed(&mut self) -> bool {
        let changed = self.bar.read32(regs::INT_STATUS) & abi::INT_GRANT != 0;
        if changed {
            self.bar.write32(regs::INT_STATUS, abi::INT_GRANT);
            self.hierarchy = self.read_hierarchy();
        }
        changed
    }

    /// Reads the counter block into `buf` (layout: `vnpu_abi::device`);
    /// returns the bytes written.
    pub fn read_counters(&mut self, buf: &DmaBuf) -> Result<usize, Error> {
        self.mailbox(abi::MBOX_READ_COUNTERS, &[buf.phys, buf.len as u64]).map(|n| n as usize)
    }
}
