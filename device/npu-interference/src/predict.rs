//! Predicting a tenant's slowdown from solo counters only: its own (what
//! a provider reads of a workload running alone: per-engine active ratios,
//! bytes per cycle to HBM and to guest memory, FLOPs per byte, stalls) and
//! its neighbours', and where it is placed. Models: the training mean (a
//! predictor that ignores its features: the floor every model must beat),
//! least squares (an SVD of the design matrix, nalgebra), and any other
//! [`Learner`] a caller brings: the random forest lives in the evaluation
//! crate `interference-eval`, so that the board daemon, which prices
//! placements with the linear model, links no ML crate. Cross-validation holds
//! out one workload pair at a time: every case of that pair (any batch,
//! shape or placement) is tested on a model trained on cases that never
//! put those two workloads together.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::characterize::{CaseOutcome, Matrix, Placement, Solo};
use crate::corun::Spec;

/// Why a model could not be trained or evaluated.
#[derive(Debug, Error)]
pub enum PredictError {
    #[error("the matrix has no solo counters for {0}")]
    NoSolo(String),
    #[error("{model}: {reason}")]
    Model { model: &'static str, reason: String },
    #[error("too few workload pairs to cross-validate ({0}; at least 2)")]
    TooFew(usize),
}

/// Names of the features, in order.
pub const FEATURES: [&str; 23] = [
    "own.log_latency",
    "own.sa_active",
    "own.vu_active",
    "own.dma_active",
    "own.hbm_bytes_per_cycle",
    "own.host_bytes_per_cycle",
    "own.log_flops_per_byte",
    "own.stall",
    "own.eus",
    "neighbours",
    "nb.dma_active",
    "nb.hbm_bytes_per_cycle",
    "nb.host_bytes_per_cycle",
    "nb.sa_active",
    "nb.vu_active",
    "nb.latency_over_own",
    "placement.core",
    "placement.chip",
    "placement.time_shared",
    "core x own.dma x nb.dma",
    "own.host x nb.host",
    "own.hbm x nb.hbm",
    "time_shared x nb.latency_over_own",
];

/// One tenant of one case: its features, its measured slowdown and the
/// workloads of its case (for holding out pairs).
#[derive(Clone, Debug)]
pub struct Sample {
    pub features: Vec<f64>,
    pub slowdown: f64,
    pub case: usize,
    pub tenant: usize,
    /// Workload names of the case, sorted.
    pub workloads: Vec<String>,
    pub placement: Placement,
}

fn flag(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

/// The features of a tenant `own` placed as `placement` with `neighbours`
/// (solo counters only).
pub fn features(own: &Solo, neighbours: &[&Solo], placement: Placement) -> Vec<f64> {
    let sum = |f: fn(&Solo) -> f64| neighbours.iter().map(|n| f(n)).sum::<f64>();
    let nb_dma = sum(|s| s.dma_active);
    let nb_hbm = sum(|s| s.hbm_bytes_per_cycle);
    let nb_host = sum(|s| s.host_bytes_per_cycle);
    let ratio = sum(|s| s.latency) / own.latency.max(1.0);
    let (core, chip, shared) =
        (placement == Placement::Core, placement == Placement::Chip, placement == Placement::TimeShared);
    vec![
        own.latency.max(1.0).ln(),
        own.sa_active,
        own.vu_active,
        own.dma_active,
        own.hbm_bytes_per_cycle,
        own.host_bytes_per_cycle,
        (1.0 + own.flops_per_byte).ln(),
        own.stall,
        f64::from(own.spec.sa + own.spec.vu),
        neighbours.len() as f64,
        nb_dma,
        nb_hbm,
        nb_host,
        sum(|s| s.sa_active),
        sum(|s| s.vu_active),
        ratio,
        flag(core),
        flag(chip),
        flag(shared),
        flag(core) * own.dma_active * nb_dma,
        own.host_bytes_per_cycle * nb_host,
        own.hbm_bytes_per_cycle * nb_hbm,
        flag(shared) * ratio,
    ]
}

fn solo<'m>(m: &'m Matrix, spec: &Spec) -> Result<&'m Solo, PredictError> {
    m.solo(spec).ok_or_else(|| PredictError::NoSolo(spec.to_string()))
}

/// One sample per tenant of every case of `m`.
pub fn dataset(m: &Matrix) -> Result<Vec<Sample>, PredictError> {
    let mut out = Vec::new();
    for (c, case) in m.cases.iter().enumerate() {
        let mut workloads: Vec<String> = case.tenants.iter().map(|t| t.spec.workload.clone()).collect();
        workloads.sort();
        for (i, t) in case.tenants.iter().enumerate() {
            let own = solo(m, &t.spec)?;
            let nbs = case
                .tenants
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, n)| solo(m, &n.spec))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(Sample {
                features: features(own, &nbs, case.placement),
                slowdown: t.slowdown,
                case: c,
                tenant: i,
                workloads: workloads.clone(),
                placement: case.placement,
            });
        }
    }
    Ok(out)
}

/// A regression model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Model {
    /// The mean slowdown of the training set, whatever the features.
    Mean,
    /// Least squares (SVD): [`Linear`].
    Linear,
    /// A random forest of `trees` trees (seeded): `interference_eval::Forest`.
    Forest { trees: usize, seed: u64 },
}

impl Model {
    pub fn name(self) -> &'static str {
        match self {
            Model::Mean => "mean (ignores features)",
            Model::Linear => "linear",
            Model::Forest { .. } => "random forest",
        }
    }
}

/// A fitted regression model: a slowdown per row of features.
pub trait Regressor: Send + Sync {
    fn predict(&self, rows: &[&[f64]]) -> Result<Vec<f64>, PredictError>;
}

/// A way to fit a [`Regressor`] to a training set. [`Mean`] and [`Linear`]
/// are here; `interference_eval::Forest` is the random forest.
pub trait Learner: Sync {
    /// What it is, for reports.
    fn model(&self) -> Model;
    /// Fits `y` (one slowdown per row) from `x`. `x` is not empty.
    fn fit(&self, x: &[&[f64]], y: &[f64]) -> Result<Box<dyn Regressor>, PredictError>;
}

/// The training set's mean, whatever the features.
#[derive(Clone, Copy, Debug)]
pub struct Mean;

struct Constant(f64);

impl Regressor for Constant {
    fn predict(&self, rows: &[&[f64]]) -> Result<Vec<f64>, PredictError> {
        Ok(vec![self.0; rows.len()])
    }
}

impl Learner for Mean {
    fn model(&self) -> Model {
        Model::Mean
    }
    fn fit(&self, _x: &[&[f64]], y: &[f64]) -> Result<Box<dyn Regressor>, PredictError> {
        Ok(Box::new(Constant(y.iter().sum::<f64>() / y.len() as f64)))
    }
}

/// Ordinary least squares with an intercept: the minimum-norm solution
/// through the pseudo-inverse of the m x n matrix `[X 1]` (an SVD;
/// singular values below `(m + n + 1)^0.5 / 2 * s_max * eps` count as zero, so features that
/// are constant or collinear within a training set, such as the
/// placement flags of a one-placement model, are harmless).
#[derive(Clone, Copy, Debug)]
pub struct Linear;

struct Affine {
    weights: Vec<f64>,
    intercept: f64,
}

impl Regressor for Affine {
    fn predict(&self, rows: &[&[f64]]) -> Result<Vec<f64>, PredictError> {
        rows.iter()
            .map(|r| {
                if r.len() != self.weights.len() {
                    return Err(PredictError::Model {
                        model: Model::Linear.name(),
                        reason: format!("{} features, trained on {}", r.len(), self.weights.len()),
                    });
                }
                Ok(r.iter().zip(&self.weights).map(|(x, w)| x * w).sum::<f64>() + self.intercept)
            })
            .collect()
    }
}

impl Learner for Linear {
    fn model(&self) -> Model {
        Model::Linear
    }
    fn fit(&self, x: &[&[f64]], y: &[f64]) -> Result<Box<dyn Regressor>, PredictError> {
        let name = Model::Linear.name();
        let n = x.first().map_or(0, |r| r.len());
        if x.len() <= n {
            return Err(PredictError::Model {
                model: name,
                reason: format!(
                    "{} training tenants for {n} features: characterize more workloads, batches or shapes",
                    x.len()
                ),
            });
        }
        if x.iter().any(|r| r.len() != n) || x.len() != y.len() {
            return Err(PredictError::Model { model: name, reason: "rows of different lengths".into() });
        }
        let a = nalgebra::DMatrix::from_fn(x.len(), n + 1, |i, j| if j < n { x[i][j] } else { 1.0 });
        let b = nalgebra::DVector::from_column_slice(y);
        let svd = a.svd(true, true);
        let s_max = svd.singular_values.max();
        let eps = 0.5 * ((x.len() + (n + 1) + 1) as f64).sqrt() * s_max * f64::EPSILON;
        let w = svd.solve(&b, eps).map_err(|e| PredictError::Model { model: name, reason: e.to_string() })?;
        Ok(Box::new(Affine { weights: w.iter().take(n).copied().collect(), intercept: w[n] }))
    }
}

fn fit(learner: &dyn Learner, train: &[&Sample]) -> Result<Box<dyn Regressor>, PredictError> {
    if train.is_empty() {
        return Err(PredictError::Model {
            model: learner.model().name(),
            reason: "no training tenants".into(),
        });
    }
    let x: Vec<&[f64]> = train.iter().map(|s| s.features.as_slice()).collect();
    let y: Vec<f64> = train.iter().map(|s| s.slowdown).collect();
    learner.fit(&x, &y)
}

/// Trains `learner` on `train` and predicts the slowdowns of `test`.
pub fn fit_predict(
    learner: &dyn Learner,
    train: &[&Sample],
    test: &[&Sample],
) -> Result<Vec<f64>, PredictError> {
    if test.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<&[f64]> = test.iter().map(|s| s.features.as_slice()).collect();
    fit(learner, train)?.predict(&rows)
}

/// A model trained on every tenant of a matrix, one per placement, that
/// predicts the slowdown of tenants in configurations nobody measured.
pub struct Predictor {
    model: Model,
    fitted: Vec<(Placement, Box<dyn Regressor>)>,
}

impl std::fmt::Debug for Predictor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Predictor").field("model", &self.model).finish_non_exhaustive()
    }
}

impl Predictor {
    /// Trains `model` on every tenant of `m`, per placement (`core` and
    /// `chip`; time-shared too when the matrix has such cases).
    pub fn train(m: &Matrix, learner: &dyn Learner) -> Result<Self, PredictError> {
        let samples = dataset(m)?;
        let mut fitted = Vec::new();
        for placement in Placement::ALL {
            let train: Vec<&Sample> = samples.iter().filter(|s| s.placement == placement).collect();
            if !train.is_empty() {
                fitted.push((placement, fit(learner, &train)?));
            }
        }
        Ok(Self { model: learner.model(), fitted })
    }

    pub fn model(&self) -> Model {
        self.model
    }

    /// The predicted slowdown of `own` placed as `placement` with
    /// `neighbours` (1 with no neighbours).
    pub fn predict(
        &self,
        own: &Solo,
        neighbours: &[&Solo],
        placement: Placement,
    ) -> Result<f64, PredictError> {
        if neighbours.is_empty() {
            return Ok(1.0);
        }
        let Some((_, f)) = self.fitted.iter().find(|(p, _)| *p == placement) else {
            return Err(PredictError::Model {
                model: self.model.name(),
                reason: format!("the matrix has no `{}` cases to learn from", placement.name()),
            });
        };
        let row = features(own, neighbours, placement);
        Ok(f.predict(&[row.as_slice()])?.first().copied().unwrap_or(f64::NAN))
    }

    /// The predicted slowdown of `own` with `same_core` neighbours on EUs
    /// of their own on its core and `elsewhere` on other cores: the two
    /// overheads (`core` and `chip` models) added. An approximation: the
    /// models learnt each kind of neighbour alone, and `chip` cases had all
    /// their tenants on one chip.
    pub fn slowdown(
        &self,
        own: &Solo,
        same_core: &[&Solo],
        elsewhere: &[&Solo],
    ) -> Result<f64, PredictError> {
        let core = self.predict(own, same_core, Placement::Core)?;
        let chip = self.predict(own, elsewhere, Placement::Chip)?;
        Ok(core + chip - 1.0)
    }
}

/// Whether `workloads` (a case's, sorted) puts `pair` together.
fn puts_together(workloads: &[String], pair: &[String]) -> bool {
    match pair {
        [a, b] if a == b => workloads.iter().filter(|w| *w == a).count() >= 2,
        [a, b] => workloads.contains(a) && workloads.contains(b),
        _ => false,
    }
}

/// How one model did, out of fold.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Evaluation {
    pub model: Model,
    pub name: String,
    /// Errors over the tenants of the pair cases where tenants run at the
    /// same time (placements `core` and `chip`), each predicted by the
    /// model that never saw its pair.
    pub concurrent: Errors,
    /// The same per placement.
    pub per_placement: Vec<(Placement, Errors)>,
    /// Fraction of "which of two neighbours interferes less with this
    /// tenant" choices the predictions get right (total overhead of the
    /// two tenants of each placement; measured differences under 1%
    /// left out).
    pub choice_accuracy: f64,
    pub choices: usize,
    /// Out-of-fold prediction per (case, tenant) of the pair cases.
    pub predictions: Vec<(usize, usize, f64)>,
}

/// Prediction errors of the slowdown over a set of tenants.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Errors {
    pub tenants: usize,
    /// Mean squared error.
    pub mse: f64,
    /// `mse` over the variance of the measured slowdowns (0: perfect, 1: no
    /// better than the mean of the test set).
    pub normalized_mse: f64,
    pub max_abs_error: f64,
}

impl Errors {
    /// NaN-propagating: a missing prediction (NaN) makes every figure NaN.
    fn of(pairs: &[(f64, f64)]) -> Self {
        let n = pairs.len().max(1) as f64;
        let mean = pairs.iter().map(|p| p.1).sum::<f64>() / n;
        let variance = pairs.iter().map(|p| (p.1 - mean).powi(2)).sum::<f64>() / n;
        let mse = pairs.iter().map(|(p, y)| (p - y).powi(2)).sum::<f64>() / n;
        let max_abs_error =
            pairs
                .iter()
                .map(|(p, y)| (p - y).abs())
                .fold(0.0, |a: f64, e| if e.is_nan() { e } else { a.max(e) });
        Self { tenants: pairs.len(), mse, normalized_mse: mse / variance, max_abs_error }
    }
}

/// The cross-validation of every model.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub features: Vec<String>,
    pub samples: usize,
    /// Workload pairs held out one at a time.
    pub folds: usize,
    pub models: Vec<Evaluation>,
}

/// Cross-validates `models` on `m`, holding out one workload pair at a
/// time.
pub fn cross_validate(m: &Matrix, learners: &[&dyn Learner]) -> Result<Report, PredictError> {
    let samples = dataset(m)?;
    let mut pairs: Vec<Vec<String>> =
        samples.iter().filter(|s| s.workloads.len() == 2).map(|s| s.workloads.clone()).collect();
    pairs.sort();
    pairs.dedup();
    if pairs.len() < 2 {
        return Err(PredictError::TooFew(pairs.len()));
    }
    let tested: Vec<&Sample> = samples.iter().filter(|s| s.workloads.len() == 2).collect();
    let mut evaluations = Vec::new();
    for &learner in learners {
        let model = learner.model();
        let mut predictions = Vec::new();
        for pair in &pairs {
            // One model per placement (the placement is known when a
            // prediction is asked for).
            for placement in Placement::ALL {
                let test: Vec<&Sample> = tested
                    .iter()
                    .copied()
                    .filter(|s| &s.workloads == pair && s.placement == placement)
                    .collect();
                let train: Vec<&Sample> = samples
                    .iter()
                    .filter(|s| s.placement == placement && !puts_together(&s.workloads, pair))
                    .collect();
                let p = fit_predict(learner, &train, &test)?;
                predictions.extend(test.iter().zip(p).map(|(s, p)| (s.case, s.tenant, p)));
            }
        }
        predictions.sort_by_key(|a| (a.0, a.1));
        let predicted = |c: usize, t: usize| {
            predictions.binary_search_by(|p| (p.0, p.1).cmp(&(c, t))).map_or(f64::NAN, |i| predictions[i].2)
        };
        let errors = |keep: &dyn Fn(Placement) -> bool| {
            let v: Vec<(f64, f64)> = tested
                .iter()
                .filter(|s| keep(s.placement))
                .map(|s| (predicted(s.case, s.tenant), s.slowdown))
                .collect();
            Errors::of(&v)
        };
        let (right, choices) = choice_accuracy(&m.cases, &predicted);
        evaluations.push(Evaluation {
            model,
            name: model.name().to_string(),
            concurrent: errors(&|p| p != Placement::TimeShared),
            per_placement: Placement::ALL.iter().map(|&p| (p, errors(&|q| q == p))).collect(),
            choice_accuracy: right / choices.max(1) as f64,
            choices,
            predictions,
        });
    }
    Ok(Report {
        features: FEATURES.iter().map(|s| s.to_string()).collect(),
        samples: samples.len(),
        folds: pairs.len(),
        models: evaluations,
    })
}

/// For every tenant X and two pair cases that put X (same placement) with
/// neighbours Y and Z: does the prediction order the two placements' total
/// overhead as measured? Returns (right, asked); a predicted tie counts
/// half.
fn choice_accuracy(cases: &[CaseOutcome], predicted: &dyn Fn(usize, usize) -> f64) -> (f64, usize) {
    // (X, placement, measured overhead, predicted overhead) per pair case
    // and side.
    let mut options: Vec<(&Spec, Placement, f64, f64)> = Vec::new();
    for (c, case) in cases.iter().enumerate() {
        if case.tenants.len() != 2 {
            continue;
        }
        let measured: f64 = case.tenants.iter().map(|t| t.slowdown - 1.0).sum();
        let guess: f64 = (0..2).map(|t| predicted(c, t) - 1.0).sum();
        options.push((&case.tenants[0].spec, case.placement, measured, guess));
        if case.tenants[0].spec != case.tenants[1].spec {
            options.push((&case.tenants[1].spec, case.placement, measured, guess));
        }
    }
    let (mut right, mut asked) = (0.0, 0);
    for (i, a) in options.iter().enumerate() {
        for b in &options[i + 1..] {
            if a.0 != b.0 || a.1 != b.1 || (a.2 - b.2).abs() < 0.01 {
                continue;
            }
            asked += 1;
            // A predicted tie is a coin toss.
            if a.3 == b.3 {
                right += 0.5;
            } else if (a.2 < b.2) == (a.3 < b.3) {
                right += 1.0;
            }
        }
    }
    (right, asked)
}
