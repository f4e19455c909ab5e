//! One Transformer encoder layer (post-layer-norm, as BERT): multi-head
//! self-attention with a real softmax, residual + layer norm, a GELU
//! feed-forward block, residual + layer norm. Matmuls on the SA, the rest
//! on the VU. Random weights from a seed; a CPU reference in f32 (libm).

use alloc::vec;
use alloc::vec::Vec;

use vnpu_abi::{Addr, Bcast, BinOp, DType, Engine, Instr, MatFlags, Program, UnOp};

use crate::selfcheck::Rng;
use crate::Pipeline;

/// Layer shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Tokens.
    pub seq: usize,
    /// Model width.
    pub d: usize,
    /// Attention heads (`d` divisible by it).
    pub heads: usize,
    /// Feed-forward width.
    pub ffn: usize,
}

/// Layer norm epsilon.
pub const EPS: f32 = 1e-5;

/// The weights, in the order they are packed (each a row-major f32 matrix
/// or vector): Wq Wk Wv Wo [d x d], bq bk bv bo [d], W1 [d x ffn], b1
/// [ffn], W2 [ffn x d], b2 [d], gamma1 beta1 gamma2 beta2 [d].
#[derive(Clone, Debug)]
pub struct Weights {
    pub shape: Shape,
    pub packed: Vec<f32>,
}

/// Offsets (in f32 elements) of each tensor in [`Weights::packed`].
#[derive(Clone, Copy, Debug)]
struct Offsets {
    wq: usize,
    wk: usize,
    wv: usize,
    wo: usize,
    bq: usize,
    bk: usize,
    bv: usize,
    bo: usize,
    w1: usize,
    b1: usize,
    w2: usize,
    b2: usize,
    g1: usize,
    be1: usize,
    g2: usize,
    be2: usize,
    end: usize,
}

fn offsets(s: Shape) -> Offsets {
    let (d, f) = (s.d, s.ffn);
    let mut at = 0;
    let mut take = |n: usize| {
        let o = at;
        at += n;
        o
    };
    let (wq, wk, wv, wo) = (take(d * d), take(d * d), take(d * d), take(d * d));
    let (bq, bk, bv, bo) = (take(d), take(d), take(d), take(d));
    let (w1, b1, w2, b2) = (take(d * f), take(f), take(f * d), take(d));
    let (g1, be1, g2, be2) = (take(d), take(d), take(d), take(d));
    Offsets { wq, wk, wv, wo, bq, bk, bv, bo, w1, b1, w2, b2, g1, be1, g2, be2, end: at }
}

impl Weights {
    /// Random weights (scaled 1/sqrt(fan-in)), gammas near 1.
    pub fn random(shape: Shape, seed: u64) -> Self {
        let o = offsets(shape);
        let mut rng = Rng::new(seed);
        let mut packed = vec![0f32; o.end];
        let fill = |v: &mut [f32], scale: f32, shift: f32, rng: &mut Rng| {
            v.iter_mut().for_each(|x| *x = shift + scale * rng.unit());
        };
        let sd = 1.0 / libm::sqrtf(shape.d as f32);
        let sf = 1.0 / libm::sqrtf(shape.ffn as f32);
        fill(&mut packed[..o.bq], sd, 0.0, &mut rng);
        fill(&mut packed[o.bq..o.w1], 0.1, 0.0, &mut rng);
        fill(&mut packed[o.w1..o.b1], sd, 0.0, &mut rng);
        fill(&mut packed[o.b1..o.w2], 0.1, 0.0, &mut rng);
        fill(&mut packed[o.w2..o.b2], sf, 0.0, &mut rng);
        fill(&mut packed[o.b2..o.g1], 0.1, 0.0, &mut rng);
        for t in [o.g1, o.g2] {
            fill(&mut packed[t..t + shape.d], 0.1, 1.0, &mut rng);
        }
        for t in [o.be1, o.be2] {
            fill(&mut packed[t..t + shape.d], 0.1, 0.0, &mut rng);
        }
        Self { shape, packed }
    }

    /// Little-endian bytes of the packed weights.
    pub fn bytes(&self) -> Vec<u8> {
        self.packed.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

/// Random input tokens `seq x d`.
pub fn random_input(shape: Shape, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..shape.seq * shape.d).map(|_| rng.unit()).collect()
}

const DMA: Engine = Engine::DMA;
const SA: Engine = Engine::sa(0);
const VU: Engine = Engine::vu(0);

fn mm(
    a: u64,
    b: u64,
    c: u64,
    m: usize,
    k: usize,
    n: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    tb: bool,
) -> Instr {
    Instr::MatMul {
        dtype: DType::F32,
        flags: MatFlags { accumulate: false, transpose_b: tb },
        a,
        b,
        c,
        m: m as u32,
        k: k as u32,
        n: n as u32,
        lda: lda as u32,
        ldb: ldb as u32,
        ldc: ldc as u32,
    }
}

fn bin(op: BinOp, bcast: Bcast, a: u64, b: u64, dst: u64, rows: usize, cols: usize) -> Instr {
    Instr::VBinary { op, bcast, a, b, dst, rows: rows as u32, cols: cols as u32 }
}

/// SRAM bytes the layer needs.
pub fn sram_bytes(s: Shape) -> u64 {
    let o = offsets(s);
    (4 * (o.end + 8 * s.seq * s.d + s.heads * s.seq * s.seq + 2 * s.seq * s.ffn)) as u64 + 4096
}

/// The layer's program: weights (packed, at guest `weights`) and input (at
/// guest `x`) DMAed in, output (`seq x d` f32) DMAed to guest `out`.
pub fn program(s: Shape, weights: u64, x: u64, out: u64) -> Program {
    let o = offsets(s);
    let (l, d, f, hds) = (s.seq, s.d, s.ffn, s.heads);
    let dh = d / hds;
    let w = |e: usize| (4 * e) as u64;
    let mut next = w(o.end).next_multiple_of(64);
    let mut alloc = |elems: usize| {
        let a = next;
        next += w(elems).next_multiple_of(64);
        a
    };
    let xs = alloc(l * d);
    let (q, k, v) = (alloc(l * d), alloc(l * d), alloc(l * d));
    let (q2, k2, v2) = (alloc(l * d), alloc(l * d), alloc(l * d));
    let scores = alloc(hds * l * l);
    let probs = alloc(hds * l * l);
    let ctx = alloc(l * d);
    let (att, y1) = (alloc(l * d), alloc(l * d));
    let (h1, h2) = (alloc(l * f), alloc(l * f));
    let (ff, y2) = (alloc(l * d), alloc(l * d));

    let mut p = Pipeline::new();
    p.p.push(
        DMA,
        Instr::DmaCopy {
            src: Addr::guest(weights),
            dst: Addr::sram(0),
            rows: 1,
            row_bytes: (4 * o.end) as u32,
            src_stride: 0,
            dst_stride: 0,
        },
    );
    p.p.push(
        DMA,
        Instr::DmaCopy {
            src: Addr::guest(x),
            dst: Addr::sram(xs),
            rows: 1,
            row_bytes: (4 * l * d) as u32,
            src_stride: 0,
            dst_stride: 0,
        },
    );
    p.hand(DMA, SA);
    for (wt, dst) in [(o.wq, q), (o.wk, k), (o.wv, v)] {
        p.p.push(SA, mm(xs, w(wt), dst, l, d, d, d, d, d, false));
    }
    p.hand(SA, VU);
    for (src, b, dst) in [(q, o.bq, q2), (k, o.bk, k2), (v, o.bv, v2)] {
        p.p.push(VU, bin(BinOp::Add, Bcast::Row, src, w(b), dst, l, d));
    }
    p.hand(VU, SA);
    // Per head: scores = Q_h K_h^T (k = dh, strided by d), scaled, softmax.
    for h in 0..hds {
        let col = w(h * dh);
        p.p.push(SA, mm(q2 + col, k2 + col, scores + w(h * l * l), l, dh, l, d, d, l, true));
    }
    p.hand(SA, VU);
    let scale = 1.0 / libm::sqrtf(dh as f32);
    p.p.push(VU, Instr::VAffine { src: scores, dst: scores, len: (hds * l * l) as u32, scale, bias: 0.0 });
    p.p.push(VU, Instr::VSoftmax { src: scores, dst: probs, rows: (hds * l) as u32, cols: l as u32 });
    p.hand(VU, SA);
    for h in 0..hds {
        let col = w(h * dh);
        p.p.push(SA, mm(probs + w(h * l * l), v2 + col, ctx + col, l, l, dh, l, d, d, false));
    }
    p.p.push(SA, mm(ctx, w(o.wo), att, l, d, d, d, d, d, false));
    p.hand(SA, VU);
    p.p.push(VU, bin(BinOp::Add, Bcast::Row, att, w(o.bo), q, l, d));
    p.p.push(VU, bin(BinOp::Add, Bcast::None, q, xs, k, l, d));
    p.p.push(
        VU,
        Instr::VLayerNorm {
            src: k,
            dst: y1,
            gamma: w(o.g1),
            beta: w(o.be1),
            rows: l as u32,
            cols: d as u32,
            eps: EPS,
        },
    );
    p.hand(VU, SA);
    p.p.push(SA, mm(y1, w(o.w1), h1, l, d, f, d, f, f, false));
    p.hand(SA, VU);
    p.p.push(VU, bin(BinOp::Add, Bcast::Row, h1, w(o.b1), h2, l, f));
    p.p.push(VU, Instr::VUnary { op: UnOp::Gelu, src: h2, dst: h1, len: (l * f) as u32 });
    p.hand(VU, SA);
    p.p.push(SA, mm(h1, w(o.w2), ff, l, f, d, f, d, d, false));
    p.hand(SA, VU);
    p.p.push(VU, bin(BinOp::Add, Bcast::Row, ff, w(o.b2), v, l, d));
    p.p.push(VU, bin(BinOp::Add, Bcast::None, v, y1, att, l, d));
    p.p.push(
        VU,
        Instr::VLayerNorm {
            src: att,
            dst: y2,
            gamma: w(o.g2),
            beta: w(o.be2),
            rows: l as u32,
            cols: d as u32,
            eps: EPS,
        },
    );
    p.hand(VU, DMA);
    p.p.push(
        DMA,
        Instr::DmaCopy {
            src: Addr::sram(y2),
            dst: Addr::guest(out),
            rows: 1,
            row_bytes: (4 * l * d) as u32,
            src_stride: 0,
            dst_stride: 0,
        },
    );
    p.p.finish()
}

fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            let av = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += av * b[p * n + j];
            }
        }
    }
    c
}

fn layernorm(x: &mut [f32], cols: usize, g: &[f32], b: &[f32]) {
    for row in x.chunks_exact_mut(cols) {
        let mean = row.iter().sum::<f32>() / cols as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
        let inv = 1.0 / libm::sqrtf(var + EPS);
        for (i, v) in row.iter_mut().enumerate() {
            *v = (*v - mean) * inv * g[i] + b[i];
        }
    }
}

fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::tanhf(0.797_884_6 * (x + 0.044_715 * x * x * x)))
}

/// The layer on the CPU.
pub fn cpu(wts: &Weights, x: &[f32]) -> Vec<f32> {
    let s = wts.shape;
    let o = offsets(s);
    let pw = &wts.packed;
    let (l, d, f, hds) = (s.seq, s.d, s.ffn, s.heads);
    let dh = d / hds;
    let bias = |m: &mut Vec<f32>, b: usize, cols: usize| {
        for row in m.chunks_exact_mut(cols) {
            row.iter_mut().enumerate().for_each(|(j, v)| *v += pw[b + j]);
        }
    };
    let mut q = matmul(x, &pw[o.wq..o.wq + d * d], l, d, d);
    let mut k = matmul(x, &pw[o.wk..o.wk + d * d], l, d, d);
    let mut v = matmul(x, &pw[o.wv..o.wv + d * d], l, d, d);
    bias(&mut q, o.bq, d);
    bias(&mut k, o.bk, d);
    bias(&mut v, o.bv, d);
    let scale = 1.0 / libm::sqrtf(dh as f32);
    let mut ctx = vec![0f32; l * d];
    for h in 0..hds {
        for i in 0..l {
            let mut row = vec![0f32; l];
            for (j, r) in row.iter_mut().enumerate() {
                let mut sum = 0f32;
                for t in 0..dh {
                    sum += q[i * d + h * dh + t] * k[j * d + h * dh + t];
                }
                *r = sum * scale;
            }
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0f32;
            row.iter_mut().for_each(|r| {
                *r = libm::expf(*r - mx);
                z += *r;
            });
            row.iter_mut().for_each(|r| *r /= z);
            for t in 0..dh {
                ctx[i * d + h * dh + t] = (0..l).map(|j| row[j] * v[j * d + h * dh + t]).sum();
            }
        }
    }
    let mut y1 = matmul(&ctx, &pw[o.wo..o.wo + d * d], l, d, d);
    bias(&mut y1, o.bo, d);
    y1.iter_mut().zip(x).for_each(|(a, b)| *a += b);
    layernorm(&mut y1, d, &pw[o.g1..o.g1 + d], &pw[o.be1..o.be1 + d]);
    let mut hid = matmul(&y1, &pw[o.w1..o.w1 + d * f], l, d, f);
    bias(&mut hid, o.b1, f);
    hid.iter_mut().for_each(|v| *v = gelu(*v));
    let mut y2 = matmul(&hid, &pw[o.w2..o.w2 + f * d], l, f, d);
    bias(&mut y2, o.b2, d);
    y2.iter_mut().zip(&y1).for_each(|(a, b)| *a += b);
    layernorm(&mut y2, d, &pw[o.g2..o.g2 + d], &pw[o.be2..o.be2 + d]);
    y2
}
