//! Inverted-residual blocks lowered as one pipeline
//! (`CompileOptions::fuse_blocks`, on by default in `vnpu compile`): a
//! MobileNetV2-style network (an expanding block with a residual add, an
//! expanding block of stride 2, a block without expansion with a residual
//! add) compiled with and without it computes the same bits, agrees with
//! an f64 reference, and the fused one takes fewer cycles and less HBM.
//! Covered: several images per tile with a short last tile, bands of rows
//! of one image (SRAM too small for a whole one), and a block whose
//! expanded tensor is a model output (not fused).
#![allow(clippy::unwrap_used)]

mod common;

use common::{attr_i, attr_ints, model, node, options, tensor, value};
use npu_onnx::host::HostRunner;
use npu_onnx::{compile, Compiled};
use onnx_protobuf::{GraphProto, Message};
use vnpu_abi::DType;

/// Input channels, expansion factor.
const C: usize = 8;
const T: usize = 6;

fn weights(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 53 + seed * 31) % 89) as f32 / 89.0 - 0.5) * 0.5).collect()
}

/// One block's parameters: (input channels, expanded channels or `None`,
/// output channels, depthwise stride, residual add).
type Spec = (usize, Option<usize>, usize, usize, bool);

const BLOCKS: [Spec; 3] =
    [(C, Some(C * T), C, 1, true), (C, Some(C * T), 2 * C, 2, false), (2 * C, None, 2 * C, 1, true)];

/// The network on `hw x hw` images; with `expose`, the first block's
/// expanded tensor `E0` is an output too.
fn network(hw: usize, expose: bool) -> Vec<u8> {
    let mut g = GraphProto::new();
    g.name = "blocks".into();
    g.initializer = vec![
        tensor("lo", &[], &[0.0]),
        tensor("hi", &[], &[6.0]),
        tensor("W", &[C as i64, C as i64, 1, 1], &weights(C * C, 99)),
        tensor("B", &[C as i64], &weights(C, 98)),
    ];
    g.input = vec![value("X", &[0, C as i64, hw as i64, hw as i64])];
    // A stem, so the first block's input is an activation (as in real
    // networks), not the model's input.
    g.node.push(node("Conv", "stem", &["X", "W", "B"], &["stem.y"], vec![]));
    g.node.push(node("Clip", "stem.clip", &["stem.y", "lo", "hi"], &["S"], vec![]));
    let mut x = "S".to_string();
    let mut side = hw;
    for (i, &(cin, exp, cout, stride, res)) in BLOCKS.iter().enumerate() {
        let c = exp.unwrap_or(cin);
        let relu6 = |g: &mut GraphProto, from: &str, to: &str| {
            g.node.push(node("Clip", &format!("{to}.clip"), &[from, "lo", "hi"], &[to], vec![]));
        };
        let mut d_in = x.clone();
        if let Some(c) = exp {
            g.initializer.push(tensor(
                &format!("We{i}"),
                &[c as i64, cin as i64, 1, 1],
                &weights(c * cin, 10 * i + 1),
            ));
            g.initializer.push(tensor(&format!("Be{i}"), &[c as i64], &weights(c, 10 * i + 2)));
            g.node.push(node(
                "Conv",
                &format!("e{i}"),
                &[&x, &format!("We{i}"), &format!("Be{i}")],
                &[&format!("e{i}.y")],
                vec![],
            ));
            relu6(&mut g, &format!("e{i}.y"), &format!("E{i}"));
            d_in = format!("E{i}");
        }
        g.initializer.push(tensor(&format!("Wd{i}"), &[c as i64, 1, 3, 3], &weights(c * 9, 10 * i + 3)));
        g.initializer.push(tensor(&format!("Bd{i}"), &[c as i64], &weights(c, 10 * i + 4)));
        let attrs = vec![
            attr_ints("pads", &[1, 1, 1, 1]),
            attr_ints("strides", &[stride as i64; 2]),
            attr_i("group", c as i64),
        ];
        g.node.push(node(
            "Conv",
            &format!("d{i}"),
            &[&d_in, &format!("Wd{i}"), &format!("Bd{i}")],
            &[&format!("d{i}.y")],
            attrs,
        ));
        relu6(&mut g, &format!("d{i}.y"), &format!("D{i}"));
        g.initializer.push(tensor(
            &format!("Wp{i}"),
            &[cout as i64, c as i64, 1, 1],
            &weights(cout * c, 10 * i + 5),
        ));
        g.initializer.push(tensor(&format!("Bp{i}"), &[cout as i64], &weights(cout, 10 * i + 6)));
        let p = format!("P{i}");
        g.node.push(node(
            "Conv",
            &format!("p{i}"),
            &[&format!("D{i}"), &format!("Wp{i}"), &format!("Bp{i}")],
            &[&p],
            vec![],
        ));
        x = if res {
            g.node.push(node("Add", &format!("a{i}"), &[&p, &x], &[&format!("S{i}")], vec![]));
            format!("S{i}")
        } else {
            p
        };
        side = side.div_ceil(stride);
    }
    g.node.push(node("Identity", "out", &[&x], &["Y"], vec![]));
    g.output = vec![value("Y", &[0, 2 * C as i64, side as i64, side as i64])];
    if expose {
        g.output.push(value("E0", &[0, (C * T) as i64, hw as i64, hw as i64]));
    }
    model(g).write_to_bytes().unwrap()
}

/// 1x1 convolution of NCHW `x` (`n` images of `hw` pixels) in f64.
fn pointwise(x: &[f64], n: usize, hw: usize, cin: usize, cout: usize, w: &[f32], b: &[f32]) -> Vec<f64> {
    let mut y = vec![0.0; n * cout * hw];
    for img in 0..n {
        for o in 0..cout {
            for p in 0..hw {
                let s: f64 = (0..cin).map(|i| x[(img * cin + i) * hw + p] * f64::from(w[o * cin + i])).sum();
                y[(img * cout + o) * hw + p] = s + f64::from(b[o]);
            }
        }
    }
    y
}

/// Depthwise 3x3 convolution, padding 1, of NCHW `x` in f64.
fn depthwise(x: &[f64], n: usize, side: usize, c: usize, stride: usize, w: &[f32], b: &[f32]) -> Vec<f64> {
    let so = side.div_ceil(stride);
    let mut y = vec![0.0; n * c * so * so];
    for img in 0..n {
        for ch in 0..c {
            for oy in 0..so {
                for ox in 0..so {
                    let mut acc = f64::from(b[ch]);
                    for ky in 0..3 {
                        for kx in 0..3 {
                            let (iy, ix) = ((oy * stride + ky) as i64 - 1, (ox * stride + kx) as i64 - 1);
                            if iy < 0 || ix < 0 || iy >= side as i64 || ix >= side as i64 {
                                continue;
                            }
                            let xv = x[((img * c + ch) * side + iy as usize) * side + ix as usize];
                            acc += xv * f64::from(w[ch * 9 + ky * 3 + kx]);
                        }
                    }
                    y[((img * c + ch) * so + oy) * so + ox] = acc;
                }
            }
        }
    }
    y
}

fn reference(x: &[f32], n: usize, hw: usize) -> Vec<f64> {
    let relu6 = |v: Vec<f64>| -> Vec<f64> { v.into_iter().map(|e| e.clamp(0.0, 6.0)).collect() };
    let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let mut x = relu6(pointwise(&x, n, hw * hw, C, C, &weights(C * C, 99), &weights(C, 98)));
    let mut side = hw;
    for (i, &(cin, exp, cout, stride, res)) in BLOCKS.iter().enumerate() {
        let c = exp.unwrap_or(cin);
        let e = match exp {
            Some(c) => relu6(pointwise(
                &x,
                n,
                side * side,
                cin,
                c,
                &weights(c * cin, 10 * i + 1),
                &weights(c, 10 * i + 2),
            )),
            None => x.clone(),
        };
        let d =
            relu6(depthwise(&e, n, side, c, stride, &weights(c * 9, 10 * i + 3), &weights(c, 10 * i + 4)));
        side = side.div_ceil(stride);
        let p = pointwise(
            &d,
            n,
            side * side,
            c,
            cout,
            &weights(cout * c, 10 * i + 5),
            &weights(cout, 10 * i + 6),
        );
        x = if res { p.iter().zip(&x).map(|(p, x)| p + x).collect() } else { p };
    }
    x
}

fn run(
    bytes: &[u8],
    batch: usize,
    x: &[f32],
    fuse: bool,
    sram: Option<u64>,
) -> (Compiled, Vec<Vec<f32>>, f64) {
    let (board, mut opts) = options(batch as u32, DType::F32);
    opts.fuse_blocks = fuse;
    opts.reuse_hbm = false;
    if let Some(s) = sram {
        opts.shape.sram_bytes = s;
    }
    let c = compile(bytes, &opts).unwrap();
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    let (out, report) = r.infer(&[x]).unwrap();
    (c, out, report.cycles)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Compiles the network with and without fused blocks; checks the bits
/// match, the f64 reference, the number of fused blocks, and that fusion
/// saves cycles and HBM.
fn check(hw: usize, batch: usize, sram: Option<u64>) {
    let x: Vec<f32> = (0..batch * C * hw * hw).map(|i| (i as f32 * 0.071).sin() * 2.0).collect();
    let bytes = network(hw, false);
    let (fused, y, cycles) = run(&bytes, batch, &x, true, sram);
    let (apart, y_apart, apart_cycles) = run(&bytes, batch, &x, false, sram);
    let want = reference(&x, batch, hw);
    assert_eq!(y[0].len(), want.len());
    let mut worst = 0f64;
    for (&g, &w) in y[0].iter().zip(&want) {
        let d = (f64::from(g) - w).abs() / (1.0 + w.abs());
        worst = if d.is_nan() || worst.is_nan() { f64::NAN } else { worst.max(d) };
    }
    assert!(worst <= 1e-5, "largest difference from the f64 reference {worst}");
    assert_eq!(bits(&y[0]), bits(&y_apart[0]), "fusing the blocks changed the result");
    assert_eq!((fused.report.blocks, apart.report.blocks), (BLOCKS.len(), 0));
    assert!(cycles < apart_cycles, "{cycles} cycles fused against {apart_cycles}");
    assert!(
        fused.report.hbm_bytes < apart.report.hbm_bytes,
        "{} HBM bytes fused against {}",
        fused.report.hbm_bytes,
        apart.report.hbm_bytes
    );
}

/// Whole images per tile: the first block's 30x30 images go two to a
/// tile (900 rows per image against a 128x128 SA's fixed cost of 382
/// cycles per weight fold), the last tile short; the later blocks' 15x15
/// images all in one tile.
#[test]
fn fused_blocks_of_whole_images_change_no_bit() {
    check(30, 5, None);
}

/// An SRAM too small for two tiles of a 24x24 image's expanded tensor
/// beside the weights: the blocks that need it are lowered op by op, the
/// later (stride-2, 12x12) block is still fused, and the bits are those
/// of the unfused program.
#[test]
fn blocks_too_large_for_sram_are_lowered_op_by_op() {
    let (hw, batch) = (24, 2);
    let x: Vec<f32> = (0..batch * C * hw * hw).map(|i| (i as f32 * 0.013).sin()).collect();
    let bytes = network(hw, false);
    let sram = Some(256 << 10);
    let (c, out, _) = run(&bytes, batch, &x, true, sram);
    let (_, apart, _) = run(&bytes, batch, &x, false, sram);
    assert_eq!(c.report.blocks, 1, "{:?}", c.report.ops);
    assert_eq!(bits(&out[0]), bits(&apart[0]));
    let want = reference(&x, batch, hw);
    let worst = out[0]
        .iter()
        .zip(&want)
        .map(|(&g, &w)| (f64::from(g) - w).abs() / (1.0 + w.abs()))
        .fold(0f64, |m, d| if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) });
    assert!(worst <= 1e-5, "largest difference from the f64 reference {worst}");
}

/// A block whose expanded tensor is a model output keeps its expansion
/// out of the chain (the tensor must reach HBM): its depthwise
/// convolution and projection are still one pipeline, without the
/// residual add (whose operand, the block's input, is not the
/// depthwise's input then).
#[test]
fn a_block_with_an_output_inside_is_not_fused() {
    let (hw, batch) = (6, 2);
    let x: Vec<f32> = (0..batch * C * hw * hw).map(|i| (i as f32 * 0.37).cos()).collect();
    let bytes = network(hw, true);
    let (c, out, _) = run(&bytes, batch, &x, true, None);
    let (_, apart, _) = run(&bytes, batch, &x, false, None);
    assert_eq!(c.report.blocks, BLOCKS.len(), "{:?}", c.report.ops);
    assert_eq!(out.len(), 2);
    for (i, (a, b)) in out.iter().zip(&apart).enumerate() {
        assert_eq!(bits(a), bits(b), "output {i}");
    }
}
