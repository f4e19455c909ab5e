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

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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

mod counters;
mod mailbox;
mod mmio;
mod precopy;
mod ring;
mod stream;

pub use precopy::{piece_flags, piece_len, LAST_OF_PASS};
pub use stream::{stream_limit, STREAM_VERSION};

use counters::Counters;

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

/// Most ring enables, resets and mailbox commands a guest may have queued
/// for the worker at once ([`Shared::post`]).
pub(crate) const MAX_QUEUED_CONTROLS: usize = 64;

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
    /// DMA regions), and what says it was lost; applied between requests.
    Memory(GuestMemoryMmap<()>, Option<crate::MemoryWatch>),
    /// Keep the vNPU's state in `store` from now on: a new session from
    /// nothing, or (`resume`) the session it holds, left by a daemon that
    /// died or restarted (its ring is taken up again at [`Control::Resume`]).
    Session {
        store: Arc<crate::store::SessionStore>,
        resume: bool,
    },
    /// The client of a resumed session is set up again (memory mapped,
    /// interrupts given): take the ring up where it was.
    Resume,
    /// Save the vNPU's whole state into the folder (a snapshot of its VM,
    /// `docs/migration.md`), say so at the rendezvous, then stay parked,
    /// serving nothing, until the VMM releases it.
    Snapshot(std::path::PathBuf, Arc<Rendezvous>),
    /// Take the state a snapshot saved in the folder (registers,
    /// configuration, memories; programs and ring at [`Control::Resume`]),
    /// keeping nothing in it from now on.
    Restore(std::path::PathBuf, Arc<Rendezvous>),
    /// As [`Control::Snapshot`], the state as one stream left at the
    /// rendezvous (a vfio-user client's stop-and-copy, `stream.rs`).
    SaveStream(Arc<Rendezvous>),
    /// As [`Control::Restore`], from a stream (`stream.rs`).
    RestoreStream(Arc<Vec<u8>>, Arc<Rendezvous>),
    /// The next pre-copy piece of about this many bytes of HBM, left at
    /// the rendezvous (`precopy.rs`); the vNPU runs on.
    PreCopy(usize, Arc<Rendezvous>),
    /// The pre-copy ends without a stop.
    PreCopyAbort,
    /// A pre-copy piece from the sending vNPU, taken before its stream.
    ApplyPiece(Arc<Vec<u8>>, Arc<Rendezvous>),
    Stop,
    /// Makes the worker panic (tests of the fault path only).
    #[cfg(test)]
    Panic,
}

/// Why a vNPU's part of a snapshot or a restore failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    State(#[from] crate::persist::StateError),
    #[error("the folder holds no saved vNPU state")]
    Empty,
    #[error("the device stream: {0}")]
    Stream(String),
    #[error("the vNPU's worker did not answer within {0:?} (it failed or is stuck)")]
    NoAnswer(std::time::Duration),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let what = what.into();
    move |source| SnapshotError::Io { what, source }
}

/// Where the VMM and a vNPU's worker meet for a snapshot or a restore
/// ([`Control::Snapshot`], [`Control::Restore`]): the worker leaves how
/// its part went; after a snapshot it waits, parked between requests,
/// until the VMM releases it (once guest RAM is saved too, so that the
/// two agree).
#[derive(Debug, Default)]
pub struct Rendezvous {
    slot: Mutex<(Option<Result<(), SnapshotError>>, bool)>,
    cv: std::sync::Condvar,
    /// A stream the worker saved (`Control::SaveStream`).
    bytes: Mutex<Vec<u8>>,
}

impl Rendezvous {
    fn done(&self, r: Result<(), SnapshotError>) {
        lock(&self.slot).0 = Some(r);
        self.cv.notify_all();
    }

    /// How the worker's part went, waiting at most `timeout` for it.
    pub fn wait_done(&self, timeout: std::time::Duration) -> Result<(), SnapshotError> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.slot);
        loop {
            if let Some(r) = g.0.take() {
                return r;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(SnapshotError::NoAnswer(timeout));
            }
            g = self.cv.wait_timeout(g, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
    }

    /// The stream the worker left (empty until it is done, and after
    /// it was taken).
    pub fn take_bytes(&self) -> Vec<u8> {
        std::mem::take(&mut *lock(&self.bytes))
    }

    /// Lets a parked worker go on.
    pub fn release(&self) {
        lock(&self.slot).1 = true;
        self.cv.notify_all();
    }

    fn wait_released(&self) {
        let mut g = lock(&self.slot);
        while !g.1 {
            g = self.cv.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
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
    /// The guest pages the device writes while a live migration logs them.
    pub write_log: Arc<crate::WriteLog>,
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
            write_log: Arc::new(crate::WriteLog::default()),
        })
    }

    /// Posts `c` to the worker (dropped once the worker is dead). What a
    /// guest's register writes queue (ring enables, resets, mailbox
    /// commands) is bounded, so a guest that writes faster than the worker
    /// serves cannot grow the queue: a reset right behind a queued reset
    /// is the same reset, and past [`MAX_QUEUED_CONTROLS`] guest controls
    /// a write is dropped, as a full hardware FIFO drops it (the guest
    /// polls `STATUS` or `MBOX_STATUS`, which say nothing happened). The
    /// host's controls (grants, memory, stop) are always queued.
    pub fn post(&self, c: Control) {
        if self.dead.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let mut q = lock(&self.controls);
        let from_guest =
            |c: &Control| matches!(c, Control::Enable { .. } | Control::Reset | Control::Mailbox { .. });
        if from_guest(&c) {
            if matches!(c, Control::Reset) && matches!(q.back(), Some(Control::Reset)) {
                return;
            }
            if q.iter().filter(|c| from_guest(c)).count() >= MAX_QUEUED_CONTROLS {
                return;
            }
        }
        q.push_back(c);
        drop(q);
        // An eventfd write fails only when the counter would overflow, in
        // which case the worker is already due to wake.
        let _ = self.control_evt.write(1);
    }

    /// Records `bit` in `INT_STATUS` and raises the vector named by the
    /// register at `vector_reg`, if any.
    pub(crate) fn notify(&self, bit: u32, vector_reg: u64) {
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
pub(crate) type Core = npu_board_runtime::CoreMem;

/// Calls `f` with each HBM chunk `hbm` has written (the others read as
/// zero): its index and its bytes. A save and a copy walk HBM this way.
pub(super) fn each_written_chunk<E>(
    hbm: &LazyHbm,
    err: impl Fn(npu_model::memory::MemoryError) -> E,
    f: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<(), E> {
    each_chunk_of(hbm, &hbm.written_chunks(), err, f)
}

/// Calls `f` with each of `chunks` of `hbm` and its bytes, in order.
pub(super) fn each_chunk_of<E>(
    hbm: &LazyHbm,
    chunks: &[u64],
    err: impl Fn(npu_model::memory::MemoryError) -> E,
    mut f: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<(), E> {
    use npu_model::memory::{Memory, HBM_CHUNK};
    let size = hbm.size();
    let mut buf = vec![0u8; usize::try_from(HBM_CHUNK).unwrap_or(1 << 20)];
    for &c in chunks {
        let at = c.saturating_mul(HBM_CHUNK);
        let n = usize::try_from(HBM_CHUNK.min(size.saturating_sub(at))).unwrap_or(0);
        hbm.read(at, &mut buf[..n]).map_err(&err)?;
        f(c, &buf[..n])?;
    }
    Ok(())
}

/// Copies core memories: the whole SRAM, and the HBM chunks `from` has
/// written.
fn copy_core(from: &Core, to: &mut Core) -> std::io::Result<()> {
    use npu_model::memory::{Memory, HBM_CHUNK};
    let err = |e: npu_model::memory::MemoryError| std::io::Error::other(e.to_string());
    to.sram.write(0, from.sram.bytes()).map_err(err)?;
    each_written_chunk(&from.hbm, err, |c, bytes| {
        to.hbm.write(c.saturating_mul(HBM_CHUNK), bytes).map_err(err)
    })
}

/// A resumed session's ring and programs, taken up at [`Control::Resume`]
/// (once the client has mapped guest memory again: programs are verified
/// against it, and the ring lives in it).
#[derive(Debug)]
struct Parked {
    programs: Vec<(usize, Vec<u8>)>,
    /// The ring was enabled: take it up where the guest's used ring says.
    ring: bool,
    /// The ring was being enabled (or reset) when the daemon went.
    enable: bool,
    reset: bool,
    /// Ring index of the request that was running.
    in_flight: Option<u16>,
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
    /// Engines its spread programs may borrow beyond its own, per vNPU
    /// core (`None`: `vnpu_spec::Qos::borrow_cap`'s default).
    pub borrow: Option<vnpu_spec::Borrow>,
    /// Cap of a request's cycle budget on a shared core.
    pub shared_max_cycles: u64,
    /// Host-work budget of a request on a shared core.
    pub shared_max_host_work: u64,
    /// Where the worker adds up what it does (the daemon's metrics).
    pub telemetry: Option<Arc<crate::Telemetry>>,
    /// Files the VMM mapped into guest RAM (`vnpu infer`'s model file):
    /// a DMA of their unchanged pages into HBM maps them instead of
    /// copying. Forgotten when the guest memory is replaced.
    pub guest_files: Arc<[crate::GuestFile]>,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            poll: std::time::Duration::from_micros(DEFAULT_POLL_US),
            cores: Vec::new(),
            priority: 0,
            slo_us: 0,
            borrow: None,
            shared_max_cycles: SHARED_MAX_BUDGET,
            shared_max_host_work: SHARED_MAX_HOST_WORK,
            telemetry: None,
            guest_files: Arc::from([]),
        }
    }
}

/// Default polling window after activity, in microseconds.
pub const DEFAULT_POLL_US: u64 = 200;

/// The vNPU device core: registers, mailbox, ring walking, programs and
/// configuration, and the one save point of its state (`persist`). It is
/// synchronous: a worker thread runs it for a PCI function
/// (`crate::worker`), a caller drives a [`DeviceCore::detached`] one
/// directly (the fuzz targets).
#[derive(Debug)]
pub struct DeviceCore {
    shared: Arc<Shared>,
    mem: GuestMemoryMmap<()>,
    /// Says when some of `mem` was lost (`Control::Memory`).
    mem_watch: Option<crate::MemoryWatch>,
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
    /// Where the vNPU's state is saved for a restarted daemon (a served
    /// vNPU's, once its client said which session it is): written at the
    /// save points only ([`DeviceCore::persist`]).
    store: Option<Arc<crate::store::SessionStore>>,
    /// The session the saved state belongs to.
    session_id: u64,
    /// Ring index of the request running now, if one is (saved, so that a
    /// restarted daemon completes it with `ST_RETRY`).
    in_flight: Option<u16>,
    /// Program handles registered or dropped since the last save point.
    programs_changed: BTreeSet<usize>,
    /// The configuration or the request in flight changed since the last
    /// save point.
    state_changed: bool,
    /// A resumed session waiting for [`Control::Resume`].
    parked: Option<Parked>,
    /// A pre-copy of the HBM under way (sending).
    precopy: Option<precopy::PreCopy>,
    /// Memories pre-copy pieces built (receiving).
    incoming: Option<precopy::Incoming>,
}

impl DeviceCore {
    /// A core with registers, interrupts (raised into `sink`, MSI-X on and
    /// every vector unmasked) and a control queue of its own, driven by its
    /// caller: [`DeviceCore::register_write`] as a guest writes BAR 0,
    /// then [`DeviceCore::handle_controls`] and
    /// [`DeviceCore::drain_ring`] as the worker thread would.
    pub fn detached(
        memory: GuestMemoryMmap<()>,
        board: &BoardConfig,
        grant: VnpuSpec,
        opts: DeviceOptions,
        sink: Arc<dyn crate::MsiSink>,
    ) -> std::io::Result<Self> {
        let shared = Shared::new(crate::initial_registers(board), abi::MSIX_VECTORS, sink, None)?;
        lock(&shared.irq.state).enabled = true;
        Ok(Self::new(Arc::new(shared), memory, board.clone(), grant, opts, "detached"))
    }

    /// Keeps this core's state in `store` from now on (as
    /// `VnpuFunction::keep_in`): a new session, or (`resume`) the one the
    /// store holds, whatever its files contain.
    pub fn keep_in(&mut self, store: Arc<crate::store::SessionStore>, resume: bool) {
        self.session(store, resume);
    }

    /// Takes a resumed session's ring up again (as `VnpuFunction::resume`).
    pub fn resume_session(&mut self) {
        self.resume();
    }

    /// The whole state as a device stream (as `StateHandle::save_stream`,
    /// `docs/migration.md`).
    pub fn stream(&self) -> Result<Vec<u8>, SnapshotError> {
        self.encode_stream(None)
    }

    /// The next pre-copy piece of about `max` bytes of HBM (as
    /// `StateHandle::precopy`, `precopy.rs`); empty when none is due.
    pub fn precopy(&mut self, max: usize) -> Result<Vec<u8>, SnapshotError> {
        self.precopy_piece(max)
    }

    /// The stream at the stop (as `StateHandle::save_stream`): after a
    /// pre-copy that still holds, incremental.
    pub fn stop_stream(&mut self) -> Result<Vec<u8>, SnapshotError> {
        let rest = self.precopy_rest();
        self.encode_stream(rest.as_deref())
    }

    /// Takes a pre-copy piece (as `StateHandle::apply_piece`).
    pub fn take_piece(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        self.apply_piece(bytes)
    }

    /// Takes a device stream (as `StateHandle::restore_stream`); the ring
    /// waits for [`Self::resume_session`].
    pub fn take_stream(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        self.restore_stream(bytes)
    }

    /// A guest write to BAR 0 (`docs/device-interface.md`); the control
    /// work it starts waits for [`DeviceCore::handle_controls`].
    pub fn register_write(&self, offset: u64, data: &[u8]) {
        self.shared.register_write(offset, data);
    }

    /// A guest read of BAR 0.
    pub fn register_read(&self, offset: u64, data: &mut [u8]) {
        self.shared.register_read(offset, data);
    }

    pub(crate) fn new(
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
            mem_watch: None,
            board,
            grant,
            config: None,
            cores: Vec::new(),
            queue: None,
            counters: Counters::default(),
            stopped: false,
            programs: Vec::new(),
            store: None,
            session_id: 0,
            in_flight: None,
            programs_changed: BTreeSet::new(),
            state_changed: true,
            parked: None,
            precopy: None,
            incoming: None,
        };
        w.configure(grant);
        w
    }

    fn regs(&self) -> std::sync::MutexGuard<'_, RegFile> {
        lock(&self.shared.regs)
    }

    fn configure(&mut self, spec: VnpuSpec) {
        self.forget_programs_and_memories();
        self.adopt(spec);
    }

    /// Takes `spec` as the configuration: its cores (memories created on
    /// first use), the telemetry and the hierarchy registers.
    fn adopt(&mut self, spec: VnpuSpec) {
        let n = spec.cores() as usize;
        self.cores = (0..n).map(|_| None).collect();
        self.config = Some(spec);
        self.state_changed = true;
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
            Some(c) if c.fits_within(&grant) => {}
            Some(_) => self.configure(grant),
            None => {}
        }
    }

    fn release(&mut self) {
        self.forget_programs_and_memories();
        self.cores.clear();
        self.config = None;
        self.state_changed = true;
        if let Some(t) = &self.opts.telemetry {
            t.configured(None);
        }
        let mut r = self.regs();
        r.set_hierarchy(None);
        r.update_u32(regs::STATUS, |s| s & !abi::STATUS_READY);
    }

    /// A new configuration (or none): the programs registered against the
    /// old one go, and its core memories with their saved files (a new
    /// configuration starts from zeros).
    fn forget_programs_and_memories(&mut self) {
        for (h, p) in self.programs.iter().enumerate() {
            if p.is_some() {
                self.programs_changed.insert(h);
            }
        }
        self.programs.clear();
        if let Some(st) = &self.store {
            if let Err(e) = st.clear_cores() {
                st.invalidate(&format!("dropping the old configuration's memories: {e}"));
            }
        }
    }

    /// Core `slot`'s memories for `spec`: in the session's files when it
    /// has a store (so a restarted daemon finds them), else in host memory.
    pub(super) fn core_memory(&self, slot: usize, spec: &VnpuSpec) -> Core {
        let (sram, hbm) = (spec.sram_per_core(), spec.hbm_per_core());
        let stored = self.store.as_ref().and_then(|st| {
            st.core(slot, sram, hbm).map_err(|e| st.invalidate(&format!("core {slot}'s memories: {e}"))).ok()
        });
        stored.unwrap_or_else(|| Core { sram: Sram::new(sram), hbm: LazyHbm::new(hbm) })
    }

    /// The vNPU's state as it leaves the core (`persist::DeviceState`):
    /// its session, configuration, request in flight and registers.
    pub(crate) fn save_state(&self) -> crate::persist::DeviceState {
        crate::persist::DeviceState {
            session: self.session_id,
            config: self.config,
            in_flight: self.in_flight,
            regs: self.regs().snapshot(),
        }
    }

    /// The save point: what changed since the last one goes to the store
    /// (programs registered or dropped, then the state record if the
    /// registers, the configuration or the request in flight changed).
    /// The core calls it after control work and around each request; it
    /// is the only place that writes the saved state.
    pub(super) fn persist(&mut self) {
        let changed = std::mem::take(&mut self.programs_changed);
        let regs_changed = self.regs().take_changed();
        let Some(st) = self.store.clone() else { return };
        for h in changed {
            let r = match self.programs.get(h).and_then(Option::as_ref) {
                Some(p) => st.save_program(h, &p.encode()),
                None => st.forget_program(h),
            };
            if let Err(e) = r {
                st.invalidate(&format!("storing program {h}: {e}"));
            }
        }
        if regs_changed || std::mem::take(&mut self.state_changed) {
            st.save(&self.save_state());
        }
    }

    /// Request `index` of the ring starts: saved as in flight.
    pub(super) fn begin_request(&mut self, index: u16) {
        self.in_flight = Some(index);
        self.state_changed = true;
        self.persist();
    }

    /// The request in flight completed: saved with what it changed.
    pub(super) fn end_request(&mut self) {
        self.in_flight = None;
        self.state_changed = true;
        self.persist();
    }

    /// Starts saving state in `store`: from nothing, or (`resume`) by
    /// restoring the state it holds, whose registers, configuration and
    /// core memories are taken now and whose programs and ring wait for
    /// [`Control::Resume`].
    fn session(&mut self, store: Arc<crate::store::SessionStore>, resume: bool) {
        let loaded = store.load();
        self.session_id = match &loaded {
            Ok(Some(s)) => s.session,
            _ => 0,
        };
        let restored = match loaded {
            Ok(Some(state)) if resume => Some(state),
            Ok(_) => None,
            Err(e) => {
                // Not a state this daemon takes: start afresh.
                log::warn!("{}: the saved state is not restorable ({e}); not resumed", self.name);
                None
            }
        };
        self.store = Some(Arc::clone(&store));
        let Some(state) = restored else {
            // A new session: everything saved from now on, the programs
            // and memories of before dropped.
            if let Err(e) = store.clear_programs().and_then(|()| store.clear_cores()) {
                store.invalidate(&format!("dropping the old state: {e}"));
            }
            self.programs_changed.clear();
            self.state_changed = true;
            self.persist();
            return;
        };
        self.restore(&store, state);
    }

    /// Restores a saved state (`session`): registers, then the
    /// configuration if it still fits the grant, with the programs and ring
    /// parked for [`Control::Resume`].
    fn restore(&mut self, store: &crate::store::SessionStore, state: crate::persist::DeviceState) {
        let programs = store.programs().unwrap_or_else(|e| {
            log::warn!("{}: reading the stored programs: {e}", self.name);
            Vec::new()
        });
        self.restore_parts(state, programs);
    }

    /// Restores a saved state with its programs (from a store or a
    /// stream): registers, then the configuration if it still fits the
    /// grant, with the programs and ring parked for [`Control::Resume`].
    fn restore_parts(&mut self, state: crate::persist::DeviceState, programs: Vec<(usize, Vec<u8>)>) {
        self.regs().resume(&state.regs);
        let config = state.config;
        match config {
            // Still within the grant: kept, with its memories.
            Some(c) if c.fits_within(&self.grant) => self.adopt(c),
            Some(_) => {
                self.configure(self.grant);
                self.shared.notify(abi::INT_GRANT, regs::MBOX_VECTOR);
            }
            None => self.release(),
        }
        let (status, enable) = {
            let r = self.regs();
            (r.u32(regs::STATUS), r.u32(regs::QUEUE_ENABLE))
        };
        let kept = self.config == config;
        self.parked = Some(Parked {
            programs: if kept { programs } else { Vec::new() },
            ring: status & abi::STATUS_QUEUE_READY != 0,
            enable: enable != 0 && status & (abi::STATUS_QUEUE_READY | abi::STATUS_FAILED) == 0,
            reset: status & abi::STATUS_RESETTING != 0,
            in_flight: state.in_flight,
        });
        self.in_flight = state.in_flight;
        // The ring waits for the client's memory.
        self.regs().update_u32(regs::STATUS, |s| s & !abi::STATUS_QUEUE_READY);
        // A mailbox command the old daemon had not finished: the driver
        // retries it.
        let busy = self.regs().u32(regs::MBOX_STATUS) == abi::MBOX_BUSY;
        if busy {
            self.regs().set_u32(regs::MBOX_STATUS, abi::ST_RETRY);
            self.shared.notify(abi::INT_MAILBOX, regs::MBOX_VECTOR);
        }
        self.state_changed = true;
        self.persist();
        log::info!(
            "{}: session resumed ({} programs)",
            self.name,
            self.parked.as_ref().map_or(0, |p| p.programs.len())
        );
    }

    /// Saves the whole state into `dir` as a session store holds it
    /// (`store.rs`): the record, every registered program and the
    /// memories of every core in use (HBM only the chunks written, the
    /// rest a hole). Called between requests, so nothing is in flight.
    fn save_to(&mut self, dir: &std::path::Path) -> Result<(), SnapshotError> {
        let cores = self.config.map_or(0, |c| c.cores());
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        crate::store::prepare_files(dir, cores).map_err(io("creating the session files"))?;
        let store = crate::store::SessionStore::open(dir).map_err(io("opening the session record"))?;
        store.begin(self.session_id).map_err(io("clearing the folder"))?;
        for (h, p) in self.programs.iter().enumerate() {
            if let Some(p) = p {
                store.save_program(h, &p.encode()).map_err(io(format!("saving program {h}")))?;
            }
        }
        if let Some(spec) = self.config {
            for (slot, core) in self.cores.iter().enumerate() {
                let Some(core) = core else { continue };
                let mut to = store
                    .core(slot, spec.sram_per_core(), spec.hbm_per_core())
                    .map_err(io(format!("core {slot}'s memory files")))?;
                copy_core(core, &mut to).map_err(io(format!("saving core {slot}'s memories")))?;
            }
        }
        store.save(&self.save_state());
        Ok(())
    }

    /// Takes the state [`Self::save_to`] left in `dir`: registers and
    /// configuration as a resumed session does, the memories copied into
    /// host memory (the folder is not written, and not kept), the
    /// programs and ring parked for [`Control::Resume`].
    fn restore_from(&mut self, dir: &std::path::Path) -> Result<(), SnapshotError> {
        if !dir.join("session").is_file() {
            return Err(SnapshotError::Empty);
        }
        let store = crate::store::SessionStore::open(dir).map_err(io("opening the session record"))?;
        let state = store.load()?.ok_or(SnapshotError::Empty)?;
        self.session_id = state.session;
        self.restore(&store, state);
        if let Some(spec) = self.config {
            for slot in 0..self.cores.len() {
                let from = store
                    .core(slot, spec.sram_per_core(), spec.hbm_per_core())
                    .map_err(io(format!("core {slot}'s memory files")))?;
                // The core's own memories (host memory: no store is kept).
                let mut to = self.core_memory(slot, &spec);
                copy_core(&from, &mut to).map_err(io(format!("restoring core {slot}'s memories")))?;
                self.cores[slot] = Some(to);
            }
        }
        Ok(())
    }

    /// Takes a resumed session's programs and ring up again (the client's
    /// memory is mapped now).
    fn resume(&mut self) {
        let Some(p) = self.parked.take() else { return };
        if let Some(spec) = self.config {
            let limits = self.limits(&spec);
            for (handle, bytes) in p.programs {
                let ok = Program::decode(&bytes)
                    .ok()
                    .filter(|prog| npu_model::verify(prog, &limits).is_ok())
                    .filter(|_| handle < abi::MAX_REGISTERED);
                match ok {
                    Some(prog) => {
                        if handle >= self.programs.len() {
                            self.programs.resize_with(handle + 1, || None);
                        }
                        self.programs[handle] = Some(Arc::new(prog));
                        // Saved again where the state is kept (a stream's
                        // programs are in no store yet).
                        self.programs_changed.insert(handle);
                    }
                    None => {
                        log::warn!("{}: stored program {handle} no longer verifies; dropped", self.name);
                        self.programs_changed.insert(handle);
                    }
                }
            }
        }
        if p.reset {
            self.reset();
        } else if p.enable || p.ring {
            let (size, desc, avail, used) = {
                let r = self.regs();
                (
                    r.u32(regs::QUEUE_SIZE),
                    r.u64(regs::QUEUE_DESC),
                    r.u64(regs::QUEUE_AVAIL),
                    r.u64(regs::QUEUE_USED),
                )
            };
            self.enable(size, desc, avail, used);
            if p.ring {
                self.take_ring_up(p.in_flight);
            }
        }
        self.in_flight = None;
        self.state_changed = true;
        self.persist();
        // Whatever happened meanwhile, the driver looks again.
        self.shared.notify(abi::INT_QUEUE, regs::QUEUE_VECTOR);
    }

    /// A resumed ring carries on after the last request the guest's used
    /// ring shows done; the one that was running when the daemon went (it
    /// may have run in part) completes with `ST_RETRY`, unrun.
    fn take_ring_up(&mut self, in_flight: Option<u16>) {
        let Some(q) = self.queue.as_mut() else { return };
        let done = match q.used_idx(&self.mem, std::sync::atomic::Ordering::Acquire) {
            Ok(i) => i.0,
            Err(e) => {
                self.fail_ring(&format!("reading the used ring to resume: {e}"));
                return;
            }
        };
        q.set_next_avail(done);
        q.set_next_used(done);
        if in_flight != Some(done) {
            return;
        }
        let Some((head, descs)) = self.take_request() else { return };
        let len = self.complete_unrun(
            &descs,
            abi::ST_RETRY,
            "the board daemon restarted while this request ran; it may have run in part: submit it again",
        );
        self.push_used(head, len);
    }

    /// Handles every posted control message, in order, then saves what
    /// they changed (a save point).
    pub fn handle_controls(&mut self) {
        self.apply_controls();
        self.persist();
    }

    fn apply_controls(&mut self) {
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
                Some(Control::Memory(mem, watch)) => {
                    self.mem = mem;
                    self.mem_watch = watch;
                    self.opts.guest_files = Arc::from([]);
                }
                Some(Control::Session { store, resume }) => self.session(store, resume),
                Some(Control::Resume) => self.resume(),
                Some(Control::Snapshot(dir, at)) => {
                    self.precopy_abort();
                    at.done(self.save_to(&dir));
                    at.wait_released();
                }
                Some(Control::Restore(dir, at)) => at.done(self.restore_from(&dir)),
                Some(Control::SaveStream(at)) => {
                    let rest = self.precopy_rest();
                    let r = self.encode_stream(rest.as_deref()).map(|b| *lock(&at.bytes) = b);
                    at.done(r);
                    at.wait_released();
                }
                Some(Control::RestoreStream(bytes, at)) => at.done(self.restore_stream(&bytes)),
                Some(Control::PreCopy(max, at)) => {
                    let r = self.precopy_piece(max).map(|b| *lock(&at.bytes) = b);
                    at.done(r);
                }
                Some(Control::PreCopyAbort) => self.precopy_abort(),
                Some(Control::ApplyPiece(bytes, at)) => at.done(self.apply_piece(&bytes)),
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

    /// What the core shares with the vCPU thread (registers, interrupts,
    /// the control queue and its eventfds).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The core cannot serve (its thread has no events): failed, and
    /// stopped.
    pub(crate) fn fail_and_stop(&mut self, code: u32) {
        self.fail(code);
        self.stopped = true;
    }

    /// A `Stop` was handled: the core serves nothing more.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Control work is waiting.
    pub fn has_controls(&self) -> bool {
        !lock(&self.shared.controls).is_empty()
    }

    /// How long to poll the ring after requests (0: not at all).
    pub fn poll_window(&self) -> std::time::Duration {
        self.opts.poll
    }

    /// Whether the driver has posted requests not yet taken.
    pub fn ring_pending(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| {
            q.avail_idx(&self.mem, std::sync::atomic::Ordering::Acquire).is_ok_and(|i| i.0 != q.next_avail())
        })
    }

    /// Asks the driver not to ring the doorbell (polling); false when there
    /// is no ring or it cannot be written.
    pub fn suppress_doorbells(&mut self) -> bool {
        let Some(q) = self.queue.as_mut() else { return false };
        let ok = q.disable_notification(&self.mem).is_ok();
        self.note_used_ring();
        ok
    }

    /// Notes the used ring (which the device writes: entries, index, flags
    /// and the avail event) in the write log.
    pub(super) fn note_used_ring(&self) {
        if let Some(q) = self.queue.as_ref().filter(|_| self.shared.write_log.logging()) {
            let len = 6 + 8 * u64::from(q.size());
            self.shared.write_log.note(q.used_ring(), len);
        }
    }

    /// Asks the driver to ring the doorbell again; `Some(true)` when
    /// requests were posted meanwhile (serve them before sleeping), `None`
    /// when there is no ring or it cannot be written.
    pub fn allow_doorbells(&mut self) -> Option<bool> {
        let q = self.queue.as_mut()?;
        let r = q.enable_notification(&self.mem).ok();
        self.note_used_ring();
        r
    }
}

/// The device's failed state with `code` in `ERROR`: the ring is not
/// served until the driver resets the device.
pub(crate) fn mark_failed(r: &mut RegFile, code: u32) {
    r.set_u32(regs::ERROR, code);
    r.update_u32(regs::STATUS, |s| (s | abi::STATUS_FAILED) & !abi::STATUS_QUEUE_READY);
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
mod control_queue_tests {
    use super::*;

    /// A guest that writes `DEVICE_RESET` and `MBOX_CMD` a million times
    /// while the worker is busy grows no queue: resets coalesce, other
    /// guest controls stop at the bound, the host's still get through.
    #[test]
    fn guest_controls_are_bounded_and_host_controls_always_queue() {
        let shared =
            Shared::new(RegFile::new(), 8, Arc::new(crate::RecordingSink::default()), None).expect("shared");
        for _ in 0..1_000_000 {
            shared.post(Control::Reset);
        }
        assert_eq!(lock(&shared.controls).len(), 1, "resets in a row are one reset");
        for i in 0..1_000_000u64 {
            shared.post(Control::Mailbox { cmd: 1, args: [i; 6] });
        }
        assert_eq!(lock(&shared.controls).len(), MAX_QUEUED_CONTROLS);
        shared.post(Control::Stop);
        assert!(matches!(lock(&shared.controls).back(), Some(Control::Stop)), "the host's stop is queued");
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
        let mut w = DeviceCore::new(shared, mem, BoardConfig::default(), spec, DeviceOptions::default(), "t");
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
mod guest_range_tests {
    use super::*;

    /// A DMA that crosses from one guest memory region into the next one
    /// (a vIOMMU client maps a buffer page by page) passes the verifier;
    /// one across a hole does not.
    #[test]
    fn a_dma_across_regions_that_meet_is_verified() {
        let mut b = vnpu_abi::ProgramBuilder::new();
        let src = vnpu_abi::Addr::guest((1 << 20) - 32);
        let dst = vnpu_abi::Addr::sram(0);
        let copy =
            vnpu_abi::Instr::DmaCopy { src, dst, rows: 1, row_bytes: 64, src_stride: 0, dst_stride: 0 };
        b.push(vnpu_abi::Engine::DMA, copy);
        let program = b.finish();
        let spec = VnpuSpec::named("small").unwrap();
        for (second, ok) in [(1u64 << 20, true), ((1 << 20) + 4096, false)] {
            let mem = GuestMemoryMmap::<()>::from_ranges(&[
                (GuestAddress(0), 1 << 20),
                (GuestAddress(second), 1 << 20),
            ])
            .unwrap();
            let shared = Arc::new(
                Shared::new(RegFile::new(), 8, Arc::new(crate::RecordingSink::default()), None).unwrap(),
            );
            let w = DeviceCore::new(shared, mem, BoardConfig::default(), spec, DeviceOptions::default(), "t");
            let r = npu_model::verify(&program, &w.limits(&spec));
            assert_eq!(r.is_ok(), ok, "second region at {second:#x}: {r:?}");
        }
    }
}

#[cfg(test)]
mod resume_tests {
    use super::*;

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;

    fn worker(mem: &GuestMemoryMmap<()>) -> DeviceCore {
        let shared = Arc::new(
            Shared::new(RegFile::new(), 8, Arc::new(crate::RecordingSink::default()), None).expect("shared"),
        );
        let spec = VnpuSpec::named("small").expect("spec");
        DeviceCore::new(shared, mem.clone(), BoardConfig::default(), spec, DeviceOptions::default(), "t")
    }

    /// Posts a `NOP` with `tag` as ring entry `idx` (descriptors 2*idx and
    /// 2*idx + 1; status block at 0x5000 + 0x100 * idx).
    fn post_nop(mem: &GuestMemoryMmap<()>, idx: u16, tag: u64) {
        let header = abi::RequestHeader { opcode: abi::OP_NOP, tag, ..Default::default() };
        let (h, st) = (0x4000 + 0x100 * u64::from(idx), 0x5000 + 0x100 * u64::from(idx));
        mem.write_slice(&header.to_bytes(), GuestAddress(h)).unwrap();
        mem.write_slice(&[0xee; abi::STATUS_BYTES], GuestAddress(st)).unwrap();
        let d = DESC + 32 * u64::from(idx);
        let next = 2 * idx + 1;
        mem.write_obj(h, GuestAddress(d)).unwrap();
        mem.write_obj(abi::HEADER_BYTES as u32, GuestAddress(d + 8)).unwrap();
        mem.write_obj(1u16, GuestAddress(d + 12)).unwrap(); // NEXT
        mem.write_obj(next, GuestAddress(d + 14)).unwrap();
        mem.write_obj(st, GuestAddress(d + 16)).unwrap();
        mem.write_obj(abi::STATUS_BYTES as u32, GuestAddress(d + 24)).unwrap();
        mem.write_obj(2u16, GuestAddress(d + 28)).unwrap(); // WRITE
        mem.write_obj(0u16, GuestAddress(d + 30)).unwrap();
        mem.write_obj(2 * idx, GuestAddress(AVAIL + 4 + 2 * u64::from(idx))).unwrap();
        mem.write_obj(idx + 1, GuestAddress(AVAIL + 2)).unwrap();
    }

    /// Sets the ring up as a driver would (8 entries, vector 3) and
    /// serves request 0, a `NOP` tagged 100.
    fn ring_up(core: &mut DeviceCore, mem: &GuestMemoryMmap<()>) {
        {
            let mut r = core.regs();
            r.set_u32(regs::QUEUE_SIZE, 8);
            r.set_u64(regs::QUEUE_DESC, DESC);
            r.set_u64(regs::QUEUE_AVAIL, AVAIL);
            r.set_u64(regs::QUEUE_USED, USED);
            r.set_u32(regs::QUEUE_ENABLE, 1);
            r.set_u32(regs::QUEUE_VECTOR, 3);
        }
        core.enable(8, DESC, AVAIL, USED);
        post_nop(mem, 0, 100);
        core.drain_ring();
    }

    fn status(mem: &GuestMemoryMmap<()>, idx: u16) -> abi::StatusBlock {
        let mut b = [0u8; abi::STATUS_BYTES];
        mem.read_slice(&mut b, GuestAddress(0x5000 + 0x100 * u64::from(idx))).unwrap();
        abi::StatusBlock::from_bytes(&b)
    }

    /// With the write log on, a served request logs exactly the pages the
    /// device wrote: its status block and the used ring, not the request
    /// header, the descriptors or the available ring the driver wrote.
    #[test]
    fn a_served_request_logs_the_guest_pages_the_device_wrote() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut core = worker(&mem);
        let log = Arc::clone(&core.shared.write_log);
        ring_up(&mut core, &mem);
        assert!(log.take().is_empty(), "nothing is logged while off");
        log.start();
        post_nop(&mem, 1, 101);
        core.drain_ring();
        assert_eq!(status(&mem, 1).status, abi::ST_OK);
        let pages: Vec<u64> = log
            .take()
            .iter()
            .enumerate()
            .flat_map(|(w, &x)| (0..64).filter(move |b| x & (1 << b) != 0).map(move |b| w as u64 * 64 + b))
            .collect();
        assert_eq!(pages, vec![USED / 4096, 0x5000 / 4096], "the used ring and the status block");
        log.stop();
    }

    /// A daemon that died while request 1 ran (request 0 done): the
    /// restarted daemon's worker, resuming the session, completes request
    /// 1 with `ST_RETRY` without running it (tag kept, one more used
    /// entry), takes up the ring after it, and serves the next request as
    /// usual; the registers (ring addresses, vectors) are the old ones.
    #[test]
    fn the_request_running_when_the_daemon_went_completes_with_retry() {
        let dir = std::env::temp_dir().join(format!("vnpu-resume-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let store = Arc::new(crate::store::SessionStore::open(&dir).unwrap());
        store.begin(42).unwrap();
        let mut old = worker(&mem);
        old.session(Arc::clone(&store), false);
        ring_up(&mut old, &mem);
        assert_eq!(status(&mem, 0).status, abi::ST_OK);
        // Request 1 taken (its save point), then the daemon dies.
        post_nop(&mem, 1, 101);
        old.begin_request(1);
        drop(old);

        let reopened = Arc::new(crate::store::SessionStore::open(&dir).unwrap());
        assert_eq!(reopened.session(), Some(42));
        let mut new = worker(&mem);
        new.session(reopened, true);
        assert_eq!(new.regs().u32(regs::QUEUE_VECTOR), 3, "the guest's registers are back");
        new.resume();
        let st = status(&mem, 1);
        assert_eq!((st.status, st.tag), (abi::ST_RETRY, 101), "the running request gets RETRY");
        let used: u16 = mem.read_obj(GuestAddress(USED + 2)).unwrap();
        assert_eq!(used, 2);
        post_nop(&mem, 2, 102);
        new.drain_ring();
        assert_eq!((status(&mem, 2).status, status(&mem, 2).tag), (abi::ST_OK, 102));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A core's whole state through a stream into a fresh core: the
    /// registers, the programs (registered at resume), SRAM and written
    /// HBM, and the ring, which carries on; a cut or changed stream is
    /// refused, never a panic, and changes nothing.
    #[test]
    fn a_core_goes_through_a_stream_whole_and_a_spoiled_stream_changes_nothing() {
        use npu_model::memory::Memory;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut old = worker(&mem);
        ring_up(&mut old, &mem);
        let spec = old.config.unwrap();
        let mut core = old.core_memory(0, &spec);
        core.sram.write(123, &[1, 2, 3]).unwrap();
        core.hbm.write((5 << 20) + 7, &[9; 100]).unwrap();
        old.cores[0] = Some(core);
        let mut b = vnpu_abi::ProgramBuilder::new();
        b.push(
            vnpu_abi::Engine::DMA,
            vnpu_abi::Instr::copy(vnpu_abi::Addr::sram(0), vnpu_abi::Addr::hbm(0), 64),
        );
        let prog = b.finish();
        old.programs = vec![None, Some(Arc::new(prog.clone()))];
        let bytes = old.encode_stream(None).unwrap();

        let mut new = worker(&mem);
        let before = new.regs().snapshot();
        // Every cut and a changed byte at many places: refused, nothing taken.
        for cut in (0..bytes.len()).step_by(9973).chain([bytes.len() - 1]) {
            assert!(new.restore_stream(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for at in (0..bytes.len()).step_by(40_009) {
            let mut b = bytes.clone();
            b[at] ^= 0x40;
            assert!(new.restore_stream(&b).is_err(), "byte {at} changed");
        }
        assert!(new.restore_stream(&[bytes.clone(), vec![0]].concat()).is_err(), "a byte past the end");
        assert_eq!(new.regs().snapshot(), before, "nothing taken from a spoiled stream");
        new.restore_stream(&bytes).unwrap();
        assert_eq!(new.regs().u32(regs::QUEUE_VECTOR), 3);
        let c = new.cores[0].as_ref().unwrap();
        let mut got = [0u8; 3];
        c.sram.read(123, &mut got).unwrap();
        assert_eq!(got, [1, 2, 3]);
        let mut h = [0u8; 100];
        c.hbm.read((5 << 20) + 7, &mut h).unwrap();
        assert_eq!(h, [9; 100]);
        new.resume();
        assert_eq!(new.programs.get(1).and_then(Option::as_ref).map(|p| p.encode()), Some(prog.encode()));
        post_nop(&mem, 1, 101);
        new.drain_ring();
        assert_eq!((status(&mem, 1).status, status(&mem, 1).tag), (abi::ST_OK, 101), "the ring carries on");
    }

    /// A pre-copy of 40 written HBM chunks in pieces of 8 MiB, with chunks
    /// written again and new ones written between the pieces and between
    /// the passes (as requests would): the stop's stream is incremental
    /// and carries only those, and the receiving core ends with every HBM
    /// byte of the sending one. A spoiled piece is refused and changes
    /// nothing; an incremental stream with no pieces before it is refused;
    /// a reconfiguration meanwhile makes the stop's stream whole.
    #[test]
    fn a_pre_copied_core_arrives_whole_from_pieces_and_an_incremental_stream() {
        use npu_model::memory::{Memory, HBM_CHUNK};
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut old = worker(&mem);
        ring_up(&mut old, &mem);
        let spec = old.config.unwrap();
        let mut core = old.core_memory(0, &spec);
        for c in 0..40u64 {
            core.hbm.write(c * 3 * HBM_CHUNK + c, &[c as u8 + 1; 4096]).unwrap();
        }
        old.cores[0] = Some(core);
        let write = |core: &mut DeviceCore, at: u64, v: u8| {
            core.cores[0].as_mut().unwrap().hbm.write(at, &[v; 300]).unwrap();
        };
        let mut new = worker(&mem);
        let mut pieces = 0;
        let mut passes = 0;
        loop {
            let p = old.precopy(8 << 20).unwrap();
            if p.is_empty() {
                break;
            }
            // Spoiled copies first: refused, nothing taken.
            let mut bad = p.clone();
            let n = bad.len();
            bad[n / 2] ^= 1;
            assert!(new.take_piece(&bad).is_err());
            assert!(new.take_piece(&p[..n - 1]).is_err());
            new.take_piece(&p).unwrap();
            pieces += 1;
            // Written again meanwhile: one chunk already sent, one new.
            write(&mut old, 3 * HBM_CHUNK * (pieces % 40), 0xa0 + pieces as u8);
            if piece_flags(&p).unwrap() & LAST_OF_PASS != 0 {
                passes += 1;
                if passes == 3 {
                    break;
                }
            }
            assert!(pieces < 100, "the pre-copy does not end");
        }
        assert!(pieces >= 5, "40 MiB in pieces of 8 MiB: {pieces}");
        write(&mut old, 200 * HBM_CHUNK + 5, 0xee);
        let fin = old.stop_stream().unwrap();
        assert!(fin.len() < 8 << 20, "the stop's stream carries the dirty chunks only: {} bytes", fin.len());
        assert!(worker(&mem).restore_stream(&fin).is_err(), "incremental with no pieces before it");
        new.restore_stream(&fin).unwrap();
        let (a, b) = (&old.cores[0].as_ref().unwrap().hbm, &new.cores[0].as_ref().unwrap().hbm);
        assert_eq!(a.written_chunks(), b.written_chunks());
        let (mut x, mut y) = (vec![0u8; HBM_CHUNK as usize], vec![0u8; HBM_CHUNK as usize]);
        for c in a.written_chunks() {
            a.read(c * HBM_CHUNK, &mut x).unwrap();
            b.read(c * HBM_CHUNK, &mut y).unwrap();
            assert!(x == y, "chunk {c} differs");
        }

        // A release and a configure meanwhile: the core is a new one, and
        // the stop's stream is whole.
        let mut again = worker(&mem);
        ring_up(&mut again, &mem);
        let mut core = again.core_memory(0, &spec);
        core.hbm.write(0, &[1; 10]).unwrap();
        again.cores[0] = Some(core);
        assert!(!again.precopy(8 << 20).unwrap().is_empty());
        let mut core = again.core_memory(0, &spec);
        core.hbm.write(HBM_CHUNK, &[2; 10]).unwrap();
        again.cores[0] = Some(core);
        assert!(again.precopy(8 << 20).unwrap().is_empty(), "a pre-copy that no longer holds sends nothing");
        let whole = again.stop_stream().unwrap();
        assert!(worker(&mem).restore_stream(&whole).is_ok(), "a whole stream needs no pieces");
    }
}
