//! The NPU worker: one thread per vNPU that owns the command ring, the
//! vNPU's SRAM and HBM, and its counters. It sleeps in an event-manager
//! loop on two eventfds: the doorbell (an ioeventfd, so a guest's doorbell
//! write wakes it without a vCPU exit to userspace) and the control
//! channel (ring set-up, reset and mailbox commands posted by the vCPU
//! thread). The vCPU thread never waits for it.
//!
//! Every request is checked before anything runs: the descriptor chain's
//! shape, the header, the program's decoding and the static verifier
//! against the vNPU's current configuration. Guest memory is touched only
//! through vm-memory's checked accessors, so a bad address fails that
//! request (or, for the ring itself, puts the device in its failed state
//! until the driver resets it) and never the VMM.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use npu_model::{run_program, BoardConfig, CoreMemory, ExecError, LazyHbm, Sram, TenantReport};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;
use vnpu_abi::device::{self as abi, regs};
use vnpu_abi::{EngineKind, Program};

use crate::msi::{lock, Interrupts};
use crate::regfile::RegFile;
use vnpu_spec::VnpuSpec;

use crate::GuestRam;

/// Cycle budget of a request whose header asks for none (about 18 s of
/// simulated time at 940 MHz).
pub const DEFAULT_BUDGET: u64 = 1 << 34;
/// Largest cycle budget a request may ask for.
pub const MAX_BUDGET: u64 = 1 << 40;
/// Most simulated cycles one request may run on a *shared* physical core
/// (about 4.6 s at 940 MHz): its co-located tenants wait for the batch it
/// is in, so a long request there must not hold them for the whole
/// [`MAX_BUDGET`]. [`DeviceOptions::shared_max_cycles`] overrides it.
pub const SHARED_MAX_BUDGET: u64 = 1 << 32;
/// Most host work (`npu_model::timing::host_work` units, about a
/// nanosecond each at most on the machines measured) the functional model
/// may spend on one request on a *shared* physical core: its co-located
/// tenants' simulation waits while the core's thread executes it, so this
/// bounds how long one request can hold them up in wall time (about 0.4 s
/// here; `docs/isolation.md`). [`DeviceOptions::shared_max_host_work`]
/// overrides it.
pub const SHARED_MAX_HOST_WORK: u64 = 1 << 28;
/// Longest error message written to a request's message buffer.
const MAX_MESSAGE: usize = 512;
/// No instruction to blame (`detail`).
const NO_DETAIL: u32 = 0xffff_ffff;

/// What the vCPU thread asks of the worker.
#[derive(Debug, Clone)]
pub(crate) enum Control {
    Enable {
        size: u32,
        desc: u64,
        avail: u64,
        used: u64,
    },
    Reset,
    Mailbox {
        cmd: u32,
        args: [u64; 6],
    },
    /// The host changed the grant (a live remap).
    Regrant(VnpuSpec),
    /// Guest memory is now this (a vfio-user client mapped or unmapped
    /// DMA regions); applied between requests.
    Memory(GuestMemoryMmap<()>),
    Stop,
    /// Makes the worker panic (tests of the fault path only).
    #[cfg(test)]
    Panic,
}

/// State shared by the PCI function (vCPU thread) and the worker.
#[derive(Debug)]
pub(crate) struct Shared {
    pub regs: Mutex<RegFile>,
    pub irq: Interrupts,
    pub controls: Mutex<VecDeque<Control>>,
    pub control_evt: EventFd,
    pub doorbell: EventFd,
    /// The worker thread has stopped on a fault: nothing is served, and
    /// nothing more is queued for it.
    pub dead: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Registers `regs`, `vectors` MSI-X vectors (disabled, as after reset)
    /// raised into `sink`, an empty control queue and fresh eventfds.
    pub fn new(
        regs: RegFile,
        vectors: u16,
        sink: Arc<dyn crate::MsiSink>,
        by_vector: Option<Arc<dyn crate::VectorSink>>,
    ) -> std::io::Result<Self> {
        let nonblock = vmm_sys_util::eventfd::EFD_NONBLOCK;
        Ok(Self {
            regs: Mutex::new(regs),
            irq: Interrupts {
                state: Mutex::new(crate::msi::MsixState {
                    table: vnpu_pci::MsixTable::new(vectors),
                    enabled: false,
                    function_masked: false,
                }),
                sink,
                vectors: by_vector,
            },
            controls: Mutex::new(VecDeque::new()),
            control_evt: EventFd::new(nonblock)?,
            doorbell: EventFd::new(nonblock)?,
            dead: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Posts `c` to the worker (dropped once the worker is dead, so a
    /// guest cannot grow the queue without bound).
    pub fn post(&self, c: Control) {
        if self.dead.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        lock(&self.controls).push_back(c);
        // An eventfd write fails only when the counter would overflow, in
        // which case the worker is already due to wake.
        let _ = self.control_evt.write(1);
    }

    /// Records `bit` in `INT_STATUS` and raises the vector named by the
    /// register at `vector_reg`, if any.
    fn notify(&self, bit: u32, vector_reg: u64) {
        let v = {
            let mut r = lock(&self.regs);
            r.update_u32(regs::INT_STATUS, |s| s | bit);
            r.u32(vector_reg)
        };
        if let Ok(v) = u16::try_from(v) {
            if u32::from(v) != abi::NO_VECTOR {
                self.irq.raise(v);
            }
        }
    }
}

/// One core of the vNPU: its SRAM and HBM segments, created on first use.
type Core = npu_board_runtime::CoreMem;

#[derive(Clone, Copy, Debug, Default)]
struct EngineTotals {
    active: f64,
    stall: f64,
    instructions: u64,
    flops: u64,
    bytes: u64,
}

/// The vNPU's performance counters (`MBOX_READ_COUNTERS`).
#[derive(Debug, Default)]
struct Counters {
    requests: u64,
    failed: u64,
    cycles: f64,
    flops: u64,
    bytes: u64,
    wall_ns: u64,
    /// Keyed by (core, kind code, index).
    engines: BTreeMap<(u32, u8, u8), EngineTotals>,
}

fn kind_code(k: EngineKind) -> u8 {
    match k {
        EngineKind::Dma => 0,
        EngineKind::Sa => 1,
        EngineKind::Vu => 2,
    }
}

impl Counters {
    fn add(&mut self, core: u32, r: &TenantReport) {
        self.cycles += r.cycles;
        for e in &r.engines {
            let t = self.engines.entry((core, kind_code(e.engine.kind), e.engine.index)).or_default();
            t.active += e.active_cycles;
            t.stall += e.stall_cycles;
            t.instructions += e.instructions;
            t.flops += e.flops;
            t.bytes += e.bytes;
            self.flops += e.flops;
            self.bytes += e.bytes;
        }
    }

    /// The counter block for a vNPU of `spec` (layout: `vnpu_abi::device`).
    fn block(&self, spec: Option<&VnpuSpec>) -> Vec<u8> {
        let mut engines = Vec::new();
        if let Some(s) = spec {
            for core in 0..s.cores() {
                let sa = (0..s.sa_per_core).map(|i| (1u8, i as u8));
                let vu = (0..s.vu_per_core).map(|i| (2u8, i as u8));
                for (kind, index) in sa.chain(vu).chain([(0u8, 0u8)]) {
                    let t = self.engines.get(&(core, kind, index)).copied().unwrap_or_default();
                    engines.push((core, kind, index, t));
                }
            }
        }
        let mut b =
            Vec::with_capacity(abi::COUNTERS_HEADER_BYTES + engines.len() * abi::COUNTERS_ENGINE_BYTES);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&(engines.len() as u32).to_le_bytes());
        for w in [self.requests, self.failed, self.cycles as u64, self.flops, self.bytes, self.wall_ns, 0] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        for (core, kind, index, t) in engines {
            b.extend_from_slice(&[kind, 0]);
            b.extend_from_slice(&u16::from(index).to_le_bytes());
            b.extend_from_slice(&core.to_le_bytes());
            for w in [t.active as u64, t.stall as u64, t.instructions, t.flops, t.bytes] {
                b.extend_from_slice(&w.to_le_bytes());
            }
        }
        b
    }
}

/// A descriptor of a request chain.
#[derive(Clone, Copy, Debug)]
struct Desc {
    addr: u64,
    len: u32,
    write: bool,
}

/// How a request ended.
#[derive(Debug, Default)]
struct Outcome {
    status: u32,
    detail: u32,
    report: Option<TenantReport>,
    message: String,
}

impl Outcome {
    fn fail(status: u32, message: impl Into<String>) -> Self {
        Self { status, detail: NO_DETAIL, report: None, message: message.into() }
    }
}

/// How a vNPU's worker serves its ring.
#[derive(Clone, Debug)]
pub struct DeviceOptions {
    /// After serving requests, keep polling the ring for this long (with
    /// the driver told not to ring the doorbell) before sleeping. 0 turns
    /// polling off: every request then waits for a thread wake-up.
    pub poll: std::time::Duration,
    /// The physical cores the vNPU's cores are placed on, shared with the
    /// other vNPUs placed there (in vNPU core order). A vNPU core without
    /// one runs alone on a core of its own.
    pub cores: Vec<crate::SharedCore>,
    /// Priority on an oversubscribed shared core (higher runs first).
    pub priority: u8,
    /// Latency target of each request on a shared core, in microseconds of
    /// simulated time from its arrival (0: none): among equal priorities
    /// the earliest deadline runs first.
    pub slo_us: u64,
    /// Cap of a request's cycle budget on a shared core.
    pub shared_max_cycles: u64,
    /// Host-work budget of a request on a shared core.
    pub shared_max_host_work: u64,
    /// Where the worker adds up what it does (the daemon's metrics).
    pub telemetry: Option<Arc<crate::Telemetry>>,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            poll: std::time::Duration::from_micros(DEFAULT_POLL_US),
            cores: Vec::new(),
            priority: 0,
            slo_us: 0,
            shared_max_cycles: SHARED_MAX_BUDGET,
            shared_max_host_work: SHARED_MAX_HOST_WORK,
            telemetry: None,
        }
    }
}

/// Default polling window after activity, in microseconds.
pub const DEFAULT_POLL_US: u64 = 200;

/// The worker's state; runs on its own thread (see [`spawn`]).
#[derive(Debug)]
pub(crate) struct Worker {
    shared: Arc<Shared>,
    mem: GuestMemoryMmap<()>,
    board: BoardConfig,
    grant: VnpuSpec,
    config: Option<VnpuSpec>,
    cores: Vec<Option<Core>>,
    queue: Option<Queue>,
    counters: Counters,
    stopped: bool,
    opts: DeviceOptions,
    /// The vNPU's name (its tenant name on shared cores).
    name: String,
    /// Programs verified once (`REGISTER`), by handle; dropped whenever
    /// the configuration changes, since they were checked against it.
    programs: Vec<Option<Arc<Program>>>,
}

impl Worker {
    pub fn new(
        shared: Arc<Shared>,
        mem: GuestMemoryMmap<()>,
        board: BoardConfig,
        grant: VnpuSpec,
        opts: DeviceOptions,
        name: &str,
    ) -> Self {
        let mut w = Self {
            opts,
            name: name.to_string(),
            shared,
            mem,
            board,
            grant,
            config: None,
            cores: Vec::new(),
            queue: None,
            counters: Counters::default(),
            stopped: false,
            programs: Vec::new(),
        };
        w.configure(grant);
        w
    }

    fn regs(&self) -> std::sync::MutexGuard<'_, RegFile> {
        lock(&self.shared.regs)
    }

    fn configure(&mut self, spec: VnpuSpec) {
        self.programs.clear();
        let n = spec.cores() as usize;
        self.cores = (0..n).map(|_| None).collect();
        self.config = Some(spec);
        if let Some(t) = &self.opts.telemetry {
            t.configured(Some(spec));
        }
        let mut r = self.regs();
        r.set_hierarchy(Some(&spec));
        r.update_u32(regs::STATUS, |s| s | abi::STATUS_READY);
    }

    /// A new grant from the host. The configuration stays if it still fits
    /// (the vNPU's SRAM, HBM and registered programs with it); otherwise
    /// the vNPU is reconfigured to the new grant, as a `CONFIGURE` would.
    fn regrant(&mut self, grant: VnpuSpec) {
        self.grant = grant;
        match self.config {
            Some(c) if c.check_within(&grant).is_ok() => {}
            Some(_) => self.configure(grant),
            None => {}
        }
    }

    fn release(&mut self) {
        self.programs.clear();
        self.cores.clear();
        self.config = None;
        if let Some(t) = &self.opts.telemetry {
            t.configured(None);
        }
        let mut r = self.regs();
        r.set_hierarchy(None);
        r.update_u32(regs::STATUS, |s| s & !abi::STATUS_READY);
    }

    /// Handles every posted control message, in order.
    fn handle_controls(&mut self) {
        loop {
            let next = lock(&self.shared.controls).pop_front();
            match next {
                None => return,
                Some(Control::Stop) => {
                    self.stopped = true;
                    return;
                }
                #[cfg(test)]
                Some(Control::Panic) => panic!("injected worker fault"),
                Some(Control::Enable { size, desc, avail, used }) => self.enable(size, desc, avail, used),
                Some(Control::Reset) => self.reset(),
                Some(Control::Memory(mem)) => self.mem = mem,
                Some(Control::Regrant(spec)) => {
                    self.regrant(spec);
                    self.shared.notify(abi::INT_GRANT, regs::MBOX_VECTOR);
                }
                Some(Control::Mailbox { cmd, args }) => {
                    let (status, result) = self.mailbox(cmd, args);
                    {
                        let mut r = self.regs();
                        r.set_u64(regs::MBOX_RESULT, result);
                        r.set_u32(regs::MBOX_STATUS, status);
                    }
                    self.shared.notify(abi::INT_MAILBOX, regs::MBOX_VECTOR);
                }
            }
        }
    }

    fn enable(&mut self, size: u32, desc: u64, avail: u64, used: u64) {
        let q = (|| {
            let mut q = Queue::new(abi::QUEUE_SIZE_MAX).ok()?;
            q.try_set_size(u16::try_from(size).ok()?).ok()?;
            q.try_set_desc_table_address(GuestAddress(desc)).ok()?;
            q.try_set_avail_ring_address(GuestAddress(avail)).ok()?;
            q.try_set_used_ring_address(GuestAddress(used)).ok()?;
            q.set_ready(true);
            q.is_valid(&self.mem).then_some(q)
        })();
        let ok = q.is_some();
        self.queue = q;
        let mut r = self.regs();
        match ok {
            true => r.update_u32(regs::STATUS, |s| s | abi::STATUS_QUEUE_READY),
            false => {
                r.set_u32(regs::QUEUE_ENABLE, 0);
                r.set_u32(regs::ERROR, abi::ERR_QUEUE_INVALID);
            }
        }
    }

    fn reset(&mut self) {
        self.queue = None;
        let mut r = self.regs();
        r.set_u32(regs::QUEUE_ENABLE, 0);
        r.set_u32(regs::COMPLETED, 0);
        r.set_u32(regs::ERROR, 0);
        r.set_u32(regs::INT_STATUS, 0);
        r.update_u32(regs::STATUS, |s| {
            s & !(abi::STATUS_QUEUE_READY | abi::STATUS_FAILED | abi::STATUS_RESETTING)
        });
    }

    /// The ring itself is broken (`ERR_QUEUE_BROKEN`): says why in the
    /// host's log (the guest only gets the code) and stops using it.
    fn fail_ring(&mut self, why: &str) {
        log::warn!("{}: the ring is broken, stopped until the driver resets it: {why}", self.name);
        self.fail(abi::ERR_QUEUE_BROKEN);
    }

    /// Stops using the ring until the driver resets the device.
    fn fail(&mut self, code: u32) {
        self.queue = None;
        mark_failed(&mut self.regs(), code);
    }

    fn mailbox(&mut self, cmd: u32, a: [u64; 6]) -> (u32, u64) {
        match cmd {
            abi::MBOX_CONFIGURE => {
                let n = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
                let spec = VnpuSpec {
                    sa_per_core: n(a[0]),
                    vu_per_core: n(a[1]),
                    sram_per_core: a[2],
                    hbm_per_core: a[3],
                    cores_per_chip: n(a[4]),
                    chips: n(a[5]),
                };
                match spec.check_within(&self.grant) {
                    Ok(()) => {
                        self.configure(spec);
                        (abi::ST_OK, 0)
                    }
                    Err(st) => (st, 0),
                }
            }
            abi::MBOX_RELEASE => {
                self.release();
                (abi::ST_OK, 0)
            }
            abi::MBOX_READ_COUNTERS => {
                let block = self.counters.block(self.config.as_ref());
                let len = block.len().min(usize::try_from(a[1]).unwrap_or(usize::MAX));
                match self.mem.write_slice(&block[..len], GuestAddress(a[0])) {
                    Ok(()) => (abi::ST_OK, len as u64),
                    Err(_) => (abi::ST_BAD_ADDRESS, 0),
                }
            }
            abi::MBOX_RESET_COUNTERS => {
                self.counters = Counters::default();
                (abi::ST_OK, 0)
            }
            abi::MBOX_QUERY_GRANT => {
                let g = &self.grant;
                let r = u64::from(g.sa_per_core)
                    | u64::from(g.vu_per_core) << 16
                    | u64::from(g.cores_per_chip) << 32
                    | u64::from(g.chips) << 48;
                (abi::ST_OK, r)
            }
            _ => {
                self.regs().set_u32(regs::ERROR, abi::ERR_MBOX_UNKNOWN);
                (abi::ST_UNKNOWN_OPCODE, 0)
            }
        }
    }

    /// Takes every available request off the ring and completes it.
    fn drain_ring(&mut self) {
        loop {
            let Some(q) = self.queue.as_mut() else { return };
            let next = match q.iter(&self.mem) {
                Ok(mut it) => it.next().map(|chain| {
                    let head = chain.head_index();
                    let descs: Vec<Desc> = chain
                        .map(|d| Desc { addr: d.addr().0, len: d.len(), write: d.is_write_only() })
                        .collect();
                    (head, descs)
                }),
                Err(e) => {
                    // The available index is more than a ring ahead, or
                    // the ring is not in guest memory.
                    let why = format!("reading the available ring (next {}): {e}", q.next_avail());
                    self.fail_ring(&why);
                    return;
                }
            };
            let Some((head, descs)) = next else { return };
            let (len, interrupt) = self.process(&descs);
            let Some(q) = self.queue.as_mut() else { return };
            if let Err(e) = q.add_used(&self.mem, head, len) {
                self.fail_ring(&format!("completing the request at head {head}: {e}"));
                return;
            }
            self.regs().update_u32(regs::COMPLETED, |c| c.wrapping_add(1));
            if interrupt {
                self.shared.notify(abi::INT_QUEUE, regs::QUEUE_VECTOR);
            }
        }
    }

    /// Runs one request; returns the used length and whether to interrupt.
    fn process(&mut self, descs: &[Desc]) -> (u32, bool) {
        let t0 = Instant::now();
        let writable: Vec<&Desc> = descs.iter().filter(|d| d.write).collect();
        let Some(status_desc) = writable.last().filter(|d| d.len as usize >= abi::STATUS_BYTES) else {
            self.regs().set_u32(regs::ERROR, abi::ERR_NO_STATUS_BLOCK);
            self.counters.failed += 1;
            return (0, true);
        };
        let message_desc = (writable.len() > 1).then(|| writable[0]);
        let mut header = abi::RequestHeader::default();
        let outcome = self.run_request(descs, &mut header);
        let wall_ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);

        self.counters.requests += 1;
        self.counters.wall_ns += wall_ns;
        if let Some(t) = &self.opts.telemetry {
            t.request(outcome.status, wall_ns, outcome.report.as_ref());
        }
        if outcome.status != abi::ST_OK {
            self.counters.failed += 1;
        }
        let mut block = abi::StatusBlock {
            status: outcome.status,
            detail: outcome.detail,
            tag: header.tag,
            wall_ns,
            ..Default::default()
        };
        if let Some(r) = &outcome.report {
            let t = r.totals();
            block.cycles = r.cycles.ceil() as u64;
            block.sa_active = t.sa_active_cycles.round() as u64;
            block.vu_active = t.vu_active_cycles.round() as u64;
            block.dma_active = t.dma_active_cycles.round() as u64;
            block.flops = t.flops;
        }
        let mut used = 0u32;
        if let Some(m) = message_desc {
            let text = outcome.message.as_bytes();
            let n = text.len().min(MAX_MESSAGE).min(m.len as usize);
            if n > 0 && self.mem.write_slice(&text[..n], GuestAddress(m.addr)).is_ok() {
                used += n as u32;
            }
        }
        if self.mem.write_slice(&block.to_bytes(), GuestAddress(status_desc.addr)).is_err() {
            self.regs().set_u32(regs::ERROR, abi::ERR_NO_STATUS_BLOCK);
            return (0, true);
        }
        used += abi::STATUS_BYTES as u32;
        (used, header.flags & abi::FLAG_NO_INTERRUPT == 0)
    }

    fn run_request(&mut self, descs: &[Desc], header: &mut abi::RequestHeader) -> Outcome {
        // Device-readable descriptors come first, then device-writable ones.
        let first_write = descs.iter().position(|d| d.write).unwrap_or(descs.len());
        if descs[first_write..].iter().any(|d| !d.write) {
            return Outcome::fail(abi::ST_BAD_REQUEST, "a device-readable descriptor follows a writable one");
        }
        let readable = &descs[..first_write];
        let Some(h) = readable.first().filter(|d| d.len as usize >= abi::HEADER_BYTES) else {
            return Outcome::fail(
                abi::ST_BAD_REQUEST,
                "the first descriptor is not a 32-byte request header",
            );
        };
        let mut hb = [0u8; abi::HEADER_BYTES];
        if self.mem.read_slice(&mut hb, GuestAddress(h.addr)).is_err() {
            return Outcome::fail(
                abi::ST_BAD_REQUEST,
                format!("header at {:#x} is not in guest memory", h.addr),
            );
        }
        *header = abi::RequestHeader::from_bytes(&hb);
        match header.opcode {
            abi::OP_NOP => Outcome::default(),
            abi::OP_RUN => self.run(&readable[1..], header),
            abi::OP_REGISTER => self.register(&readable[1..]),
            abi::OP_RUN_REGISTERED => match self.registered(header.handle) {
                Ok(p) => self.execute(p, header),
                Err(o) => o,
            },
            abi::OP_UNREGISTER => match self.registered(header.handle) {
                Ok(_) => {
                    self.programs[header.handle as usize] = None;
                    Outcome::default()
                }
                Err(o) => o,
            },
            op => Outcome::fail(abi::ST_UNKNOWN_OPCODE, format!("unknown opcode {op}")),
        }
    }

    /// Copies the program out of guest memory, decodes and verifies it
    /// against the current configuration.
    fn load_verified(&self, payload: &[Desc]) -> Result<Program, Outcome> {
        let Some(spec) = self.config else {
            return Err(Outcome::fail(abi::ST_NOT_CONFIGURED, "the vNPU is released; configure it first"));
        };
        let total: u64 = payload.iter().map(|d| u64::from(d.len)).sum();
        if total > u64::from(abi::MAX_PROGRAM_BYTES) {
            return Err(Outcome::fail(
                abi::ST_TOO_LARGE,
                format!("program of {total} bytes, limit {}", abi::MAX_PROGRAM_BYTES),
            ));
        }
        // Copied out first: the guest cannot change what was checked.
        let mut bytes = vec![0u8; total as usize];
        let mut at = 0usize;
        for d in payload {
            let end = at + d.len as usize;
            if self.mem.read_slice(&mut bytes[at..end], GuestAddress(d.addr)).is_err() {
                return Err(Outcome::fail(
                    abi::ST_BAD_REQUEST,
                    format!("program buffer [{:#x}, +{:#x}) is not in guest memory", d.addr, d.len),
                ));
            }
            at = end;
        }
        let program =
            Program::decode(&bytes).map_err(|e| Outcome::fail(abi::ST_BAD_PROGRAM, e.to_string()))?;
        let limits =
            spec.limits(self.mem.iter().map(|r| r.start_addr().0..r.start_addr().0 + r.len()).collect());
        if let Err(e) = npu_model::verify(&program, &limits) {
            let detail = e.position().map_or(NO_DETAIL, |(s, i)| (s as u32) << 16 | (i as u32 & 0xffff));
            return Err(Outcome {
                status: abi::ST_VERIFY_FAILED,
                detail,
                report: None,
                message: e.to_string(),
            });
        }
        Ok(program)
    }

    /// `RUN`: load, verify, execute.
    fn run(&mut self, payload: &[Desc], header: &abi::RequestHeader) -> Outcome {
        match self.load_verified(payload) {
            Ok(program) => self.execute(Arc::new(program), header),
            Err(o) => o,
        }
    }

    /// `REGISTER`: load and verify once; the handle is in `detail`.
    fn register(&mut self, payload: &[Desc]) -> Outcome {
        let program = match self.load_verified(payload) {
            Ok(p) => p,
            Err(o) => return o,
        };
        let Some(slot) = (0..abi::MAX_REGISTERED).find(|&i| self.programs.get(i).is_none_or(Option::is_none))
        else {
            return Outcome::fail(
                abi::ST_NO_SPACE,
                format!("all {} program handles are in use", abi::MAX_REGISTERED),
            );
        };
        let held: usize = self.programs.iter().flatten().map(|p| p.instruction_count()).sum();
        let count = program.instruction_count();
        if held.saturating_add(count) > abi::MAX_REGISTERED_INSTRUCTIONS {
            return Outcome::fail(
                abi::ST_NO_SPACE,
                format!(
                    "registered programs hold {held} instructions; {count} more would pass the limit of {}",
                    abi::MAX_REGISTERED_INSTRUCTIONS
                ),
            );
        }
        if slot >= self.programs.len() {
            self.programs.resize_with(slot + 1, || None);
        }
        self.programs[slot] = Some(Arc::new(program));
        Outcome { status: abi::ST_OK, detail: slot as u32, report: None, message: String::new() }
    }

    fn registered(&self, handle: u32) -> Result<Arc<Program>, Outcome> {
        self.programs.get(handle as usize).and_then(Clone::clone).ok_or_else(|| {
            Outcome::fail(abi::ST_BAD_HANDLE, format!("no program is registered under handle {handle}"))
        })
    }

    /// Runs a verified program on the header's core.
    fn execute(&mut self, program: Arc<Program>, header: &abi::RequestHeader) -> Outcome {
        let Some(spec) = self.config else {
            return Outcome::fail(abi::ST_NOT_CONFIGURED, "the vNPU is released; configure it first");
        };
        let Some(Some(core_slot)) = usize::try_from(header.core).ok().map(|c| self.cores.get(c).map(|_| c))
        else {
            let n = spec.cores();
            return Outcome::fail(
                abi::ST_BAD_CORE,
                format!("core {} does not exist ({n} cores)", header.core),
            );
        };
        let budget = match header.max_cycles {
            0 => DEFAULT_BUDGET,
            n => n.min(MAX_BUDGET),
        };
        let core = self.cores[core_slot].get_or_insert_with(|| Core {
            sram: Sram::new(spec.sram_per_core),
            hbm: LazyHbm::new(spec.hbm_per_core),
        });
        let result = if let Some(shared) = self.opts.cores.get(core_slot).cloned() {
            // Lend the core's memory to the shared physical core for the batch.
            let lent = std::mem::replace(core, Core { sram: Sram::new(0), hbm: LazyHbm::new(0) });
            let claim = npu_board_runtime::Claim {
                sa: spec.sa_per_core,
                vu: spec.vu_per_core,
                priority: self.opts.priority,
                slo_cycles: self.opts.slo_us.saturating_mul(u64::from(self.board.clock_mhz)),
            };
            // Co-located tenants wait for this batch: a tighter budget.
            let budget = budget.min(self.opts.shared_max_cycles.max(1));
            let host_work = self.opts.shared_max_host_work;
            match shared.run(
                &self.name,
                claim,
                program,
                lent,
                Box::new(GuestRam::new(&self.mem)),
                budget,
                host_work,
            ) {
                Some((back, r, _, _)) => {
                    *core = back;
                    r
                }
                None => return Outcome::fail(abi::ST_EXEC_FAULT, "the physical core stopped"),
            }
        } else {
            let mut guest = GuestRam::new(&self.mem);
            let mem = CoreMemory { sram: &mut core.sram, hbm: &mut core.hbm, guest: &mut guest };
            run_program(&self.board, &program, Some(mem), Some(budget))
        };
        match result {
            Ok(report) => {
                self.counters.add(header.core, &report);
                Outcome { status: abi::ST_OK, detail: 0, report: Some(report), message: String::new() }
            }
            Err(e) => {
                let (status, detail) = match &e {
                    ExecError::Budget { .. } | ExecError::HostWork { .. } => {
                        (abi::ST_BUDGET_EXHAUSTED, NO_DETAIL)
                    }
                    ExecError::Kernel { stream, index, .. } | ExecError::Deadlock { stream, index, .. } => {
                        (abi::ST_EXEC_FAULT, (*stream as u32) << 16 | (*index as u32 & 0xffff))
                    }
                };
                Outcome { status, detail, report: None, message: e.to_string() }
            }
        }
    }
}

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
    fn ring_pending(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| {
            q.avail_idx(&self.mem, std::sync::atomic::Ordering::Acquire).is_ok_and(|i| i.0 != q.next_avail())
        })
    }

    /// Polls the ring for `opts.poll` after the last request, with doorbells
    /// suppressed (`VRING_USED_F_NO_NOTIFY`), so back-to-back requests skip
    /// both the doorbell exit and the thread wake-up.
    fn poll_ring(&mut self) {
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

/// Starts the worker thread for `worker`; it runs until [`Control::Stop`].
/// Should it panic (a host bug), the vNPU is left in a failed state the
/// driver can read (`ERR_DEVICE_FAULT`), never a silent hang.
pub(crate) fn spawn(worker: Worker, name: String) -> std::io::Result<std::thread::JoinHandle<()>> {
    let shared = Arc::clone(&worker.shared);
    std::thread::Builder::new().name(name).spawn(move || {
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(worker)));
        if served.is_err() {
            died(&shared);
        }
    })
}

/// The worker's event loop.
fn serve(worker: Worker) {
    let mut em = match EventManager::<Worker>::new() {
        Ok(em) => em,
        Err(_) => return,
    };
    let id = em.add_subscriber(worker);
    loop {
        match em.subscriber_mut(id) {
            Ok(w) if !w.stopped => {}
            _ => return,
        }
        if em.run().is_err() {
            return;
        }
    }
}

/// The device's failed state with `code` in `ERROR`: the ring is not
/// served until the driver resets the device.
fn mark_failed(r: &mut RegFile, code: u32) {
    r.set_u32(regs::ERROR, code);
    r.update_u32(regs::STATUS, |s| (s | abi::STATUS_FAILED) & !abi::STATUS_QUEUE_READY);
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

/// Drives a worker synchronously from fuzzer bytes (no thread): an
/// operation count, that many 16-byte operations (ring set-up with any
/// size and addresses, reset, mailbox commands, ring drains), then guest
/// memory contents. Used by the `vnpu_ring` fuzz target and a unit
/// test; not part of the device's API: built only for them (cargo-fuzz
/// builds with `--cfg fuzzing`).
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub fn fuzz_drive(data: &[u8]) {
    const MEM: usize = 16 << 10;
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]) else { return };
    // The first byte says how many 16-byte operations follow; the bytes
    // after them seed guest memory (repeated to fill it).
    let Some((&n, rest)) = data.split_first() else { return };
    let (ops, init) = rest.split_at(rest.len().min(16 * usize::from(n)));
    if !init.is_empty() {
        let fill: Vec<u8> = init.iter().copied().cycle().take(MEM).collect();
        let _ = mem.write_slice(&fill, GuestAddress(0));
    }
    let Ok(shared) = Shared::new(RegFile::new(), 8, Arc::new(crate::RecordingSink::default()), None) else {
        return;
    };
    // Completions raise vectors through the sink.
    lock(&shared.irq.state).enabled = true;
    let shared = Arc::new(shared);
    let grant = VnpuSpec {
        chips: 1,
        cores_per_chip: 2,
        sa_per_core: 2,
        vu_per_core: 2,
        // Small segments keep each run fast; the checks do not depend on size.
        sram_per_core: 64 << 10,
        hbm_per_core: 1 << 20,
    };
    let mut w = Worker::new(
        shared,
        mem,
        BoardConfig::default(),
        grant,
        DeviceOptions { poll: std::time::Duration::ZERO, ..Default::default() },
        "fuzz",
    );
    let u64_at = |b: &[u8], o: usize| {
        let mut x = [0u8; 8];
        for (i, v) in b.iter().skip(o).take(8).enumerate() {
            x[i] = *v;
        }
        u64::from_le_bytes(x)
    };
    for op in ops.chunks(16) {
        match op[0] % 4 {
            0 => w.enable(
                u32::from(op.get(1).copied().unwrap_or(8)),
                u64_at(op, 2) % (MEM as u64 + 64),
                u64_at(op, 6) % (MEM as u64),
                u64_at(op, 10) % (MEM as u64),
            ),
            1 => w.reset(),
            2 => {
                let args = [u64_at(op, 2) % 4, u64_at(op, 4) % 4, u64_at(op, 6), u64_at(op, 8), 1, 1];
                let _ = w.mailbox(u32::from(op.get(1).copied().unwrap_or(0) % 7), args);
            }
            _ => w.drain_ring(),
        }
    }
}

#[cfg(test)]
mod fault_tests {
    use super::*;

    /// A worker that panics leaves its vNPU failed with `ERR_DEVICE_FAULT`
    /// (what the driver reads), the mailbox not busy forever, and further
    /// controls dropped instead of queued.
    #[test]
    fn a_worker_panic_is_a_device_error_the_driver_can_read() {
        let (mut f, _sink) = crate::test_function(&VnpuSpec::named("small").unwrap());
        let rd = |f: &mut crate::VnpuFunction, off: u64| {
            let mut b = [0u8; 4];
            vnpu_pci::PciFunction::bar_read(f, 0, off, &mut b);
            u32::from_le_bytes(b)
        };
        assert_eq!(rd(&mut f, regs::ERROR), 0);
        // A mailbox command posted just before the fault.
        vnpu_pci::PciFunction::bar_write(&mut f, 0, regs::MBOX_CMD, &abi::MBOX_QUERY_GRANT.to_le_bytes());
        f.shared_for_tests().post(Control::Panic);
        let t0 = Instant::now();
        while rd(&mut f, regs::STATUS) & abi::STATUS_FAILED == 0 {
            assert!(t0.elapsed().as_secs() < 10, "the vNPU never reported its fault");
            std::thread::yield_now();
        }
        assert_eq!(rd(&mut f, regs::ERROR), abi::ERR_DEVICE_FAULT);
        assert_eq!(rd(&mut f, regs::STATUS) & abi::STATUS_QUEUE_READY, 0);
        assert_ne!(rd(&mut f, regs::MBOX_STATUS), abi::MBOX_BUSY);
        for _ in 0..1000 {
            vnpu_pci::PciFunction::bar_write(&mut f, 0, regs::DEVICE_RESET, &1u32.to_le_bytes());
        }
        assert!(lock(&f.shared_for_tests().controls).is_empty());
    }
}

#[cfg(test)]
mod registration_tests {
    use super::*;

    /// The instructions a guest can keep registered are bounded: programs
    /// of the largest size register until `MAX_REGISTERED_INSTRUCTIONS`,
    /// the next is refused with `NO_SPACE`, and a free handle's room is
    /// usable again.
    #[test]
    fn registered_programs_are_bounded_in_instructions() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        let mut b = vnpu_abi::ProgramBuilder::new();
        for i in 0..vnpu_abi::program::MAX_INSTRUCTIONS - 1 {
            b.push(vnpu_abi::Engine::DMA, vnpu_abi::Instr::Signal { sem: (i % 64) as u8 });
        }
        let bytes = b.finish().encode();
        mem.write_slice(&bytes, GuestAddress(0x1000)).unwrap();
        let payload = [Desc { addr: 0x1000, len: bytes.len() as u32, write: false }];
        let shared = Arc::new(
            Shared::new(RegFile::new(), 8, Arc::new(crate::RecordingSink::default()), None).unwrap(),
        );
        let spec = VnpuSpec::named("small").unwrap();
        let mut w = Worker::new(shared, mem, BoardConfig::default(), spec, DeviceOptions::default(), "t");
        let fits = abi::MAX_REGISTERED_INSTRUCTIONS / vnpu_abi::program::MAX_INSTRUCTIONS;
        for i in 0..fits {
            let o = w.register(&payload);
            assert_eq!((o.status, o.detail), (abi::ST_OK, i as u32), "{}", o.message);
        }
        let o = w.register(&payload);
        assert_eq!(o.status, abi::ST_NO_SPACE, "{}", o.message);
        assert!(o.message.contains("would pass the limit"), "{}", o.message);
        w.programs[1] = None;
        assert_eq!(w.register(&payload).status, abi::ST_OK);
    }
}

#[cfg(test)]
mod fuzz_tests {
    /// The fuzz harness runs on arbitrary bytes (smoke test of the target).
    #[test]
    fn fuzz_harness_survives_arbitrary_bytes() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [0usize, 1, 15, 16, 300, 5000, 20000] {
            let data: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            super::fuzz_drive(&data);
        }
        // Short operations (a harness bug the fuzzer found in its first minute).
        super::fuzz_drive(&[1, 0, 8, 0, 0, 0, 0, 0]);
        super::fuzz_drive(&[1, 2, 1, 9]);
    }
}
