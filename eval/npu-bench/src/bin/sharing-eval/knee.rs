//! `sharing-eval --knee`: each system's throughput at the SLA found by a
//! search of its own knee, over several seeds, with the metrics of
//! `npu_bench::metrics` (`docs/evaluation.md`, "Metrics").
//!
//! For each seed and system: offered loads of 0.3, 0.5, 0.7, 0.85, 1.0,
//! 1.15, 1.3, 1.5 and 2 times the system's own saturation until the first
//! that fails (halving below 0.3 if that one fails), then the knee
//! bisected until the last pass and the first failure are within 5%
//! (`metrics::refine`). Every rate runs at least `--min-requests` requests
//! of each tenant. A rate passes when the run is not saturated and every
//! tenant's p99 (from at least 100 requests) is within its bound. The
//! throughput at the SLA is the highest offered rate every lower swept
//! rate of which passed. Then, at 0.8 of the better PREMA-like system's
//! throughput at the SLA, every system runs the same arrivals once more:
//! their p99 over all requests, and the ratio to the better baseline's
//! where both are below saturation.

use npu_bench::metrics::{self, Spread, SweepPoint, Tail};
use npu_bench::Rng;
use serde::{Deserialize, Serialize};

use crate::Outcome;

/// One swept rate of one system.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Point {
    /// Offered requests per second, all tenants.
    pub offered_rps: f64,
    /// Completed requests per second (every request of the stream over
    /// the time until the last completes).
    pub served_rps: f64,
    pub saturated: bool,
    pub meets_sla: bool,
    /// Each tenant's p99 (seconds; null: too few requests) and bound.
    pub tenant_p99_s: Vec<Option<f64>>,
    pub requests: usize,
    /// Busy SA + VU time over all EU time until the last completion.
    pub eu_utilization: f64,
    /// p99 over every request of the mix.
    pub p99: Tail,
}

/// One system's knee on one seed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Knee {
    pub system: String,
    pub seed: u64,
    /// Offered requests per second at the SLA (`None`: not even the
    /// lowest rate passed).
    pub throughput_at_sla_rps: Option<f64>,
    /// The sweep never failed: the figure is a lower bound.
    pub lower_bound: bool,
    pub points: Vec<Point>,
}

impl Knee {
    /// The swept point at the throughput at the SLA (its knee), if any.
    pub fn at_sla(&self) -> Option<&Point> {
        let t = self.throughput_at_sla_rps?;
        self.points.iter().find(|p| p.offered_rps == t)
    }
}

/// Runs system `s` (an index of [`Setup::systems`]) on arrivals.
pub type Simulate<'a> = dyn FnMut(usize, &[Vec<f64>]) -> Result<Outcome, String> + 'a;

/// What the search needs of the evaluation: the systems' names and
/// saturation scales, the tenants' relative rates and bounds, and a way
/// to run one system on arrivals.
pub struct Setup<'a> {
    pub systems: Vec<&'static str>,
    /// Each system's saturation, as a scale of `weights` (per cycle).
    pub saturation: Vec<f64>,
    pub weights: Vec<f64>,
    /// Each tenant's latency bound (cycles).
    pub sla: Vec<f64>,
    /// Core clock (Hz) and the core's EUs.
    pub hz: f64,
    pub eus: f64,
    pub min_requests: usize,
    /// Shortest arrival window (cycles).
    pub min_window: f64,
    /// Indices of the PREMA-like systems (the baselines).
    pub baselines: Vec<usize>,
    pub simulate: &'a mut Simulate<'a>,
}

/// The loads (fractions of a system's saturation) swept before the knee
/// is bisected.
const GRID: [f64; 9] = [0.3, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 2.0];

impl Setup<'_> {
    /// The arrivals at scale `x` (per-tenant rates `x * weights`, per
    /// cycle) for `seed`: Poisson, each tenant at least `min_requests`.
    fn arrivals(&self, x: f64, seed: u64) -> Vec<Vec<f64>> {
        let least = self.weights.iter().copied().fold(f64::INFINITY, f64::min);
        let window = self.min_window.max(self.min_requests as f64 * 1.1 / (x * least));
        let mut rng = Rng(seed.max(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ x.to_bits());
        self.weights.iter().map(|w| rng.arrivals(1.0 / (x * w), window)).collect()
    }

    /// Runs system `s` at scale `x`.
    fn point(&mut self, s: usize, x: f64, seed: u64) -> Result<Point, String> {
        let arrivals = self.arrivals(x, seed);
        let o = (self.simulate)(s, &arrivals)?;
        Ok(self.read(&arrivals, &o, x))
    }

    fn read(&self, arrivals: &[Vec<f64>], o: &Outcome, x: f64) -> Point {
        let first = arrivals.iter().filter_map(|a| a.first()).copied().fold(f64::INFINITY, f64::min);
        let last = arrivals.iter().filter_map(|a| a.last()).copied().fold(f64::NEG_INFINITY, f64::max);
        let saturated = o.failed > 0 || metrics::saturated(first, last, o.end);
        let tenant_p99: Vec<Option<f64>> = o.latencies.iter().map(|l| metrics::p99(l)).collect();
        let within = tenant_p99.iter().zip(&self.sla).all(|(p, b)| p.is_some_and(|p| p <= *b));
        let all: Vec<f64> = o.latencies.iter().flatten().copied().collect();
        let requests = all.len();
        Point {
            offered_rps: x * self.weights.iter().sum::<f64>() * self.hz,
            served_rps: requests as f64 / (o.end / self.hz),
            saturated,
            meets_sla: !saturated && within,
            tenant_p99_s: tenant_p99.iter().map(|p| p.map(|c| c / self.hz)).collect(),
            requests,
            eu_utilization: o.eu_cycles / (self.eus * o.end.max(1.0)),
            p99: match Tail::of(&all, saturated) {
                Tail::Bounded(c) => Tail::Bounded(c / self.hz),
                t => t,
            },
        }
    }

    /// System `s`'s knee on `seed`.
    pub fn knee(&mut self, s: usize, seed: u64, progress: &mut dyn FnMut(&str)) -> Result<Knee, String> {
        let sat = self.saturation[s];
        let mut points: Vec<(f64, Point)> = Vec::new();
        let sweep = |p: &[(f64, Point)]| -> Vec<SweepPoint> {
            p.iter().map(|(x, q)| SweepPoint { rate: *x, meets_sla: q.meets_sla }).collect()
        };
        for g in GRID {
            let p = self.point(s, g * sat, seed)?;
            let fail = !p.meets_sla;
            points.push((g * sat, p));
            if fail {
                break;
            }
        }
        // The lowest failed: halve until one passes (at most six times).
        let mut lo = GRID[0];
        while points.iter().all(|(_, p)| !p.meets_sla) && lo > GRID[0] / 64.0 {
            lo /= 2.0;
            let p = self.point(s, lo * sat, seed)?;
            points.push((lo * sat, p));
        }
        while let Some(x) = metrics::refine(&sweep(&points)) {
            progress(&format!(
                "{} seed {seed}: bisecting at {:.0}/s",
                self.systems[s],
                x * self.rps_per_scale()
            ));
            let p = self.point(s, x, seed)?;
            points.push((x, p));
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let sp = sweep(&points);
        Ok(Knee {
            system: self.systems[s].to_string(),
            seed,
            throughput_at_sla_rps: metrics::throughput_at_sla(&sp).map(|x| x * self.rps_per_scale()),
            lower_bound: metrics::never_failed(&sp),
            points: points.into_iter().map(|(_, p)| p).collect(),
        })
    }

    fn rps_per_scale(&self) -> f64 {
        self.weights.iter().sum::<f64>() * self.hz
    }

    /// Every system at the same offered scale `x` (the same arrivals).
    pub fn at(&mut self, x: f64, seed: u64) -> Result<Vec<Point>, String> {
        let arrivals = self.arrivals(x, seed);
        let mut out = Vec::new();
        for s in 0..self.systems.len() {
            let o = (self.simulate)(s, &arrivals)?;
            out.push(self.read(&arrivals, &o, x));
        }
        Ok(out)
    }
}

/// The knees and the common-rate comparison of one seed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SeedResult {
    pub seed: u64,
    pub knees: Vec<Knee>,
    /// The offered rate of the comparison: 0.8 of the better baseline's
    /// throughput at the SLA (`None` if neither baseline met the SLA).
    pub common_rps: Option<f64>,
    pub common: Vec<Point>,
}

/// Runs every system's knee search on each seed, then the common-rate
/// comparison.
pub fn run(
    setup: &mut Setup<'_>,
    seeds: &[u64],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<SeedResult>, String> {
    let mut out = Vec::new();
    for &seed in seeds {
        let mut knees = Vec::new();
        for s in 0..setup.systems.len() {
            progress(&format!("seed {seed}: {} ...", setup.systems[s]));
            knees.push(setup.knee(s, seed, progress)?);
        }
        let best = setup
            .baselines
            .iter()
            .filter_map(|&b| knees[b].throughput_at_sla_rps)
            .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))));
        let (common_rps, common) = match best {
            Some(rps) => {
                let x = 0.8 * rps / setup.rps_per_scale();
                (Some(0.8 * rps), setup.at(x, seed)?)
            }
            None => (None, Vec::new()),
        };
        out.push(SeedResult { seed, knees, common_rps, common });
    }
    Ok(out)
}

impl Point {
    /// Each tenant's tail as it may be read: unbounded when the run was
    /// saturated.
    pub fn tenant_tails(&self) -> Vec<Tail> {
        self.tenant_p99_s
            .iter()
            .map(|p| match (self.saturated, p) {
                (true, _) => Tail::Unbounded,
                (false, Some(s)) => Tail::Bounded(*s),
                (false, None) => Tail::TooFewRequests,
            })
            .collect()
    }
}

/// The summary over seeds of system `s` against the better baseline: on
/// each seed, the baseline with the higher throughput at the SLA (the
/// first of them on a tie).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Summary {
    pub system: String,
    /// Its throughput at the SLA (req/s) over seeds.
    pub throughput_at_sla_rps: Spread,
    /// Over the better baseline's, per seed (seeds where both met the SLA
    /// at some rate).
    pub throughput_ratio: Spread,
    /// How many times lower its tenants' p99s are than the better
    /// baseline's at the common rate (`metrics::tenant_tail_ratio`: the
    /// geometric mean over tenants), on seeds where every tenant's tail is
    /// bounded in both; the other seeds are counted as unbounded.
    pub p99_ratio: Spread,
    pub p99_unbounded_seeds: usize,
    /// Its EU utilization over the better baseline's at the common rate
    /// (the same work at the same rate: above 1 means the work took more
    /// engine-cycles, not that more was served).
    pub utilization_ratio: Spread,
    /// Its EU utilization at its own knee (the rate of its throughput at
    /// the SLA) over the better baseline's at the baseline's knee: how
    /// much more of the core each keeps busy at the most it serves within
    /// the SLA (Neu10's utilization figure).
    #[serde(default)]
    pub knee_utilization_ratio: Spread,
    /// Seeds whose sweep never failed (its figure is a lower bound).
    pub lower_bound_seeds: usize,
}

/// The better of `baselines` on a seed: the one with the higher
/// throughput at the SLA.
fn better(r: &SeedResult, baselines: &[usize]) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for &b in baselines {
        if let Some(t) = r.knees.get(b).and_then(|k| k.throughput_at_sla_rps) {
            if best.is_none_or(|(_, x)| t > x) {
                best = Some((b, t));
            }
        }
    }
    best.map(|(b, _)| b)
}

/// Summaries of every system.
pub fn summarize(results: &[SeedResult], baselines: &[usize]) -> Vec<Summary> {
    let n = results.first().map_or(0, |r| r.knees.len());
    (0..n)
        .map(|s| {
            let (mut tput, mut ratio, mut p99, mut util) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut knee_util = Vec::new();
            let (mut unbounded, mut lower) = (0, 0);
            for r in results {
                let k = &r.knees[s];
                lower += usize::from(k.lower_bound);
                if let Some(t) = k.throughput_at_sla_rps {
                    tput.push(t);
                }
                let Some(b) = better(r, baselines) else { continue };
                if let (Some(t), Some(base)) = (k.throughput_at_sla_rps, r.knees[b].throughput_at_sla_rps) {
                    ratio.push(t / base);
                }
                if let (Some(ours), Some(base)) = (k.at_sla(), r.knees[b].at_sla()) {
                    knee_util.push(ours.eu_utilization / base.eu_utilization);
                }
                if let (Some(ours), Some(base)) = (r.common.get(s), r.common.get(b)) {
                    match metrics::tenant_tail_ratio(&base.tenant_tails(), &ours.tenant_tails()) {
                        Some(x) => p99.push(x),
                        None => unbounded += 1,
                    }
                    util.push(ours.eu_utilization / base.eu_utilization);
                }
            }
            Summary {
                system: results.first().map_or(String::new(), |r| r.knees[s].system.clone()),
                throughput_at_sla_rps: Spread::of(&tput),
                throughput_ratio: Spread::of(&ratio),
                p99_ratio: Spread::of(&p99),
                p99_unbounded_seeds: unbounded,
                utilization_ratio: Spread::of(&util),
                knee_utilization_ratio: Spread::of(&knee_util),
                lower_bound_seeds: lower,
            }
        })
        .collect()
}

/// Prints `summary` as a table.
pub fn print(summary: &[Summary], seeds: usize) {
    println!(
        "\nthroughput at the SLA (the highest offered rate every lower swept rate of which met it), over {seeds} seeds; \
         p99 (geometric mean over tenants) and EU utilization at 0.8 of the better PREMA-like system's; \
         EU utilization at each one's knee:"
    );
    println!(
        "  {:<12} {:>30} {:>30} {:>30} {:>30} {:>30}",
        "system",
        "req/s median (min-max)",
        "/ better PREMA-like",
        "p99 lower by",
        "EU util / PREMA-like's",
        "at the knees"
    );
    for x in summary {
        let r = |sp: &Spread| if sp.seeds == 0 { "-".to_string() } else { sp.to_string() };
        println!(
            "  {:<12} {:>30} {:>30} {:>30} {:>30} {:>30}{}{}",
            x.system,
            r(&x.throughput_at_sla_rps),
            r(&x.throughput_ratio),
            r(&x.p99_ratio),
            r(&x.utilization_ratio),
            r(&x.knee_utilization_ratio),
            if x.p99_unbounded_seeds > 0 {
                format!("  (p99 unbounded on {} seeds)", x.p99_unbounded_seeds)
            } else {
                String::new()
            },
            if x.lower_bound_seeds > 0 {
                format!("  (never failed on {} seeds: a lower bound)", x.lower_bound_seeds)
            } else {
                String::new()
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake system: below scale `knee` (read back from the arrivals'
    /// count, so within Poisson noise) every request takes 10 cycles
    /// against a bound of 100, above it 1,000. The search must land within
    /// 5% below the knee (and the noise), never above it.
    #[test]
    fn the_search_lands_within_five_percent_below_the_knee() {
        let knee = 0.37;
        let mut fake = |_: usize, arrivals: &[Vec<f64>]| -> Result<Outcome, String> {
            // The arrivals' rate tells the scale: n requests over the window.
            let n: usize = arrivals.iter().map(Vec::len).sum();
            let last = arrivals.iter().filter_map(|a| a.last()).copied().fold(0.0, f64::max);
            let scale = n as f64 / last / 2.0;
            let lat = if scale < knee { 10.0 } else { 1000.0 };
            Ok(Outcome {
                latencies: arrivals.iter().map(|a| vec![lat; a.len()]).collect(),
                end: last + lat,
                ..Outcome::default()
            })
        };
        let mut setup = Setup {
            systems: vec!["fake"],
            saturation: vec![0.5],
            weights: vec![1.0, 1.0],
            sla: vec![100.0, 100.0],
            hz: 1.0,
            eus: 8.0,
            min_requests: 2000,
            min_window: 0.0,
            baselines: vec![0],
            simulate: &mut fake,
        };
        let k = setup.knee(0, 1, &mut |_| {}).unwrap();
        // Offered rate = scale x 2 tenants.
        let got = k.throughput_at_sla_rps.unwrap() / 2.0;
        assert!(
            got < knee && got > knee / 1.05 / 1.02,
            "{got} against a knee at {knee}: {:?}",
            k.points.len()
        );
        assert!(!k.lower_bound);
        // Every point ran at least 2,000 requests of each tenant.
        assert!(
            k.points.iter().all(|p| p.requests >= 2 * 2000),
            "{:?}",
            k.points.iter().map(|p| p.requests).collect::<Vec<_>>()
        );
    }

    fn point(offered_rps: f64, meets_sla: bool, eu_utilization: f64, p99: [f64; 2]) -> Point {
        Point {
            offered_rps,
            served_rps: offered_rps,
            saturated: false,
            meets_sla,
            tenant_p99_s: p99.iter().map(|&x| Some(x)).collect(),
            requests: 2000,
            eu_utilization,
            p99: Tail::Bounded(p99[0].max(p99[1])),
        }
    }

    fn knee(system: &str, points: Vec<Point>) -> Knee {
        let sweep: Vec<SweepPoint> =
            points.iter().map(|p| SweepPoint { rate: p.offered_rps, meets_sla: p.meets_sla }).collect();
        Knee {
            system: system.into(),
            seed: 1,
            throughput_at_sla_rps: metrics::throughput_at_sla(&sweep),
            lower_bound: metrics::never_failed(&sweep),
            points,
        }
    }

    /// A seed computed by hand: ours passes at 100 and 200 and fails at
    /// 300 (knee 200, 60% busy there); the baselines' knees are 100 (30%)
    /// and 150 (40%, the better). At the common rate (120) ours has p99s
    /// of 2 and 8 against the better baseline's 4 and 32, and 24% busy
    /// against 20%.
    #[test]
    fn the_summary_holds_ratios_computed_by_hand() {
        let r = SeedResult {
            seed: 1,
            knees: vec![
                knee(
                    "ours",
                    vec![
                        point(100.0, true, 0.3, [1.0; 2]),
                        point(200.0, true, 0.6, [1.0; 2]),
                        point(300.0, false, 0.7, [9.0; 2]),
                    ],
                ),
                knee("weak", vec![point(100.0, true, 0.3, [1.0; 2]), point(150.0, false, 0.4, [9.0; 2])]),
                knee("better", vec![point(150.0, true, 0.4, [1.0; 2]), point(200.0, false, 0.5, [9.0; 2])]),
            ],
            common_rps: Some(120.0),
            common: vec![
                point(120.0, true, 0.24, [2.0, 8.0]),
                point(120.0, true, 0.3, [3.0, 9.0]),
                point(120.0, true, 0.2, [4.0, 32.0]),
            ],
        };
        let s = summarize(&[r], &[1, 2]);
        let ours = &s[0];
        assert_eq!(ours.throughput_at_sla_rps.median, 200.0);
        // 200 / 150.
        assert!((ours.throughput_ratio.median - 4.0 / 3.0).abs() < 1e-12, "{:?}", ours.throughput_ratio);
        // Geometric mean of 4/2 and 32/8: sqrt(2 x 4).
        assert!((ours.p99_ratio.median - 8f64.sqrt()).abs() < 1e-12, "{:?}", ours.p99_ratio);
        assert!((ours.utilization_ratio.median - 1.2).abs() < 1e-12, "{:?}", ours.utilization_ratio);
        // 0.6 at its knee over 0.4 at the better baseline's.
        assert!(
            (ours.knee_utilization_ratio.median - 1.5).abs() < 1e-12,
            "{:?}",
            ours.knee_utilization_ratio
        );
        assert_eq!(ours.lower_bound_seeds, 0);
    }
}
