//! The work-conserving vNPU system: each tenant owns a
//! 1 SA + 1 VU vNPU of the core as in the static system, but its requests
//! run as operator-level tasks (`npu_lower::lower_ops`), and at every
//! task boundary `npu_scheduler::lend` gives it its guarantee plus idle
//! engines (least slack first, along its per-operation profile:
//! `npu_scheduler::pick_shape`); borrowed engines come back at the
//! borrower's next task boundary. Tasks are cut so that one lasts about
//! `task_cycles` on the engines it runs on (at least one operation), which
//! bounds how long an owner waits for engines it lent.
//!
//! The same core also runs the **Planaria-like** comparison system
//! (`Lending::fission`): no guarantees; at each task boundary the most
//! urgent tenant takes the least shape whose time for the rest of its
//! request meets its deadline (the fastest free shape if none does), the
//! next one the same from what is left, then idle engines as above
//! (`npu_scheduler::fission`). Unlike Planaria's hardware, a running task
//! is not re-split when a request arrives: it keeps its engines until its
//! boundary, as in the work-conserving system.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::rc::Rc;

use npu_graph::Graph;
use npu_lower::{lower_ops_with, LowerOptions, VnpuShape};
use npu_model::{run_program, verify, BoardConfig, CoreMemory, CoreSim, SimTenant, VnpuLimits};
use npu_scheduler::{fission, least_shape, lend, pick_shape, AtBoundary, Engines};
use vnpu_abi::Program;

use crate::{Outcome, Workload};

/// Who gets the core's engines at a task boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// vNPU-WC: guarantees first, then idle engines (priority, least
    /// slack).
    Lend,
    /// Planaria-like fission: no guarantees; the most urgent (priority,
    /// least slack) takes the least shape that meets its deadline.
    Fission,
    /// V10-like operator interleaving: no guarantees, no deadlines; the
    /// tenant with the least engine time attained per unit of priority
    /// goes first and takes the fastest shape of what is free (within the
    /// tolerance), the next one the same from what is left.
    Interleave,
}

/// How the operator-task systems cut requests and pick shapes.
#[derive(Clone, Copy, Debug)]
pub struct Lending {
    /// Target length of one task on the engines it runs on (cycles).
    pub task_cycles: f64,
    /// An engine more is taken only if it makes the task this much faster
    /// (a fraction; `pick_shape`'s tolerance).
    pub tolerance: f64,
    pub policy: Policy,
}

/// A workload cut into operations, each timed alone on every shape of the
/// core; tasks (ranges of operations) lowered on first use.
pub struct Tasks {
    graph: Graph,
    /// How each task is lowered: the board's `[lowering]`, with residual
    /// adds fused into `graph` beforehand (a fused convolution is one
    /// operation, so any range of operations can be a task).
    options: LowerOptions,
    core: Engines,
    /// SRAM per engine: a shape of k engines gets k of them (1 SA + 1 VU:
    /// a quarter of the core's SRAM, as the static vNPU).
    sram_per_engine: u64,
    hbm_bytes: u64,
    sa_rows: u32,
    sa_cols: u32,
    /// `op_cycles[op][shape index]`: cycles of the operation alone.
    op_cycles: Vec<Vec<f64>>,
    cache: HashMap<(usize, usize, Engines), Rc<Program>>,
    /// Tasks lowered so far.
    lowered: usize,
}

impl Tasks {
    /// Times every operation of `graph` on every shape of `board`'s core,
    /// lowered as `board` says (`[lowering]`).
    pub fn new(board: &BoardConfig, graph: Graph) -> Result<Self, String> {
        let core = Engines::new(board.core.sa_count, board.core.vu_count);
        let l = &board.lowering;
        let graph = if l.fuse_residual { npu_lower::fuse_residual_adds(&graph) } else { graph };
        let options = LowerOptions {
            dtype: match l.dtype {
                npu_model::config::NumType::F32 => vnpu_abi::DType::F32,
                npu_model::config::NumType::Bf16 => vnpu_abi::DType::Bf16,
            },
            bf16_activations: l.bf16_activations(),
            reuse_hbm: l.reuse_hbm,
            fuse_residual: false,
            stream_weights: l.stream_weights,
            // Operator-level tasks leave their outputs in HBM.
            keep_on_chip: false,
        };
        let mut t = Self {
            graph,
            options,
            core,
            sram_per_engine: board.sram_bytes() / u64::from(core.total().max(1)),
            hbm_bytes: 8 << 30,
            sa_rows: board.core.sa_rows,
            sa_cols: board.core.sa_cols,
            op_cycles: Vec::new(),
            cache: HashMap::new(),
            lowered: 0,
        };
        for op in 0..t.graph.ops.len() {
            let mut row = Vec::new();
            for sa in 1..=core.sa {
                for vu in 1..=core.vu {
                    let e = Engines::new(sa, vu);
                    let p = lower_ops_with(&t.graph, op..op + 1, t.shape(e), t.options)
                        .map_err(|x| t.err(op, e, &x))?;
                    let r = run_program(board, &p.program, None, None).map_err(|x| t.err(op, e, &x))?;
                    row.push(r.cycles);
                }
            }
            t.op_cycles.push(row);
        }
        Ok(t)
    }

    fn err(&self, op: usize, e: Engines, x: &dyn std::fmt::Display) -> String {
        format!("{} operation {op} on {}+{}: {x}", self.graph.name, e.sa, e.vu)
    }

    pub fn ops(&self) -> usize {
        self.op_cycles.len()
    }

    fn shape(&self, e: Engines) -> VnpuShape {
        VnpuShape {
            sa: e.sa,
            vu: e.vu,
            sram_bytes: self.sram_per_engine * u64::from(e.total()),
            hbm_bytes: self.hbm_bytes,
            sa_rows: self.sa_rows,
            sa_cols: self.sa_cols,
        }
    }

    /// Cycles of operations `ops` alone on `e`, one after the other
    /// (infinity for a shape outside the core).
    pub fn cycles(&self, ops: Range<usize>, e: Engines) -> f64 {
        if e.sa == 0 || e.vu == 0 || !e.within(self.core) {
            return f64::INFINITY;
        }
        let k = ((e.sa - 1) * self.core.vu + (e.vu - 1)) as usize;
        self.op_cycles.get(ops).unwrap_or_default().iter().map(|r| r[k]).sum()
    }

    /// The end of the task that starts at operation `op` on `e`: as many
    /// operations as fit in `limit` cycles there, at least one.
    pub fn task_end(&self, op: usize, e: Engines, limit: f64) -> usize {
        let mut end = (op + 1).min(self.ops());
        while end < self.ops() && self.cycles(op..end + 1, e) <= limit {
            end += 1;
        }
        end
    }

    /// Task `ops` lowered for `e` and verified against that shape's limits.
    pub fn program(&mut self, ops: Range<usize>, e: Engines) -> Result<Rc<Program>, String> {
        let key = (ops.start, ops.end, e);
        if let Some(p) = self.cache.get(&key) {
            return Ok(p.clone());
        }
        let shape = self.shape(e);
        let l = lower_ops_with(&self.graph, ops.clone(), shape, self.options)
            .map_err(|x| self.err(ops.start, e, &x))?;
        let limits = VnpuLimits {
            sa: e.sa,
            vu: e.vu,
            sram_bytes: shape.sram_bytes,
            hbm_bytes: shape.hbm_bytes,
            guest: Vec::new(),
            borrow_sa: 0,
            borrow_vu: 0,
        };
        verify(&l.program, &limits).map_err(|x| self.err(ops.start, e, &x))?;
        let p = Rc::new(l.program);
        self.cache.insert(key, p.clone());
        self.lowered += 1;
        Ok(p)
    }
}

/// One task on the core: its tenant, the operation after its last, and
/// its program.
struct Task {
    tenant: usize,
    end: usize,
    program: Rc<Program>,
    /// When it started and on what.
    start: f64,
    engines: Engines,
}

impl SimTenant for Task {
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

/// A tenant of the work-conserving core.
#[derive(Default)]
struct Tenant {
    /// Arrival times of its requests that have not completed.
    queue: VecDeque<f64>,
    /// The next operation of its oldest request.
    op: usize,
    /// What its task on the core holds.
    running: Option<Engines>,
    /// Since when it has waited at a boundary for engines it lent.
    blocked_since: Option<f64>,
}

/// The guaranteed shape of every tenant: a quarter of the default core, as
/// in the static vNPU system.
pub const GUARANTEED: Engines = Engines::new(1, 1);

/// Runs the arrival stream on the work-conserving core. `tasks[i]` is
/// tenant `i`'s workload cut into operations; a request's latency bound is
/// its workload's `sla` (the deadline whose slack orders lending). Fails if a task cannot be
/// lowered (none expected: every operation was lowered for every shape
/// before).
pub fn simulate_lending(
    board: &BoardConfig,
    ws: &[Workload],
    tasks: &mut [Tasks],
    arrivals: &[Vec<f64>],
    how: Lending,
) -> Result<Outcome, String> {
    let n = ws.len();
    let core = Engines::new(board.core.sa_count, board.core.vu_count);
    let mut o = Outcome::new(n);
    let mut sim: CoreSim<'_, Task> = CoreSim::new(board, n);
    let mut ts: Vec<Tenant> = (0..n).map(|_| Tenant::default()).collect();
    let mut next = vec![0usize; n];
    // Engine-cycles each tenant's tasks have held (V10-like order).
    let mut attained = vec![0f64; n];
    loop {
        let now = sim.now();
        for (i, t) in ts.iter_mut().enumerate() {
            while let Some(&a) = arrivals[i].get(next[i]).filter(|a| **a <= now) {
                next[i] += 1;
                t.queue.push_back(a);
            }
        }
        let at: Vec<usize> = (0..n).filter(|&i| ts[i].running.is_none() && !ts[i].queue.is_empty()).collect();
        // Cycles from now to each one's deadline.
        let to_deadline: Vec<f64> =
            at.iter().map(|&i| ts[i].queue.front().copied().unwrap_or(now) + ws[i].sla - now).collect();
        let waiting: Vec<AtBoundary> = at
            .iter()
            .zip(&to_deadline)
            .map(|(&i, d)| match how.policy {
                // The order key in the slack field: least attained engine
                // time per unit of priority first.
                Policy::Interleave => AtBoundary {
                    guaranteed: GUARANTEED,
                    priority: 0,
                    slack: attained[i] / f64::from(ws[i].priority.max(1)),
                },
                _ => AtBoundary {
                    guaranteed: GUARANTEED,
                    priority: ws[i].priority,
                    slack: d - tasks[i].cycles(ts[i].op..tasks[i].ops(), GUARANTEED),
                },
            })
            .collect();
        let running: Vec<Engines> = ts.iter().filter_map(|t| t.running).collect();
        let choose = |k: usize, base, cap| {
            let i = at[k];
            let op = ts[i].op;
            // Choose on the operations the next task would hold on the
            // guarantee (at least the next one).
            let window = op..tasks[i].task_end(op, GUARANTEED, how.task_cycles);
            pick_shape(base, cap, how.tolerance, |e| tasks[i].cycles(window.clone(), e))
        };
        let grants = if how.policy == Policy::Interleave {
            // The fastest shape of what is free for the next task's
            // operations (at least one SA and one VU: every lowering needs
            // both), then what is left to the next.
            let need = |k: usize, free: Engines| {
                let i = at[k];
                if !GUARANTEED.within(free) {
                    return None;
                }
                let op = ts[i].op;
                let window = op..tasks[i].task_end(op, GUARANTEED, how.task_cycles);
                Some(pick_shape(GUARANTEED, free, how.tolerance, |e| tasks[i].cycles(window.clone(), e)))
            };
            fission(core, &running, &waiting, need, choose)
        } else if how.policy == Policy::Fission {
            // The least shape that finishes the request by its deadline
            // (alone: as Planaria estimates), else the fastest free one.
            let need = |k: usize, free: Engines| {
                let i = at[k];
                if !GUARANTEED.within(free) {
                    return None;
                }
                let rest = ts[i].op..tasks[i].ops();
                let time = |e: &Engines| tasks[i].cycles(rest.clone(), *e);
                Some(
                    least_shape(GUARANTEED, free, |e| time(e) <= to_deadline[k])
                        .unwrap_or_else(|| pick_shape(GUARANTEED, free, how.tolerance, |e| time(&e))),
                )
            };
            fission(core, &running, &waiting, need, choose)
        } else {
            lend(core, &running, &waiting, choose)
        };
        for (&i, g) in at.iter().zip(grants) {
            let t = &mut ts[i];
            let Some(e) = g else {
                t.blocked_since.get_or_insert(now);
                continue;
            };
            if let Some(since) = t.blocked_since.take() {
                o.reclaim_waits += 1;
                o.reclaim_max = o.reclaim_max.max(now - since);
            }
            let end = tasks[i].task_end(t.op, e, how.task_cycles);
            let program = tasks[i].program(t.op..end, e)?;
            sim.add(Task { tenant: i, end, program, start: now, engines: e }, 0.0);
            o.tasks += 1;
            t.running = Some(e);
        }
        let next_arrival =
            (0..n).filter_map(|i| arrivals[i].get(next[i]).copied()).fold(f64::INFINITY, f64::min);
        if sim.is_idle() && !next_arrival.is_finite() {
            // Nothing runs and nothing will arrive: every queue is empty
            // (an idle core lends its guarantee to everyone at a boundary).
            break;
        }
        for (_, task, r) in sim.step_until(next_arrival) {
            let t = &mut ts[task.tenant];
            t.running = None;
            t.op = task.end;
            attained[task.tenant] += f64::from(task.engines.total()) * (sim.now() - task.start);
            let failed = match r {
                Ok(rep) => {
                    let tot = rep.totals();
                    o.eu_cycles += tot.sa_active_cycles + tot.vu_active_cycles;
                    let extra = task.engines.total().saturating_sub(GUARANTEED.total());
                    o.borrowed_eu_cycles += f64::from(extra) * (rep.cycles - task.start);
                    false
                }
                Err(_) => true,
            };
            if failed || t.op >= tasks[task.tenant].ops() {
                let arrival = t.queue.pop_front().unwrap_or(sim.now());
                t.op = 0;
                if failed {
                    o.failed += 1;
                } else {
                    o.latencies[task.tenant].push(sim.now() - arrival);
                }
                o.end = o.end.max(sim.now());
            }
        }
    }
    Ok(o)
}

/// Per-tenant request rates (per cycle) at which the work-conserving core
/// saturates, for relative rates `weights`: a batch of requests in those
/// proportions (the least weighted tenant `rounds` of them) all queued at
/// time 0, served until the last completes: the batch over that time.
/// Pessimistic: towards the end only the longest tenant's requests are
/// left and the core runs below what a steady mix would keep busy.
pub fn saturation_lending(
    board: &BoardConfig,
    ws: &[Workload],
    tasks: &mut [Tasks],
    weights: &[f64],
    rounds: usize,
    how: Lending,
) -> Result<f64, String> {
    let least = weights.iter().copied().fold(f64::INFINITY, f64::min);
    let counts: Vec<usize> = weights.iter().map(|w| ((w / least) * rounds as f64).round() as usize).collect();
    let arrivals: Vec<Vec<f64>> = counts.iter().map(|&c| vec![0.0; c]).collect();
    let o = simulate_lending(board, ws, tasks, &arrivals, how)?;
    let total: usize = counts.iter().sum();
    Ok(total as f64 / o.end.max(1.0) / weights.iter().sum::<f64>())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use npu_graph::{Act, Init, View};
    use npu_lower::lower_ops;
    use vnpu_abi::ProgramBuilder;

    /// Three 64 x 512 x 512 matrix products: SA-bound, faster on more SAs.
    fn mlp() -> Graph {
        let mut g = Graph::new("mlp", 64);
        let x = g.tensor("input", 64 * 512, Init::Input);
        g.input = x;
        let mut v = View::dense(x, 512);
        for i in 0..3 {
            v = g.linear(&format!("fc{i}"), v, 64, 512, 512, Act::Relu, None);
        }
        g.output = v.t;
        g
    }

    fn workload() -> Workload {
        let p = ProgramBuilder::new().finish();
        Workload {
            name: "mlp".into(),
            p11: p.clone(),
            spread: p.clone(),
            spread_k: 1,
            p44: p,
            t11: 1.0,
            t44: 1e12,
            ts11: 1.0,
            ts44: 1.0,
            sla: 1e13,
            priority: 1,
        }
    }

    /// Operation `op` of `g` alone on `sa` + `vu`, lowered and run here
    /// (the reference the simulation's tables are checked against).
    fn alone(board: &BoardConfig, g: &Graph, op: usize, e: Engines) -> f64 {
        let sram = board.sram_bytes() / 8 * u64::from(e.sa + e.vu);
        let shape = VnpuShape::on_board(board, e.sa, e.vu, sram, 8 << 30);
        run_program(board, &lower_ops(g, op..op + 1, shape).unwrap().program, None, None).unwrap().cycles
    }

    /// The shape a lone tenant should get for operation `op`: the fewest
    /// engines (then SAs) within `tol` of the fastest of all 16.
    fn best(board: &BoardConfig, g: &Graph, op: usize, tol: f64) -> (Engines, f64) {
        let all: Vec<(Engines, f64)> = (1..=4)
            .flat_map(|sa| (1..=4).map(move |vu| Engines::new(sa, vu)))
            .map(|e| (e, alone(board, g, op, e)))
            .collect();
        let fastest = all.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
        let mut ok: Vec<_> = all.into_iter().filter(|x| x.1 <= fastest * (1.0 + tol)).collect();
        ok.sort_by_key(|(e, _)| (e.sa + e.vu, e.sa));
        ok[0]
    }

    const ONE_OP: Lending = Lending { task_cycles: 1.0, tolerance: 0.05, policy: Policy::Lend };

    #[test]
    fn a_lone_request_runs_each_operation_on_the_engines_that_pay() {
        let board = BoardConfig::default();
        let g = mlp();
        let mut tasks = [Tasks::new(&board, g.clone()).unwrap(), Tasks::new(&board, g.clone()).unwrap()];
        let ws = [workload(), workload()];
        let o = simulate_lending(&board, &ws, &mut tasks, &[vec![0.0], vec![]], ONE_OP).unwrap();
        let picks: Vec<(Engines, f64)> = (0..3).map(|op| best(&board, &g, op, 0.05)).collect();
        // More SAs pay for these products: the lone tenant borrows.
        assert!(picks.iter().all(|(e, _)| e.sa > 1), "{picks:?}");
        let want: f64 = picks.iter().map(|p| p.1).sum();
        let got = o.latencies[0][0];
        assert!((got - want).abs() <= 1e-6 * want, "latency {got} vs {want} ({picks:?})");
        assert_eq!((o.tasks, o.reclaim_waits, o.failed), (3, 0, 0));
        // It held the engines it borrowed for exactly those operations.
        let lent: f64 = picks.iter().map(|(e, t)| f64::from(e.sa + e.vu - 2) * t).sum();
        assert!((o.borrowed_eu_cycles - lent).abs() <= 1e-6 * lent, "{} vs {lent}", o.borrowed_eu_cycles);
        // Faster than its own 1+1 vNPU, operation by operation.
        let one: f64 = (0..3).map(|op| alone(&board, &g, op, GUARANTEED)).sum();
        assert!(got < one, "{got} vs {one} on 1+1");
    }

    #[test]
    fn a_higher_priority_borrows_the_idle_engines_first() {
        let board = BoardConfig::default();
        let g = mlp();
        let mut tasks: Vec<Tasks> = (0..3).map(|_| Tasks::new(&board, g.clone()).unwrap()).collect();
        let mut ws = [workload(), workload(), workload()];
        // Three equal requests at 0, the same slack: each gets its 1 SA,
        // the one first in order also the fourth, idle SA (a product of 4
        // SA-wide tiles runs faster on 2 SAs), and finishes first.
        let all = [vec![0.0], vec![0.0], vec![0.0]];
        let o = simulate_lending(&board, &ws, &mut tasks, &all, ONE_OP).unwrap();
        let l: Vec<f64> = o.latencies.iter().map(|l| l[0]).collect();
        assert!(l[0] < l[1] && l[0] < l[2], "{l:?}");
        // The last at priority 12 is served first at every boundary.
        ws[2].priority = 12;
        let o = simulate_lending(&board, &ws, &mut tasks, &all, ONE_OP).unwrap();
        let l: Vec<f64> = o.latencies.iter().map(|l| l[0]).collect();
        assert!(l[2] < l[0] && l[2] < l[1], "{l:?}");
    }

    #[test]
    fn the_v10_core_serves_the_least_served_per_priority_first() {
        let board = BoardConfig::default();
        let g = mlp();
        let mut tasks: Vec<Tasks> = (0..3).map(|_| Tasks::new(&board, g.clone()).unwrap()).collect();
        let mut ws = [workload(), workload(), workload()];
        let v10 = Lending { policy: Policy::Interleave, ..ONE_OP };
        // Alone, a tenant takes the fastest shape of the whole core for
        // each operation, as a lone vNPU-WC tenant borrows it.
        let alone = [vec![0.0], vec![], vec![]];
        let a = simulate_lending(&board, &ws, &mut tasks, &alone, v10).unwrap().latencies[0][0];
        let b = simulate_lending(&board, &ws, &mut tasks, &alone, ONE_OP).unwrap().latencies[0][0];
        assert!((a - b).abs() <= 1e-9 * b, "{a} vs {b}");
        // Three at once: at equal priorities the order alternates with the
        // engine time each has had, and the second ends last. At priority
        // 12 its attained time counts a twelfth: it goes first at every
        // boundary and ends first.
        let all = [vec![0.0], vec![0.0], vec![0.0]];
        let o = simulate_lending(&board, &ws, &mut tasks, &all, v10).unwrap();
        let l: Vec<f64> = o.latencies.iter().map(|l| l[0]).collect();
        assert!(l[1] > l[0] && l[1] > l[2], "{l:?}");
        ws[1].priority = 12;
        let o = simulate_lending(&board, &ws, &mut tasks, &all, v10).unwrap();
        let l: Vec<f64> = o.latencies.iter().map(|l| l[0]).collect();
        assert!(l[1] < l[0] && l[1] < l[2], "{l:?}");
        assert_eq!(o.failed, 0);
    }

    #[test]
    fn an_owner_gets_its_engines_back_when_the_borrowers_task_ends() {
        let board = BoardConfig::default();
        let g = mlp();
        let mut tasks = [Tasks::new(&board, g.clone()).unwrap(), Tasks::new(&board, g.clone()).unwrap()];
        let ws = [workload(), workload()];
        let (shape, first) = best(&board, &g, 0, 0.05);
        // The borrower holds every SA: the owner, arriving half-way
        // through that task, cannot have its 1 SA until the task ends.
        assert_eq!(shape.sa, 4, "{shape:?}");
        let arrival = first / 2.0;
        let o = simulate_lending(&board, &ws, &mut tasks, &[vec![0.0], vec![arrival]], ONE_OP).unwrap();
        assert_eq!(o.reclaim_waits, 1);
        let wait = o.reclaim_max;
        assert!((wait - (first - arrival)).abs() <= 1e-6 * first, "waited {wait}, task ended {first}");
        assert_eq!((o.latencies[0].len(), o.latencies[1].len(), o.failed), (1, 1, 0));
        assert!(o.latencies[1][0] > wait);
    }
}
