//! The placement evaluation (`placement-eval`, docs/interference.md):
//! a stream of vNPUs with workloads attached arrives at one board; each
//! policy places the same stream, and one continuous simulation of the
//! board model ([`npu_interference::stream::Stream`]) runs every admitted
//! vNPU's requests beside whatever shares the board with it at the time.
//! A vNPU's slowdown is its run time over its run time alone.
//!
//! Policies: `first-fit` (lowest-numbered core that fits), `balance`
//! (this manager's default: best fit on EUs, EU/memory balance),
//! `random` (any core that fits), `spread` (worst fit: the core with the
//! most EUs left, i.e. the fewest neighbours' EUs), `interference` and
//! `interference-first` ([`Policy`], priced by a [`Predictor`] trained on
//! a characterization matrix), and `oracle` / `oracle-first`: as the two
//! interference policies, but pricing each candidate core by the measured
//! overhead of the board's tenants with the new one there (a co-run of
//! the whole board on the model, [`closed_loop`]).

use std::collections::HashMap;

use npu_interference::characterize::{Matrix, Solo};
use npu_interference::corun::{closed_loop, CoRunError, Placed, RequestPrograms, Spec};
use npu_interference::predict::{Model, PredictError, Predictor};
use npu_interference::stream::Stream;
use npu_model::{BoardConfig, Contention};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use npu_model::config::{HBM_SLICE, SRAM_SLICE};
use vnpu_placement::{predicted_slowdowns, Board, Policy};
use vnpu_spec::{Shape, ShapeError};

/// Why an evaluation could not run.
#[derive(Debug, Error)]
pub enum EvalError {
    #[error(transparent)]
    Model(#[from] CoRunError),
    #[error(transparent)]
    Predict(#[from] PredictError),
    #[error("{0}")]
    Input(String),
    #[error("a vNPU of the stream: {0}")]
    Shape(#[from] ShapeError),
}

/// A placement policy of the evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvalPolicy {
    FirstFit,
    Balance,
    Random,
    Spread,
    Interference,
    InterferenceFirst,
    Oracle,
    OracleFirst,
}

impl EvalPolicy {
    pub const ALL: [EvalPolicy; 8] = [
        EvalPolicy::FirstFit,
        EvalPolicy::Balance,
        EvalPolicy::Random,
        EvalPolicy::Spread,
        EvalPolicy::Interference,
        EvalPolicy::InterferenceFirst,
        EvalPolicy::Oracle,
        EvalPolicy::OracleFirst,
    ];

    pub fn name(self) -> &'static str {
        match self {
            EvalPolicy::FirstFit => "first-fit",
            EvalPolicy::Balance => "balance",
            EvalPolicy::Random => "random",
            EvalPolicy::Spread => "spread",
            EvalPolicy::Interference => "interference",
            EvalPolicy::InterferenceFirst => "interference-first",
            EvalPolicy::Oracle => "oracle",
            EvalPolicy::OracleFirst => "oracle-first",
        }
    }
}

impl std::str::FromStr for EvalPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EvalPolicy::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<&str> = EvalPolicy::ALL.iter().map(|p| p.name()).collect();
            format!("unknown policy `{s}` ({})", names.join(", "))
        })
    }
}

/// What stream to place.
#[derive(Clone, Debug)]
pub struct StreamPlan {
    pub workloads: Vec<String>,
    pub batches: Vec<u32>,
    /// vNPU shapes: SA and VU per core, cores per chip, and chips.
    pub shapes: Vec<(u32, u32, u32, u32)>,
    pub vnpus: usize,
    /// Offered load: the EU-time the stream asks for over the EU-time the
    /// board has while it arrives (solo run times).
    pub load: f64,
    /// Mean work of a vNPU, in simulated cycles of running alone
    /// (exponentially distributed; at least one request).
    pub work_cycles: f64,
    /// Arrivals at the start left out of the statistics (the board fills
    /// up): a fraction of `vnpus`.
    pub warmup: f64,
    pub seed: u64,
}

impl StreamPlan {
    /// Every kind of vNPU of the plan: each workload at each batch on each
    /// shape.
    pub fn items(&self) -> Vec<Item> {
        self.workloads
            .iter()
            .flat_map(|w| {
                self.batches.iter().flat_map(move |&batch| {
                    self.shapes.iter().map(move |&(sa, vu, cores, chips)| Item {
                        spec: Spec { workload: w.clone(), batch, sa, vu },
                        cores: cores.max(1),
                        chips: chips.max(1),
                    })
                })
            })
            .collect()
    }
}

/// One vNPU of a stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub arrival: f64,
    /// Index into the stream's items.
    pub item: usize,
    pub requests: u64,
}

/// A kind of vNPU of a stream: `spec` (a workload on a per-core shape)
/// on each of `cores` cores of each of `chips` chips, data-parallel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    #[serde(flatten)]
    pub spec: Spec,
    /// Cores per chip.
    pub cores: u32,
    #[serde(default = "one_chip")]
    pub chips: u32,
}

fn one_chip() -> u32 {
    1
}

/// `SPEC xCORES`, and `xCHIPS` when there are several.
impl std::fmt::Display for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.spec, self.cores)?;
        if self.chips > 1 {
            write!(f, "x{}", self.chips)?;
        }
        Ok(())
    }
}

impl Item {
    /// One core of `spec`.
    pub fn one_core(spec: Spec) -> Self {
        Self { spec, cores: 1, chips: 1 }
    }

    /// Execution units of the whole vNPU.
    pub fn eus(&self) -> u32 {
        (self.spec.sa + self.spec.vu).saturating_mul(self.all_cores())
    }

    /// Cores of the whole vNPU.
    pub fn all_cores(&self) -> u32 {
        self.cores.saturating_mul(self.chips)
    }
}

/// A stream: its distinct items and its vNPUs in arrival order.
#[derive(Clone, Debug)]
pub struct JobStream {
    pub items: Vec<Item>,
    pub jobs: Vec<Job>,
}

/// The manager's shape of a vNPU `item`: SRAM and HBM of each core in
/// proportion to its EUs, as [`RequestPrograms::lower`] lowers for.
/// HBM is rounded down to whole slices, as the manager hands it out.
pub fn shape_of(cfg: &BoardConfig, item: &Item) -> Result<Shape, ShapeError> {
    let spec = &item.spec;
    let eus = u64::from(cfg.core.sa_count + cfg.core.vu_count).max(1);
    let mine = u64::from(spec.sa + spec.vu);
    let slices = |bytes: u64, slice: u64| (bytes * mine / eus / slice).max(1) * slice;
    let hbm_core = cfg.hbm_bytes_per_chip() / u64::from(cfg.cores_per_chip.max(1));
    Shape::new(
        item.chips.max(1),
        item.cores.max(1),
        spec.sa,
        spec.vu,
        slices(cfg.sram_bytes(), SRAM_SLICE),
        slices(hbm_core, HBM_SLICE),
    )
}

fn exp(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = rng.random();
    -mean * (1.0 - u).ln()
}

/// Draws a stream of `plan`'s size, load and seed over `items` (e.g.
/// [`StreamPlan::items`], or those of them that fit: [`Items::kinds`]):
/// items uniformly, work exponentially, then Poisson arrivals at the rate
/// that offers `plan.load` of the board's EUs. `latency(item)` is an
/// item's request latency alone in cycles.
pub fn generate(
    cfg: &BoardConfig,
    plan: &StreamPlan,
    items: &[Item],
    latency: &dyn Fn(&Item) -> f64,
) -> JobStream {
    let items = items.to_vec();
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let mut jobs = Vec::with_capacity(plan.vnpus);
    let mut eu_time = 0.0;
    for _ in 0..plan.vnpus {
        let item = rng.random_range(0..items.len().max(1));
        let lat = latency(&items[item]).max(1.0);
        let requests = (exp(&mut rng, plan.work_cycles) / lat).round().max(1.0) as u64;
        eu_time += f64::from(items[item].eus()) * requests as f64 * lat;
        jobs.push(Job { arrival: 0.0, item, requests });
    }
    let total_eus = f64::from(cfg.chips * cfg.cores_per_chip * (cfg.core.sa_count + cfg.core.vu_count));
    let gap = eu_time / (plan.vnpus.max(1) as f64 * plan.load.max(1e-6) * total_eus);
    let mut t = 0.0;
    for j in &mut jobs {
        t += exp(&mut rng, gap);
        j.arrival = t;
    }
    JobStream { items, jobs }
}

/// What the board model knows of each item: its per-core programs, the
/// solo counters of one of its cores, and its request latency alone.
#[derive(Debug)]
pub struct Items {
    /// The items, those that fit (the rest are in `left_out`); the other
    /// fields follow their order.
    pub kinds: Vec<Item>,
    /// Items too large for their vNPU (tensors past its HBM, or a program
    /// past the instructions of a request).
    pub left_out: Vec<Item>,
    pub programs: Vec<RequestPrograms>,
    pub solos: Vec<Solo>,
    /// Cycles of one request of the whole vNPU alone on the board: its
    /// one core's solo latency, or, for several cores, measured on the
    /// board model (its cores share the chip's HBM and the host link).
    pub alone: Vec<f64>,
}

impl Items {
    /// Lowers every item; solo counters from `matrix` where it has them,
    /// else measured. An item too large for its vNPU
    /// ([`RequestPrograms::lower_if_fits`]) is left out (`left_out`).
    pub fn new(cfg: &BoardConfig, all: &[Item], matrix: &Matrix) -> Result<Self, EvalError> {
        let mut programs = Vec::with_capacity(all.len());
        let mut solos = Vec::with_capacity(all.len());
        let (mut kinds, mut left_out) = (Vec::new(), Vec::new());
        for it in all {
            let s = &it.spec;
            let Some(p) = RequestPrograms::lower_if_fits(cfg, s)? else {
                left_out.push(it.clone());
                continue;
            };
            programs.push(p);
            kinds.push(it.clone());
            solos.push(match matrix.solo(s) {
                Some(x) => x.clone(),
                None => Solo::measure(cfg, s)?,
            });
        }
        let items = &kinds;
        let mut alone = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            alone.push(if it.all_cores() <= 1 {
                solos[i].latency
            } else {
                if it.cores > cfg.cores_per_chip || it.chips > cfg.chips {
                    return Err(EvalError::Input(format!(
                        "{} cores on each of {} chips a vNPU; the board has {} chips of {}",
                        it.cores, it.chips, cfg.chips, cfg.cores_per_chip
                    )));
                }
                // The first cores of the first chips (identical chips: any
                // would do).
                let per = cfg.cores_per_chip as usize;
                let cores: Vec<usize> = (0..it.chips as usize)
                    .flat_map(|ch| (0..it.cores as usize).map(move |c| ch * per + c))
                    .collect();
                let mut sim = Stream::new(cfg);
                let id = sim.admit(&programs[i], &cores, 1)?;
                sim.run_until(f64::INFINITY)?;
                match sim.times(id) {
                    Some((a, Some(b))) => b - a,
                    _ => return Err(EvalError::Model(CoRunError::Stuck)),
                }
            });
        }
        Ok(Self { kinds, left_out, programs, solos, alone })
    }
}

/// One tenant's fate under one policy.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Fate {
    /// The physical cores it got; empty: rejected.
    pub cores: Vec<usize>,
    /// Run time over run time alone (NaN: rejected).
    pub slowdown: f64,
}

/// One policy on one stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PolicyRun {
    pub policy: EvalPolicy,
    pub seed: u64,
    /// vNPUs counted (after the warm-up) and how many of them were
    /// rejected (no core had room).
    pub counted: usize,
    pub rejected: usize,
    /// Over the accepted counted vNPUs.
    pub mean_slowdown: f64,
    pub p95_slowdown: f64,
    pub max_slowdown: f64,
    /// Allocated EUs over the board's EUs, averaged over time from the
    /// first counted arrival to the last arrival.
    pub eu_utilization: f64,
    /// Decisions with two or more candidate cores after the first
    /// criterion (where pricing could change anything).
    pub contested: usize,
    /// Board co-runs the oracle measured (cache misses).
    pub measured: usize,
    pub wall_seconds: f64,
    pub fates: Vec<Fate>,
}

/// The oracle's measurements: total overhead of a board configuration
/// (per chip, per core, the items on it; cores of a chip are alike).
type Cache = HashMap<Vec<Vec<Vec<usize>>>, f64>;

fn canonical(cfg: &BoardConfig, tenants: &[(usize, usize)]) -> Vec<Vec<Vec<usize>>> {
    let per = cfg.cores_per_chip.max(1) as usize;
    let mut chips: Vec<Vec<Vec<usize>>> = vec![vec![Vec::new(); per]; cfg.chips.max(1) as usize];
    for &(item, core) in tenants {
        if let Some(c) = chips.get_mut(core / per).and_then(|ch| ch.get_mut(core % per)) {
            c.push(item);
        }
    }
    for ch in &mut chips {
        for c in ch.iter_mut() {
            c.sort_unstable();
        }
        ch.sort();
    }
    chips
}

/// The measured total overhead (sum of slowdown - 1) of `tenants`
/// (item, core) running together on the board.
fn measured_overhead(
    cfg: &BoardConfig,
    items: &Items,
    tenants: &[(usize, usize)],
    cache: &mut Cache,
    misses: &mut usize,
) -> Result<f64, EvalError> {
    let key = canonical(cfg, tenants);
    if let Some(&v) = cache.get(&key) {
        return Ok(v);
    }
    let placed: Vec<Placed> =
        tenants.iter().map(|&(i, core)| Placed { request: &items.programs[i], core, group: None }).collect();
    let m = closed_loop(cfg, &placed, Contention::default(), 1)?;
    let v = tenants.iter().zip(&m).map(|(&(i, _), m)| m.latency / items.solos[i].latency - 1.0).sum();
    *misses += 1;
    cache.insert(key, v);
    Ok(v)
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[((n - 1) as f64 * q).round() as usize],
    }
}

/// Keeps `k` of `v` (which has at least `k`): the first (`first-fit`),
/// `k` drawn uniformly (`random`), or the `k` smallest by `key`
/// (`spread`: the roomiest first).
fn choose<T, K: Ord>(v: &mut Vec<T>, k: usize, policy: EvalPolicy, rng: &mut StdRng, key: impl Fn(&T) -> K) {
    match policy {
        EvalPolicy::FirstFit => {}
        EvalPolicy::Random => {
            for i in 0..k {
                let j = rng.random_range(i..v.len());
                v.swap(i, j);
            }
        }
        _ => v.sort_by_key(|x| key(x)),
    }
    v.truncate(k);
}

/// The cores an interference-blind policy other than `balance` picks for
/// a vNPU of shape `s` (its `cores_per_chip` cores on each of its `chips`
/// chips; `None`: not enough chips have room). One core: `first-fit` the lowest-numbered core that
/// fits, `random` any core that fits (uniformly), `spread` the one with
/// the most EUs left. Several: the same choice of cores on each chip, and
/// of the chips that have room the first ones (`first-fit`), random ones
/// (`random`), or those whose chosen cores have the most EUs left
/// (`spread`), listed chip by chip.
fn blind_cores(board: &Board, s: &Shape, policy: EvalPolicy, rng: &mut StdRng) -> Option<Vec<u32>> {
    let k = s.cores_per_chip().max(1) as usize;
    let want = s.chips().max(1) as usize;
    let fitting = board.fitting_cores(s);
    if k == 1 && want == 1 {
        // The whole board's fitting cores at once (as before multi-core
        // vNPUs: the same choices, the same random draws).
        let c = match policy {
            EvalPolicy::FirstFit => fitting.first().copied(),
            EvalPolicy::Random => (!fitting.is_empty()).then(|| fitting[rng.random_range(0..fitting.len())]),
            _ => fitting.iter().copied().max_by_key(|&c| (board.score(c, s).0, std::cmp::Reverse(c))),
        };
        return c.map(|c| vec![c as u32]);
    }
    let per = board.cores_per_chip.max(1) as usize;
    // Per chip with room: its cores for the vNPU and their EUs left.
    let mut chips: Vec<(Vec<usize>, u64)> = Vec::new();
    for chip in 0..board.chips as usize {
        let mut mine: Vec<usize> = fitting.iter().copied().filter(|c| c / per == chip).collect();
        let hbm = board.hbm_used.get(chip).copied().unwrap_or(u64::MAX);
        if mine.len() < k || hbm.saturating_add(s.hbm_per_core().saturating_mul(k as u64)) > board.hbm {
            continue;
        }
        choose(&mut mine, k, policy, rng, |&c| (std::cmp::Reverse(board.score(c, s).0), c));
        let left = mine.iter().map(|&c| u64::from(board.score(c, s).0)).sum();
        chips.push((mine, left));
    }
    if chips.len() < want {
        return None;
    }
    // `want` of the chips with room: the first ones, random ones, or
    // those with the most EUs left (the lowest-numbered on ties).
    choose(&mut chips, want, policy, rng, |(cores, left)| (std::cmp::Reverse(*left), cores.first().copied()));
    // Chip by chip, as the manager's placement lists them.
    chips.sort_by_key(|(cores, _)| cores.first().copied());
    Some(chips.into_iter().flat_map(|(cores, _)| cores).map(|c| c as u32).collect())
}

/// Places `stream` by `policy` on a board of `cfg` and simulates it.
pub fn run_policy(
    cfg: &BoardConfig,
    stream: &JobStream,
    items: &Items,
    predictor: Option<&Predictor>,
    policy: EvalPolicy,
    plan: &StreamPlan,
) -> Result<PolicyRun, EvalError> {
    let started = std::time::Instant::now();
    let shapes: Vec<Shape> = stream.items.iter().map(|s| shape_of(cfg, s)).collect::<Result<_, _>>()?;
    let mut board = Board::new(cfg);
    let mut sim = Stream::new(cfg);
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0x9e37_79b9_7f4a_7c15);
    // (item, core, job) of each core of each vNPU on the board.
    let mut resident: Vec<(usize, usize, usize)> = Vec::new();
    let mut fates: Vec<Fate> = vec![Fate { cores: Vec::new(), slowdown: f64::NAN }; stream.jobs.len()];
    let mut sim_ids: Vec<usize> = Vec::new();
    let (mut contested, mut measured) = (0, 0);
    let mut cache = Cache::new();
    let depart = |gone: Vec<usize>, board: &mut Board, resident: &mut Vec<(usize, usize, usize)>| {
        for id in gone {
            while let Some(k) = resident.iter().position(|r| r.2 == id) {
                let (item, core, _) = resident.swap_remove(k);
                board.release(&shapes[item], &[core as u32]);
            }
        }
    };
    for (j, job) in stream.jobs.iter().enumerate() {
        let gone = sim.run_until(job.arrival)?;
        depart(gone, &mut board, &mut resident);
        let shape = &shapes[job.item];
        let cores: Option<Vec<u32>> = match policy {
            EvalPolicy::FirstFit | EvalPolicy::Random | EvalPolicy::Spread => {
                blind_cores(&board, shape, policy, &mut rng).inspect(|c| board.occupy(shape, c))
            }
            EvalPolicy::Balance => board.place(shape).ok(),
            _ => {
                let first = matches!(policy, EvalPolicy::InterferenceFirst | EvalPolicy::OracleFirst);
                let order = if first { Policy::InterferenceFirst } else { Policy::Interference };
                let tenants: Vec<(usize, usize)> = resident.iter().map(|r| (r.0, r.1)).collect();
                let mut failed: Option<EvalError> = None;
                let mut asked = false;
                let r = board.place_scored(shape, order, &mut |_, cores| {
                    asked = true;
                    let mut t = tenants.clone();
                    t.extend(cores.iter().map(|&c| (job.item, c as usize)));
                    let cost = match (policy, predictor) {
                        (EvalPolicy::Oracle | EvalPolicy::OracleFirst, _) => {
                            measured_overhead(cfg, items, &t, &mut cache, &mut measured)
                        }
                        (_, Some(p)) => predicted_overhead(p, items, &t),
                        (_, None) => {
                            Err(EvalError::Input("the interference policies need a predictor".into()))
                        }
                    };
                    cost.unwrap_or_else(|e| {
                        failed.get_or_insert(e);
                        f64::NAN
                    })
                });
                if let Some(e) = failed {
                    return Err(e);
                }
                contested += usize::from(asked);
                r.ok()
            }
        };
        if let Some(cores) = cores {
            let cores: Vec<usize> = cores.into_iter().map(|c| c as usize).collect();
            let id = sim.admit(&items.programs[job.item], &cores, job.requests)?;
            if sim_ids.len() <= id {
                sim_ids.resize(id + 1, usize::MAX);
            }
            sim_ids[id] = j;
            resident.extend(cores.iter().map(|&c| (job.item, c, id)));
            fates[j].cores = cores;
        }
    }
    sim.run_until(f64::INFINITY)?;
    // Slowdowns and EU-time.
    let skip = ((stream.jobs.len() as f64) * plan.warmup.clamp(0.0, 0.99)) as usize;
    let window =
        (stream.jobs.get(skip).map_or(0.0, |j| j.arrival), stream.jobs.last().map_or(0.0, |j| j.arrival));
    let mut eu_time = 0.0;
    for (id, &j) in sim_ids.iter().enumerate() {
        let Some((arrived, Some(left))) = sim.times(id) else { continue };
        let job = &stream.jobs[j];
        let alone = job.requests as f64 * items.alone[job.item];
        fates[j].slowdown = (left - arrived) / alone;
        let overlap = (left.min(window.1) - arrived.max(window.0)).max(0.0);
        eu_time += f64::from(stream.items[job.item].eus()) * overlap;
    }
    let counted = &fates[skip.min(fates.len())..];
    let accepted: Vec<f64> = counted.iter().filter(|f| !f.cores.is_empty()).map(|f| f.slowdown).collect();
    let total_eus = f64::from(cfg.chips * cfg.cores_per_chip * (cfg.core.sa_count + cfg.core.vu_count));
    Ok(PolicyRun {
        policy,
        seed: plan.seed,
        counted: counted.len(),
        rejected: counted.iter().filter(|f| f.cores.is_empty()).count(),
        mean_slowdown: accepted.iter().sum::<f64>() / accepted.len().max(1) as f64,
        p95_slowdown: quantile(&accepted, 0.95),
        max_slowdown: quantile(&accepted, 1.0),
        eu_utilization: eu_time / (total_eus * (window.1 - window.0)).max(1.0),
        contested,
        measured,
        wall_seconds: started.elapsed().as_secs_f64(),
        fates,
    })
}

/// The predicted total overhead of `tenants` (item, core).
fn predicted_overhead(p: &Predictor, items: &Items, tenants: &[(usize, usize)]) -> Result<f64, EvalError> {
    let with: Vec<(&Solo, usize)> = tenants.iter().map(|&(i, core)| (&items.solos[i], core)).collect();
    Ok(predicted_slowdowns(p, &with)?.iter().map(|s| s - 1.0).sum())
}

/// Min, median and max.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(v: &[f64]) -> Self {
        Self { min: quantile(v, 0.0), median: quantile(v, 0.5), max: quantile(v, 1.0) }
    }
}

/// One policy over every seed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PolicySummary {
    pub policy: EvalPolicy,
    pub mean_slowdown: Spread,
    pub p95_slowdown: Spread,
    pub eu_utilization: Spread,
    pub rejected_percent: Spread,
    /// 1 - overhead / balance's overhead (mean slowdown - 1) on the same
    /// stream, in percent: how much of the interference-blind overhead the
    /// policy removes.
    pub overhead_cut_vs_balance: Spread,
    pub wall_seconds: Spread,
}

/// Per policy, min/median/max over the seeds of `runs`.
pub fn summarize(runs: &[PolicyRun]) -> Vec<PolicySummary> {
    let mut policies: Vec<EvalPolicy> = Vec::new();
    for r in runs {
        if !policies.contains(&r.policy) {
            policies.push(r.policy);
        }
    }
    policies
        .into_iter()
        .map(|p| {
            let mine: Vec<&PolicyRun> = runs.iter().filter(|r| r.policy == p).collect();
            let of =
                |f: &dyn Fn(&PolicyRun) -> f64| Spread::of(&mine.iter().map(|r| f(r)).collect::<Vec<_>>());
            let cut = |r: &PolicyRun| {
                runs.iter()
                    .find(|b| b.policy == EvalPolicy::Balance && b.seed == r.seed)
                    .map_or(f64::NAN, |b| 100.0 * (1.0 - (r.mean_slowdown - 1.0) / (b.mean_slowdown - 1.0)))
            };
            PolicySummary {
                policy: p,
                mean_slowdown: of(&|r| r.mean_slowdown),
                p95_slowdown: of(&|r| r.p95_slowdown),
                eu_utilization: of(&|r| 100.0 * r.eu_utilization),
                rejected_percent: of(&|r| 100.0 * r.rejected as f64 / r.counted.max(1) as f64),
                overhead_cut_vs_balance: of(&cut),
                wall_seconds: of(&|r| r.wall_seconds),
            }
        })
        .collect()
}

/// A predictor of `model` trained on `matrix`, when any policy needs one.
pub fn predictor_for(
    matrix: &Matrix,
    model: Model,
    policies: &[EvalPolicy],
) -> Result<Option<Predictor>, EvalError> {
    let needs =
        policies.iter().any(|p| matches!(p, EvalPolicy::Interference | EvalPolicy::InterferenceFirst));
    Ok(if needs { Some(Predictor::train(matrix, interference_eval::learner(model).as_ref())?) } else { None })
}
