//! Work-conserving engine lending on one physical core.
//!
//! Every tenant of a core owns a guaranteed shape (its vNPU: so many SAs and
//! VUs). Its requests run as a sequence of tasks (groups of operations,
//! each lowered for the engines it is given when it starts, see
//! `npu_lower::lower_ops`), so at every task boundary the engines a
//! tenant uses can change. [`lend`] decides them:
//!
//! 1. **Guarantees first.** Tenants at a boundary, most urgent first
//!    (priority, then least slack), each take their guaranteed shape from
//!    the engines no running task holds. A tenant whose guarantee is partly
//!    held by a borrower's running task waits, and *reserves* what is free of
//!    its guarantee so no one else can borrow it: it gets its guarantee back
//!    when that task ends (a borrower's task is the longest it waits).
//! 2. **Idle engines next.** What is still free goes, in the same order, to
//!    the tenants that got their guarantee: each one's `choose` picks a shape
//!    between its guarantee and its guarantee plus everything free (along
//!    its profile: [`pick_shape`] takes the smallest shape within a
//!    tolerance of the fastest), and the rest stays free for the next.
//!
//! Nothing here knows programs or time: the caller measures a task's time
//! on each shape and cuts requests into tasks.

/// A number of SAs and VUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Engines {
    pub sa: u32,
    pub vu: u32,
}

impl Engines {
    pub const fn new(sa: u32, vu: u32) -> Self {
        Self { sa, vu }
    }

    /// Both counts within `other`'s.
    pub fn within(self, other: Engines) -> bool {
        self.sa <= other.sa && self.vu <= other.vu
    }

    pub fn saturating_add(self, other: Engines) -> Engines {
        Engines::new(self.sa.saturating_add(other.sa), self.vu.saturating_add(other.vu))
    }

    pub fn saturating_sub(self, other: Engines) -> Engines {
        Engines::new(self.sa.saturating_sub(other.sa), self.vu.saturating_sub(other.vu))
    }

    /// Component-wise minimum.
    pub fn min(self, other: Engines) -> Engines {
        Engines::new(self.sa.min(other.sa), self.vu.min(other.vu))
    }

    /// Component-wise maximum.
    pub fn max(self, other: Engines) -> Engines {
        Engines::new(self.sa.max(other.sa), self.vu.max(other.vu))
    }

    /// SAs plus VUs.
    pub fn total(self) -> u32 {
        self.sa.saturating_add(self.vu)
    }

    /// The order of "smaller": fewer engines, then fewer SAs.
    pub fn size_key(self) -> (u32, u32) {
        (self.total(), self.sa)
    }
}

/// Every shape from `base` to `cap` (both counts inclusive; `base` alone
/// when `cap` is smaller).
pub fn shapes_between(base: Engines, cap: Engines) -> impl Iterator<Item = Engines> {
    (base.sa..=cap.sa.max(base.sa))
        .flat_map(move |sa| (base.vu..=cap.vu.max(base.vu)).map(move |vu| Engines::new(sa, vu)))
}

/// The smallest shape ([`Engines::size_key`]) from `base` to `cap` that
/// passes `ok`.
pub fn least_shape(base: Engines, cap: Engines, ok: impl FnMut(&Engines) -> bool) -> Option<Engines> {
    shapes_between(base, cap).filter(ok).min_by_key(|s| s.size_key())
}

/// A tenant at a task boundary: it has work and no task on the core.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AtBoundary {
    /// Its vNPU's shape: what it gets whenever it has work.
    pub guaranteed: Engines,
    /// Higher is served first.
    pub priority: u8,
    /// Cycles to spare: its request's deadline minus now minus its
    /// remaining work on its guaranteed shape (infinity: no deadline).
    /// Less slack is served first among equal priorities.
    pub slack: f64,
}

/// The order [`lend`] serves tenants at a boundary in: priority, then least
/// slack, then the order given.
pub fn lending_order(waiting: &[AtBoundary]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..waiting.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (&waiting[a], &waiting[b]);
        y.priority.cmp(&x.priority).then(x.slack.total_cmp(&y.slack))
    });
    order
}

/// The engines each tenant at a boundary starts its next task on, or
/// `None` if it must wait (part of its guarantee is lent to a task still
/// running). `core`: the core's engines; `running`: what each task on the
/// core holds; `choose(i, guaranteed, cap)`: the shape tenant `i` wants
/// between its guarantee and `cap` (clamped into that range). A tenant whose
/// guarantee does not fit the core at all is served what the core has once
/// it is empty, never starved.
pub fn lend(
    core: Engines,
    running: &[Engines],
    waiting: &[AtBoundary],
    choose: impl FnMut(usize, Engines, Engines) -> Engines,
) -> Vec<Option<Engines>> {
    let (order, mut free) = start(core, running, waiting);
    let mut grant: Vec<Option<Engines>> = vec![None; waiting.len()];
    // 1. Guarantees (a guarantee larger than the core is the whole core).
    for &i in &order {
        let want = waiting[i].guaranteed.min(core);
        if want.within(free) {
            grant[i] = Some(want);
        }
        // Granted, or reserved for the owner until the borrower's task ends.
        free = free.saturating_sub(want);
    }
    // 2. Idle engines, along each one's profile.
    lend_idle(&order, &mut grant, free, choose);
    grant
}

/// The lending order and the engines no running task holds.
fn start(core: Engines, running: &[Engines], waiting: &[AtBoundary]) -> (Vec<usize>, Engines) {
    let held = running.iter().fold(Engines::default(), |a, r| a.saturating_add(*r));
    (lending_order(waiting), core.saturating_sub(held))
}

/// Hands `free` engines, in `order`, to the tenants granted something:
/// each one's `choose(i, granted, granted + free)`, clamped to that range.
fn lend_idle(
    order: &[usize],
    grant: &mut [Option<Engines>],
    mut free: Engines,
    mut choose: impl FnMut(usize, Engines, Engines) -> Engines,
) {
    for &i in order {
        let Some(base) = grant[i] else { continue };
        let cap = base.saturating_add(free);
        let shape = choose(i, base, cap).max(base).min(cap);
        free = free.saturating_sub(shape.saturating_sub(base));
        grant[i] = Some(shape);
    }
}

/// Planaria-style dynamic fission, for comparison: no guarantees. Tenants
/// at a boundary, most urgent first ([`lending_order`]), each take what
/// `need(i, free)` asks of the engines still free (the least that meets its
/// deadline, as Planaria allocates; `None`: nothing it can run on is
/// free, it waits and reserves nothing); then what is left goes, in the
/// same order, as in [`lend`]'s second step. A tenant can be starved by
/// more urgent ones: nothing is its own.
pub fn fission(
    core: Engines,
    running: &[Engines],
    waiting: &[AtBoundary],
    mut need: impl FnMut(usize, Engines) -> Option<Engines>,
    choose: impl FnMut(usize, Engines, Engines) -> Engines,
) -> Vec<Option<Engines>> {
    let (order, mut free) = start(core, running, waiting);
    let mut grant: Vec<Option<Engines>> = vec![None; waiting.len()];
    for &i in &order {
        if let Some(n) = need(i, free).filter(|n| n.within(free) && n.total() > 0) {
            grant[i] = Some(n);
            free = free.saturating_sub(n);
        }
    }
    lend_idle(&order, &mut grant, free, choose);
    grant
}

/// The shape between `base` and `cap` (inclusive, both counts) with the
/// fewest engines (then the fewest SAs) whose `time` is within
/// `tolerance` (a fraction) of the fastest of them: extra engines are
/// taken only where they pay. Shapes whose time is not finite (cannot be
/// lowered) are never picked; `base` when none is finite.
pub fn pick_shape(
    base: Engines,
    cap: Engines,
    tolerance: f64,
    mut time: impl FnMut(Engines) -> f64,
) -> Engines {
    let shapes: Vec<(Engines, f64)> =
        shapes_between(base, cap).map(|s| (s, time(s))).filter(|(_, t)| t.is_finite()).collect();
    let best = shapes.iter().map(|(_, t)| *t).fold(f64::INFINITY, f64::min);
    shapes
        .into_iter()
        .filter(|(_, t)| *t <= best * (1.0 + tolerance.max(0.0)))
        .min_by_key(|(s, _)| s.size_key())
        .map_or(base, |(s, _)| s)
}

/// What a staged request knows of its own work, for the boundary
/// policies ([`Staging`]): cycles alone on a shape (infinity: it cannot
/// run there).
pub trait StageTimes {
    /// Cycles of its next stage (as cut for its guarantee) on `e`.
    fn next(&self, e: Engines) -> f64;
    /// Cycles of the rest of the request on `e`, stage after stage.
    fn rest(&self, e: Engines) -> f64;
}

/// Who gets a core's engines at a stage boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Boundary {
    /// vNPU-WC: guarantees first, then idle engines ([`lend`]; priority,
    /// then least slack).
    Lend,
    /// Planaria-like fission: no guarantees; the most urgent takes the
    /// least shape whose time for the rest of its request meets its
    /// deadline, else the fastest free one ([`fission`]).
    Fission,
    /// V10-like operator interleaving: no guarantees, no deadlines; the
    /// tenant with the least engine time attained per unit of priority
    /// goes first and takes the fastest free shape for its next stage.
    Interleave,
}

/// A boundary policy and how much faster an engine more must make a
/// stage to be taken ([`pick_shape`]'s tolerance).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Staging {
    pub boundary: Boundary,
    pub tolerance: f64,
}

/// A staged request at a boundary, as [`Staging::grant`] sees it.
pub struct AtStage<'a> {
    /// Its claim: what [`Boundary::Lend`] guarantees, and the least shape
    /// every policy gives it.
    pub guaranteed: Engines,
    pub priority: u8,
    /// Cycles from now to its deadline (infinity: none).
    pub to_deadline: f64,
    /// Engine-cycles its tenant's stages have held on the core so far.
    pub attained: f64,
    pub times: &'a dyn StageTimes,
}

impl std::fmt::Debug for AtStage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtStage")
            .field("guaranteed", &self.guaranteed)
            .field("priority", &self.priority)
            .field("to_deadline", &self.to_deadline)
            .field("attained", &self.attained)
            .finish_non_exhaustive()
    }
}

impl Staging {
    /// The engines each request at a boundary starts its next stage on
    /// (`None`: it waits); `core` and `running` as in [`lend`].
    pub fn grant(&self, core: Engines, running: &[Engines], at: &[AtStage<'_>]) -> Vec<Option<Engines>> {
        let tol = self.tolerance;
        let waiting: Vec<AtBoundary> = at
            .iter()
            .map(|a| match self.boundary {
                // The order key in the slack field: least attained engine
                // time per unit of priority first.
                Boundary::Interleave => AtBoundary {
                    guaranteed: a.guaranteed,
                    priority: 0,
                    slack: a.attained / f64::from(a.priority.max(1)),
                },
                Boundary::Lend | Boundary::Fission => AtBoundary {
                    guaranteed: a.guaranteed,
                    priority: a.priority,
                    slack: a.to_deadline - a.times.rest(a.guaranteed),
                },
            })
            .collect();
        let choose = |k: usize, base, cap| pick_shape(base, cap, tol, |e| at[k].times.next(e));
        match self.boundary {
            Boundary::Lend => lend(core, running, &waiting, choose),
            Boundary::Interleave => {
                // The fastest free shape for the next stage (at least the
                // claim), then what is left to the next.
                let need = |k: usize, free: Engines| {
                    let g = at[k].guaranteed;
                    g.within(free).then(|| pick_shape(g, free, tol, |e| at[k].times.next(e)))
                };
                fission(core, running, &waiting, need, choose)
            }
            Boundary::Fission => {
                // The least shape that ends the request by its deadline
                // (alone: as Planaria estimates), else the fastest free one.
                let need = |k: usize, free: Engines| {
                    let (g, a) = (at[k].guaranteed, &at[k]);
                    if !g.within(free) {
                        return None;
                    }
                    Some(
                        least_shape(g, free, |e| a.times.rest(*e) <= a.to_deadline)
                            .unwrap_or_else(|| pick_shape(g, free, tol, |e| a.times.rest(e))),
                    )
                };
                fission(core, running, &waiting, need, choose)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CORE: Engines = Engines::new(4, 4);
    const ONE: Engines = Engines::new(1, 1);

    fn at(slack: f64) -> AtBoundary {
        AtBoundary { guaranteed: ONE, priority: 0, slack }
    }

    /// Everyone wants everything it can get.
    fn greedy(_: usize, _: Engines, cap: Engines) -> Engines {
        cap
    }

    #[test]
    fn a_lone_tenant_borrows_every_idle_engine() {
        assert_eq!(lend(CORE, &[], &[at(0.0)], greedy), [Some(CORE)]);
        // Only what it can use: the choice is clamped to [guarantee, cap].
        assert_eq!(lend(CORE, &[], &[at(0.0)], |_, _, _| Engines::new(9, 0)), [Some(Engines::new(4, 1))]);
    }

    #[test]
    fn guarantees_come_before_lending_and_the_least_slack_borrows_first() {
        // Two at a boundary, one task running on 1+1: each gets its 1+1,
        // the one with less slack gets the two idle pairs.
        let g = lend(CORE, &[ONE], &[at(50.0), at(10.0)], greedy);
        assert_eq!(g, [Some(ONE), Some(Engines::new(2, 2))]);
        // Priority beats slack.
        let hi = AtBoundary { priority: 1, ..at(50.0) };
        let g = lend(CORE, &[ONE], &[hi, at(10.0)], greedy);
        assert_eq!(g, [Some(Engines::new(2, 2)), Some(ONE)]);
    }

    #[test]
    fn an_owner_whose_engines_are_lent_waits_and_nobody_borrows_its_reservation() {
        // A borrower's task holds 3+3 of the core, a second tenant's task
        // 1+1: nothing is free, the owner waits.
        let g = lend(CORE, &[Engines::new(3, 3), ONE], &[at(0.0)], greedy);
        assert_eq!(g, [None]);
        // One pair free: the most urgent takes it, the other waits.
        let g = lend(CORE, &[Engines::new(3, 3)], &[at(5.0), at(0.0)], greedy);
        assert_eq!(g, [None, Some(ONE)]);
        // An owner of 2+2 blocked by a borrower holding 3+1 reserves the
        // 1 SA + 2 VUs that are free of its guarantee: a less urgent tenant
        // gets its own 1 VU and borrows nothing (without the reservation
        // it would take 1+3).
        let owner = AtBoundary { guaranteed: Engines::new(2, 2), ..at(0.0) };
        let small = AtBoundary { guaranteed: Engines::new(0, 1), ..at(5.0) };
        let g = lend(CORE, &[Engines::new(3, 1)], &[owner, small], greedy);
        assert_eq!(g, [None, Some(Engines::new(0, 1))]);
        // Once the borrower's task ends the owner is served first.
        let g = lend(CORE, &[], &[at(0.0), at(-5.0)], |_, b, _| b);
        assert_eq!(g, [Some(ONE), Some(ONE)]);
    }

    #[test]
    fn a_guarantee_larger_than_the_core_gets_the_whole_core() {
        let big = AtBoundary { guaranteed: Engines::new(8, 8), ..at(0.0) };
        assert_eq!(lend(CORE, &[], &[big], |_, b, _| b), [Some(CORE)]);
        assert_eq!(lend(CORE, &[ONE], &[big], |_, b, _| b), [None]);
    }

    #[test]
    fn fission_gives_the_urgent_what_they_need_and_reserves_nothing() {
        // The most urgent needs 3+3, the next 1+1: both fit, the rest (0+0)
        // is lent to no one.
        let need = |i: usize, _| Some(if i == 0 { Engines::new(3, 3) } else { ONE });
        let g = fission(CORE, &[], &[at(0.0), at(9.0)], need, greedy);
        assert_eq!(g, [Some(Engines::new(3, 3)), Some(ONE)]);
        // A running task holds 3+3: the more urgent tenant needs 2+2 and
        // waits, the less urgent takes the free 1+1 (no reservation, no
        // guarantee: the opposite of `lend`).
        let need = |i: usize, _| Some(if i == 0 { Engines::new(2, 2) } else { ONE });
        let g = fission(CORE, &[Engines::new(3, 3)], &[at(0.0), at(9.0)], need, greedy);
        assert_eq!(g, [None, Some(ONE)]);
        // What is left after the needs goes to the most urgent.
        let g = fission(CORE, &[], &[at(5.0), at(1.0)], |_, _| Some(ONE), greedy);
        assert_eq!(g, [Some(ONE), Some(Engines::new(3, 3))]);
        // A need that is not free, or empty, is not granted.
        assert_eq!(fission(CORE, &[CORE], &[at(0.0)], |_, _| Some(ONE), greedy), [None]);
        assert_eq!(fission(CORE, &[], &[at(0.0)], |_, _| Some(Engines::new(0, 0)), greedy), [None]);
    }

    #[test]
    fn pick_shape_takes_engines_only_where_they_pay() {
        // SA-bound: time falls with SAs only.
        let sa_bound = |s: Engines| 100.0 / f64::from(s.sa);
        assert_eq!(pick_shape(ONE, CORE, 0.05, sa_bound), Engines::new(4, 1));
        // Nothing helps: the guarantee.
        assert_eq!(pick_shape(ONE, CORE, 0.05, |_| 7.0), ONE);
        // Within the tolerance the smaller shape wins: 2+2 at 101 against
        // 4+4 at 100.
        let t = |s: Engines| {
            if s.sa >= 2 && s.vu >= 2 {
                if s.total() == 8 {
                    100.0
                } else {
                    101.0
                }
            } else {
                150.0
            }
        };
        assert_eq!(pick_shape(ONE, CORE, 0.05, t), Engines::new(2, 2));
        assert_eq!(pick_shape(ONE, CORE, 0.0, t), CORE);
        // Shapes that cannot be lowered are skipped; none at all: the base.
        let only_odd = |s: Engines| if s.sa % 2 == 1 { 10.0 / f64::from(s.sa) } else { f64::INFINITY };
        assert_eq!(pick_shape(ONE, CORE, 0.0, only_odd), Engines::new(3, 1));
        assert_eq!(pick_shape(ONE, CORE, 0.0, |_| f64::NAN), ONE);
    }

    /// A stage of `work` SA-cycles that splits over SAs (VUs do not
    /// help), `stages` of them in the request.
    struct SaBound {
        work: f64,
        stages: f64,
    }

    impl StageTimes for SaBound {
        fn next(&self, e: Engines) -> f64 {
            if e.sa == 0 || e.vu == 0 {
                f64::INFINITY
            } else {
                self.work / f64::from(e.sa)
            }
        }
        fn rest(&self, e: Engines) -> f64 {
            self.next(e) * self.stages
        }
    }

    fn staged(times: &dyn StageTimes, priority: u8, to_deadline: f64, attained: f64) -> AtStage<'_> {
        AtStage { guaranteed: ONE, priority, to_deadline, attained, times }
    }

    #[test]
    fn a_lone_staged_request_takes_the_engines_that_pay_under_every_policy() {
        let t = SaBound { work: 400.0, stages: 2.0 };
        for boundary in [Boundary::Lend, Boundary::Interleave] {
            let s = Staging { boundary, tolerance: 0.05 };
            // 4 SAs: 100 cycles, the fastest; VUs do not pay.
            assert_eq!(s.grant(CORE, &[], &[staged(&t, 0, f64::INFINITY, 0.0)]), [Some(Engines::new(4, 1))]);
        }
        // Fission: the most urgent takes the least shape whose rest (2
        // stages) meets its deadline: 800 / sa <= 300 needs 3 SAs; the
        // other its 1+1; the 2 idle VUs pay no one.
        let s = Staging { boundary: Boundary::Fission, tolerance: 0.05 };
        let two = [staged(&t, 0, 300.0, 0.0), staged(&t, 0, 1e9, 0.0)];
        assert_eq!(s.grant(CORE, &[], &two), [Some(Engines::new(3, 1)), Some(ONE)]);
        // No shape meets it: the fastest (4 SAs), and nothing is left
        // that the other can run on.
        let two = [staged(&t, 0, 10.0, 0.0), staged(&t, 0, 1e9, 0.0)];
        assert_eq!(s.grant(CORE, &[], &two), [Some(Engines::new(4, 1)), None]);
    }

    #[test]
    fn interleave_serves_the_least_attained_per_priority_first() {
        let t = SaBound { work: 400.0, stages: 1.0 };
        let s = Staging { boundary: Boundary::Interleave, tolerance: 0.05 };
        // Beside a running 1+2, 3 SAs and 2 VUs are free: the one with
        // less attained time takes the fastest shape (3+1), and the 1 VU
        // left is not enough for the other.
        let busy = [Engines::new(1, 2)];
        let g = s.grant(CORE, &busy, &[staged(&t, 1, 0.0, 50.0), staged(&t, 1, 0.0, 10.0)]);
        assert_eq!(g, [None, Some(Engines::new(3, 1))]);
        // Priority 10 divides the first one's attained time to 5.
        let g = s.grant(CORE, &busy, &[staged(&t, 10, 0.0, 50.0), staged(&t, 1, 0.0, 10.0)]);
        assert_eq!(g, [Some(Engines::new(3, 1)), None]);
    }

    #[test]
    fn lend_orders_staged_requests_by_slack_on_their_guarantee() {
        // Same deadline; the longer rest has less slack and borrows.
        let short = SaBound { work: 400.0, stages: 1.0 };
        let long = SaBound { work: 400.0, stages: 3.0 };
        let s = Staging { boundary: Boundary::Lend, tolerance: 0.05 };
        let g = s.grant(CORE, &[], &[staged(&short, 0, 5000.0, 0.0), staged(&long, 0, 5000.0, 0.0)]);
        assert_eq!(g, [Some(ONE), Some(Engines::new(3, 1))]);
    }
}
