//! A channel concatenation of products' outputs (SqueezeNet's fire
//! modules, Inception's branches) costs no copy: each product writes its
//! channels straight into the concatenation's output. Checked against a
//! CPU reference in f64, against the same model with the concatenated
//! tensors also graph outputs (which keeps the copies: the bits must not
//! change), and by the operations and cycles the compiler emits.
#![allow(clippy::unwrap_used)]

mod common;

use common::{attr_i, attr_ints, model, node, options, tensor, value};
use npu_onnx::host::HostRunner;
use npu_onnx::{compile, Compiled};
use onnx_protobuf::{GraphProto, Message};
use vnpu_abi::DType;

const C: usize = 6;
const S: usize = 4;
const E1: usize = 5;
const E3: usize = 7;
const HW: usize = 9;

/// Deterministic weights: `n` values in about +-0.5.
fn weights(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 37 + seed * 101) % 97) as f32 / 97.0 - 0.5) * 0.9).collect()
}

/// A fire module: `S = Relu(Conv1x1(X))`, `E1 = Relu(Conv1x1(S))`,
/// `E3 = Relu(Conv3x3(S, pad 1))`, `Y = Concat(E1, E3, axis 1)`, and
/// `Z = GlobalAveragePool(Y)`, the output (`[N, 12, 1, 1]`: stored
/// channels-last as in ONNX's order, so no copy re-lays it out); with
/// `expose`, `E1` and `E3` are graph outputs too.
fn fire(expose: bool) -> Vec<u8> {
    let mut g = GraphProto::new();
    g.name = "fire".into();
    let (c, s, e1, e3) = (C as i64, S as i64, E1 as i64, E3 as i64);
    g.initializer = vec![
        tensor("Ws", &[s, c, 1, 1], &weights(S * C, 1)),
        tensor("Bs", &[s], &weights(S, 2)),
        tensor("W1", &[e1, s, 1, 1], &weights(E1 * S, 3)),
        tensor("B1", &[e1], &weights(E1, 4)),
        tensor("W3", &[e3, s, 3, 3], &weights(E3 * S * 9, 5)),
        tensor("B3", &[e3], &weights(E3, 6)),
    ];
    let hw = HW as i64;
    g.input = vec![value("X", &[0, c, hw, hw])];
    g.output = vec![value("Z", &[0, e1 + e3, 1, 1])];
    if expose {
        g.output.push(value("E1", &[0, e1, hw, hw]));
        g.output.push(value("E3", &[0, e3, hw, hw]));
    }
    g.node = vec![
        node("Conv", "sq", &["X", "Ws", "Bs"], &["Sc"], vec![]),
        node("Relu", "sq_relu", &["Sc"], &["S"], vec![]),
        node("Conv", "e1", &["S", "W1", "B1"], &["E1c"], vec![]),
        node("Relu", "e1_relu", &["E1c"], &["E1"], vec![]),
        node("Conv", "e3", &["S", "W3", "B3"], &["E3c"], vec![attr_ints("pads", &[1, 1, 1, 1])]),
        node("Relu", "e3_relu", &["E3c"], &["E3"], vec![]),
        node("Concat", "cat", &["E1", "E3"], &["Y"], vec![attr_i("axis", 1)]),
        node("GlobalAveragePool", "gap", &["Y"], &["Z"], vec![]),
    ];
    model(g).write_to_bytes().unwrap()
}

/// `Relu(conv(x) + b)` in f64, NCHW, `k x k` window, zero padding `k / 2`.
fn conv_relu(x: &[f64], cin: usize, w: &[f32], b: &[f32], cout: usize, k: usize) -> Vec<f64> {
    let n = x.len() / (cin * HW * HW);
    let p = (k / 2) as i64;
    let mut y = vec![0.0; n * cout * HW * HW];
    for img in 0..n {
        for o in 0..cout {
            for oy in 0..HW {
                for ox in 0..HW {
                    let mut acc = f64::from(b[o]);
                    for i in 0..cin {
                        for ky in 0..k {
                            for kx in 0..k {
                                let (iy, ix) = (oy as i64 + ky as i64 - p, ox as i64 + kx as i64 - p);
                                if iy < 0 || ix < 0 || iy >= HW as i64 || ix >= HW as i64 {
                                    continue;
                                }
                                let xv = x[((img * cin + i) * HW + iy as usize) * HW + ix as usize];
                                acc += xv * f64::from(w[((o * cin + i) * k + ky) * k + kx]);
                            }
                        }
                    }
                    y[((img * cout + o) * HW + oy) * HW + ox] = acc.max(0.0);
                }
            }
        }
    }
    y
}

fn run(bytes: &[u8], batch: usize, x: &[f32]) -> (Compiled, Vec<Vec<f32>>, f64) {
    let (board, opts) = options(batch as u32, DType::F32);
    let c = compile(bytes, &opts).unwrap();
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    let (out, report) = r.infer(&[x]).unwrap();
    (c, out, report.cycles)
}

fn copies(c: &Compiled) -> usize {
    c.report.ops.iter().filter(|(k, _)| k == "Copy").map(|(_, n)| n).sum()
}

#[test]
fn fire_module_concatenates_in_place_with_the_same_bits() {
    let batch = 3;
    let x: Vec<f32> = (0..batch * C * HW * HW).map(|i| (i as f32 * 0.137).sin() * 2.0).collect();
    let (in_place, y, cycles) = run(&fire(false), batch, &x);
    let (copied, outs, copy_cycles) = run(&fire(true), batch, &x);

    // The reference: the module in f64.
    let xd: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let s = conv_relu(&xd, C, &weights(S * C, 1), &weights(S, 2), S, 1);
    let e1 = conv_relu(&s, S, &weights(E1 * S, 3), &weights(E1, 4), E1, 1);
    let e3 = conv_relu(&s, S, &weights(E3 * S * 9, 5), &weights(E3, 6), E3, 3);
    let plane = HW * HW;
    let mut want = Vec::with_capacity(batch * (E1 + E3));
    for img in 0..batch {
        let mean = |e: &[f64], c: usize| e[c * plane..(c + 1) * plane].iter().sum::<f64>() / plane as f64;
        want.extend((0..E1).map(|c| mean(&e1[img * E1 * plane..], c)));
        want.extend((0..E3).map(|c| mean(&e3[img * E3 * plane..], c)));
    }
    let y = &y[0];
    assert_eq!(y.len(), want.len());
    let mut worst = 0f64;
    for (&g, &w) in y.iter().zip(&want) {
        let d = (f64::from(g) - w).abs();
        worst = if d.is_nan() || worst.is_nan() { f64::NAN } else { worst.max(d) };
    }
    assert!(worst <= 1e-5, "largest difference from the f64 reference {worst}");

    // The same bits as the copies give.
    let differ = y.iter().zip(&outs[0]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differ, 0, "{differ} of {} elements changed", y.len());

    // The concatenation is free where the concatenated tensors have no
    // other use (the input's re-layout to channels-last copies in both);
    // at least its two copies more when both are outputs too; and the
    // copies' time saved.
    assert_eq!(in_place.report.aliases, copied.report.aliases + 1);
    assert!(
        copies(&in_place) + 2 <= copies(&copied),
        "{:?} against {:?}",
        in_place.report.ops,
        copied.report.ops
    );
    assert!(cycles < copy_cycles, "{cycles} cycles in place against {copy_cycles} with the copies");
}

/// The same along a dense tensor's last axis: two products of one input,
/// concatenated.
#[test]
fn products_concatenate_in_place_along_the_last_axis() {
    let (k, n1, n2, batch) = (10usize, 6usize, 3usize, 5usize);
    let (wa, wb) = (weights(k * n1, 7), weights(k * n2, 8));
    let build = |expose: bool| {
        let mut g = GraphProto::new();
        g.name = "two".into();
        g.initializer =
            vec![tensor("Wa", &[k as i64, n1 as i64], &wa), tensor("Wb", &[k as i64, n2 as i64], &wb)];
        g.input = vec![value("X", &[0, k as i64])];
        g.output = vec![value("Y", &[0, (n1 + n2) as i64])];
        if expose {
            g.output.push(value("A", &[0, n1 as i64]));
        }
        g.node = vec![
            node("MatMul", "a", &["X", "Wa"], &["A"], vec![]),
            node("MatMul", "b", &["X", "Wb"], &["B"], vec![]),
            node("Concat", "cat", &["A", "B"], &["Y"], vec![attr_i("axis", -1)]),
        ];
        model(g).write_to_bytes().unwrap()
    };
    let x: Vec<f32> = (0..batch * k).map(|i| (i as f32 * 0.31).cos()).collect();
    let (in_place, y, _) = run(&build(false), batch, &x);
    let (partly, y2, _) = run(&build(true), batch, &x);
    let y = &y[0];
    for r in 0..batch {
        for (j, got) in y[r * (n1 + n2)..(r + 1) * (n1 + n2)].iter().enumerate() {
            let (w, n, c) = if j < n1 { (&wa, n1, j) } else { (&wb, n2, j - n1) };
            let want: f64 = (0..k).map(|p| f64::from(x[r * k + p]) * f64::from(w[p * n + c])).sum();
            let d = (f64::from(*got) - want).abs();
            assert!(d <= 1e-5, "row {r} column {j}: {got} against {want}");
        }
    }
    assert_eq!(
        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        y2[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(copies(&in_place), 0, "{:?}", in_place.report.ops);
    // `A` is an output too: its copy stays, `B`'s goes.
    assert_eq!(copies(&partly), 1, "{:?}", partly.report.ops);
}
