//! Event-driven execution of programs on one core.
//!
//! Each program (one per tenant placed on the core) has one instruction
//! stream per engine; all streams of all tenants advance concurrently in
//! simulated time. An instruction occupies its engine for the cycles the
//! timing model gives; `signal`/`wait` order streams of one tenant. DMA
//! transfers that touch HBM share the chip's HBM bandwidth fairly
//! (max-min, each capped by its own engine rate) with every other such
//! transfer in flight, which is where co-located tenants slow each other.
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
    pub instructions: u64,
}

impl Totals {
    fn add(&mut self, e: &EngineStats) {
        match e.engine.kind {
            EngineKind::Sa => self.sa_active_cycles += e.active_cycles,
            EngineKind::Vu => self.vu_active_cycles += e.active_cycles,
            EngineKind::Dma => self.dma_active_cycles += e.active_cycles,
        }
        self.stall_cycles += e.stall_cycles;
        self.flops += e.flops;
        self.bytes += e.bytes;
        self.instructions += e.instructions;
    }
}

/// What one tenant's program did.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantReport {
    /// Simulated cycles from start until its last stream finished.
    pub cycles: f64,
    pub engines: Vec<EngineStats>,
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
    Transfer { start: f64, remaining: f64, cap: f64, hbm: bool, issued: f64, ideal: f64 },
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
    stats: EngineStats,
    rate: f64,
}

#[derive(Debug)]
struct TenantState {
    sems: [u32; vnpu_abi::isa::NUM_SEMAPHORES as usize],
    error: Option<ExecError>,
}

/// Max-min fair shares of `total` among demands capped at `caps`.
fn water_fill(total: f64, caps: &mut [(usize, f64)]) -> Vec<(usize, f64)> {
    caps.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut left = total;
    let mut out = Vec::with_capacity(caps.len());
    let n = caps.len();
    for (i, &(id, cap)) in caps.iter().enumerate() {
        let share = left / (n - i) as f64;
        let r = cap.min(share);
        left -= r;
        out.push((id, r));
    }
    out
}

/// Runs the tenants' programs on one core of `cfg` until every one has
/// finished or failed. A failing tenant stops alone; the others go on.
pub fn run_core(cfg: &BoardConfig, tenants: &mut [Tenant<'_, '_>]) -> CoreReport {
    let hbm_bw = cfg.hbm_bytes_per_cycle();
    let mut runs: Vec<Run> = Vec::new();
    let mut states: Vec<TenantState> = Vec::new();
    for (t, tenant) in tenants.iter().enumerate() {
        states.push(TenantState { sems: [0; vnpu_abi::isa::NUM_SEMAPHORES as usize], error: None });
        for (s, stream) in tenant.program.streams.iter().enumerate() {
            runs.push(Run {
                tenant: t,
                stream: s,
                pc: 0,
                state: State::Ready,
                finished_at: 0.0,
                last_transfer_end: f64::NEG_INFINITY,
                stats: EngineStats {
                    engine: stream.engine,
                    instructions: 0,
                    active_cycles: 0.0,
                    stall_cycles: 0.0,
                    flops: 0,
                    bytes: 0,
                },
                rate: 0.0,
            });
        }
    }

    let mut now = 0.0f64;
    loop {
        // Issue everything that can issue at `now`, until nothing changes.
        loop {
            let mut progressed = false;
            for r in runs.iter_mut() {
                let ts = &mut states[r.tenant];
                if ts.error.is_some() {
                    r.state = State::Done;
                    continue;
                }
                let code = &tenants[r.tenant].program.streams[r.stream].code;
                match r.state {
                    State::Waiting { sem, since } => {
                        if ts.sems[sem as usize] > 0 {
                            ts.sems[sem as usize] -= 1;
                            r.stats.stall_cycles += now - since;
                            r.pc += 1;
                            r.state = State::Ready;
                            progressed = true;
                        }
                    }
                    State::Ready => {
                        progressed = true;
                        let Some(instr) = code.get(r.pc) else {
                            r.state = State::Done;
                            r.finished_at = now;
                            continue;
                        };
                        match *instr {
                            Instr::Halt => {
                                r.stats.instructions += 1;
                                r.state = State::Done;
                                r.finished_at = now;
                            }
                            Instr::Signal { sem } => {
                                r.stats.instructions += 1;
                                let v = &mut ts.sems[usize::from(sem) % ts.sems.len()];
                                *v = v.saturating_add(1);
                                r.pc += 1;
                            }
                            Instr::Wait { sem } => {
                                r.stats.instructions += 1;
                                r.state =
                                    State::Waiting { sem: sem % vnpu_abi::isa::NUM_SEMAPHORES, since: now };
                            }
                            ref i => {
                                let c = cost(cfg, i);
                                // Never spend host time on an instruction that
                                // cannot finish within the tenant's budget.
                                if let Some(b) = tenants[r.tenant].max_cycles {
                                    let least = match c.occupancy {
                                        Occupancy::Fixed(cy) => cy,
                                        Occupancy::Transfer { latency, bytes, cap, .. } => {
                                            latency + bytes / cap
                                        }
                                        Occupancy::Sync => 0.0,
                                    };
                                    if now + least > b as f64 {
                                        ts.error = Some(ExecError::Budget { budget: b });
                                        r.state = State::Done;
                                        continue;
                                    }
                                }
                                if let Some(mem) = tenants[r.tenant].memory.as_mut() {
                                    if let Err(source) = execute(i, mem) {
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
                                        State::Busy { until: now + cy }
                                    }
                                    Occupancy::Transfer { latency, first_byte, bytes, cap, hbm } => {
                                        let streaming = (now - r.last_transfer_end).abs() <= EPS;
                                        let lat = if streaming { latency } else { latency + first_byte };
                                        State::Transfer {
                                            start: now + lat,
                                            remaining: bytes,
                                            cap,
                                            hbm,
                                            issued: now,
                                            ideal: lat + bytes / cap,
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
            if !progressed {
                break;
            }
        }

        // A tenant whose every unfinished stream waits, with nothing in
        // flight, can never move again.
        for (t, ts) in states.iter_mut().enumerate() {
            if ts.error.is_some() {
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
            if states[r.tenant].error.is_some() {
                r.state = State::Done;
            }
        }

        // Rates of the transfers in flight.
        let mut hbm_caps = Vec::new();
        for (i, r) in runs.iter_mut().enumerate() {
            if let State::Transfer { start, cap, hbm, .. } = r.state {
                r.rate = 0.0;
                if start <= now + EPS {
                    if hbm {
                        hbm_caps.push((i, cap));
                    } else {
                        r.rate = cap;
                    }
                }
            }
        }
        match cfg.hbm.partition {
            HbmPartition::Shared => {
                for (i, rate) in water_fill(hbm_bw, &mut hbm_caps) {
                    runs[i].rate = rate;
                }
            }
            HbmPartition::Equal => {
                // Each tenant fills its own share; unused shares stay unused.
                let share = hbm_bw / states.len().max(1) as f64;
                for t in 0..states.len() {
                    let mut mine: Vec<(usize, f64)> =
                        hbm_caps.iter().copied().filter(|&(i, _)| runs[i].tenant == t).collect();
                    for (i, rate) in water_fill(share, &mut mine) {
                        runs[i].rate = rate;
                    }
                }
            }
        }

        // The next event.
        let mut next = f64::INFINITY;
        for r in &runs {
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
        for (t, tenant) in tenants.iter().enumerate() {
            if let Some(b) = tenant.max_cycles {
                let b = b as f64;
                let active = states[t].error.is_none()
                    && runs.iter().any(|r| r.tenant == t && !matches!(r.state, State::Done));
                if active && b > now {
                    next = next.min(b);
                }
            }
        }
        if !next.is_finite() {
            break;
        }

        let prev = now;
        now = next;
        for r in runs.iter_mut() {
            match &mut r.state {
                State::Busy { until } if *until <= now => r.state = State::Ready,
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
                        r.state = State::Ready;
                    } else if flowing {
                        *remaining -= r.rate * (now - prev);
                    }
                }
                _ => {}
            }
        }
        for (t, tenant) in tenants.iter().enumerate() {
            if let Some(b) = tenant.max_cycles {
                let active = runs.iter().any(|r| r.tenant == t && !matches!(r.state, State::Done));
                if states[t].error.is_none() && active && (b as f64) <= now + EPS {
                    states[t].error = Some(ExecError::Budget { budget: b });
                }
            }
        }
    }

    let mut reports = Vec::with_capacity(tenants.len());
    let mut makespan = 0.0f64;
    for (t, ts) in states.into_iter().enumerate() {
        if let Some(e) = ts.error {
            reports.push(Err(e));
            continue;
        }
        let mine: Vec<&Run> = runs.iter().filter(|r| r.tenant == t).collect();
        let cycles = mine.iter().map(|r| r.finished_at).fold(0.0, f64::max);
        makespan = makespan.max(cycles);
        reports.push(Ok(TenantReport { cycles, engines: mine.iter().map(|r| r.stats.clone()).collect() }));
    }
    CoreReport { cycles: makespan, tenants: reports }
}

/// Runs one program alone on a core.
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
