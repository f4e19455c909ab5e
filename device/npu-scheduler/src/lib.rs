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
    fission, least_shape, lend, lending_order, pick_shape, shapes_between, AtBoundary, Engines,
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
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pending {
    pub claim: Claim,
    pub arrival: f64,
}

impl Pending {
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

/// One scheduling pass of an oversubscribed core.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// Waiting requests that go on the core now (indices into `waiting`).
    pub place: Vec<usize>,
    /// Running requests to suspend so the most urgent waiting one fits
    /// (indices into `running`); it is the last of `place`.
    pub preempt: Vec<usize>,
}

/// The placement policy: what fits goes on the core ([`placements`], most
/// urgent first); then, if the most urgent request left over is more
/// urgent (higher priority, or the same priority and an earlier deadline)
/// than some running ones, the least urgent of those are suspended until
/// it fits. Requests of equal priority without latency targets never
/// preempt each other, and a preempted request is less urgent than the one
/// that preempted it, so preemption cannot go in circles.
pub fn schedule(board: &BoardConfig, waiting: &[Pending], running: &[Pending]) -> Decision {
    let claims: Vec<Claim> = waiting.iter().map(|p| p.claim).collect();
    let order = admission_order(waiting);
    let on_core: Vec<Claim> = running.iter().map(|p| p.claim).collect();
    let mut place = placements(board, &claims, &order, &on_core);
    let Some(&w) = order.iter().find(|i| !place.contains(i)) else {
        return Decision { place, preempt: Vec::new() };
    };
    let want = waiting[w];
    let mut victims: Vec<usize> = (0..running.len()).filter(|&r| running[r].urgency(&want).is_lt()).collect();
    // Least urgent first; among equals the latest arrival.
    victims.sort_by(|&a, &b| {
        running[a].urgency(&running[b]).then(running[b].arrival.total_cmp(&running[a].arrival))
    });
    let used = |skip: &[usize]| {
        let on = (0..running.len()).filter(|r| !skip.contains(r)).map(|r| running[r].claim);
        on.chain(place.iter().map(|&i| waiting[i].claim))
            .fold((0u32, 0u32), |(a, b), c| (a.saturating_add(c.sa), b.saturating_add(c.vu)))
    };
    let fits = |(sa, vu): (u32, u32)| {
        sa.saturating_add(want.claim.sa) <= board.core.sa_count
            && vu.saturating_add(want.claim.vu) <= board.core.vu_count
    };
    let mut preempt = Vec::new();
    for v in victims {
        preempt.push(v);
        if fits(used(&preempt)) {
            place.push(w);
            return Decision { place, preempt };
        }
    }
    Decision { place, preempt: Vec::new() }
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
}

/// What one [`Dispatcher::dispatch`] pass did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dispatched {
    /// Requests placed that had waited for engines.
    pub waited: u64,
    /// Running requests suspended for a more urgent one.
    pub preempted: u64,
    /// (simulation id, when its engines are free: now plus what it had in
    /// flight) of each request suspended.
    pub suspended: Vec<(usize, f64)>,
    /// (simulation id, when it issues again) of each suspended request
    /// resumed.
    pub resumed: Vec<(usize, f64)>,
}

impl<J> Default for Dispatcher<J> {
    fn default() -> Self {
        Self { waiting: Vec::new(), running: Vec::new(), suspended: Vec::new() }
    }
}

impl<J: SimTenant> Dispatcher<J> {
    /// A request arrives (after those already waiting).
    pub fn submit(&mut self, job: J, p: Pending) {
        self.waiting.push((job, p, false));
    }

    /// Requests not on the core yet.
    pub fn waiting(&self) -> impl Iterator<Item = &J> {
        self.waiting.iter().map(|w| &w.0)
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
        let cands: Vec<Pending> =
            self.waiting.iter().map(|w| w.1).chain(self.suspended.iter().map(|s| s.1)).collect();
        let on_core: Vec<Pending> = self.running.iter().map(|r| r.1).collect();
        let d = decide(&cands, &on_core);
        let preemptor = if d.preempt.is_empty() { None } else { d.place.last().copied() };
        let mut drain: f64 = 0.0;
        let mut victims = d.preempt.clone();
        victims.sort_unstable_by(|a, b| b.cmp(a));
        victims.dedup();
        victims.retain(|&r| r < self.running.len());
        let mut out = Dispatched::default();
        for r in victims {
            let (id, p) = self.running.swap_remove(r);
            sim.suspend(id);
            let own = sim.drain_cycles(id);
            drain = drain.max(own);
            out.suspended.push((id, sim.now() + own));
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
        for i in place.into_iter().filter(|&i| i < cands.len()) {
            let delay = |waited: bool| match (Some(i) == preemptor, waited) {
                (true, _) => switch.max(drain),
                (false, true) => switch,
                (false, false) => 0.0,
            };
            if i >= n_waiting {
                // A suspended request goes on where it stopped.
                let (id, p) = self.suspended.remove(i - n_waiting);
                let d = delay(true);
                sim.resume(id, d);
                out.resumed.push((id, sim.now() + d));
                self.running.push((id, p));
                continue;
            }
            // `remove` (not `swap_remove`): the rest stay in arrival order.
            let (mut job, p, waited) = self.waiting.remove(i);
            let delay = delay(waited);
            out.waited += u64::from(waited);
            starts(&mut job, sim.now() + delay);
            self.running.push((sim.add(job, delay), p));
        }
        out
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
        let c = |priority, slo_cycles| Claim { sa: 1, vu: 1, priority, slo_cycles };
        let p = |claim, arrival| Pending { claim, arrival };
        assert_eq!(admission_order(&[p(c(0, 0), 5.0), p(c(0, 0), 1.0), p(c(0, 0), 1.0)]), vec![1, 2, 0]);
        assert_eq!(admission_order(&[p(c(0, 0), 1.0), p(c(0, 100), 50.0), p(c(1, 0), 9.0)]), vec![2, 1, 0]);
    }

    #[test]
    fn schedule_preempts_only_for_more_urgent_requests() {
        let board = BoardConfig::default();
        let half = |slo_cycles, priority| Claim { sa: 2, vu: 2, priority, slo_cycles };
        let p = |claim, arrival| Pending { claim, arrival };
        let running = [p(half(0, 0), 0.0), p(half(0, 0), 10.0)];
        // A request with a latency target preempts the later of two equal
        // requests without one.
        let d = schedule(&board, &[p(half(1000, 0), 20.0)], &running);
        assert_eq!(d, Decision { place: vec![0], preempt: vec![1] });
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
        let whole = Claim { sa: 4, vu: 4, priority: 0, slo_cycles: 10 };
        let d = schedule(&board, &[p(whole, 30.0)], &running);
        assert_eq!((d.place, d.preempt.len()), (vec![0], 2));
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
            d.submit(T(p, i, budget), Pending { claim: *c, arrival: 0.0 });
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
        let c = BoardConfig::default();
        let (long, short) = (vu_work(40), vu_work(10));
        let alone = |p: &Program| npu_model::run_program(&c, p, None, None).unwrap().cycles;
        let (tl, ts) = (alone(&long), alone(&short));
        // Each claims half the VUs: two run at once. Order: 0, 1, 2, 3.
        let half = Claim { sa: 0, vu: c.core.vu_count / 2, priority: 0, slo_cycles: 0 };
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
        let c = BoardConfig::default();
        let p = vu_work(10);
        let one = npu_model::run_program(&c, &p, None, None).unwrap().cycles;
        let whole = |priority| Claim { sa: c.core.sa_count, vu: c.core.vu_count, priority, slo_cycles: 0 };
        let t = dispatch_all(
            &c,
            &[&p, &p, &p],
            &[whole(2), whole(1), whole(3)],
            Some(one.ceil() as u64 + 1000),
            0.0,
        );
        assert!(t[2].started == 0.0 && t[0].started > 0.0 && t[1].started > t[0].started);
        // (Each would have exceeded its budget if it counted from the core's start.)
        let big = Claim { sa: 99, vu: 99, priority: 0, slo_cycles: 0 };
        assert_eq!(dispatch_all(&c, &[&p], &[big], None, 0.0).len(), 1);
    }
}
