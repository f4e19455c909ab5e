//! Compiled ONNX models run on the NPU model in-process, checked against
//! ONNX Runtime (run by scripts/ort_ref.py in `.venv-onnx`, which
//! scripts/setup.sh installs) and against the labels.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use npu_lower::VnpuShape;
use npu_model::BoardConfig;
use npu_onnx::host::HostRunner;
use npu_onnx::{compile, npy, CompileOptions, Compiled};
use vnpu_abi::DType;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/onnx").join(name)
}

fn shape(board: &BoardConfig, sa: u32, vu: u32) -> VnpuShape {
    VnpuShape::on_board(board, sa, vu, board.sram_bytes(), 1 << 30)
}

/// ONNX Runtime's output `output` of `model` on `input` (NAME=FILE).
///
/// Each call writes into a directory of its own: tests run in parallel
/// threads of one process, and two of them may run the same model (at two
/// vNPU shapes), so a directory per process let one test read the `.npy`
/// file another was still writing ("magic not found").
fn ort(model: &Path, inputs: &[(&str, &Path)], output: &str) -> npy::Array {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("vnpu-ort-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join(model.file_stem().unwrap());
    let py = root().join(".venv-onnx/bin/python");
    let mut cmd = Command::new(&py);
    cmd.arg(root().join("scripts/ort_ref.py")).arg(model).arg(&prefix);
    for (n, p) in inputs {
        cmd.arg(format!("{n}={}", p.display()));
    }
    let out = cmd
        .args(["--output", output])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (bash scripts/setup.sh installs it): {e}", py.display()));
    assert!(out.status.success(), "ort_ref.py failed: {}", String::from_utf8_lossy(&out.stderr));
    let file: String = output
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || ".-_".contains(c) { c } else { '_' })
        .collect();
    let array = npy::read_file(&PathBuf::from(format!("{}.{file}.npy", prefix.display()))).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    array
}

/// Max absolute error, max relative error (|d| / max(|ref|, 1e-6)); NaN
/// anywhere gives NaN.
fn errors(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len());
    let mut abs = 0f64;
    let mut rel = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        let d = (f64::from(g) - f64::from(w)).abs();
        if d.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        abs = abs.max(d);
        rel = rel.max(d / f64::from(w).abs().max(1e-6));
    }
    (abs, rel)
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] || x.is_nan() { i } else { b })
}

/// Compiles `model` for `sa` SAs and `vu` VUs at the batch of `x` (its
/// leading dimension) and runs it in-process on `x`.
fn compile_and_run(
    model: &Path,
    x: &npy::Array,
    sa: u32,
    vu: u32,
    outputs: Option<&str>,
) -> (Compiled, Vec<f32>) {
    compile_and_run_as(model, x, sa, vu, outputs, DType::F32)
}

/// [`compile_and_run`] with the SA's operands in `dtype`.
fn compile_and_run_as(
    model: &Path,
    x: &npy::Array,
    sa: u32,
    vu: u32,
    outputs: Option<&str>,
    dtype: DType,
) -> (Compiled, Vec<f32>) {
    compile_and_run_inputs(model, &[x], sa, vu, outputs, (dtype, false))
}

/// [`compile_and_run_as`] for a model of several inputs, `xs` in its input
/// order; the batch is the first's leading dimension.
fn compile_and_run_inputs(
    model: &Path,
    xs: &[&npy::Array],
    sa: u32,
    vu: u32,
    outputs: Option<&str>,
    (dtype, bf16_activations): (DType, bool),
) -> (Compiled, Vec<f32>) {
    let board = BoardConfig::default();
    let opts = CompileOptions {
        shape: shape(&board, sa, vu),
        batch: xs[0].shape[0] as u32,
        shapes: HashMap::new(),
        outputs: outputs.map(|o| vec![o.to_string()]),
        dtype,
        bf16_activations,
        spread: None,
        reuse_hbm: true,
        fuse_residual: true,
        fuse_blocks: true,
    };
    let c =
        compile(&std::fs::read(model).unwrap(), &opts).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    let data: Vec<&[f32]> = xs.iter().map(|x| &x.data[..]).collect();
    let (mut outs, _) = r.infer(&data).unwrap();
    (c, outs.swap_remove(0))
}

/// Compiles `model` for the whole test set as one batch, runs it, and
/// compares with ONNX Runtime and the labels.
fn check_classifier(model: &str, sa: u32, vu: u32) {
    let x = npy::read_file(&fixture("digits-x.npy")).unwrap();
    let y = npy::read_file(&fixture("digits-y.npy")).unwrap();
    let n = x.shape[0] as usize;
    let (_, got) = compile_and_run(&fixture(model), &x, sa, vu, Some("probabilities"));
    let want = ort(&fixture(model), &[("X", &fixture("digits-x.npy"))], "probabilities");
    assert_eq!(want.shape, vec![n as u64, 10]);
    let (abs, rel) = errors(&got, &want.data);
    let classes = 10;
    let agree = (0..n)
        .filter(|&i| argmax(&got[i * classes..][..classes]) == argmax(&want.data[i * classes..][..classes]))
        .count();
    let correct = (0..n).filter(|&i| argmax(&got[i * classes..][..classes]) == y.data[i] as usize).count();
    println!("{model} {sa}sa{vu}vu: max abs {abs:.3e} max rel {rel:.3e} top-1 agree {agree}/{n} correct {correct}/{n}");
    assert!(abs <= 1e-5, "{model}: max abs error {abs} against ONNX Runtime");
    assert!(rel <= 1e-4, "{model}: max relative error {rel} against ONNX Runtime");
    assert_eq!(agree, n, "{model}: top-1 differs from ONNX Runtime");
    assert!(correct * 100 >= n * 95, "{model}: accuracy {correct}/{n}");
}

#[test]
fn digits_mlp_relu_matches_onnx_runtime() {
    check_classifier("digits-mlp.onnx", 1, 1);
}

#[test]
fn digits_mlp_tanh_matches_onnx_runtime_on_two_engines_each() {
    check_classifier("digits-mlp2.onnx", 2, 2);
}

/// Max absolute error and max relative error where an element's
/// denominator is at least 1e-3 of the output's largest magnitude (outputs
/// of convolutions cross zero, where an element-wise relative error means
/// nothing); NaN anywhere gives NaN.
fn scaled_errors(got: &[f32], want: &[f32]) -> (f64, f64) {
    let scale = want.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs()));
    let floor = (scale * 1e-3).max(1e-30);
    let (abs, _) = errors(got, want);
    let rel = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - f64::from(w)).abs() / f64::from(w).abs().max(floor))
        .fold(0f64, |m, r| if r.is_nan() || m.is_nan() { f64::NAN } else { m.max(r) });
    (abs, rel)
}

/// An operator test model of tests/fixtures/onnx/ops (scripts/onnx_ops.py)
/// on its input, against ONNX Runtime.
fn check_ops(name: &str, sa: u32, vu: u32) {
    check_ops_inputs(name, &["x"], sa, vu);
}

/// [`check_ops`] for a model with the inputs `inputs`, in the model's
/// order, each in `ops/<name>-<input>.npy`; the batch is the first's
/// leading dimension.
fn check_ops_inputs(name: &str, inputs: &[&str], sa: u32, vu: u32) {
    let model = fixture(&format!("ops/{name}.onnx"));
    let paths: Vec<PathBuf> = inputs.iter().map(|i| fixture(&format!("ops/{name}-{i}.npy"))).collect();
    let xs: Vec<npy::Array> = paths.iter().map(|p| npy::read_file(p).unwrap()).collect();
    let refs: Vec<&npy::Array> = xs.iter().collect();
    let (c, got) = compile_and_run_inputs(&model, &refs, sa, vu, None, (DType::F32, false));
    let names: Vec<&str> = c.model.inputs.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, inputs, "{name}: the compiled model's inputs");
    let out = c.model.outputs[0].clone();
    let feeds: Vec<(&str, &Path)> = inputs.iter().copied().zip(paths.iter().map(PathBuf::as_path)).collect();
    let want = ort(&model, &feeds, &out.name);
    assert_eq!(want.shape, out.dims, "{name}: output shape");
    let (abs, rel) = scaled_errors(&got, &want.data);
    println!("{name} {sa}sa{vu}vu: max abs {abs:.3e} max rel {rel:.3e} ({:?})", c.report.ops);
    assert!(rel <= 1e-4, "{name}: max relative error {rel} (abs {abs}) against ONNX Runtime");
}

/// Token ids in (int64, as `transformers` exports them): word embeddings
/// gathered by them (directly, and through a Reshape of the ids), position
/// embeddings by constant positions, a layer norm and a projection, against
/// ONNX Runtime; the compiled input is int64 (i32 in the window). An id
/// outside the table fails the request instead of reading past it.
#[test]
fn token_ids_gather_embeddings_as_onnx_runtime_does() {
    check_ops_inputs("token-embedding", &["ids"], 1, 1);
    check_ops_inputs("token-embedding", &["ids"], 2, 2);
    let model = fixture("ops/token-embedding.onnx");
    let ids = npy::read_file(&fixture("ops/token-embedding-ids.npy")).unwrap();
    let board = BoardConfig::default();
    let opts = CompileOptions {
        shape: shape(&board, 1, 1),
        batch: ids.shape[0] as u32,
        shapes: HashMap::new(),
        outputs: None,
        dtype: DType::F32,
        bf16_activations: false,
        spread: None,
        reuse_hbm: true,
        fuse_residual: true,
        fuse_blocks: true,
    };
    let c = compile(&std::fs::read(&model).unwrap(), &opts).unwrap();
    assert_eq!(c.model.inputs[0].elem, vnpu_abi::compiled_model::ElemType::I64);
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    for bad in [50.0f32, -1.0] {
        let mut x = ids.data.clone();
        x[4] = bad;
        let e = r.infer(&[&x]).expect_err("an id outside the table").to_string();
        assert!(e.contains("index"), "{bad}: {e}");
    }
    // The runner still answers.
    assert!(r.infer(&[&ids.data]).is_ok());
}

/// An attention mask as `transformers` exports it: int64 ids cast to
/// int32 and gathered by, an int64 mask cast to float on the device
/// (`vu.unary i32_to_f32`) and made an additive bias, softmax attention.
#[test]
fn an_integer_attention_mask_cast_to_float_matches_onnx_runtime() {
    check_ops_inputs("token-mask", &["ids", "mask"], 1, 1);
}

/// Comparisons, logic, `Where`, `IsNaN`, `IsInf` and casts to bool on
/// computed tensors (`vu.binary` eq/lt/.../keep), at the comparisons'
/// boundaries, against ONNX Runtime.
#[test]
fn comparisons_logic_and_where_match_onnx_runtime() {
    check_ops("logic-ops", 1, 1);
    check_ops("logic-ops", 2, 2);
}

/// A `transformers` text model (scripts/hf_models.py: small configs built
/// in code, seeded random weights, exported by `torch.onnx.export` with
/// its weights in an external data file), compiled from its file with
/// int64 token ids and attention mask in (the second sequence padded),
/// run in-process, against ONNX Runtime: max abs error, that error
/// relative to the output's scale (its largest magnitude), argmax
/// agreement over the last axis.
fn check_text_model(name: &str, sa: u32, vu: u32) -> (f64, f64, usize, usize) {
    let model = fixture(&format!("hf/{name}.onnx"));
    let inputs = ["input_ids", "attention_mask"];
    let paths: Vec<PathBuf> = inputs.iter().map(|i| fixture(&format!("hf/{name}-{i}.npy"))).collect();
    let xs: Vec<npy::Array> = paths.iter().map(|p| npy::read_file(p).unwrap()).collect();
    let board = BoardConfig::default();
    let opts = CompileOptions {
        shape: shape(&board, sa, vu),
        batch: xs[0].shape[0] as u32,
        shapes: HashMap::new(),
        outputs: None,
        dtype: DType::F32,
        bf16_activations: false,
        spread: None,
        reuse_hbm: true,
        fuse_residual: true,
        fuse_blocks: true,
    };
    let c = npu_onnx::compile_file(&model, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    for t in &c.model.inputs {
        assert_eq!(t.elem, vnpu_abi::compiled_model::ElemType::I64, "{name}: input {} is int64", t.name);
    }
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    let data: Vec<&[f32]> = xs.iter().map(|x| &x.data[..]).collect();
    let (outs, _) = r.infer(&data).unwrap();
    let out = c.model.outputs[0].clone();
    let feeds: Vec<(&str, &Path)> = inputs.iter().copied().zip(paths.iter().map(PathBuf::as_path)).collect();
    let want = ort(&model, &feeds, &out.name);
    assert_eq!(want.shape, out.dims, "{name}: output shape");
    let common::Agreement { abs, scale, agree, rows } =
        common::agreement(&outs[0], &want.data, *out.dims.last().unwrap() as usize);
    let scaled = abs / scale;
    println!(
        "{name} {sa}sa{vu}vu: max abs {abs:.3e}, of the scale ({scale:.3}) {scaled:.3e}, argmax {agree}/{rows} \
         ({} nodes: {:?})",
        c.report.nodes,
        c.report.ops
    );
    (abs, scaled, agree, rows)
}

/// BERT, DistilBERT and GPT-2 as `transformers` and `torch.onnx.export`
/// give them: within 1e-5 of ONNX Runtime's outputs relative to their
/// scale, every argmax the same.
#[test]
fn transformers_text_models_match_onnx_runtime() {
    for (name, sa, vu) in [("bert", 1, 1), ("distilbert", 2, 2), ("gpt2", 1, 1)] {
        let (abs, scaled, agree, rows) = check_text_model(name, sa, vu);
        assert!(scaled <= 1e-5, "{name}: error {scaled} of the output's scale (max abs {abs})");
        assert_eq!(agree, rows, "{name}: argmax agreement");
    }
}

/// Multi-query attention (keys and values of one head broadcast over four
/// by the batched products) with an additive padding mask computed from a
/// second input and a constant causal mask of -inf.
#[test]
fn masked_multi_query_attention_matches_onnx_runtime() {
    check_ops_inputs("masked-attention", &["x", "m"], 1, 1);
    check_ops_inputs("masked-attention", &["x", "m"], 2, 2);
}

#[test]
fn decoder_with_transposed_convs_concat_pad_resize_slice_matches_onnx_runtime() {
    check_ops("decoder", 1, 1);
}

#[test]
fn pad_in_reflect_edge_and_wrap_mode_and_reversing_slices_match_onnx_runtime() {
    check_ops("pad-slice-modes", 1, 1);
    check_ops("pad-slice-modes", 2, 2);
}

#[test]
fn decoder_matches_onnx_runtime_on_four_engines_each() {
    check_ops("decoder", 4, 4);
}

#[test]
fn resize_in_every_mode_matches_onnx_runtime() {
    check_ops("resize-modes", 1, 1);
}

#[test]
fn decomposed_layer_norm_and_broadcasting_match_onnx_runtime() {
    check_ops("layernorm-decomposed", 2, 2);
}

#[test]
fn transposed_operands_of_element_wise_operations_match_onnx_runtime() {
    check_ops("transposed-operands", 1, 1);
}

#[test]
fn conv_batchnorm_relu6_matches_onnx_runtime() {
    check_ops("conv-bn-relu6", 1, 1);
}

#[test]
fn depthwise_with_row_stride_and_hardswish_matches_onnx_runtime() {
    check_ops("dw-hardswish", 1, 1);
}

#[test]
fn grouped_conv_and_pooling_match_onnx_runtime() {
    check_ops("group-pool", 2, 2);
}

#[test]
fn squeeze_excitation_head_matches_onnx_runtime() {
    check_ops("se-head", 1, 1);
}

#[test]
fn per_channel_constants_match_onnx_runtime() {
    check_ops("channel-consts", 4, 4);
}

/// A PyTorch-trained classifier of tests/fixtures/onnx/torch
/// (scripts/train_torch.py) on the 450 test images as one batch. Logits
/// against the float64 result of onnx's reference evaluator (the exact
/// math: the 1e-4 target) and against ONNX Runtime, which is f32 too and
/// itself differs from the exact result: the vNPU may differ from it by
/// 1e-4 or by twice ONNX Runtime's own error, whichever is larger. Top-1
/// against ONNX Runtime and the labels.
fn check_torch(name: &str, input: &str, sa: u32, vu: u32) {
    let model = fixture(&format!("torch/{name}.onnx"));
    let xp = fixture(&format!("torch/{input}"));
    let x = npy::read_file(&xp).unwrap();
    let y = npy::read_file(&fixture("digits-y.npy")).unwrap();
    let n = x.shape[0] as usize;
    let (c, got) = compile_and_run(&model, &x, sa, vu, None);
    let want = ort(&model, &[("x", &xp)], "logits");
    assert_eq!(want.shape, vec![n as u64, 10], "{name}: output shape");
    let exact = npy::read_file(&fixture(&format!("torch/{name}-f64.npy"))).unwrap();
    assert_eq!(exact.shape, want.shape, "{name}: reference shape");
    let (abs, rel) = scaled_errors(&got, &want.data);
    let (abs64, rel64) = scaled_errors(&got, &exact.data);
    let (_, ort64) = scaled_errors(&want.data, &exact.data);
    let top = |v: &[f32], i: usize| argmax(&v[i * 10..][..10]);
    let agree = (0..n).filter(|&i| top(&got, i) == top(&want.data, i)).count();
    let correct = (0..n).filter(|&i| top(&got, i) == y.data[i] as usize).count();
    println!(
        "{name} {sa}sa{vu}vu: against f64 max abs {abs64:.3e} max rel {rel64:.3e}; against ORT max abs {abs:.3e} \
         max rel {rel:.3e} (ORT against f64: {ort64:.3e}); top-1 agree {agree}/{n} correct {correct}/{n} ({:?})",
        c.report.ops
    );
    assert!(rel64 <= 1e-4, "{name}: max relative error {rel64} (abs {abs64}) against the float64 result");
    let bound = 1e-4f64.max(2.0 * ort64);
    assert!(
        rel <= bound,
        "{name}: max relative error {rel} (abs {abs}) against ONNX Runtime (bound {bound})"
    );
    assert_eq!(agree, n, "{name}: top-1 differs from ONNX Runtime");
    assert!(correct * 100 >= n * 93, "{name}: accuracy {correct}/{n}");
}

#[test]
fn pytorch_cnn_matches_onnx_runtime() {
    check_torch("digits-cnn", "digits-img-x.npy", 2, 2);
}

#[test]
fn pytorch_transformer_encoder_matches_onnx_runtime() {
    check_torch("digits-transformer", "digits-seq-x.npy", 1, 1);
}

#[test]
fn pytorch_transformer_encoder_matches_onnx_runtime_on_four_engines_each() {
    check_torch("digits-transformer", "digits-seq-x.npy", 4, 4);
}

/// Every test model compiled with bf16 SA operands, against the f64
/// result where there is one (else ONNX Runtime): the scaled error stays
/// within the documented bound (docs/compiled-model-format.md, "bf16") and top-1
/// agrees with ONNX Runtime on nearly every classifier input.
#[test]
fn bf16_models_stay_within_the_documented_bound() {
    let digits = fixture("digits-x.npy");
    let labels = npy::read_file(&fixture("digits-y.npy")).unwrap();
    let cases: Vec<(String, PathBuf, PathBuf, &str, Option<PathBuf>)> = vec![
        ("digits-mlp".into(), fixture("digits-mlp.onnx"), digits.clone(), "X", None),
        ("digits-mlp2".into(), fixture("digits-mlp2.onnx"), digits.clone(), "X", None),
        (
            "digits-cnn".into(),
            fixture("torch/digits-cnn.onnx"),
            fixture("torch/digits-img-x.npy"),
            "x",
            Some(fixture("torch/digits-cnn-f64.npy")),
        ),
        (
            "digits-transformer".into(),
            fixture("torch/digits-transformer.onnx"),
            fixture("torch/digits-seq-x.npy"),
            "x",
            Some(fixture("torch/digits-transformer-f64.npy")),
        ),
    ];
    for ((name, model, xp, input, exact), acts) in cases.iter().flat_map(|c| [(c, false), (c, true)]) {
        let (name, exact) =
            (format!("{name}{}", if acts { " +bf16 activations" } else { "" }), exact.clone());
        let x = npy::read_file(xp).unwrap();
        let classifier = name.starts_with("digits-mlp");
        let out = if classifier { Some("probabilities") } else { None };
        let (c, got) = compile_and_run_inputs(model, &[&x], 1, 1, out, (DType::Bf16, acts));
        assert_eq!(c.model.target.sa_dtype, DType::Bf16, "{name}");
        let (f32c, _) = compile_and_run(model, &x, 1, 1, out);
        let oname = c.model.outputs[0].name.clone();
        let want = ort(model, &[(input, xp)], &oname);
        let reference = match &exact {
            Some(p) => npy::read_file(p).unwrap().data,
            None => want.data.clone(),
        };
        let (abs, _) = errors(&got, &reference);
        let (_, rel) = scaled_errors(&got, &reference);
        let norm = abs / reference.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs()));
        let n = x.shape[0] as usize;
        let k = got.len() / n;
        let top = |v: &[f32], i: usize| argmax(&v[i * k..][..k]);
        let agree = (0..n).filter(|&i| top(&got, i) == top(&want.data, i)).count();
        let correct = (0..n).filter(|&i| top(&got, i) == labels.data[i] as usize).count();
        println!(
            "{name} bf16: max abs {abs:.3e}, normwise {norm:.3e}, scaled rel {rel:.3e} against {}; top-1 agree {agree}/{n}, \
             correct {correct}/{n}; weights {} B (f32 {} B)",
            if exact.is_some() { "f64" } else { "ORT" },
            c.report.weight_bytes,
            f32c.report.weight_bytes
        );
        assert!(norm <= BF16_BOUND, "{name}: normwise error {norm} above the bf16 bound {BF16_BOUND}");
        assert!(agree * 100 >= n * 99, "{name}: top-1 agrees with ONNX Runtime on {agree}/{n}");
        // The product weights are half their f32 size (the transformer's
        // position embedding is a VU operand and stays f32).
        assert!(c.report.weight_bytes < f32c.report.weight_bytes, "{name}: weights not smaller");
    }
}

/// The documented end-to-end bound on the normwise error (largest absolute
/// error over the largest reference magnitude) of the test models compiled
/// with bf16 SA operands: 2^-5, four times a single product's 2u
/// (docs/compiled-model-format.md, "bf16").
const BF16_BOUND: f64 = 0.03125;

/// `ArgMax` (the first of tied maxima) and `ArgMin` with
/// `select_last_index` (the last of tied minima) over rows with many
/// ties and one all equal, as int64 outputs, against ONNX Runtime: the
/// compiled output is int64 and every index is the same.
#[test]
fn argmax_and_argmin_give_onnx_runtimes_indices() {
    for name in ["argmax", "argmin-last"] {
        let model = fixture(&format!("ops/{name}.onnx"));
        let x = npy::read_file(&fixture(&format!("ops/{name}-x.npy"))).unwrap();
        let (c, got) = compile_and_run(&model, &x, 1, 1, None);
        assert_eq!(c.model.outputs[0].elem, vnpu_abi::compiled_model::ElemType::I64, "{name}");
        let out = c.model.outputs[0].clone();
        let want = ort(&model, &[("x", &fixture(&format!("ops/{name}-x.npy")))], &out.name);
        let want: Vec<f32> = want.ints.as_ref().unwrap().iter().map(|&v| v as f32).collect();
        println!("{name}: {got:?}");
        assert_eq!(got, want, "{name}: indices against ONNX Runtime");
    }
}

/// `TopK` (K = 4 of 10) over rows with ties, a row all equal and
/// infinities: the int64 indices of the largest (the first of equal ones)
/// and the values of the smallest, against ONNX Runtime.
#[test]
fn top_k_gives_onnx_runtimes_indices_and_values() {
    let model = fixture("ops/topk-indices.onnx");
    let x = npy::read_file(&fixture("ops/topk-indices-x.npy")).unwrap();
    let (c, got) = compile_and_run(&model, &x, 1, 1, None);
    let out = c.model.outputs[0].clone();
    assert_eq!(out.elem, vnpu_abi::compiled_model::ElemType::I64);
    let want = ort(&model, &[("x", &fixture("ops/topk-indices-x.npy"))], &out.name);
    let want: Vec<f32> = want.ints.as_ref().unwrap().iter().map(|&v| v as f32).collect();
    assert_eq!(got, want, "indices");
    let model = fixture("ops/topk-smallest.onnx");
    let x = npy::read_file(&fixture("ops/topk-smallest-x.npy")).unwrap();
    let (c, got) = compile_and_run(&model, &x, 1, 1, None);
    let want = ort(&model, &[("x", &fixture("ops/topk-smallest-x.npy"))], &c.model.outputs[0].name);
    assert_eq!(got, want.data, "values");
}

/// The CNN and the transformer compiled as spread programs (1 SA + 1 VU of
/// their own, lowered for 3 more of each) give the float64 result within
/// the same bound on every number of engines the board may give them,
/// bit for bit the same outputs on each (the compiled programs are
/// race-free), and take less time with more engines.
#[test]
fn spread_models_give_the_same_results_on_any_engines() {
    let board = BoardConfig::default();
    for (name, input) in [("digits-cnn", "digits-img-x.npy"), ("digits-transformer", "digits-seq-x.npy")] {
        let model = fixture(&format!("torch/{name}.onnx"));
        let x = npy::read_file(&fixture(&format!("torch/{input}"))).unwrap();
        let exact = npy::read_file(&fixture(&format!("torch/{name}-f64.npy"))).unwrap();
        let opts = CompileOptions {
            shape: shape(&board, 1, 1),
            batch: x.shape[0] as u32,
            shapes: HashMap::new(),
            outputs: None,
            dtype: DType::F32,
            bf16_activations: false,
            spread: Some((3, 3)),
            reuse_hbm: true,
            fuse_residual: true,
            fuse_blocks: true,
        };
        let c = compile(&std::fs::read(&model).unwrap(), &opts).unwrap();
        assert!(c.model.infer.spread && c.model.load.spread);
        assert_eq!((c.model.target.sa, c.model.target.vu), (1, 1));
        assert_eq!(c.model.infer.compute_streams(), (4, 4), "{name}");
        let mut runs: Vec<([u32; 2], Vec<f32>, f64)> = Vec::new();
        for engines in [[1, 1], [2, 2], [1, 4], [4, 4]] {
            let mut r = HostRunner::new(&board, &c.model).unwrap();
            r.on_engines(engines);
            let (mut outs, report) = r.infer(&[&x.data]).unwrap();
            runs.push((engines, outs.swap_remove(0), report.cycles));
        }
        // Not spread, lowered for its own engine of each kind.
        let plain =
            compile(&std::fs::read(&model).unwrap(), &CompileOptions { spread: None, ..opts }).unwrap();
        let (_, plain) = HostRunner::new(&board, &plain.model).unwrap().infer(&[&x.data]).unwrap();
        let one = runs[0].2;
        println!(
            "{name} not spread on 1+1: {:.0} cycles ({:.2}x spread on 1+1)",
            plain.cycles,
            plain.cycles / one
        );
        for (engines, got, cycles) in &runs {
            let (abs, rel) = scaled_errors(got, &exact.data);
            println!(
                "{name} spread on {engines:?}: {cycles:.0} cycles ({:.2}x on 1+1); against f64 max abs {abs:.3e} max rel {rel:.3e}",
                cycles / one
            );
            assert!(rel <= 1e-4, "{name} on {engines:?}: max relative error {rel} against float64");
            let same = got.iter().zip(&runs[0].1).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: outputs on {engines:?} differ from those on one engine of each");
        }
        assert!(runs[3].2 < runs[1].2 && runs[1].2 < runs[0].2, "{name}: more engines, no faster: {runs:?}");
    }
}
