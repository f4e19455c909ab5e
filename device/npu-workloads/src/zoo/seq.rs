//! Sequence models: the Transformer encoders (BERT, Transformer-base) and GNMT.

use super::*;

/// The sizes of a GNMT-like translation model.
#[derive(Clone, Debug)]
pub struct GnmtSize {
    /// LSTM layers of the encoder (the first bidirectional) and of the
    /// decoder.
    pub layers: u32,
    /// Hidden units (and embedding dimensions).
    pub hidden: u32,
    /// Target vocabulary (the classifier's outputs).
    pub vocab: u32,
    /// Source and target tokens.
    pub src: u32,
    pub tgt: u32,
}

impl GnmtSize {
    /// MLPerf Inference's GNMT (v2, from the NVIDIA reference): 4 + 4
    /// layers of 1024 units, a shared vocabulary of 32k subwords; 25
    /// tokens each way (a WMT16 sentence of average length).
    pub const MLPERF: GnmtSize = GnmtSize { layers: 4, hidden: 1024, vocab: 32_000, src: 25, tgt: 25 };
}

/// GNMT v2 as MLPerf runs it, greedy (beam 1) for a fixed `tgt` tokens.
///
/// Encoder: the first layer a bidirectional LSTM, the others
/// unidirectional with residual connections from the third on; each
/// layer's input projection is one product over all source tokens (as
/// cuDNN runs it), then per token the recurrent product, its sum with
/// the token's projection and the cell's element-wise work on the VU.
/// Decoder, per target token: the embedding of the previous token (a
/// gather), four LSTM layers whose input is `[x | h]` for the first and
/// `[x | context | h]` for the others (residual from the third on), the
/// attention of the first layer's output over the encoder's (Luong's
/// "general" score `q W k` with `W k` computed once; GNMT's normalized
/// Bahdanau score, a tanh over every source position per step, is
/// modelled by it), and the classifier over the vocabulary. The argmax
/// and the search are not modelled: each step's token index is an input.
/// LSTM gates are `[i | f | o | g]`.
pub fn gnmt(batch: u32, z: &GnmtSize) -> Graph {
    let (hd, t_src, t_tgt) = (z.hidden, z.src, z.tgt);
    let mut g = Graph::new("gnmt", batch);
    // The cell's element-wise part: gates (rows x 4H) and the previous
    // cell state -> new state `c` (dense) and `h` into `h_out`.
    let cell = |g: &mut Graph, p: &str, gates: View, c_prev: Option<TensorId>, h_out: View| -> TensorId {
        let b = g.batch;
        let sig = g.act(&format!("{p}.sig"), u64::from(b) * 3 * u64::from(hd));
        g.ops.push(Op::Unary {
            name: format!("{p}.sig"),
            x: gates,
            y: View::dense(sig, 3 * hd),
            rows: b,
            cols: 3 * hd,
            act: Act::Sigmoid,
        });
        let gt = g.act(&format!("{p}.tanh"), u64::from(b * hd));
        g.ops.push(Op::Unary {
            name: format!("{p}.tanh"),
            x: View { col: gates.col + 3 * hd, ..gates },
            y: View::dense(gt, hd),
            rows: b,
            cols: hd,
            act: Act::Tanh,
        });
        let sv = |col| View { t: sig, ld: 3 * hd, col };
        let c = g.act(&format!("{p}.c"), u64::from(b * hd));
        g.ops.push(Op::Mul {
            name: format!("{p}.ig"),
            a: sv(0),
            b: View::dense(gt, hd),
            y: View::dense(c, hd),
            rows: b,
            cols: hd,
            act: Act::None,
        });
        if let Some(cp) = c_prev {
            let fc = g.act(&format!("{p}.fc"), u64::from(b * hd));
            g.ops.push(Op::Mul {
                name: format!("{p}.fc"),
                a: sv(hd),
                b: View::dense(cp, hd),
                y: View::dense(fc, hd),
                rows: b,
                cols: hd,
                act: Act::None,
            });
            g.ops.push(Op::Add {
                name: format!("{p}.c"),
                a: View::dense(fc, hd),
                b: View::dense(c, hd),
                y: View::dense(c, hd),
                rows: b,
                cols: hd,
                act: Act::None,
            });
        }
        let tc = g.act(&format!("{p}.tanh_c"), u64::from(b * hd));
        g.ops.push(Op::Unary {
            name: format!("{p}.tanh_c"),
            x: View::dense(c, hd),
            y: View::dense(tc, hd),
            rows: b,
            cols: hd,
            act: Act::Tanh,
        });
        g.ops.push(Op::Mul {
            name: format!("{p}.h"),
            a: sv(2 * hd),
            b: View::dense(tc, hd),
            y: h_out,
            rows: b,
            cols: hd,
            act: Act::None,
        });
        c
    };
    // The source tokens' embeddings, [B, T, H].
    let table = g.tensor("src.emb.table", u64::from(z.vocab) * u64::from(hd), Init::Weights { fan_in: 1 });
    let idx = g.tensor("src.tokens", u64::from(batch * t_src), Init::Indices { max: z.vocab });
    g.input = idx;
    let mut x = g.act("src.emb", u64::from(batch * t_src) * u64::from(hd));
    g.ops.push(Op::Embedding {
        name: "src.emb".into(),
        table,
        idx,
        y: View::dense(x, hd),
        batch: batch * t_src,
        rows: z.vocab,
        dim: hd,
        pool: 1,
    });
    let mut xc = hd;
    for l in 0..z.layers {
        let dirs = if l == 0 { 2 } else { 1 };
        let out_c = dirs * hd;
        let out = g.act(&format!("enc{l}"), u64::from(batch * t_src) * u64::from(out_c));
        for d in 0..dirs {
            let p = format!("enc{l}.{}", if d == 0 { "fwd" } else { "bwd" });
            let proj =
                g.linear(&format!("{p}.in"), View::dense(x, xc), batch * t_src, xc, 4 * hd, Act::None, None);
            let rec = g.linear_weights(&format!("{p}.rec"), hd, 4 * hd);
            let mut c = None;
            for s in 0..t_src {
                let t = if d == 0 { s } else { t_src - 1 - s };
                let step = |t: u32| View { t: out, ld: t_src * out_c, col: t * out_c + d * hd };
                let xp = View { t: proj.t, ld: t_src * 4 * hd, col: t * 4 * hd };
                let gates = if s == 0 {
                    xp
                } else {
                    let prev = if d == 0 { t - 1 } else { t + 1 };
                    let r = g.linear_using(&format!("{p}.rec{t}"), step(prev), batch, rec, hd, 4 * hd);
                    g.ops.push(Op::Add {
                        name: format!("{p}.gates{t}"),
                        a: xp,
                        b: r,
                        y: r,
                        rows: batch,
                        cols: 4 * hd,
                        act: Act::None,
                    });
                    r
                };
                c = Some(cell(&mut g, &format!("{p}.{t}"), gates, c, step(t)));
            }
        }
        if l >= 2 {
            g.ops.push(Op::Add {
                name: format!("enc{l}.residual"),
                a: View::dense(out, out_c),
                b: View::dense(x, xc),
                y: View::dense(out, out_c),
                rows: batch * t_src,
                cols: out_c,
                act: Act::None,
            });
        }
        (x, xc) = (out, out_c);
    }
    // Attention keys W k, once per sentence.
    let keys = g.linear("att.keys", View::dense(x, hd), batch * t_src, hd, hd, Act::None, None);
    let tgt_table =
        g.tensor("tgt.emb.table", u64::from(z.vocab) * u64::from(hd), Init::Weights { fan_in: 1 });
    // Per layer: the input row [x | context | h] (the first layer [x | h]).
    let width = |l: u32| if l == 0 { 2 * hd } else { 3 * hd };
    let mut state: Vec<Option<TensorId>> = vec![None; z.layers as usize];
    let mut bufs: Vec<TensorId> = (0..z.layers)
        .map(|l| g.act(&format!("dec{l}.in0"), u64::from(batch) * u64::from(width(l))))
        .collect();
    let dec_w: Vec<_> =
        (0..z.layers).map(|l| g.linear_weights(&format!("dec{l}.gates"), width(l), 4 * hd)).collect();
    let cls_w = g.linear_weights("classifier", hd, z.vocab);
    let mut logits = None;
    for t in 0..t_tgt {
        let idx = g.tensor(format!("tgt.tokens{t}"), u64::from(batch), Init::Indices { max: z.vocab });
        g.ops.push(Op::Embedding {
            name: format!("tgt.emb{t}"),
            table: tgt_table,
            idx,
            y: View { t: bufs[0], ld: width(0), col: 0 },
            batch,
            rows: z.vocab,
            dim: hd,
            pool: 1,
        });
        let next: Vec<TensorId> = (0..z.layers)
            .map(|l| g.act(&format!("dec{l}.in{}", t + 1), u64::from(batch) * u64::from(width(l))))
            .collect();
        let top = g.act(&format!("dec.out{t}"), u64::from(batch * hd));
        for l in 0..z.layers {
            let p = format!("dec{l}.{t}");
            let w = width(l);
            let gates = g.linear_using(
                &format!("{p}.gates"),
                View::dense(bufs[l as usize], w),
                batch,
                dec_w[l as usize],
                w,
                4 * hd,
            );
            // h goes into the next token's input row of this layer.
            let h = View { t: next[l as usize], ld: w, col: w - hd };
            state[l as usize] = Some(cell(&mut g, &p, gates, state[l as usize], h));
            if l == 0 {
                // Attention of h over the encoder's outputs; the context
                // into the input rows of layers 1.. of this token.
                let scores = g.act(&format!("att.scores{t}"), u64::from(batch * t_src));
                g.ops.push(Op::BatchMatMul {
                    name: format!("att.scores{t}"),
                    a: next[0],
                    b: keys.t,
                    y: scores,
                    lda: w,
                    ldb: hd,
                    ldy: t_src,
                    trans_b: true,
                    m: 1,
                    k: hd,
                    n: t_src,
                    offs: (0..u64::from(batch))
                        .map(|b| {
                            [
                                b * u64::from(w) + u64::from(hd),
                                b * u64::from(t_src * hd),
                                b * u64::from(t_src),
                            ]
                        })
                        .collect(),
                    act: Act::None,
                });
                let probs = g.act(&format!("att.probs{t}"), u64::from(batch * t_src));
                g.ops.push(Op::Softmax {
                    name: format!("att.probs{t}"),
                    x: View::dense(scores, t_src),
                    y: View::dense(probs, t_src),
                    rows: batch,
                    cols: t_src,
                });
                for ll in 1..z.layers {
                    let wl = width(ll);
                    g.ops.push(Op::BatchMatMul {
                        name: format!("att.context{t}.{ll}"),
                        a: probs,
                        b: x,
                        y: bufs[ll as usize],
                        lda: t_src,
                        ldb: hd,
                        ldy: wl,
                        trans_b: false,
                        m: 1,
                        k: t_src,
                        n: hd,
                        offs: (0..u64::from(batch))
                            .map(|b| {
                                [
                                    b * u64::from(t_src),
                                    b * u64::from(t_src * hd),
                                    b * u64::from(wl) + u64::from(hd),
                                ]
                            })
                            .collect(),
                        act: Act::None,
                    });
                }
            }
            // This layer's output is the next layer's x (with the
            // residual from the third layer on), or the decoder's.
            let dst = if l + 1 < z.layers {
                View { t: bufs[l as usize + 1], ld: width(l + 1), col: 0 }
            } else {
                View::dense(top, hd)
            };
            let x_in = View { t: bufs[l as usize], ld: w, col: 0 };
            if l >= 2 {
                g.ops.push(Op::Add {
                    name: format!("{p}.residual"),
                    a: h,
                    b: x_in,
                    y: dst,
                    rows: batch,
                    cols: hd,
                    act: Act::None,
                });
            } else {
                g.ops.push(Op::Copy { name: format!("{p}.out"), x: h, y: dst, rows: batch, cols: hd });
            }
        }
        logits = Some(
            g.linear_using(&format!("classifier{t}"), View::dense(top, hd), batch, cls_w, hd, z.vocab).t,
        );
        bufs = next;
    }
    g.output = logits.unwrap_or(g.input);
    g
}

pub(super) fn encoder(
    name: &str,
    batch: u32,
    layers: u32,
    seq: u32,
    d: u32,
    heads: u32,
    ffn: u32,
    act: Act,
) -> Graph {
    let mut g = Graph::new(name, batch);
    let mut x = g.tensor("input", u64::from(batch * seq) * u64::from(d), Init::Input);
    g.input = x;
    for l in 0..layers {
        x = g.encoder_layer(l, x, seq, d, heads, ffn, act);
    }
    g.output = x;
    g
}
