//! Residual adds fused into the convolution that computes one of their
//! operands (`CompileOptions::fuse_residual`, on by default in `vnpu
//! compile`): a ResNet basic block compiled with and without it computes
//! the same bits (f32), agrees with an f64 reference, and the fused one
//! has no add and takes fewer cycles; an operand that is also a model
//! output is not fused away.
#![allow(clippy::unwrap_used)]

mod common;

use common::{attr_ints, model, node, options, tensor, value};
use npu_onnx::host::HostRunner;
use npu_onnx::{compile, Compiled};
use onnx_protobuf::{GraphProto, Message};
use vnpu_abi::DType;

const C: usize = 8;
const HW: usize = 10;

fn weights(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 53 + seed * 31) % 89) as f32 / 89.0 - 0.5) * 0.4).collect()
}

/// A stem `P = Relu(Conv1x1(X))`, then a basic block on it:
/// `Y = Relu(Conv(Relu(Conv(P))) + P)`, 3x3 convolutions with padding 1;
/// with `expose`, the second convolution's output `B` is an output too.
/// Images are `hw x hw`.
fn block(expose: bool, hw: usize) -> Vec<u8> {
    let c = C as i64;
    let hw = hw as i64;
    let mut g = GraphProto::new();
    g.name = "block".into();
    g.initializer = vec![
        tensor("W0", &[c, c, 1, 1], &weights(C * C, 5)),
        tensor("B0", &[c], &weights(C, 6)),
        tensor("W1", &[c, c, 3, 3], &weights(C * C * 9, 1)),
        tensor("B1", &[c], &weights(C, 2)),
        tensor("W2", &[c, c, 3, 3], &weights(C * C * 9, 3)),
        tensor("B2", &[c], &weights(C, 4)),
    ];
    g.input = vec![value("X", &[0, c, hw, hw])];
    g.output = vec![value("Y", &[0, c, hw, hw])];
    if expose {
        g.output.push(value("B", &[0, c, hw, hw]));
    }
    let pads = || vec![attr_ints("pads", &[1, 1, 1, 1])];
    g.node = vec![
        node("Conv", "stem", &["X", "W0", "B0"], &["P0"], vec![]),
        node("Relu", "r0", &["P0"], &["P"], vec![]),
        node("Conv", "c1", &["P", "W1", "B1"], &["A0"], pads()),
        node("Relu", "r1", &["A0"], &["A"], vec![]),
        node("Conv", "c2", &["A", "W2", "B2"], &["B"], pads()),
        node("Add", "add", &["B", "P"], &["S"], vec![]),
        node("Relu", "r2", &["S"], &["Y"], vec![]),
    ];
    model(g).write_to_bytes().unwrap()
}

/// The stem in f64: `Relu(Conv1x1(x))`, NCHW.
fn stem(x: &[f64]) -> Vec<f64> {
    let (w, b) = (weights(C * C, 5), weights(C, 6));
    let plane = HW * HW;
    let mut y = vec![0.0; x.len()];
    for img in 0..x.len() / (C * plane) {
        for o in 0..C {
            for p in 0..plane {
                let s: f64 = (0..C).map(|i| x[(img * C + i) * plane + p] * f64::from(w[o * C + i])).sum();
                y[(img * C + o) * plane + p] = (s + f64::from(b[o])).max(0.0);
            }
        }
    }
    y
}

/// A 3x3 convolution with padding 1 in f64, NCHW.
fn conv3(x: &[f64], w: &[f32], b: &[f32]) -> Vec<f64> {
    let n = x.len() / (C * HW * HW);
    let mut y = vec![0.0; x.len()];
    for img in 0..n {
        for o in 0..C {
            for oy in 0..HW as i64 {
                for ox in 0..HW as i64 {
                    let mut acc = f64::from(b[o]);
                    for i in 0..C {
                        for ky in 0..3 {
                            for kx in 0..3 {
                                let (iy, ix) = (oy + ky - 1, ox + kx - 1);
                                if iy < 0 || ix < 0 || iy >= HW as i64 || ix >= HW as i64 {
                                    continue;
                                }
                                let xv = x[((img * C + i) * HW + iy as usize) * HW + ix as usize];
                                acc += xv * f64::from(w[((o * C + i) * 3 + ky as usize) * 3 + kx as usize]);
                            }
                        }
                    }
                    y[((img * C + o) * HW + oy as usize) * HW + ox as usize] = acc;
                }
            }
        }
    }
    y
}

fn run(bytes: &[u8], batch: usize, x: &[f32], fuse_residual: bool) -> (Compiled, Vec<Vec<f32>>, f64) {
    let (board, mut opts) = options(batch as u32, DType::F32);
    opts.fuse_residual = fuse_residual;
    let c = compile(bytes, &opts).unwrap();
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    let (out, report) = r.infer(&[x]).unwrap();
    (c, out, report.cycles)
}

fn adds(c: &Compiled) -> usize {
    c.report.ops.iter().filter(|(k, _)| k == "Add").map(|(_, n)| n).sum()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_fused_residual_add_changes_no_bit_and_saves_cycles() {
    let batch = 2;
    let x: Vec<f32> = (0..batch * C * HW * HW).map(|i| (i as f32 * 0.071).sin()).collect();
    let (fused, y, cycles) = run(&block(false, HW), batch, &x, true);
    let (apart, y_apart, apart_cycles) = run(&block(false, HW), batch, &x, false);

    let xd: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let xd = stem(&xd);
    let a: Vec<f64> = conv3(&xd, &weights(C * C * 9, 1), &weights(C, 2)).iter().map(|v| v.max(0.0)).collect();
    let b = conv3(&a, &weights(C * C * 9, 3), &weights(C, 4));
    let want: Vec<f64> = b.iter().zip(&xd).map(|(b, x)| (b + x).max(0.0)).collect();
    let mut worst = 0f64;
    for (&g, &w) in y[0].iter().zip(&want) {
        let d = (f64::from(g) - w).abs();
        worst = if d.is_nan() || worst.is_nan() { f64::NAN } else { worst.max(d) };
    }
    assert!(worst <= 1e-5, "largest difference from the f64 reference {worst}");

    assert_eq!(bits(&y[0]), bits(&y_apart[0]), "fusing the add changed the result");
    assert_eq!((adds(&fused), adds(&apart)), (0, 1), "{:?} / {:?}", fused.report.ops, apart.report.ops);
    assert_eq!(fused.report.fused, apart.report.fused + 1);
    assert!(cycles < apart_cycles, "{cycles} cycles fused against {apart_cycles}");
}

/// 1x1 images: channels-last is ONNX's own order, so no copy re-lays
/// the output `B` out, and only its being an output keeps it stored.
#[test]
fn an_operand_that_is_an_output_keeps_its_add() {
    let batch = 3;
    let x: Vec<f32> = (0..batch * C).map(|i| (i as f32 * 0.23).cos()).collect();
    let (c, out, _) = run(&block(true, 1), batch, &x, true);
    let (_, apart, _) = run(&block(true, 1), batch, &x, false);
    assert_eq!(adds(&c), 1, "{:?}", c.report.ops);
    assert_eq!(out.len(), 2);
    for (i, (a, b)) in out.iter().zip(&apart).enumerate() {
        assert_eq!(bits(a), bits(b), "output {i}");
    }
}
