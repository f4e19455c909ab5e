//! Random well-formed programs (every instruction kind, random shapes,
//! strides, dtypes, flags, in-place and overlapping operands, random
//! semaphores between streams) on the model and on the reference, from
//! memories holding random numbers with a few NaNs and infinities.

use std::collections::BTreeMap;

use npu_difftest::{check, check_on, Outcome};
use npu_model::{BoardConfig, VnpuLimits};
use npu_reference::Machine;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use vnpu_abi::{
    Addr, Bcast, BinOp, ConvGeom, DType, Engine, Instr, MatFlags, PoolGeom, PoolOp, ProgramBuilder, RedOp,
    UnOp,
};

const SRAM: u64 = 32 << 10;
const HBM: u64 = 64 << 10;
const GUEST_BASE: u64 = 0x10000;
const GUEST: u64 = 16 << 10;
/// SRAM bytes [0, INDICES) hold small u32 gather indices.
const INDICES: u64 = 256;

fn limits() -> VnpuLimits {
    VnpuLimits {
        sa: 2,
        vu: 2,
        sram_bytes: SRAM,
        hbm_bytes: HBM,
        guest: std::iter::once(GUEST_BASE..GUEST_BASE + GUEST).collect(),
        borrow_sa: 0,
        borrow_vu: 0,
    }
}

fn value(rng: &mut StdRng) -> f32 {
    match rng.random_range(0..200) {
        0 => f32::NAN,
        1 => f32::INFINITY,
        2 => f32::NEG_INFINITY,
        3 => 0.0,
        4 => 1e30,
        _ => rng.random_range(-4.0f32..4.0),
    }
}

fn memory(rng: &mut StdRng) -> Machine {
    let mut m = Machine::new(SRAM as usize, HBM as usize, &[(GUEST_BASE, GUEST as usize)]);
    let fill = |rng: &mut StdRng, v: &mut [u8]| {
        for c in v.chunks_exact_mut(4) {
            c.copy_from_slice(&value(rng).to_le_bytes());
        }
    };
    fill(rng, &mut m.sram);
    fill(rng, &mut m.hbm);
    fill(rng, &mut m.guest[0].1);
    for i in 0..INDICES / 4 {
        let idx: u32 = rng.random_range(0..8);
        m.sram[(i * 4) as usize..(i * 4 + 4) as usize].copy_from_slice(&idx.to_le_bytes());
    }
    m
}

/// An offset for `bytes` in a segment of `size` bytes past `floor`,
/// mostly 4-byte aligned (sometimes 2, to leave the model's in-place
/// fast paths).
fn place(rng: &mut StdRng, floor: u64, size: u64, bytes: u64) -> u64 {
    let room = size.saturating_sub(floor + bytes).max(1);
    let o = floor + rng.random_range(0..room);
    if rng.random_range(0..8) == 0 {
        o & !1
    } else {
        o & !3
    }
}

fn dim(rng: &mut StdRng, hi: u32) -> u32 {
    rng.random_range(1..=hi)
}

fn dtype(rng: &mut StdRng) -> DType {
    if rng.random_bool(0.3) {
        DType::Bf16
    } else {
        DType::F32
    }
}

fn sram(rng: &mut StdRng, bytes: u64) -> u64 {
    place(rng, INDICES, SRAM, bytes)
}

/// Sometimes the same operand (in place), else a random one.
fn maybe_same(rng: &mut StdRng, other: u64, bytes: u64) -> u64 {
    if rng.random_range(0..4) == 0 {
        other
    } else {
        sram(rng, bytes)
    }
}

fn space(rng: &mut StdRng) -> (vnpu_abi::Space, u64, u64) {
    match rng.random_range(0..3) {
        0 => (vnpu_abi::Space::Sram, INDICES, SRAM),
        1 => (vnpu_abi::Space::Hbm, 0, HBM),
        _ => (vnpu_abi::Space::Guest, GUEST_BASE, GUEST_BASE + GUEST),
    }
}

fn dma(rng: &mut StdRng) -> Instr {
    if rng.random_range(0..3) == 0 {
        let (sp, lo, hi) = space(rng);
        let row_bytes = rng.random_range(1..64);
        let table_rows = rng.random_range(1..=8);
        let count = dim(rng, 16);
        return Instr::DmaGather {
            table: Addr { space: sp, offset: place(rng, lo, hi, u64::from(table_rows * row_bytes)) },
            indices: rng.random_range(0..INDICES / 4 - u64::from(count)) * 4,
            dst: sram(rng, u64::from(count * row_bytes)),
            count,
            row_bytes,
            table_rows,
        };
    }
    let (s, slo, shi) = space(rng);
    let (d, dlo, dhi) = space(rng);
    let rows = dim(rng, 8);
    // Mostly short rows; sometimes rows long enough to be copied in place.
    let row_bytes = if rng.random_bool(0.2) { rng.random_range(256..700) } else { rng.random_range(1..128) };
    let src_stride = u64::from(row_bytes) + rng.random_range(0..3) * 4;
    let dst_stride = u64::from(row_bytes) + rng.random_range(0..3) * 4;
    let src_span = (u64::from(rows) - 1) * src_stride + u64::from(row_bytes);
    let dst_span = (u64::from(rows) - 1) * dst_stride + u64::from(row_bytes);
    let src = place(rng, slo, shi, src_span);
    // Same space: sometimes overlapping the source.
    let dst = if s == d && rng.random_bool(0.3) {
        (src + rng.random_range(0..16)).min(dhi.saturating_sub(dst_span))
    } else {
        place(rng, dlo, dhi, dst_span)
    };
    Instr::DmaCopy {
        src: Addr { space: s, offset: src },
        dst: Addr { space: d, offset: dst },
        rows,
        row_bytes,
        src_stride,
        dst_stride,
    }
}

fn sa(rng: &mut StdRng) -> Instr {
    let dt = dtype(rng);
    let flags = MatFlags { accumulate: rng.random_bool(0.3), transpose_b: rng.random_bool(0.3) };
    if rng.random_bool(0.5) {
        let (m, k, n) = (dim(rng, 12), dim(rng, 12), dim(rng, 12));
        let lda = k + rng.random_range(0..3);
        let ldb = if flags.transpose_b { k } else { n } + rng.random_range(0..3);
        let ldc = n + rng.random_range(0..3);
        let s = dt.size();
        let b_rows = if flags.transpose_b { n } else { k };
        return Instr::MatMul {
            dtype: dt,
            flags,
            a: sram(rng, u64::from(m * lda) * s),
            b: sram(rng, u64::from(b_rows * ldb) * s),
            c: sram(rng, u64::from(m * ldc) * 4),
            m,
            k,
            n,
            lda,
            ldb,
            ldc,
        };
    }
    let (kh, kw) = (dim(rng, 3) as u16, dim(rng, 3) as u16);
    let pad = |rng: &mut StdRng| rng.random_range(0..2u16);
    let geom = ConvGeom {
        n: dim(rng, 2),
        h: u32::from(kh) + rng.random_range(0..4),
        w: u32::from(kw) + rng.random_range(0..4),
        cin: dim(rng, 4),
        cout: dim(rng, 4),
        kh,
        kw,
        stride_h: dim(rng, 2) as u16,
        stride_w: dim(rng, 2) as u16,
        pad_top: pad(rng),
        pad_bottom: pad(rng),
        pad_left: pad(rng),
        pad_right: pad(rng),
    };
    let (ho, wo) = geom.out_hw().unwrap_or((1, 1));
    let s = dt.size();
    Instr::Conv2d {
        dtype: dt,
        flags: MatFlags { transpose_b: false, ..flags },
        input: sram(rng, u64::from(geom.n * geom.h * geom.w * geom.cin) * s),
        weights: sram(rng, u64::from(u32::from(kh * kw) * geom.cin * geom.cout) * s),
        output: sram(rng, u64::from(geom.n * ho * wo * geom.cout) * 4),
        geom,
    }
}

fn vu(rng: &mut StdRng) -> Instr {
    let (rows, cols) = (dim(rng, 8), dim(rng, 16));
    let n = u64::from(rows * cols) * 4;
    match rng.random_range(0..11) {
        0 => {
            let a = sram(rng, n);
            let bcast = *pick(rng, Bcast::ALL);
            let b_len = match bcast {
                Bcast::None => n,
                Bcast::Row => u64::from(cols) * 4,
                Bcast::Scalar => 4,
            };
            Instr::VBinary {
                op: *pick(rng, BinOp::ALL),
                bcast,
                a,
                b: sram(rng, b_len),
                dst: maybe_same(rng, a, n),
                rows,
                cols,
            }
        }
        1 => {
            let src = sram(rng, n);
            Instr::VUnary { op: *pick(rng, UnOp::ALL), src, dst: maybe_same(rng, src, n), len: rows * cols }
        }
        2 => {
            let src = sram(rng, n);
            Instr::VAffine {
                src,
                dst: maybe_same(rng, src, n),
                len: rows * cols,
                scale: rng.random_range(-4.0..4.0),
                bias: rng.random_range(-2.0..2.0),
            }
        }
        3 => {
            let inner = dim(rng, 4);
            Instr::VReduce {
                op: *pick(rng, RedOp::ALL),
                src: sram(rng, n * u64::from(inner)),
                dst: sram(rng, u64::from(rows * inner) * 4),
                outer: rows,
                reduce: cols,
                inner,
            }
        }
        4 => {
            let src = sram(rng, n);
            Instr::VSoftmax { src, dst: maybe_same(rng, src, n), rows, cols }
        }
        5 => {
            let src = sram(rng, n);
            Instr::VLayerNorm {
                src,
                dst: maybe_same(rng, src, n),
                gamma: sram(rng, u64::from(cols) * 4),
                beta: sram(rng, u64::from(cols) * 4),
                rows,
                cols,
                eps: *pick(rng, &[0.0, 1e-5, 1.0]),
            }
        }
        6 => {
            let (kh, kw) = (dim(rng, 3) as u16, dim(rng, 3) as u16);
            let geom = PoolGeom {
                n: dim(rng, 2),
                h: u32::from(kh) + rng.random_range(0..4),
                w: u32::from(kw) + rng.random_range(0..4),
                c: dim(rng, 4),
                kh,
                kw,
                stride: dim(rng, 2) as u16,
                pad: rng.random_range(0..kh.min(kw)),
            };
            let (ho, wo) = geom.out_hw().unwrap_or((1, 1));
            Instr::VPool {
                op: *pick(rng, PoolOp::ALL),
                src: sram(rng, u64::from(geom.n * geom.h * geom.w * geom.c) * 4),
                dst: sram(rng, u64::from(geom.n * ho * wo * geom.c) * 4),
                geom,
            }
        }
        7 => {
            let c = dim(rng, 4);
            let (kh, kw) = (dim(rng, 3) as u16, dim(rng, 3) as u16);
            let geom = ConvGeom {
                n: dim(rng, 2),
                h: u32::from(kh) + rng.random_range(0..4),
                w: u32::from(kw) + rng.random_range(0..4),
                cin: c,
                cout: c,
                kh,
                kw,
                stride_h: dim(rng, 2) as u16,
                stride_w: dim(rng, 2) as u16,
                pad_top: rng.random_range(0..2),
                pad_bottom: rng.random_range(0..2),
                pad_left: rng.random_range(0..2),
                pad_right: rng.random_range(0..2),
            };
            let (ho, wo) = geom.out_hw().unwrap_or((1, 1));
            Instr::VDepthwise {
                src: sram(rng, u64::from(geom.n * geom.h * geom.w * c) * 4),
                weights: sram(rng, u64::from(u32::from(kh * kw) * c) * 4),
                dst: sram(rng, u64::from(geom.n * ho * wo * c) * 4),
                geom,
            }
        }
        9 => {
            let src = sram(rng, n);
            Instr::VRmsNorm {
                src,
                dst: maybe_same(rng, src, n),
                gamma: sram(rng, u64::from(cols) * 4),
                rows,
                cols,
                eps: *pick(rng, &[0.0, 1e-6, 1.0]),
            }
        }
        8 => {
            let src = sram(rng, n);
            let (a, b) = (rng.random_range(-2.0..2.0f32), rng.random_range(-2.0..2.0f32));
            Instr::VClamp { src, dst: maybe_same(rng, src, n), len: rows * cols, lo: a.min(b), hi: a.max(b) }
        }
        _ => {
            let (from, to) = (dtype(rng), dtype(rng));
            let len = rows * cols;
            Instr::VConvert {
                from,
                to,
                src: sram(rng, u64::from(len) * from.size()),
                dst: sram(rng, u64::from(len) * to.size()),
                len,
            }
        }
    }
}

fn pick<'a, T>(rng: &mut StdRng, all: &'a [T]) -> &'a T {
    &all[rng.random_range(0..all.len())]
}

fn program(rng: &mut StdRng) -> vnpu_abi::Program {
    program_on(rng, &[Engine::DMA, Engine::sa(0), Engine::sa(1), Engine::vu(0), Engine::vu(1)])
}

fn program_on(rng: &mut StdRng, engines: &[Engine]) -> vnpu_abi::Program {
    let mut b = ProgramBuilder::new();
    for _ in 0..rng.random_range(1..10) {
        let e = *pick(rng, engines);
        if rng.random_range(0..4) == 0 {
            let waiter = *pick(rng, engines);
            if waiter != e {
                b.sync(e, waiter, rng.random_range(0..4));
            }
            continue;
        }
        let i = match e.kind {
            vnpu_abi::EngineKind::Dma => dma(rng),
            vnpu_abi::EngineKind::Sa => sa(rng),
            vnpu_abi::EngineKind::Vu => vu(rng),
        };
        b.push(e, i);
    }
    if b.is_empty() {
        b.push(Engine::vu(0), Instr::VUnary { op: UnOp::Copy, src: INDICES, dst: INDICES + 64, len: 1 });
    }
    b.finish()
}

#[test]
fn random_verified_programs_match_the_reference() {
    let board = BoardConfig::default();
    // DIFFTEST_SEED and DIFFTEST_CASES run other and longer searches.
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let mut rng = StdRng::seed_from_u64(env("DIFFTEST_SEED", 0x5eed_d1ff));
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut completed_instrs: BTreeMap<&str, usize> = BTreeMap::new();
    let cases = env("DIFFTEST_CASES", 2000) as usize;
    for case in 0..cases {
        let p = program(&mut rng);
        let initial = memory(&mut rng);
        match check(&board, &p, &limits(), &initial, Some(1 << 30)) {
            Err(m) => panic!("case {case}: {m}\nprogram: {p:#?}"),
            Ok(o) => {
                let name = match &o {
                    Outcome::Rejected(e) => {
                        panic!("case {case}: the generator made a program the verifier refuses: {e}")
                    }
                    Outcome::Completed { .. } => "completed",
                    Outcome::Failed(npu_model::ExecError::Deadlock { .. }) => "deadlock",
                    Outcome::Failed(npu_model::ExecError::Kernel { .. }) => "kernel failure",
                    Outcome::Failed(_) => "other failure",
                    Outcome::Skipped { .. } => "skipped",
                };
                *outcomes.entry(name).or_default() += 1;
                if matches!(o, Outcome::Completed { .. }) {
                    for s in &p.streams {
                        for i in &s.code {
                            *completed_instrs.entry(i.mnemonic()).or_default() += 1;
                        }
                    }
                }
            }
        }
    }
    eprintln!("outcomes: {outcomes:?}\ninstructions in completed programs: {completed_instrs:?}");
    // Not vacuous: most programs complete, and every instruction kind is
    // compared many times.
    let done = outcomes.get("completed").copied().unwrap_or(0);
    assert!(done * 2 > cases, "only {done} of {cases} programs completed: {outcomes:?}");
    for m in [
        "dma.copy",
        "dma.gather",
        "sa.matmul",
        "sa.conv2d",
        "vu.binary",
        "vu.unary",
        "vu.affine",
        "vu.reduce",
        "vu.softmax",
        "vu.layernorm",
        "vu.pool",
        "vu.depthwise",
        "vu.convert",
    ] {
        let n = completed_instrs.get(m).copied().unwrap_or(0);
        assert!(n >= 20, "{m} compared only {n} times");
    }
    assert!(outcomes.get("kernel failure").copied().unwrap_or(0) > 0, "no gather ever failed: {outcomes:?}");
}

/// Spread programs (four logical SA and four logical VU streams on a vNPU
/// of one SA and one VU that may borrow three of each) match the
/// reference on every number of engines the core may give them: each
/// gives another order of effects, and each order must be one the ISA
/// allows with the reference's values. Not spread, the same programs are
/// refused.
#[test]
fn spread_programs_match_the_reference_on_any_engines() {
    let board = BoardConfig::default();
    let mut rng = StdRng::seed_from_u64(0x5b7e_ad00);
    let engines: Vec<Engine> =
        std::iter::once(Engine::DMA).chain((0..4).flat_map(|i| [Engine::sa(i), Engine::vu(i)])).collect();
    let spread = VnpuLimits { sa: 1, vu: 1, borrow_sa: 3, borrow_vu: 3, ..limits() };
    let (mut completed, mut refused) = (0, 0);
    let cases = 300;
    for case in 0..cases {
        let mut p = program_on(&mut rng, &engines);
        let initial = memory(&mut rng);
        if p.streams.iter().any(|s| s.engine.index > 0) {
            let bound = check(&board, &p, &spread, &initial, Some(1 << 30)).unwrap();
            assert!(matches!(bound, Outcome::Rejected(_)), "case {case}: not spread, yet {bound:?}");
            refused += 1;
        }
        p.spread = true;
        for width in [None, Some([1, 1]), Some([2, 1]), Some([1, 3]), Some([4, 4])] {
            match check_on(&board, &p, &spread, &initial, Some(1 << 30), width) {
                Err(m) => panic!("case {case} on {width:?}: {m}\nprogram: {p:#?}"),
                Ok(Outcome::Rejected(e)) => panic!("case {case}: refused: {e}"),
                Ok(Outcome::Completed { .. }) => completed += 1,
                Ok(_) => {}
            }
        }
    }
    assert!(completed * 2 > cases * 5, "only {completed} of {} runs completed", cases * 5);
    assert!(refused * 2 > cases, "only {refused} of {cases} programs used a borrowed engine index");
}
