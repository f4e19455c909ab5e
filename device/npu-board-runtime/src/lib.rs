//! The board runtime: the physical cores of a board shared by vNPUs, of
//! one VM or of several (the board daemon's, the in-process device's):
//! one simulation of the whole board (`npu_model::BoardSim`) runs for as
//! long as the board serves requests, and every request joins its core
//! when it arrives, so requests of different vNPUs run in the same
//! simulated interval on their own engines (spatial sharing) and contend
//! for what the hardware shares: the core's DMA engines, the chip's HBM
//! bandwidth (all cores of the chip) and the board's host link (all
//! cores), as the board says. A request's arrival is the board's simulated
//! time when it is submitted; after each completion the board waits (at
//! most 200 us of wall time) for the active vNPUs that just got results to
//! submit their next request, so a vNPU that issues back-to-back requests
//! keeps its engines busy while its neighbours' long requests go on.
//!
//! The board is advanced in passes (`pass`) by whichever thread holds
//! the engine: the thread that submits a request runs them itself when no
//! other thread does, until its own request is answered, and leaves what
//! is left to the board's own thread, which runs passes only then (no
//! hand-off to another thread and back for a vNPU alone on its board).
//!
//! An oversubscribed core (its vNPUs claim more SAs or VUs than it has)
//! places waiting requests in order of higher priority, then earliest SLO
//! deadline (arrival plus the tenant's latency target; tenants without one
//! last), then arrival, each as soon as its claim fits beside the requests
//! still running (first fit, in that order). A request that had to wait
//! for engines pays a context switch ([`switch_cycles`]) before it starts.
//! Requests that finish later than their deadline are counted
//! ([`SharingStats::slo_misses`]).

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use npu_model::{BoardConfig, CoreMemory, ExecError, LazyHbm, Memory, SimTenant, Sram, TenantReport};
pub use npu_scheduler::{
    admission_order, harvest, placements, schedule, switch_cycles, AtStage, Boundary, Claim, Decision,
    Dispatched, Dispatcher, Engines, Pending, Prema, StageTimes, Staging,
};
use vnpu_abi::Program;

mod runtime;
#[cfg(test)]
use runtime::{add_busy, overlap, CoreLog, FOLD_AT};
pub use runtime::{Completion, Counters, Harvest, Interval, Policy, Runtime, SharingStats, Staged};

/// A lock that outlives a panicked holder (the board's state stays
/// consistent between steps).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The guest memory a request's program reads and writes (a VM's RAM).
pub type GuestMemory = Box<dyn Memory + Send>;

/// How long the core waits (wall time) for vNPUs to submit before it
/// advances simulated time.
const GATHER: Duration = Duration::from_micros(200);

/// A vNPU that got a result within this long (wall time) counts as active:
/// an idle board waits for the active ones' requests of the moment (up to
/// [`GATHER`]), for no one else.
const ACTIVE: Duration = Duration::from_millis(1);

/// One vNPU core's memory, lent to the shared core for a request.
#[derive(Debug)]
pub struct CoreMem {
    pub sram: Sram,
    pub hbm: LazyHbm,
}

/// What a request gets back: its memory, its result (`cycles` counted
/// from the request's start on the core), and where it ran on the core's
/// simulated timeline (cycles).
pub type JobResult = (CoreMem, Result<TenantReport, ExecError>, f64, f64);

/// A request waiting for the next pass (the runtime takes it then).
struct Submitted {
    /// The board's core it runs on.
    core: usize,
    tenant: String,
    claim: Claim,
    job: Job,
}

/// A request as the runtime runs it: its program, memories, budgets and
/// where its answer goes.
struct Job {
    program: Arc<Program>,
    mem: CoreMem,
    guest: GuestMemory,
    budget: u64,
    /// Host-work budget (`npu_model::timing::host_work` units).
    host_work: u64,
    reply: mpsc::Sender<JobResult>,
}

/// A guest's request is one program on its claim.
impl Staged for Job {}

impl SimTenant for Job {
    fn program(&self) -> &Program {
        &self.program
    }
    fn memory(&mut self) -> Option<CoreMemory<'_>> {
        Some(CoreMemory { sram: &mut self.mem.sram, hbm: &mut self.mem.hbm, guest: self.guest.as_mut() })
    }
    fn max_cycles(&self) -> Option<u64> {
        Some(self.budget)
    }
    fn max_host_work(&self) -> Option<u64> {
        Some(self.host_work)
    }
}

#[derive(Default)]
struct Queue {
    pending: Vec<Submitted>,
    /// The board's simulated time.
    now: f64,
    stop: bool,
    paused: bool,
    /// A thread is running the engine's passes (the board's own, or a
    /// submitting one, [`SharedCore::run`]); no other may.
    running: bool,
    /// Requests are on the cores or waiting for engines (as the last pass
    /// left the board).
    busy: bool,
}

impl Queue {
    /// Requests to place, or on the board (as the last pass left it).
    fn has_work(&self) -> bool {
        !self.pending.is_empty() || self.busy
    }
}

struct Inner {
    board: BoardConfig,
    /// How long the board waits for submissions before time moves on.
    gather: Duration,
    /// How long after its last result a vNPU counts as active.
    active: Duration,
    q: Mutex<Queue>,
    cv: Condvar,
    /// The simulation and the dispatchers, run by whoever holds
    /// `Queue::running`.
    engine: Mutex<Engine>,
    /// The cores' counters (the engine's runtime updates them).
    counters: Counters,
}

/// The board's cores in one simulation (`npu_model::BoardSim`), advanced
/// by the submitting threads or the board's own thread: requests on every
/// core share each chip's HBM and the board's host link on one simulated
/// timeline. Hand its cores
/// ([`SharedBoard::core`]) to the vNPUs placed on them.
#[derive(Clone)]
pub struct SharedBoard {
    inner: Arc<Inner>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl std::fmt::Debug for SharedBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBoard").finish_non_exhaustive()
    }
}

/// One physical core of a [`SharedBoard`]; clone it into every vNPU placed
/// on the core.
#[derive(Clone)]
pub struct SharedCore {
    board: SharedBoard,
    index: usize,
}

impl std::fmt::Debug for SharedCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCore").field("index", &self.index).finish_non_exhaustive()
    }
}

impl SharedBoard {
    /// Every core of `board` with the board's engine thread.
    pub fn new(board: &BoardConfig, name: &str) -> std::io::Result<Self> {
        Self::with_gather(board, name, GATHER)
    }

    /// A board that waits up to `gather` (wall time) for the vNPUs that
    /// just got results to submit again before it advances simulated time
    /// (200 us for [`SharedBoard::new`]); the wait ends as soon as they
    /// have. A vNPU counts as active for `gather` or 1 ms after its
    /// result, whichever is longer.
    pub fn with_gather(board: &BoardConfig, name: &str, gather: Duration) -> std::io::Result<Self> {
        Self::with_timing(board, name, gather, ACTIVE.max(gather))
    }

    /// As [`SharedBoard::with_gather`], with vNPUs counted as active for
    /// `active` after their last result: the board waits (up to `gather`)
    /// only for active vNPUs.
    pub fn with_timing(
        board: &BoardConfig,
        name: &str,
        gather: Duration,
        active: Duration,
    ) -> std::io::Result<Self> {
        let state = Engine::for_board(board);
        let counters = state.with_dependent(|_, st| st.rt.counters());
        let inner = Arc::new(Inner {
            board: board.clone(),
            gather,
            active,
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            engine: Mutex::new(state),
            counters,
        });
        let i = Arc::clone(&inner);
        let t = std::thread::Builder::new().name(name.into()).spawn(move || engine(&i))?;
        Ok(Self { inner, thread: Arc::new(Mutex::new(Some(t))) })
    }

    /// Every core of the board, in index order.
    pub fn cores(&self) -> Vec<SharedCore> {
        let n = self.inner.board.chips.saturating_mul(self.inner.board.cores_per_chip);
        (0..n).filter_map(|i| self.core(i)).collect()
    }

    /// Core `index` (`chip x cores_per_chip + core`), if the board has it.
    pub fn core(&self, index: u32) -> Option<SharedCore> {
        let n = self.inner.board.chips.saturating_mul(self.inner.board.cores_per_chip);
        (index < n).then(|| SharedCore { board: self.clone(), index: index as usize })
    }

    /// Holds submitted requests back until [`SharedBoard::resume`] (for
    /// tests that need several requests to arrive at the same moment).
    pub fn pause(&self) {
        lock(&self.inner.q).paused = true;
    }

    /// Lets held requests through.
    pub fn resume(&self) {
        lock(&self.inner.q).paused = false;
        self.inner.cv.notify_all();
    }

    /// Turns harvesting on or off for requests placed from now on (on by
    /// default): off, every request runs on its claim's engines alone
    /// (`docs/management.md`, "Harvesting"), as on a board without it.
    pub fn set_harvesting(&self, on: bool) {
        let mut engine = lock(&self.inner.engine);
        engine.with_dependent_mut(|_, st| st.rt.set_harvesting(on));
    }

    /// [`Runtime::set_lend_limit`] for the board's engine.
    pub fn set_lend_limit(&self, cycles: f64) {
        let mut engine = lock(&self.inner.engine);
        engine.with_dependent_mut(|_, st| st.rt.set_lend_limit(cycles));
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

impl SharedCore {
    /// Core 0 of a board of its own (`board`'s other cores idle), with its
    /// engine thread.
    pub fn new(board: &BoardConfig, name: &str) -> std::io::Result<Self> {
        Self::with_gather(board, name, GATHER)
    }

    /// As [`SharedCore::new`] with [`SharedBoard::with_gather`]'s wait.
    pub fn with_gather(board: &BoardConfig, name: &str, gather: Duration) -> std::io::Result<Self> {
        Ok(SharedCore { board: SharedBoard::with_gather(board, name, gather)?, index: 0 })
    }

    /// The core's index on its board.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Runs `program` for `tenant` on the core within `budget` cycles and
    /// `host_work` units of host work; blocks until it is done.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        tenant: &str,
        claim: Claim,
        program: Arc<Program>,
        mem: CoreMem,
        guest: GuestMemory,
        budget: u64,
        host_work: u64,
    ) -> Option<JobResult> {
        let (tx, rx) = mpsc::channel();
        let inner = &self.board.inner;
        let run_here = {
            let mut q = lock(&inner.q);
            if q.stop {
                return None;
            }
            let job = Job { program, mem, guest, budget, host_work, reply: tx };
            q.pending.push(Submitted { core: self.index, tenant: tenant.into(), claim, job });
            // Nobody runs the board: this thread does, until its own
            // request is answered (no hand-off to the board's thread and
            // back: two thread wake-ups saved per request).
            let free = !q.running && !q.paused;
            q.running |= free;
            free
        };
        if !run_here {
            inner.cv.notify_all();
            return rx.recv().ok();
        }
        let answer = {
            let mut engine = lock(&inner.engine);
            loop {
                match rx.try_recv() {
                    Ok(a) => break Some(a),
                    Err(mpsc::TryRecvError::Disconnected) => break None,
                    Err(mpsc::TryRecvError::Empty) => {}
                }
                if !engine.with_dependent_mut(|_, st| pass(inner, st)) {
                    break None;
                }
            }
        };
        // What is left (the neighbours' requests) goes to the board's
        // thread.
        let left = {
            let mut q = lock(&inner.q);
            q.running = false;
            q.has_work()
        };
        if left {
            inner.cv.notify_all();
        }
        answer
    }

    /// Busy time, overlap, per-tenant use and harvesting of this core so
    /// far.
    pub fn stats(&self) -> SharingStats {
        let now = lock(&self.board.inner.q).now;
        self.board.inner.counters.stats(self.index, now)
    }

    /// Holds the board's submitted requests back ([`SharedBoard::pause`]).
    pub fn pause(&self) {
        self.board.pause();
    }

    /// Lets held requests through.
    pub fn resume(&self) {
        self.board.resume();
    }

    /// Requests submitted to this core and not yet taken by the board.
    pub fn pending(&self) -> usize {
        lock(&self.board.inner.q).pending.iter().filter(|j| j.core == self.index).count()
    }

    /// Stops the board's engine thread (pending requests get no answer).
    pub fn stop(&self) {
        self.board.stop();
    }
}

/// What the board's engine keeps from one pass to the next.
struct EngineState<'c> {
    /// The one engine of sharing.
    rt: Runtime<'c, Job>,
    /// Tenants (core, name) that just got a result and may submit their
    /// next request.
    replied: Vec<(usize, String)>,
    /// When each tenant last got a result (wall time): on an idle board,
    /// those that got one within `Inner::active` may be about to submit
    /// again.
    recent: Vec<(usize, String, Instant)>,
}

self_cell::self_cell!(
    /// The engine's state with the board configuration its simulation
    /// borrows, so either the board's thread or a submitting thread can
    /// run a pass (`Inner::engine`).
    struct Engine {
        owner: BoardConfig,
        #[not_covariant]
        dependent: EngineState,
    }
);

impl Engine {
    fn for_board(board: &BoardConfig) -> Self {
        Engine::new(board.clone(), |board| EngineState {
            rt: Runtime::new(board),
            replied: Vec::new(),
            recent: Vec::new(),
        })
    }
}

/// The board's own engine thread: runs passes whenever there is work and
/// no submitting thread is running them.
fn engine(inner: &Inner) {
    loop {
        {
            let mut q = lock(&inner.q);
            loop {
                if q.stop {
                    return;
                }
                if !q.running && q.has_work() && !q.paused {
                    q.running = true;
                    break;
                }
                q = inner.cv.wait(q).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
        let mut engine = lock(&inner.engine);
        loop {
            if !engine.with_dependent_mut(|_, st| pass(inner, st)) {
                return;
            }
            let mut q = lock(&inner.q);
            if !q.has_work() {
                q.running = false;
                break;
            }
        }
    }
}

/// One pass of the board: wait until there is work, let the requests of
/// the moment arrive (wall time, below), place what fits on each core,
/// advance the whole board to the next completion and answer the requests
/// that finished. False when the board stopped.
fn pass(inner: &Inner, st: &mut EngineState<'_>) -> bool {
    let fresh = {
        let mut q = lock(&inner.q);
        loop {
            if q.stop {
                return false;
            }
            if (!q.pending.is_empty() || st.rt.busy()) && !q.paused {
                break;
            }
            q = inner.cv.wait(q).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        !st.rt.busy()
    };
    // Before simulated time moves on, let the active vNPUs that just got
    // a result submit their next request (and, on an idle board, let the
    // requests of this moment of every active vNPU arrive: the wait ends
    // once each of them has one pending, at once for a vNPU alone on the
    // board). A vNPU without a result for longer than `active` holds
    // nobody back.
    let until = Instant::now() + inner.gather;
    {
        let mut q = lock(&inner.q);
        loop {
            st.recent.retain(|r| r.2.elapsed() < inner.active);
            let has = |c: usize, t: &str| q.pending.iter().any(|j| j.core == c && j.tenant == t);
            let active = |c: usize, t: &str| st.recent.iter().any(|r| r.0 == c && r.1 == t);
            let missing = st.replied.iter().any(|(c, t)| active(*c, t) && !has(*c, t));
            let others_may_come = fresh && st.recent.iter().any(|(c, t, _)| !has(*c, t));
            let left = until.saturating_duration_since(Instant::now());
            if q.stop || left.is_zero() || !(others_may_come || missing) {
                break;
            }
            // Wake when a waited-for vNPU stops counting as active, too.
            let expiry = st.recent.iter().map(|r| inner.active.saturating_sub(r.2.elapsed())).min();
            let left = expiry.map_or(left, |e| left.min(e.max(Duration::from_micros(1))));
            q = inner.cv.wait_timeout(q, left).map_or_else(|e| e.into_inner().0, |r| r.0);
        }
        if q.stop {
            return false;
        }
        for Submitted { core, tenant, claim, job } in q.pending.drain(..) {
            // Cannot fail (cores come from `SharedBoard::core`); the
            // requester would get no answer rather than a wrong one.
            let _ = st.rt.submit(core, &tenant, claim, job);
        }
    }
    st.replied.clear();
    // Place, lend and advance the whole board to the next completion.
    let done = st.rt.step(f64::INFINITY);
    let mut q = lock(&inner.q);
    q.now = st.rt.now();
    for Completion { core, tenant, job, result, begin, end, .. } in done {
        match st.recent.iter_mut().find(|r| r.0 == core && r.1 == tenant) {
            Some(r) => r.2 = Instant::now(),
            None => st.recent.push((core, tenant.clone(), Instant::now())),
        }
        st.replied.push((core, tenant));
        // A vNPU that went away does not stop the board.
        let _ = job.reply.send((job.mem, result, begin, end));
    }
    q.busy = st.rt.busy();
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder};

    /// (tenant, start, end) on whole cycles in 0..64.
    fn interval() -> impl proptest::strategy::Strategy<Value = (usize, u32, u32)> {
        use proptest::strategy::Strategy;
        (0usize..3, 0u32..64, 1u32..16).prop_map(|(t, s, len)| (t, s, s + len))
    }

    proptest::proptest! {
        /// Folding the settled part of a core's log changes none of its
        /// numbers. Reference: count, cycle by cycle, how many intervals
        /// cover it (independent of the sweep).
        #[test]
        fn folding_the_log_keeps_busy_time_and_overlap(
            early in proptest::collection::vec(interval(), 0..40),
            late in proptest::collection::vec(interval(), 0..40),
            frontier in 0u32..64,
        ) {
            let names = ["a", "b", "c"];
            // Intervals that come after the fold start at the frontier or later.
            let late: Vec<(usize, u32, u32)> =
                late.into_iter().map(|(t, s, e)| (t, s.max(frontier), e.max(frontier + 1))).collect();
            let mut log = CoreLog::default();
            let push = |log: &mut CoreLog, &(t, s, e): &(usize, u32, u32)| {
                log.log.push(Interval { tenant: names[t].into(), start: f64::from(s), end: f64::from(e) });
            };
            early.iter().for_each(|i| push(&mut log, i));
            log.fold(f64::from(frontier));
            late.iter().for_each(|i| push(&mut log, i));
            log.fold(f64::from(frontier) / 2.0); // behind the settled time: nothing
            let all: Vec<&(usize, u32, u32)> = early.iter().chain(&late).collect();
            let (mut want_overlap, mut want_busy) = (0u32, [0u32; 3]);
            for cycle in 0..80 {
                let covering: Vec<usize> =
                    all.iter().filter(|i| i.1 <= cycle && cycle < i.2).map(|i| i.0).collect();
                want_overlap += u32::from(covering.len() >= 2);
                covering.iter().for_each(|&t| want_busy[t] += 1);
            }
            let got_overlap = log.settled_overlap + overlap(log.log.iter().map(|i| (i.start, i.end)));
            proptest::prop_assert_eq!(got_overlap, f64::from(want_overlap));
            let mut busy = log.settled_busy.clone();
            add_busy(&mut busy, log.log.iter().map(|i| (i.tenant.as_str(), i.end - i.start)));
            for (t, name) in names.iter().enumerate() {
                let got = busy.iter().find(|b| b.0 == *name).map_or(0.0, |b| b.1);
                proptest::prop_assert_eq!(got, f64::from(want_busy[t]), "tenant {}", name);
            }
            proptest::prop_assert!(log.log.iter().all(|i| i.end > f64::from(frontier)));
        }
    }

    /// Submits, from a thread of its own, a request of `name` that streams
    /// 1 MiB from HBM, and waits until the (paused) core holds it.
    fn submit(core: &SharedCore, name: &'static str, claim: Claim) -> std::thread::JoinHandle<JobResult> {
        submit_copies(core, name, claim, 1)
    }

    /// A program that streams `n` MiB from HBM.
    fn copies(n: usize) -> Arc<Program> {
        let mut p = ProgramBuilder::new();
        let copy = Instr::DmaCopy {
            src: Addr::hbm(0),
            dst: Addr::sram(0),
            rows: 1,
            row_bytes: 1 << 20,
            src_stride: 0,
            dst_stride: 0,
        };
        for _ in 0..n {
            p.push(Engine::DMA, copy);
        }
        Arc::new(p.finish())
    }

    /// Runs `n` MiB of copies for `name` on the calling thread.
    fn run_copies(core: &SharedCore, name: &str, claim: Claim, n: usize) -> JobResult {
        let guest = Box::new(npu_model::VecGuestMemory { base: 0, bytes: vec![0; 1 << 16] });
        let mem = CoreMem { sram: Sram::new(2 << 20), hbm: LazyHbm::new(1 << 28) };
        core.run(name, claim, copies(n), mem, guest, 1 << 30, 1 << 28).unwrap()
    }

    /// A request's report counts its own cycles from its start, not the
    /// core's clock: the same request run twice reports the same cycles,
    /// though the second ends later on the core's timeline.
    #[test]
    fn reports_count_from_the_requests_start() {
        let core = SharedCore::new(&BoardConfig::test_board(), "test").unwrap();
        let claim = Claim { sa: 1, vu: 1, ..Claim::default() };
        let first = run_copies(&core, "a", claim, 2);
        let second = run_copies(&core, "a", claim, 2);
        core.stop();
        let (c1, c2) = (first.1.unwrap().cycles, second.1.unwrap().cycles);
        assert!(second.3 >= first.3 + c1 - 1e-6, "second ends at {} on the core", second.3);
        assert!(c1 > 0.0 && (c2 - c1).abs() < 1e-6, "{c1} vs {c2}");
    }

    /// As [`submit`], streaming `n` MiB (the core must be paused).
    fn submit_copies(
        core: &SharedCore,
        name: &'static str,
        claim: Claim,
        n: usize,
    ) -> std::thread::JoinHandle<JobResult> {
        let before = core.pending();
        let c = core.clone();
        let t = std::thread::spawn(move || run_copies(&c, name, claim, n));
        while core.pending() <= before {
            std::thread::yield_now();
        }
        t
    }

    #[test]
    fn concurrent_tenants_share_the_simulated_timeline() {
        let board = BoardConfig::test_board();
        let core = SharedCore::new(&board, "core-test").unwrap();
        core.pause();
        let claim = Claim { sa: 1, vu: 1, priority: 0, slo_cycles: 0, ..Claim::default() };
        let threads = [submit(&core, "t0", claim), submit(&core, "t1", claim)];
        core.resume();
        for t in threads {
            let (_, r, s, e) = t.join().unwrap();
            assert!(r.is_ok() && e > s);
        }
        let st = core.stats();
        assert_eq!(st.tenants.len(), 2);
        // Both ran at once, sharing HBM; neither waited for engines.
        assert_eq!((st.requests, st.waited), (2, 0));
        assert!(st.overlap_cycles > 0.0 && st.overlap_cycles <= st.busy_cycles);
        core.stop();
    }

    /// A tenant idle for longer than `ACTIVE` holds nobody back: with a
    /// 10 s wait for the active tenants' requests of the moment, another
    /// tenant's requests on the idle board still run at once (a board that
    /// waited for every tenant it had seen would take 10 s for each).
    #[test]
    fn an_idle_neighbour_does_not_hold_a_tenant_back() {
        let board = SharedBoard::with_timing(
            &BoardConfig::test_board(),
            "idle-neighbour",
            Duration::from_secs(10),
            ACTIVE,
        )
        .unwrap();
        let core = board.core(0).unwrap();
        let claim = Claim { sa: 1, vu: 1, ..Claim::default() };
        assert!(run_copies(&core, "idle", claim, 1).1.is_ok());
        std::thread::sleep(ACTIVE * 3);
        let t = Instant::now();
        for _ in 0..3 {
            assert!(run_copies(&core, "busy", claim, 1).1.is_ok());
        }
        let took = t.elapsed();
        core.stop();
        assert!(took < Duration::from_secs(5), "three requests took {took:?}");
    }

    /// A core that serves request after request keeps a bounded log (the
    /// settled part is folded into totals) and still reports every
    /// tenant's busy time as the sum of its requests' intervals, as each
    /// requester saw them.
    #[test]
    fn a_long_running_core_keeps_a_bounded_log_and_exact_totals() {
        let core = SharedCore::new(&BoardConfig::test_board(), "core-fold").unwrap();
        let claim = Claim { sa: 1, vu: 1, ..Claim::default() };
        let per_tenant = FOLD_AT + 300;
        let threads: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|name| {
                let c = core.clone();
                std::thread::spawn(move || {
                    let mut busy = 0.0;
                    for _ in 0..per_tenant {
                        let (_, r, s, e) = run_copies(&c, name, claim, 1);
                        assert!(r.is_ok() && e > s);
                        busy += e - s;
                    }
                    busy
                })
            })
            .collect();
        let want: Vec<f64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let kept = lock(&core.board.inner.engine).with_dependent(|_, st| st.rt.kept_intervals(0));
        let st = core.stats();
        core.stop();
        assert!(kept < FOLD_AT + 4, "{kept} intervals kept after {} requests", 2 * per_tenant);
        assert_eq!(st.requests, 2 * per_tenant as u64);
        for (name, want) in ["a", "b"].iter().zip(want) {
            let got = st.tenants.iter().find(|t| t.0 == *name).map_or(f64::NAN, |t| t.1);
            assert!((got - want).abs() <= 1e-6 * want, "{name}: {got} vs {want}");
        }
        assert!(st.overlap_cycles > 0.0 && st.overlap_cycles <= st.busy_cycles, "{st:?}");
    }

    /// A preempted request is not busy while it is suspended: two
    /// whole-core tenants that preempt each other never count as running
    /// at once. (A request on core 1 finishing early is what lets the
    /// urgent one arrive while the long one runs on core 0.)
    #[test]
    fn a_suspended_request_is_not_counted_busy() {
        let board = BoardConfig::test_board();
        let shared = SharedBoard::with_gather(&board, "board-preempt", Duration::from_secs(2)).unwrap();
        let (c0, c1) = (shared.core(0).unwrap(), shared.core(1).unwrap());
        let whole = |priority| Claim { priority, ..Claim::whole_core(&board) };
        shared.pause();
        let long = submit_copies(&c0, "long", whole(0), 64);
        let early = submit_copies(&c1, "early", whole(0), 1);
        shared.resume();
        assert!(early.join().unwrap().1.is_ok());
        // The board waits for "early" to submit again; first the urgent one.
        let urgent = submit_copies(&c0, "urgent", whole(9), 1);
        let again = run_copies(&c1, "early", whole(0), 1);
        let (urgent, long) = (urgent.join().unwrap(), long.join().unwrap());
        assert!(again.1.is_ok() && urgent.1.is_ok() && long.1.is_ok());
        assert!(
            urgent.3 < long.3,
            "the urgent request ended at {} after the long one ({})",
            urgent.3,
            long.3
        );
        let st = c0.stats();
        assert_eq!((st.requests, st.preempted), (2, 1));
        assert_eq!(st.overlap_cycles, 0.0, "{st:?}");
        // The long one's busy time leaves its suspension out.
        let busy = |t: &str| st.tenants.iter().find(|x| x.0 == t).map_or(f64::NAN, |x| x.1);
        assert!(busy("long") < long.3 - long.2 - (urgent.3 - urgent.2), "{st:?} {long:?}");
        shared.stop();
    }

    /// The cores of one board share the chip's HBM: four cores streaming
    /// from HBM at once (4 x 400 GB/s wanted of 1.2 TB/s) each take about
    /// 4/3 as long as one core alone; on four boards of their own they do
    /// not slow each other.
    #[test]
    fn the_cores_of_a_board_share_the_chips_hbm() {
        let board = BoardConfig::test_board();
        let claim = Claim { sa: 1, vu: 1, ..Claim::default() };
        let alone = {
            let core = SharedCore::new(&board, "alone").unwrap();
            let r = run_copies(&core, "a", claim, 4).1.unwrap().cycles;
            core.stop();
            r
        };
        let shared = SharedBoard::new(&board, "board").unwrap();
        let cores: Vec<SharedCore> = (0..4).map(|c| shared.core(c).unwrap()).collect();
        assert!(shared.core(4).is_none(), "the test board has four cores");
        shared.pause();
        let names = ["c0", "c1", "c2", "c3"];
        let threads: Vec<_> = cores.iter().zip(names).map(|(c, n)| submit_copies(c, n, claim, 4)).collect();
        shared.resume();
        for (i, t) in threads.into_iter().enumerate() {
            let c = t.join().unwrap().1.unwrap().cycles;
            assert!(c / alone > 1.3 && c / alone < 1.34, "core {i}: {c} cycles, alone {alone}");
            assert_eq!(cores[i].stats().requests, 1);
        }
        shared.stop();
        let boards: Vec<SharedCore> =
            (0..4).map(|i| SharedCore::new(&board, &format!("b{i}")).unwrap()).collect();
        for b in &boards {
            b.pause();
        }
        let threads: Vec<_> = boards.iter().zip(names).map(|(c, n)| submit_copies(c, n, claim, 4)).collect();
        boards.iter().for_each(SharedCore::resume);
        for (i, t) in threads.into_iter().enumerate() {
            let c = t.join().unwrap().1.unwrap().cycles;
            assert!((c - alone).abs() < 1e-6, "board {i}: {c} cycles, alone {alone}");
        }
        boards.iter().for_each(SharedCore::stop);
    }

    /// Among equal priorities the tighter latency target runs first, and a
    /// request that ends after its deadline is counted as a miss.
    #[test]
    fn an_oversubscribed_core_runs_the_earliest_deadline_first() {
        let board = BoardConfig::test_board();
        let core = SharedCore::new(&board, "core-slo").unwrap();
        core.pause();
        let whole = |slo_cycles| Claim { slo_cycles, ..Claim::whole_core(&board) };
        // Submitted in this order: no target, a loose one, a tight one.
        let none = submit(&core, "none", whole(0));
        let loose = submit(&core, "loose", whole(1 << 40));
        let tight = submit(&core, "tight", whole(1));
        core.resume();
        let (none, loose, tight) = (none.join().unwrap(), loose.join().unwrap(), tight.join().unwrap());
        assert!(tight.3 <= loose.2 && loose.3 <= none.2, "{:?} {:?} {:?}", tight.2, loose.2, none.2);
        let st = core.stats();
        assert_eq!((st.requests, st.waited, st.slo_requests), (3, 2, 2));
        // One simulated cycle is beyond any program: the tight one missed.
        assert_eq!(st.slo_misses, 1);
        core.stop();
    }

    /// Two tenants that each claim the whole core run one after the other,
    /// the higher priority first, with a context switch between them.
    #[test]
    fn an_oversubscribed_core_runs_the_higher_priority_first() {
        let board = BoardConfig::test_board();
        let core = SharedCore::new(&board, "core-over").unwrap();
        core.pause();
        let whole = |priority| Claim { priority, ..Claim::whole_core(&board) };
        // Submitted in this order: low first.
        let low = submit(&core, "low", whole(1));
        let high = submit(&core, "high", whole(9));
        core.resume();
        let (low, high) = (low.join().unwrap(), high.join().unwrap());
        assert!(high.3 <= low.2, "high priority ran first: {:?} {:?}", (high.2, high.3), (low.2, low.3));
        assert!((low.2 - high.3 - switch_cycles(&board)).abs() < 1e-6);
        let st = core.stats();
        assert_eq!((st.requests, st.waited), (2, 1));
        assert_eq!(st.overlap_cycles, 0.0);
        core.stop();
    }

    /// Vnpus of different shapes on an oversubscribed core: the engines a
    /// short request frees go to the next waiting one at once, not when
    /// the longest request of its wave ends.
    #[test]
    fn freed_engines_pass_to_the_next_request_without_waiting_for_the_wave() {
        let board = BoardConfig::test_board();
        let core = SharedCore::new(&board, "core-admit").unwrap();
        core.pause();
        let half =
            Claim { sa: board.core.sa_count / 2, vu: 1, priority: 0, slo_cycles: 0, ..Claim::default() };
        let long = submit_copies(&core, "long", half, 16);
        let short = submit_copies(&core, "short", half, 1);
        let next = submit_copies(&core, "next", half, 1);
        core.resume();
        let (long, short, next) = (long.join().unwrap(), short.join().unwrap(), next.join().unwrap());
        assert_eq!((long.2, short.2), (0.0, 0.0));
        assert!((next.2 - short.3 - switch_cycles(&board)).abs() < 1e-6, "{} {}", short.3, next.2);
        assert!(next.3 < long.3, "next ended at {} after the long one ({})", next.3, long.3);
        let st = core.stats();
        assert_eq!((st.requests, st.waited), (3, 1));
        core.stop();
    }

    /// A vNPU that submits its next request as soon as it gets a result
    /// runs it while its neighbour's long request is still going: the
    /// core's timeline is not cut into batches.
    #[test]
    fn a_short_tenant_runs_request_after_request_beside_a_long_one() {
        let board = BoardConfig::test_board();
        // Waits as long as it takes for "short" to submit again.
        let core = SharedCore::with_gather(&board, "core-continuous", Duration::from_secs(2)).unwrap();
        core.pause();
        let half =
            Claim { sa: board.core.sa_count / 2, vu: 1, priority: 0, slo_cycles: 0, ..Claim::default() };
        let long = submit_copies(&core, "long", half, 64);
        let first = submit_copies(&core, "short", half, 1);
        core.resume();
        let first = first.join().unwrap();
        let mut last = first.3;
        for _ in 0..5 {
            let (_, r, s, e) = run_copies(&core, "short", half, 1);
            assert!(r.is_ok() && s >= last && e > s);
            last = e;
        }
        let long = long.join().unwrap();
        // All six short requests ran inside the long one's interval.
        assert!(last < long.3, "short ones ended at {last}, the long one at {}", long.3);
        let st = core.stats();
        assert_eq!((st.requests, st.waited), (7, 0));
        core.stop();
    }

    /// A request with a latency target that finds the engines taken by a
    /// long request without one suspends it, runs, and the long one goes
    /// on where it stopped.
    #[test]
    fn an_urgent_request_preempts_a_long_one_on_an_oversubscribed_core() {
        let board = BoardConfig::test_board();
        let core = SharedCore::with_gather(&board, "core-preempt", Duration::from_secs(2)).unwrap();
        core.pause();
        let half =
            Claim { sa: board.core.sa_count / 2, vu: 1, priority: 0, slo_cycles: 0, ..Claim::default() };
        let long = submit_copies(&core, "long", half, 64);
        let short = submit_copies(&core, "rt", half, 1);
        core.resume();
        let short = short.join().unwrap();
        // The same vNPU's next request needs the whole core, within 1 ms.
        let whole =
            Claim { sa: board.core.sa_count, vu: 2, priority: 0, slo_cycles: 940_000, ..Claim::default() };
        let (_, r, s, e) = run_copies(&core, "rt", whole, 1);
        assert!(r.is_ok() && s >= short.3);
        let long = long.join().unwrap();
        assert!(e < long.3, "the urgent request ended at {e}, after the long one ({})", long.3);
        let st = core.stats();
        assert_eq!((st.requests, st.preempted), (3, 1));
        assert!(long.1.is_ok());
        core.stop();
    }

    /// `streams` VU streams (spread or not), stream `s` adding its block
    /// of `n` f32s at `s * 3n` to the next block into the third, `each`
    /// times.
    fn adds(streams: u8, n: u32, each: usize, spread: bool) -> Arc<Program> {
        let mut b = ProgramBuilder::new();
        let block = u64::from(n) * 4;
        for s in 0..streams {
            let at = u64::from(s) * 3 * block;
            for _ in 0..each {
                let (a, bb, dst) = (at, at + block, at + 2 * block);
                let op = vnpu_abi::BinOp::Add;
                b.push(
                    Engine::vu(s),
                    Instr::VBinary { op, bcast: vnpu_abi::Bcast::None, a, b: bb, dst, rows: 1, cols: n },
                );
            }
        }
        if spread {
            b.spread();
        }
        Arc::new(b.finish())
    }

    /// A tenant's memory: SRAM holding `seed + i` at f32 `i`.
    fn filled(seed: f32) -> CoreMem {
        let mut sram = Sram::new(1 << 20);
        let v: Vec<f32> = (0..(1 << 18)).map(|i| seed + i as f32).collect();
        npu_model::memory::write_f32s(&mut sram, 0, &v).unwrap();
        CoreMem { sram, hbm: LazyHbm::new(1 << 20) }
    }

    /// What [`adds`] leaves in [`filled`]`(seed)`'s SRAM: each stream's
    /// third block is the sum of its first two (computed here, on the CPU).
    fn added(seed: f32, streams: u8, n: u32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..(1 << 18)).map(|i| seed + i as f32).collect();
        let n = n as usize;
        for s in 0..streams as usize {
            for i in 0..n {
                v[s * 3 * n + 2 * n + i] = v[s * 3 * n + i] + v[s * 3 * n + n + i];
            }
        }
        v
    }

    /// Harvesting through the shared core: a spread tenant borrows the
    /// VUs of an idle neighbour (counted on both sides), gives them back
    /// when the neighbour submits, and each tenant's memory holds its own
    /// results only, as the CPU computes them.
    #[test]
    fn a_borrower_runs_on_an_idle_neighbours_engines_and_sees_only_its_memory() {
        let board = BoardConfig::test_board();
        assert_eq!(board.core.vu_count, 4);
        let core = SharedCore::new(&board, "harvest-test").unwrap();
        let owner = Claim { sa: 1, vu: 3, borrow: Engines::default(), ..Claim::default() };
        let borrower = Claim { sa: 1, vu: 1, borrow: Engines::new(3, 3), ..Claim::default() };
        let n = 4096;
        fn run(c: &SharedCore, name: &str, claim: Claim, p: Arc<Program>, seed: f32) -> JobResult {
            let guest = Box::new(npu_model::VecGuestMemory { base: 0, bytes: vec![0; 64] });
            c.run(name, claim, p, filled(seed), guest, 1 << 40, 1 << 40).unwrap()
        }
        // The owner once, then the borrower alone: it gets the owner's VUs.
        let (mem, r, _, _) = run(&core, "owner", owner, adds(3, n, 1, false), 1.0);
        assert!(r.is_ok());
        assert_eq!(npu_model::memory::read_f32s(&mem.sram, 0, 1 << 18).unwrap(), added(1.0, 3, n));
        let (mem, r, _, _) = run(&core, "borrower", borrower, adds(4, n, 8, true), 5.0);
        let alone = r.unwrap();
        assert_eq!(npu_model::memory::read_f32s(&mem.sram, 0, 1 << 18).unwrap(), added(5.0, 4, n));
        assert!(alone.borrowed_cycles > 0.0);
        let st = core.stats();
        let h = |t: &str| st.harvest.iter().find(|h| h.0 == t).map(|h| h.1.clone()).unwrap_or_default();
        assert_eq!(h("borrower").borrowed_cycles, alone.borrowed_cycles);
        // Three of its four streams ran on the owner's VUs: 3/4 of the
        // borrower's time, lent by the owner for as long as it ran.
        assert!((h("borrower").borrowed_cycles - 0.75 * 4.0 * alone.cycles).abs() <= 1e-6 * alone.cycles);
        assert!((h("owner").lent_cycles - 3.0 * alone.cycles).abs() <= 1e-6 * alone.cycles);
        // Both at once: each gets its own results.
        core.pause();
        let c2 = core.clone();
        let t = std::thread::spawn(move || run(&c2, "borrower", borrower, adds(4, n, 8, true), 7.0));
        while core.pending() < 1 {
            std::thread::yield_now();
        }
        let c3 = core.clone();
        let o = std::thread::spawn(move || run(&c3, "owner", owner, adds(3, n, 1, false), 3.0));
        while core.pending() < 2 {
            std::thread::yield_now();
        }
        core.resume();
        let (bm, br, _, _) = t.join().unwrap();
        let (om, or, _, _) = o.join().unwrap();
        assert!(br.is_ok() && or.is_ok());
        assert_eq!(npu_model::memory::read_f32s(&bm.sram, 0, 1 << 18).unwrap(), added(7.0, 4, n));
        assert_eq!(npu_model::memory::read_f32s(&om.sram, 0, 1 << 18).unwrap(), added(3.0, 3, n));
        core.stop();
    }

    /// A request of `stages` stages of `adds` vector adds each, split
    /// evenly over the VUs it is granted (VUs only: SAs do not help).
    #[derive(Debug)]
    struct AddStages {
        tenant: usize,
        stages: usize,
        adds: usize,
        done: usize,
        program: Arc<Program>,
        /// Cycles of one stage on 1..=4 VUs, run alone (the reference).
        alone: [f64; 4],
    }

    impl StageTimes for AddStages {
        fn next(&self, e: Engines) -> f64 {
            match e.vu {
                1..=4 if e.sa >= 1 => self.alone[e.vu as usize - 1],
                _ => f64::INFINITY,
            }
        }
        fn rest(&self, e: Engines) -> f64 {
            self.next(e) * (self.stages - self.done) as f64
        }
    }

    impl Staged for AddStages {
        fn stage_times(&self) -> Option<&dyn StageTimes> {
            Some(self)
        }
        fn begin_stage(&mut self, e: Engines) {
            let vus = e.vu.clamp(1, 4);
            self.program = adds(vus as u8, 256, self.adds / vus as usize, false);
        }
        fn end_stage(&mut self, _: &TenantReport) -> bool {
            self.done += 1;
            self.done < self.stages
        }
    }

    impl SimTenant for AddStages {
        fn program(&self) -> &Program {
            &self.program
        }
        fn memory(&mut self) -> Option<CoreMemory<'_>> {
            None
        }
        fn max_cycles(&self) -> Option<u64> {
            None
        }
    }

    fn add_stages(board: &BoardConfig, tenant: usize, stages: usize, count: usize) -> AddStages {
        let alone = [1u8, 2, 3, 4].map(|v| {
            npu_model::run_program(board, &adds(v, 256, count / usize::from(v), false), None, None)
                .map_or(f64::NAN, |r| r.cycles)
        });
        AddStages { tenant, stages, adds: count, done: 0, program: adds(1, 256, 1, false), alone }
    }

    /// Staging, by hand: a lone request takes every VU for each of its
    /// stages and borrows the three beyond its claim; a second tenant
    /// arriving during a stage waits for that stage to end (the bound of
    /// an owner's wait), then both run on their guarantees and the idle
    /// engines.
    #[test]
    fn staged_requests_borrow_idle_engines_and_give_them_back_at_stage_ends() {
        let board = BoardConfig::test_board();
        let claim = Claim { sa: 1, vu: 1, ..Claim::default() };
        let mut rt: Runtime<'_, AddStages> = Runtime::new(&board);
        rt.set_harvesting(false);
        rt.set_staging(Staging { boundary: Boundary::Lend, tolerance: 0.0 });
        let a = add_stages(&board, 0, 2, 96);
        let stage4 = a.alone[3];
        assert!(stage4 < a.alone[0] / 3.0, "{:?}", a.alone);
        rt.submit(0, "a", claim, a).map_err(|_| "no core").unwrap();
        let mut done = Vec::new();
        while rt.busy() {
            done.extend(rt.step(f64::INFINITY));
        }
        assert_eq!(done.len(), 1, "one completion for two stages");
        let c = &done[0];
        assert!(c.result.is_ok());
        assert_eq!((c.begin, c.end), (0.0, 2.0 * stage4), "two stages on 4 VUs back to back");
        let st = rt.stats(0);
        assert_eq!(st.stages, 2);
        let h = &st.harvest.iter().find(|h| h.0 == "a").unwrap().1;
        assert_eq!(h.borrowed_cycles, 3.0 * 2.0 * stage4, "3 VUs beyond the claim");

        // Again, with "b" arriving half-way through "a"'s first stage: it
        // waits for that stage to end, then runs on its 1+1 while "a"'s
        // second stage takes the other 3 VUs.
        let mut rt: Runtime<'_, AddStages> = Runtime::new(&board);
        rt.set_harvesting(false);
        rt.set_staging(Staging { boundary: Boundary::Lend, tolerance: 0.0 });
        rt.submit(0, "a", claim, add_stages(&board, 0, 2, 96)).map_err(|_| "no core").unwrap();
        let mut done = rt.step(stage4 / 2.0);
        assert!(done.is_empty());
        let b = add_stages(&board, 1, 1, 96);
        let b_alone = b.alone[0];
        rt.submit(0, "b", claim, b).map_err(|_| "no core").unwrap();
        while rt.busy() {
            done.extend(rt.step(f64::INFINITY));
        }
        assert_eq!(done.len(), 2);
        let st = rt.stats(0);
        let hb = &st.harvest.iter().find(|h| h.0 == "b").unwrap().1;
        assert_eq!((hb.reclaims, hb.reclaim_max_cycles), (1, stage4 / 2.0), "b waited for a's stage");
        let b_done = done.iter().find(|c| c.job.tenant == 1).unwrap();
        // One engine switch after it waited, then its stage on 1 VU (it
        // shares the core with a's stage, so at least its time alone).
        let switch = switch_cycles(&board);
        assert_eq!(b_done.begin, stage4 + switch);
        assert!(b_done.end >= b_done.begin + b_alone, "{b_done:?}");
    }
}
