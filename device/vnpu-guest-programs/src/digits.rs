//! The two digit classifiers trained by `scripts/train_digits.py` on
//! scikit-learn's 8x8 digits: an MLP (64 -> 32 ReLU -> 10) and a small CNN
//! (conv 3x3 1->8 pad 1, ReLU, 2x2 max pool, dense 128 -> 10).
//!
//! Weight files are the fixtures' byte layout, DMAed to SRAM in one copy.

use vnpu_abi::{
    Addr, Bcast, BinOp, ConvGeom, DType, Engine, Instr, MatFlags, PoolGeom, PoolOp, Program, UnOp,
};

use crate::{copy, Pipeline};

/// Pixels per image.
pub const PIXELS: usize = 64;
/// Classes.
pub const CLASSES: usize = 10;
/// Hidden units of the MLP.
pub const HIDDEN: usize = 32;
/// Bytes of `mlp.bin`: W1[64x32] b1[32] W2[32x10] b2[10].
pub const MLP_BYTES: usize = 4 * (PIXELS * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES);
/// Channels of the CNN's convolution.
pub const CHANNELS: usize = 8;
/// Bytes of `cnn.bin`: K[3x3x1x8] bk[8] W[128x10] b[10].
pub const CNN_BYTES: usize = 4 * (9 * CHANNELS + CHANNELS + 128 * CLASSES + CLASSES);

/// Where a model lives in SRAM: weights at `base`, activations after them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SramPlan {
    pub base: u64,
}

const DMA: Engine = Engine::DMA;
const SA: Engine = Engine::sa(0);
const VU: Engine = Engine::vu(0);

fn matmul(a: u64, b: u64, c: u64, m: usize, k: usize, n: usize) -> Instr {
    Instr::MatMul {
        dtype: DType::F32,
        flags: MatFlags::default(),
        a,
        b,
        c,
        m: m as u32,
        k: k as u32,
        n: n as u32,
        lda: k as u32,
        ldb: n as u32,
        ldc: n as u32,
    }
}

fn bias(a: u64, b: u64, dst: u64, rows: usize, cols: usize) -> Instr {
    Instr::VBinary { op: BinOp::Add, bcast: Bcast::Row, a, b, dst, rows: rows as u32, cols: cols as u32 }
}

/// Loads weights of `bytes` bytes from guest address `weights` into SRAM at `plan.base`.
pub fn load_weights(plan: SramPlan, weights: u64, bytes: usize) -> Program {
    let mut p = Pipeline::new();
    p.p.push(DMA, copy(Addr::guest(weights), Addr::sram(plan.base), bytes));
    p.p.finish()
}

/// SRAM bytes the MLP needs for a batch of `batch`.
pub fn mlp_sram_bytes(batch: usize) -> u64 {
    (MLP_BYTES.next_multiple_of(64) + batch * 4 * (PIXELS + 2 * HIDDEN + 2 * CLASSES)) as u64
}

/// MLP on `batch` images at guest `x` (f32, 64 each); logits (f32, 10
/// each) to guest `out`. Weights must be loaded at `plan.base`.
pub fn mlp_infer(plan: SramPlan, batch: usize, x: u64, out: u64) -> Program {
    let b = plan.base;
    let (w1, b1) = (b, b + 4 * (PIXELS * HIDDEN) as u64);
    let w2 = b1 + 4 * HIDDEN as u64;
    let b2 = w2 + 4 * (HIDDEN * CLASSES) as u64;
    let xs = b + MLP_BYTES.next_multiple_of(64) as u64;
    let h = xs + (4 * batch * PIXELS) as u64;
    let h2 = h + (4 * batch * HIDDEN) as u64;
    let l = h2 + (4 * batch * HIDDEN) as u64;
    let l2 = l + (4 * batch * CLASSES) as u64;
    let mut p = Pipeline::new();
    p.p.push(DMA, copy(Addr::guest(x), Addr::sram(xs), 4 * batch * PIXELS));
    p.hand(DMA, SA);
    p.p.push(SA, matmul(xs, w1, h, batch, PIXELS, HIDDEN));
    p.hand(SA, VU);
    p.p.push(VU, bias(h, b1, h2, batch, HIDDEN));
    p.p.push(VU, Instr::VUnary { op: UnOp::Relu, src: h2, dst: h, len: (batch * HIDDEN) as u32 });
    p.hand(VU, SA);
    p.p.push(SA, matmul(h, w2, l, batch, HIDDEN, CLASSES));
    p.hand(SA, VU);
    p.p.push(VU, bias(l, b2, l2, batch, CLASSES));
    p.hand(VU, DMA);
    p.p.push(DMA, copy(Addr::sram(l2), Addr::guest(out), 4 * batch * CLASSES));
    p.p.finish()
}

/// SRAM bytes the CNN needs for a batch of `batch`.
pub fn cnn_sram_bytes(batch: usize) -> u64 {
    (CNN_BYTES.next_multiple_of(64) + batch * 4 * (PIXELS + 2 * PIXELS * CHANNELS + 128 + 2 * CLASSES)) as u64
}

/// CNN on `batch` images at guest `x`; logits to guest `out`. Weights must
/// be loaded at `plan.base`.
pub fn cnn_infer(plan: SramPlan, batch: usize, x: u64, out: u64) -> Program {
    let b = plan.base;
    let k = b;
    let bk = k + 4 * (9 * CHANNELS) as u64;
    let w = bk + 4 * CHANNELS as u64;
    let bw = w + 4 * (128 * CLASSES) as u64;
    let xs = b + CNN_BYTES.next_multiple_of(64) as u64;
    let c = xs + (4 * batch * PIXELS) as u64;
    let c2 = c + (4 * batch * PIXELS * CHANNELS) as u64;
    let pooled = c2 + (4 * batch * PIXELS * CHANNELS) as u64;
    let l = pooled + (4 * batch * 128) as u64;
    let l2 = l + (4 * batch * CLASSES) as u64;
    let geom = ConvGeom {
        n: batch as u32,
        h: 8,
        w: 8,
        cin: 1,
        cout: CHANNELS as u32,
        kh: 3,
        kw: 3,
        stride_h: 1,
        stride_w: 1,
        pad_top: 1,
        pad_bottom: 1,
        pad_left: 1,
        pad_right: 1,
    };
    let pool = PoolGeom { n: batch as u32, h: 8, w: 8, c: CHANNELS as u32, kh: 2, kw: 2, stride: 2, pad: 0 };
    let mut p = Pipeline::new();
    p.p.push(DMA, copy(Addr::guest(x), Addr::sram(xs), 4 * batch * PIXELS));
    p.hand(DMA, SA);
    let conv = Instr::Conv2d {
        dtype: DType::F32,
        flags: MatFlags::default(),
        input: xs,
        weights: k,
        output: c,
        geom,
    };
    p.p.push(SA, conv);
    p.hand(SA, VU);
    p.p.push(VU, bias(c, bk, c2, batch * PIXELS, CHANNELS));
    p.p.push(VU, Instr::VUnary { op: UnOp::Relu, src: c2, dst: c, len: (batch * PIXELS * CHANNELS) as u32 });
    p.p.push(VU, Instr::VPool { op: PoolOp::Max, src: c, dst: pooled, geom: pool });
    p.hand(VU, SA);
    p.p.push(SA, matmul(pooled, w, l, batch, 128, CLASSES));
    p.hand(SA, VU);
    p.p.push(VU, bias(l, bw, l2, batch, CLASSES));
    p.hand(VU, DMA);
    p.p.push(DMA, copy(Addr::sram(l2), Addr::guest(out), 4 * batch * CLASSES));
    p.p.finish()
}

/// MLP logits on the CPU (`w` = `mlp.bin` as f32s).
pub fn mlp_cpu(w: &[f32], x: &[f32]) -> [f32; CLASSES] {
    let (w1, rest) = w.split_at(PIXELS * HIDDEN);
    let (b1, rest) = rest.split_at(HIDDEN);
    let (w2, b2) = rest.split_at(HIDDEN * CLASSES);
    let mut h = [0f32; HIDDEN];
    for (j, hj) in h.iter_mut().enumerate() {
        let mut s = 0f32;
        for i in 0..PIXELS {
            s += x[i] * w1[i * HIDDEN + j];
        }
        *hj = (s + b1[j]).max(0.0);
    }
    let mut out = [0f32; CLASSES];
    for (j, o) in out.iter_mut().enumerate() {
        let mut s = 0f32;
        for i in 0..HIDDEN {
            s += h[i] * w2[i * CLASSES + j];
        }
        *o = s + b2[j];
    }
    out
}

/// CNN logits on the CPU (`w` = `cnn.bin` as f32s).
pub fn cnn_cpu(w: &[f32], x: &[f32]) -> [f32; CLASSES] {
    let (k, rest) = w.split_at(9 * CHANNELS);
    let (bk, rest) = rest.split_at(CHANNELS);
    let (wd, bd) = rest.split_at(128 * CLASSES);
    // Conv + bias + ReLU, NHWC.
    let mut a = [0f32; 64 * CHANNELS];
    for y in 0..8i32 {
        for xx in 0..8i32 {
            for c in 0..CHANNELS {
                let mut s = 0f32;
                for dy in 0..3i32 {
                    for dx in 0..3i32 {
                        let (iy, ix) = (y + dy - 1, xx + dx - 1);
                        if (0..8).contains(&iy) && (0..8).contains(&ix) {
                            s += x[(iy * 8 + ix) as usize] * k[((dy * 3 + dx) as usize) * CHANNELS + c];
                        }
                    }
                }
                a[((y * 8 + xx) as usize) * CHANNELS + c] = (s + bk[c]).max(0.0);
            }
        }
    }
    // 2x2 max pool -> 4x4x8, flattened (h, w, c).
    let mut p = [0f32; 128];
    for y in 0..4 {
        for xx in 0..4 {
            for c in 0..CHANNELS {
                let at = |yy: usize, xc: usize| a[(yy * 8 + xc) * CHANNELS + c];
                let m = at(2 * y, 2 * xx)
                    .max(at(2 * y, 2 * xx + 1))
                    .max(at(2 * y + 1, 2 * xx))
                    .max(at(2 * y + 1, 2 * xx + 1));
                p[(y * 4 + xx) * CHANNELS + c] = m;
            }
        }
    }
    let mut out = [0f32; CLASSES];
    for (j, o) in out.iter_mut().enumerate() {
        let mut s = 0f32;
        for (i, pi) in p.iter().enumerate() {
            s += pi * wd[i * CLASSES + j];
        }
        *o = s + bd[j];
    }
    out
}

/// Guest-physical layout the `digits` guest uses (64 MiB of RAM), shared
/// with the host's in-process baseline so both run identical programs.
pub mod layout {
    /// `mlp.bin`.
    pub const MLP_WEIGHTS: u64 = 0x300_0000;
    /// `cnn.bin`.
    pub const CNN_WEIGHTS: u64 = 0x300_4000;
    /// `test_x.bin` (the whole test split).
    pub const TEST_X: u64 = 0x301_0000;
    /// Logits of a batch run.
    pub const BATCH_OUT: u64 = 0x303_0000;
    /// One image, for batch-1 runs.
    pub const ONE_X: u64 = 0x304_0000;
    /// Logits of a batch-1 run.
    pub const ONE_OUT: u64 = 0x304_1000;
    /// End of the layout.
    pub const END: u64 = 0x304_2000;
    /// SRAM plan of the MLP.
    pub const MLP_SRAM: super::SramPlan = super::SramPlan { base: 0 };
    /// SRAM plan of the CNN.
    pub const CNN_SRAM: super::SramPlan = super::SramPlan { base: 0x8_0000 };
}

/// The throughput benchmark's protocol between the `digits` guest and the
/// host (`vnpu demo`): round by round, the guest times one batch request
/// (one in flight) on the TSC and reports it through the VMM's benchmark
/// register `id(model, warm)`; the host then runs the same batch program
/// in-process, timed on the same TSC, before the guest's next round.
pub mod bench {
    /// Untimed rounds first on both sides.
    pub const WARMUP: usize = 2;
    /// Timed rounds per model.
    pub const ROUNDS: usize = 15;
    /// Index of the MLP in `id`.
    pub const MLP: u32 = 0;
    /// Index of the CNN in `id`.
    pub const CNN: u32 = 1;

    /// The benchmark register a round of `model` is reported on.
    pub const fn id(model: u32, warm: bool) -> u32 {
        2 * model + warm as u32
    }

    /// `(model, warm)` of a benchmark register id (`None` for others).
    pub const fn parse(id: u32) -> Option<(u32, bool)> {
        if id < 4 {
            Some((id / 2, id % 2 == 1))
        } else {
            None
        }
    }
}
