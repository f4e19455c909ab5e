//! Tenants in a closed loop on a simulated board: each sends one
//! inference request after another (input from guest memory over the host
//! link, the workload's program, output back to guest memory) while the
//! others do the same, so every request meets the others' whole programs
//! at every phase. What they contend for is the board model's
//! ([`npu_model::BoardSim`], run by the board runtime
//! `npu_board_runtime::Runtime`): each core's DMA engines, each chip's
//! HBM, the board's host link; tenants of one time-shared group also wait
//! for each other's engines (one phase at a time, oldest request first).

use npu_board_runtime::{Claim, Runtime, Staged};
use npu_model::{BoardConfig, Contention, CoreMemory, ExecError, SimTenant, Totals};
use npu_workloads::{lower_workload, RunError, RunOptions};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use vnpu_abi::{Addr, Engine, Instr, Program, ProgramBuilder};

/// Why a co-run could not be made or finish.
#[derive(Debug, Error)]
pub enum CoRunError {
    #[error("{workload} batch {batch} on {sa} SA + {vu} VU: {source}")]
    Lower { workload: String, batch: u32, sa: u32, vu: u32, source: Box<RunError> },
    #[error("{workload}: its input or output ({bytes} bytes) is larger than one DMA descriptor moves")]
    TooLarge { workload: String, bytes: u64 },
    #[error("tenant {tenant} placed on core {core}; the board has {cores} cores")]
    NoCore { tenant: usize, core: usize, cores: usize },
    #[error("tenant {tenant} placed on no core, or twice on core {core}: a tenant's cores are distinct")]
    BadCores { tenant: usize, core: usize },
    #[error("tenant {tenant} ({workload}) failed: {source}")]
    Exec { tenant: usize, workload: String, source: ExecError },
    #[error("the simulation stopped with requests unfinished (a model bug)")]
    Stuck,
}

/// A tenant: which workload at which batch on which vNPU shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Spec {
    pub workload: String,
    pub batch: u32,
    pub sa: u32,
    pub vu: u32,
}

impl std::fmt::Display for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} b{} {}+{}", self.workload, self.batch, self.sa, self.vu)
    }
}

/// The three programs of one request of a tenant.
#[derive(Clone, Debug)]
pub struct RequestPrograms {
    pub spec: Spec,
    /// Guest memory -> HBM: the input tensor.
    pub input: Program,
    /// The workload, HBM to HBM.
    pub body: Program,
    /// HBM -> guest memory: the output tensor.
    pub output: Program,
}

fn copy(src: Addr, dst: Addr, bytes: u64, workload: &str) -> Result<Program, CoRunError> {
    let row_bytes =
        u32::try_from(bytes).map_err(|_| CoRunError::TooLarge { workload: workload.to_string(), bytes })?;
    let mut b = ProgramBuilder::new();
    b.push(Engine::DMA, Instr::DmaCopy { src, dst, rows: 1, row_bytes, src_stride: 0, dst_stride: 0 });
    Ok(b.finish())
}

/// How a study names the items [`RequestPrograms::lower_if_fits`] leaves
/// out, before their list.
pub const LEFT_OUT: &str =
    "left out (too large for the vNPU: its tensors exceed the HBM, or its program the instructions of a request)";

impl RequestPrograms {
    /// Lowers `spec` for a vNPU of its shape with the core's SRAM and HBM
    /// in proportion to its EUs (what a tenant of that shape is given).
    pub fn lower(cfg: &BoardConfig, spec: &Spec) -> Result<Self, CoRunError> {
        let eus = u64::from(cfg.core.sa_count + cfg.core.vu_count).max(1);
        let mine = u64::from(spec.sa + spec.vu);
        let hbm_core = cfg.hbm_bytes_per_chip() / u64::from(cfg.cores_per_chip.max(1));
        // SRAM in whole 2 MiB slices, as the manager allocates it.
        let slice = 2u64 << 20;
        let sram = (cfg.sram_bytes() * mine / eus / slice).max(1) * slice;
        let o = RunOptions {
            sram_bytes: Some(sram),
            hbm_bytes: Some(hbm_core * mine / eus),
            sa: spec.sa,
            vu: spec.vu,
            ..RunOptions::on_board(cfg, spec.workload.clone(), spec.batch)
        };
        let lower_err = |source| CoRunError::Lower {
            workload: spec.workload.clone(),
            batch: spec.batch,
            sa: spec.sa,
            vu: spec.vu,
            source: Box::new(source),
        };
        let (lowered, _, _) = lower_workload(cfg, &o).map_err(lower_err)?;
        let input = &lowered.tensors[lowered.input];
        let output = &lowered.tensors[lowered.output];
        Ok(Self {
            spec: spec.clone(),
            input: copy(Addr::guest(0), Addr::hbm(input.offset), input.elems * 4, &spec.workload)?,
            body: lowered.program,
            output: copy(Addr::hbm(output.offset), Addr::guest(0), output.elems * 4, &spec.workload)?,
        })
    }

    /// [`RequestPrograms::lower`], or `None` when the workload's tensors
    /// do not fit the HBM a vNPU of that shape is given, or its program
    /// the instructions of one request (an item a study leaves out rather
    /// than fails on).
    pub fn lower_if_fits(cfg: &BoardConfig, spec: &Spec) -> Result<Option<Self>, CoRunError> {
        match Self::lower(cfg, spec) {
            Ok(p) => Ok(Some(p)),
            Err(CoRunError::Lower { source, .. }) if matches!(*source, RunError::Lower(ref e) if e.is_capacity()) => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn phase(&self, phase: usize) -> &Program {
        match phase {
            0 => &self.input,
            1 => &self.body,
            _ => &self.output,
        }
    }
}

/// A tenant placed on the board: on `core`, and in time-shared `group`
/// (tenants of one group use the same engines: one request at a time).
#[derive(Clone, Copy, Debug)]
pub struct Placed<'p> {
    pub request: &'p RequestPrograms,
    pub core: usize,
    pub group: Option<usize>,
}

/// What one tenant measured: every request it finished while all tenants
/// were sending theirs (a tenant with short requests finishes many while a
/// long one finishes its few, and so meets every phase of it), but the
/// first (a warm-up: all first requests start together at time 0).
#[derive(Clone, Debug, Default)]
pub struct Measured {
    /// Mean cycles from a request's start (its previous one's end) to its
    /// end, waiting for a time-shared group's turn included.
    pub latency: f64,
    /// Requests it finished.
    pub requests: usize,
    /// Counters of those requests, summed over their three programs.
    pub totals: Totals,
}

pub(crate) struct Job<'p> {
    pub(crate) tenant: usize,
    pub(crate) program: &'p Program,
}

/// Each phase is one program on its claim.
impl Staged for Job<'_> {}

impl SimTenant for Job<'_> {
    fn program(&self) -> &Program {
        self.program
    }
    fn memory(&mut self) -> Option<CoreMemory<'_>> {
        None
    }
    fn max_cycles(&self) -> Option<u64> {
        None
    }
}

/// Tenant `id`'s name on the board's cores.
pub(crate) fn name(id: usize) -> String {
    format!("tenant-{id}")
}

/// What a request of `request`'s vNPU claims on each of its cores.
pub(crate) fn claim(request: &RequestPrograms) -> Claim {
    Claim { sa: request.spec.sa, vu: request.spec.vu, ..Claim::default() }
}

#[derive(Default)]
struct State {
    /// Its first request has ended (the warm-up: every tenant's first
    /// starts at time 0, in step, an alignment no later request has).
    warm: bool,
    done: usize,
    phase: usize,
    /// When its current request was sent (its previous one ended): on
    /// the board's timeline, the arrival each phase of it carries.
    since: f64,
    latency: f64,
    /// Counters of the current request so far.
    request: Totals,
    /// Counters of the counted requests.
    totals: Totals,
}

/// Runs `tenants` together on a board of `cfg`, contending for what
/// `contention` says, until each has finished `iterations` requests after
/// its first (every tenant keeps sending until the last one is done, and
/// all its finished requests but the first count); returns what each
/// measured, in order.
///
/// The board runtime (`npu_board_runtime::Runtime`, the daemon's) runs
/// them: each phase of a request is a request of the tenant's vNPU on its
/// core, claiming the tenant's SAs and VUs, or the whole core for a
/// tenant of a time-shared group (so the group's phases go one at a time,
/// a phase that waited for the core after an engine switch). The second
/// and third phases of a request claim a higher priority than a new
/// request's first: a request under way goes on before the group's next
/// one starts (one request of the group at a time, in the order they
/// were sent).
pub fn closed_loop<'p>(
    cfg: &BoardConfig,
    tenants: &[Placed<'p>],
    contention: Contention,
    iterations: usize,
) -> Result<Vec<Measured>, CoRunError> {
    let iterations = iterations.max(1);
    let mut board: Runtime<'_, Job<'p>> = Runtime::new(cfg);
    board.set_contention(contention);
    board.set_harvesting(false);
    let cores = board.cores();
    for (tenant, t) in tenants.iter().enumerate() {
        if t.core >= cores {
            return Err(CoRunError::NoCore { tenant, core: t.core, cores });
        }
    }
    let claim_of = |t: &Placed<'_>, phase: usize| {
        let priority = u8::from(phase > 0);
        match t.group {
            Some(_) => Claim { priority, ..Claim::whole_core(cfg) },
            None => Claim { priority, ..claim(t.request) },
        }
    };
    let send = |board: &mut Runtime<'_, Job<'p>>, tenant: usize, phase: usize, since: f64| {
        let t = &tenants[tenant];
        let job = Job { tenant, program: t.request.phase(phase) };
        // The core exists (checked above).
        let _ = board.submit_arrived(t.core, &name(tenant), claim_of(t, phase), job, since);
    };
    let mut state: Vec<State> = tenants.iter().map(|_| State::default()).collect();
    for tenant in 0..tenants.len() {
        send(&mut board, tenant, 0, 0.0);
    }
    while state.iter().any(|s| s.done < iterations) {
        let finished = board.step(f64::INFINITY);
        if finished.is_empty() {
            return Err(CoRunError::Stuck);
        }
        for done in finished {
            let (tenant, now) = (done.job.tenant, done.end);
            let report = done.result.map_err(|source| CoRunError::Exec {
                tenant,
                workload: tenants[tenant].request.spec.workload.clone(),
                source,
            })?;
            let Some(s) = state.get_mut(tenant) else { return Err(CoRunError::Stuck) };
            s.request.merge(&report.totals());
            if s.phase < 2 {
                s.phase += 1;
                send(&mut board, tenant, s.phase, s.since);
                continue;
            }
            // A request ended: count it (after the first, which started
            // in step with every other tenant's), send the next one.
            if s.warm {
                s.latency += now - s.since;
                s.totals.merge(&s.request);
                s.done += 1;
            }
            s.request = Totals::default();
            s.warm = true;
            s.phase = 0;
            s.since = now;
            send(&mut board, tenant, 0, now);
        }
    }
    Ok(state
        .into_iter()
        .map(|s| {
            let n = s.done.max(1) as f64;
            Measured { latency: s.latency / n, requests: s.done, totals: s.totals }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Two equal tenants time-sharing a core's engines take turns a
    /// request at a time: each request waits for the other's whole request,
    /// and the two first phases that waited pay an engine switch each.
    #[test]
    fn a_time_shared_pair_takes_turns_a_request_at_a_time() {
        let cfg = BoardConfig::default();
        let spec = Spec { workload: "ncf".into(), batch: 1, sa: 1, vu: 1 };
        let r = RequestPrograms::lower(&cfg, &spec).unwrap();
        let solo =
            closed_loop(&cfg, &[Placed { request: &r, core: 0, group: None }], Contention::default(), 3)
                .unwrap()[0]
                .latency;
        let pair = [Placed { request: &r, core: 0, group: Some(0) }; 2];
        let sw = npu_board_runtime::switch_cycles(&cfg);
        for contention in
            [Contention::default(), Contention { dma_engines: false, hbm: false, host_link: false }]
        {
            let m = closed_loop(&cfg, &pair, contention, 3).unwrap();
            for t in &m {
                let want = 2.0 * solo + 2.0 * sw;
                assert!(
                    (t.latency - want).abs() <= 1e-9 * want,
                    "{} vs {want} (solo {solo}, switch {sw})",
                    t.latency
                );
                assert_eq!(t.requests, 3);
            }
        }
        // On engines of their own they overlap: faster than taking turns.
        let side = [Placed { request: &r, core: 0, group: None }; 2];
        let m = closed_loop(&cfg, &side, Contention::default(), 3).unwrap();
        assert!(
            m.iter().all(|t| t.latency < 2.0 * solo),
            "{:?}",
            m.iter().map(|t| t.latency).collect::<Vec<_>>()
        );
    }
}
