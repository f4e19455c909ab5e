//! A plain CPU interpreter of layer graphs: direct loops, f64
//! accumulation, no tiling. The lowered programs are checked against it.

use vnpu_abi::DType;

use crate::{Act, Graph, Op, PoolOp, RedOp, View};

/// An SA operand as the SA reads it: unchanged for f32, rounded to the
/// nearest bf16 (ties to even) for bf16.
fn operand(dtype: DType, x: f32) -> f64 {
    match dtype {
        DType::F32 => f64::from(x),
        DType::Bf16 => f64::from(half::bf16::from_f32(x).to_f32()),
    }
}

fn act(a: Act, x: f64) -> f64 {
    match a {
        Act::None => x,
        Act::Relu => x.max(0.0),
        Act::Gelu => {
            0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        }
        Act::GeluErf => 0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)),
        Act::Erf => libm::erf(x),
        Act::Sqrt => x.sqrt(),
        Act::Recip => 1.0 / x,
        Act::Exp => x.exp(),
        Act::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Act::Swish => x / (1.0 + (-x).exp()),
        Act::Tanh => x.tanh(),
        Act::Clamp { scale, bias, lo, hi } => {
            (x * f64::from(scale) + f64::from(bias)).max(f64::from(lo)).min(f64::from(hi))
        }
        Act::HardSwish => x * (x / 6.0 + 0.5).clamp(0.0, 1.0),
        Act::Abs => x.abs(),
        Act::Log => x.ln(),
        Act::Floor => x.floor(),
        Act::Ceil => x.ceil(),
        Act::Sin => x.sin(),
        Act::Cos => x.cos(),
        // The reference holds an integer tensor as its numbers.
        Act::I32ToF32 => x,
        Act::F32ToI32 => x.trunc(),
    }
}

fn get(t: &[Vec<f32>], v: View, r: u32, c: u32) -> f64 {
    f64::from(t[v.t][(r as usize) * v.ld as usize + (v.col + c) as usize])
}

fn set(t: &mut [Vec<f32>], v: View, r: u32, c: u32, x: f64) {
    t[v.t][(r as usize) * v.ld as usize + (v.col + c) as usize] = x as f32;
}

/// Runs every operation of `graph` on `tensors` (one vector per tensor,
/// indices stored as the bits of their u32 values), in place.
pub fn run(graph: &Graph, tensors: &mut [Vec<f32>]) {
    run_as(graph, tensors, DType::F32)
}

/// [`run`] with the SA's operands in `dtype`: both operands of every
/// product (Linear, Conv, BatchMatMul, Attention's two) are rounded to
/// `dtype` before they are multiplied (what a program lowered by
/// [`crate::lower_as`] computes); accumulation stays f64.
pub fn run_as(graph: &Graph, tensors: &mut [Vec<f32>], dtype: DType) {
    run_stored(graph, tensors, dtype, &[])
}

/// [`run_as`] for a program that stores tensor `t` as `stored[t]` (f32
/// where `stored` is shorter): every tensor stored as bf16 is rounded to
/// bf16 (nearest even) after each operation that touches it, as a program
/// whose activations are bf16 in HBM rounds what it writes.
pub fn run_stored(graph: &Graph, tensors: &mut [Vec<f32>], dtype: DType, stored: &[DType]) {
    let q = |x: f32| operand(dtype, x);
    for op in &graph.ops {
        match *op {
            Op::Linear { x, w, b, y, rows, k, n, act: a, .. } => {
                for r in 0..rows {
                    for j in 0..n {
                        let mut s = f64::from(tensors[b][j as usize]);
                        for p in 0..k {
                            s += q(get(tensors, x, r, p) as f32) * q(tensors[w][(p * n + j) as usize]);
                        }
                        set(tensors, y, r, j, act(a, s));
                    }
                }
            }
            Op::Conv { x, w, b, y, batch, s, cin, cout, act: a, residual, .. } => {
                let (ho, wo) = s.out();
                let (kh, kw) = (i64::from(s.kh), i64::from(s.kw));
                for img in 0..i64::from(batch) {
                    for oy in 0..i64::from(ho) {
                        for ox in 0..i64::from(wo) {
                            for co in 0..i64::from(cout) {
                                let mut acc = f64::from(tensors[b][co as usize]);
                                for ky in 0..kh {
                                    for kx in 0..kw {
                                        let iy = oy * i64::from(s.sh) + ky - i64::from(s.pad[0]);
                                        let ix = ox * i64::from(s.sw) + kx - i64::from(s.pad[2]);
                                        if iy < 0 || ix < 0 || iy >= i64::from(s.h) || ix >= i64::from(s.w) {
                                            continue;
                                        }
                                        for ci in 0..i64::from(cin) {
                                            let xi = ((img * i64::from(s.h) + iy) * i64::from(s.w) + ix)
                                                * i64::from(cin)
                                                + ci;
                                            let wi =
                                                ((ky * kw + kx) * i64::from(cin) + ci) * i64::from(cout) + co;
                                            acc += q(tensors[x][xi as usize]) * q(tensors[w][wi as usize]);
                                        }
                                    }
                                }
                                let pixel = (img * i64::from(ho) + oy) * i64::from(wo) + ox;
                                let mut v = act(a, acc) as f32;
                                if let Some(res) = residual {
                                    let ri = pixel * i64::from(cout) + co;
                                    v = act(res.act, f64::from(v + tensors[res.r][ri as usize])) as f32;
                                }
                                set(tensors, y, pixel as u32, co as u32, f64::from(v));
                            }
                        }
                    }
                }
            }
            Op::Depthwise { x, w, b, y, batch, s, c, act: a, .. } => {
                let (ho, wo) = s.out();
                let (kh, kw) = (i64::from(s.kh), i64::from(s.kw));
                for img in 0..i64::from(batch) {
                    for oy in 0..i64::from(ho) {
                        for ox in 0..i64::from(wo) {
                            for ch in 0..i64::from(c) {
                                let mut acc = f64::from(tensors[b][ch as usize]);
                                for ky in 0..kh {
                                    for kx in 0..kw {
                                        let iy = oy * i64::from(s.sh) + ky - i64::from(s.pad[0]);
                                        let ix = ox * i64::from(s.sw) + kx - i64::from(s.pad[2]);
                                        if iy < 0 || ix < 0 || iy >= i64::from(s.h) || ix >= i64::from(s.w) {
                                            continue;
                                        }
                                        let xi = ((img * i64::from(s.h) + iy) * i64::from(s.w) + ix)
                                            * i64::from(c)
                                            + ch;
                                        let wi = (ky * kw + kx) * i64::from(c) + ch;
                                        acc += f64::from(tensors[x][xi as usize])
                                            * f64::from(tensors[w][wi as usize]);
                                    }
                                }
                                let yi =
                                    ((img * i64::from(ho) + oy) * i64::from(wo) + ox) * i64::from(c) + ch;
                                tensors[y][yi as usize] = act(a, acc) as f32;
                            }
                        }
                    }
                }
            }
            Op::Pool { x, y, batch, s, c, op, .. } => {
                let (ho, wo) = s.out();
                for img in 0..i64::from(batch) {
                    for oy in 0..i64::from(ho) {
                        for ox in 0..i64::from(wo) {
                            for ch in 0..i64::from(c) {
                                let (mut m, mut sum, mut count) = (f32::NEG_INFINITY, 0.0f64, 0u32);
                                for ky in 0..i64::from(s.kh) {
                                    for kx in 0..i64::from(s.kw) {
                                        let iy = oy * i64::from(s.sh) + ky - i64::from(s.pad[0]);
                                        let ix = ox * i64::from(s.sw) + kx - i64::from(s.pad[2]);
                                        if iy < 0 || ix < 0 || iy >= i64::from(s.h) || ix >= i64::from(s.w) {
                                            continue;
                                        }
                                        let xi = ((img * i64::from(s.h) + iy) * i64::from(s.w) + ix)
                                            * i64::from(c)
                                            + ch;
                                        m = m.max(tensors[x][xi as usize]);
                                        sum += f64::from(tensors[x][xi as usize]);
                                        count += 1;
                                    }
                                }
                                tensors[y][(((img * i64::from(ho) + oy) * i64::from(wo) + ox) * i64::from(c)
                                    + ch) as usize] = match op {
                                    PoolOp::Max => m,
                                    PoolOp::Avg => (sum / f64::from(count.max(1))) as f32,
                                };
                            }
                        }
                    }
                }
            }
            Op::GlobalPool { x, y, batch, hw, c, .. } => {
                for img in 0..batch as usize {
                    for ch in 0..c as usize {
                        let s: f64 = (0..hw as usize)
                            .map(|p| f64::from(tensors[x][(img * hw as usize + p) * c as usize + ch]))
                            .sum();
                        tensors[y][img * c as usize + ch] = (s / f64::from(hw)) as f32;
                    }
                }
            }
            Op::Reduce { op: rop, x, y, outer, reduce, inner, .. } => {
                let (outer, reduce, inner) = (outer as usize, reduce as usize, inner as usize);
                for o in 0..outer {
                    for i in 0..inner {
                        let v = (0..reduce).map(|r| f64::from(tensors[x][(o * reduce + r) * inner + i]));
                        let out = match rop {
                            RedOp::Sum => v.sum(),
                            RedOp::Mean => v.sum::<f64>() / reduce.max(1) as f64,
                            RedOp::Max => v.fold(f64::NEG_INFINITY, |m, e| {
                                if m.is_nan() || e.is_nan() {
                                    f64::NAN
                                } else {
                                    m.max(e)
                                }
                            }),
                        };
                        tensors[y][o * inner + i] = out as f32;
                    }
                }
            }
            Op::Add { a, b, y, rows, cols, act: ac, .. } => {
                for r in 0..rows {
                    for c in 0..cols {
                        let v = act(ac, get(tensors, a, r, c) + get(tensors, b, r, c));
                        set(tensors, y, r, c, v);
                    }
                }
            }
            Op::Mul { a, b, y, rows, cols, act: ac, .. } => {
                for r in 0..rows {
                    for c in 0..cols {
                        let v = act(ac, get(tensors, a, r, c) * get(tensors, b, r, c));
                        set(tensors, y, r, c, v);
                    }
                }
            }
            Op::Max { a, b, y, rows, cols, act: ac, .. } | Op::Min { a, b, y, rows, cols, act: ac, .. } => {
                let max = matches!(op, Op::Max { .. });
                for r in 0..rows {
                    for c in 0..cols {
                        let (p, q) = (get(tensors, a, r, c), get(tensors, b, r, c));
                        let v = if p.is_nan() || q.is_nan() {
                            f64::NAN
                        } else if max {
                            p.max(q)
                        } else {
                            p.min(q)
                        };
                        set(tensors, y, r, c, act(ac, v));
                    }
                }
            }
            Op::Compare { op: bop, a, b, y, rows, cols, .. } => {
                use vnpu_abi::BinOp;
                for r in 0..rows {
                    for c in 0..cols {
                        let (p, q) = (get(tensors, a, r, c), get(tensors, b, r, c));
                        let v = match bop {
                            BinOp::Eq => f64::from(u8::from(p == q)),
                            BinOp::Ne => f64::from(u8::from(p != q)),
                            BinOp::Lt => f64::from(u8::from(p < q)),
                            BinOp::Le => f64::from(u8::from(p <= q)),
                            BinOp::Gt => f64::from(u8::from(p > q)),
                            BinOp::Ge => f64::from(u8::from(p >= q)),
                            BinOp::Keep if p == 0.0 => 0.0,
                            BinOp::Keep => q,
                            BinOp::Add => p + q,
                            BinOp::Sub => p - q,
                            BinOp::Mul => p * q,
                            BinOp::Max | BinOp::Min if p.is_nan() || q.is_nan() => f64::NAN,
                            BinOp::Max => p.max(q),
                            BinOp::Min => p.min(q),
                        };
                        set(tensors, y, r, c, v);
                    }
                }
            }
            Op::AddNorm { a, b, gamma, beta, y, rows, cols, eps, .. } => {
                let n = cols as usize;
                for r in 0..rows as usize {
                    let v: Vec<f64> = (0..n)
                        .map(|c| {
                            f64::from(tensors[a][r * n + c])
                                + b.map_or(0.0, |b| f64::from(tensors[b][r * n + c]))
                        })
                        .collect();
                    let mean = v.iter().sum::<f64>() / n as f64;
                    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
                    for c in 0..n {
                        let z = (v[c] - mean) / (var + f64::from(eps)).sqrt();
                        tensors[y][r * n + c] =
                            (z * f64::from(tensors[gamma][c]) + f64::from(tensors[beta][c])) as f32;
                    }
                }
            }
            Op::RmsNorm { x, gamma, y, rows, cols, eps, .. } => {
                let n = cols as usize;
                for r in 0..rows as usize {
                    let v: Vec<f64> = (0..n).map(|c| f64::from(tensors[x][r * n + c])).collect();
                    let ms = v.iter().map(|x| x * x).sum::<f64>() / n as f64;
                    let inv = 1.0 / (ms + f64::from(eps)).sqrt();
                    for c in 0..n {
                        tensors[y][r * n + c] = (v[c] * inv * f64::from(tensors[gamma][c])) as f32;
                    }
                }
            }
            Op::ScaleChannels { x, s, y, batch, hw, c, .. } => {
                let (hw, c) = (hw as usize, c as usize);
                for img in 0..batch as usize {
                    for p in 0..hw {
                        for ch in 0..c {
                            let i = (img * hw + p) * c + ch;
                            tensors[y][i] =
                                (f64::from(tensors[x][i]) * f64::from(tensors[s][img * c + ch])) as f32;
                        }
                    }
                }
            }
            Op::Attention { qkv, y, batch, seq, heads, dh, .. } => {
                let (seq, dh, hid) = (seq as usize, dh as usize, (heads * dh) as usize);
                let scale = 1.0 / (dh as f64).sqrt();
                for bi in 0..batch as usize {
                    for h in 0..heads as usize {
                        let src = tensors[qkv].clone();
                        let at = |row: usize, which: usize, d: usize| {
                            q(src[(bi * seq + row) * 3 * hid + which * hid + h * dh + d])
                        };
                        for i in 0..seq {
                            let logits: Vec<f64> = (0..seq)
                                .map(|j| (0..dh).map(|d| at(i, 0, d) * at(j, 1, d)).sum::<f64>() * scale)
                                .collect();
                            let mx = logits.iter().copied().fold(f64::MIN, f64::max);
                            let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                            let sum: f64 = e.iter().sum();
                            for d in 0..dh {
                                let v: f64 = (0..seq).map(|j| q((e[j] / sum) as f32) * at(j, 2, d)).sum();
                                tensors[y][(bi * seq + i) * hid + h * dh + d] = v as f32;
                            }
                        }
                    }
                }
            }
            Op::CachedAttention {
                q: qt, k, v, y, batch, q_len, kv_len, cap, heads, kv_heads, dh, ..
            } => {
                let (ql, kl, cap, dh) = (q_len as usize, kv_len as usize, cap as usize, dh as usize);
                let (hs, group) = (heads as usize, (heads / kv_heads.max(1)).max(1) as usize);
                let scale = 1.0 / (dh as f64).sqrt();
                let (kc, vc, qs) = (tensors[k].clone(), tensors[v].clone(), tensors[qt].clone());
                for bi in 0..batch as usize {
                    for h in 0..hs {
                        let kh = h / group;
                        let cache = |t: &[f32], j: usize, d: usize| {
                            q(t[((bi * kv_heads as usize + kh) * cap + j) * dh + d])
                        };
                        for i in 0..ql {
                            let row = ((bi * ql + i) * hs + h) * dh;
                            // Positions up to the query's own.
                            let seen = (kl - ql + i + 1).min(kl);
                            let logits: Vec<f64> = (0..seen)
                                .map(|j| {
                                    (0..dh).map(|d| q(qs[row + d]) * cache(&kc, j, d)).sum::<f64>() * scale
                                })
                                .collect();
                            let mx = logits.iter().copied().fold(f64::MIN, f64::max);
                            let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                            let sum: f64 = e.iter().sum();
                            for d in 0..dh {
                                let o: f64 =
                                    (0..seen).map(|j| q((e[j] / sum) as f32) * cache(&vc, j, d)).sum();
                                tensors[y][row + d] = o as f32;
                            }
                        }
                    }
                }
            }
            Op::Embedding { table, idx, y, batch, dim, pool, .. } => {
                for b in 0..batch {
                    for d in 0..dim {
                        let mut s = 0.0f64;
                        for p in 0..pool {
                            let row = tensors[idx][(b * pool + p) as usize].to_bits();
                            s += f64::from(tensors[table][(row * dim + d) as usize]);
                        }
                        set(tensors, y, b, d, s);
                    }
                }
            }
            Op::Interaction { z, y, batch, f, d, .. } => {
                for b in 0..batch as usize {
                    let zb =
                        |i: usize, k: usize| f64::from(tensors[z][b * (f * d) as usize + i * d as usize + k]);
                    let mut out = Vec::with_capacity((f * f) as usize);
                    for i in 0..f as usize {
                        for j in 0..f as usize {
                            out.push((0..d as usize).map(|k| zb(i, k) * zb(j, k)).sum::<f64>());
                        }
                    }
                    for (c, v) in out.into_iter().enumerate() {
                        set(tensors, y, b as u32, c as u32, v);
                    }
                }
            }
            Op::Unary { x, y, rows, cols, act: a, .. } => {
                for r in 0..rows {
                    for c in 0..cols {
                        let v = act(a, get(tensors, x, r, c));
                        set(tensors, y, r, c, v);
                    }
                }
            }
            Op::Softmax { x, y, rows, cols, .. } => {
                for r in 0..rows {
                    let v: Vec<f64> = (0..cols).map(|c| get(tensors, x, r, c)).collect();
                    let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = v.iter().map(|x| (x - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for (c, e) in e.into_iter().enumerate() {
                        set(tensors, y, r, c as u32, e / sum);
                    }
                }
            }
            Op::BatchMatMul { a, b, y, lda, ldb, ldy, trans_b, m, k, n, ref offs, act: f, .. } => {
                let (lda, ldb, ldy) = (lda as usize, ldb as usize, ldy as usize);
                for &[oa, ob, oy] in offs {
                    let (oa, ob, oy) = (oa as usize, ob as usize, oy as usize);
                    for i in 0..m as usize {
                        for j in 0..n as usize {
                            let s: f64 = (0..k as usize)
                                .map(|l| {
                                    let bv = if trans_b { ob + j * ldb + l } else { ob + l * ldb + j };
                                    q(tensors[a][oa + i * lda + l]) * q(tensors[b][bv])
                                })
                                .sum();
                            tensors[y][oy + i * ldy + j] = act(f, s) as f32;
                        }
                    }
                }
            }
            Op::FastNms { boxes, scores, corners, y, batch, n, classes, iou, .. } => {
                fast_nms(tensors, [boxes, scores, corners, y], batch, n, classes, iou);
            }
            Op::Copy { x, y, rows, cols, .. } => {
                for r in 0..rows {
                    for c in 0..cols {
                        let v = get(tensors, x, r, c);
                        set(tensors, y, r, c, v);
                    }
                }
            }
        }
        // What the program stores as bf16 (`stored`) is rounded when written.
        for t in op.tensors() {
            if stored.get(t) == Some(&DType::Bf16) {
                tensors[t].iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
            }
        }
    }
}

/// [`Op::FastNms`] in f32, with the operations in the order the
/// lowering's VU runs them (so results match bit for bit on the same
/// inputs: the steps would amplify any rounding difference).
fn fast_nms(
    tensors: &mut [Vec<f32>],
    [boxes, scores, corners, y]: [usize; 4],
    batch: u32,
    n: u32,
    classes: u32,
    iou: f32,
) {
    use crate::NMS_STEP;
    let (n, c, bn) = (n as usize, classes as usize, (batch * n) as usize);
    let relu = |x: f32| if x.is_nan() { x } else { x.max(0.0) };
    let clamp01 = |x: f32| x.clamp(0.0, 1.0);
    let max_nan = |a: f32, b: f32| if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) };
    let min_nan = |a: f32, b: f32| if a.is_nan() || b.is_nan() { f32::NAN } else { a.min(b) };
    for b in 0..batch as usize {
        // Corners and areas: [y1, x1, y2, x2, area].
        let mut k = [vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]];
        for i in 0..n {
            let bx = &tensors[boxes][(b * n + i) * 4..(b * n + i) * 4 + 4];
            let (hh, hw) = (bx[2] * 0.5 + 0.0, bx[3] * 0.5 + 0.0);
            let (y1, y2, x1, x2) = (bx[0] - hh, bx[0] + hh, bx[1] - hw, bx[1] + hw);
            let area = (y2 - y1) * (x2 - x1);
            for (p, v) in [y1, x1, y2, x2, area].into_iter().enumerate() {
                k[p][i] = v;
            }
        }
        for (p, plane) in k.iter().enumerate() {
            tensors[corners][p * bn + b * n..p * bn + (b + 1) * n].copy_from_slice(plane);
        }
        let s = &tensors[scores][b * n * c..(b + 1) * n * c];
        let mut out = vec![0f32; n * c];
        for i in 0..n {
            // The row of "overlaps enough" steps of box i.
            let t: Vec<f32> = (0..n)
                .map(|j| {
                    let iw = relu(min_nan(k[3][j], k[3][i]) - max_nan(k[1][j], k[1][i]));
                    let ih = relu(min_nan(k[2][j], k[2][i]) - max_nan(k[0][j], k[0][i]));
                    let inter = iw * ih;
                    let union = (k[4][j] + k[4][i]) - inter;
                    let over = (union * -iou + 0.0) + inter;
                    clamp01(over * NMS_STEP + 0.0)
                })
                .collect();
            for cl in 0..c {
                let m = (0..n).map(|j| s[j * c + cl] * t[j]).fold(f32::NEG_INFINITY, max_nan);
                let si = s[i * c + cl];
                let keep = clamp01((si - m) * NMS_STEP + 1.0);
                out[i * c + cl] = keep * si;
            }
        }
        tensors[y][b * n * c..(b + 1) * n * c].copy_from_slice(&out);
    }
}
