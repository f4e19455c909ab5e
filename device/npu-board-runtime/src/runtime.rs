//! The one engine of sharing: the board's cores in one simulation
//! (`npu_model::BoardSim`), each with its dispatcher (`npu_scheduler`:
//! placement, preemption, harvesting), and what happened on each core.
//! [`Runtime`] is driven in simulated time: submit requests, step to the
//! next completion (or a given time), read the counters. The daemon's and
//! the in-process device's shared board ([`crate::SharedBoard`]) drive it
//! from the vNPUs' threads, coupling simulated to wall time; an evaluation
//! drives it with arrivals of its own. Either way, dispatch, budgets,
//! preemption, lending and the counters are this code's.

use std::sync::{Arc, Mutex};

use npu_model::{BoardConfig, BoardSim, Contention, CoreMemory, ExecError, SimTenant, TenantReport};
use npu_scheduler::{
    schedule, switch_cycles, AtStage, Claim, Decision, Dispatcher, Engines, Pending, Prema, StageTimes,
    Staging,
};
use vnpu_abi::Program;

/// Who runs next on a core, and what is preempted for it (default:
/// [`npu_scheduler::schedule`]; an evaluation may run a baseline's).
pub type Policy = fn(&BoardConfig, &[Pending], &[Pending]) -> Decision;

/// How the cores pick: a [`Policy`], PREMA's token order
/// ([`Runtime::set_prema`]), which also needs the time, or a boundary
/// policy for staged requests ([`Runtime::set_staging`]).
#[derive(Clone, Copy, Debug)]
enum Rule {
    Policy(Policy),
    Prema(Prema),
    Staged(Staging),
}

/// A request that runs as a sequence of stages, each on the engines it is
/// granted when it starts ([`Runtime::set_staging`]): the operator-task
/// systems' requests (vNPU-WC, Planaria-like, V10-like). Any other
/// request is one program on its claim: the default methods say so.
pub trait Staged {
    /// What it knows of its own work for the boundary policy; `None`: not
    /// staged.
    fn stage_times(&self) -> Option<&dyn StageTimes> {
        None
    }
    /// Its next stage runs on `engines`: from now its program
    /// ([`SimTenant::program`]) is that stage, made for them. A request
    /// that cannot run the stage there keeps the failure to report itself
    /// and ends the stage with an empty program.
    fn begin_stage(&mut self, _engines: Engines) {}
    /// Its current stage ended with `report`; whether another follows.
    fn end_stage(&mut self, _report: &TenantReport) -> bool {
        false
    }
}

/// The times of a request that is not staged: no shape is worth more than
/// its claim.
struct Fixed;

impl StageTimes for Fixed {
    fn next(&self, _: Engines) -> f64 {
        f64::INFINITY
    }
    fn rest(&self, _: Engines) -> f64 {
        f64::INFINITY
    }
}

/// A request with what the runtime knows of it.
struct Entry<J> {
    job: J,
    tenant: String,
    claim: Claim,
    arrival: f64,
    /// When its program starts on the core's timeline.
    begin: f64,
    /// A staged request: the engines of its current (or last) stage, when
    /// its first stage started, and since when it has waited at a
    /// boundary without a grant.
    stage: Option<Engines>,
    first: Option<f64>,
    blocked: Option<f64>,
}

impl<J> Entry<J> {
    /// The engines it holds on the core: its stage's, else its claim's.
    fn holds(&self) -> Engines {
        self.stage.unwrap_or(self.claim.engines())
    }

    /// The engines it holds beyond its claim (a stage's borrowed ones).
    fn beyond_claim(&self) -> Engines {
        self.holds().saturating_sub(self.claim.engines())
    }
}

impl<J: SimTenant> SimTenant for Entry<J> {
    fn program(&self) -> &Program {
        self.job.program()
    }
    fn memory(&mut self) -> Option<CoreMemory<'_>> {
        self.job.memory()
    }
    fn max_cycles(&self) -> Option<u64> {
        self.job.max_cycles()
    }
    fn max_host_work(&self) -> Option<u64> {
        self.job.max_host_work()
    }
    fn took_effect(&mut self, stream: usize, index: usize) {
        self.job.took_effect(stream, index);
    }
}

/// A request that finished (or failed).
#[derive(Debug)]
pub struct Completion<J> {
    pub core: usize,
    pub tenant: String,
    pub job: J,
    /// Its report; `cycles` count from its start on the core (after any
    /// wait for engines), `started` is 0.
    pub result: Result<TenantReport, ExecError>,
    /// On the board's timeline (cycles): when it was submitted, when its
    /// program started, when it ended.
    pub arrival: f64,
    pub begin: f64,
    pub end: f64,
}

/// A tenant's busy interval on the core's simulated timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Interval {
    pub tenant: String,
    pub start: f64,
    pub end: f64,
}

/// Busy intervals a core keeps before it folds the settled ones into
/// totals ([`CoreLog::fold`]): a daemon serves for ever, its log must not
/// grow with every request.
pub(crate) const FOLD_AT: usize = 1024;

/// What happened on one core of the board.
#[derive(Default)]
pub(crate) struct CoreLog {
    /// Busy intervals not folded yet (all of them end after `settled`).
    pub(crate) log: Vec<Interval>,
    /// Before this simulated time every interval is counted in
    /// `settled_busy` and `settled_overlap`: no request still to finish
    /// started before it.
    pub(crate) settled: f64,
    pub(crate) settled_busy: Vec<(String, f64)>,
    pub(crate) settled_overlap: f64,
    requests: u64,
    waited: u64,
    preempted: u64,
    killed: u64,
    killed_cycles: f64,
    stages: u64,
    slo_requests: u64,
    slo_misses: u64,
    /// Harvesting per tenant.
    harvest: Vec<(String, Harvest)>,
}

impl CoreLog {
    fn harvest(&mut self, tenant: &str) -> &mut Harvest {
        let i = match self.harvest.iter().position(|h| h.0 == tenant) {
            Some(i) => i,
            None => {
                self.harvest.push((tenant.to_string(), Harvest::default()));
                self.harvest.len() - 1
            }
        };
        &mut self.harvest[i].1
    }

    /// Counts everything before simulated time `frontier` (no interval
    /// still to come starts before it) in the settled totals and keeps
    /// only the parts of intervals after it. Busy time and overlap are
    /// sums over time, so the totals are exactly what the whole log gives.
    pub(crate) fn fold(&mut self, frontier: f64) {
        if frontier <= self.settled {
            return;
        }
        let before = self.log.iter().filter(|i| i.start < frontier);
        let busy = before.clone().map(|i| (i.tenant.as_str(), i.end.min(frontier) - i.start));
        add_busy(&mut self.settled_busy, busy);
        self.settled_overlap += overlap(before.map(|i| (i.start, i.end.min(frontier))));
        self.log.retain(|i| i.end > frontier);
        for i in &mut self.log {
            i.start = i.start.max(frontier);
        }
        self.settled = frontier;
    }

    fn stats(&self, now: f64) -> SharingStats {
        let mut tenants = self.settled_busy.clone();
        add_busy(&mut tenants, self.log.iter().map(|iv| (iv.tenant.as_str(), iv.end - iv.start)));
        SharingStats {
            requests: self.requests,
            waited: self.waited,
            preempted: self.preempted,
            killed: self.killed,
            killed_cycles: self.killed_cycles,
            stages: self.stages,
            busy_cycles: now,
            overlap_cycles: self.settled_overlap + overlap(self.log.iter().map(|i| (i.start, i.end))),
            tenants,
            slo_requests: self.slo_requests,
            slo_misses: self.slo_misses,
            harvest: self.harvest.clone(),
        }
    }
}

/// What harvesting did for and to one tenant of a core
/// (`docs/management.md`, "Harvesting").
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Harvest {
    /// Engine-cycles its spread programs ran on engines beyond its claim
    /// (`npu_model::TenantReport::borrowed_cycles`).
    pub borrowed_cycles: f64,
    /// Engine-cycles its own engines were granted to others, used or not,
    /// while its request could not use them or it had none on the core
    /// (engines no vNPU claims count first).
    pub lent_cycles: f64,
    /// Its requests that waited for borrowers to give engines back, the
    /// cycles they waited, and the longest wait.
    pub reclaims: u64,
    pub reclaim_cycles: f64,
    pub reclaim_max_cycles: f64,
}

/// What a core did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SharingStats {
    /// Requests served.
    pub requests: u64,
    /// Requests that had to wait for engines (only on an oversubscribed
    /// core).
    pub waited: u64,
    /// Times a running request was suspended for a more urgent one.
    pub preempted: u64,
    /// Times a running request was stopped and queued again from scratch
    /// (PREMA's KILL, [`Runtime::set_prema`]), and the SA and VU
    /// engine-cycles of the work dropped.
    pub killed: u64,
    pub killed_cycles: f64,
    /// Stages of staged requests run ([`Runtime::set_staging`]).
    pub stages: u64,
    /// The board's simulated time (cycles).
    pub busy_cycles: f64,
    /// Simulated cycles during which two or more tenants ran at once.
    pub overlap_cycles: f64,
    /// Busy cycles per tenant.
    pub tenants: Vec<(String, f64)>,
    /// Requests that had a latency target, and those that missed it.
    pub slo_requests: u64,
    pub slo_misses: u64,
    /// Harvesting per tenant (tenants it touched).
    pub harvest: Vec<(String, Harvest)>,
}

/// The board's cores in one simulation with their dispatchers and logs
/// (see the module's documentation).
pub struct Runtime<'c, J> {
    board: &'c BoardConfig,
    switch: f64,
    rule: Rule,
    sim: BoardSim<'c, Entry<J>>,
    dispatchers: Vec<Dispatcher<Entry<J>>>,
    /// Tenants seen on each core (HBM shares under the "equal" policy)
    /// with their latest claim (whose engines they lend while idle).
    tenants: Vec<Vec<(String, Claim)>>,
    /// Per core, (simulation id, engines free, issuing again) of every
    /// suspension of a request still on the core: its busy interval
    /// leaves them out (infinity: not resumed yet).
    gaps: Vec<Vec<(usize, f64, f64)>>,
    /// Per core, the engine-cycles each tenant's stages have held
    /// ([`npu_scheduler::Boundary::Interleave`]'s order).
    attained: Vec<Vec<(String, f64)>>,
    logs: Counters,
}

/// The per-core logs of a [`Runtime`], readable from other threads while
/// it steps ([`Runtime::counters`]): a step updates them in one short
/// lock, and the totals (busy time, overlap) are derived only when read.
#[derive(Clone, Default)]
pub struct Counters(Arc<Mutex<Vec<CoreLog>>>);

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters").finish_non_exhaustive()
    }
}

impl Counters {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<CoreLog>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What `core` did until the board's simulated time `now`.
    pub fn stats(&self, core: usize, now: f64) -> SharingStats {
        self.lock().get(core).map_or_else(SharingStats::default, |l| l.stats(now))
    }
}

impl<J: SimTenant + Staged> std::fmt::Debug for Runtime<'_, J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("now", &self.sim.now()).finish_non_exhaustive()
    }
}

impl<'c, J: SimTenant + Staged> Runtime<'c, J> {
    /// Every core of `board`, idle at time 0, harvesting on, scheduled by
    /// [`npu_scheduler::schedule`].
    pub fn new(board: &'c BoardConfig) -> Self {
        let sim = BoardSim::new(board);
        let n = sim.len();
        let core = Engines::new(board.core.sa_count, board.core.vu_count);
        Self {
            board,
            switch: switch_cycles(board),
            rule: Rule::Policy(schedule),
            sim,
            dispatchers: (0..n).map(|_| Dispatcher::harvesting(core)).collect(),
            tenants: vec![Vec::new(); n],
            gaps: vec![Vec::new(); n],
            attained: vec![Vec::new(); n],
            logs: Counters(Arc::new(Mutex::new((0..n).map(|_| CoreLog::default()).collect()))),
        }
    }

    /// Lends idle engines to spread programs from the next step on, or
    /// not (then every request runs on its claim's engines).
    pub fn set_harvesting(&mut self, on: bool) {
        let core = Engines::new(self.board.core.sa_count, self.board.core.vu_count);
        for d in &mut self.dispatchers {
            d.set_harvesting(on.then_some(core));
        }
    }

    /// Bounds the cycles of a compute instruction a request may start on
    /// a lent engine, from the next step on ([`CoreSim::set_lend_limit`]):
    /// an owner reclaims its engines within that many cycles. Infinity
    /// (the default): any instruction, the reclaim bound is then one
    /// instruction.
    ///
    /// [`CoreSim::set_lend_limit`]: npu_model::CoreSim::set_lend_limit
    pub fn set_lend_limit(&mut self, cycles: f64) {
        self.sim.set_lend_limit(cycles);
    }

    /// Which resources co-located requests contend for, from the next
    /// step on ([`npu_model::Contention`]; the default, everything, is
    /// the hardware's): the interference characterization's what-ifs.
    pub fn set_contention(&mut self, contention: Contention) {
        self.sim.set_contention(contention);
    }

    /// Runs every core by `policy` from the next step on.
    pub fn set_policy(&mut self, policy: Policy) {
        self.rule = Rule::Policy(policy);
        for d in &mut self.dispatchers {
            d.set_checkpoint(0.0, 0.0);
        }
    }

    /// Runs every core by PREMA's token order from the next step on
    /// ([`npu_scheduler::Prema`]): a preempted request's state is saved
    /// and restored in half of `prema.checkpoint` each, and a step also
    /// ends when a waiter's tokens overtake a running request's. Meant
    /// for requests whose programs can start again from scratch (a kill
    /// drops their work): the evaluations' baseline, not the daemon's
    /// policy. Requests weigh their waiting by the estimate they were
    /// submitted with ([`Runtime::submit_estimated`]).
    pub fn set_prema(&mut self, prema: Prema) {
        self.rule = Rule::Prema(prema);
        for d in &mut self.dispatchers {
            d.set_checkpoint(prema.checkpoint / 2.0, prema.checkpoint / 2.0);
        }
    }

    /// Runs every core by `staging`'s boundary policy from the next step
    /// on: at every pass each staged request waiting for its next stage
    /// ([`Staged`]) is granted engines (or waits) and starts its stage on
    /// them; a stage that ends queues the request's next one at once, and
    /// only its last stage completes the request. A request that waited
    /// at a boundary starts after one engine switch, as any request that
    /// waited; nothing is preempted. Requests that are not staged are
    /// granted their claim when it is free. A tenant that waited without a
    /// grant counts a reclaim ([`Harvest::reclaims`]), a stage on more
    /// engines than its claim counts the extra engine-cycles as borrowed,
    /// and the claims of tenants not using them as lent.
    pub fn set_staging(&mut self, staging: Staging) {
        self.rule = Rule::Staged(staging);
        for d in &mut self.dispatchers {
            d.set_checkpoint(0.0, 0.0);
        }
    }

    /// The board's cores.
    pub fn cores(&self) -> usize {
        self.sim.len()
    }

    /// The board's simulated time (cycles).
    pub fn now(&self) -> f64 {
        self.sim.now()
    }

    /// Requests are on the cores or waiting for engines.
    pub fn busy(&self) -> bool {
        !self.sim.is_idle() || self.dispatchers.iter().any(|d| d.waiting().next().is_some())
    }

    /// A request of `tenant` arrives on `core` now, claiming `claim`; it
    /// goes on the core at the next [`Runtime::step`]. Hands the job back
    /// if the board has no such core.
    pub fn submit(&mut self, core: usize, tenant: &str, claim: Claim, job: J) -> Result<(), J> {
        let now = self.sim.now();
        self.submit_arrived(core, tenant, claim, job, now)
    }

    /// As [`Runtime::submit`], for a request that arrived at simulated time
    /// `arrival` (no later than now: a request that queued behind its
    /// tenant's previous one, as in a guest's ring) and reaches the core
    /// now: its deadline and its place among equals count from `arrival`.
    pub fn submit_arrived(
        &mut self,
        core: usize,
        tenant: &str,
        claim: Claim,
        job: J,
        arrival: f64,
    ) -> Result<(), J> {
        self.submit_estimated(core, tenant, claim, job, arrival, 0.0)
    }

    /// As [`Runtime::submit_arrived`], with an estimate of the cycles the
    /// request takes alone on its claim ([`Pending::estimate`]: PREMA's
    /// token rate).
    pub fn submit_estimated(
        &mut self,
        core: usize,
        tenant: &str,
        claim: Claim,
        job: J,
        arrival: f64,
        estimate: f64,
    ) -> Result<(), J> {
        let arrival = arrival.min(self.sim.now());
        let (Some(seen), Some(c), Some(d)) =
            (self.tenants.get_mut(core), self.sim.core(core), self.dispatchers.get_mut(core))
        else {
            return Err(job);
        };
        match seen.iter_mut().find(|t| t.0 == tenant) {
            Some(t) => t.1 = claim,
            None => {
                seen.push((tenant.to_string(), claim));
                c.set_shares(seen.len());
            }
        }
        let estimate = if estimate.is_finite() { estimate.max(0.0) } else { 0.0 };
        let p = Pending { estimate, ..Pending::new(claim, arrival) };
        let entry = Entry {
            job,
            tenant: tenant.to_string(),
            claim,
            arrival,
            begin: arrival,
            stage: None,
            first: None,
            blocked: None,
        };
        d.submit(entry, p);
        Ok(())
    }

    /// One pass: on each core, place what fits (most urgent first,
    /// preempting for the most urgent one left over) and lend the idle
    /// engines; then advance the whole board to the next completion, or
    /// to simulated time `until` if none comes first. Returns the requests
    /// that finished.
    pub fn step(&mut self, until: f64) -> Vec<Completion<J>> {
        let board = self.board;
        let rule = self.rule;
        let now = self.sim.now();
        let mut until = until;
        let mut passes = Vec::with_capacity(self.dispatchers.len());
        // Per core, who borrows what until the next pass, and who waited
        // for engines to come back (named now: they may finish in this
        // step).
        let mut lending: Vec<Lending> = Vec::new();
        for (c, d) in self.dispatchers.iter_mut().enumerate() {
            let Some(core) = self.sim.core(c) else { continue };
            if core.is_idle() && d.waiting().next().is_none() {
                continue;
            }
            let mut staged_waits = Vec::new();
            let staged = match (rule, self.attained.get(c)) {
                (Rule::Staged(s), Some(attained)) => {
                    Some(grant_stages(board, s, core, d, attained, now, &mut staged_waits))
                }
                _ => None,
            };
            let pass = d.dispatch(
                core,
                self.switch,
                |w, r| match (rule, staged) {
                    (_, Some(place)) => Decision { place, ..Decision::default() },
                    (Rule::Policy(policy), None) => policy(board, w, r),
                    (Rule::Prema(p), None) => p.decide(board, now, w, r),
                    (Rule::Staged(_), None) => Decision::default(),
                },
                |j, at| j.begin = at,
            );
            if let Rule::Prema(p) = rule {
                let (w, r) = d.pending(now);
                if let Some(t) = p.next_decision(now, &w, &r) {
                    until = until.min(t);
                }
            }
            let name = |id: usize| core.job(id).map(|j| j.tenant.clone());
            let mut borrowing: Vec<(String, Engines)> =
                pass.borrowing.iter().filter_map(|&(id, g)| Some((name(id)?, g))).collect();
            let mut reclaimed: Vec<(String, f64)> =
                pass.reclaimed.iter().filter_map(|&(id, d)| Some((name(id)?, d))).collect();
            if let Rule::Staged(_) = rule {
                // Stages on more engines than their claims borrow them.
                borrowing.extend(core.jobs().filter_map(|j| {
                    let extra = j.beyond_claim();
                    (extra.total() > 0).then(|| (j.tenant.clone(), extra))
                }));
                reclaimed.append(&mut staged_waits);
            }
            let unused: Vec<(String, Engines)> =
                pass.unused.iter().filter_map(|&(id, u)| Some((name(id)?, u))).collect();
            if !borrowing.is_empty() || !reclaimed.is_empty() {
                let running = core.jobs().map(|j| j.tenant.clone()).collect();
                lending.push(Lending { core: c, borrowing, reclaimed, unused, running });
            }
            passes.push((c, pass));
        }
        let before = self.sim.now();
        let done = self.sim.step_until(until);
        let dt = (self.sim.now() - before).max(0.0);
        let mut logs = self.logs.lock();
        for Lending { core: c, borrowing, reclaimed, unused, running } in lending {
            let (Some(log), Some(seen)) = (logs.get_mut(c), self.tenants.get(c)) else {
                continue;
            };
            for (tenant, wait) in reclaimed {
                let h = log.harvest(&tenant);
                h.reclaims += 1;
                h.reclaim_cycles += wait;
                h.reclaim_max_cycles = h.reclaim_max_cycles.max(wait);
            }
            let lent = borrowing.iter().fold(Engines::default(), |a, (_, g)| a.saturating_add(*g));
            for (tenant, cycles) in lenders(board, seen, &running, &unused, lent) {
                log.harvest(&tenant).lent_cycles += cycles * dt;
            }
        }
        for (c, pass) in passes {
            if let Some(log) = logs.get_mut(c) {
                log.waited += pass.waited;
                log.preempted += pass.preempted;
                log.killed += pass.killed.len() as u64;
                log.killed_cycles += pass.killed.iter().map(|k| k.1).sum::<f64>();
            }
            let Some(g) = self.gaps.get_mut(c) else { continue };
            // A killed request starts again under a new simulation id.
            g.retain(|x| !pass.killed.iter().any(|k| k.0 == x.0));
            g.extend(pass.suspended.iter().map(|&(id, at)| (id, at, f64::INFINITY)));
            for (id, at) in pass.resumed {
                if let Some(open) = g.iter_mut().find(|x| x.0 == id && x.2.is_infinite()) {
                    open.2 = at;
                }
            }
        }
        let now = self.sim.now();
        let mut out = Vec::with_capacity(done.len());
        for (c, (id, mut entry, r)) in done {
            if let Some(d) = self.dispatchers.get_mut(c) {
                d.finished(id);
            }
            let end = r.as_ref().map_or(now, |t| t.cycles);
            let begin = entry.begin.min(end);
            if let (Some(e), Ok(t)) = (entry.stage, &r) {
                // A stage ended: what it held, and its next stage if any.
                let held = f64::from(e.total()) * (end - begin);
                if let Some(a) = self.attained.get_mut(c) {
                    add_busy(a, std::iter::once((entry.tenant.as_str(), held)));
                }
                let extra = entry.beyond_claim();
                if let Some(log) = logs.get_mut(c) {
                    log.stages += 1;
                    if extra.total() > 0 {
                        log.harvest(&entry.tenant).borrowed_cycles +=
                            f64::from(extra.total()) * (end - begin);
                    }
                }
                entry.first.get_or_insert(begin);
                if entry.job.end_stage(t) {
                    if let Some(log) = logs.get_mut(c) {
                        log.log.push(Interval { tenant: entry.tenant.clone(), start: begin, end });
                    }
                    let p = Pending::new(entry.claim, entry.arrival);
                    if let Some(d) = self.dispatchers.get_mut(c) {
                        d.resubmit(entry, p);
                    }
                    continue;
                }
            }
            let mut mine: Vec<(f64, f64)> = Vec::new();
            if let Some(g) = self.gaps.get_mut(c) {
                mine = g.iter().filter(|x| x.0 == id).map(|x| (x.1, x.2)).collect();
                g.retain(|x| x.0 != id);
            }
            if let Some(log) = logs.get_mut(c) {
                if let Ok(t) = &r {
                    if t.borrowed_cycles > 0.0 {
                        log.harvest(&entry.tenant).borrowed_cycles += t.borrowed_cycles;
                    }
                }
                for (start, stop) in busy_intervals(begin, end, mine) {
                    log.log.push(Interval { tenant: entry.tenant.clone(), start, end: stop });
                }
                log.requests += 1;
                if entry.claim.slo_cycles > 0 {
                    log.slo_requests += 1;
                    let deadline = Pending::new(entry.claim, entry.arrival).deadline();
                    log.slo_misses += u64::from(end > deadline);
                }
                if log.log.len() >= FOLD_AT {
                    // Requests still to finish on this core arrived no
                    // earlier than the oldest unfinished one, and new ones
                    // arrive now or later: nothing will start before that.
                    let oldest = self.dispatchers.get(c).and_then(Dispatcher::oldest_arrival);
                    log.fold(oldest.map_or(now, |a| a.min(now)));
                }
            }
            // The requester sees its own request's time: cycles from its
            // start on the core (after any wait for engines) to its
            // completion, not the board's clock.
            let result = r.map(|mut t| {
                t.cycles = (t.cycles - t.started).max(0.0);
                t.started = 0.0;
                t
            });
            let Entry { job, tenant, arrival, first, .. } = entry;
            let begin = first.unwrap_or(begin);
            out.push(Completion { core: c, tenant, job, result, arrival, begin, end });
        }
        out
    }

    /// Busy time, overlap, per-tenant use and harvesting of `core` so far.
    pub fn stats(&self, core: usize) -> SharingStats {
        self.logs.stats(core, self.sim.now())
    }

    /// A handle on the cores' counters for other threads.
    pub fn counters(&self) -> Counters {
        self.logs.clone()
    }

    /// Busy intervals `core` keeps unfolded (bounded by [`FOLD_AT`]).
    #[cfg(test)]
    pub(crate) fn kept_intervals(&self, core: usize) -> usize {
        self.logs.lock().get(core).map_or(0, |l| l.log.len())
    }
}

/// The staged requests waiting on `core` that start a stage now (indices
/// into its waiting list, in order), by `staging`'s boundary policy; each
/// gets its stage on the engines granted. Pushes (tenant, cycles) of each
/// that had waited at a boundary without a grant to `waits`.
fn grant_stages<J: SimTenant + Staged>(
    board: &BoardConfig,
    staging: Staging,
    core: &npu_model::CoreSim<'_, Entry<J>>,
    d: &mut Dispatcher<Entry<J>>,
    attained: &[(String, f64)],
    now: f64,
    waits: &mut Vec<(String, f64)>,
) -> Vec<usize> {
    let engines = Engines::new(board.core.sa_count, board.core.vu_count);
    let running: Vec<Engines> = core.jobs().map(Entry::holds).collect();
    let grants = {
        let at: Vec<AtStage<'_>> = d
            .waiting()
            .map(|e| AtStage {
                guaranteed: e.claim.engines(),
                priority: e.claim.priority,
                to_deadline: match e.claim.slo_cycles {
                    0 => f64::INFINITY,
                    slo => e.arrival + slo as f64 - now,
                },
                attained: attained.iter().find(|a| a.0 == e.tenant).map_or(0.0, |a| a.1),
                times: e.job.stage_times().unwrap_or(&Fixed),
            })
            .collect();
        staging.grant(engines, &running, &at)
    };
    let mut place = Vec::new();
    for (k, ((e, p), g)) in d.waiting_mut().zip(grants).enumerate() {
        let Some(g) = g else {
            e.blocked.get_or_insert(now);
            continue;
        };
        if e.job.stage_times().is_some() {
            e.job.begin_stage(g);
            e.stage = Some(g);
            p.claim.sa = g.sa;
            p.claim.vu = g.vu;
        }
        if let Some(since) = e.blocked.take() {
            waits.push((e.tenant.clone(), now - since));
        }
        place.push(k);
    }
    place
}

/// One core's lending in one pass: (tenant, engines it borrows until the
/// next pass), (tenant, cycles its request placed now waits for
/// borrowers to give engines back), (tenant, engines of its running
/// request's claim its program cannot use) and the tenants with a request
/// on the core.
struct Lending {
    core: usize,
    borrowing: Vec<(String, Engines)>,
    reclaimed: Vec<(String, f64)>,
    unused: Vec<(String, Engines)>,
    running: Vec<String>,
}

/// Whose engines `lent` are (engines lent on a core now): first the
/// engines no tenant `seen` on the core claims, then the engines of
/// running requests' claims their programs cannot use (`unused`), then,
/// in the order they were seen, the claimed engines of tenants with no
/// request `running`, each up to its claim. Returns (tenant, engines of
/// its lent).
fn lenders(
    board: &BoardConfig,
    seen: &[(String, Claim)],
    running: &[String],
    unused: &[(String, Engines)],
    lent: Engines,
) -> Vec<(String, f64)> {
    let claimed = seen.iter().fold(Engines::default(), |a, (_, c)| a.saturating_add(c.engines()));
    let core = Engines::new(board.core.sa_count, board.core.vu_count);
    let mut left = lent.saturating_sub(core.saturating_sub(claimed));
    let idle = seen.iter().filter(|(t, _)| !running.contains(t)).map(|(t, c)| (t, c.engines()));
    let mut out: Vec<(String, f64)> = Vec::new();
    for (tenant, own) in unused.iter().map(|(t, u)| (t, *u)).chain(idle) {
        let from = left.min(own);
        left = left.saturating_sub(from);
        if from.total() > 0 {
            match out.iter_mut().find(|o| &o.0 == tenant) {
                Some(o) => o.1 += f64::from(from.total()),
                None => out.push((tenant.clone(), f64::from(from.total()))),
            }
        }
    }
    out
}

/// Adds each (tenant, cycles) to `into`'s entry of that tenant.
pub(crate) fn add_busy<'a>(into: &mut Vec<(String, f64)>, busy: impl Iterator<Item = (&'a str, f64)>) {
    for (tenant, cycles) in busy {
        match into.iter_mut().find(|(t, _)| t == tenant) {
            Some(e) => e.1 += cycles,
            None => into.push((tenant.to_string(), cycles)),
        }
    }
}

/// Time during which two or more of `intervals` (start, end) run: a sweep
/// of their end points.
pub(crate) fn overlap(intervals: impl Iterator<Item = (f64, f64)>) -> f64 {
    let mut ev: Vec<(f64, i32)> = intervals.flat_map(|(s, e)| [(s, 1), (e, -1)]).collect();
    ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut active, mut last, mut total) = (0, 0.0, 0.0);
    for (t, d) in ev {
        if active >= 2 {
            total += t - last;
        }
        active += d;
        last = t;
    }
    total
}

/// A request's busy intervals: from `begin` to `end`, less its
/// suspensions (engines free, issuing again; infinity: never resumed).
fn busy_intervals(begin: f64, end: f64, mut gaps: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    gaps.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut runs = Vec::new();
    let mut from = begin;
    for (stop, again) in gaps {
        if stop > from {
            runs.push((from, stop.min(end)));
        }
        from = from.max(again.min(end));
    }
    if end > from || runs.is_empty() {
        runs.push((from.min(end), end));
    }
    runs
}
