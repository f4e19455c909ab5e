//! A DLRM-like recommendation model, VU-heavy as DLRM is: embedding bags
//! (a DMA gather of `FEATURES` rows per sample from an HBM table, summed on
//! the VU) feed a small MLP on the SA (64 -> 16 ReLU -> 1, sigmoid). The
//! gather and the pooling dominate; the SA is mostly idle.

use alloc::vec;
use alloc::vec::Vec;

use vnpu_abi::{Addr, Bcast, BinOp, DType, Engine, Instr, MatFlags, Program, RedOp, UnOp};

use crate::selfcheck::Rng;
use crate::{copy, Pipeline};

/// Rows of the embedding table.
pub const ROWS: usize = 1024;
/// Embedding width.
pub const DIM: usize = 64;
/// Lookups pooled per sample.
pub const FEATURES: usize = 32;
/// Hidden units of the MLP.
pub const HIDDEN: usize = 16;

/// The model: table [ROWS x DIM], W1 [DIM x HIDDEN], b1, w2 [HIDDEN], b2.
#[derive(Clone, Debug)]
pub struct Model {
    pub table: Vec<f32>,
    /// W1, b1, w2, b2 packed (the SRAM layout of the MLP).
    pub mlp: Vec<f32>,
}

impl Model {
    pub fn random(seed: u64) -> Self {
        let mut r = Rng::new(seed);
        let table = (0..ROWS * DIM).map(|_| r.unit() * 0.5).collect();
        let n = DIM * HIDDEN + HIDDEN + HIDDEN + 1;
        let mlp = (0..n).map(|_| r.unit() * 0.25).collect();
        Self { table, mlp }
    }
}

/// Random lookups for `batch` samples (u32 row indices).
pub fn random_indices(batch: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..batch * FEATURES).map(|_| r.below(ROWS as u32)).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Bytes of the table and of the MLP weights, as they go to guest memory.
pub fn weight_bytes(m: &Model) -> (Vec<u8>, Vec<u8>) {
    (f32_bytes(&m.table), f32_bytes(&m.mlp))
}

const DMA: Engine = Engine::DMA;
const SA: Engine = Engine::sa(0);
const VU: Engine = Engine::vu(0);
/// SRAM offset of the MLP weights.
const MLP_AT: u64 = 0;
/// SRAM offset of the activations.
const ACT_AT: u64 = 0x4000;

/// Loads the table (guest `table` -> HBM 0) and the MLP (guest `mlp` -> SRAM).
pub fn load(table: u64, mlp: u64) -> Program {
    let mut p = Pipeline::new();
    p.p.push(DMA, copy(Addr::guest(table), Addr::hbm(0), 4 * ROWS * DIM));
    p.p.push(DMA, copy(Addr::guest(mlp), Addr::sram(MLP_AT), 4 * (DIM * HIDDEN + 2 * HIDDEN + 1)));
    p.p.finish()
}

/// SRAM the inference of `batch` samples needs.
pub fn sram_bytes(batch: usize) -> u64 {
    ACT_AT + (4 * batch * (FEATURES + FEATURES * DIM + DIM + 2 * HIDDEN + 4)) as u64 + 4096
}

/// Click probabilities of `batch` samples whose lookups (u32) are at guest
/// `indices`; results (f32 each) to guest `out`.
pub fn infer(batch: usize, indices: u64, out: u64) -> Program {
    let w = |e: usize| (4 * e) as u64;
    let (w1, b1) = (MLP_AT, MLP_AT + w(DIM * HIDDEN));
    let (w2, b2) = (b1 + w(HIDDEN), b1 + w(2 * HIDDEN));
    let idx = ACT_AT;
    let emb = idx + w(batch * FEATURES).next_multiple_of(64);
    let pooled = emb + w(batch * FEATURES * DIM);
    let h = pooled + w(batch * DIM);
    let h2 = h + w(batch * HIDDEN);
    let o = h2 + w(batch * HIDDEN);
    let o2 = o + w(batch).next_multiple_of(64);
    let mut p = Pipeline::new();
    p.p.push(DMA, copy(Addr::guest(indices), Addr::sram(idx), 4 * batch * FEATURES));
    let rows = (batch * FEATURES) as u32;
    p.p.push(
        DMA,
        Instr::DmaGather {
            table: Addr::hbm(0),
            indices: idx,
            dst: emb,
            count: rows,
            row_bytes: w(DIM) as u32,
            table_rows: ROWS as u32,
        },
    );
    p.hand(DMA, VU);
    let (b, f, d) = (batch as u32, FEATURES as u32, DIM as u32);
    p.p.push(VU, Instr::VReduce { op: RedOp::Sum, src: emb, dst: pooled, outer: b, reduce: f, inner: d });
    p.hand(VU, SA);
    let mm = |a, bm, c, m: usize, k: usize, n: usize| Instr::MatMul {
        dtype: DType::F32,
        flags: MatFlags::default(),
        a,
        b: bm,
        c,
        m: m as u32,
        k: k as u32,
        n: n as u32,
        lda: k as u32,
        ldb: n as u32,
        ldc: n as u32,
    };
    p.p.push(SA, mm(pooled, w1, h, batch, DIM, HIDDEN));
    p.hand(SA, VU);
    p.p.push(
        VU,
        Instr::VBinary {
            op: BinOp::Add,
            bcast: Bcast::Row,
            a: h,
            b: b1,
            dst: h2,
            rows: b,
            cols: HIDDEN as u32,
        },
    );
    p.p.push(VU, Instr::VUnary { op: UnOp::Relu, src: h2, dst: h, len: b * HIDDEN as u32 });
    p.hand(VU, SA);
    p.p.push(SA, mm(h, w2, o, batch, HIDDEN, 1));
    p.hand(SA, VU);
    p.p.push(
        VU,
        Instr::VBinary { op: BinOp::Add, bcast: Bcast::Row, a: o, b: b2, dst: o2, rows: b, cols: 1 },
    );
    p.p.push(VU, Instr::VUnary { op: UnOp::Sigmoid, src: o2, dst: o, len: b });
    p.hand(VU, DMA);
    p.p.push(DMA, copy(Addr::sram(o), Addr::guest(out), 4 * batch));
    p.p.finish()
}

/// The same on the CPU.
pub fn cpu(m: &Model, indices: &[u32]) -> Vec<f32> {
    let batch = indices.len() / FEATURES;
    let (w1, rest) = m.mlp.split_at(DIM * HIDDEN);
    let (b1, rest) = rest.split_at(HIDDEN);
    let (w2, b2) = rest.split_at(HIDDEN);
    let mut out = vec![0f32; batch];
    for (s, o) in out.iter_mut().enumerate() {
        let mut pooled = [0f32; DIM];
        for f in 0..FEATURES {
            let r = indices[s * FEATURES + f] as usize;
            for (d, p) in pooled.iter_mut().enumerate() {
                *p += m.table[r * DIM + d];
            }
        }
        let mut z = b2[0];
        for j in 0..HIDDEN {
            let mut a = 0f32;
            for (d, p) in pooled.iter().enumerate() {
                a += p * w1[d * HIDDEN + j];
            }
            z += (a + b1[j]).max(0.0) * w2[j];
        }
        *o = 1.0 / (1.0 + libm::expf(-z));
    }
    out
}
