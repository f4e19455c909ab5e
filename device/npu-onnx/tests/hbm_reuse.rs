//! HBM shared by liveness (`CompileOptions::reuse_hbm`, on by default in
//! `vnpu compile`): a model compiled with it computes the same bits in the
//! same simulated cycles as without, needs less HBM, and a second output
//! that no later operation touches keeps its HBM until the guest reads it.
#![allow(clippy::unwrap_used)]

mod common;

use common::{model, node, options, tensor, value};
use npu_onnx::compile;
use npu_onnx::host::HostRunner;
use onnx_protobuf::{GraphProto, Message};
use vnpu_abi::DType;

/// `E = Relu(X)` is computed first and is the model's second output; a
/// chain of four products then makes `Y`, the first output (so the first
/// and third products' outputs may share HBM). Without its own HBM,
/// `E`'s space is free after the first operation and the chain's first
/// tensor takes it.
fn early_second_output(width: usize, w: &[Vec<f32>]) -> Vec<u8> {
    let n = width as i64;
    let mut g = GraphProto::new();
    g.name = "early".into();
    g.initializer = w.iter().enumerate().map(|(i, w)| tensor(&format!("W{i}"), &[n, n], w)).collect();
    g.input = vec![value("X", &[0, n])];
    g.output = vec![value("Y", &[0, n]), value("E", &[0, n])];
    g.node = vec![
        node("Relu", "early", &["X"], &["E"], vec![]),
        node("MatMul", "a", &["X", "W0"], &["A"], vec![]),
        node("MatMul", "b", &["A", "W1"], &["B"], vec![]),
        node("MatMul", "c", &["B", "W2"], &["C"], vec![]),
        node("MatMul", "y", &["C", "W3"], &["Y"], vec![]),
    ];
    model(g).write_to_bytes().unwrap()
}

/// `x` (`rows` x `n`) times `w` (`n` x `n`) in f64, and the sums of
/// `|x_p w_p|` (the scale of each element's rounding error).
fn product(x: &[f64], w: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / n;
    let (mut y, mut scale) = (vec![0.0; rows * n], vec![0.0; rows * n]);
    for r in 0..rows {
        for p in 0..n {
            let a = x[r * n + p];
            for j in 0..n {
                let b = f64::from(w[p * n + j]);
                y[r * n + j] += a * b;
                scale[r * n + j] += (a * b).abs();
            }
        }
    }
    (y, scale)
}

#[test]
fn shared_hbm_changes_no_bit_and_no_cycle_and_keeps_every_output() {
    let (width, batch) = (128usize, 16usize);
    let w: Vec<Vec<f32>> = (0..4)
        .map(|k| (0..width * width).map(|i| ((i * 7 + k * 13) as f32 * 0.011).sin() / 8.0).collect())
        .collect();
    let bytes = early_second_output(width, &w);
    let x: Vec<f32> = (0..batch * width).map(|i| (i as f32 * 0.013).sin() * 3.0).collect();
    let run = |reuse_hbm: bool| {
        let (board, mut opts) = options(batch as u32, DType::F32);
        opts.reuse_hbm = reuse_hbm;
        let c = compile(&bytes, &opts).unwrap();
        let mut r = HostRunner::new(&board, &c.model).unwrap();
        let (out, report) = r.infer(&[&x]).unwrap();
        (c.report.hbm_bytes, out, report.cycles)
    };
    let (own_hbm, own, own_cycles) = run(false);
    let (shared_hbm, shared, shared_cycles) = run(true);
    assert!(shared_hbm < own_hbm, "{shared_hbm} bytes of HBM with reuse against {own_hbm} without");
    assert_eq!(shared_cycles.to_bits(), own_cycles.to_bits(), "the addresses changed the simulated time");
    assert_eq!(shared.len(), 2);
    for (i, (a, b)) in shared.iter().zip(&own).enumerate() {
        assert_eq!(a.len(), b.len());
        let differ = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differ, 0, "output {i}: {differ} elements depend on where the intermediate tensors are");
    }
    // Against the formulas, in f64.
    for (j, &v) in x.iter().enumerate() {
        assert_eq!(shared[1][j].to_bits(), v.max(0.0).to_bits(), "E[{j}]");
    }
    let mut h: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let mut scale = vec![0.0; h.len()];
    for wk in &w {
        (h, scale) = product(&h, wk, width);
    }
    for (j, (want, s)) in h.iter().zip(&scale).enumerate() {
        let got = f64::from(shared[0][j]);
        // Four f32 products of 128 terms: well within 1e-4 of each
        // element's magnitude scale (NaN fails the comparison).
        assert!((got - want).abs() <= 1e-4 * (s + 1e-3), "Y[{j}] = {got}, want {want}");
    }
}
