//! A stream of tenants on one simulated board: each arrives at a time of
//! its own on the cores it is given, sends a fixed number of inference
//! requests back to back (input over the host link, program, output, as in
//! [`crate::corun`]) and leaves when the last one is done. A tenant of
//! several cores (a multi-core vNPU) runs each phase of a request on all
//! of them at once, data-parallel, and starts the next phase when the
//! last of them is done. Everything the
//! tenants meet on the way (co-tenants that come and go, each core's DMA
//! engines, each chip's HBM, the board's host link) is the board model's,
//! in one continuous simulation run by the device's own board runtime
//! (`npu_board_runtime::Runtime`: each phase is a request of the tenant's
//! vNPU claiming its SAs and VUs on the core, dispatched as the daemon
//! dispatches it): what a placement policy's choices cost its tenants,
//! measured rather than predicted.

use npu_board_runtime::Runtime;
use npu_model::BoardConfig;

use crate::corun::{claim, name, CoRunError, Job, RequestPrograms};

struct Tenant<'p> {
    request: &'p RequestPrograms,
    cores: Vec<usize>,
    /// Cores still running the current phase.
    pending: usize,
    /// Requests still to send, the current one included.
    left: u64,
    phase: usize,
    arrived: f64,
    left_at: Option<f64>,
}

/// The board and its tenants, advanced in time by the caller (between
/// arrivals).
pub struct Stream<'c, 'p> {
    board: Runtime<'c, Job<'p>>,
    tenants: Vec<Tenant<'p>>,
}

impl std::fmt::Debug for Stream<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("now", &self.now()).field("tenants", &self.tenants.len()).finish()
    }
}

impl<'c, 'p> Stream<'c, 'p> {
    /// An idle board of `cfg` at time 0 (every resource contended, as on
    /// the hardware).
    pub fn new(cfg: &'c BoardConfig) -> Self {
        Self { board: Runtime::new(cfg), tenants: Vec::new() }
    }

    /// Simulated cycles since the stream began.
    pub fn now(&self) -> f64 {
        self.board.now()
    }

    /// A tenant arrives now on `cores` (one or more distinct cores) with
    /// `requests` requests (at least one) of `request` to send; returns its
    /// id (0, 1, ... in arrival order).
    pub fn admit(
        &mut self,
        request: &'p RequestPrograms,
        cores: &[usize],
        requests: u64,
    ) -> Result<usize, CoRunError> {
        let id = self.tenants.len();
        let n = self.board.cores();
        if let Some(&core) = cores.iter().find(|&&c| c >= n) {
            return Err(CoRunError::NoCore { tenant: id, core, cores: n });
        }
        let twice = cores.iter().enumerate().find(|&(i, c)| cores[..i].contains(c));
        if cores.is_empty() || twice.is_some() {
            return Err(CoRunError::BadCores { tenant: id, core: twice.map_or(0, |(_, &c)| c) });
        }
        for &core in cores {
            // Checked above: every core exists.
            let _ = self.board.submit(
                core,
                &name(id),
                claim(request),
                Job { tenant: id, program: request.phase(0) },
            );
        }
        let arrived = self.board.now();
        self.tenants.push(Tenant {
            request,
            cores: cores.to_vec(),
            pending: cores.len(),
            left: requests.max(1),
            phase: 0,
            arrived,
            left_at: None,
        });
        Ok(id)
    }

    /// Runs the board until simulated time `until` (or, with infinity,
    /// until every tenant has left); returns the tenants that left on the
    /// way, in the order they did.
    pub fn run_until(&mut self, until: f64) -> Result<Vec<usize>, CoRunError> {
        let mut gone = Vec::new();
        loop {
            let finished = self.board.step(until);
            if finished.is_empty() {
                if until.is_infinite() && self.tenants.iter().any(|t| t.left_at.is_none()) {
                    return Err(CoRunError::Stuck);
                }
                return Ok(gone);
            }
            let now = self.board.now();
            for done in finished {
                let (id, report) = (done.job.tenant, done.result);
                let Some(t) = self.tenants.get_mut(id) else { return Err(CoRunError::Stuck) };
                report.map_err(|source| CoRunError::Exec {
                    tenant: id,
                    workload: t.request.spec.workload.clone(),
                    source,
                })?;
                t.pending = t.pending.saturating_sub(1);
                if t.pending > 0 {
                    continue;
                }
                if t.phase < 2 {
                    t.phase += 1;
                } else {
                    t.phase = 0;
                    t.left -= 1;
                    if t.left == 0 {
                        t.left_at = Some(now);
                        gone.push(id);
                        continue;
                    }
                }
                t.pending = t.cores.len();
                let program = t.request.phase(t.phase);
                let claim = claim(t.request);
                for &core in &t.cores {
                    let _ = self.board.submit(core, &name(id), claim, Job { tenant: id, program });
                }
            }
        }
    }

    /// When tenant `id` arrived and (once it has) left.
    pub fn times(&self, id: usize) -> Option<(f64, Option<f64>)> {
        self.tenants.get(id).map(|t| (t.arrived, t.left_at))
    }
}
