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

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;

use npu_bench::serve_jobs;
use npu_board_runtime::{Boundary, Claim, Runtime, StageTimes, Staged, Staging};
use npu_graph::Graph;
use npu_lower::{lower_ops_with, LowerOptions, VnpuShape};
use npu_model::{run_program, verify, BoardConfig, CoreMemory, SimTenant, TenantReport, VnpuLimits};
use npu_scheduler::Engines;
use vnpu_abi::{Program, ProgramBuilder};

use crate::{Outcome, Workload};

/// How the operator-task systems cut requests and pick shapes.
#[derive(Clone, Copy, Debug)]
pub struct Lending {
    /// Target length of one task on the engines it runs on (cycles).
    pub task_cycles: f64,
    /// An engine more is taken only if it makes the task this much faster
    /// (a fraction; `pick_shape`'s tolerance).
    pub tolerance: f64,
    /// Who gets the core's engines at a task boundary
    /// (`npu_scheduler::Boundary`).
    pub policy: Boundary,
    /// Every tenant's guaranteed shape (its share of the core, as in the
    /// static vNPU system); tasks are cut to `task_cycles` on it.
    pub guarantee: Engines,
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
            fuse_blocks: false,
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

/// A request of a tenant of an operator-task system, as the board
/// runtime stages it (`npu_board_runtime::Staged`): its next task is the
/// operations from `op` that fit in `task_cycles` on the engines it is
/// granted, lowered for them.
struct TaskRequest<'t, 'm> {
    tenant: usize,
    arrival: f64,
    tasks: &'t RefCell<&'m mut Tasks>,
    task_cycles: f64,
    /// Its claim's engines (tasks are cut on them).
    guarantee: Engines,
    /// Its next operation, and the end of the task it runs now.
    op: usize,
    end: usize,
    program: Rc<Program>,
    /// Active SA + VU cycles of its tasks so far.
    eu_cycles: f64,
    /// A task could not be lowered (none expected: every operation was
    /// lowered for every shape before).
    failed: Option<String>,
}

impl StageTimes for TaskRequest<'_, '_> {
    /// Its next task as cut on its guarantee (at least one operation).
    fn next(&self, e: Engines) -> f64 {
        let t = self.tasks.borrow();
        t.cycles(self.op..t.task_end(self.op, self.guarantee, self.task_cycles), e)
    }

    fn rest(&self, e: Engines) -> f64 {
        let t = self.tasks.borrow();
        t.cycles(self.op..t.ops(), e)
    }
}

impl Staged for TaskRequest<'_, '_> {
    fn stage_times(&self) -> Option<&dyn StageTimes> {
        Some(self)
    }

    fn begin_stage(&mut self, e: Engines) {
        let mut t = self.tasks.borrow_mut();
        self.end = t.task_end(self.op, e, self.task_cycles);
        match t.program(self.op..self.end, e) {
            Ok(p) => self.program = p,
            Err(x) => {
                self.failed = Some(x);
                self.program = Rc::new(ProgramBuilder::new().finish());
            }
        }
    }

    fn end_stage(&mut self, report: &TenantReport) -> bool {
        let tot = report.totals();
        self.eu_cycles += tot.sa_active_cycles + tot.vu_active_cycles;
        self.op = self.end;
        self.failed.is_none() && self.op < self.tasks.borrow().ops()
    }
}

impl SimTenant for TaskRequest<'_, '_> {
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

/// Submits tenant `i`'s request that arrived at `arrival` to core 0.
fn submit_task<'t, 'm>(
    rt: &mut Runtime<'_, TaskRequest<'t, 'm>>,
    ws: &[Workload],
    tasks: &'t [RefCell<&'m mut Tasks>],
    empty: &Rc<Program>,
    how: Lending,
    i: usize,
    arrival: f64,
) -> Result<(), String> {
    let (Some(w), Some(t)) = (ws.get(i), tasks.get(i)) else {
        return Err(format!("no tenant {i}"));
    };
    let claim = Claim {
        sa: how.guarantee.sa,
        vu: how.guarantee.vu,
        priority: w.priority,
        slo_cycles: w.sla as u64,
        borrow: Engines::default(),
    };
    let req = TaskRequest {
        tenant: i,
        arrival,
        tasks: t,
        task_cycles: how.task_cycles,
        guarantee: how.guarantee,
        op: 0,
        end: 0,
        program: empty.clone(),
        eu_cycles: 0.0,
        failed: None,
    };
    rt.submit_arrived(0, &format!("{i}:{}", w.name), claim, req, arrival)
        .map_err(|_| "the board has no core 0".to_string())
}

/// Runs the arrival stream on the board runtime's core 0 with `how`'s
/// boundary policy (`Runtime::set_staging`). `tasks[i]` is tenant `i`'s
/// workload cut into operations; each tenant claims `how.guarantee` with
/// its priority and its workload's `sla` as latency target (the deadline
/// whose slack orders lending). Fails if a task cannot be lowered.
pub fn simulate_lending(
    board: &BoardConfig,
    ws: &[Workload],
    tasks: &mut [Tasks],
    arrivals: &[Vec<f64>],
    how: Lending,
) -> Result<Outcome, String> {
    let n = ws.len().min(tasks.len()).min(arrivals.len());
    let mut o = Outcome::new(n);
    let tasks: Vec<RefCell<&mut Tasks>> = tasks.iter_mut().map(RefCell::new).collect();
    let mut rt: Runtime<'_, TaskRequest<'_, '_>> = Runtime::new(board);
    rt.set_harvesting(false);
    rt.set_staging(Staging { boundary: how.policy, tolerance: how.tolerance });
    let empty = Rc::new(ProgramBuilder::new().finish());
    let mut failure = None;
    let submit = |rt: &mut Runtime<'_, _>, i, arrival| submit_task(rt, ws, &tasks, &empty, how, i, arrival);
    serve_jobs(
        &mut rt,
        &arrivals[..n],
        submit,
        |r| r.tenant,
        |done| {
            let req = done.job;
            o.eu_cycles += req.eu_cycles;
            if let Some(x) = req.failed {
                failure.get_or_insert(x);
            }
            match done.result {
                Ok(_) => o.latencies[req.tenant].push(done.end - req.arrival),
                Err(_) => o.failed += 1,
            }
            o.end = o.end.max(done.end);
            Ok(())
        },
    )?;
    if let Some(x) = failure {
        return Err(x);
    }
    let st = rt.stats(0);
    o.tasks = st.stages;
    o.add_reclaims(&st);
    o.borrowed_eu_cycles += st.harvest.iter().map(|h| h.1.borrowed_cycles).sum::<f64>();
    Ok(o)
}

/// Per-tenant request rates (per cycle) at which the operator-task core
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
            share: GUARANTEED,
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

    /// A quarter of the test board's core, as its static vNPUs.
    const GUARANTEED: Engines = Engines::new(1, 1);

    const ONE_OP: Lending =
        Lending { task_cycles: 1.0, tolerance: 0.05, policy: Boundary::Lend, guarantee: GUARANTEED };

    #[test]
    fn a_lone_request_runs_each_operation_on_the_engines_that_pay() {
        let board = BoardConfig::test_board();
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
        let board = BoardConfig::test_board();
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
        let board = BoardConfig::test_board();
        let g = mlp();
        let mut tasks: Vec<Tasks> = (0..3).map(|_| Tasks::new(&board, g.clone()).unwrap()).collect();
        let mut ws = [workload(), workload(), workload()];
        let v10 = Lending { policy: Boundary::Interleave, ..ONE_OP };
        // Alone, a tenant takes the fastest shape of the whole core for
        // each operation, as a lone vNPU-WC tenant borrows it.
        let alone = [vec![0.0], vec![], vec![]];
        let a = simulate_lending(&board, &ws, &mut tasks, &alone, v10).unwrap().latencies[0][0];
        let b = simulate_lending(&board, &ws, &mut tasks, &alone, ONE_OP).unwrap().latencies[0][0];
        assert!((a - b).abs() <= 1e-9 * b, "{a} vs {b}");
        // Three at once: the fastest shape takes every SA, so one task
        // runs at a time, and at equal priorities in turns by the engine
        // time each has had: the first to end has waited for two tasks of
        // each other tenant (7 tasks in all, 3 with a FIFO order), the
        // last ends two tasks (and their engine switches) later.
        let (shape, t) = best(&board, &g, 0, 0.05);
        assert_eq!(shape.sa, 4, "{shape:?}");
        let switch = npu_scheduler::switch_cycles(&board);
        let all = [vec![0.0], vec![0.0], vec![0.0]];
        let o = simulate_lending(&board, &ws, &mut tasks, &all, v10).unwrap();
        let l: Vec<f64> = o.latencies.iter().map(|l| l[0]).collect();
        let lo = l.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert!(lo >= 7.0 * t * (1.0 - 1e-9), "{l:?}: first ends before 7 tasks of {t}");
        assert!(hi - lo <= 2.0 * (t + switch) * (1.0 + 1e-9), "{l:?}: turns of {t} + {switch}");
        // At priority 12 its attained time counts a twelfth: it goes first
        // at every boundary and ends first.
        ws[1].priority = 12;
        let o = simulate_lending(&board, &ws, &mut tasks, &all, v10).unwrap();
        let l: Vec<f64> = o.latencies.iter().map(|l| l[0]).collect();
        assert!(l[1] < l[0] && l[1] < l[2], "{l:?}");
        assert_eq!(o.failed, 0);
    }

    #[test]
    fn an_owner_gets_its_engines_back_when_the_borrowers_task_ends() {
        let board = BoardConfig::test_board();
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
