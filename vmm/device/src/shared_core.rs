//! A physical core shared by several vNPUs, of one VM or of several: the
//! requests they have pending at the same moment run together in one
//! simulation of the core (`npu_model::run_core`), so their engines are
//! busy in the same simulated interval (spatial sharing) and they contend
//! for the core's HBM bandwidth as the board says. Requests that arrive
//! while a batch runs go into the next one; the core's simulated clock
//! advances by each batch's makespan (time sharing between batches).
//!
//! An oversubscribed core (its vNPUs hold more SAs or VUs than it has) runs
//! a batch whose tenants do not fit together in rounds: higher priority
//! first, then earliest SLO deadline (arrival on the core's timeline plus
//! the tenant's latency target; tenants without one last), then arrival
//! order; each round as many tenants as the engines hold, and a context
//! switch between rounds ([`switch_cycles`]). Requests that finish later
//! than their deadline are counted ([`SharingStats::slo_misses`]).

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use npu_model::{run_core, BoardConfig, CoreMemory, ExecError, LazyHbm, Sram, Tenant, TenantReport};
use vm_memory::GuestMemoryMmap;
use vnpu_abi::Program;

use crate::msi::lock;
use crate::GuestRam;

/// How long the core waits for other vNPUs' requests to join a batch.
const GATHER: Duration = Duration::from_micros(200);

/// One vNPU core's memory, lent to the shared core for a request.
#[derive(Debug)]
pub(crate) struct CoreMem {
    pub sram: Sram,
    pub hbm: LazyHbm,
}

/// What a request gets back: its memory, its result, and where it ran on
/// the core's simulated timeline (cycles).
pub(crate) type JobResult = (CoreMem, Result<TenantReport, ExecError>, f64, f64);

/// What a tenant occupies on the core and how urgent it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Claim {
    pub sa: u32,
    pub vu: u32,
    /// Higher runs first when the core is oversubscribed.
    pub priority: u8,
    /// Latency target in simulated cycles from arrival on the core (0:
    /// none); among equal priorities the earliest deadline runs first.
    pub slo_cycles: u64,
}

struct Job {
    tenant: String,
    claim: Claim,
    /// The core's simulated time when the request arrived.
    arrival: f64,
    program: Arc<Program>,
    mem: CoreMem,
    guest: GuestMemoryMmap<()>,
    budget: u64,
    reply: mpsc::Sender<JobResult>,
}

/// A tenant's busy interval on the core's simulated timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Interval {
    pub tenant: String,
    pub start: f64,
    pub end: f64,
}

#[derive(Default)]
struct Queue {
    pending: Vec<Job>,
    now: f64,
    log: Vec<Interval>,
    batches: u64,
    rounds: u64,
    slo_requests: u64,
    slo_misses: u64,
    stop: bool,
    paused: bool,
}

struct Inner {
    board: BoardConfig,
    q: Mutex<Queue>,
    cv: Condvar,
}

/// A shared physical core; clone it into every vNPU placed on the core.
#[derive(Clone)]
pub struct SharedCore {
    inner: Arc<Inner>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl std::fmt::Debug for SharedCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCore").finish_non_exhaustive()
    }
}

/// What the core did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SharingStats {
    /// Batches run.
    pub batches: u64,
    /// Rounds run (more than batches when the core was oversubscribed).
    pub rounds: u64,
    /// Simulated cycles the core was busy.
    pub busy_cycles: f64,
    /// Simulated cycles during which two or more tenants ran at once.
    pub overlap_cycles: f64,
    /// Busy cycles per tenant.
    pub tenants: Vec<(String, f64)>,
    /// Requests that had a latency target, and those that missed it.
    pub slo_requests: u64,
    pub slo_misses: u64,
}

impl SharedCore {
    /// A core of `board` with its engine thread.
    pub fn new(board: &BoardConfig, name: &str) -> std::io::Result<Self> {
        let inner =
            Arc::new(Inner { board: board.clone(), q: Mutex::new(Queue::default()), cv: Condvar::new() });
        let i = Arc::clone(&inner);
        let t = std::thread::Builder::new().name(name.into()).spawn(move || engine(&i))?;
        Ok(Self { inner, thread: Arc::new(Mutex::new(Some(t))) })
    }

    /// Runs `program` for `tenant` with the batch that forms next; blocks
    /// until it is done.
    pub(crate) fn run(
        &self,
        tenant: &str,
        claim: Claim,
        program: Arc<Program>,
        mem: CoreMem,
        guest: GuestMemoryMmap<()>,
        budget: u64,
    ) -> Option<JobResult> {
        let (tx, rx) = mpsc::channel();
        {
            let mut q = lock(&self.inner.q);
            if q.stop {
                return None;
            }
            let arrival = q.now;
            q.pending.push(Job {
                tenant: tenant.into(),
                claim,
                arrival,
                program,
                mem,
                guest,
                budget,
                reply: tx,
            });
        }
        self.inner.cv.notify_all();
        rx.recv().ok()
    }

    /// Busy time, overlap and per-tenant use so far.
    pub fn stats(&self) -> SharingStats {
        let q = lock(&self.inner.q);
        let mut tenants: Vec<(String, f64)> = Vec::new();
        for iv in &q.log {
            match tenants.iter_mut().find(|(t, _)| *t == iv.tenant) {
                Some(e) => e.1 += iv.end - iv.start,
                None => tenants.push((iv.tenant.clone(), iv.end - iv.start)),
            }
        }
        // Overlap: sweep the interval end points.
        let mut ev: Vec<(f64, i32)> = q.log.iter().flat_map(|i| [(i.start, 1), (i.end, -1)]).collect();
        ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut active, mut last, mut overlap) = (0, 0.0, 0.0);
        for (t, d) in ev {
            if active >= 2 {
                overlap += t - last;
            }
            active += d;
            last = t;
        }
        SharingStats {
            batches: q.batches,
            rounds: q.rounds,
            busy_cycles: q.now,
            overlap_cycles: overlap,
            tenants,
            slo_requests: q.slo_requests,
            slo_misses: q.slo_misses,
        }
    }

    /// Holds batches back until [`SharedCore::resume`] (for tests that need
    /// several requests in one batch).
    pub fn pause(&self) {
        lock(&self.inner.q).paused = true;
    }

    /// Lets batches run again.
    pub fn resume(&self) {
        lock(&self.inner.q).paused = false;
        self.inner.cv.notify_all();
    }

    /// Requests waiting for the next batch.
    pub fn pending(&self) -> usize {
        lock(&self.inner.q).pending.len()
    }

    /// Stops the engine thread (pending requests get no answer).
    pub fn stop(&self) {
        lock(&self.inner.q).stop = true;
        self.inner.cv.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// Cycles to switch the core's engines from one round of tenants to the
/// next: drain the SA pipelines (2 x rows + cols) and the VU pipeline, then
/// load the next tenants' first weights (one SA tile over the DMA engine).
pub fn switch_cycles(board: &BoardConfig) -> f64 {
    let c = &board.core;
    let drain = f64::from(2 * c.sa_rows + c.sa_cols + c.vu_latency_cycles);
    let tile = f64::from(c.sa_rows * c.sa_cols * 4);
    drain + board.ns_to_cycles(board.dma.latency_ns) + tile / board.gbps_to_bytes_per_cycle(board.dma.gbps)
}

/// When `j` must finish on the core's timeline (infinity: no target).
fn deadline(j: &Job) -> f64 {
    match j.claim.slo_cycles {
        0 => f64::INFINITY,
        c => j.arrival + c as f64,
    }
}

/// Splits jobs into rounds that fit the core: by priority, then earliest
/// deadline, then arrival.
fn rounds(board: &BoardConfig, mut jobs: Vec<Job>) -> Vec<Vec<Job>> {
    // Stable: equal priorities and deadlines keep their arrival order.
    jobs.sort_by(|a, b| b.claim.priority.cmp(&a.claim.priority).then(deadline(a).total_cmp(&deadline(b))));
    let mut out: Vec<Vec<Job>> = Vec::new();
    for j in jobs {
        let fits = |r: &Vec<Job>| {
            let sa: u32 = r.iter().map(|x| x.claim.sa).sum::<u32>() + j.claim.sa;
            let vu: u32 = r.iter().map(|x| x.claim.vu).sum::<u32>() + j.claim.vu;
            r.is_empty() || (sa <= board.core.sa_count && vu <= board.core.vu_count)
        };
        match out.iter_mut().find(|r| fits(r)) {
            Some(r) => r.push(j),
            None => out.push(vec![j]),
        }
    }
    out
}

fn engine(inner: &Inner) {
    loop {
        {
            let mut q = lock(&inner.q);
            while (q.pending.is_empty() || q.paused) && !q.stop {
                q = inner.cv.wait(q).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            if q.stop {
                return;
            }
        }
        // Let the other vNPUs' requests of this moment join the batch.
        std::thread::sleep(GATHER);
        let (jobs, mut start) = {
            let mut q = lock(&inner.q);
            (std::mem::take(&mut q.pending), q.now)
        };
        let all = rounds(&inner.board, jobs);
        let n_rounds = all.len();
        for (i, mut jobs) in all.into_iter().enumerate() {
            if i > 0 {
                start += switch_cycles(&inner.board);
            }
            let guest_mems: Vec<GuestMemoryMmap<()>> = jobs.iter().map(|j| j.guest.clone()).collect();
            let mut guests: Vec<GuestRam<'_>> = guest_mems.iter().map(GuestRam::new).collect();
            let mut tenants: Vec<Tenant<'_, '_>> = Vec::new();
            for (j, g) in jobs.iter_mut().zip(guests.iter_mut()) {
                tenants.push(Tenant {
                    program: &j.program,
                    memory: Some(CoreMemory { sram: &mut j.mem.sram, hbm: &mut j.mem.hbm, guest: g }),
                    max_cycles: Some(j.budget),
                });
            }
            let report = run_core(&inner.board, &mut tenants);
            drop(tenants);
            drop(guests);
            let mut q = lock(&inner.q);
            q.rounds += 1;
            if i + 1 == n_rounds {
                q.batches += 1;
            }
            q.now = start + report.cycles;
            for (j, r) in jobs.into_iter().zip(report.tenants) {
                let end = start + r.as_ref().map_or(0.0, |t| t.cycles);
                q.log.push(Interval { tenant: j.tenant.clone(), start, end });
                if j.claim.slo_cycles > 0 {
                    q.slo_requests += 1;
                    q.slo_misses += u64::from(end > deadline(&j));
                }
                // A vNPU that went away does not stop the core.
                let _ = j.reply.send((j.mem, r, start, end));
            }
            start = q.now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder};

    /// Submits, from a thread of its own, a request of `name` that streams
    /// 1 MiB from HBM, and waits until the (paused) core holds it.
    fn submit(core: &SharedCore, name: &'static str, claim: Claim) -> std::thread::JoinHandle<JobResult> {
        let mut p = ProgramBuilder::new();
        let copy = Instr::DmaCopy {
            src: Addr::hbm(0),
            dst: Addr::sram(0),
            rows: 1,
            row_bytes: 1 << 20,
            src_stride: 0,
            dst_stride: 0,
        };
        p.push(Engine::DMA, copy);
        let prog = Arc::new(p.finish());
        let guest = GuestMemoryMmap::<()>::from_ranges(&[(vm_memory::GuestAddress(0), 1 << 16)]).unwrap();
        let before = core.pending();
        let c = core.clone();
        let t = std::thread::spawn(move || {
            let mem = CoreMem { sram: Sram::new(2 << 20), hbm: LazyHbm::new(1 << 28) };
            c.run(name, claim, prog, mem, guest, 1 << 30).unwrap()
        });
        while core.pending() <= before {
            std::thread::yield_now();
        }
        t
    }

    #[test]
    fn concurrent_tenants_share_the_simulated_timeline() {
        let board = BoardConfig::default();
        let core = SharedCore::new(&board, "core-test").unwrap();
        core.pause();
        let claim = Claim { sa: 1, vu: 1, priority: 0, slo_cycles: 0 };
        let threads = [submit(&core, "t0", claim), submit(&core, "t1", claim)];
        core.resume();
        for t in threads {
            let (_, r, s, e) = t.join().unwrap();
            assert!(r.is_ok() && e > s);
        }
        let st = core.stats();
        assert_eq!(st.tenants.len(), 2);
        // One batch: both ran at once, sharing HBM.
        assert_eq!(st.batches, 1);
        assert!(st.overlap_cycles > 0.0 && st.overlap_cycles <= st.busy_cycles);
        core.stop();
    }

    /// Among equal priorities the tighter latency target runs first, and a
    /// request that ends after its deadline is counted as a miss.
    #[test]
    fn an_oversubscribed_core_runs_the_earliest_deadline_first() {
        let board = BoardConfig::default();
        let core = SharedCore::new(&board, "core-slo").unwrap();
        core.pause();
        let whole =
            |slo_cycles| Claim { sa: board.core.sa_count, vu: board.core.vu_count, priority: 0, slo_cycles };
        // Submitted in this order: no target, a loose one, a tight one.
        let none = submit(&core, "none", whole(0));
        let loose = submit(&core, "loose", whole(1 << 40));
        let tight = submit(&core, "tight", whole(1));
        core.resume();
        let (none, loose, tight) = (none.join().unwrap(), loose.join().unwrap(), tight.join().unwrap());
        assert!(tight.3 <= loose.2 && loose.3 <= none.2, "{:?} {:?} {:?}", tight.2, loose.2, none.2);
        let st = core.stats();
        assert_eq!((st.rounds, st.slo_requests), (3, 2));
        // One simulated cycle is beyond any program: the tight one missed.
        assert_eq!(st.slo_misses, 1);
        core.stop();
    }

    /// Two tenants that each claim the whole core run in two rounds, the
    /// higher priority first, with a context switch between them.
    #[test]
    fn an_oversubscribed_core_runs_rounds_by_priority() {
        let board = BoardConfig::default();
        let core = SharedCore::new(&board, "core-over").unwrap();
        core.pause();
        let whole =
            |priority| Claim { sa: board.core.sa_count, vu: board.core.vu_count, priority, slo_cycles: 0 };
        // Submitted in this order: low first.
        let low = submit(&core, "low", whole(1));
        let high = submit(&core, "high", whole(9));
        core.resume();
        let (low, high) = (low.join().unwrap(), high.join().unwrap());
        assert!(high.3 <= low.2, "high priority ran first: {:?} {:?}", (high.2, high.3), (low.2, low.3));
        assert!((low.2 - high.3 - switch_cycles(&board)).abs() < 1e-6);
        let st = core.stats();
        assert_eq!((st.batches, st.rounds), (1, 2));
        assert_eq!(st.overlap_cycles, 0.0);
        core.stop();
    }
}
