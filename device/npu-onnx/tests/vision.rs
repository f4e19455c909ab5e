//! Vision models as `torch.onnx.export` writes them (scripts/vision_models.py):
//! torchvision's `squeezenet1_0` and `vit_b_16` and a YOLO-family detector
//! with its box decoding, their graphs committed and their weights written
//! from a seed by scripts/fill_external.py (in `.venv-onnx`), compiled from
//! the file with its external data, run in-process, against ONNX Runtime.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use npu_lower::VnpuShape;
use npu_model::BoardConfig;
use npu_onnx::host::HostRunner;
use npu_onnx::{npy, CompileOptions};
use vnpu_abi::DType;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    root().join(".venv-onnx/bin/python")
}

/// Writes model `name`'s weights and input into a fresh directory and
/// returns it (with the model copied there).
fn materialize(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vnpu-vision-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(python())
        .arg(root().join("scripts/fill_external.py"))
        .arg(root().join(format!("tests/fixtures/onnx/vision/{name}.onnx")))
        .arg(&dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run .venv-onnx's python (bash scripts/setup.sh): {e}"));
    assert!(out.status.success(), "fill_external.py: {}", String::from_utf8_lossy(&out.stderr));
    dir
}

/// ONNX Runtime's output `y` of the model in `dir`.
fn ort(dir: &Path, name: &str) -> npy::Array {
    let prefix = dir.join(format!("ort-{name}"));
    let out = Command::new(python())
        .arg(root().join("scripts/ort_ref.py"))
        .arg(dir.join(format!("{name}.onnx")))
        .arg(&prefix)
        .arg(format!("x={}", dir.join(format!("{name}-x.npy")).display()))
        .args(["--output", "y"])
        .output()
        .unwrap();
    assert!(out.status.success(), "ort_ref.py: {}", String::from_utf8_lossy(&out.stderr));
    npy::read_file(&PathBuf::from(format!("{}.y.npy", prefix.display()))).unwrap()
}

/// Compiles and runs model `name` on `sa` SAs and `vu` VUs; returns max
/// abs error, that error relative to the output's largest magnitude, and
/// argmax agreement over the last axis.
fn check(name: &str, sa: u32, vu: u32) -> (f64, f64, usize, usize) {
    let dir = materialize(name);
    let x = npy::read_file(&dir.join(format!("{name}-x.npy"))).unwrap();
    let board = BoardConfig::default();
    let opts = CompileOptions {
        shape: VnpuShape::on_board(&board, sa, vu, board.sram_bytes(), 4 << 30),
        batch: 1,
        shapes: HashMap::new(),
        outputs: None,
        dtype: DType::F32,
        bf16_activations: false,
        spread: None,
        reuse_hbm: true,
        fuse_residual: true,
        fuse_blocks: true,
    };
    let c = npu_onnx::compile_file(&dir.join(format!("{name}.onnx")), &opts)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    let (outs, _) = r.infer(&[&x.data]).unwrap();
    let want = ort(&dir, name);
    let _ = std::fs::remove_dir_all(&dir);
    let common::Agreement { abs, scale, agree, rows } =
        common::agreement(&outs[0], &want.data, *want.shape.last().unwrap() as usize);
    println!(
        "{name} {sa}sa{vu}vu: max abs {abs:.3e}, of the scale ({scale:.3e}) {:.3e}, argmax {agree}/{rows} ({} nodes: {:?})",
        abs / scale,
        c.report.nodes,
        c.report.ops
    );
    (abs, abs / scale, agree, rows)
}

/// SqueezeNet (ceil-mode max pooling, fire modules' concatenations),
/// torchvision's ViT-B/16 (86 M weights: the class token, position
/// embeddings, 12 encoder layers) and the YOLO-style detector (SiLU,
/// Split, SPPF pooling, nearest Resize, the decoding head), each within
/// 1e-5 of ONNX Runtime's output scale, every argmax equal.
#[test]
fn squeezenet_vit_and_a_yolo_detector_match_onnx_runtime() {
    for (name, sa, vu) in [("squeezenet1_0", 2, 2), ("tiny-yolo", 1, 1), ("vit_b_16", 4, 4)] {
        let (abs, rel, agree, rows) = check(name, sa, vu);
        assert!(rel <= 1e-5, "{name}: error {rel} of the output's scale (max abs {abs})");
        assert_eq!(agree, rows, "{name}: argmax agreement");
    }
}
