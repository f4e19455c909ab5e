//! The metrics the sharing and SLO evaluations report, each defined once
//! here and in `docs/evaluation.md` ("Metrics"), and held by tests on
//! cases computed by hand (`tests` below).
//!
//! - [`p99`]: the 99th percentile of a tenant's latencies, nearest rank,
//!   only from at least [`MIN_P99_SAMPLES`] requests (below that it is
//!   the slowest request, not a percentile).
//! - [`saturated`]: a run whose queue grew for as long as requests
//!   arrived. Its latencies grow with the length of the run: they are
//!   reported as unbounded, never as a number or a ratio ([`Tail`]).
//! - [`throughput_at_sla`]: the highest swept rate such that every swept
//!   rate up to it meets the SLA (no rate above a failure counts, however
//!   it came out).
//! - [`refine`]: the rates to sweep next, bisecting between the last
//!   passing rate and the first failing one until they are at most
//!   [`KNEE_STEP`] apart.
//! - [`tenant_tail_ratio`]: how many times lower a system's tenants' p99s
//!   are than a baseline's, the geometric mean over tenants, only when
//!   every one is bounded in both.
//! - [`Spread`]: min / median / max of a figure over seeds.

use serde::{Deserialize, Serialize};

/// Fewest latencies a p99 is computed from (with fewer, the 99th
/// percentile by nearest rank is the slowest request or next to it).
pub const MIN_P99_SAMPLES: usize = 100;

/// A sweep is fine enough around a knee when its last passing and first
/// failing rates are at most this ratio apart (5%).
pub const KNEE_STEP: f64 = 1.05;

/// A run is saturated when the requests still queued at the end of the
/// arrivals take more than this share of the arrival window to drain.
pub const DRAIN_SHARE: f64 = 0.05;

/// The `q`-th quantile (0 < q <= 1) of `v` by nearest rank (the smallest
/// value with at least `q` of the values at or below it); NaN when `v`
/// is empty or holds a NaN.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() || v.iter().any(|x| x.is_nan()) || !(q > 0.0 && q <= 1.0) {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    // Nearest rank: ceil(q n), 1-based.
    let rank = (q * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// The 99th percentile of `v` by nearest rank, `None` with fewer than
/// [`MIN_P99_SAMPLES`] values (NaN propagates).
pub fn p99(v: &[f64]) -> Option<f64> {
    (v.len() >= MIN_P99_SAMPLES).then(|| quantile(v, 0.99))
}

/// Whether a run was saturated: the last request completed more than
/// [`DRAIN_SHARE`] of the arrival window (`first_arrival` to
/// `last_arrival`) after the last arrival. A stable queue drains within
/// about one request's latency; a saturated one holds a backlog that
/// grows with the window. NaN inputs count as saturated (nothing can be
/// read from such a run).
pub fn saturated(first_arrival: f64, last_arrival: f64, last_completion: f64) -> bool {
    let window = last_arrival - first_arrival;
    let drain = last_completion - last_arrival;
    !(window > 0.0 && drain <= DRAIN_SHARE * window)
}

/// A tail latency as it may be read: a number below saturation, else
/// unbounded (it grows with the run's length), or missing (too few
/// requests).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "seconds")]
pub enum Tail {
    Bounded(f64),
    Unbounded,
    TooFewRequests,
}

impl Tail {
    /// The tail of a tenant's `latencies` in a run that was or was not
    /// `saturated`.
    pub fn of(latencies: &[f64], saturated: bool) -> Self {
        if saturated {
            return Tail::Unbounded;
        }
        match p99(latencies) {
            Some(v) => Tail::Bounded(v),
            None => Tail::TooFewRequests,
        }
    }

    /// The number, if there is one.
    pub fn seconds(self) -> Option<f64> {
        match self {
            Tail::Bounded(v) => Some(v),
            _ => None,
        }
    }
}

/// How many times lower our tail is than the baseline's: `base / ours`,
/// only when both are bounded (below saturation); `None` otherwise.
pub fn tail_ratio(base: Tail, ours: Tail) -> Option<f64> {
    Some(base.seconds()? / ours.seconds()?)
}

/// How many times lower our tenants' tails are than the baseline's: the
/// geometric mean over tenants of [`tail_ratio`] (each tenant weighs the
/// same, whatever its latency: a mix's own p99 is its longest tenant's),
/// only when every tenant's tail is bounded in both; `None` otherwise.
pub fn tenant_tail_ratio(base: &[Tail], ours: &[Tail]) -> Option<f64> {
    if base.is_empty() || base.len() != ours.len() {
        return None;
    }
    let logs: Option<Vec<f64>> =
        base.iter().zip(ours).map(|(b, o)| tail_ratio(*b, *o).map(f64::ln)).collect();
    let logs = logs?;
    Some((logs.iter().sum::<f64>() / logs.len() as f64).exp())
}

/// One rate of a sweep for one system.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SweepPoint {
    /// Offered rate (requests per second of all tenants).
    pub rate: f64,
    /// Every tenant's p99 within its bound, and the run not saturated.
    pub meets_sla: bool,
}

/// Throughput at the SLA: the highest swept rate `r` such that every
/// swept rate up to `r` meets the SLA. `None` when the lowest swept rate
/// fails (or nothing was swept). A rate that passes above a failing one
/// does not count: a pass after a failure is noise (few requests, a lucky
/// arrival pattern), not capacity. Points need not be sorted; equal rates
/// must all pass.
pub fn throughput_at_sla(points: &[SweepPoint]) -> Option<f64> {
    let mut rates: Vec<f64> = points.iter().map(|p| p.rate).filter(|r| r.is_finite()).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    let mut best = None;
    for r in rates {
        // A rate passes only if every run at it passed.
        if points.iter().any(|p| p.rate == r && !p.meets_sla) {
            break;
        }
        best = Some(r);
    }
    best
}

/// Whether the sweep ended before its first failure (the throughput at
/// the SLA is then a lower bound: the highest rate swept).
pub fn never_failed(points: &[SweepPoint]) -> bool {
    points.iter().all(|p| p.meets_sla)
}

/// The next rate to sweep around the knee of `points`: the geometric mean
/// of the last passing rate (of the prefix that passes) and the first
/// failing rate above it, while they are more than [`KNEE_STEP`] apart;
/// `None` when the knee is fine enough, when nothing failed, or when the
/// lowest rate failed (then the sweep must start lower).
pub fn refine(points: &[SweepPoint]) -> Option<f64> {
    let lo = throughput_at_sla(points)?;
    let hi =
        points.iter().filter(|p| p.rate > lo && !p.meets_sla).map(|p| p.rate).fold(f64::INFINITY, f64::min);
    (hi.is_finite() && hi / lo > KNEE_STEP).then(|| (lo * hi).sqrt())
}

/// A figure over seeds: its least, median and greatest value (NaN in,
/// NaN out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    pub seeds: usize,
}

impl Spread {
    pub fn of(v: &[f64]) -> Self {
        if v.is_empty() || v.iter().any(|x| x.is_nan()) {
            return Self { min: f64::NAN, median: f64::NAN, max: f64::NAN, seeds: v.len() };
        }
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
        Self { min: s[0], median, max: s[n - 1], seeds: n }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.2} ({:.2}-{:.2}, {} seeds)", self.median, self.min, self.max, self.seeds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(rate: f64, meets_sla: bool) -> SweepPoint {
        SweepPoint { rate, meets_sla }
    }

    /// The balanced mix's sweep as the issue read it: fail at 90,858,
    /// pass at 95,256 and 98,662, fail at 98,881. The old rule (the
    /// highest pass anywhere) kept 98,662; the prefix rule keeps the last
    /// pass before the first failure.
    #[test]
    fn a_sweep_that_fails_in_the_middle_counts_only_up_to_its_first_failure() {
        let sweep = [
            pt(80_000.0, true),
            pt(85_000.0, true),
            pt(90_858.0, false),
            pt(95_256.0, true),
            pt(98_662.0, true),
            pt(98_881.0, false),
        ];
        assert_eq!(throughput_at_sla(&sweep), Some(85_000.0));
        // Order does not matter.
        let mut rev = sweep;
        rev.reverse();
        assert_eq!(throughput_at_sla(&rev), Some(85_000.0));
        // The lowest rate failing: none.
        assert_eq!(throughput_at_sla(&[pt(1.0, false), pt(2.0, true)]), None);
        assert_eq!(throughput_at_sla(&[]), None);
        // All passing: the highest, and the sweep says it never failed.
        assert_eq!(throughput_at_sla(&[pt(1.0, true), pt(2.0, true)]), Some(2.0));
        assert!(never_failed(&[pt(1.0, true), pt(2.0, true)]) && !never_failed(&sweep));
        // A failure at the same rate as a pass voids the pass.
        assert_eq!(throughput_at_sla(&[pt(1.0, true), pt(2.0, true), pt(2.0, false)]), Some(1.0));
    }

    /// Bisection between 85,000 (pass) and 90,858 (fail): the geometric
    /// mean, until the two are within 5%.
    #[test]
    fn the_knee_is_bisected_until_it_is_within_five_percent() {
        let mut sweep = vec![pt(80_000.0, true), pt(85_000.0, true), pt(90_858.0, false), pt(95_256.0, true)];
        // 90,858 / 85,000 = 1.069 > 1.05: bisect at sqrt(85,000 x 90,858).
        let next = refine(&sweep).unwrap();
        assert!((next - 87_880.2).abs() < 0.1, "{next}");
        sweep.push(pt(next, true));
        // 90,858 / 87,880 = 1.034: fine enough.
        assert_eq!(refine(&sweep), None);
        assert_eq!(throughput_at_sla(&sweep), Some(next));
        // Nothing failed, or the lowest failed: nothing to bisect.
        assert_eq!(refine(&[pt(1.0, true)]), None);
        assert_eq!(refine(&[pt(1.0, false), pt(2.0, false)]), None);
    }

    /// A queue that drains within 5% of the window is stable; one that
    /// needs longer grew while requests arrived.
    #[test]
    fn a_saturated_queue_is_flagged_and_its_tail_is_unbounded() {
        // Arrivals over [0, 1] s; the last completes at 1.01 s: stable.
        assert!(!saturated(0.0, 1.0, 1.01));
        assert!(!saturated(0.0, 1.0, 1.04));
        // At 1.2 s: 20% of the window left to drain.
        assert!(saturated(0.0, 1.0, 1.2));
        // A single arrival, or NaN: nothing can be read.
        assert!(saturated(1.0, 1.0, 1.0));
        assert!(saturated(0.0, f64::NAN, 1.0));
        let lat: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(Tail::of(&lat, true), Tail::Unbounded);
        assert_eq!(tail_ratio(Tail::Unbounded, Tail::of(&lat, false)), None);
        assert_eq!(tail_ratio(Tail::of(&lat, false), Tail::Unbounded), None);
    }

    /// 200 latencies 1..=200: the nearest-rank p99 is the 198th, 198. A
    /// mix of two tenants, 100 requests each at 1..=100 and 101..=200: the
    /// mix's p99 is that of the 200 together, 198; each tenant's own is
    /// its 99th value, 99 and 199. With 99 requests there is no p99.
    #[test]
    fn p99_by_nearest_rank_on_a_mix_computed_by_hand() {
        let a: Vec<f64> = (1..=100).map(f64::from).collect();
        let b: Vec<f64> = (101..=200).map(f64::from).collect();
        let mix: Vec<f64> = b.iter().chain(&a).copied().collect();
        assert_eq!(p99(&mix), Some(198.0));
        assert_eq!(p99(&a), Some(99.0));
        assert_eq!(p99(&b), Some(199.0));
        assert_eq!(p99(&a[..99]), None);
        assert_eq!(Tail::of(&a[..99], false), Tail::TooFewRequests);
        // Our p99 99 against a baseline's 198: 2x lower.
        assert_eq!(tail_ratio(Tail::Bounded(198.0), Tail::Bounded(99.0)), Some(2.0));
        // Per tenant: 2x lower for one, 8x higher for the other (a ratio
        // of 1/8): the geometric mean of 2 and 1/8 is 1/2, whatever the
        // tenants' scales.
        let base = [Tail::Bounded(2e-3), Tail::Bounded(1e-5)];
        let ours = [Tail::Bounded(1e-3), Tail::Bounded(8e-5)];
        let r = tenant_tail_ratio(&base, &ours).unwrap();
        assert!((r - 0.5).abs() < 1e-12, "{r}");
        // One tenant unbounded on either side: no ratio.
        assert_eq!(tenant_tail_ratio(&[Tail::Unbounded, base[1]], &ours), None);
        assert_eq!(tenant_tail_ratio(&base, &[ours[0], Tail::TooFewRequests]), None);
        assert_eq!(tenant_tail_ratio(&base, &ours[..1]), None);
        // NaN propagates.
        let mut nan = a.clone();
        nan[3] = f64::NAN;
        assert!(p99(&nan).unwrap().is_nan());
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn a_spread_over_seeds_is_min_median_max() {
        let s = Spread::of(&[1.4, 1.1, 1.3, 1.2, 1.5]);
        assert_eq!((s.min, s.median, s.max, s.seeds), (1.1, 1.3, 1.5, 5));
        assert_eq!(Spread::of(&[1.0, 2.0]).median, 1.5);
        assert!(Spread::of(&[1.0, f64::NAN]).median.is_nan());
    }
}
