//! The interference evaluation (`docs/interference.md`): what the
//! `npu-interference` command adds to the library `npu-interference`:
//! a random-forest predictor ([`Forest`], smartcore) to compare with the
//! library's linear one, and the heat maps and bar charts ([`plot`]).
//! Kept apart so that nothing the board daemon links needs an ML or a
//! plotting crate.

pub mod plot;

use npu_interference::predict::{Learner, Linear, Mean, Model, PredictError, Regressor};
use smartcore::ensemble::random_forest_regressor::{RandomForestRegressor, RandomForestRegressorParameters};
use smartcore::linalg::basic::matrix::DenseMatrix;

/// A random forest of `trees` regression trees grown to purity on
/// bootstrap samples (smartcore), seeded.
#[derive(Clone, Copy, Debug)]
pub struct Forest {
    pub trees: usize,
    pub seed: u64,
}

struct Fitted(RandomForestRegressor<f64, f64, DenseMatrix<f64>, Vec<f64>>);

fn matrix(rows: &[&[f64]]) -> Result<DenseMatrix<f64>, PredictError> {
    let v: Vec<Vec<f64>> = rows.iter().map(|r| r.to_vec()).collect();
    DenseMatrix::from_2d_vec(&v)
        .map_err(|e| PredictError::Model { model: "random forest", reason: e.to_string() })
}

fn failed(e: smartcore::error::Failed) -> PredictError {
    PredictError::Model { model: "random forest", reason: e.to_string() }
}

impl Regressor for Fitted {
    fn predict(&self, rows: &[&[f64]]) -> Result<Vec<f64>, PredictError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.0.predict(&matrix(rows)?).map_err(failed)
    }
}

impl Learner for Forest {
    fn model(&self) -> Model {
        Model::Forest { trees: self.trees, seed: self.seed }
    }
    fn fit(&self, x: &[&[f64]], y: &[f64]) -> Result<Box<dyn Regressor>, PredictError> {
        let params = RandomForestRegressorParameters {
            max_depth: None,
            min_samples_leaf: 1,
            min_samples_split: 2,
            n_trees: self.trees.max(1),
            m: None,
            keep_samples: false,
            seed: self.seed,
        };
        let y = y.to_vec();
        Ok(Box::new(Fitted(RandomForestRegressor::fit(&matrix(x)?, &y, params).map_err(failed)?)))
    }
}

/// The learner a [`Model`] names.
pub fn learner(model: Model) -> Box<dyn Learner> {
    match model {
        Model::Mean => Box::new(Mean),
        Model::Linear => Box::new(Linear),
        Model::Forest { trees, seed } => Box::new(Forest { trees, seed }),
    }
}
