//! scikit-learn models as skl2onnx exports them (ai.onnx.ml operators,
//! ZipMap included), trained and exported by scripts/sklearn_models.py in
//! `.venv-onnx` (scripts/setup.sh installs it), compiled, run on the NPU
//! model in-process, and checked output by output against ONNX Runtime
//! (scripts/ort_ref.py) on the same inputs: labels equal, probabilities
//! within 1e-5, regressions within 1e-5 of their scale.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use npu_model::BoardConfig;
use npu_onnx::host::HostRunner;
use npu_onnx::{compile_file, npy, CompileOptions};
use vnpu_abi::DType;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    root().join(".venv-onnx/bin/python")
}

/// The models' directory, written once per test process.
fn models() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("vnpu-sklearn-{}", std::process::id()));
        let out = Command::new(python())
            .arg(root().join("scripts/sklearn_models.py"))
            .arg(&dir)
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run {} (bash scripts/setup.sh installs it): {e}", python().display())
            });
        assert!(out.status.success(), "sklearn_models.py failed: {}", String::from_utf8_lossy(&out.stderr));
        dir
    })
}

/// ONNX Runtime's outputs `names` of `model` on `x`.
fn ort(model: &Path, input: &str, x: &Path, names: &[String], tag: &str) -> Vec<npy::Array> {
    let dir = models().join(format!("ort-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("out");
    let mut cmd = Command::new(python());
    cmd.arg(root().join("scripts/ort_ref.py"))
        .arg(model)
        .arg(&prefix)
        .arg(format!("{input}={}", x.display()));
    for n in names {
        cmd.args(["--output", n]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "ort_ref.py failed: {}", String::from_utf8_lossy(&out.stderr));
    names
        .iter()
        .map(|n| {
            let file: String = n
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || ".-_".contains(c) { c } else { '_' })
                .collect();
            npy::read_file(&PathBuf::from(format!("{}.{file}.npy", prefix.display()))).unwrap()
        })
        .collect()
}

/// Options for a 1 SA + 1 VU vNPU at `batch`, f32, compiling `outputs`
/// (the model's own when `None`).
fn options(batch: u32, outputs: Option<Vec<String>>) -> (BoardConfig, CompileOptions) {
    let (board, mut o) = common::options(batch, DType::F32);
    o.outputs = outputs;
    (board, o)
}

/// Compiles model `name` at the batch of its input, runs it on a 1+1
/// vNPU of the default board, and compares every output with ONNX
/// Runtime's. Returns the worst absolute error of float outputs.
fn check(name: &str) -> f64 {
    check_outputs(name, None)
}

/// [`check`] of the outputs `outputs` only (all of the model's when `None`).
fn check_outputs(name: &str, outputs: Option<Vec<String>>) -> f64 {
    let model = models().join(format!("{name}.onnx"));
    let xpath = models().join(format!("{name}-X.npy"));
    let x = npy::read_file(&xpath).unwrap();
    let (board, opts) = options(x.shape[0] as u32, outputs);
    let c = compile_file(&model, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    let (outs, _) = r.infer(&[&x.data]).unwrap_or_else(|e| panic!("{name}: {e}"));
    let names: Vec<String> = c.model.outputs.iter().map(|o| o.name.clone()).collect();
    let input = c.model.inputs[0].name.clone();
    let want = ort(&model, &input, &xpath, &names, name);
    let mut worst = 0f64;
    for ((d, got), want) in c.model.outputs.iter().zip(&outs).zip(&want) {
        assert_eq!(
            got.len(),
            want.data.len(),
            "{name}: output {} has {} values, ONNX Runtime {}",
            d.name,
            got.len(),
            want.data.len()
        );
        if d.elem.is_int() {
            let differ = got.iter().zip(&want.data).filter(|(g, w)| g != w).count();
            println!("{name}: {} labels, {differ} differ", got.len());
            assert_eq!(differ, 0, "{name}: output {} differs from ONNX Runtime in {differ} places", d.name);
            continue;
        }
        let scale = want.data.iter().fold(1f64, |m, &w| m.max(f64::from(w).abs()));
        let abs = got.iter().zip(&want.data).fold(0f64, |m, (&g, &w)| {
            let e = (f64::from(g) - f64::from(w)).abs();
            if e.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        });
        println!("{name}: output {} max abs error {abs:.3e} (scale {scale:.3e})", d.name);
        assert!(
            abs <= 1e-5 * scale,
            "{name}: output {}: max abs error {abs} (scale {scale}) against ONNX Runtime",
            d.name
        );
        worst = worst.max(abs / scale);
    }
    worst
}

macro_rules! models {
    ($($test:ident: $name:literal,)*) => {$(
        #[test]
        fn $test() {
            check($name);
        }
    )*};
}

models! {
    standard_scaler_and_logistic_regression: "scaler-logreg",
    random_forest_of_100_trees: "random-forest",
    gradient_boosting_regressor: "gradient-boosting-regressor",
    svc_with_rbf_kernel: "svc-rbf",
    mlp_classifier: "mlp",
    binary_logistic_regression: "logreg-binary",
    binary_random_forest: "random-forest-binary",
    binary_gradient_boosting: "gradient-boosting-binary",
    multiclass_gradient_boosting: "gradient-boosting-multi",
    binary_svc: "svc-binary",
    svc_of_ten_classes: "svc-ten-classes",
    svc_with_poly_kernel: "svc-poly",
    svc_with_sigmoid_kernel: "svc-sigmoid",
    svc_with_linear_kernel: "svc-linear",
    linear_svc: "linear-svc",
    svr: "svr",
    linear_regression: "linear-regression",
    decision_tree_of_digits: "decision-tree",
    random_forest_regressor: "random-forest-regressor",
    multi_output_tree: "multi-output-tree",
    imputer_scaler_normalizer_binarizer: "imputer-pipeline",
    imputer_then_logistic_regression: "imputer-logreg",
    one_hot_encoder: "onehot",
    one_hot_encoder_then_logistic_regression: "onehot-logreg",
    max_normalizer: "normalizer-max",
    l1_normalizer: "normalizer-l1",
    tree_ensemble_of_ml_opset_5: "tree-ensemble-v5",
    adaboost: "adaboost",
    extra_trees: "extra-trees",
    gaussian_naive_bayes: "gaussian-nb",
    bernoulli_naive_bayes: "bernoulli-nb",
    multinomial_naive_bayes: "multinomial-nb",
    linear_discriminant_analysis: "lda",
    quadratic_discriminant_analysis: "qda",
    kmeans: "kmeans",
    sgd_classifier: "sgd",
    ridge_classifier: "ridge-classifier",
    perceptron: "perceptron",
    pca_then_logistic_regression: "pca-logreg",
    polynomial_features_then_ridge: "poly-ridge",
    robust_and_max_abs_scalers_then_logistic_regression: "robust-maxabs-logreg",
    kbins_discretizer_then_logistic_regression: "kbins-logreg",
    lasso: "lasso",
    decision_tree_regressor: "decision-tree-regressor",
    linear_svr: "linear-svr",
    nu_svc: "nu-svc",
    mlp_regressor: "mlp-regressor",
    lightgbm_multiclass: "lightgbm-multi",
    lightgbm_with_missing_values: "lightgbm-missing",
    lightgbm_regressor: "lightgbm-regressor",
    label_encoder_of_integers: "label-encoder-ints",
    label_encoder_of_floats: "label-encoder-floats",
}

/// String class labels: the probabilities compile and equal ONNX
/// Runtime's; the label output (a string tensor) is refused with the way
/// around it.
#[test]
fn string_labels_compile_the_probabilities_only() {
    check_outputs("string-labels", Some(vec!["output_probability".into()]));
    let e = compile_file(&models().join("string-labels.onnx"), &options(4, None).1)
        .expect_err("a string label output is refused")
        .to_string();
    assert!(e.contains("string class labels") && e.contains("--output"), "{e}");
}

/// SVC(probability=True): its label compiles and equals ONNX Runtime's;
/// its probabilities (a pairwise coupling) are refused with the reason
/// and the way around it.
#[test]
fn svc_with_probabilities_compiles_its_label_only() {
    check_outputs("svc-probability", Some(vec!["output_label".into()]));
    let model = models().join("svc-probability.onnx");
    let e = compile_file(&model, &options(4, None).1).expect_err("the probabilities are refused").to_string();
    assert!(e.contains("SVMClassifier") && e.contains("probability=True") && e.contains("--output"), "{e}");
}

/// Every model the script writes has a test above.
#[test]
fn every_exported_model_is_checked() {
    let listed = std::fs::read_to_string(models().join("models.txt")).unwrap();
    let src = include_str!("sklearn.rs");
    for name in listed.split_whitespace() {
        assert!(src.contains(&format!("\"{name}\"")), "{name} has no test");
    }
}
