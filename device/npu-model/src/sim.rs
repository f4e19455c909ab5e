//! Event-driven execution of programs on one core.
//!
//! Each program (one per tenant placed on the core) has one instruction
//! stream per engine; all streams of all tenants advance concurrently in
//! simulated time. An instruction occupies its engine for the cycles the
//! timing model gives; `signal`/`wait` order streams of one tenant. DMA
//! transfers in flight share, max-min fairly (progressive filling), the
//! resources they use: the core's DMA engines (`core.dma_engines` times
//! one engine's rate, every transfer, at most one engine's rate each), the
//! HBM bandwidth (transfers that touch HBM; per tenant under
//! `hbm.partition = "equal"`) and the host link (transfers that touch guest
//! memory). That is where co-located tenants slow each other. A
//! [`BoardSim`] advances every core of a board together, so the transfers
//! of all cores share each chip's HBM and the board's host link; a
//! [`CoreSim`] stepped alone is a core alone on its board.
//!
//! Functional execution (when the tenant has memory attached) happens when
//! an instruction issues; a program whose streams are ordered by semaphores
//! therefore computes the same numbers whatever the timing.
//!
//! Simulated time is in core cycles (`f64`, so fractional DMA rates stay
//! exact enough); it has nothing to do with how long the host takes.

use thiserror::Error;
use vnpu_abi::{Engine, EngineKind, Instr, Program};

use crate::config::{BoardConfig, HbmPartition};
use crate::kernels::{execute, CoreMemory, KernelError};
use crate::timing::{cost, Occupancy};

const EPS: f64 = 1e-9;

/// Why a tenant's program stopped before the end.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ExecError {
    #[error("stream {stream} ({engine}) instruction {index} ({mnemonic}): {source}")]
    Kernel { stream: usize, engine: Engine, index: usize, mnemonic: &'static str, source: KernelError },
    #[error("deadlock: stream {stream} ({engine}) waits forever on semaphore {sem} at instruction {index}")]
    Deadlock { stream: usize, engine: Engine, index: usize, sem: u8 },
    #[error("cycle budget of {budget} cycles exhausted")]
    Budget { budget: u64 },
    /// The host work the model would spend on the request passed its
    /// budget (see [`crate::timing::host_work`]); checked before the
    /// instruction that would pass it runs.
    #[error("host-work budget of {budget} units exhausted (the request asks the simulator for more work than a shared core allows one request)")]
    HostWork { budget: u64 },
}

/// Counters of one engine of one tenant.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineStats {
    pub engine: Engine,
    pub instructions: u64,
    /// Cycles the engine did work (a transfer counts its uncontended time).
    pub active_cycles: f64,
    /// Cycles lost waiting on semaphores or to HBM contention.
    pub stall_cycles: f64,
    pub flops: u64,
    pub bytes: u64,
    /// Bytes of the transfers that touch HBM (a provider's HBM counter).
    pub hbm_bytes: u64,
    /// Bytes of the transfers that touch guest memory (over the host link).
    pub host_bytes: u64,
}

impl EngineStats {
    /// The counters of `engine` before it has done anything.
    pub fn idle(engine: Engine) -> Self {
        Self {
            engine,
            instructions: 0,
            active_cycles: 0.0,
            stall_cycles: 0.0,
            flops: 0,
            bytes: 0,
            hbm_bytes: 0,
            host_bytes: 0,
        }
    }
}

/// Sums over engines.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    pub sa_active_cycles: f64,
    pub vu_active_cycles: f64,
    pub dma_active_cycles: f64,
    pub stall_cycles: f64,
    pub flops: u64,
    pub bytes: u64,
    pub hbm_bytes: u64,
    pub host_bytes: u64,
    pub instructions: u64,
}

impl Totals {
    /// Adds `other`'s counts to these (sums over several requests).
    pub fn merge(&mut self, other: &Totals) {
        self.sa_active_cycles += other.sa_active_cycles;
        self.vu_active_cycles += other.vu_active_cycles;
        self.dma_active_cycles += other.dma_active_cycles;
        self.stall_cycles += other.stall_cycles;
        self.flops += other.flops;
        self.bytes += other.bytes;
        self.hbm_bytes += other.hbm_bytes;
        self.host_bytes += other.host_bytes;
        self.instructions += other.instructions;
    }

    fn add(&mut self, e: &EngineStats) {
        match e.engine.kind {
            EngineKind::Sa => self.sa_active_cycles += e.active_cycles,
            EngineKind::Vu => self.vu_active_cycles += e.active_cycles,
            EngineKind::Dma => self.dma_active_cycles += e.active_cycles,
        }
        self.stall_cycles += e.stall_cycles;
        self.flops += e.flops;
        self.bytes += e.bytes;
        self.hbm_bytes += e.hbm_bytes;
        self.host_bytes += e.host_bytes;
        self.instructions += e.instructions;
    }
}

/// What one tenant's program did.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantReport {
    /// Simulated cycles from the core's start until the tenant's last
    /// stream finished.
    pub cycles: f64,
    /// When the tenant was placed on the core ([`CoreSim::add`]; 0 for
    /// [`run_core`]); its first instruction issues after the delay it was
    /// added with.
    pub started: f64,
    pub engines: Vec<EngineStats>,
    /// Engine-cycles of the SA and VU instructions of a spread program
    /// that started while the tenant already had as many of its
    /// instructions of that kind running as it is guaranteed engines: its
    /// work on borrowed engines ([`CoreSim::set_engines`]; 0 for a program
    /// that is not spread).
    pub borrowed_cycles: f64,
}

impl TenantReport {
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        self.engines.iter().for_each(|e| t.add(e));
        t
    }
}

/// What the core did.
#[derive(Debug)]
pub struct CoreReport {
    /// Simulated cycles until the last tenant finished.
    pub cycles: f64,
    pub tenants: Vec<Result<TenantReport, ExecError>>,
}

impl CoreReport {
    /// Counters summed over the tenants that completed.
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for r in self.tenants.iter().flatten() {
            r.engines.iter().for_each(|e| t.add(e));
        }
        t
    }
}

/// A program placed on the core.
#[derive(Debug)]
pub struct Tenant<'p, 'm> {
    pub program: &'p Program,
    /// Memories for functional execution; `None` runs timing only.
    pub memory: Option<CoreMemory<'m>>,
    /// Stop the program (with [`ExecError::Budget`]) after this many cycles.
    pub max_cycles: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
enum State {
    Ready,
    Busy { until: f64 },
    Transfer { start: f64, remaining: f64, cap: f64, hbm: bool, host: bool, issued: f64, ideal: f64 },
    Waiting { sem: u8, since: f64 },
    Done,
}

#[derive(Debug)]
struct Run {
    tenant: usize,
    stream: usize,
    pc: usize,
    state: State,
    finished_at: f64,
    /// When this stream's last transfer ended (for DMA pipelining).
    last_transfer_end: f64,
    /// It runs an instruction of a spread program on one of the tenant's
    /// engines ([`Slot::holding`]) until its `Busy` ends.
    holds: bool,
    stats: EngineStats,
    rate: f64,
    /// `Some(id)`: not a stream but one transfer in flight of stream
    /// `stream` (`dma.in_flight > 1`), which it leaves when done.
    transfer_of: Option<u64>,
    /// A stream's transfers in flight as such runs: their ids and the
    /// bytes each touches.
    in_flight: Vec<(u64, [Span; 3])>,
}

/// Bytes `[start, end)` of one memory space (0: none).
type Span = (u8, u64, u64);

/// The bytes a transfer touches (bounding ranges per operand), to hold a
/// later transfer of the same stream back while an earlier one that
/// touches any of them is in flight.
fn spans(instr: &Instr) -> [Span; 3] {
    let sp = |a: vnpu_abi::Addr, len: u64| (a.space as u8 + 1, a.offset, a.offset.saturating_add(len));
    let strided = |rows: u32, row_bytes: u32, stride: u64| {
        u64::from(rows.saturating_sub(1)).saturating_mul(stride).saturating_add(u64::from(row_bytes))
    };
    match *instr {
        Instr::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride } => [
            sp(src, strided(rows, row_bytes, src_stride)),
            sp(dst, strided(rows, row_bytes, dst_stride)),
            (0, 0, 0),
        ],
        Instr::DmaGather { table, indices, dst, count, row_bytes, table_rows } => [
            sp(table, u64::from(table_rows).saturating_mul(u64::from(row_bytes))),
            sp(vnpu_abi::Addr::sram(indices), u64::from(count).saturating_mul(4)),
            sp(vnpu_abi::Addr::sram(dst), u64::from(count).saturating_mul(u64::from(row_bytes))),
        ],
        _ => [(0, 0, 0); 3],
    }
}

/// Whether two transfers touch a common byte (conservatively: any overlap
/// of their bounding ranges in one space).
fn spans_meet(a: &[Span; 3], b: &[Span; 3]) -> bool {
    a.iter().any(|x| x.0 != 0 && b.iter().any(|y| y.0 == x.0 && x.1 < y.2 && y.1 < x.2))
}

/// A flow of [`max_min_rates`]: its own cap (a transfer's rate alone, at
/// most one engine's: `timing` caps every transfer by it) and the
/// resources it uses.
#[derive(Clone, Debug)]
struct Flow {
    cap: f64,
    uses: [Option<usize>; 3],
}

/// Max-min fair rates of `flows` over resources of `capacity` (progressive
/// filling: every unfrozen flow's rate grows at the same pace until it
/// reaches its cap or one of its resources is full; then it is frozen).
/// The rates go into `rate`, with `left` and `active` as scratch (every
/// step with transfers computes rates: no allocation once the buffers
/// have grown).
fn max_min_rates(
    flows: &[Flow],
    capacity: &[f64],
    rate: &mut Vec<f64>,
    left: &mut Vec<f64>,
    active: &mut Vec<bool>,
) {
    rate.clear();
    rate.resize(flows.len(), 0.0);
    left.clear();
    left.extend_from_slice(capacity);
    active.clear();
    active.extend(flows.iter().map(|f| f.cap > EPS));
    let uses = |f: &Flow, r: usize| f.uses.contains(&Some(r));
    while active.iter().any(|a| *a) {
        let mut step = f64::INFINITY;
        for (r, l) in left.iter().enumerate() {
            let n = flows.iter().zip(active.iter()).filter(|(f, a)| **a && uses(f, r)).count();
            if n > 0 {
                step = step.min(l.max(0.0) / n as f64);
            }
        }
        for ((f, a), x) in flows.iter().zip(active.iter()).zip(rate.iter()) {
            if *a {
                step = step.min(f.cap - x);
            }
        }
        let step = step.max(0.0);
        for (i, f) in flows.iter().enumerate() {
            if active[i] {
                rate[i] += step;
                for r in f.uses.iter().flatten() {
                    left[*r] -= step;
                }
            }
        }
        let mut frozen = false;
        for (i, f) in flows.iter().enumerate() {
            let full = f.uses.iter().flatten().any(|r| left[*r] <= EPS * capacity[*r].max(1.0));
            if active[i] && (full || f.cap - rate[i] <= EPS * f.cap.max(1.0)) {
                active[i] = false;
                frozen = true;
            }
        }
        if !frozen {
            // Cannot happen (the step froze something); never loop forever.
            break;
        }
    }
}

/// A tenant of a [`CoreSim`]: its program, memories and budget.
pub trait SimTenant {
    fn program(&self) -> &Program;
    /// Memories for functional execution; `None` runs timing only.
    fn memory(&mut self) -> Option<CoreMemory<'_>>;
    /// Cycles the tenant may run, counted from when its streams start.
    fn max_cycles(&self) -> Option<u64>;
    /// Host-work units ([`crate::timing::host_work`]) the functional model
    /// may spend on the tenant (none: unbounded).
    fn max_host_work(&self) -> Option<u64> {
        None
    }
    /// Called when instruction `index` of stream `stream` takes effect:
    /// a compute or DMA instruction just before it executes, a `signal`
    /// when it increments, a `wait` when it consumes its semaphore, a
    /// `halt` when it stops its stream. The calls give the order in which
    /// the model applied the program (a differential check replays it on
    /// the reference interpreter); the default does nothing.
    fn took_effect(&mut self, _stream: usize, _index: usize) {}
}

impl SimTenant for Tenant<'_, '_> {
    fn program(&self) -> &Program {
        self.program
    }
    fn memory(&mut self) -> Option<CoreMemory<'_>> {
        self.memory.as_mut().map(|m| CoreMemory {
            sram: &mut *m.sram,
            hbm: &mut *m.hbm,
            guest: &mut *m.guest,
        })
    }
    fn max_cycles(&self) -> Option<u64> {
        self.max_cycles
    }
}

impl SimTenant for &mut Tenant<'_, '_> {
    fn program(&self) -> &Program {
        (**self).program()
    }
    fn memory(&mut self) -> Option<CoreMemory<'_>> {
        (**self).memory()
    }
    fn max_cycles(&self) -> Option<u64> {
        (**self).max_cycles()
    }
}

struct Slot<J> {
    job: J,
    sems: [u32; vnpu_abi::isa::NUM_SEMAPHORES as usize],
    error: Option<ExecError>,
    /// When it was placed on the core.
    started: f64,
    /// Simulated time at which its budget runs out (infinity: none).
    budget_end: f64,
    /// When it was suspended (it issues nothing until resumed).
    suspended_at: Option<f64>,
    /// Host-work units spent on it so far (counted when it has a budget).
    host_work: u64,
    /// A spread program's engines ([`CoreSim::set_engines`]): how many of
    /// its SA and VU instructions may run at once (`None`: not spread, one
    /// engine per stream).
    width: Option<[u32; 2]>,
    /// Of those, its own (what it has beyond them is borrowed).
    guarantee: [u32; 2],
    /// Its SA and VU instructions running now (spread programs only).
    holding: [u32; 2],
    /// Engine-cycles of instructions started beyond its guarantee.
    borrowed: f64,
}

/// Index of `kind` in a slot's per-kind counts (SA 0, VU 1), if it is a
/// compute engine.
fn compute_kind(kind: vnpu_abi::EngineKind) -> Option<usize> {
    match kind {
        vnpu_abi::EngineKind::Sa => Some(0),
        vnpu_abi::EngineKind::Vu => Some(1),
        vnpu_abi::EngineKind::Dma => None,
    }
}

/// What [`CoreSim::step`] hands back for a tenant that finished or failed:
/// its id, the tenant itself and its report.
pub type Finished<J> = (usize, J, Result<TenantReport, ExecError>);

/// A core that tenants join and leave while simulated time runs: the
/// event-driven simulation behind [`run_core`], kept across calls so a
/// tenant can be placed on the core while others are half-way through
/// their programs (a shared core serving requests as they come).
pub struct CoreSim<'c, J> {
    cfg: &'c BoardConfig,
    now: f64,
    slots: Vec<Option<Slot<J>>>,
    runs: Vec<Run>,
    /// The id of the next transfer run (`Run::transfer_of`).
    next_transfer: u64,
    /// Shares of HBM bandwidth under `hbm.partition = "equal"`.
    shares: usize,
    /// What its tenants contend for (read from a board's first core).
    contention: Contention,
    /// Longest compute instruction (cycles) a spread tenant may start on
    /// an engine beyond its guarantee ([`Self::set_lend_limit`]).
    lend_limit: f64,
}

impl<J> std::fmt::Debug for CoreSim<'_, J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreSim")
            .field("now", &self.now)
            .field("runs", &self.runs.len())
            .finish_non_exhaustive()
    }
}

impl<'c, J: SimTenant> CoreSim<'c, J> {
    /// An idle core at time 0. Under `hbm.partition = "equal"` each tenant
    /// owns `1 / shares` of the HBM bandwidth, used or not.
    pub fn new(cfg: &'c BoardConfig, shares: usize) -> Self {
        Self {
            cfg,
            now: 0.0,
            lend_limit: f64::INFINITY,
            slots: Vec::new(),
            runs: Vec::new(),
            next_transfer: 0,
            shares: shares.max(1),
            contention: Contention::default(),
        }
    }

    /// Which resources its tenants contend for (all, as on the hardware,
    /// unless a what-if says otherwise).
    pub fn set_contention(&mut self, contention: Contention) {
        self.contention = contention;
    }

    /// Simulated cycles since the core started.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Sets the number of HBM shares under `hbm.partition = "equal"`.
    pub fn set_shares(&mut self, shares: usize) {
        self.shares = shares.max(1);
    }

    /// No tenant is on the core.
    pub fn is_idle(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    /// Places `job` on the core now; its streams issue from `now + delay`.
    /// Returns its id (reused once it has finished).
    pub fn add(&mut self, job: J, delay: f64) -> usize {
        let delay = delay.max(0.0);
        let budget_end = job.max_cycles().map_or(f64::INFINITY, |b| self.now + delay + b as f64);
        let streams: Vec<Engine> = job.program().streams.iter().map(|s| s.engine).collect();
        // A spread program runs on every engine of the core until told
        // otherwise (a lone tenant has them all); its logical streams
        // bound that anyway.
        let all = [self.cfg.core.sa_count.max(1), self.cfg.core.vu_count.max(1)];
        let width = job.program().spread.then_some(all);
        let slot = Slot {
            job,
            sems: [0; vnpu_abi::isa::NUM_SEMAPHORES as usize],
            error: None,
            started: self.now,
            budget_end,
            suspended_at: None,
            host_work: 0,
            width,
            guarantee: all,
            holding: [0; 2],
            borrowed: 0.0,
        };
        let id = match self.slots.iter().position(Option::is_none) {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        for (s, engine) in streams.into_iter().enumerate() {
            self.runs.push(Run {
                tenant: id,
                stream: s,
                pc: 0,
                state: if delay > 0.0 { State::Busy { until: self.now + delay } } else { State::Ready },
                finished_at: self.now,
                last_transfer_end: f64::NEG_INFINITY,
                holds: false,
                stats: EngineStats::idle(engine),
                rate: 0.0,
                transfer_of: None,
                in_flight: Vec::new(),
            });
        }
        id
    }

    /// Stops tenant `id` from issuing instructions (preemption at
    /// instruction boundaries: what it has in flight finishes, its memories
    /// stay as they are); its budget stops counting. False if there is no
    /// such tenant or it is suspended already.
    pub fn suspend(&mut self, id: usize) -> bool {
        match self.slots.get_mut(id).and_then(Option::as_mut) {
            Some(ts) if ts.suspended_at.is_none() => {
                ts.suspended_at = Some(self.now);
                true
            }
            _ => false,
        }
    }

    /// Lets suspended tenant `id` go on, issuing again from `now + delay`
    /// (a context switch back onto its engines). False if it is not
    /// suspended.
    pub fn resume(&mut self, id: usize, delay: f64) -> bool {
        let now = self.now;
        let delay = delay.max(0.0);
        let Some(ts) = self.slots.get_mut(id).and_then(Option::as_mut) else { return false };
        let Some(at) = ts.suspended_at.take() else { return false };
        ts.budget_end += now - at + delay;
        for r in self.runs.iter_mut().filter(|r| r.tenant == id) {
            if matches!(r.state, State::Ready) && delay > 0.0 {
                r.state = State::Busy { until: now + delay };
            }
        }
        true
    }

    /// Bounds how long an engine lent to a spread tenant stays busy: from
    /// now on such a tenant starts a compute instruction on an engine
    /// beyond its guarantee only if the instruction takes at most `cycles`
    /// (a longer one waits for one of its own engines). An owner taking
    /// its engines back then waits at most `cycles` for a borrower's
    /// instruction to end. Infinity (the default): no bound.
    pub fn set_lend_limit(&mut self, cycles: f64) {
        self.lend_limit = if cycles.is_nan() { f64::INFINITY } else { cycles.max(0.0) };
    }

    /// Sets the engines spread tenant `id` runs on from now: `guarantee`
    /// (SAs, VUs) of its own and `width` in all (at least one of each and
    /// at least the guarantee). Its instructions running on engines beyond
    /// the new width finish (an instruction is the unit of preemption);
    /// returns the cycles until they have, when the engines taken back are
    /// free (0 when none is taken back, or `id` is not a spread tenant).
    pub fn set_engines(&mut self, id: usize, guarantee: [u32; 2], width: [u32; 2]) -> f64 {
        let now = self.now;
        let Some(ts) = self.slots.get_mut(id).and_then(Option::as_mut) else { return 0.0 };
        if ts.width.is_none() {
            return 0.0;
        }
        let guarantee = guarantee.map(|g| g.max(1));
        let width = [width[0].max(guarantee[0]), width[1].max(guarantee[1])];
        ts.width = Some(width);
        ts.guarantee = guarantee;
        let holding = ts.holding;
        let mut drain: f64 = 0.0;
        for k in 0..2 {
            let excess = holding[k].saturating_sub(width[k]) as usize;
            if excess == 0 {
                continue;
            }
            let mut left: Vec<f64> = self
                .runs
                .iter()
                .filter(|r| r.tenant == id && r.holds && compute_kind(r.stats.engine.kind) == Some(k))
                .filter_map(|r| match r.state {
                    State::Busy { until } => Some((until - now).max(0.0)),
                    _ => None,
                })
                .collect();
            left.sort_by(f64::total_cmp);
            if let Some(t) = left.get(excess - 1) {
                drain = drain.max(*t);
            }
        }
        drain
    }

    /// The tenants on the core.
    pub fn jobs(&self) -> impl Iterator<Item = &J> {
        self.slots.iter().flatten().map(|s| &s.job)
    }

    /// Tenant `id`, if it is on the core.
    pub fn job(&self, id: usize) -> Option<&J> {
        self.slots.get(id).and_then(Option::as_ref).map(|s| &s.job)
    }

    /// The engines spread tenant `id` runs on now (SAs, VUs), if it is one.
    pub fn engines(&self, id: usize) -> Option<[u32; 2]> {
        self.slots.get(id).and_then(Option::as_ref).and_then(|s| s.width)
    }

    /// Takes tenant `id` off the core now, unfinished (PREMA's KILL: its
    /// work is lost and it starts again from scratch later). Returns its
    /// job and the counters of what it did until now (engine time spent on
    /// the lost work is still time the engines were busy). What it had in
    /// flight leaves with it: a caller that models the hardware finishing
    /// those transfers first delays the next tenant by [`Self::drain_cycles`]
    /// taken before the kill. `None` if there is no such tenant.
    pub fn kill(&mut self, id: usize) -> Option<(J, TenantReport)> {
        let slot = self.slots.get_mut(id)?.take()?;
        let mut engines = Vec::new();
        self.runs.retain(|r| {
            if r.tenant == id {
                // A transfer in flight counts nothing until it lands.
                if r.transfer_of.is_none() {
                    engines.push(r.stats.clone());
                }
                false
            } else {
                true
            }
        });
        let borrowed_cycles = slot.borrowed;
        Some((slot.job, TenantReport { cycles: self.now, started: slot.started, engines, borrowed_cycles }))
    }

    /// Cycles until what tenant `id` has in flight is done (at its
    /// uncontended rate): when its engines are free after a suspension.
    pub fn drain_cycles(&self, id: usize) -> f64 {
        let now = self.now;
        self.runs
            .iter()
            .filter(|r| r.tenant == id)
            .map(|r| match r.state {
                State::Busy { until } => until - now,
                State::Transfer { start, remaining, cap, .. } => {
                    start.max(now) - now + remaining / cap.max(EPS)
                }
                _ => 0.0,
            })
            .fold(0.0, f64::max)
    }

    /// Advances simulated time until at least one tenant has finished or
    /// failed and returns those; empty when no tenant is on the core.
    pub fn step(&mut self) -> Vec<Finished<J>> {
        self.step_until(f64::INFINITY)
    }

    /// As [`CoreSim::step`], but stops at simulated time `limit` if no
    /// tenant finishes before (an idle core just moves its clock there).
    /// The core is alone on its board: its transfers have the chip's HBM
    /// and the board's host link to themselves.
    pub fn step_until(&mut self, limit: f64) -> Vec<Finished<J>> {
        step_cores(std::slice::from_mut(self), &[0], limit).into_iter().map(|(_, f)| f).collect()
    }

    /// Issues everything that can issue now; returns the tenants that
    /// finished or failed (they leave the core).
    fn issue(&mut self) -> Vec<Finished<J>> {
        let cfg = self.cfg;
        let now = self.now;
        let depth = cfg.dma.in_flight.max(1) as usize;
        let lend_limit = self.lend_limit;
        let Self { slots, runs, next_transfer, .. } = self;
        // Issue everything that can issue at `now`, until nothing changes.
        loop {
            let mut progressed = false;
            let mut spawned = Vec::new();
            for r in runs.iter_mut() {
                let Some(ts) = slots.get_mut(r.tenant).and_then(Option::as_mut) else {
                    r.state = State::Done;
                    continue;
                };
                if ts.error.is_some() {
                    r.state = State::Done;
                    continue;
                }
                if ts.suspended_at.is_some() {
                    continue;
                }
                match r.state {
                    State::Waiting { sem, since } => {
                        if ts.sems[sem as usize] > 0 {
                            ts.sems[sem as usize] -= 1;
                            ts.job.took_effect(r.stream, r.pc);
                            r.stats.stall_cycles += now - since;
                            r.pc += 1;
                            r.state = State::Ready;
                            progressed = true;
                        }
                    }
                    State::Ready => {
                        let instr =
                            ts.job.program().streams.get(r.stream).and_then(|s| s.code.get(r.pc)).copied();
                        // With transfers in flight, a signal, a halt or the
                        // stream's end waits for all of them (what it
                        // announces must have landed), and a transfer waits
                        // while `dma.in_flight` are in flight or one that
                        // touches its bytes is.
                        if !r.in_flight.is_empty() {
                            let blocked = match instr {
                                None | Some(Instr::Halt) | Some(Instr::Signal { .. }) => true,
                                Some(Instr::Wait { .. }) => false,
                                Some(i) => {
                                    let mine = spans(&i);
                                    r.in_flight.len() >= depth
                                        || r.in_flight.iter().any(|(_, s)| spans_meet(s, &mine))
                                }
                            };
                            if blocked {
                                continue;
                            }
                        }
                        // A spread program's instruction waits for one of
                        // the tenant's engines of its kind.
                        let kind = instr.and_then(|i| i.engine_kind()).and_then(compute_kind);
                        if let (Some(k), Some(w)) = (kind, ts.width) {
                            if ts.holding[k] >= w[k] {
                                continue;
                            }
                            // Beyond its guarantee only what the lend
                            // limit allows (an owner's reclaim bound).
                            if ts.holding[k] >= ts.guarantee[k] && lend_limit.is_finite() {
                                let long = instr.is_some_and(|i| match cost(cfg, &i).occupancy {
                                    Occupancy::Fixed(cy) => cy > lend_limit,
                                    _ => false,
                                });
                                if long {
                                    continue;
                                }
                            }
                        }
                        progressed = true;
                        let Some(instr) = instr else {
                            r.state = State::Done;
                            r.finished_at = now;
                            continue;
                        };
                        match instr {
                            Instr::Halt => {
                                ts.job.took_effect(r.stream, r.pc);
                                r.stats.instructions += 1;
                                r.state = State::Done;
                                r.finished_at = now;
                            }
                            Instr::Signal { sem } => {
                                ts.job.took_effect(r.stream, r.pc);
                                r.stats.instructions += 1;
                                let v =
                                    &mut ts.sems[usize::from(sem) % vnpu_abi::isa::NUM_SEMAPHORES as usize];
                                *v = v.saturating_add(1);
                                r.pc += 1;
                            }
                            Instr::Wait { sem } => {
                                r.stats.instructions += 1;
                                r.state =
                                    State::Waiting { sem: sem % vnpu_abi::isa::NUM_SEMAPHORES, since: now };
                            }
                            i => {
                                let c = cost(cfg, &i);
                                // Never spend host time on an instruction that
                                // cannot finish within the tenant's budget.
                                let least = match c.occupancy {
                                    Occupancy::Fixed(cy) => cy,
                                    Occupancy::Transfer { latency, bytes, cap, .. } => latency + bytes / cap,
                                    Occupancy::Sync => 0.0,
                                };
                                if now + least > ts.budget_end {
                                    ts.error =
                                        Some(ExecError::Budget { budget: ts.job.max_cycles().unwrap_or(0) });
                                    r.state = State::Done;
                                    continue;
                                }
                                // Nor host time past the tenant's host-work budget
                                // (counted only for tenants that have one).
                                if let Some(budget) = ts.job.max_host_work() {
                                    let work = ts.host_work.saturating_add(crate::timing::host_work(&i));
                                    if work > budget {
                                        ts.error = Some(ExecError::HostWork { budget });
                                        r.state = State::Done;
                                        continue;
                                    }
                                    ts.host_work = work;
                                }
                                ts.job.took_effect(r.stream, r.pc);
                                if let Some(mut mem) = ts.job.memory() {
                                    if let Err(source) = execute(&i, &mut mem) {
                                        ts.error = Some(ExecError::Kernel {
                                            stream: r.stream,
                                            engine: r.stats.engine,
                                            index: r.pc,
                                            mnemonic: i.mnemonic(),
                                            source,
                                        });
                                        r.state = State::Done;
                                        continue;
                                    }
                                }
                                r.stats.instructions += 1;
                                r.stats.flops = r.stats.flops.saturating_add(c.flops);
                                r.stats.bytes = r.stats.bytes.saturating_add(c.bytes);
                                r.pc += 1;
                                r.state = match c.occupancy {
                                    Occupancy::Fixed(cy) => {
                                        r.stats.active_cycles += cy;
                                        if let (Some(k), Some(_)) = (kind, ts.width) {
                                            if ts.holding[k] >= ts.guarantee[k] {
                                                ts.borrowed += cy;
                                            }
                                            ts.holding[k] += 1;
                                            r.holds = true;
                                        }
                                        State::Busy { until: now + cy }
                                    }
                                    Occupancy::Transfer { latency, first_byte, bytes, cap, hbm, host } => {
                                        if hbm {
                                            r.stats.hbm_bytes = r.stats.hbm_bytes.saturating_add(c.bytes);
                                        }
                                        if host {
                                            r.stats.host_bytes = r.stats.host_bytes.saturating_add(c.bytes);
                                        }
                                        // The first bytes' latency is hidden
                                        // when the engine is streaming: its
                                        // last transfer ended just now, or
                                        // one of the stream's is in flight.
                                        let streaming = (now - r.last_transfer_end).abs() <= EPS
                                            || !r.in_flight.is_empty();
                                        let lat = if streaming { latency } else { latency + first_byte };
                                        if depth > 1 {
                                            // Issued asynchronously: the stream
                                            // is busy for the issue overhead,
                                            // the transfer goes on as a run of
                                            // its own (active: its data time;
                                            // its memory latency overlaps).
                                            let id = *next_transfer;
                                            *next_transfer += 1;
                                            r.in_flight.push((id, spans(&i)));
                                            r.stats.active_cycles += latency;
                                            spawned.push(Run {
                                                tenant: r.tenant,
                                                stream: r.stream,
                                                pc: r.pc,
                                                state: State::Transfer {
                                                    start: now + lat,
                                                    remaining: bytes,
                                                    cap,
                                                    hbm,
                                                    host,
                                                    issued: now + lat,
                                                    ideal: bytes / cap,
                                                },
                                                finished_at: now,
                                                last_transfer_end: f64::NEG_INFINITY,
                                                holds: false,
                                                stats: EngineStats::idle(r.stats.engine),
                                                rate: 0.0,
                                                transfer_of: Some(id),
                                                in_flight: Vec::new(),
                                            });
                                            State::Busy { until: now + latency }
                                        } else {
                                            State::Transfer {
                                                start: now + lat,
                                                remaining: bytes,
                                                cap,
                                                hbm,
                                                host,
                                                issued: now,
                                                ideal: lat + bytes / cap,
                                            }
                                        }
                                    }
                                    Occupancy::Sync => State::Ready,
                                };
                            }
                        }
                    }
                    State::Busy { .. } | State::Transfer { .. } | State::Done => {}
                }
            }
            runs.append(&mut spawned);
            if !progressed {
                break;
            }
        }

        // A tenant whose every unfinished stream waits, with nothing in
        // flight, can never move again.
        for (t, ts) in slots.iter_mut().enumerate() {
            let Some(ts) = ts.as_mut() else { continue };
            if ts.error.is_some() || ts.suspended_at.is_some() {
                continue;
            }
            let mine = runs.iter().filter(|r| r.tenant == t);
            let in_flight =
                mine.clone().any(|r| matches!(r.state, State::Busy { .. } | State::Transfer { .. }));
            if !in_flight {
                if let Some(r) = mine.clone().find(|r| matches!(r.state, State::Waiting { .. })) {
                    if let State::Waiting { sem, .. } = r.state {
                        ts.error = Some(ExecError::Deadlock {
                            stream: r.stream,
                            engine: r.stats.engine,
                            index: r.pc,
                            sem,
                        });
                    }
                }
            }
        }
        for r in runs.iter_mut() {
            if slots.get(r.tenant).and_then(Option::as_ref).is_none_or(|s| s.error.is_some()) {
                r.state = State::Done;
            }
        }

        // Tenants that finished or failed leave the core.
        let mut out = Vec::new();
        for (t, slot) in slots.iter_mut().enumerate() {
            let done = slot.is_some()
                && runs.iter().filter(|r| r.tenant == t).all(|r| matches!(r.state, State::Done));
            if !done {
                continue;
            }
            let Some(ts) = slot.take() else { continue };
            let report = match ts.error {
                Some(e) => Err(e),
                None => {
                    let mine = runs.iter().filter(|r| r.tenant == t);
                    Ok(TenantReport {
                        cycles: mine.clone().map(|r| r.finished_at).fold(ts.started, f64::max),
                        started: ts.started,
                        engines: mine.map(|r| r.stats.clone()).collect(),
                        borrowed_cycles: ts.borrowed,
                    })
                }
            };
            runs.retain(|r| r.tenant != t);
            out.push((t, ts.job, report));
        }
        out
    }

    /// The transfers in flight that move data now (their rates are set by
    /// [`CoreSim::set_rate`] before time advances); every transfer's rate
    /// is reset to 0.
    fn demands(&mut self, out: &mut Vec<Demand>, oldest: &mut Vec<(usize, usize, u64)>) {
        let now = self.now;
        out.clear();
        // A stream's transfers in flight move their data in issue order
        // (their memory latencies overlap, their data phases do not): only
        // the oldest of each stream flows.
        oldest.clear();
        for r in &self.runs {
            if let (Some(id), State::Transfer { .. }) = (r.transfer_of, r.state) {
                match oldest.iter_mut().find(|(t, s, _)| *t == r.tenant && *s == r.stream) {
                    Some(o) => o.2 = o.2.min(id),
                    None => oldest.push((r.tenant, r.stream, id)),
                }
            }
        }
        for (run, r) in self.runs.iter_mut().enumerate() {
            if let State::Transfer { start, cap, hbm, host, .. } = r.state {
                r.rate = 0.0;
                let first = r.transfer_of.is_none_or(|id| {
                    oldest.iter().any(|&(t, s, o)| t == r.tenant && s == r.stream && o == id)
                });
                if first && start <= now + EPS {
                    out.push(Demand { run, tenant: r.tenant, cap, hbm, host });
                }
            }
        }
    }

    fn set_rate(&mut self, run: usize, rate: f64) {
        if let Some(r) = self.runs.get_mut(run) {
            r.rate = rate;
        }
    }

    /// When the next thing happens on the core at the current rates
    /// (infinity: nothing can).
    fn next_event(&self) -> f64 {
        let now = self.now;
        let Self { slots, runs, .. } = self;
        // The next event.
        let mut next = f64::INFINITY;
        for r in runs.iter() {
            match r.state {
                State::Busy { until } => next = next.min(until),
                State::Transfer { start, remaining, .. } => {
                    if start > now + EPS {
                        next = next.min(start);
                    } else if r.rate > 0.0 {
                        next = next.min(now + remaining / r.rate);
                    }
                }
                _ => {}
            }
        }
        for ts in slots.iter().flatten().filter(|ts| ts.suspended_at.is_none()) {
            if ts.budget_end > now {
                next = next.min(ts.budget_end);
            }
        }
        next
    }

    /// Moves simulated time to `next` (no later than [`CoreSim::next_event`]).
    fn advance(&mut self, next: f64) {
        let prev = self.now;
        let now = next;
        self.now = now;
        let Self { slots, runs, .. } = self;
        for r in runs.iter_mut() {
            match &mut r.state {
                State::Busy { until } if *until <= now => {
                    r.state = State::Ready;
                    if r.holds {
                        r.holds = false;
                        let k = compute_kind(r.stats.engine.kind).unwrap_or(0);
                        if let Some(ts) = slots.get_mut(r.tenant).and_then(Option::as_mut) {
                            ts.holding[k] = ts.holding[k].saturating_sub(1);
                        }
                    }
                }
                State::Transfer { start, remaining, issued, ideal, .. } => {
                    // A transfer flowing since `prev` finishes when the same
                    // expression that chose `next` says so; comparing times
                    // (not leftover bytes) keeps this exact at any magnitude
                    // of `now`.
                    let flowing = *start <= prev + EPS;
                    let done = if flowing && r.rate > 0.0 {
                        prev + *remaining / r.rate <= now
                    } else {
                        *start <= now && *remaining <= 0.0
                    };
                    if done {
                        let took = now - *issued;
                        r.stats.active_cycles += *ideal;
                        r.stats.stall_cycles += (took - *ideal).max(0.0);
                        r.last_transfer_end = now;
                        r.state = if r.transfer_of.is_some() { State::Done } else { State::Ready };
                    } else if flowing {
                        *remaining -= r.rate * (now - prev);
                    }
                }
                _ => {}
            }
        }
        // Transfers in flight that are done leave; their stream counts them.
        let landed: Vec<(usize, usize, u64, f64, f64)> = runs
            .iter()
            .filter_map(|r| match (r.transfer_of, r.state) {
                (Some(id), State::Done) => {
                    Some((r.tenant, r.stream, id, r.stats.active_cycles, r.stats.stall_cycles))
                }
                _ => None,
            })
            .collect();
        if !landed.is_empty() {
            runs.retain(|r| !(r.transfer_of.is_some() && matches!(r.state, State::Done)));
            for (tenant, stream, id, active, stall) in landed {
                let parent = runs
                    .iter_mut()
                    .find(|r| r.tenant == tenant && r.stream == stream && r.transfer_of.is_none());
                if let Some(p) = parent {
                    p.in_flight.retain(|(i, _)| *i != id);
                    p.stats.active_cycles += active;
                    p.stats.stall_cycles += stall;
                    p.last_transfer_end = now;
                }
            }
        }
        for ts in slots.iter_mut().flatten() {
            if ts.error.is_none() && ts.suspended_at.is_none() && ts.budget_end <= now + EPS {
                ts.error = Some(ExecError::Budget { budget: ts.job.max_cycles().unwrap_or(0) });
            }
        }
    }

    /// A tenant failed and has not been reported yet.
    fn has_errors(&self) -> bool {
        self.slots.iter().flatten().any(|ts| ts.error.is_some())
    }
}

/// A transfer that moves data now: which run, whose, its own cap and
/// whether it uses HBM and the host link.
#[derive(Clone, Copy, Debug)]
struct Demand {
    run: usize,
    tenant: usize,
    cap: f64,
    hbm: bool,
    host: bool,
}

/// Which physical resources co-located tenants contend for. On the
/// hardware, all of them (the default); turning one off gives every
/// tenant a private copy of it at full capacity. A what-if that no board
/// has: the interference characterization runs the same tenants with each
/// combination to attribute a slowdown to each resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Contention {
    /// The DMA engines of a core.
    pub dma_engines: bool,
    /// The HBM bandwidth of a chip.
    pub hbm: bool,
    /// The board's host link (transfers to and from guest memory).
    pub host_link: bool,
}

impl Default for Contention {
    fn default() -> Self {
        Self { dma_engines: true, hbm: true, host_link: true }
    }
}

/// Resource pools of one rate assignment, created on first use: a pool
/// per key, so a shared resource's key names the core, chip or board and
/// a private one's the tenant as well.
#[derive(Default)]
struct Pools {
    keys: Vec<(u8, usize, usize)>,
    capacity: Vec<f64>,
}

impl Pools {
    fn clear(&mut self) {
        self.keys.clear();
        self.capacity.clear();
    }

    fn get(&mut self, key: (u8, usize, usize), capacity: f64) -> usize {
        match self.keys.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                self.keys.push(key);
                self.capacity.push(capacity);
                self.capacity.len() - 1
            }
        }
    }
}

/// The buffers of [`assign_rates`], kept per thread from one step to the
/// next (a step of a DMA-bound program allocated ten of them).
#[derive(Default)]
struct RateScratch {
    chip_shares: Vec<usize>,
    pools: Pools,
    flows: Vec<Flow>,
    which: Vec<(usize, usize)>,
    demands: Vec<Demand>,
    oldest: Vec<(usize, usize, u64)>,
    rate: Vec<f64>,
    left: Vec<f64>,
    active: Vec<bool>,
}

thread_local! {
    static RATE_SCRATCH: std::cell::RefCell<RateScratch> = std::cell::RefCell::new(RateScratch::default());
}

/// Sets the rates of every transfer in flight on `cores` (core `i` on chip
/// `chips[i]`, all of one board): max-min over each core's DMA engines,
/// each chip's HBM bandwidth and the board's host link, one pool of each
/// (`hbm.partition = "shared"`), or, under `"equal"`, one share of each
/// per tenant, used or not: `1/n` of its core's engines for the `n`
/// shares of the core, of its chip's HBM for the shares of the chip, of
/// the host link for the shares of the board. A resource the cores'
/// [`Contention`] leaves out is a private pool of full capacity per tenant.
fn assign_rates<J: SimTenant>(cores: &mut [CoreSim<'_, J>], chips: &[usize]) {
    if !cores.iter().any(|c| c.runs.iter().any(|r| matches!(r.state, State::Transfer { .. }))) {
        // Nothing to share (most events of compute-bound programs).
        return;
    }
    let n_chips = chips.iter().copied().max().map_or(1, |m| m + 1);
    crate::scratch::with_scratch(
        &RATE_SCRATCH,
        |_| true,
        |scratch| {
            assign_rates_with(cores, chips, n_chips, scratch);
        },
    );
}

fn assign_rates_with<J: SimTenant>(
    cores: &mut [CoreSim<'_, J>],
    chips: &[usize],
    n_chips: usize,
    scratch: &mut RateScratch,
) {
    let Some((cfg, contention)) = cores.first().map(|c| (c.cfg, c.contention)) else { return };
    let engine = cfg.gbps_to_bytes_per_cycle(cfg.dma.gbps);
    let engines = engine * f64::from(cfg.core.dma_engines.max(1));
    let host = cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps);
    let hbm = cfg.hbm_bytes_per_cycle();
    let chip_of = |c: usize| chips.get(c).copied().unwrap_or(0);
    let RateScratch { chip_shares, pools, flows, which, demands, oldest, rate, left, active } = scratch;
    chip_shares.clear();
    chip_shares.resize(n_chips, 0);
    pools.clear();
    flows.clear();
    which.clear();
    for (c, core) in cores.iter().enumerate() {
        chip_shares[chip_of(c)] += core.shares;
    }
    let board_shares: usize = chip_shares.iter().sum::<usize>().max(1);
    let equal = cfg.hbm.partition == HbmPartition::Equal;
    for (c, core) in cores.iter_mut().enumerate() {
        let chip = chip_of(c);
        // Under "equal" every tenant has its share (a pool of its own);
        // a resource without contention is the tenant's, whole.
        let (engine_pool, hbm_pool, link_pool) = if equal {
            let n = core.shares as f64;
            let on_chip = chip_shares[chip].max(1) as f64;
            let board = board_shares as f64;
            (
                if contention.dma_engines { engines / n } else { engines },
                if contention.hbm { hbm / on_chip } else { hbm },
                if contention.host_link { host / board } else { host },
            )
        } else {
            (engines, hbm, host)
        };
        core.demands(demands, oldest);
        for d in demands.iter() {
            // A pool key: (resource, owner, tenant on core c or MAX).
            let own = |shared: bool, owner: usize| {
                if shared && !equal {
                    (owner, usize::MAX)
                } else {
                    (c, d.tenant)
                }
            };
            let (o, t) = own(contention.dma_engines, c);
            let e = pools.get((0, o, t), engine_pool);
            let l = d.host.then(|| {
                let (o, t) = own(contention.host_link, 0);
                pools.get((1, o, t), link_pool)
            });
            let h = d.hbm.then(|| {
                let (o, t) = own(contention.hbm, chip);
                pools.get((2, o, t), hbm_pool)
            });
            flows.push(Flow { cap: d.cap, uses: [Some(e), l, h] });
            which.push((c, d.run));
        }
    }
    max_min_rates(flows, &pools.capacity, rate, left, active);
    for (&(c, run), &r) in which.iter().zip(rate.iter()) {
        if let Some(core) = cores.get_mut(c) {
            core.set_rate(run, r);
        }
    }
}

/// Advances the cores of one board together (core `i` on chip
/// `chips[i]`; their clocks agree) until a tenant of one of them finishes
/// or fails, or simulated time reaches `limit`; returns those tenants with
/// their core's index.
fn step_cores<J: SimTenant>(
    cores: &mut [CoreSim<'_, J>],
    chips: &[usize],
    limit: f64,
) -> Vec<(usize, Finished<J>)> {
    loop {
        let mut out = Vec::new();
        for (c, core) in cores.iter_mut().enumerate() {
            out.extend(core.issue().into_iter().map(|f| (c, f)));
        }
        if !out.is_empty() {
            return out;
        }
        assign_rates(cores, chips);
        let now = cores.iter().map(CoreSim::now).fold(f64::NEG_INFINITY, f64::max);
        let mut next = cores.iter().map(CoreSim::next_event).fold(f64::INFINITY, f64::min);
        if next > limit {
            if limit.is_finite() && limit > now {
                next = limit;
            } else {
                // Nothing on the cores (a tenant that cannot move has been
                // reported above), or the limit is reached.
                return Vec::new();
            }
        }
        if !next.is_finite() {
            return Vec::new();
        }
        for core in cores.iter_mut() {
            core.advance(next);
        }
        if next >= limit && !cores.iter().any(CoreSim::has_errors) {
            return Vec::new();
        }
    }
}

/// Every core of a board, simulated together so that the transfers of all
/// tenants on all cores share what the hardware shares: each core's DMA
/// engines, each chip's HBM bandwidth and the board's host link (see
/// [`CoreSim`] for one core alone). Tenants join a core with
/// [`BoardSim::core`] (`add`, `suspend`, `resume` on it); time moves only
/// through [`BoardSim::step_until`], on every core at once.
pub struct BoardSim<'c, J> {
    cores: Vec<CoreSim<'c, J>>,
    chips: Vec<usize>,
}

impl<J> std::fmt::Debug for BoardSim<'_, J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoardSim").field("cores", &self.cores).finish_non_exhaustive()
    }
}

impl<'c, J: SimTenant> BoardSim<'c, J> {
    /// Every core of `cfg` (`chips x cores_per_chip`, core `i` on chip
    /// `i / cores_per_chip`), idle at time 0, with one HBM share each.
    pub fn new(cfg: &'c BoardConfig) -> Self {
        let per = cfg.cores_per_chip.max(1) as usize;
        let n = (cfg.chips as usize).saturating_mul(per).max(1);
        Self {
            cores: (0..n).map(|_| CoreSim::new(cfg, 1)).collect(),
            chips: (0..n).map(|i| i / per).collect(),
        }
    }

    /// Number of cores.
    pub fn len(&self) -> usize {
        self.cores.len()
    }

    /// Never: a board has a core at least.
    pub fn is_empty(&self) -> bool {
        self.cores.is_empty()
    }

    /// Simulated cycles since the board started.
    pub fn now(&self) -> f64 {
        self.cores.first().map_or(0.0, CoreSim::now)
    }

    /// [`CoreSim::set_lend_limit`] on every core.
    pub fn set_lend_limit(&mut self, cycles: f64) {
        self.cores.iter_mut().for_each(|c| c.set_lend_limit(cycles));
    }

    /// Core `i`, to place, suspend or resume tenants on it (its own
    /// `step`/`step_until` would run it alone: use the board's).
    pub fn core(&mut self, i: usize) -> Option<&mut CoreSim<'c, J>> {
        self.cores.get_mut(i)
    }

    /// No tenant is on any core.
    pub fn is_idle(&self) -> bool {
        self.cores.iter().all(CoreSim::is_idle)
    }

    /// Which resources the tenants of all cores contend for (all, as on
    /// the hardware, unless a what-if says otherwise).
    pub fn set_contention(&mut self, contention: Contention) {
        self.cores.iter_mut().for_each(|c| c.set_contention(contention));
    }

    /// As [`CoreSim::step_until`] for every core at once: stops when a
    /// tenant of some core finishes or fails (returned with its core's
    /// index), or at simulated time `limit`.
    pub fn step_until(&mut self, limit: f64) -> Vec<(usize, Finished<J>)> {
        step_cores(&mut self.cores, &self.chips, limit)
    }

    /// Advances until a tenant finishes or fails; empty when the board is
    /// idle.
    pub fn step(&mut self) -> Vec<(usize, Finished<J>)> {
        self.step_until(f64::INFINITY)
    }
}

/// Runs the tenants' programs on one core of `cfg` until every one has
/// finished or failed. A failing tenant stops alone; the others go on.
pub fn run_core(cfg: &BoardConfig, tenants: &mut [Tenant<'_, '_>]) -> CoreReport {
    let n = tenants.len();
    let mut sim = CoreSim::new(cfg, n);
    let mut index = Vec::with_capacity(n);
    for t in tenants.iter_mut() {
        index.push(sim.add(t, 0.0));
    }
    let mut results: Vec<Option<Result<TenantReport, ExecError>>> = (0..n).map(|_| None).collect();
    while !sim.is_idle() {
        for (id, _, r) in sim.step() {
            if let Some(k) = index.iter().position(|&i| i == id) {
                results[k] = Some(r);
            }
        }
    }
    report(results)
}

fn report(results: Vec<Option<Result<TenantReport, ExecError>>>) -> CoreReport {
    let tenants: Vec<Result<TenantReport, ExecError>> =
        results.into_iter().map(|r| r.unwrap_or(Err(ExecError::Budget { budget: 0 }))).collect();
    let cycles = tenants.iter().flatten().map(|t| t.cycles).fold(0.0, f64::max);
    CoreReport { cycles, tenants }
}

/// Runs one program alone on a core.
/// As [`run_program`], a spread program on `width` engines (SAs, VUs) of
/// which `guarantee` are its own ([`CoreSim::set_engines`]); a program
/// that is not spread runs as with [`run_program`].
pub fn run_program_on(
    cfg: &BoardConfig,
    program: &Program,
    memory: Option<CoreMemory<'_>>,
    max_cycles: Option<u64>,
    guarantee: [u32; 2],
    width: [u32; 2],
) -> Result<TenantReport, ExecError> {
    let mut sim = CoreSim::new(cfg, 1);
    let id = sim.add(Tenant { program, memory, max_cycles }, 0.0);
    sim.set_engines(id, guarantee, width);
    loop {
        if let Some((_, _, r)) = sim.step().pop() {
            return r;
        }
        if sim.is_idle() {
            return Err(ExecError::Budget { budget: 0 });
        }
    }
}

pub fn run_program(
    cfg: &BoardConfig,
    program: &Program,
    memory: Option<CoreMemory<'_>>,
    max_cycles: Option<u64>,
) -> Result<TenantReport, ExecError> {
    let mut t = [Tenant { program, memory, max_cycles }];
    let mut report = run_core(cfg, &mut t);
    report.tenants.pop().unwrap_or(Err(ExecError::Budget { budget: 0 }))
}
