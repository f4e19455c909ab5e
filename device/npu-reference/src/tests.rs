//! The reference against numbers worked out by hand from `docs/isa.md`.

use super::*;
use vnpu_abi::MatFlags;

fn machine() -> Machine {
    Machine::new(4096, 4096, &[(0x1000, 256)])
}

fn put(m: &mut Machine, addr: u64, v: &[f32]) {
    for (i, x) in v.iter().enumerate() {
        m.copy_from(Space::Sram, addr + 4 * i as u64, &x.to_le_bytes()).unwrap();
    }
}

/// The expected f32 values (and tolerances) of the writes, in order.
fn values(w: &[Write]) -> Vec<(f64, f64)> {
    w.iter()
        .map(|w| match w.expect {
            Expect::F32 { value, tol } => (value, tol),
            e => panic!("not an f32 write: {e:?}"),
        })
        .collect()
}

fn assert_values(w: &[Write], want: &[f64]) {
    let got = values(w);
    assert_eq!(got.len(), want.len(), "{got:?}");
    for ((v, tol), want) in got.iter().zip(want) {
        let ok = (v - want).abs() <= 1e-12 * want.abs().max(1.0);
        assert!(ok, "got {v} (tol {tol}), want {want}");
    }
}

#[test]
fn matmul_computes_a_times_b_with_leading_dimensions() {
    let mut m = machine();
    // A 2x2 with lda 3 (a padding column), B 2x2.
    put(&mut m, 0, &[1.0, 2.0, 99.0, 3.0, 4.0, 99.0]);
    put(&mut m, 64, &[5.0, 6.0, 7.0, 8.0]);
    let mm = |flags| Instr::MatMul {
        dtype: DType::F32,
        flags,
        a: 0,
        b: 64,
        c: 128,
        m: 2,
        k: 2,
        n: 2,
        lda: 3,
        ldb: 2,
        ldc: 2,
    };
    let w = m.effects(&mm(MatFlags::default())).unwrap();
    assert_values(&w, &[19.0, 22.0, 43.0, 50.0]);
    assert_eq!(w.iter().map(|w| w.addr).collect::<Vec<_>>(), [128, 132, 136, 140]);
    // B read as n x k: [[5, 6], [7, 8]] transposed is [[5, 7], [6, 8]].
    let w = m.effects(&mm(MatFlags { transpose_b: true, accumulate: false })).unwrap();
    assert_values(&w, &[17.0, 23.0, 39.0, 53.0]);
    // Accumulate adds C's old contents.
    put(&mut m, 128, &[1.0, 1.0, 1.0, 1.0]);
    let w = m.effects(&mm(MatFlags { transpose_b: false, accumulate: true })).unwrap();
    assert_values(&w, &[20.0, 23.0, 44.0, 51.0]);
}

#[test]
fn matmul_with_a_zero_dimension_writes_nothing() {
    let m = machine();
    let i = Instr::MatMul {
        dtype: DType::F32,
        flags: MatFlags::default(),
        a: 0,
        b: 64,
        c: 128,
        m: 2,
        k: 0,
        n: 2,
        lda: 2,
        ldb: 2,
        ldc: 2,
    };
    assert_eq!(m.effects(&i).unwrap(), vec![]);
}

#[test]
fn conv2d_pads_with_zeros_and_sums_in_bounds_taps() {
    let mut m = machine();
    // One 2x2 single-channel image [[1, 2], [3, 4]], a 3x3 kernel of ones,
    // padding 1: every output is the sum of the whole image.
    put(&mut m, 0, &[1.0, 2.0, 3.0, 4.0]);
    put(&mut m, 64, &[1.0; 9]);
    let geom = ConvGeom {
        n: 1,
        h: 2,
        w: 2,
        cin: 1,
        cout: 1,
        kh: 3,
        kw: 3,
        stride_h: 1,
        stride_w: 1,
        pad_top: 1,
        pad_bottom: 1,
        pad_left: 1,
        pad_right: 1,
    };
    let conv = |geom| Instr::Conv2d {
        dtype: DType::F32,
        flags: MatFlags::default(),
        input: 0,
        weights: 64,
        output: 128,
        geom,
    };
    assert_values(&m.effects(&conv(geom)).unwrap(), &[10.0, 10.0, 10.0, 10.0]);
    // A 3x3 kernel over 2x2 without padding: refused geometry.
    let bad = ConvGeom { pad_top: 0, pad_bottom: 0, pad_left: 0, pad_right: 0, ..geom };
    assert_eq!(m.effects(&conv(bad)), Err(RefError::Geometry("conv kernel/stride")));
}

/// No input channels: every output is 0, whatever the kernel size (a
/// fuzz input with a 26890 x 65385 kernel made the reference list 1.7e9
/// taps per pixel and run out of memory).
#[test]
fn conv2d_without_input_channels_writes_zeros_without_listing_taps() {
    let m = machine();
    let geom = ConvGeom {
        n: 1,
        h: 0,
        w: 0,
        cin: 0,
        cout: 2,
        kh: 26890,
        kw: 65385,
        stride_h: 65535,
        stride_w: 65535,
        pad_top: 65535,
        pad_bottom: 65535,
        pad_left: 12543,
        pad_right: 65535,
    };
    let i = Instr::Conv2d {
        dtype: DType::F32,
        flags: MatFlags::default(),
        input: 0,
        weights: 0,
        output: 0,
        geom,
    };
    // Output 2 x 1 pixels x 2 channels.
    assert_values(&m.effects(&i).unwrap(), &[0.0; 4]);
}

#[test]
fn dma_copy_reads_every_row_before_writing() {
    let mut m = machine();
    m.copy_from(Space::Sram, 0, &[1, 2, 3, 4]).unwrap();
    // Two rows of 2 bytes, source rows at 0 and 2, destination rows at 1
    // and 3: overlapping; the second row copies the *old* bytes 3, 4.
    let i = Instr::DmaCopy {
        src: Addr::sram(0),
        dst: Addr::sram(1),
        rows: 2,
        row_bytes: 2,
        src_stride: 2,
        dst_stride: 2,
    };
    let w = m.effects(&i).unwrap();
    let bytes: Vec<(u64, Expect)> = w.iter().map(|w| (w.addr, w.expect)).collect();
    assert_eq!(
        bytes,
        [(1, Expect::Byte(1)), (2, Expect::Byte(2)), (3, Expect::Byte(3)), (4, Expect::Byte(4))]
    );
    // Guest memory outside its range is refused.
    let i = Instr::DmaCopy {
        src: Addr::guest(0x10f0),
        dst: Addr::sram(0),
        rows: 1,
        row_bytes: 32,
        src_stride: 0,
        dst_stride: 0,
    };
    assert!(matches!(m.effects(&i), Err(RefError::OutOfSegment { space: "guest", .. })));
}

#[test]
fn gather_checks_every_index_against_the_table() {
    let mut m = machine();
    m.copy_from(Space::Hbm, 0, &[10, 11, 20, 21, 30, 31]).unwrap();
    m.copy_from(Space::Sram, 0, &[2, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    let g = |count, table_rows| Instr::DmaGather {
        table: Addr::hbm(0),
        indices: 0,
        dst: 64,
        count,
        row_bytes: 2,
        table_rows,
    };
    let w = m.effects(&g(2, 3)).unwrap();
    let got: Vec<Expect> = w.iter().map(|w| w.expect).collect();
    assert_eq!(got, [30, 31, 10, 11].map(Expect::Byte));
    assert_eq!(m.effects(&g(2, 2)), Err(RefError::GatherIndex { position: 0, index: 2, rows: 2 }));
}

#[test]
fn nan_propagates_through_relu_max_and_pooling() {
    let mut m = machine();
    put(&mut m, 0, &[f32::NAN, 1.0]);
    let relu = Instr::VUnary { op: UnOp::Relu, src: 0, dst: 64, len: 2 };
    let v = values(&m.effects(&relu).unwrap());
    assert!(v[0].0.is_nan() && v[1].0 == 1.0, "{v:?}");
    let max = Instr::VBinary { op: BinOp::Max, bcast: Bcast::Scalar, a: 0, b: 4, dst: 64, rows: 1, cols: 2 };
    let v = values(&m.effects(&max).unwrap());
    assert!(v[0].0.is_nan() && v[1].0 == 1.0, "{v:?}");
    let red = Instr::VReduce { op: RedOp::Max, src: 0, dst: 64, outer: 1, reduce: 2, inner: 1 };
    assert!(values(&m.effects(&red).unwrap())[0].0.is_nan());
}

#[test]
fn average_pool_divides_by_in_bounds_elements() {
    let mut m = machine();
    put(&mut m, 0, &[1.0, 2.0, 3.0, 4.0]);
    let geom = PoolGeom { n: 1, h: 2, w: 2, c: 1, kh: 2, kw: 2, stride: 1, pad: 1 };
    let i = Instr::VPool { op: PoolOp::Avg, src: 0, dst: 64, geom };
    // 3x3 outputs; the corners see one element, the edges two, the centre four.
    assert_values(&m.effects(&i).unwrap(), &[1.0, 1.5, 2.0, 2.0, 2.5, 3.0, 3.0, 3.5, 4.0]);
    let i = Instr::VPool { op: PoolOp::Max, src: 0, dst: 64, geom };
    assert_values(&m.effects(&i).unwrap(), &[1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 3.0, 4.0, 4.0]);
}

#[test]
fn softmax_and_layernorm_match_their_formulas() {
    let mut m = machine();
    put(&mut m, 0, &[0.0, 3f32.ln()]);
    let i = Instr::VSoftmax { src: 0, dst: 64, rows: 1, cols: 2 };
    let v = values(&m.effects(&i).unwrap());
    assert!((v[0].0 - 0.25).abs() < 1e-7 && (v[1].0 - 0.75).abs() < 1e-7, "{v:?}");
    put(&mut m, 0, &[1.0, 3.0, 2.0, 2.0, 0.5, 0.5]);
    let i = Instr::VLayerNorm { src: 0, dst: 64, gamma: 8, beta: 16, rows: 1, cols: 2, eps: 0.0 };
    // mean 2, population variance 1: [-1, 1] * gamma 2 + beta 0.5.
    assert_values(&m.effects(&i).unwrap(), &[-1.5, 2.5]);
}

#[test]
fn convert_rounds_to_nearest_even() {
    // bf16 keeps 7 fraction bits: 1 + 2^-8 is a tie (to 1.0, even), 1 +
    // 3 * 2^-8 is a tie too (to 1 + 2^-6, even), 1 + 2^-8 + 2^-20 rounds up.
    let cases = [
        (1.0 + 2f32.powi(-8), 1.0),
        (1.0 + 3.0 * 2f32.powi(-8), 1.0 + 2f32.powi(-6)),
        (1.0 + 2f32.powi(-8) + 2f32.powi(-20), 1.0 + 2f32.powi(-7)),
    ];
    for (x, want) in cases {
        assert_eq!(bf16_to_f32(f32_to_bf16(x)), want, "{x}");
    }
    assert_eq!(bf16_to_f32(f32_to_bf16(f32::MAX)), f32::INFINITY);
    assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
}

#[test]
fn close_claims_what_it_should() {
    assert!(close(1.0, 1.0, 0.0));
    assert!(!close(1.0 + f32::EPSILON, 1.0, 0.0));
    assert!(close(f32::NAN, f64::NAN, 0.0));
    assert!(!close(f32::NAN, 1.0, 1.0));
    assert!(!close(1.0, f64::NAN, 1.0));
    assert!(close(f32::NAN, 1.0, f64::INFINITY));
    // A NaN tolerance is no licence.
    assert!(!close(2.0, 1.0, f64::NAN));
    assert!(close(f32::INFINITY, f64::from(f32::MAX) * 1.0000001, 0.0));
    assert!(!close(f32::INFINITY, 1e30, 1.0));
    assert!(!close(f32::NEG_INFINITY, f64::from(f32::MAX), 0.0));
}
