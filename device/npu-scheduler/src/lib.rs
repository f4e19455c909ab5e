//! Which requests of a shared physical core run, when, and on what: the
//! scheduling policy of the board runtime, apart from any device or VMM.
//!
//! - [`Claim`]: what a tenant occupies on a core and how urgent it is;
//! - [`schedule`]: the policy (priority, then earliest deadline, first fit;
//!   preemption of less urgent requests for the most urgent one);
//! - [`Dispatcher`]: the requests of one core that have not finished,
//!   applying the policy's decisions to the core's simulation
//!   (`npu_model::CoreSim`, or a core of a `npu_model::BoardSim`).
//!
//! - [`lending`]: work-conserving lending of idle engines at task
//!   boundaries (guarantees first, then idle engines by urgency along each
//!   tenant's profile), used by `sharing-eval`'s work-conserving system.
//!
//! The device's shared board (`npu_board_runtime::SharedBoard`) and the
//! evaluations (`npu-bench`'s `slo-eval`, `sharing-eval`) run their cores
//! through it; `docs/management.md` describes the policy.

use npu_model::{BoardConfig, CoreSim, SimTenant};

pub mod lending;
pub use lending::{
    fission, least_shape, lend, lending_order, pick_shape, shapes_between, AtBoundary, AtStage, Boundary,
    Engines, StageTimes, Staging,
};

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
    /// Idle engines of the core a spread program may run on beyond `sa`
    /// and `vu` ([`harvest`]).
    pub borrow: Engines,
}

impl Claim {
    /// Every SA and VU of a core of `board`, nothing else set.
    pub fn whole_core(board: &BoardConfig) -> Self {
        Self { sa: board.core.sa_count, vu: board.core.vu_count, ..Self::default() }
    }

    /// Its SAs and VUs.
    pub fn engines(&self) -> Engines {
        Engines::new(self.sa, self.vu)
    }
}

/// Cycles to switch engines from one tenant's request to another's: drain the SA pipelines (2 x rows + cols) and the VU pipeline, then
/// load the next tenants' first weights (one SA tile over the DMA engine).
pub fn switch_cycles(board: &BoardConfig) -> f64 {
    let c = &board.core;
    let drain = f64::from(2 * c.sa_rows + c.sa_cols + c.vu_latency_cycles);
    let tile = f64::from(c.sa_rows * c.sa_cols * 4);
    drain + board.ns_to_cycles(board.dma.latency_ns) + tile / board.gbps_to_bytes_per_cycle(board.dma.gbps)
}

/// The order in which waiting requests get engines on an oversubscribed
/// core: most urgent first ([`Pending::urgency`]), then earliest arrival,
/// then the order given.
pub fn admission_order(waiting: &[Pending]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..waiting.len()).collect();
    order.sort_by(|&a, &b| {
        waiting[b].urgency(&waiting[a]).then(waiting[a].arrival.total_cmp(&waiting[b].arrival))
    });
    order
}

/// Which waiting requests go on the core now: in `order` (most urgent
/// first, see [`admission_order`]), each one whose claim fits beside the
/// `running` claims and those placed before it (first fit); on an idle
/// core the first one in any case. Returns indices into `waiting`.
pub fn placements(board: &BoardConfig, waiting: &[Claim], order: &[usize], running: &[Claim]) -> Vec<usize> {
    let (mut sa, mut vu) =
        running.iter().fold((0u32, 0u32), |(a, b), c| (a.saturating_add(c.sa), b.saturating_add(c.vu)));
    let mut place = Vec::new();
    for &i in order {
        let Some(c) = waiting.get(i) else { continue };
        let fits =
            sa.saturating_add(c.sa) <= board.core.sa_count && vu.saturating_add(c.vu) <= board.core.vu_count;
        if fits || (running.is_empty() && place.is_empty()) {
            place.push(i);
            sa = sa.saturating_add(c.sa);
            vu = vu.saturating_add(c.vu);
        }
    }
    place
}

/// A request as the placement policy sees it: what it claims and when it
/// arrived on the core's timeline.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pending {
    pub claim: Claim,
    pub arrival: f64,
    /// Cycles it takes alone on its claim, as whoever submitted it
    /// estimates them (0: unknown); [`Prema`] weighs waiting by it.
    pub estimate: f64,
    /// Cycles it has issued on the core so far (0 until it is placed;
    /// [`Dispatcher`] keeps it for running and suspended requests).
    pub ran: f64,
}

impl Pending {
    /// A request of `claim` that arrived at `arrival`, its time unknown.
    pub fn new(claim: Claim, arrival: f64) -> Self {
        Self { claim, arrival, ..Self::default() }
    }

    /// When it must finish on the core's timeline (infinity: no target).
    pub fn deadline(&self) -> f64 {
        match self.claim.slo_cycles {
            0 => f64::INFINITY,
            c => self.arrival + c as f64,
        }
    }

    /// How its urgency compares with `other`'s (greater = more urgent):
    /// higher priority, then earlier deadline.
    pub fn urgency(&self, other: &Pending) -> std::cmp::Ordering {
        self.claim.priority.cmp(&other.claim.priority).then(other.deadline().total_cmp(&self.deadline()))
    }
}

/// The idle engines each running request gets beyond its claim
/// (harvesting): `core`'s engines that no running request can use (`uses`:
/// of its claim, what its program has streams for, [`uses`]) go, most
/// urgent request first ([`admission_order`]), to the requests that can
/// use more (`wants`: at most what each one's claim lets it borrow and
/// its spread program has logical streams for), and the rest to the
/// next. Claims come first, so a request placed on the core takes back
/// what its program needs from the borrowers.
pub fn harvest(core: Engines, running: &[Pending], wants: &[Engines], uses: &[Engines]) -> Vec<Engines> {
    let held = uses.iter().fold(Engines::default(), |a, u| a.saturating_add(*u));
    let mut idle = core.saturating_sub(held);
    let mut out = vec![Engines::default(); running.len()];
    for i in admission_order(running) {
        let (Some(w), Some(o)) = (wants.get(i), out.get_mut(i)) else { continue };
        *o = w.min(idle);
        idle = idle.saturating_sub(*o);
    }
    out
}

/// What request `p` of `program` can use of its claim: all of it for the
/// kinds its program has as many streams of, else one engine per stream
/// (a program with no VU stream never uses its claim's VUs: they can be
/// lent for as long as it runs).
pub fn uses(program: &vnpu_abi::Program, p: &Pending) -> Engines {
    let (sa, vu) = program.compute_streams();
    Engines::new(sa, vu).min(p.claim.engines())
}

/// What request `p` of `program` can use beyond its claim: the smaller of
/// its borrowing cap and its logical streams beyond the claim (nothing
/// unless the program is spread).
pub fn wants(program: &vnpu_abi::Program, p: &Pending) -> Engines {
    if !program.spread {
        return Engines::default();
    }
    let (sa, vu) = program.compute_streams();
    Engines::new(sa.saturating_sub(p.claim.sa), vu.saturating_sub(p.claim.vu)).min(p.claim.borrow)
}

/// One scheduling pass of an oversubscribed core.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// Waiting requests that go on the core now (indices into `waiting`).
    pub place: Vec<usize>,
    /// Running requests to suspend so the most urgent waiting one fits
    /// (indices into `running`); it is the last of `place`.
    pub preempt: Vec<usize>,
    /// Running requests to stop and start again from scratch later
    /// (indices into `running`, none of them in `preempt`; PREMA's KILL,
    /// [`Prema`]): their work is dropped, they wait again.
    pub kill: Vec<usize>,
}

/// The placement policy: what fits goes on the core ([`placements`], most
/// urgent first); then, if the most urgent request left over is more
/// urgent (higher priority, or the same priority and an earlier deadline)
/// than some running ones, the least urgent of those are suspended until
/// it fits. Requests of equal priority without latency targets never
/// preempt each other, and a preempted request is less urgent than the one
/// that preempted it, so preemption cannot go in circles.
pub fn schedule(board: &BoardConfig, waiting: &[Pending], running: &[Pending]) -> Decision {
    let order = admission_order(waiting);
    let mut place = placements(board, &claims(waiting), &order, &claims(running));
    let Some(&w) = order.iter().find(|i| !place.contains(i)) else {
        return Decision { place, ..Decision::default() };
    };
    let want = waiting[w];
    let mut victims: Vec<usize> = (0..running.len()).filter(|&r| running[r].urgency(&want).is_lt()).collect();
    // Least urgent first; among equals the latest arrival.
    victims.sort_by(|&a, &b| {
        running[a].urgency(&running[b]).then(running[b].arrival.total_cmp(&running[a].arrival))
    });
    let mut preempt = Vec::new();
    for v in victims {
        preempt.push(v);
        if fits_without(board, running, &preempt, waiting, &place, want.claim) {
            place.push(w);
            return Decision { place, preempt, ..Decision::default() };
        }
    }
    Decision { place, ..Decision::default() }
}

/// A baseline policy (PREMA's NP-FCFS): waiting requests in arrival
/// order, each placed if its claim fits (first fit), nothing preempted;
/// priorities and deadlines ignored. `slo-eval` and `sharing-eval` run it
/// through the board runtime (`Runtime::set_policy`).
pub fn fifo(board: &BoardConfig, waiting: &[Pending], running: &[Pending]) -> Decision {
    let mut order: Vec<usize> = (0..waiting.len()).collect();
    order.sort_by(|&a, &b| waiting[a].arrival.total_cmp(&waiting[b].arrival));
    Decision { place: placements(board, &claims(waiting), &order, &claims(running)), ..Decision::default() }
}

/// What each of `ps` claims.
fn claims(ps: &[Pending]) -> Vec<Claim> {
    ps.iter().map(|p| p.claim).collect()
}

/// Whether `want` fits on a core of `board` beside the `running` requests
/// but those in `gone` (indices into `running`: stopped for it) and the
/// waiting ones already placed this pass (`place`: indices into
/// `waiting`).
fn fits_without(
    board: &BoardConfig,
    running: &[Pending],
    gone: &[usize],
    waiting: &[Pending],
    place: &[usize],
    want: Claim,
) -> bool {
    let on = (0..running.len()).filter(|r| !gone.contains(r)).map(|r| running[r].claim);
    let (sa, vu) = on
        .chain(place.iter().map(|&i| waiting[i].claim))
        .fold((0u32, 0u32), |(a, b), c| (a.saturating_add(c.sa), b.saturating_add(c.vu)));
    sa.saturating_add(want.sa) <= board.core.sa_count && vu.saturating_add(want.vu) <= board.core.vu_count
}

/// PREMA's scheduler (Choi and Rhu, "PREMA: A Predictive Multi-task
/// Scheduling Algorithm For Preemptible Neural Processing Units", HPCA
/// 2020, Algorithm 2 and its preemption mechanisms), the baseline
/// `sharing-eval` compares with:
///
/// - **Tokens.** A request starts with its priority's worth of tokens and
///   gains priority x (time waited / its estimated time alone): its
///   priority times its slowdown so far, `priority x (1 + waited /
///   estimate)` ([`Prema::tokens`]). Time it runs does not count as waited.
/// - **Threshold.** The highest of PREMA's priority levels (1, 3, 9: low,
///   medium, high) that the largest token count of the requests (waiting
///   and running) has reached ([`Prema::threshold`]).
/// - **Candidates and pick.** The requests with at least the threshold's
///   tokens are the candidates; the one with the shortest estimated time
///   left (estimate minus what it has run) goes first, then the next
///   (first fit, earliest arrival breaking ties; with whole-core claims one
///   at a time).
/// - **Preemption.** When a waiting candidate is picked before a running
///   request that holds engines it needs, the running one stops for it (if
///   its time left exceeds the candidate's by more than `margin`
///   checkpoints; `margin` infinite: never, PREMA-drain) by one of
///   PREMA's three mechanisms: **DRAIN** (it finishes first) if it would
///   end within one checkpoint anyway, **KILL** (if `kill`; its work is
///   dropped and it starts again later) if it has run for less than one
///   checkpoint, else **CHECKPOINT** (suspended, its state saved and
///   restored later: the dispatcher's costs,
///   [`Dispatcher::set_checkpoint`]).
///
/// Decisions are taken when requests arrive or finish and when a waiting
/// request's tokens reach a level that changes the threshold or makes it a
/// candidate ([`Prema::next_decision`]). Departures from the paper, and
/// why: the estimates are each request's isolated time on the core as the
/// model runs it (the paper's predictor estimates it from the layer
/// shapes); decisions are taken at those events, not at a scheduling
/// period the paper leaves to the system; the mechanism thresholds are one
/// checkpoint (the paper picks the mechanism by comparing costs, and one
/// checkpoint is the cost to compare against). Tested by hand-computed
/// streams (`prema_picks_the_shortest_candidate_past_the_threshold`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prema {
    /// How much shorter (in checkpoints) a waiting candidate's time left
    /// must be than a running request's to stop it (0: any shorter;
    /// infinity: never preempt, PREMA-drain).
    pub margin: f64,
    /// PREMA's KILL for a request that has run for less than one
    /// checkpoint (else it is checkpointed too).
    pub kill: bool,
    /// Cycles of one checkpoint and restore of a request's state.
    pub checkpoint: f64,
}

/// PREMA's priority levels (low, medium, high), the thresholds.
pub const PREMA_LEVELS: [f64; 3] = [1.0, 3.0, 9.0];

impl Prema {
    /// The tokens of `p` at `now`: priority (at least 1) x (1 + time
    /// waited / estimate), waited being the time since its arrival that it
    /// did not run (estimate at least 1 cycle).
    pub fn tokens(p: &Pending, now: f64) -> f64 {
        let waited = (now - p.arrival - p.ran).max(0.0);
        f64::from(p.claim.priority.max(1)) * (1.0 + waited / p.estimate.max(1.0))
    }

    /// The highest priority level the largest of `tokens` has reached (the
    /// lowest level when there are none).
    pub fn threshold(tokens: impl IntoIterator<Item = f64>) -> f64 {
        let top = tokens.into_iter().fold(f64::NEG_INFINITY, f64::max);
        PREMA_LEVELS.iter().copied().filter(|&l| top >= l).fold(PREMA_LEVELS[0], f64::max)
    }

    /// Cycles `p` has left by its estimate.
    fn left(p: &Pending) -> f64 {
        (p.estimate - p.ran).max(0.0)
    }

    /// One pass at simulated time `now` (see the type's documentation):
    /// `waiting` and `running` as [`schedule`] takes them.
    pub fn decide(
        &self,
        board: &BoardConfig,
        now: f64,
        waiting: &[Pending],
        running: &[Pending],
    ) -> Decision {
        let threshold = Self::threshold(waiting.iter().chain(running).map(|p| Self::tokens(p, now)));
        // Waiting candidates, shortest time left first, then arrival.
        let mut order: Vec<usize> =
            (0..waiting.len()).filter(|&i| Self::tokens(&waiting[i], now) >= threshold).collect();
        order.sort_by(|&a, &b| {
            Self::left(&waiting[a])
                .total_cmp(&Self::left(&waiting[b]))
                .then(waiting[a].arrival.total_cmp(&waiting[b].arrival))
        });
        let mut place = placements(board, &claims(waiting), &order, &claims(running));
        if place.len() < order.len() && !running.is_empty() && self.margin.is_finite() {
            // The first candidate left over may stop running requests that
            // come after it in PREMA's order: not candidates, or with more
            // time left by the margin.
            let Some(&w) = order.iter().find(|i| !place.contains(i)) else {
                return Decision { place, ..Decision::default() };
            };
            let want = waiting[w];
            let bar = Self::left(&want) + self.margin * self.checkpoint;
            let mut behind: Vec<usize> = (0..running.len())
                .filter(|&r| Self::tokens(&running[r], now) < threshold || Self::left(&running[r]) > bar)
                .collect();
            // Most time left first.
            behind.sort_by(|&a, &b| Self::left(&running[b]).total_cmp(&Self::left(&running[a])));
            let (mut preempt, mut kill, mut gone) = (Vec::new(), Vec::new(), Vec::new());
            for r in behind {
                let p = running[r];
                if Self::left(&p) <= self.checkpoint {
                    // DRAIN: it ends within a checkpoint anyway.
                    continue;
                }
                if self.kill && p.ran < self.checkpoint {
                    kill.push(r);
                } else {
                    preempt.push(r);
                }
                gone.push(r);
                if fits_without(board, running, &gone, waiting, &place, want.claim) {
                    place.push(w);
                    return Decision { place, preempt, kill };
                }
            }
        }
        if place.is_empty() && running.is_empty() {
            // An idle core with no candidate cannot happen (the largest
            // token reaches the threshold), but never leave it idle.
            place = placements(board, &claims(waiting), &(0..waiting.len()).collect::<Vec<_>>(), &[]);
            place.truncate(1);
        }
        Decision { place, ..Decision::default() }
    }

    /// The first moment after `now` at which a waiting request's tokens
    /// reach a priority level above its current count (which may change
    /// the threshold or make it a candidate), a little past it; `None` if
    /// nothing waits or preemption is off.
    pub fn next_decision(&self, now: f64, waiting: &[Pending], running: &[Pending]) -> Option<f64> {
        if running.is_empty() || self.margin.is_infinite() {
            return None;
        }
        let mut next = f64::INFINITY;
        for w in waiting {
            let have = Self::tokens(w, now);
            let prio = f64::from(w.claim.priority.max(1));
            for level in PREMA_LEVELS.iter().copied().filter(|&l| l > have) {
                // prio (1 + (t - arrival - ran) / estimate) = level.
                let t = w.arrival + w.ran + w.estimate.max(1.0) * (level / prio - 1.0);
                if t > now {
                    next = next.min(t + 1e-3);
                }
            }
        }
        next.is_finite().then_some(next)
    }
}

/// The requests of one shared core that have not finished: waiting for
/// engines, running, or suspended. [`Dispatcher::dispatch`] applies a
/// scheduling [`Decision`] to the core's simulation. The device's shared
/// core and `slo-eval` both run their cores through it.
#[derive(Debug)]
pub struct Dispatcher<J> {
    /// Not on the core yet, in arrival order, with whether a pass has
    /// passed it over (it then pays a context switch).
    waiting: Vec<(J, Pending, bool)>,
    /// (simulation id, request) on the core, issuing or suspended.
    running: Vec<(usize, Pending)>,
    suspended: Vec<(usize, Pending)>,
    /// The engines of the core ([`Dispatcher::harvesting`]); `None`: no
    /// request borrows.
    core: Option<Engines>,
    /// Cycles to save a preempted request's state and to restore it
    /// ([`Dispatcher::set_checkpoint`]).
    save: f64,
    restore: f64,
    /// (simulation id, when it issues again) of each running request.
    issuing: Vec<(usize, f64)>,
}

/// What one [`Dispatcher::dispatch`] pass did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dispatched {
    /// Requests placed that had waited for engines.
    pub waited: u64,
    /// Running requests suspended for a more urgent one.
    pub preempted: u64,
    /// (simulation id, engine-cycles of SA and VU work dropped) of each
    /// running request killed ([`Decision::kill`]); it waits again.
    pub killed: Vec<(usize, f64)>,
    /// (simulation id, when its engines are free: now plus what it had in
    /// flight) of each request suspended.
    pub suspended: Vec<(usize, f64)>,
    /// (simulation id, when it issues again) of each suspended request
    /// resumed.
    pub resumed: Vec<(usize, f64)>,
    /// (simulation id, idle engines it runs on beyond its claim from now)
    /// of each running request that borrows ([`harvest`]).
    pub borrowing: Vec<(usize, Engines)>,
    /// (simulation id, engines of its claim its program cannot use) of
    /// each running request that leaves some of its claim idle ([`uses`]).
    pub unused: Vec<(usize, Engines)>,
    /// (simulation id, cycles) of each request placed or resumed this
    /// pass that waited for borrowers to give engines back: the
    /// instructions running on them finish first.
    pub reclaimed: Vec<(usize, f64)>,
}

impl<J> Default for Dispatcher<J> {
    fn default() -> Self {
        Self {
            waiting: Vec::new(),
            running: Vec::new(),
            suspended: Vec::new(),
            core: None,
            save: 0.0,
            restore: 0.0,
            issuing: Vec::new(),
        }
    }
}

impl<J> Dispatcher<J> {
    /// A dispatcher that lends `core`'s idle engines to spread programs
    /// ([`harvest`]) at every pass, and takes them back for the claims of
    /// the requests it places.
    pub fn harvesting(core: Engines) -> Self {
        Self { core: Some(core), ..Self::default() }
    }

    /// Lends `core`'s idle engines from the next pass on (`None`: no
    /// more lending; what is lent now is taken back at the next pass).
    pub fn set_harvesting(&mut self, core: Option<Engines>) {
        self.core = core;
    }

    /// A preempted request's state is saved (`save` cycles, after what
    /// it has in flight drains, before the preemptor starts) and restored
    /// (`restore` cycles, before it issues again): engines that must be
    /// handed over with their SRAM, as on a whole core time-shared by
    /// [`Prema`]. Default 0: a suspended request keeps its SRAM.
    pub fn set_checkpoint(&mut self, save: f64, restore: f64) {
        self.save = save.max(0.0);
        self.restore = restore.max(0.0);
    }
}

impl<J: SimTenant> Dispatcher<J> {
    /// A request arrives (after those already waiting).
    pub fn submit(&mut self, job: J, p: Pending) {
        self.waiting.push((job, p, false));
    }

    /// A request that arrived at `p.arrival` waits again (a staged
    /// request between stages): among the waiting in arrival order.
    pub fn resubmit(&mut self, job: J, p: Pending) {
        self.insert_by_arrival((job, p, false));
    }

    /// Puts `w` among the waiting in arrival order (after equals).
    fn insert_by_arrival(&mut self, w: (J, Pending, bool)) {
        let at = self.waiting.iter().position(|x| x.1.arrival > w.1.arrival).unwrap_or(self.waiting.len());
        self.waiting.insert(at, w);
    }

    /// Requests not on the core yet.
    pub fn waiting(&self) -> impl Iterator<Item = &J> {
        self.waiting.iter().map(|w| &w.0)
    }

    /// Requests not on the core yet, with what the policy will see of
    /// them (a staged request's claim is set to the engines its next
    /// stage is granted before it is placed).
    pub fn waiting_mut(&mut self) -> impl Iterator<Item = (&mut J, &mut Pending)> {
        self.waiting.iter_mut().map(|w| (&mut w.0, &mut w.1))
    }

    /// One scheduling pass: `decide` sees the waiting requests followed by
    /// the suspended ones, and the running ones (the arguments of
    /// [`schedule`]). Victims are suspended; a request placed after
    /// waiting, or resumed, starts after a context switch of `switch`
    /// cycles, and the one that preempted after the victims' engines have
    /// drained too. `starts` learns when each newly placed request starts.
    pub fn dispatch(
        &mut self,
        sim: &mut CoreSim<'_, J>,
        switch: f64,
        decide: impl FnOnce(&[Pending], &[Pending]) -> Decision,
        mut starts: impl FnMut(&mut J, f64),
    ) -> Dispatched {
        let now = sim.now();
        let (cands, on_core) = self.pending(now);
        let d = decide(&cands, &on_core);
        let stops = !d.preempt.is_empty() || !d.kill.is_empty();
        let preemptor = if stops { d.place.last().copied() } else { None };
        // When the preemptor may start: the victims' engines drained and
        // the checkpointed ones' state saved.
        let mut free: f64 = 0.0;
        let mut victims: Vec<(usize, bool)> =
            d.preempt.iter().map(|&r| (r, false)).chain(d.kill.iter().map(|&r| (r, true))).collect();
        victims.sort_unstable_by_key(|v| std::cmp::Reverse(v.0));
        victims.dedup_by_key(|v| v.0);
        victims.retain(|&(r, _)| r < self.running.len());
        let mut out = Dispatched::default();
        // Killed requests wait again once this pass has placed (indices
        // into `waiting` stay as `decide` saw them until then).
        let mut requeue = Vec::new();
        for (r, kill) in victims {
            let (id, mut p) = self.running.swap_remove(r);
            let own = sim.drain_cycles(id);
            let since = self.issued_since(id);
            if kill {
                if let Some((job, part)) = sim.kill(id) {
                    let t = part.totals();
                    out.killed.push((id, t.sa_active_cycles + t.vu_active_cycles));
                    p.ran = 0.0;
                    requeue.push((job, p, true));
                }
                free = free.max(own);
                continue;
            }
            sim.suspend(id);
            p.ran += (now - since.unwrap_or(now)).max(0.0);
            free = free.max(own + self.save);
            out.suspended.push((id, now + own));
            self.suspended.push((id, p));
            out.preempted += 1;
        }
        let n_waiting = self.waiting.len();
        for (i, w) in self.waiting.iter_mut().enumerate() {
            w.2 |= !d.place.contains(&i);
        }
        let mut place = d.place;
        place.sort_unstable_by(|a, b| b.cmp(a));
        place.dedup();
        place.retain(|&i| i < cands.len());
        // Lend the idle engines among what runs from now on, and take
        // back from borrowers what the claims placed now need.
        let (reclaim, grants, spare) = self.lend(sim, &place, n_waiting);
        let n_running = self.running.len();
        for &i in &place {
            let delay = |waited: bool, restore: f64| {
                let d = match (Some(i) == preemptor, waited) {
                    (true, _) => switch.max(free + restore),
                    (false, true) => switch.max(restore),
                    (false, false) => restore,
                };
                d.max(reclaim)
            };
            if i >= n_waiting {
                // A suspended request goes on where it stopped, once its
                // state is back.
                let (id, p) = self.suspended.remove(i - n_waiting);
                let d = delay(true, self.restore);
                sim.resume(id, d);
                out.resumed.push((id, now + d));
                self.issuing.push((id, now + d));
                self.running.push((id, p));
            } else {
                // `remove` (not `swap_remove`): the rest stay in arrival order.
                let (mut job, p, waited) = self.waiting.remove(i);
                let delay = delay(waited, 0.0);
                out.waited += u64::from(waited);
                starts(&mut job, now + delay);
                let id = sim.add(job, delay);
                self.issuing.push((id, now + delay));
                self.running.push((id, p));
            }
            if reclaim > 0.0 {
                if let Some(&(id, _)) = self.running.last() {
                    out.reclaimed.push((id, reclaim));
                }
            }
        }
        // The placed requests' engines (they were added in `place`'s
        // order, after the requests running before).
        for (k, &(id, p)) in self.running.iter().enumerate() {
            let Some(g) = grants.get(k) else { continue };
            let claim = [p.claim.sa, p.claim.vu];
            if k >= n_running {
                sim.set_engines(id, claim, [claim[0].saturating_add(g.sa), claim[1].saturating_add(g.vu)]);
            }
            if g.total() > 0 {
                out.borrowing.push((id, *g));
            }
            if let Some(u) = spare.get(k).filter(|u| u.total() > 0) {
                out.unused.push((id, *u));
            }
        }
        for w in requeue {
            self.insert_by_arrival(w);
        }
        out
    }

    /// When running request `id` last started issuing; forgets it.
    fn issued_since(&mut self, id: usize) -> Option<f64> {
        let k = self.issuing.iter().position(|x| x.0 == id)?;
        Some(self.issuing.swap_remove(k).1)
    }

    /// The requests as a policy sees them at simulated time `now`: those
    /// waiting followed by the suspended ones, and the running ones (with
    /// the cycles each has issued, [`Pending::ran`]).
    pub fn pending(&self, now: f64) -> (Vec<Pending>, Vec<Pending>) {
        let cands = self.waiting.iter().map(|w| w.1).chain(self.suspended.iter().map(|s| s.1)).collect();
        let on_core = self
            .running
            .iter()
            .map(|&(id, mut p)| {
                if let Some(&(_, since)) = self.issuing.iter().find(|x| x.0 == id) {
                    p.ran += (now - since).max(0.0);
                }
                p
            })
            .collect();
        (cands, on_core)
    }

    /// Lends the core's idle engines ([`harvest`]) to the requests running
    /// now and those about to be placed (`place`: indices into the waiting
    /// requests followed by the suspended ones; `n_waiting` of the
    /// former) and applies the new shares of the running ones. Returns
    /// how long the placed requests wait for borrowers to give engines
    /// back, and each one's grant and the engines of its claim it cannot
    /// use, in the order `self.running` will hold them (running ones
    /// first, then `place`'s order).
    fn lend(
        &mut self,
        sim: &mut CoreSim<'_, J>,
        place: &[usize],
        n_waiting: usize,
    ) -> (f64, Vec<Engines>, Vec<Engines>) {
        let n = self.running.len() + place.len();
        let Some(core) = self.core else {
            // Nobody borrows: every request runs on its claim.
            return (0.0, vec![Engines::default(); n], vec![Engines::default(); n]);
        };
        let mut who: Vec<Pending> = Vec::new();
        let mut want: Vec<Engines> = Vec::new();
        let mut using: Vec<Engines> = Vec::new();
        let mut add = |p: Pending, program: Option<&vnpu_abi::Program>| {
            who.push(p);
            want.push(program.map_or(Engines::default(), |g| wants(g, &p)));
            // A request whose program is gone from view keeps its claim.
            using.push(program.map_or(p.claim.engines(), |g| uses(g, &p)));
        };
        for &(id, p) in &self.running {
            add(p, sim.job(id).map(SimTenant::program));
        }
        for &i in place {
            if i >= n_waiting {
                let Some(&(id, p)) = self.suspended.get(i - n_waiting) else { continue };
                add(p, sim.job(id).map(SimTenant::program));
            } else {
                let Some((job, p, _)) = self.waiting.get(i) else { continue };
                add(*p, Some(job.program()));
            }
        }
        let grants = harvest(core, &who, &want, &using);
        let spare: Vec<Engines> =
            who.iter().zip(&using).map(|(p, u)| p.claim.engines().saturating_sub(*u)).collect();
        let mut reclaim: f64 = 0.0;
        for (&(id, p), g) in self.running.iter().zip(&grants) {
            let claim = [p.claim.sa, p.claim.vu];
            let width = [claim[0].saturating_add(g.sa), claim[1].saturating_add(g.vu)];
            reclaim = reclaim.max(sim.set_engines(id, claim, width));
        }
        if place.is_empty() {
            reclaim = 0.0;
        }
        (reclaim, grants, spare)
    }

    /// The earliest arrival of a request not finished (waiting, running
    /// or suspended): none of them started before it.
    pub fn oldest_arrival(&self) -> Option<f64> {
        let waiting = self.waiting.iter().map(|w| w.1.arrival);
        let on_core = self.running.iter().chain(&self.suspended).map(|r| r.1.arrival);
        waiting.chain(on_core).min_by(f64::total_cmp)
    }

    /// Forgets request `id` once the core reports it finished.
    pub fn finished(&mut self, id: usize) {
        self.issuing.retain(|(i, _)| *i != id);
        self.running.retain(|(i, _)| *i != id);
        self.suspended.retain(|(i, _)| *i != id);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use npu_model::{CoreMemory, TenantReport};
    use vnpu_abi::{Engine, Instr, Program, ProgramBuilder};

    /// Equal urgency goes by arrival time, whatever order the waiting
    /// requests are held in; urgency goes first.
    #[test]
    fn admission_order_breaks_ties_by_arrival() {
        let c = |priority, slo_cycles| Claim { sa: 1, vu: 1, priority, slo_cycles, ..Claim::default() };
        let p = Pending::new;
        assert_eq!(admission_order(&[p(c(0, 0), 5.0), p(c(0, 0), 1.0), p(c(0, 0), 1.0)]), vec![1, 2, 0]);
        assert_eq!(admission_order(&[p(c(0, 0), 1.0), p(c(0, 100), 50.0), p(c(1, 0), 9.0)]), vec![2, 1, 0]);
    }

    #[test]
    fn schedule_preempts_only_for_more_urgent_requests() {
        let board = BoardConfig::test_board();
        let half = |slo_cycles, priority| Claim { sa: 2, vu: 2, priority, slo_cycles, ..Claim::default() };
        let p = Pending::new;
        let running = [p(half(0, 0), 0.0), p(half(0, 0), 10.0)];
        // A request with a latency target preempts the later of two equal
        // requests without one.
        let d = schedule(&board, &[p(half(1000, 0), 20.0)], &running);
        assert_eq!(d, Decision { place: vec![0], preempt: vec![1], kill: vec![] });
        // Without a target it waits.
        assert_eq!(schedule(&board, &[p(half(0, 0), 20.0)], &running), Decision::default());
        // A higher priority preempts a lower one, never the reverse.
        let mixed = [p(half(0, 3), 0.0), p(half(0, 1), 5.0)];
        assert_eq!(schedule(&board, &[p(half(0, 2), 9.0)], &mixed).preempt, vec![1]);
        assert_eq!(schedule(&board, &[p(half(0, 0), 9.0)], &mixed), Decision::default());
        // A running request with an earlier deadline is not preempted.
        let tight = [p(half(100, 0), 0.0), p(half(50, 0), 0.0)];
        assert_eq!(schedule(&board, &[p(half(1000, 0), 1.0)], &tight), Decision::default());
        // A request that would not fit even alone beside nothing suspends
        // as many as it needs.
        let whole = Claim { sa: 4, vu: 4, priority: 0, slo_cycles: 10, ..Claim::default() };
        let d = schedule(&board, &[p(whole, 30.0)], &running);
        assert_eq!((d.place, d.preempt.len()), (vec![0], 2));
    }

    /// FIFO places in arrival order whatever the urgency, first fit, and
    /// never preempts.
    #[test]
    fn fifo_places_the_oldest_that_fit_and_never_preempts() {
        let board = BoardConfig::test_board();
        let c = |sa, priority, slo_cycles| Claim { sa, vu: 1, priority, slo_cycles, ..Claim::default() };
        let p = Pending::new;
        // 3 SAs free beside a running 1-SA request: the oldest (2 SAs, no
        // urgency) goes, the urgent 2-SA one no longer fits, the 1-SA
        // one does.
        let waiting = [p(c(2, 9, 10), 5.0), p(c(2, 0, 0), 1.0), p(c(1, 0, 0), 7.0)];
        let running = [p(c(1, 0, 0), 0.0)];
        assert_eq!(fifo(&board, &waiting, &running), Decision { place: vec![1, 2], ..Decision::default() });
        // The same, by the device's policy: urgency first.
        assert_eq!(schedule(&board, &waiting, &running).place[0], 0);
    }

    /// PREMA by hand: tokens = priority x (1 + waited / estimate); the
    /// threshold is the highest level (1, 3, 9) the largest count reached;
    /// among the candidates, the shortest time left goes first.
    #[test]
    fn prema_picks_the_shortest_candidate_past_the_threshold() {
        let board = BoardConfig::test_board();
        let whole = Claim::whole_core(&board);
        let req = |priority, arrival, estimate, ran| Pending {
            claim: Claim { priority, ..whole },
            arrival,
            estimate,
            ran,
        };
        let prema = Prema { margin: 0.0, kill: true, checkpoint: 10.0 };
        // Tokens at 100: 1 x (1 + 100/400) = 1.25; 1 x (1 + 50/10) = 6;
        // 2 x (1 + 60/100) = 3.2. The largest, 6, reached level 3: the
        // candidates are the last two (>= 3); the shortest left of those is
        // the second (10 against 100).
        let waiting = [req(1, 0.0, 400.0, 0.0), req(1, 50.0, 10.0, 0.0), req(2, 40.0, 100.0, 0.0)];
        assert_eq!(Prema::tokens(&waiting[0], 100.0), 1.25);
        assert_eq!(Prema::threshold(waiting.iter().map(|p| Prema::tokens(p, 100.0))), 3.0);
        let d = prema.decide(&board, 100.0, &waiting, &[]);
        assert_eq!(d, Decision { place: vec![1], ..Decision::default() });
        // At 45 the largest count is 1.1 (the first): threshold 1, every
        // request a candidate, the shortest (the third: 100) goes; the
        // second has not arrived.
        let early = [waiting[0], waiting[2]];
        assert_eq!(prema.decide(&board, 45.0, &early, &[]).place, vec![1]);
        // Running since 0 with 90 cycles issued (310 left), a waiter with 10
        // left arrives: it is a candidate (threshold 1) and shorter, the
        // running one is checkpointed.
        let running = [req(1, 0.0, 400.0, 90.0)];
        let arrived = [req(1, 100.0, 10.0, 0.0)];
        let d = prema.decide(&board, 100.0, &arrived, &running);
        assert_eq!(d, Decision { place: vec![0], preempt: vec![0], kill: vec![] });
        // Issued less than a checkpoint: killed; within a checkpoint of its
        // end: it drains, nothing goes on.
        let d = prema.decide(&board, 100.0, &arrived, &[req(1, 0.0, 400.0, 9.0)]);
        assert_eq!(d, Decision { place: vec![0], preempt: vec![], kill: vec![0] });
        let d = prema.decide(&board, 100.0, &arrived, &[req(1, 0.0, 400.0, 395.0)]);
        assert_eq!(d, Decision::default());
        // A waiter with more time left than the running one does not stop
        // it while both are candidates.
        let long = [req(1, 100.0, 1000.0, 0.0)];
        assert_eq!(prema.decide(&board, 100.0, &long, &running), Decision::default());
        // The next decision is when its tokens reach 3: 1 + (t - 100) /
        // 1000 = 3 at t = 2100. The running request (its `ran` as given:
        // 2100 - 90 = 2010 cycles not run, 1 + 2010 / 400 = 6.0 tokens) is
        // a candidate then too, with less left (310 < 1000): it keeps the
        // core.
        let t = prema.next_decision(100.0, &long, &running).unwrap();
        assert!((t - 1e-3 - 2100.0).abs() < 1e-9, "{t}");
        assert_eq!(prema.decide(&board, t, &long, &running), Decision::default());
        // But a running request that is no candidate is stopped for one:
        // priority-9 waiter (9 tokens: threshold 9) against a priority-1
        // running one with a count below 9.
        let urgent = [req(9, 100.0, 1000.0, 0.0)];
        let d = prema.decide(&board, 100.0, &urgent, &running);
        assert_eq!(d, Decision { place: vec![0], preempt: vec![0], kill: vec![] });
        // Drain mode never preempts and asks for no decision.
        let drain = Prema { margin: f64::INFINITY, ..prema };
        assert_eq!(drain.decide(&board, 100.0, &urgent, &running), Decision::default());
        assert_eq!(drain.next_decision(51.0, &long, &running), None);
    }

    /// A VU-only program busy for `n` exp passes over 1 Mi elements.
    fn vu_work(n: usize) -> Program {
        let mut p = ProgramBuilder::new();
        for _ in 0..n {
            p.push(Engine::vu(0), Instr::VUnary { op: vnpu_abi::UnOp::Exp, src: 0, dst: 0, len: 1 << 20 });
        }
        p.finish()
    }

    /// Timing-only requests of `programs` with `claims`, all arriving at
    /// time 0 in this order, dispatched by [`schedule`] with a context
    /// switch of `switch` cycles until all finish: each one's report.
    fn dispatch_all(
        board: &BoardConfig,
        programs: &[&Program],
        claims: &[Claim],
        budget: Option<u64>,
        switch: f64,
    ) -> Vec<TenantReport> {
        struct T<'p>(&'p Program, usize, Option<u64>);
        impl SimTenant for T<'_> {
            fn program(&self) -> &Program {
                self.0
            }
            fn memory(&mut self) -> Option<CoreMemory<'_>> {
                None
            }
            fn max_cycles(&self) -> Option<u64> {
                self.2
            }
        }
        let mut sim = CoreSim::new(board, programs.len());
        let mut d = Dispatcher::default();
        for (i, (p, c)) in programs.iter().zip(claims).enumerate() {
            d.submit(T(p, i, budget), Pending::new(*c, 0.0));
        }
        let mut out: Vec<Option<TenantReport>> = vec![None; programs.len()];
        loop {
            d.dispatch(&mut sim, switch, |w, r| schedule(board, w, r), |_, _| {});
            let done = sim.step();
            if done.is_empty() && d.waiting().next().is_none() {
                break;
            }
            for (id, t, r) in done {
                d.finished(id);
                out[t.1] = Some(r.unwrap());
            }
        }
        out.into_iter().map(Option::unwrap).collect()
    }

    /// Requests take over engines as soon as they free up, in order.
    #[test]
    fn dispatched_requests_take_over_engines_as_soon_as_they_free_up() {
        let c = BoardConfig::test_board();
        let (long, short) = (vu_work(40), vu_work(10));
        let alone = |p: &Program| npu_model::run_program(&c, p, None, None).unwrap().cycles;
        let (tl, ts) = (alone(&long), alone(&short));
        // Each claims half the VUs: two run at once. Order: 0, 1, 2, 3.
        let half = Claim { sa: 0, vu: c.core.vu_count / 2, priority: 0, slo_cycles: 0, ..Claim::default() };
        let t = dispatch_all(&c, &[&long, &short, &short, &long], &[half; 4], None, 500.0);
        assert_eq!((t[0].started, t[1].started), (0.0, 0.0));
        // Request 2 takes request 1's VUs when it ends, not when request 0 ends.
        assert!((t[2].started - ts).abs() < 1e-6, "{} vs {ts}", t[2].started);
        assert!((t[2].cycles - (2.0 * ts + 500.0)).abs() < 1e-6);
        // Request 3 waits for the next free half: request 2's end.
        assert!((t[3].started - t[2].cycles).abs() < 1e-6);
        assert!((t[3].cycles - (t[3].started + 500.0 + tl)).abs() < 1e-6);
        let makespan = t.iter().map(|t| t.cycles).fold(0.0, f64::max);
        assert!((makespan - t[3].cycles).abs() < 1e-6 && t[3].started < t[0].cycles);
        // All four at once (no claims) would finish sooner.
        let mut all: Vec<npu_model::Tenant> = [&long, &short, &short, &long]
            .into_iter()
            .map(|program| npu_model::Tenant { program, memory: None, max_cycles: None })
            .collect();
        assert!(npu_model::run_core(&c, &mut all).cycles < makespan);
    }

    /// Whole-core requests run one after the other by priority, each
    /// within a budget that counts from its own start; a claim larger than
    /// the core still runs, alone.
    #[test]
    fn dispatch_follows_priority_and_budgets_count_from_the_start() {
        let c = BoardConfig::test_board();
        let p = vu_work(10);
        let one = npu_model::run_program(&c, &p, None, None).unwrap().cycles;
        let whole = |priority| Claim { priority, ..Claim::whole_core(&c) };
        let t = dispatch_all(
            &c,
            &[&p, &p, &p],
            &[whole(2), whole(1), whole(3)],
            Some(one.ceil() as u64 + 1000),
            0.0,
        );
        assert!(t[2].started == 0.0 && t[0].started > 0.0 && t[1].started > t[0].started);
        // (Each would have exceeded its budget if it counted from the core's start.)
        let big = Claim { sa: 99, vu: 99, priority: 0, slo_cycles: 0, ..Claim::default() };
        assert_eq!(dispatch_all(&c, &[&p], &[big], None, 0.0).len(), 1);
    }

    /// `streams` independent VU streams of `each` `exp` passes over 64 Ki
    /// elements, spread or not.
    fn vu_streams(streams: u8, each: usize, spread: bool) -> Program {
        let mut b = ProgramBuilder::new();
        for s in 0..streams {
            for _ in 0..each {
                b.push(
                    Engine::vu(s),
                    Instr::VUnary { op: vnpu_abi::UnOp::Exp, src: 0, dst: 0, len: 1 << 16 },
                );
            }
        }
        if spread {
            b.spread();
        }
        b.finish()
    }

    struct Timed(Program, &'static str);
    impl SimTenant for Timed {
        fn program(&self) -> &Program {
            &self.0
        }
        fn memory(&mut self) -> Option<CoreMemory<'_>> {
            None
        }
        fn max_cycles(&self) -> Option<u64> {
            None
        }
    }

    /// Steps `sim` to its next completion and dispatches again until
    /// nothing is left, from simulated time `until` on; returns each
    /// tenant's end and everything dispatched.
    fn drain_all(
        board: &BoardConfig,
        sim: &mut CoreSim<'_, Timed>,
        d: &mut Dispatcher<Timed>,
        ends: &mut Vec<(&'static str, f64)>,
        passes: &mut Vec<Dispatched>,
    ) {
        loop {
            let done = sim.step();
            if done.is_empty() {
                break;
            }
            for (id, t, r) in done {
                d.finished(id);
                ends.push((t.1, r.unwrap().cycles));
            }
            passes.push(d.dispatch(sim, 0.0, |w, r| schedule(board, w, r), |_, _| {}));
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    /// A lone tenant with a spread program runs on every idle engine its
    /// cap and streams allow; without a cap, or without harvesting, on its
    /// claim.
    #[test]
    fn a_lone_tenant_gets_every_idle_engine() {
        let board = BoardConfig::test_board();
        let c = npu_model::run_program(&board, &vu_streams(1, 1, false), None, None).unwrap().cycles;
        let core = Engines::new(board.core.sa_count, board.core.vu_count);
        let run = |d: &mut Dispatcher<Timed>, borrow: Engines| {
            let mut sim = CoreSim::new(&board, 1);
            let claim = Claim { sa: 1, vu: 1, borrow, ..Claim::default() };
            d.submit(Timed(vu_streams(4, 3, true), "b"), Pending::new(claim, 0.0));
            let first = d.dispatch(&mut sim, 0.0, |w, r| schedule(&board, w, r), |_, _| {});
            let (mut ends, mut passes) = (Vec::new(), Vec::new());
            drain_all(&board, &mut sim, d, &mut ends, &mut passes);
            (ends[0].1, first.borrowing)
        };
        let (t, lent) = run(&mut Dispatcher::harvesting(core), Engines::new(3, 3));
        assert!(close(t, 3.0 * c), "{t} vs {}", 3.0 * c);
        // Its streams bound what it borrows: four VU streams, no SA one.
        assert_eq!(lent.iter().map(|l| l.1).collect::<Vec<_>>(), [Engines::new(0, 3)]);
        let (t, _) = run(&mut Dispatcher::harvesting(core), Engines::new(0, 1));
        assert!(close(t, 6.0 * c), "{t} vs {}", 6.0 * c);
        let (t, _) = run(&mut Dispatcher::default(), Engines::new(3, 3));
        assert!(close(t, 12.0 * c), "{t} vs {}", 12.0 * c);
    }

    /// An owner's request takes its engines back from a borrower within
    /// one instruction of the borrower: it arrives 1.5 instructions into
    /// the borrower's run on four VUs and starts when the borrower's
    /// second round ends, half an instruction later.
    #[test]
    fn an_owner_takes_its_engines_back_within_one_instruction() {
        let board = BoardConfig::test_board();
        let c = npu_model::run_program(&board, &vu_streams(1, 1, false), None, None).unwrap().cycles;
        let mut sim = CoreSim::new(&board, 2);
        let mut d = Dispatcher::harvesting(Engines::new(board.core.sa_count, board.core.vu_count));
        let borrower = Claim { sa: 1, vu: 1, borrow: Engines::new(3, 3), ..Claim::default() };
        let owner = Claim { sa: 1, vu: 3, ..Claim::default() };
        d.submit(Timed(vu_streams(4, 6, true), "borrower"), Pending::new(borrower, 0.0));
        d.dispatch(&mut sim, 0.0, |w, r| schedule(&board, w, r), |_, _| {});
        assert!(sim.step_until(1.5 * c).is_empty());
        d.submit(Timed(vu_streams(3, 1, false), "owner"), Pending::new(owner, 1.5 * c));
        let pass = d.dispatch(&mut sim, 0.0, |w, r| schedule(&board, w, r), |_, _| {});
        assert_eq!(pass.reclaimed.len(), 1);
        assert!(close(pass.reclaimed[0].1, 0.5 * c), "{:?} vs {}", pass.reclaimed, 0.5 * c);
        assert!(pass.borrowing.is_empty(), "{:?}", pass.borrowing);
        let (mut ends, mut passes) = (Vec::new(), Vec::new());
        drain_all(&board, &mut sim, &mut d, &mut ends, &mut passes);
        // The owner: from 2c, one instruction on each of its three VUs.
        let end = |n: &str| ends.iter().find(|e| e.0 == n).unwrap().1;
        assert!(close(end("owner"), 3.0 * c), "{} vs {}", end("owner"), 3.0 * c);
        // The borrower: 8 instructions by 2c on four VUs, one more by 3c
        // on its own, then four VUs again for the 15 left (four rounds:
        // three streams have four each).
        assert!(close(end("borrower"), 7.0 * c), "{} vs {}", end("borrower"), 7.0 * c);
        // Lent again once the owner left.
        assert_eq!(passes[0].borrowing.iter().map(|b| b.1).collect::<Vec<_>>(), [Engines::new(0, 3)]);
    }

    /// A running request whose program has no VU stream lends the VUs of
    /// its claim for as long as it runs: a spread neighbour runs on them
    /// and the owner is not slowed (it could never use them).
    #[test]
    fn a_running_request_lends_the_engines_its_program_cannot_use() {
        let board = BoardConfig::test_board();
        let c = npu_model::run_program(&board, &vu_streams(1, 1, false), None, None).unwrap().cycles;
        let mut owner = ProgramBuilder::new();
        for _ in 0..40 {
            let i = Instr::MatMul {
                dtype: vnpu_abi::DType::F32,
                flags: vnpu_abi::MatFlags::default(),
                a: 0,
                b: 0,
                c: 0,
                m: 256,
                k: 128,
                n: 128,
                lda: 128,
                ldb: 128,
                ldc: 128,
            };
            owner.push(Engine::sa(0), i);
        }
        let owner = owner.finish();
        let alone = npu_model::run_program(&board, &owner, None, None).unwrap().cycles;
        assert!(alone > 3.0 * c, "the owner must outlast the borrower: {alone} vs {c}");
        let core = Engines::new(board.core.sa_count, board.core.vu_count);
        let run = |d: &mut Dispatcher<Timed>| {
            let mut sim = CoreSim::new(&board, 2);
            let own = Claim { sa: 2, vu: 2, ..Claim::default() };
            let borrower = Claim { sa: 1, vu: 1, borrow: Engines::new(3, 3), ..Claim::default() };
            d.submit(Timed(owner.clone(), "owner"), Pending::new(own, 0.0));
            d.submit(Timed(vu_streams(4, 3, true), "borrower"), Pending::new(borrower, 0.0));
            let first = d.dispatch(&mut sim, 0.0, |w, r| schedule(&board, w, r), |_, _| {});
            let (mut ends, mut passes) = (Vec::new(), Vec::new());
            drain_all(&board, &mut sim, d, &mut ends, &mut passes);
            let end = |n: &str| ends.iter().find(|e| e.0 == n).unwrap().1;
            (end("owner"), end("borrower"), first)
        };
        // The owner uses one SA and no VU of its 2+2: the borrower gets
        // the core's other three VUs and runs its 12 instructions in 3.
        let (owner_end, borrower_end, first) = run(&mut Dispatcher::harvesting(core));
        assert!(close(borrower_end, 3.0 * c), "{borrower_end} vs {}", 3.0 * c);
        assert!(close(owner_end, alone), "{owner_end} vs {alone}");
        let unused: Vec<Engines> = first.unused.iter().map(|u| u.1).collect();
        assert!(unused.contains(&Engines::new(1, 2)), "{:?}", first.unused);
        // Without harvesting: 12 on its one VU; the owner the same.
        let (owner_end, borrower_end, _) = run(&mut Dispatcher::default());
        assert!(close(borrower_end, 12.0 * c) && close(owner_end, alone), "{borrower_end} {owner_end}");
    }
}
