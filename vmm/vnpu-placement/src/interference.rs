//! Interference-aware placement (docs/interference.md, "Placement"): a
//! predictor trained on a characterization matrix of this board
//! (`npu-interference characterize`) prices each candidate core by the
//! predicted overhead of every tenant of the board once the new vNPU is
//! there. Only instances with a workload attached (`--workload`) are
//! priced; the others still take their EUs and memory.

use std::path::Path;

use npu_interference::characterize::{Matrix, Solo};
use npu_interference::corun::{CoRunError, Spec};
use npu_interference::matrix_file::MatrixFileError;
use npu_interference::predict::{Learner, PredictError, Predictor};
use npu_model::BoardConfig;
use thiserror::Error;

use vnpu_spec::{Instance, Workload};

/// Why interference could not be predicted.
#[derive(Debug, Error)]
pub enum InterferenceError {
    #[error("interference {0}")]
    Matrix(#[from] MatrixFileError),
    #[error("the interference matrix was measured on board `{matrix}`, this board is `{board}`: characterize this board first (npu-interference characterize --board ...)")]
    OtherBoard { matrix: String, board: String },
    #[error(transparent)]
    Predict(#[from] PredictError),
    #[error("measuring a workload alone: {0}")]
    Measure(#[from] CoRunError),
    #[error("no solo counters for {0} (neither in the matrix nor measured before the placement); try again")]
    NotMeasured(String),
}

/// A trained predictor and the solo counters it needs.
#[derive(Debug)]
pub struct InterferenceModel {
    board: BoardConfig,
    predictor: Predictor,
    solos: Vec<Solo>,
}

/// The tenant one core of an instance is, to the predictor.
pub fn spec_of(workload: &Workload, inst_sa: u32, inst_vu: u32) -> Spec {
    Spec { workload: workload.name.clone(), batch: workload.batch, sa: inst_sa, vu: inst_vu }
}

/// The predicted slowdown of each tenant `(solo counters, physical core)`
/// beside the others: [`Predictor::slowdown`] with the tenants of its
/// core as one kind of neighbour and all the others as the other.
pub fn predicted_slowdowns(p: &Predictor, tenants: &[(&Solo, usize)]) -> Result<Vec<f64>, PredictError> {
    let mut out = Vec::with_capacity(tenants.len());
    for (k, &(own, core)) in tenants.iter().enumerate() {
        let (mut same, mut elsewhere) = (Vec::new(), Vec::new());
        for (j, &(other, c)) in tenants.iter().enumerate() {
            if j != k {
                if c == core {
                    same.push(other)
                } else {
                    elsewhere.push(other)
                }
            }
        }
        out.push(p.slowdown(own, &same, &elsewhere)?);
    }
    Ok(out)
}

impl InterferenceModel {
    /// Trains `learner` on `matrix` (measured on a board named as `board`).
    pub fn new(
        matrix: &Matrix,
        board: &BoardConfig,
        learner: &dyn Learner,
    ) -> Result<Self, InterferenceError> {
        if matrix.board != board.name {
            return Err(InterferenceError::OtherBoard {
                matrix: matrix.board.clone(),
                board: board.name.clone(),
            });
        }
        Ok(Self {
            board: board.clone(),
            predictor: Predictor::train(matrix, learner)?,
            solos: matrix.solo.clone(),
        })
    }

    /// Reads a matrix written by `npu-interference characterize --json`
    /// and trains `learner` on it.
    pub fn from_file(
        path: &Path,
        board: &BoardConfig,
        learner: &dyn Learner,
    ) -> Result<Self, InterferenceError> {
        Self::new(&Matrix::load(path)?, board, learner)
    }

    /// The index of `spec`'s solo counters: the matrix's, else measured
    /// now on the board model (and kept).
    pub fn solo(&mut self, spec: &Spec) -> Result<usize, InterferenceError> {
        if let Some(i) = self.solos.iter().position(|s| &s.spec == spec) {
            return Ok(i);
        }
        self.solos.push(Solo::measure(&self.board, spec)?);
        Ok(self.solos.len() - 1)
    }

    /// The index of `spec`'s solo counters if they are known (in the
    /// matrix or measured by [`InterferenceModel::solo`] before), never
    /// measuring: what a caller holding a lock uses, having measured
    /// what it needs before taking it.
    pub fn known(&self, spec: &Spec) -> Result<usize, InterferenceError> {
        self.solos
            .iter()
            .position(|s| &s.spec == spec)
            .ok_or_else(|| InterferenceError::NotMeasured(spec.to_string()))
    }

    /// Measures now (without a lock held: a lowering and a run of the
    /// board model each, 10-50 ms) the solo counters of every tenant
    /// `instances` would price, and of `also`, that the matrix lacks.
    pub fn measure_missing(
        &mut self,
        instances: &[Instance],
        also: &[Spec],
    ) -> Result<(), InterferenceError> {
        let specs = instances.iter().filter_map(|i| {
            i.workload.as_ref().map(|w| spec_of(w, i.shape.sa_per_core(), i.shape.vu_per_core()))
        });
        for spec in specs.chain(also.iter().cloned()).collect::<Vec<_>>() {
            self.solo(&spec)?;
        }
        Ok(())
    }

    /// Solo counters by index (from [`InterferenceModel::solo`]).
    pub fn solo_at(&self, i: usize) -> Option<&Solo> {
        self.solos.get(i)
    }

    /// The predicted slowdown of each tenant `(solo index, physical core)`
    /// beside the others (neighbours on its core, and elsewhere).
    pub fn slowdowns(&self, tenants: &[(usize, usize)]) -> Result<Vec<f64>, InterferenceError> {
        let mut with = Vec::with_capacity(tenants.len());
        for &(i, core) in tenants {
            let s = self.solos.get(i).ok_or_else(|| {
                InterferenceError::Predict(PredictError::NoSolo(format!(
                    "solo index {i} (not from this model)"
                )))
            })?;
            with.push((s, core));
        }
        Ok(predicted_slowdowns(&self.predictor, &with)?)
    }

    /// The predicted overhead of the board: the sum of every tenant's
    /// slowdown minus one.
    pub fn overhead(&self, tenants: &[(usize, usize)]) -> Result<f64, InterferenceError> {
        Ok(self.slowdowns(tenants)?.iter().map(|s| s - 1.0).sum())
    }

    /// The priced tenants of `instances` (active, with a workload): one
    /// per physical core of each. Never measures: their counters must be
    /// known ([`InterferenceModel::measure_missing`]).
    pub fn tenants(&self, instances: &[Instance]) -> Result<Vec<(usize, usize)>, InterferenceError> {
        let mut out = Vec::new();
        for i in instances.iter().filter(|i| i.active) {
            let Some(w) = &i.workload else { continue };
            let s = self.known(&spec_of(w, i.shape.sa_per_core(), i.shape.vu_per_core()))?;
            out.extend(i.cores.iter().map(|&c| (s, c as usize)));
        }
        Ok(out)
    }
}
