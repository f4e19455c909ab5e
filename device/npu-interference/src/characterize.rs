//! Every pair (and triple, quadruple) of workloads co-located on the board model,
//! each tenant's slowdown against running alone, and the share of it each
//! cause accounts for: contention for the DMA engines of a core, for the
//! HBM of a chip, for the board's host link, and waiting for the engines
//! of a time-shared core.
//!
//! Attribution: each case runs under the eight combinations of
//! [`Contention`] (every resource contended or each tenant's own), and a
//! resource's share is its Shapley value over the three (the mean of what
//! contending for it adds, over every order of adding the three): the
//! shares add up to the slowdown under full contention minus the slowdown
//! with nothing contended, which is 1 unless the tenants also wait for
//! each other's engines (then that rest is the waiting share).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use npu_model::{BoardConfig, Contention, Totals};
use serde::{Deserialize, Serialize};

use crate::corun::{closed_loop, CoRunError, Measured, Placed, RequestPrograms, Spec};

/// Where the tenants of a case are put.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// One core, each tenant on EUs of its own (the core's DMA engines,
    /// the chip's HBM and the host link are shared).
    Core,
    /// Each tenant on a core of its own, all on one chip (HBM and the host
    /// link are shared).
    Chip,
    /// One core, the same EUs, one request at a time in turn (an
    /// oversubscribed core): tenants wait for each other's engines.
    TimeShared,
}

impl Placement {
    pub const ALL: [Placement; 3] = [Placement::Core, Placement::Chip, Placement::TimeShared];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Core => "core",
            Placement::Chip => "chip",
            Placement::TimeShared => "time-shared",
        }
    }

    /// Whether `tenants` can be placed so on a core of `cfg`.
    pub fn fits(self, cfg: &BoardConfig, tenants: &[Spec]) -> bool {
        let each = tenants.iter().all(|s| s.sa <= cfg.core.sa_count && s.vu <= cfg.core.vu_count);
        each && match self {
            Placement::Core => {
                tenants.iter().map(|s| s.sa).sum::<u32>() <= cfg.core.sa_count
                    && tenants.iter().map(|s| s.vu).sum::<u32>() <= cfg.core.vu_count
            }
            Placement::Chip => tenants.len() <= cfg.cores_per_chip as usize,
            Placement::TimeShared => true,
        }
    }
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Placement::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown placement `{s}` (core, chip, time-shared)"))
    }
}

/// A set of tenants to co-locate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Case {
    pub placement: Placement,
    pub tenants: Vec<Spec>,
}

/// A slowdown split by cause (in units of the solo latency: the four add
/// up to `slowdown - 1`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Causes {
    pub dma_engines: f64,
    pub hbm: f64,
    pub host_link: f64,
    pub waiting: f64,
}

/// One tenant of a case.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TenantOutcome {
    pub spec: Spec,
    /// Co-located latency over solo latency (full contention).
    pub slowdown: f64,
    pub causes: Causes,
    /// Requests it finished in the co-run.
    pub requests: usize,
}

/// One case's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CaseOutcome {
    pub placement: Placement,
    pub tenants: Vec<TenantOutcome>,
}

/// A workload's counters running alone: what a provider can read of it
/// without co-locating it (the features of [`crate::predict`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Solo {
    pub spec: Spec,
    /// Cycles of one request (input, program, output).
    pub latency: f64,
    /// Active cycles per cycle per SA / per VU of the vNPU.
    pub sa_active: f64,
    pub vu_active: f64,
    /// Active transfer cycles per cycle (over its DMA streams).
    pub dma_active: f64,
    /// Bytes per cycle to or from HBM, and to or from guest memory.
    pub hbm_bytes_per_cycle: f64,
    pub host_bytes_per_cycle: f64,
    /// FLOPs per byte moved (arithmetic intensity).
    pub flops_per_byte: f64,
    /// Cycles its transfers and waits lost, per cycle.
    pub stall: f64,
}

impl Solo {
    /// Measures `spec` alone on a board of `cfg` (lowered as
    /// [`RequestPrograms::lower`] does, one counted request after a
    /// warm-up), as [`characterize`] does for every tenant.
    pub fn measure(cfg: &BoardConfig, spec: &Spec) -> Result<Self, CoRunError> {
        let p = RequestPrograms::lower(cfg, spec)?;
        let m = closed_loop(cfg, &[Placed { request: &p, core: 0, group: None }], Contention::default(), 1)?;
        let m = m.first().ok_or(CoRunError::Stuck)?;
        Ok(Self::new(spec, m))
    }

    fn new(spec: &Spec, m: &Measured) -> Self {
        let t: &Totals = &m.totals;
        let n = m.requests.max(1) as f64;
        let cycles = (m.latency * n).max(1.0);
        Self {
            spec: spec.clone(),
            latency: m.latency,
            sa_active: t.sa_active_cycles / cycles / f64::from(spec.sa.max(1)),
            vu_active: t.vu_active_cycles / cycles / f64::from(spec.vu.max(1)),
            dma_active: t.dma_active_cycles / cycles,
            hbm_bytes_per_cycle: t.hbm_bytes as f64 / cycles,
            host_bytes_per_cycle: t.host_bytes as f64 / cycles,
            flops_per_byte: t.flops as f64 / (t.bytes.max(1) as f64),
            stall: t.stall_cycles / cycles,
        }
    }
}

/// Everything a characterization measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Matrix {
    pub board: String,
    /// Requests each tenant of a co-run finished after a warm-up one.
    pub iterations: usize,
    pub solo: Vec<Solo>,
    pub cases: Vec<CaseOutcome>,
    /// Items of the plan whose tensors do not fit their vNPU's HBM (a
    /// quarter or half of a chip's), left out with every case they are in.
    #[serde(default)]
    pub left_out: Vec<Spec>,
}

impl Matrix {
    /// The solo counters of `spec`.
    pub fn solo(&self, spec: &Spec) -> Option<&Solo> {
        self.solo.iter().find(|s| &s.spec == spec)
    }
}

/// The eight contention combinations, indexed by bit 0 = DMA engines, bit
/// 1 = HBM, bit 2 = host link (set: contended).
fn contention(bits: usize) -> Contention {
    Contention { dma_engines: bits & 1 != 0, hbm: bits & 2 != 0, host_link: bits & 4 != 0 }
}

/// Shapley values of the three resources from `s[bits]`, the slowdown
/// with the resources of `bits` contended.
pub fn shapley(s: &[f64; 8]) -> [f64; 3] {
    let mut phi = [0.0; 3];
    for (r, p) in phi.iter_mut().enumerate() {
        let bit = 1 << r;
        for (without, value) in s.iter().enumerate() {
            if without & bit != 0 {
                continue;
            }
            // |T|! (n - |T| - 1)! / n! for n = 3.
            let w = match (without as u32).count_ones() {
                0 | 2 => 1.0 / 3.0,
                _ => 1.0 / 6.0,
            };
            *p += w * (s[without | bit] - value);
        }
    }
    phi
}

/// Places `programs` as `placement` says.
fn placed<'p>(placement: Placement, programs: &[&'p RequestPrograms]) -> Vec<Placed<'p>> {
    programs
        .iter()
        .enumerate()
        .map(|(i, r)| match placement {
            Placement::Core => Placed { request: r, core: 0, group: None },
            Placement::Chip => Placed { request: r, core: i, group: None },
            Placement::TimeShared => Placed { request: r, core: 0, group: Some(0) },
        })
        .collect()
}

/// Runs one case under the eight contention combinations.
pub fn run_case(
    cfg: &BoardConfig,
    case: &Case,
    programs: &[&RequestPrograms],
    solo: &[f64],
    iterations: usize,
) -> Result<CaseOutcome, CoRunError> {
    let tenants = placed(case.placement, programs);
    let runs = (0..8)
        .map(|bits| closed_loop(cfg, &tenants, contention(bits), iterations))
        .collect::<Result<Vec<_>, _>>()?;
    let slow: Vec<[f64; 8]> =
        (0..tenants.len()).map(|i| std::array::from_fn(|bits| runs[bits][i].latency / solo[i])).collect();
    let requests: Vec<usize> = runs[7].iter().map(|m| m.requests).collect();
    Ok(CaseOutcome {
        placement: case.placement,
        tenants: case
            .tenants
            .iter()
            .zip(slow.iter().zip(requests))
            .map(|(spec, (s, requests))| {
                let [dma_engines, hbm, host_link] = shapley(s);
                TenantOutcome {
                    spec: spec.clone(),
                    slowdown: s[7],
                    causes: Causes { dma_engines, hbm, host_link, waiting: s[0] - 1.0 },
                    requests,
                }
            })
            .collect(),
    })
}

/// What to characterize.
#[derive(Clone, Debug)]
pub struct Plan {
    pub workloads: Vec<String>,
    pub batches: Vec<u32>,
    /// vNPU shapes (SA, VU); every tenant of a case has the same.
    pub shapes: Vec<(u32, u32)>,
    pub placements: Vec<Placement>,
    /// Sizes of the larger groups (3: every triple of distinct
    /// workloads, 4: every quadruple, ...), all at `group_batch`.
    pub groups: Vec<usize>,
    pub group_batch: u32,
    pub iterations: usize,
    pub threads: usize,
}

/// Every case of `plan` that fits a core of `cfg`: every pair of (workload,
/// batch) items, a workload with itself included, per shape and placement;
/// then every group of distinct workloads of each size of `plan.groups`
/// at the group batch (placements `core` and `chip`).
pub fn cases(cfg: &BoardConfig, plan: &Plan) -> Vec<Case> {
    let mut out = Vec::new();
    for &(sa, vu) in &plan.shapes {
        let items: Vec<Spec> = plan
            .workloads
            .iter()
            .flat_map(|w| plan.batches.iter().map(move |&b| Spec { workload: w.clone(), batch: b, sa, vu }))
            .collect();
        for &placement in &plan.placements {
            for i in 0..items.len() {
                for j in i..items.len() {
                    let tenants = vec![items[i].clone(), items[j].clone()];
                    if placement.fits(cfg, &tenants) {
                        out.push(Case { placement, tenants });
                    }
                }
            }
            if placement == Placement::TimeShared {
                continue;
            }
            for &size in &plan.groups {
                for pick in combinations(plan.workloads.len(), size) {
                    let tenants: Vec<Spec> = pick
                        .iter()
                        .map(|&x| Spec {
                            workload: plan.workloads[x].clone(),
                            batch: plan.group_batch,
                            sa,
                            vu,
                        })
                        .collect();
                    if placement.fits(cfg, &tenants) {
                        out.push(Case { placement, tenants });
                    }
                }
            }
        }
    }
    out
}

/// Every `k`-subset of `0..n`, in lexicographic order.
fn combinations(n: usize, k: usize) -> Vec<Vec<usize>> {
    if k == 0 || k > n {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut pick: Vec<usize> = (0..k).collect();
    loop {
        out.push(pick.clone());
        // The rightmost index that can still move right.
        let Some(i) = (0..k).rev().find(|&i| pick[i] < n - k + i) else { return out };
        pick[i] += 1;
        for j in i + 1..k {
            pick[j] = pick[j - 1] + 1;
        }
    }
}

/// Runs every case of `plan` on `threads` threads; `progress` is called
/// after each case with (done, total).
pub fn characterize(
    cfg: &BoardConfig,
    plan: &Plan,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Matrix, CoRunError> {
    let mut cases = cases(cfg, plan);
    let mut specs: Vec<Spec> = cases.iter().flat_map(|c| c.tenants.iter().cloned()).collect();
    specs.sort();
    specs.dedup();
    // Lower every item; one whose tensors do not fit its vNPU's HBM is
    // left out, with every case it is in.
    let mut left_out = Vec::new();
    let mut programs = Vec::with_capacity(specs.len());
    let mut kept = Vec::with_capacity(specs.len());
    for s in specs {
        match RequestPrograms::lower_if_fits(cfg, &s)? {
            Some(p) => {
                programs.push(p);
                kept.push(s);
            }
            None => left_out.push(s),
        }
    }
    let specs = kept;
    cases.retain(|c| c.tenants.iter().all(|t| !left_out.contains(t)));
    let mut solo = Vec::with_capacity(specs.len());
    for (spec, p) in specs.iter().zip(&programs) {
        let m = closed_loop(cfg, &[Placed { request: p, core: 0, group: None }], Contention::default(), 1)?;
        solo.push(Solo::new(spec, &m[0]));
    }
    let find = |s: &Spec| specs.binary_search(s).unwrap_or(0);
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<CaseOutcome, CoRunError>>>> =
        Mutex::new((0..cases.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..plan.threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let idx: Vec<usize> = case.tenants.iter().map(find).collect();
                let progs: Vec<&RequestPrograms> = idx.iter().map(|&k| &programs[k]).collect();
                let lat: Vec<f64> = idx.iter().map(|&k| solo[k].latency).collect();
                let r = run_case(cfg, case, &progs, &lat, plan.iterations);
                if let Ok(mut v) = results.lock() {
                    v[i] = Some(r);
                }
                progress(done.fetch_add(1, Ordering::Relaxed) + 1, cases.len());
            });
        }
    });
    let results = results.into_inner().unwrap_or_default();
    let mut outcomes = Vec::with_capacity(results.len());
    for r in results {
        outcomes.push(r.ok_or(CoRunError::Stuck)??);
    }
    Ok(Matrix { board: cfg.name.clone(), iterations: plan.iterations, solo, cases: outcomes, left_out })
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Mean of each cause over `t`, as shares of the summed overhead.
fn shares<'a>(t: impl Iterator<Item = &'a TenantOutcome>) -> [f64; 4] {
    let mut sum = [0.0; 4];
    for o in t {
        let c = o.causes;
        for (s, x) in sum.iter_mut().zip([c.dma_engines, c.hbm, c.host_link, c.waiting]) {
            *s += x;
        }
    }
    let total: f64 = sum.iter().sum();
    // Rounding leaves shares of -1e-14 (printed -0.0): under 0.05% is 0.
    sum.map(|s| if total > 0.0 && (s / total).abs() >= 5e-4 { 100.0 * s / total } else { 0.0 })
}

/// A text summary: per placement and shape, the slowdowns and the share of
/// the overhead each cause accounts for; the worst co-located tenants; per
/// workload on a shared core.
pub fn summary(m: &Matrix) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if !m.left_out.is_empty() {
        let names: Vec<String> = m.left_out.iter().map(|s| s.to_string()).collect();
        let _ = writeln!(out, "{}: {}", crate::corun::LEFT_OUT, names.join(", "));
    }
    let mut groups: Vec<(Placement, usize, u32, u32)> = m
        .cases
        .iter()
        .map(|c| (c.placement, c.tenants.len(), c.tenants[0].spec.sa, c.tenants[0].spec.vu))
        .collect();
    groups.sort();
    groups.dedup();
    let _ = writeln!(
        out,
        "{:<12} {:>7} {:>5} {:>6} {:>8} {:>7} {:>7} {:>6} {:>6} {:>6} {:>7}",
        "placement", "tenants", "shape", "cases", "mean", "p95", "max", "dma%", "hbm%", "link%", "wait%"
    );
    for (placement, n, sa, vu) in groups {
        let cases: Vec<&CaseOutcome> = m
            .cases
            .iter()
            .filter(|c| {
                c.placement == placement
                    && c.tenants.len() == n
                    && c.tenants[0].spec.sa == sa
                    && c.tenants[0].spec.vu == vu
            })
            .collect();
        let tenants = || cases.iter().flat_map(|c| c.tenants.iter());
        let mut s: Vec<f64> = tenants().map(|t| t.slowdown).collect();
        let mean = s.iter().sum::<f64>() / s.len().max(1) as f64;
        let (p95, max) = (quantile(&mut s, 0.95), quantile(&mut s, 1.0));
        let [d, h, l, w] = shares(tenants());
        let _ = writeln!(
            out,
            "{:<12} {:>7} {:>5} {:>6} {:>7.3}x {:>6.2}x {:>6.2}x {:>6.1} {:>6.1} {:>6.1} {:>7.1}",
            placement.name(),
            n,
            format!("{sa}+{vu}"),
            cases.len(),
            mean,
            p95,
            max,
            d,
            h,
            l,
            w
        );
    }
    let mut worst: Vec<(f64, String)> = m
        .cases
        .iter()
        .filter(|c| c.placement != Placement::TimeShared)
        .flat_map(|c| {
            // A workload with itself: one line, not two.
            let twin = |i: usize| c.tenants[..i].iter().any(|o| o.spec == c.tenants[i].spec);
            c.tenants.iter().enumerate().filter(move |(i, _)| !twin(*i)).map(move |(i, t)| {
                let others: Vec<String> = c
                    .tenants
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, o)| o.spec.to_string())
                    .collect();
                let x = t.causes;
                (
                    t.slowdown,
                    format!(
                        "{:.3}x  {} with {} ({}): dma {:.3} hbm {:.3} link {:.3}",
                        t.slowdown,
                        t.spec,
                        others.join(", "),
                        c.placement.name(),
                        x.dma_engines,
                        x.hbm,
                        x.host_link
                    ),
                )
            })
        })
        .collect();
    worst.sort_by(|a, b| b.0.total_cmp(&a.0));
    let _ = writeln!(out, "\nworst co-located tenants (slowdown, then what each cause adds):");
    for (_, line) in worst.iter().take(10) {
        let _ = writeln!(out, "  {line}");
    }
    let mut workloads: Vec<&str> = m.solo.iter().map(|s| s.spec.workload.as_str()).collect();
    workloads.dedup();
    let _ = writeln!(out, "\non a shared core (placement core), per workload as the slowed tenant:");
    let _ = writeln!(
        out,
        "{:<14} {:>8} {:>7} {:>6} {:>6} {:>6}",
        "workload", "mean", "max", "dma%", "hbm%", "link%"
    );
    for w in workloads {
        let t: Vec<&TenantOutcome> = m
            .cases
            .iter()
            .filter(|c| c.placement == Placement::Core)
            .flat_map(|c| c.tenants.iter())
            .filter(|t| t.spec.workload == w)
            .collect();
        if t.is_empty() {
            continue;
        }
        let mut s: Vec<f64> = t.iter().map(|t| t.slowdown).collect();
        let mean = s.iter().sum::<f64>() / s.len() as f64;
        let max = quantile(&mut s, 1.0);
        let [d, h, l, _] = shares(t.iter().copied());
        let _ = writeln!(out, "{w:<14} {mean:>7.3}x {max:>6.2}x {d:>6.1} {h:>6.1} {l:>6.1}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: [f64; 3], b: [f64; 3]) {
        for (r, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() < 1e-12, "resource {r}: {x} expected {y} (all {a:?})");
        }
    }

    #[test]
    fn combinations_are_every_subset_once() {
        assert_eq!(combinations(4, 2), [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]);
        assert_eq!(combinations(7, 3).len(), 35);
        assert_eq!(combinations(7, 4).len(), 35);
        assert_eq!(combinations(3, 3), [[0, 1, 2]]);
        assert!(combinations(2, 3).is_empty() && combinations(3, 0).is_empty());
    }

    #[test]
    fn shapley_values_by_hand() {
        // Bits: 1 = DMA engines, 2 = HBM, 4 = host link.
        // Additive: each resource's own effect.
        let additive: [f64; 8] = std::array::from_fn(|b| {
            1.0 + [0.5, 0.2, 0.1]
                .iter()
                .enumerate()
                .filter(|(r, _)| b & (1 << r) != 0)
                .map(|x| x.1)
                .sum::<f64>()
        });
        close(shapley(&additive), [0.5, 0.2, 0.1]);
        // Only the engines and HBM together slow the tenant (0.3): they
        // share it equally, the link gets nothing.
        let joint: [f64; 8] = std::array::from_fn(|b| if b & 3 == 3 { 1.3 } else { 1.0 });
        close(shapley(&joint), [0.15, 0.15, 0.0]);
        // Any one of the three is enough to cost 0.6: a third each.
        let any: [f64; 8] = std::array::from_fn(|b| if b != 0 { 1.6 } else { 1.0 });
        close(shapley(&any), [0.2, 0.2, 0.2]);
    }
}
