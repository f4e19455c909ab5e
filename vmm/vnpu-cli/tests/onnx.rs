//! Bring your own model, end to end as a user runs it: `vnpu compile` an
//! ONNX model trained by scikit-learn, `vnpu infer` it in a VM (the runner
//! guest, the driver, the ring, the verifier, the model, MSI-X), and check
//! the outputs against ONNX Runtime (scripts/ort_ref.py in .venv-onnx,
//! installed by scripts/setup.sh) and the test labels.
//!
//! Needs /dev/kvm and the guests built (scripts/build-guests.sh).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use npu_onnx::npy;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> String {
    root().join("tests/fixtures/onnx").join(name).display().to_string()
}

fn vnpu(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vnpu")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn tmp(name: &str) -> String {
    let d = std::env::temp_dir().join(format!("vnpu-onnx-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name).display().to_string()
}

/// ONNX Runtime's output `output` of `model` on `input` (`NAME=FILE`).
///
/// Each call has a file name of its own: tests run in parallel threads of
/// one process and two of them run ONNX Runtime on the same model (the
/// f32 and bf16 CNN tests), so a name per model let one read the `.npy`
/// file the other was still writing.
fn ort(model: &str, input: &str, output: &str) -> npy::Array {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let prefix = tmp(&format!("ort-{call}-{}", Path::new(model).file_stem().unwrap().to_string_lossy()));
    let py = root().join(".venv-onnx/bin/python");
    let out = Command::new(&py)
        .arg(root().join("scripts/ort_ref.py"))
        .args([model, &prefix, input, "--output", output])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (bash scripts/setup.sh installs it): {e}", py.display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // ort_ref.py's file name for the output (docs in the script).
    let file: String = output
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || ".-_".contains(c) { c } else { '_' })
        .collect();
    npy::read_file(Path::new(&format!("{prefix}.{file}.npy"))).unwrap()
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] || x.is_nan() { i } else { b })
}

/// Compiles `model` at `batch`, runs all 450 test images through a VM
/// (450 / batch requests), and checks every output against ONNX Runtime
/// and the labels; the in-process run must give the same bits.
fn end_to_end(model: &str, vnpu_spec: &str, batch: u32) {
    let m = fixture(model);
    let art = tmp(&format!("{model}.{batch}.vnpu"));
    let b = batch.to_string();
    let (code, out, err) =
        vnpu(&["compile", &m, "--vnpu", vnpu_spec, "--batch", &b, "--output", "probabilities", "-o", &art]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("output        probabilities f32"), "{out}");
    let got_path = tmp(&format!("{model}.{batch}.out.npy"));
    let (code, out, err) =
        vnpu(&["infer", &art, "--input", &fixture("digits-x.npy"), "--output", &got_path, "--show", "1"]);
    assert_eq!(code, 0, "{out}{err}");
    let runs = 450 / batch;
    assert!(out.contains(&format!("infer: {runs} batches of {batch} done")), "{out}");
    assert!(out.contains("simulated NPU time"), "{out}");
    let got = npy::read_file(Path::new(&got_path)).unwrap();
    let want = ort(&m, &format!("X={}", fixture("digits-x.npy")), "probabilities");
    assert_eq!(got.shape, vec![450, 10]);
    assert_eq!(got.shape, want.shape);
    let (mut abs, mut rel) = (0f64, 0f64);
    for (&g, &w) in got.data.iter().zip(&want.data) {
        let d = (f64::from(g) - f64::from(w)).abs();
        assert!(!d.is_nan(), "{model}: NaN in the output");
        abs = abs.max(d);
        rel = rel.max(d / f64::from(w).abs().max(1e-6));
    }
    let y = npy::read_file(Path::new(&fixture("digits-y.npy"))).unwrap();
    let rows = |v: &[f32], i: usize| argmax(&v[i * 10..(i + 1) * 10]);
    let agree = (0..450).filter(|&i| rows(&got.data, i) == rows(&want.data, i)).count();
    let correct = (0..450).filter(|&i| rows(&got.data, i) == y.data[i] as usize).count();
    println!("{model} batch {batch} via VM: max abs {abs:.3e} rel {rel:.3e} top-1 agree {agree}/450 correct {correct}/450");
    assert!(abs <= 1e-5 && rel <= 1e-4, "{model}: error {abs} / {rel} against ONNX Runtime");
    assert_eq!(agree, 450, "{model}: top-1 differs from ONNX Runtime");
    assert!(correct >= 430, "{model}: {correct}/450 correct");
    // The in-process run of the same file gives the same bits.
    let host_path = tmp(&format!("{model}.{batch}.host.npy"));
    let (code, out, err) =
        vnpu(&["infer", &art, "--input", &fixture("digits-x.npy"), "--in-process", "--output", &host_path]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(npy::read_file(Path::new(&host_path)).unwrap(), got, "{model}: VM and in-process differ");
}

#[test]
fn scikit_learn_relu_mlp_runs_in_a_vm_and_matches_onnx_runtime() {
    end_to_end("digits-mlp.onnx", "sa=1,vu=1,sram=8M,hbm=512M", 450);
}

#[test]
fn scikit_learn_tanh_mlp_runs_batch_by_batch_on_a_larger_vnpu() {
    end_to_end("digits-mlp2.onnx", "sa=2,vu=2,sram=8M,hbm=512M", 50);
}

#[test]
fn unsupported_operators_and_bad_files_are_refused_with_reasons() {
    let art = tmp("refused.vnpu");
    // The label output's ai.onnx.ml operator compiles (docs/compiled-model-format.md,
    // "scikit-learn models"); the same model with that operator renamed to
    // one nobody defines is refused by name, with the way around it.
    let (code, out, err) = vnpu(&["compile", &fixture("digits-mlp.onnx"), "-o", &art]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("label int64"), "{out}");
    let mut bytes = std::fs::read(fixture("digits-mlp.onnx")).unwrap();
    let (from, to) = (b"ArrayFeatureExtractor", b"ArrayFeatureExtractoX");
    // The node's name and its op type (same length: the protobuf stays valid).
    while let Some(at) = bytes.windows(from.len()).position(|w| w == from) {
        bytes[at..at + to.len()].copy_from_slice(to);
    }
    let renamed = tmp("renamed.onnx");
    std::fs::write(&renamed, &bytes).unwrap();
    let (code, _, err) = vnpu(&["compile", &renamed, "-o", &art]);
    assert_ne!(code, 0);
    assert!(
        err.contains("node `") && err.contains("ArrayFeatureExtractoX") && err.contains("--output"),
        "{err}"
    );
    // An element type the SA does not have.
    let (code, _, err) = vnpu(&["compile", &fixture("digits-mlp.onnx"), "--dtype", "f16", "-o", &art]);
    assert_ne!(code, 0);
    assert!(err.contains("--dtype f16: expected f32 or bf16"), "{err}");
    // Not ONNX at all.
    let (code, _, err) = vnpu(&["compile", &fixture("digits-x.npy"), "-o", &art]);
    assert_ne!(code, 0);
    assert!(err.contains("not an ONNX model") || err.contains("no graph"), "{err}");
    // A compiled model file that is not one.
    let (code, _, err) = vnpu(&["infer", &fixture("digits-x.npy"), "--input", &fixture("digits-x.npy")]);
    assert_ne!(code, 0);
    assert!(err.contains("bad magic"), "{err}");
    // Inputs of the wrong shape.
    let (code, out, err) = vnpu(&[
        "compile",
        &fixture("digits-mlp.onnx"),
        "--output",
        "probabilities",
        "--batch",
        "7",
        "-o",
        &art,
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = vnpu(&["infer", &art, "--input", &fixture("digits-x.npy")]);
    assert_ne!(code, 0);
    assert!(err.contains("multiple of 7"), "{err}");
    // A vNPU smaller than the model was compiled for: the runner refuses.
    let (code, out, err) = vnpu(&[
        "compile",
        &fixture("digits-mlp.onnx"),
        "--output",
        "probabilities",
        "--vnpu",
        "sa=2,vu=2,sram=8M,hbm=512M",
        "-o",
        &art,
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let x1 = tmp("x1.npy");
    let x = npy::read_file(Path::new(&fixture("digits-x.npy"))).unwrap();
    npy::write_file(Path::new(&x1), &npy::Array::floats(vec![1, 64], x.data[..64].to_vec())).unwrap();
    let (code, out, err) = vnpu(&["infer", &art, "--input", &x1, "--vnpu", "sa=1,vu=1,sram=8M,hbm=512M"]);
    assert_ne!(code, 0);
    assert!(err.contains("compiled for 2 SA") && out.contains("infer:"), "{out}{err}");
}

/// Max scaled relative error of `got` against `want` (denominators at least
/// 1e-3 of the largest `|want|`: logits cross zero); NaN fails.
fn scaled_rel(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs()));
    let mut rel = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        let d = (f64::from(g) - f64::from(w)).abs();
        assert!(!d.is_nan(), "{what}: NaN");
        rel = rel.max(d / f64::from(w).abs().max(scale * 1e-3));
    }
    rel
}

/// `vnpu compile` `model` for `vnpu_spec` at `batch`, then `vnpu infer` it
/// in a VM on input `x` (`NAME=FILE`): both commands' output and the
/// outputs read back.
fn compile_and_infer(
    model: &str,
    x: &str,
    vnpu_spec: &str,
    batch: u32,
    tag: &str,
) -> (String, String, npy::Array) {
    let art = tmp(&format!("{tag}.vnpu"));
    let b = batch.to_string();
    let (code, compiled, err) = vnpu(&["compile", model, "--vnpu", vnpu_spec, "--batch", &b, "-o", &art]);
    assert_eq!(code, 0, "{compiled}{err}");
    let got_path = tmp(&format!("{tag}.out.npy"));
    let (code, out, err) = vnpu(&["infer", &art, "--input", x, "--output", &got_path]);
    assert_eq!(code, 0, "{out}{err}");
    let got = npy::read_file(Path::new(&got_path)).unwrap();
    (compiled, out, got)
}

/// An operator test model of tests/fixtures/onnx/ops (a small CNN with
/// random weights, scripts/onnx_ops.py) compiled at `batch`, run through a
/// VM on its input, and checked against ONNX Runtime.
fn cnn_end_to_end(name: &str, vnpu_spec: &str, batch: u32) {
    ops_end_to_end(name, "x", vnpu_spec, batch);
}

/// [`cnn_end_to_end`] for a model whose one input is `input`
/// (`ops/<name>-<input>.npy`).
fn ops_end_to_end(name: &str, input: &str, vnpu_spec: &str, batch: u32) {
    let m = fixture(&format!("ops/{name}.onnx"));
    let x = fixture(&format!("ops/{name}-{input}.npy"));
    let (_, out, got) = compile_and_infer(&m, &format!("{input}={x}"), vnpu_spec, batch, name);
    let output = out
        .lines()
        .find_map(|l| l.strip_prefix("wrote         ").filter(|r| r.contains(&format!("{name}.out.npy"))))
        .and_then(|r| r.rsplit_once(" (").map(|(_, o)| o.trim_end_matches(')').to_string()))
        .unwrap_or_else(|| panic!("{name}: no output name in {out}"));
    let want = ort(&m, &format!("{input}={x}"), &output);
    assert_eq!(got.shape, want.shape, "{name}");
    let rel = scaled_rel(name, &got.data, &want.data);
    println!("{name} batch {batch} via VM: max rel {rel:.3e}");
    assert!(rel <= 1e-4, "{name}: relative error {rel} against ONNX Runtime");
}

#[test]
fn a_cnn_with_squeeze_excitation_runs_in_a_vm_and_matches_onnx_runtime() {
    cnn_end_to_end("se-head", "sa=1,vu=1,sram=8M,hbm=512M", 1);
}

/// Token ids (an int64 `.npy`, as `transformers` takes them) through
/// `vnpu compile` and `vnpu infer` in a VM: embeddings gathered by them,
/// against ONNX Runtime.
#[test]
fn token_ids_run_in_a_vm_and_match_onnx_runtime() {
    ops_end_to_end("token-embedding", "ids", "sa=1,vu=1,sram=8M,hbm=512M", 1);
}

/// An int64 output (ArgMax's indices) through `vnpu infer` in a VM:
/// written as an int64 `.npy`, equal to ONNX Runtime's.
#[test]
fn argmax_indices_come_out_of_a_vm_as_int64() {
    let m = fixture("ops/argmax.onnx");
    let x = fixture("ops/argmax-x.npy");
    let (_, out, got) = compile_and_infer(&m, &format!("x={x}"), "sa=1,vu=1,sram=8M,hbm=512M", 5, "argmax");
    let want = ort(&m, &format!("x={x}"), "argmax_1");
    assert_eq!(got.ints, want.ints, "{out}");
    assert!(got.ints.is_some(), "written as an integer array");
}

/// torchvision's ViT-B/16 as exported (tests/fixtures/onnx/vision, its
/// 346 MB of weights written from a seed by scripts/fill_external.py):
/// `vnpu compile` reads its external data, and `vnpu infer` sizes the VM's
/// memory from the model (a 1.7 GiB job; guests were capped at 1 GiB) and
/// matches ONNX Runtime.
#[test]
fn vit_b_16_runs_in_a_vm_sized_from_the_model() {
    let dir = std::env::temp_dir().join(format!("vnpu-cli-vit-{}", std::process::id()));
    let py = root().join(".venv-onnx/bin/python");
    let out = Command::new(&py)
        .arg(root().join("scripts/fill_external.py"))
        .arg(fixture("vision/vit_b_16.onnx"))
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let m = dir.join("vit_b_16.onnx").display().to_string();
    let x = dir.join("vit_b_16-x.npy").display().to_string();
    let (_, out, got) = compile_and_infer(&m, &format!("x={x}"), "sa=4,vu=4,sram=32M,hbm=4G", 1, "vit_b_16");
    assert!(out.contains("VM"), "{out}");
    let want = ort(&m, &format!("x={x}"), "y");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(got.data.len(), want.data.len());
    let scale = want.data.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs()));
    let abs = got.data.iter().zip(&want.data).fold(0f64, |m, (&g, &w)| {
        let d = (f64::from(g) - f64::from(w)).abs();
        if d.is_nan() || m.is_nan() {
            f64::NAN
        } else {
            m.max(d)
        }
    });
    println!("vit_b_16 via VM: max abs {abs:.3e}, of the output's scale {:.3e}", abs / scale);
    assert!(abs / scale <= 1e-5, "vit_b_16: error {abs} of a scale {scale} against ONNX Runtime");
}

#[test]
fn a_depthwise_hardswish_cnn_runs_in_a_vm_and_matches_onnx_runtime() {
    cnn_end_to_end("dw-hardswish", "sa=2,vu=2,sram=8M,hbm=512M", 1);
}

/// A model trained by PyTorch (scripts/train_torch.py) compiled at batch
/// 50, all 450 test images through a VM, logits against the float64
/// reference (the 1e-4 target) and ONNX Runtime (1e-4 or twice ONNX
/// Runtime's own error against float64, whichever is larger), top-1
/// against ONNX Runtime and the labels. `ops` must appear in the compile
/// report.
fn torch_end_to_end(name: &str, input: &str, vnpu_spec: &str, ops: &[&str]) {
    let m = fixture(&format!("torch/{name}.onnx"));
    let x = fixture(&format!("torch/{input}"));
    let (compiled, out, got) = compile_and_infer(&m, &format!("x={x}"), vnpu_spec, 50, name);
    for op in ops {
        assert!(compiled.contains(op), "{name}: no {op} in {compiled}");
    }
    assert!(out.contains("infer: 9 batches of 50 done"), "{out}");
    let want = ort(&m, &format!("x={x}"), "logits");
    let exact = npy::read_file(Path::new(&fixture(&format!("torch/{name}-f64.npy")))).unwrap();
    assert_eq!(got.shape, vec![450, 10]);
    assert_eq!(want.shape, got.shape);
    let rel64 = scaled_rel("vNPU against f64", &got.data, &exact.data);
    let rel = scaled_rel("vNPU against ORT", &got.data, &want.data);
    let ort64 = scaled_rel("ORT against f64", &want.data, &exact.data);
    let y = npy::read_file(Path::new(&fixture("digits-y.npy"))).unwrap();
    let rows = |v: &[f32], i: usize| argmax(&v[i * 10..(i + 1) * 10]);
    let agree = (0..450).filter(|&i| rows(&got.data, i) == rows(&want.data, i)).count();
    let correct = (0..450).filter(|&i| rows(&got.data, i) == y.data[i] as usize).count();
    println!(
        "{name} via VM: rel {rel64:.3e} against f64, {rel:.3e} against ORT (ORT against f64 {ort64:.3e}); \
         top-1 agree {agree}/450 correct {correct}/450"
    );
    assert!(rel64 <= 1e-4, "{name}: relative error {rel64} against the float64 result");
    assert!(rel <= 1e-4f64.max(2.0 * ort64), "{name}: relative error {rel} against ONNX Runtime");
    assert_eq!(agree, 450, "{name}: top-1 differs from ONNX Runtime");
    assert!(correct >= 420, "{name}: {correct}/450 correct");
}

#[test]
fn a_pytorch_transformer_encoder_runs_in_a_vm_and_matches_onnx_runtime() {
    torch_end_to_end(
        "digits-transformer",
        "digits-seq-x.npy",
        "sa=2,vu=2,sram=8M,hbm=512M",
        &["BatchMatMul", "AddNorm"],
    );
}

#[test]
fn a_pytorch_cnn_runs_in_a_vm_and_matches_onnx_runtime() {
    torch_end_to_end("digits-cnn", "digits-img-x.npy", "sa=1,vu=1,sram=8M,hbm=512M", &["Conv", "GlobalPool"]);
}

/// `vnpu compile --dtype bf16`: the PyTorch CNN with bf16 weights and SA
/// operands, all 450 test images through a VM at batch 50. The logits stay
/// within the documented bf16 bound of the float64 result (normwise error
/// at most 2^-5, docs/compiled-model-format.md "bf16"), top-1 agrees with ONNX
/// Runtime on at least 99% of the images, the weights are half their f32
/// size, and the in-process run of the same file gives the same bits.
#[test]
fn a_bf16_compiled_cnn_runs_in_a_vm_within_the_bf16_bound() {
    let (name, input) = ("digits-cnn", "digits-img-x.npy");
    let m = fixture(&format!("torch/{name}.onnx"));
    let x = fixture(&format!("torch/{input}"));
    let weights = |report: &str| -> u64 {
        let line = report.lines().find(|l| l.starts_with("memory")).unwrap_or_else(|| panic!("{report}"));
        line.split_whitespace().nth(1).and_then(|w| w.parse().ok()).unwrap_or_else(|| panic!("{line}"))
    };
    let f32_art = tmp("cnn-f32.vnpu");
    let (code, f32_report, err) = vnpu(&["compile", &m, "--batch", "50", "-o", &f32_art]);
    assert_eq!(code, 0, "{f32_report}{err}");
    let art = tmp("cnn-bf16.vnpu");
    let (code, report, err) = vnpu(&["compile", &m, "--batch", "50", "--dtype", "bf16", "-o", &art]);
    assert_eq!(code, 0, "{report}{err}");
    assert!(report.contains("bf16 SA operands"), "{report}");
    assert!(weights(&report) * 10 < weights(&f32_report) * 6, "weights not halved:\n{report}\n{f32_report}");
    let got_path = tmp("cnn-bf16.out.npy");
    let (code, out, err) = vnpu(&["infer", &art, "--input", &format!("x={x}"), "--output", &got_path]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("(bf16 SA operands)") && out.contains("infer: 9 batches of 50 done"), "{out}");
    let got = npy::read_file(Path::new(&got_path)).unwrap();
    let exact = npy::read_file(Path::new(&fixture(&format!("torch/{name}-f64.npy")))).unwrap();
    let want = ort(&m, &format!("x={x}"), "logits");
    assert_eq!(got.shape, exact.shape);
    let scale = exact.data.iter().fold(0f64, |a, &w| a.max(f64::from(w).abs()));
    let mut abs = 0f64;
    for (&g, &w) in got.data.iter().zip(&exact.data) {
        let d = (f64::from(g) - f64::from(w)).abs();
        assert!(!d.is_nan(), "NaN in the output");
        abs = abs.max(d);
    }
    let rows = |v: &[f32], i: usize| argmax(&v[i * 10..(i + 1) * 10]);
    let agree = (0..450).filter(|&i| rows(&got.data, i) == rows(&want.data, i)).count();
    println!(
        "{name} bf16 via VM: max abs {abs:.3e}, normwise {:.3e} against f64; top-1 agree {agree}/450",
        abs / scale
    );
    assert!(abs / scale <= 0.03125, "normwise error {} above 2^-5", abs / scale);
    assert!(agree >= 446, "top-1 agrees with ONNX Runtime on {agree}/450");
    let host_path = tmp("cnn-bf16.host.npy");
    let (code, out, err) =
        vnpu(&["infer", &art, "--input", &format!("x={x}"), "--in-process", "--output", &host_path]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(npy::read_file(Path::new(&host_path)).unwrap(), got, "VM and in-process differ");
}

/// A hand-built model (the reference is its own bytes): `y` = the input
/// `x` followed by weights 5..8. Compiled models read their weights only
/// through HBM, so the runner reads the weight image where the job put it
/// and keeps only the inputs and outputs in DMA memory; a model whose
/// infer program also reads the image from the window gets the whole
/// window with the image copied in. Both give the same `y`, in a VM and
/// in-process.
#[test]
fn weights_in_place_or_copied_give_the_same_outputs() {
    use vnpu_abi::compiled_model::{ElemType, Model, Target, TensorDesc};
    use vnpu_abi::{Addr, DType, Engine, Instr, ProgramBuilder};
    let x = [0.5f32, -1.0, 2.25, 3.0];
    let xf = tmp("hand-x.npy");
    npy::write_file(Path::new(&xf), &npy::Array::floats(vec![1, 4], x.to_vec())).unwrap();
    let weights: Vec<u8> = (1..=16).flat_map(|i| (i as f32).to_le_bytes()).collect();
    for (name, from_window) in [("through-hbm", false), ("from-window", true)] {
        let mut load = ProgramBuilder::new();
        load.push(Engine::DMA, Instr::copy(Addr::guest(0), Addr::hbm(0), 64));
        let mut infer = ProgramBuilder::new();
        infer.push(Engine::DMA, Instr::copy(Addr::guest(64), Addr::hbm(256), 16));
        infer.push(Engine::DMA, Instr::copy(Addr::hbm(256), Addr::guest(128), 16));
        if from_window {
            infer.push(Engine::DMA, Instr::copy(Addr::guest(16), Addr::hbm(512), 16));
            infer.push(Engine::DMA, Instr::copy(Addr::hbm(512), Addr::guest(144), 16));
        } else {
            infer.push(Engine::DMA, Instr::copy(Addr::hbm(16), Addr::guest(144), 16));
        }
        let desc = |name: &str, dims: Vec<u64>, offset| TensorDesc {
            name: name.into(),
            elem: ElemType::F32,
            dims,
            offset,
        };
        let m = Model {
            target: Target {
                batch: 1,
                sa: 1,
                vu: 1,
                sram_bytes: 4 << 20,
                hbm_bytes: 256 << 20,
                sa_dtype: DType::F32,
            },
            window_bytes: 192,
            inputs: vec![desc("x", vec![1, 4], 64)],
            outputs: vec![desc("y", vec![1, 8], 128)],
            load: load.finish(),
            infer: infer.finish(),
            weights: weights.clone(),
        };
        let art = tmp(&format!("hand-{name}.vnpu"));
        std::fs::write(&art, m.encode()).unwrap();
        for path in [&[][..], &["--in-process"][..]] {
            let out = tmp(&format!("hand-{name}-y.npy"));
            let (code, stdout, err) =
                vnpu(&[&["infer", &art, "--input", &xf, "--output", &out][..], path].concat());
            assert_eq!(code, 0, "{name} {path:?}: {stdout}{err}");
            let y = npy::read_file(Path::new(&out)).unwrap();
            assert_eq!(y.data, [0.5, -1.0, 2.25, 3.0, 5.0, 6.0, 7.0, 8.0], "{name} {path:?}");
        }
    }
}
