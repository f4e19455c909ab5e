//! Functional results checked against plain CPU references over random
//! shapes, run end to end through programs (DMA in, compute, DMA out) on
//! the simulated core.
#![allow(clippy::unwrap_used)]

use half::bf16;
use npu_model::memory::{read_f32s, write_f32s};
use npu_model::{
    run_core, run_program, BoardConfig, CoreMemory, CoreSim, ExecError, LazyHbm, Memory, Sram, Tenant,
    VecGuestMemory,
};
use proptest::prelude::*;
use vnpu_abi::*;

const GUEST_BASE: u64 = 0x10_0000;
const SRAM: u64 = 8 << 20;

fn cfg() -> BoardConfig {
    let mut c = BoardConfig::test_board();
    c.core.sa_rows = 16;
    c.core.sa_cols = 16;
    c
}

/// Runs `build` against fresh memories holding `inputs` (f32 arrays placed
/// back to back in guest memory starting at GUEST_BASE); returns guest memory.
struct Harness {
    guest: VecGuestMemory,
    sram: Sram,
    hbm: LazyHbm,
}

impl Harness {
    fn new() -> Self {
        Self {
            guest: VecGuestMemory::new(GUEST_BASE, 16 << 20),
            sram: Sram::new(SRAM),
            hbm: LazyHbm::new(1 << 30),
        }
    }
    fn put(&mut self, at: u64, v: &[f32]) {
        write_f32s(&mut self.guest, GUEST_BASE + at, v).unwrap();
    }
    fn get(&self, at: u64, n: usize) -> Vec<f32> {
        read_f32s(&self.guest, GUEST_BASE + at, n).unwrap()
    }
    fn run(&mut self, p: &Program) -> Result<npu_model::TenantReport, ExecError> {
        let mem = CoreMemory { sram: &mut self.sram, hbm: &mut self.hbm, guest: &mut self.guest };
        run_program(&cfg(), p, Some(mem), Some(1 << 40))
    }
}

fn dma(b: &mut ProgramBuilder, src: Addr, dst: Addr, bytes: u64) {
    b.push(
        Engine::DMA,
        Instr::DmaCopy { src, dst, rows: 1, row_bytes: bytes as u32, src_stride: 0, dst_stride: 0 },
    );
}

fn reference_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, bt: bool) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let bv = if bt { b[j * k + p] } else { b[p * n + j] };
                s += f64::from(a[i * k + p]) * f64::from(bv);
            }
            c[i * n + j] = s as f32;
        }
    }
    c
}

fn close(got: &[f32], want: &[f32], tol: f32) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        prop_assert!((g - w).abs() <= tol * (1.0 + w.abs()), "element {}: got {} want {}", i, g, w);
    }
    Ok(())
}

fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
    // A small deterministic generator so failures reproduce from the seed.
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// MatMul over random shapes, around and across the 16x16 array edge,
    /// with leading dimensions larger than the rows, transposed B and
    /// accumulation into existing C.
    #[test]
    fn matmul_matches_reference(m in 1usize..70, k in 1usize..70, n in 1usize..70, pad in 0usize..5,
                                bt in any::<bool>(), acc in any::<bool>(), seed in any::<u64>()) {
        let a = rand_vec(seed, m * k);
        let b = rand_vec(seed ^ 1, k * n);
        let c0 = rand_vec(seed ^ 2, m * n);
        let (lda, ldc) = (k + pad, n + pad);
        let mut h = Harness::new();
        // A with padded rows, B dense, C with padded rows.
        let mut a_pad = vec![0.0; m * lda];
        for i in 0..m { a_pad[i * lda..i * lda + k].copy_from_slice(&a[i * k..(i + 1) * k]); }
        let mut c_pad = vec![0.0; m * ldc];
        for i in 0..m { c_pad[i * ldc..i * ldc + n].copy_from_slice(&c0[i * n..(i + 1) * n]); }
        let (ga, gb, gc) = (0u64, 4 << 20, 8 << 20);
        h.put(ga, &a_pad); h.put(gb, &b); h.put(gc, &c_pad);
        let (sa, sb, sc) = (0u64, 2 << 20, 4 << 20);
        let mut p = ProgramBuilder::new();
        dma(&mut p, Addr::guest(GUEST_BASE + ga), Addr::sram(sa), (m * lda * 4) as u64);
        dma(&mut p, Addr::guest(GUEST_BASE + gb), Addr::sram(sb), (k * n * 4) as u64);
        dma(&mut p, Addr::guest(GUEST_BASE + gc), Addr::sram(sc), (m * ldc * 4) as u64);
        p.sync(Engine::DMA, Engine::sa(0), 0);
        p.push(Engine::sa(0), Instr::MatMul {
            dtype: DType::F32, flags: MatFlags { accumulate: acc, transpose_b: bt },
            a: sa, b: sb, c: sc, m: m as u32, k: k as u32, n: n as u32,
            lda: lda as u32, ldb: if bt { k as u32 } else { n as u32 }, ldc: ldc as u32,
        });
        p.sync(Engine::sa(0), Engine::DMA, 1);
        dma(&mut p, Addr::sram(sc), Addr::guest(GUEST_BASE + gc), (m * ldc * 4) as u64);
        let r = h.run(&p.finish()).unwrap();
        let got_pad = h.get(gc, m * ldc);
        let got: Vec<f32> = (0..m).flat_map(|i| got_pad[i * ldc..i * ldc + n].to_vec()).collect();
        let mut want = reference_matmul(&a, &b, m, k, n, bt);
        if acc { for (w, c) in want.iter_mut().zip(&c0) { *w += c; } }
        close(&got, &want, 1e-4)?;
        // Padding columns of C are untouched.
        for i in 0..m { for j in n..ldc { prop_assert_eq!(got_pad[i * ldc + j], 0.0); } }
        let t = r.totals();
        prop_assert_eq!(t.flops, 2 * (m * k * n) as u64);
        prop_assert!(t.sa_active_cycles > 0.0 && t.dma_active_cycles > 0.0);
    }

    /// bf16 operands, f32 accumulation: equal to the f32 product of the
    /// bf16-rounded inputs.
    #[test]
    fn bf16_matmul_accumulates_in_f32(m in 1usize..40, k in 1usize..40, n in 1usize..40, seed in any::<u64>()) {
        let a: Vec<f32> = rand_vec(seed, m * k).iter().map(|x| bf16::from_f32(*x).to_f32()).collect();
        let b: Vec<f32> = rand_vec(seed ^ 9, k * n).iter().map(|x| bf16::from_f32(*x).to_f32()).collect();
        let mut h = Harness::new();
        h.put(0, &a); h.put(1 << 20, &b);
        let mut p = ProgramBuilder::new();
        dma(&mut p, Addr::guest(GUEST_BASE), Addr::sram(0), (m * k * 4) as u64);
        dma(&mut p, Addr::guest(GUEST_BASE + (1 << 20)), Addr::sram(1 << 20), (k * n * 4) as u64);
        p.sync(Engine::DMA, Engine::vu(0), 0);
        p.push(Engine::vu(0), Instr::VConvert { from: DType::F32, to: DType::Bf16, src: 0, dst: 2 << 20, len: (m * k) as u32 });
        p.push(Engine::vu(0), Instr::VConvert { from: DType::F32, to: DType::Bf16, src: 1 << 20, dst: 3 << 20, len: (k * n) as u32 });
        p.sync(Engine::vu(0), Engine::sa(1), 1);
        p.push(Engine::sa(1), Instr::MatMul {
            dtype: DType::Bf16, flags: MatFlags::default(), a: 2 << 20, b: 3 << 20, c: 4 << 20,
            m: m as u32, k: k as u32, n: n as u32, lda: k as u32, ldb: n as u32, ldc: n as u32,
        });
        p.sync(Engine::sa(1), Engine::DMA, 2);
        dma(&mut p, Addr::sram(4 << 20), Addr::guest(GUEST_BASE + (2 << 20)), (m * n * 4) as u64);
        h.run(&p.finish()).unwrap();
        close(&h.get(2 << 20, m * n), &reference_matmul(&a, &b, m, k, n, false), 1e-5)?;
    }

    /// Convolution with stride and asymmetric padding against a direct
    /// (loop over the window) reference.
    #[test]
    fn conv2d_matches_direct_reference(nb in 1u32..3, h in 1u32..12, w in 1u32..12, cin in 1u32..6, cout in 1u32..20,
                                       kh in 1u16..4, kw in 1u16..4, sh in 1u16..3, sw in 1u16..3,
                                       pads in any::<[bool; 4]>(), seed in any::<u64>()) {
        let g = ConvGeom { n: nb, h, w, cin, cout, kh, kw, stride_h: sh, stride_w: sw,
            pad_top: pads[0] as u16, pad_bottom: pads[1] as u16, pad_left: pads[2] as u16, pad_right: pads[3] as u16 };
        let Some((ho, wo)) = g.out_hw() else { return Ok(()); };
        let x = rand_vec(seed, (nb * h * w * cin) as usize);
        let wt = rand_vec(seed ^ 3, kh as usize * kw as usize * (cin * cout) as usize);
        let mut hs = Harness::new();
        hs.put(0, &x); hs.put(1 << 20, &wt);
        let mut p = ProgramBuilder::new();
        dma(&mut p, Addr::guest(GUEST_BASE), Addr::sram(0), x.len() as u64 * 4);
        dma(&mut p, Addr::guest(GUEST_BASE + (1 << 20)), Addr::sram(1 << 20), wt.len() as u64 * 4);
        p.sync(Engine::DMA, Engine::sa(0), 0);
        p.push(Engine::sa(0), Instr::Conv2d { dtype: DType::F32, flags: MatFlags::default(), input: 0, weights: 1 << 20, output: 2 << 20, geom: g });
        p.sync(Engine::sa(0), Engine::DMA, 1);
        let out_len = (nb * ho * wo * cout) as usize;
        dma(&mut p, Addr::sram(2 << 20), Addr::guest(GUEST_BASE + (2 << 20)), out_len as u64 * 4);
        hs.run(&p.finish()).unwrap();
        let mut want = vec![0.0f32; out_len];
        for b in 0..nb as i64 { for oy in 0..ho as i64 { for ox in 0..wo as i64 { for co in 0..cout as i64 {
            let mut s = 0.0f64;
            for ky in 0..kh as i64 { for kx in 0..kw as i64 { for ci in 0..cin as i64 {
                let iy = oy * sh as i64 + ky - g.pad_top as i64;
                let ix = ox * sw as i64 + kx - g.pad_left as i64;
                if iy < 0 || ix < 0 || iy >= h as i64 || ix >= w as i64 { continue; }
                let xv = x[(((b * h as i64 + iy) * w as i64 + ix) * cin as i64 + ci) as usize];
                let wv = wt[(((ky * kw as i64 + kx) * cin as i64 + ci) * cout as i64 + co) as usize];
                s += f64::from(xv) * f64::from(wv);
            }}}
            want[(((b * ho as i64 + oy) * wo as i64 + ox) * cout as i64 + co) as usize] = s as f32;
        }}}}
        close(&hs.get(2 << 20, out_len), &want, 1e-4)?;
    }

    /// Vector unit operations against scalar references.
    #[test]
    fn vector_ops_match_reference(rows in 1u32..9, cols in 1u32..300, seed in any::<u64>()) {
        let n = (rows * cols) as usize;
        let x = rand_vec(seed, n);
        let y = rand_vec(seed ^ 5, n);
        let gamma = rand_vec(seed ^ 6, cols as usize);
        let beta = rand_vec(seed ^ 7, cols as usize);
        let mut h = Harness::new();
        h.put(0, &x); h.put(1 << 20, &y); h.put(2 << 20, &gamma); h.put(3 << 20, &beta);
        let mut p = ProgramBuilder::new();
        for (i, len) in [(0u64, n), (1, n), (2, cols as usize), (3, cols as usize)] {
            dma(&mut p, Addr::guest(GUEST_BASE + (i << 20)), Addr::sram(i << 20), len as u64 * 4);
        }
        p.sync(Engine::DMA, Engine::vu(0), 0);
        let (rs, cs) = (rows, cols);
        let out = |i: u64| (16 + i) << 18;
        let v = Engine::vu(0);
        p.push(v, Instr::VBinary { op: BinOp::Add, bcast: Bcast::None, a: 0, b: 1 << 20, dst: out(0), rows: rs, cols: cs });
        p.push(v, Instr::VBinary { op: BinOp::Mul, bcast: Bcast::Row, a: 0, b: 2 << 20, dst: out(1), rows: rs, cols: cs });
        p.push(v, Instr::VUnary { op: UnOp::Gelu, src: 0, dst: out(2), len: n as u32 });
        p.push(v, Instr::VUnary { op: UnOp::Relu, src: 0, dst: out(3), len: n as u32 });
        p.push(v, Instr::VSoftmax { src: 0, dst: out(4), rows: rs, cols: cs });
        p.push(v, Instr::VLayerNorm { src: 0, dst: out(5), gamma: 2 << 20, beta: 3 << 20, rows: rs, cols: cs, eps: 1e-5 });
        p.push(v, Instr::VReduce { op: RedOp::Max, src: 0, dst: out(6), outer: rs, reduce: cs, inner: 1 });
        p.push(v, Instr::VReduce { op: RedOp::Sum, src: 0, dst: out(7), outer: 1, reduce: rs, inner: cs });
        p.push(v, Instr::VAffine { src: 0, dst: out(8), len: n as u32, scale: 0.5, bias: -2.0 });
        p.push(v, Instr::VUnary { op: UnOp::Exp, src: 0, dst: out(9), len: n as u32 });
        p.sync(v, Engine::DMA, 1);
        for i in 0..10u64 {
            dma(&mut p, Addr::sram(out(i)), Addr::guest(GUEST_BASE + (4 << 20) + (i << 18)), n as u64 * 4);
        }
        h.run(&p.finish()).unwrap();
        let got = |i: u64, len: usize| h.get((4 << 20) + (i << 18), len);
        let (r, c) = (rows as usize, cols as usize);
        close(&got(0, n), &x.iter().zip(&y).map(|(a, b)| a + b).collect::<Vec<_>>(), 1e-6)?;
        close(&got(1, n), &x.iter().enumerate().map(|(i, a)| a * gamma[i % c]).collect::<Vec<_>>(), 1e-6)?;
        let gelu = |v: f32| { let v = f64::from(v); (0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())) as f32 };
        close(&got(2, n), &x.iter().map(|v| gelu(*v)).collect::<Vec<_>>(), 1e-5)?;
        close(&got(3, n), &x.iter().map(|v| v.max(0.0)).collect::<Vec<_>>(), 0.0)?;
        let mut sm = Vec::new();
        let mut ln = Vec::new();
        for row in x.chunks(c) {
            let mx = row.iter().fold(f64::MIN, |a, b| a.max(f64::from(*b)));
            let s: f64 = row.iter().map(|v| (f64::from(*v) - mx).exp()).sum();
            sm.extend(row.iter().map(|v| ((f64::from(*v) - mx).exp() / s) as f32));
            let mean: f64 = row.iter().map(|v| f64::from(*v)).sum::<f64>() / c as f64;
            let var: f64 = row.iter().map(|v| (f64::from(*v) - mean).powi(2)).sum::<f64>() / c as f64;
            ln.extend(row.iter().enumerate().map(|(j, v)| ((f64::from(*v) - mean) / (var + 1e-5).sqrt() * f64::from(gamma[j]) + f64::from(beta[j])) as f32));
        }
        close(&got(4, n), &sm, 1e-5)?;
        close(&got(5, n), &ln, 1e-3)?;
        close(&got(6, r), &x.chunks(c).map(|row| row.iter().fold(f32::MIN, |a, b| a.max(*b))).collect::<Vec<_>>(), 0.0)?;
        close(&got(7, c), &(0..c).map(|j| (0..r).map(|i| f64::from(x[i * c + j])).sum::<f64>() as f32).collect::<Vec<_>>(), 1e-5)?;
        close(&got(8, n), &x.iter().map(|v| v * 0.5 - 2.0).collect::<Vec<_>>(), 1e-6)?;
        close(&got(9, n), &x.iter().map(|v| v.exp()).collect::<Vec<_>>(), 1e-6)?;
    }

    /// Depthwise convolution on the VU against a direct reference.
    #[test]
    fn depthwise_matches_reference(h in 1u32..10, w in 1u32..10, c in 1u32..9, k in 1u16..4, sh in 1u16..3, sw in 1u16..3, pad in 0u16..2, seed in any::<u64>()) {
        let g = ConvGeom { n: 1, h, w, cin: c, cout: c, kh: k, kw: k, stride_h: sh, stride_w: sw, pad_top: pad, pad_bottom: pad, pad_left: pad, pad_right: pad };
        let Some((ho, wo)) = g.out_hw() else { return Ok(()); };
        let x = rand_vec(seed, (h * w * c) as usize);
        let wt = rand_vec(seed ^ 11, (k as u32 * k as u32 * c) as usize);
        let mut hs = Harness::new();
        hs.put(0, &x); hs.put(1 << 20, &wt);
        let mut p = ProgramBuilder::new();
        dma(&mut p, Addr::guest(GUEST_BASE), Addr::sram(0), x.len() as u64 * 4);
        dma(&mut p, Addr::guest(GUEST_BASE + (1 << 20)), Addr::sram(1 << 20), wt.len() as u64 * 4);
        p.sync(Engine::DMA, Engine::vu(0), 0);
        p.push(Engine::vu(0), Instr::VDepthwise { src: 0, weights: 1 << 20, dst: 2 << 20, geom: g });
        p.sync(Engine::vu(0), Engine::DMA, 1);
        let n = (ho * wo * c) as usize;
        dma(&mut p, Addr::sram(2 << 20), Addr::guest(GUEST_BASE + (2 << 20)), n as u64 * 4);
        hs.run(&p.finish()).unwrap();
        let mut want = vec![0.0f32; n];
        for oy in 0..ho as i64 { for ox in 0..wo as i64 { for ch in 0..c as i64 {
            let mut s = 0.0f64;
            for ky in 0..k as i64 { for kx in 0..k as i64 {
                let iy = oy * sh as i64 + ky - pad as i64; let ix = ox * sw as i64 + kx - pad as i64;
                if iy >= 0 && ix >= 0 && iy < h as i64 && ix < w as i64 {
                    s += f64::from(x[((iy * w as i64 + ix) * c as i64 + ch) as usize]) * f64::from(wt[((ky * k as i64 + kx) * c as i64 + ch) as usize]);
                }
            }}
            want[((oy * wo as i64 + ox) * c as i64 + ch) as usize] = s as f32;
        }}}
        close(&hs.get(2 << 20, n), &want, 1e-5)?;
    }

    /// Pooling against a direct reference.
    #[test]
    fn pool_matches_reference(h in 1u32..10, w in 1u32..10, c in 1u32..5, k in 1u16..4, stride in 1u16..3, pad in 0u16..2, max in any::<bool>(), seed in any::<u64>()) {
        let g = PoolGeom { n: 1, h, w, c, kh: k, kw: k, stride, pad };
        if pad >= k { return Ok(()); }
        let Some((ho, wo)) = g.out_hw() else { return Ok(()); };
        let x = rand_vec(seed, (h * w * c) as usize);
        let mut hs = Harness::new();
        hs.put(0, &x);
        let mut p = ProgramBuilder::new();
        dma(&mut p, Addr::guest(GUEST_BASE), Addr::sram(0), x.len() as u64 * 4);
        p.sync(Engine::DMA, Engine::vu(0), 0);
        let op = if max { PoolOp::Max } else { PoolOp::Avg };
        p.push(Engine::vu(0), Instr::VPool { op, src: 0, dst: 1 << 20, geom: g });
        p.sync(Engine::vu(0), Engine::DMA, 1);
        let n = (ho * wo * c) as usize;
        dma(&mut p, Addr::sram(1 << 20), Addr::guest(GUEST_BASE + (1 << 20)), n as u64 * 4);
        hs.run(&p.finish()).unwrap();
        let mut want = vec![0.0f32; n];
        for oy in 0..ho as i64 { for ox in 0..wo as i64 { for ch in 0..c as i64 {
            let mut vals = vec![];
            for ky in 0..k as i64 { for kx in 0..k as i64 {
                let iy = oy * stride as i64 + ky - pad as i64; let ix = ox * stride as i64 + kx - pad as i64;
                if iy >= 0 && ix >= 0 && iy < h as i64 && ix < w as i64 { vals.push(x[((iy * w as i64 + ix) * c as i64 + ch) as usize]); }
            }}
            want[((oy * wo as i64 + ox) * c as i64 + ch) as usize] = if max { vals.iter().fold(f32::MIN, |a, b| a.max(*b)) } else { vals.iter().sum::<f32>() / vals.len() as f32 };
        }}}
        close(&hs.get(1 << 20, n), &want, 1e-6)?;
    }
}

#[test]
fn strided_dma_and_gather() {
    let mut h = Harness::new();
    let table: Vec<f32> = (0..40).map(|v| v as f32).collect(); // 10 rows of 4
    h.put(0, &table);
    let idx: Vec<u8> = [3u32, 0, 9, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    h.guest.write(GUEST_BASE + 4096, &idx).unwrap();
    let mut p = ProgramBuilder::new();
    // Table into HBM, every other row only via a strided copy into SRAM.
    dma(&mut p, Addr::guest(GUEST_BASE), Addr::hbm(1 << 20), 160);
    p.push(
        Engine::DMA,
        Instr::DmaCopy {
            src: Addr::hbm(1 << 20),
            dst: Addr::sram(0),
            rows: 5,
            row_bytes: 16,
            src_stride: 32,
            dst_stride: 16,
        },
    );
    dma(&mut p, Addr::guest(GUEST_BASE + 4096), Addr::sram(4096), 16);
    p.push(
        Engine::DMA,
        Instr::DmaGather {
            table: Addr::hbm(1 << 20),
            indices: 4096,
            dst: 8192,
            count: 4,
            row_bytes: 16,
            table_rows: 10,
        },
    );
    dma(&mut p, Addr::sram(0), Addr::guest(GUEST_BASE + 8192), 80);
    dma(&mut p, Addr::sram(8192), Addr::guest(GUEST_BASE + 16384), 64);
    h.run(&p.finish()).unwrap();
    let strided = h.get(8192, 20);
    let want: Vec<f32> = (0..5).flat_map(|r| (0..4).map(move |c| (r * 8 + c) as f32)).collect();
    assert_eq!(strided, want);
    let gathered = h.get(16384, 16);
    let want: Vec<f32> = [3, 0, 9, 3].iter().flat_map(|r| (0..4).map(move |c| (r * 4 + c) as f32)).collect();
    assert_eq!(gathered, want);
}

#[test]
fn gather_index_out_of_table_fails_the_request() {
    let mut h = Harness::new();
    h.guest.write(GUEST_BASE, &10u32.to_le_bytes()).unwrap();
    let mut p = ProgramBuilder::new();
    dma(&mut p, Addr::guest(GUEST_BASE), Addr::sram(0), 4);
    p.push(
        Engine::DMA,
        Instr::DmaGather {
            table: Addr::hbm(0),
            indices: 0,
            dst: 64,
            count: 1,
            row_bytes: 16,
            table_rows: 10,
        },
    );
    let e = h.run(&p.finish()).unwrap_err();
    assert!(matches!(e, ExecError::Kernel { index: 1, .. }), "{e}");
    assert!(e.to_string().contains("outside the table"), "{e}");
}

#[test]
fn engines_run_concurrently_and_semaphores_order_them() {
    let c = cfg();
    let mm = |sa: u64| Instr::MatMul {
        dtype: DType::F32,
        flags: MatFlags::default(),
        a: 0,
        b: 0,
        c: sa << 20,
        m: 64,
        k: 16,
        n: 16,
        lda: 16,
        ldb: 16,
        ldc: 16,
    };
    let one = npu_model::timing::sa_gemm_cycles(&c, 64, 16, 16);
    // Two SAs in parallel take as long as one.
    let mut p = ProgramBuilder::new();
    p.push(Engine::sa(0), mm(1));
    p.push(Engine::sa(1), mm(2));
    let r = run_program(&c, &p.finish(), None, None).unwrap();
    assert_eq!(r.cycles, one);
    // Chained through a semaphore they take twice as long, and the waiter
    // records the wait as stall.
    let mut p = ProgramBuilder::new();
    p.push(Engine::sa(0), mm(1));
    p.sync(Engine::sa(0), Engine::sa(1), 3);
    p.push(Engine::sa(1), mm(2));
    let r = run_program(&c, &p.finish(), None, None).unwrap();
    assert_eq!(r.cycles, 2.0 * one);
    let sa1 = r.engines.iter().find(|e| e.engine == Engine::sa(1)).unwrap();
    assert_eq!(sa1.stall_cycles, one);
    assert_eq!(sa1.active_cycles, one);
}

#[test]
fn deadlock_and_budget_are_reported() {
    let c = cfg();
    let mut p = ProgramBuilder::new();
    p.push(Engine::vu(0), Instr::Wait { sem: 4 });
    let e = run_program(&c, &p.finish(), None, None).unwrap_err();
    assert_eq!(e, ExecError::Deadlock { stream: 0, engine: Engine::vu(0), index: 0, sem: 4 });

    let mut p = ProgramBuilder::new();
    for _ in 0..100 {
        p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len: 1 << 20 });
    }
    let e = run_program(&c, &p.finish(), None, Some(5000)).unwrap_err();
    assert_eq!(e, ExecError::Budget { budget: 5000 });
}

fn hbm_stream(bytes: u32, n: usize) -> Program {
    let mut p = ProgramBuilder::new();
    for i in 0..n {
        p.push(
            Engine::DMA,
            Instr::DmaCopy {
                src: Addr::hbm(0),
                dst: Addr::sram((i % 2) as u64 * u64::from(bytes)),
                rows: 1,
                row_bytes: bytes,
                src_stride: 0,
                dst_stride: 0,
            },
        );
    }
    p.finish()
}

#[test]
fn colocated_tenants_contend_for_hbm_and_fail_alone() {
    let mut c = cfg();
    // HBM slower than one DMA engine, so two tenants must share it.
    c.hbm.channels = 2;
    let heavy = hbm_stream(1 << 20, 8);
    let alone = run_program(&c, &heavy, None, None).unwrap();
    let mut ts = [
        Tenant { program: &heavy, memory: None, max_cycles: None },
        Tenant { program: &heavy, memory: None, max_cycles: None },
    ];
    let both = run_core(&c, &mut ts);
    let t0 = both.tenants[0].as_ref().unwrap();
    assert!(
        t0.cycles > 1.9 * alone.cycles && t0.cycles < 2.1 * alone.cycles,
        "{} vs {}",
        t0.cycles,
        alone.cycles
    );
    assert!(t0.totals().stall_cycles > 0.9 * alone.cycles);
    assert!((t0.totals().dma_active_cycles - alone.totals().dma_active_cycles).abs() < 1.0);

    // A tenant that reads outside its SRAM fails; its neighbour completes
    // with exactly the results and timing it has alone.
    let mut bad = ProgramBuilder::new();
    bad.push(Engine::vu(0), Instr::VUnary { op: UnOp::Copy, src: SRAM - 8, dst: 0, len: 4 });
    let bad = bad.finish();
    let mut g1 = VecGuestMemory::new(0, 64);
    let (mut s1, mut h1) = (Sram::new(SRAM), LazyHbm::new(1 << 30));
    let mut g2 = VecGuestMemory::new(0, 64);
    let (mut s2, mut h2) = (Sram::new(SRAM), LazyHbm::new(1 << 30));
    let light = hbm_stream(4096, 4);
    let mut ts = [
        Tenant {
            program: &bad,
            memory: Some(CoreMemory { sram: &mut s1, hbm: &mut h1, guest: &mut g1 }),
            max_cycles: None,
        },
        Tenant {
            program: &light,
            memory: Some(CoreMemory { sram: &mut s2, hbm: &mut h2, guest: &mut g2 }),
            max_cycles: None,
        },
    ];
    let r = run_core(&c, &mut ts);
    assert!(matches!(r.tenants[0], Err(ExecError::Kernel { .. })));
    let alone = run_program(&c, &light, None, None).unwrap();
    assert_eq!(r.tenants[1].as_ref().unwrap().cycles, alone.cycles);
}

/// Transfers whose leftover time is below one float ulp of a large
/// simulated time still complete (this once livelocked the event loop).
#[test]
fn long_runs_with_odd_transfer_sizes_terminate() {
    let mut c = cfg();
    c.hbm.channels = 3;
    let mut p = ProgramBuilder::new();
    p.push(
        Engine::sa(0),
        Instr::MatMul {
            dtype: DType::F32,
            flags: MatFlags::default(),
            a: 0,
            b: 0,
            c: 0,
            m: 1 << 30,
            k: 16,
            n: 16,
            lda: 16,
            ldb: 16,
            ldc: 16,
        },
    );
    p.sync(Engine::sa(0), Engine::DMA, 0);
    for i in 0..200u32 {
        p.push(
            Engine::DMA,
            Instr::DmaCopy {
                src: Addr::hbm(0),
                dst: Addr::sram(0),
                rows: 1,
                row_bytes: 4097 + i * 131,
                src_stride: 0,
                dst_stride: 0,
            },
        );
    }
    let heavy = hbm_stream(1 << 20, 40);
    let prog = p.finish();
    let mut ts = [
        Tenant { program: &prog, memory: None, max_cycles: None },
        Tenant { program: &heavy, memory: None, max_cycles: None },
    ];
    let r = run_core(&c, &mut ts);
    assert!(r.tenants.iter().all(|t| t.is_ok()));
    assert!(r.cycles > (1u64 << 30) as f64);
}

/// The copying path of sa.matmul (unaligned operands, output overlapping an
/// input) gives the reference result: inputs are read before C is written.
#[test]
fn matmul_with_unaligned_or_overlapping_operands() {
    let (m, k, n) = (7usize, 7usize, 7usize);
    let a = rand_vec(41, m * k);
    let b = rand_vec(42, k * n);
    let want = reference_matmul(&a, &b, m, k, n, false);
    for (sa, sb, sc) in [(2u64, 4096u64, 8192u64), (0, 4096, 0), (0, 4096, 4096)] {
        let mut h = Harness::new();
        h.put(0, &a);
        h.put(4096, &b);
        let mut p = ProgramBuilder::new();
        dma(&mut p, Addr::guest(GUEST_BASE), Addr::sram(sa), (m * k * 4) as u64);
        dma(&mut p, Addr::guest(GUEST_BASE + 4096), Addr::sram(sb), (k * n * 4) as u64);
        p.sync(Engine::DMA, Engine::sa(0), 0);
        p.push(
            Engine::sa(0),
            Instr::MatMul {
                dtype: DType::F32,
                flags: MatFlags::default(),
                a: sa,
                b: sb,
                c: sc,
                m: m as u32,
                k: k as u32,
                n: n as u32,
                lda: k as u32,
                ldb: n as u32,
                ldc: n as u32,
            },
        );
        p.sync(Engine::sa(0), Engine::DMA, 1);
        dma(&mut p, Addr::sram(sc), Addr::guest(GUEST_BASE + 65536), (m * n * 4) as u64);
        h.run(&p.finish()).unwrap();
        let got = h.get(65536, m * n);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "a@{sa} b@{sb} c@{sc}: {g} vs {w}");
        }
    }
}

/// Found by fuzzing: operands with a zero dimension have empty footprints,
/// so the verifier accepts huge other dimensions. Such instructions must
/// neither overflow nor loop over the huge dimensions.
#[test]
fn zero_sized_operands_with_huge_dimensions_are_cheap_and_safe() {
    let big = u32::MAX;
    let g = ConvGeom {
        n: big,
        h: big,
        w: big,
        cin: 0,
        cout: 0,
        kh: 1,
        kw: 1,
        stride_h: 1,
        stride_w: 1,
        pad_top: 0,
        pad_bottom: 0,
        pad_left: 0,
        pad_right: 0,
    };
    let huge_window = ConvGeom {
        n: 1,
        h: 1,
        w: 1,
        cin: 1,
        cout: 1,
        kh: 60000,
        kw: 60000,
        stride_h: 1,
        stride_w: 1,
        pad_top: 40000,
        pad_bottom: 40000,
        pad_left: 40000,
        pad_right: 40000,
    };
    // (case, engine, instruction, whether the verifier accepts it, whether
    // the functional model runs it). Zero-sized operands have empty
    // footprints and pass the verifier (but for the conv, whose input
    // size overflows); the huge window's weights do not fit SRAM. Every
    // case also runs as a program that skipped the verifier would: the
    // model refuses what it will not do with a clean error, cheaply.
    let cases = [
        (
            "depthwise with zero channels",
            Engine::vu(0),
            Instr::VDepthwise { src: 0, weights: 0, dst: 0, geom: g },
            true,
            false,
        ),
        (
            "conv with zero channels",
            Engine::sa(0),
            Instr::Conv2d {
                dtype: DType::F32,
                flags: MatFlags::default(),
                input: 0,
                weights: 0,
                output: 0,
                geom: g,
            },
            false,
            false,
        ),
        (
            "pool with zero channels",
            Engine::vu(0),
            Instr::VPool {
                op: PoolOp::Max,
                src: 0,
                dst: 0,
                geom: PoolGeom { n: big, h: big, w: big, c: 0, kh: 1, kw: 1, stride: 1, pad: 0 },
            },
            true,
            false,
        ),
        (
            "reduce with an empty inner dimension",
            Engine::vu(0),
            Instr::VReduce { op: RedOp::Sum, src: 0, dst: 0, outer: big, reduce: big, inner: 0 },
            true,
            true,
        ),
        (
            "depthwise with a 60000x60000 window",
            Engine::vu(0),
            Instr::VDepthwise { src: 0, weights: 0, dst: 0, geom: huge_window },
            false,
            false,
        ),
    ];
    let limits = npu_model::VnpuLimits {
        sa: 1,
        vu: 1,
        sram_bytes: SRAM,
        hbm_bytes: 1 << 30,
        guest: vec![],
        borrow_sa: 0,
        borrow_vu: 0,
    };
    for (name, engine, i, accepted, runs) in cases {
        let mut p = ProgramBuilder::new();
        p.push(engine, i);
        let prog = p.finish();
        assert_eq!(npu_model::verify(&prog, &limits).is_ok(), accepted, "{name}: verifier verdict");
        let start = std::time::Instant::now();
        let mut h = Harness::new();
        let functional = h.run(&prog);
        let timing = run_program(&cfg(), &prog, None, Some(1 << 30));
        // Run, or refused with a clean error (too large for the model, or
        // past the cycle budget before any host work), as named.
        let refused = |r: &Result<npu_model::TenantReport, ExecError>| match r {
            Ok(_) => false,
            Err(ExecError::Kernel { source: npu_model::kernels::KernelError::TooLarge(_), .. })
            | Err(ExecError::Budget { .. }) => true,
            Err(e) => panic!("{name}: {e}"),
        };
        assert_eq!(refused(&functional), !runs, "{name}: {functional:?}");
        // Timing alone needs no data; only the huge window costs more
        // than its 2^30-cycle budget.
        assert_eq!(refused(&timing), name.contains("window"), "{name}: timing {timing:?}");
        assert!(start.elapsed().as_secs() < 5, "{name} took {:?}", start.elapsed());
    }
}

/// An instruction that cannot finish within the cycle budget is refused
/// before the host does its work: its output is never written.
#[test]
fn over_budget_instructions_are_not_executed() {
    let mut h = Harness::new();
    h.sram.write(0, &1.5f32.to_le_bytes()).unwrap();
    let mut p = ProgramBuilder::new();
    p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 4096, len: 1 << 20 });
    let prog = p.finish();
    let mem = CoreMemory { sram: &mut h.sram, hbm: &mut h.hbm, guest: &mut h.guest };
    let e = run_program(&cfg(), &prog, Some(mem), Some(100)).unwrap_err();
    assert_eq!(e, ExecError::Budget { budget: 100 });
    let mut out = [0u8; 4];
    h.sram.read(4096, &mut out).unwrap();
    assert_eq!(f32::from_le_bytes(out), 0.0);
}

/// Found by fuzzing: an empty gather with a huge row size allocated the row.
#[test]
fn empty_gather_allocates_nothing() {
    let mut h = Harness::new();
    let mut p = ProgramBuilder::new();
    p.push(
        Engine::DMA,
        Instr::DmaGather {
            table: Addr::guest(0),
            indices: 0,
            dst: 0,
            count: 0,
            row_bytes: u32::MAX,
            table_rows: 0,
        },
    );
    p.push(
        Engine::sa(0),
        Instr::MatMul {
            dtype: DType::F32,
            flags: MatFlags::default(),
            a: 0,
            b: 1 << 40,
            c: 1 << 50,
            m: u32::MAX,
            k: 1,
            n: 0,
            lda: 0,
            ldb: 0,
            ldc: 0,
        },
    );
    let r = h.run(&p.finish()).unwrap();
    assert_eq!(r.totals().bytes, 0);
}

/// With `hbm.partition = "equal"` a tenant's HBM time no longer depends on
/// how hard its neighbour streams; with `shared` it takes what is left.
#[test]
fn equal_hbm_partition_makes_a_tenant_independent_of_its_neighbour() {
    let mut c = cfg();
    c.hbm.channels = 2;
    let victim = hbm_stream(1 << 18, 16);
    let heavy = hbm_stream(1 << 20, 64);
    // A light neighbour: a long VU computation, then a little HBM traffic.
    let mut light = ProgramBuilder::new();
    light.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len: 1 << 20 });
    light.sync(Engine::vu(0), Engine::DMA, 0);
    let light = {
        let mut p = light;
        p.push(
            Engine::DMA,
            Instr::DmaCopy {
                src: Addr::hbm(0),
                dst: Addr::sram(0),
                rows: 1,
                row_bytes: 4096,
                src_stride: 0,
                dst_stride: 0,
            },
        );
        p.finish()
    };
    let victim_next_to = |c: &BoardConfig, n: &Program| {
        let mut ts = [
            Tenant { program: &victim, memory: None, max_cycles: None },
            Tenant { program: n, memory: None, max_cycles: None },
        ];
        run_core(c, &mut ts).tenants[0].as_ref().unwrap().cycles
    };
    let (shared_light, shared_heavy) = (victim_next_to(&c, &light), victim_next_to(&c, &heavy));
    assert!(shared_heavy > 1.8 * shared_light, "{shared_heavy} vs {shared_light}");
    c.hbm.partition = npu_model::config::HbmPartition::Equal;
    let (eq_light, eq_heavy) = (victim_next_to(&c, &light), victim_next_to(&c, &heavy));
    assert!((eq_heavy - eq_light).abs() < 1e-6 * eq_light, "{eq_heavy} vs {eq_light}");
    // The price: the victim cannot use the bandwidth the light neighbour leaves idle.
    assert!(eq_light > 1.8 * shared_light);
}

/// A VU program that is busy for `n` exp passes over 1 Mi elements.
fn vu_work(n: usize) -> Program {
    let mut p = ProgramBuilder::new();
    for _ in 0..n {
        p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len: 1 << 20 });
    }
    p.finish()
}

#[test]
fn a_suspended_tenant_resumes_where_it_stopped() {
    let c = BoardConfig::test_board();
    let (long, short) = (vu_work(40), vu_work(10));
    let alone = |p: &Program| run_program(&c, p, None, None).unwrap().cycles;
    let (ta, tb) = (alone(&long), alone(&short));
    let mut a = Tenant { program: &long, memory: None, max_cycles: Some(ta.ceil() as u64 + 1) };
    let mut b = Tenant { program: &short, memory: None, max_cycles: None };
    let mut sim = CoreSim::new(&c, 2);
    let ia = sim.add(&mut a, 0.0);
    // Mid-way through an instruction.
    let t1 = ta * 0.51;
    assert!(sim.step_until(t1).is_empty());
    assert!(sim.suspend(ia) && !sim.suspend(ia));
    // Its instruction in flight finishes before its engines are free.
    let drain = sim.drain_cycles(ia);
    assert!(drain > 0.0 && drain < ta / 40.0 + 1.0, "{drain}");
    let ib = sim.add(&mut b, drain);
    let done = sim.step();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].0, ib);
    let b_end = done[0].2.as_ref().unwrap().cycles;
    assert!((b_end - (t1 + drain + tb)).abs() < 1e-6);
    assert!(sim.resume(ia, 500.0) && !sim.resume(ia, 0.0));
    let done = sim.step();
    // A did all its work once, plus B's time and the switch back; its
    // budget (its own time alone) did not run while it was suspended.
    let a_rep = done[0].2.as_ref().unwrap();
    assert!((a_rep.cycles - (ta + tb + 500.0)).abs() < 1e-6, "{} vs {}", a_rep.cycles, ta + tb + 500.0);
    assert!(sim.is_idle());
}

/// PREMA's KILL: a killed tenant leaves the core at once with the counters
/// of the work it did (lost work that kept its engine busy), frees its id,
/// and the next tenant runs as if alone.
#[test]
fn a_killed_tenant_leaves_with_what_it_did() {
    let c = BoardConfig::test_board();
    let (long, short) = (vu_work(40), vu_work(10));
    let alone = |p: &Program| run_program(&c, p, None, None).unwrap().cycles;
    let (ta, tb) = (alone(&long), alone(&short));
    let mut a = Tenant { program: &long, memory: None, max_cycles: None };
    let mut b = Tenant { program: &short, memory: None, max_cycles: None };
    let mut sim = CoreSim::new(&c, 2);
    let ia = sim.add(&mut a, 0.0);
    let t1 = ta * 0.25;
    assert!(sim.step_until(t1).is_empty());
    let (_, part) = sim.kill(ia).unwrap();
    assert!(sim.kill(ia).is_none() && sim.is_idle());
    // A quarter of 40 passes ran (its VU busy all the time until now).
    let vu = part.totals().vu_active_cycles;
    assert!((vu - t1).abs() <= ta / 40.0 + 1.0, "{vu} vs {t1}");
    assert!((part.cycles - t1).abs() < 1e-9);
    let ib = sim.add(&mut b, 0.0);
    assert_eq!(ib, ia, "the id is free again");
    let done = sim.step();
    let b_end = done[0].2.as_ref().unwrap().cycles;
    assert!((b_end - (t1 + tb)).abs() < 1e-6, "{b_end} vs {}", t1 + tb);
}

/// A tenant with a host-work budget (as the device gives one on a shared
/// core): the instruction that would pass it is refused before the model
/// does its work, and everything before it ran.
#[test]
fn the_instruction_that_passes_the_host_work_budget_is_not_executed() {
    use npu_model::timing::{host_work, TRANSCENDENTAL_UNITS};
    use npu_model::SimTenant;
    struct Capped {
        program: Program,
        sram: Sram,
        hbm: LazyHbm,
        guest: VecGuestMemory,
        budget: u64,
    }
    impl SimTenant for Capped {
        fn program(&self) -> &Program {
            &self.program
        }
        fn memory(&mut self) -> Option<CoreMemory<'_>> {
            Some(CoreMemory { sram: &mut self.sram, hbm: &mut self.hbm, guest: &mut self.guest })
        }
        fn max_cycles(&self) -> Option<u64> {
            None
        }
        fn max_host_work(&self) -> Option<u64> {
            Some(self.budget)
        }
    }
    let exp = |i: u64| Instr::VUnary { op: UnOp::Exp, src: 0, dst: 16384 * (i + 1), len: 4096 };
    assert_eq!(host_work(&exp(0)), 4096 * TRANSCENDENTAL_UNITS);
    let mut p = ProgramBuilder::new();
    for i in 0..5 {
        p.push(Engine::vu(0), exp(i));
    }
    let budget = 3 * host_work(&exp(0));
    let t = Capped {
        program: p.finish(),
        sram: Sram::new(SRAM),
        hbm: LazyHbm::new(1 << 20),
        guest: VecGuestMemory::new(0, 4096),
        budget,
    };
    let board = cfg();
    let mut sim = CoreSim::new(&board, 1);
    sim.add(t, 0.0);
    let mut done = Vec::new();
    while !sim.is_idle() {
        done.extend(sim.step());
    }
    let (_, t, r) = done.pop().unwrap();
    assert_eq!(r.unwrap_err(), ExecError::HostWork { budget });
    let at = |t: &Capped, i: u64| {
        let mut b = [0u8; 4];
        t.sram.read(16384 * (i + 1), &mut b).unwrap();
        f32::from_le_bytes(b)
    };
    // exp(0) = 1 where an instruction ran; untouched zeros after the cap.
    assert_eq!([at(&t, 0), at(&t, 1), at(&t, 2), at(&t, 3), at(&t, 4)], [1.0, 1.0, 1.0, 0.0, 0.0]);
}
