//! Decoder-only language models (Llama, Gemma, Qwen2) in their two
//! serving phases: a prefill over a prompt, which fills the K/V cache, and
//! one decode step, which reads it and appends a position.
//!
//! Layer by layer, as the models' reference code (Hugging Face
//! `transformers`) computes them: RMSNorm, separate Q/K/V projections,
//! rotary embeddings on Q and K, attention of grouped query heads over
//! the K/V cache (`Op::CachedAttention`), the output projection and the
//! residual add; RMSNorm, the gated MLP (`act(x W_gate) * (x W_up)`, then
//! `W_down`: SwiGLU with SiLU, GeGLU with GELU) and the residual add. A
//! final RMSNorm, then the LM head over the last position of each
//! sequence (what a server samples from). The K/V caches are state in
//! HBM (`Init::State`), one pair per layer, `[batch][kv_heads][cap][dh]`.
//!
//! What differs from the reference code, each costing what it replaces:
//! - a tied LM head reads a weight tensor of its own, the size of the
//!   embedding table (the same bytes per step; HBM holds them twice);
//! - products have a bias (added in the VU pass the SA result takes);
//! - the rotary tables (`cos`, `sin`, `-sin`) have a row per query and
//!   K/V head rather than per position (a VU operand does not broadcast
//!   rows); seeded random in a synthetic run;
//! - a prefill's attention computes every score of the square and masks
//!   the upper half (a kernel that skips masked blocks does half).

use super::*;

/// The shape of one decoder model, from its published configuration.
#[derive(Clone, Debug)]
pub struct DecoderConfig {
    /// The library's name (`llama-3.2-1b`).
    pub name: &'static str,
    pub layers: u32,
    pub hidden: u32,
    /// Query heads.
    pub heads: u32,
    /// K/V heads (`heads` for multi-head, 1 for multi-query attention).
    pub kv_heads: u32,
    pub head_dim: u32,
    /// The gated MLP's inner width.
    pub ffn: u32,
    pub vocab: u32,
    /// The LM head is the embedding table (transposed).
    pub tied: bool,
    /// The MLP's gate activation: `Act::Swish` (SwiGLU) or `Act::Gelu`.
    pub act: Act,
    /// The embeddings are scaled by `sqrt(hidden)` (Gemma).
    pub scale_embeddings: bool,
    pub eps: f32,
    /// Where the numbers come from.
    pub source: &'static str,
}

impl DecoderConfig {
    /// Parameters (embedding and head counted once when tied).
    pub fn params(&self) -> u64 {
        let (d, f, v) = (u64::from(self.hidden), u64::from(self.ffn), u64::from(self.vocab));
        let (q, kv) = (u64::from(self.heads * self.head_dim), u64::from(self.kv_heads * self.head_dim));
        let layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d;
        let head = if self.tied { 0 } else { v * d };
        u64::from(self.layers) * layer + v * d + head + d
    }

    /// Bytes of K and V one position takes in the cache at `elem` bytes
    /// per element, over all layers.
    pub fn kv_bytes_per_position(&self, elem: u64) -> u64 {
        2 * u64::from(self.layers) * u64::from(self.kv_heads * self.head_dim) * elem
    }
}

/// The decoder models, each from its published configuration.
pub const DECODERS: &[DecoderConfig] = &[
    DecoderConfig {
        name: "llama-3.2-1b",
        layers: 16,
        hidden: 2048,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        ffn: 8192,
        vocab: 128_256,
        tied: true,
        act: Act::Swish,
        scale_embeddings: false,
        eps: 1e-5,
        source:
            "meta-llama/Llama-3.2-1B config.json (Meta, 2024): 16 layers, hidden 2048, 32 heads, 8 KV heads, \
                 intermediate 8192, vocabulary 128256, tied embeddings, SiLU",
    },
    DecoderConfig {
        name: "qwen2.5-0.5b",
        layers: 24,
        hidden: 896,
        heads: 14,
        kv_heads: 2,
        head_dim: 64,
        ffn: 4864,
        vocab: 151_936,
        tied: true,
        act: Act::Swish,
        scale_embeddings: false,
        eps: 1e-6,
        source:
            "Qwen/Qwen2.5-0.5B config.json (Qwen team, 2024): 24 layers, hidden 896, 14 heads, 2 KV heads, \
                 intermediate 4864, vocabulary 151936, tied embeddings, SiLU, Q/K/V biases",
    },
    DecoderConfig {
        name: "gemma-2b",
        layers: 18,
        hidden: 2048,
        heads: 8,
        kv_heads: 1,
        head_dim: 256,
        ffn: 16_384,
        vocab: 256_000,
        tied: true,
        act: Act::Gelu,
        scale_embeddings: true,
        eps: 1e-6,
        source: "google/gemma-2b config.json (Gemma team, 2024): 18 layers, hidden 2048, 8 heads, 1 KV head \
                 (multi-query), head dim 256, intermediate 16384, vocabulary 256000, tied embeddings, GeGLU \
                 (tanh GELU), embeddings scaled by sqrt(hidden)",
    },
    DecoderConfig {
        name: "llama-2-7b",
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        ffn: 11_008,
        vocab: 32_000,
        tied: false,
        act: Act::Swish,
        scale_embeddings: false,
        eps: 1e-5,
        source:
            "meta-llama/Llama-2-7b-hf config.json (Touvron et al. 2023): 32 layers, hidden 4096, 32 heads \
                 (multi-head), intermediate 11008, vocabulary 32000, separate LM head, SiLU",
    },
];

/// Which pass of a decoder a workload is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A prompt of this many tokens per sequence, from an empty cache.
    Prefill { prompt: u32 },
    /// One new token per sequence at position `context - 1`: it attends
    /// to `context` positions, the `context - 1` cached ones and its own.
    Decode { context: u32 },
}

/// The longest prompt and context a workload name may ask for.
pub const MAX_POSITIONS: u32 = 32_768;

/// The config named `model`.
pub fn decoder_config(model: &str) -> Option<&'static DecoderConfig> {
    DECODERS.iter().find(|c| c.name == model)
}

/// Parses `MODEL-prefill-P` or `MODEL-decode-L` (`P`, `L` from 1 to
/// [`MAX_POSITIONS`]).
pub fn parse_decoder(name: &str) -> Option<(&'static DecoderConfig, Phase)> {
    DECODERS.iter().find_map(|c| {
        let rest = name.strip_prefix(c.name)?.strip_prefix('-')?;
        let num = |s: &str| s.parse::<u32>().ok().filter(|v| (1..=MAX_POSITIONS).contains(v));
        let phase = if let Some(p) = rest.strip_prefix("prefill-") {
            Phase::Prefill { prompt: num(p)? }
        } else {
            Phase::Decode { context: num(rest.strip_prefix("decode-")?)? }
        };
        Some((c, phase))
    })
}

/// The graph of one `phase` of `c` over `batch` sequences; `None` when a
/// tensor's size does not fit the IR's counts.
pub fn decoder(c: &DecoderConfig, batch: u32, phase: Phase) -> Option<Graph> {
    let (t_len, kv_len) = match phase {
        Phase::Prefill { prompt } => (prompt, prompt),
        Phase::Decode { context } => (1, context),
    };
    let (d, dh, heads, kvh) = (c.hidden, c.head_dim, c.heads, c.kv_heads);
    let rows = batch.checked_mul(t_len)?;
    let (qw, kw) = (heads.checked_mul(dh)?, kvh.checked_mul(dh)?);
    rows.checked_mul(heads)?.checked_mul(dh)?;
    u32::try_from(u64::from(batch) * u64::from(kvh) * u64::from(kv_len) * u64::from(dh)).ok()?;
    let e = |a: u32, b: u32| u64::from(a) * u64::from(b);
    let phase_name = match phase {
        Phase::Prefill { prompt } => format!("{}-prefill-{prompt}", c.name),
        Phase::Decode { context } => format!("{}-decode-{context}", c.name),
    };
    let mut g = Graph::new(&phase_name, batch);
    // Token ids in, their embeddings out (one row gathered per token).
    let table = g.tensor("embed.table", e(c.vocab, d), Init::Weights { fan_in: 1 });
    let ids = g.tensor("ids", rows.into(), Init::Indices { max: c.vocab });
    g.input = ids;
    let mut x = g.act("embed", e(rows, d));
    g.ops.push(Op::Embedding {
        name: "embed".into(),
        table,
        idx: ids,
        y: View::dense(x, d),
        batch: rows,
        rows: c.vocab,
        dim: d,
        pool: 1,
    });
    if c.scale_embeddings {
        let s = g.act("embed.scaled", e(rows, d));
        g.ops.push(Op::Unary {
            name: "embed.scale".into(),
            x: View::dense(x, d),
            y: View::dense(s, d),
            rows,
            cols: d,
            act: Act::affine((d as f32).sqrt(), 0.0),
        });
        x = s;
    }
    let half = dh / 2;
    // Rotary tables, shared by the layers: a row per query head and per
    // K/V head of every token.
    let tables = |g: &mut Graph, tag: &str, n: u32| -> [TensorId; 3] {
        ["cos", "sin", "nsin"].map(|w| g.tensor(format!("rope.{tag}.{w}"), e(n, half), Init::Bias))
    };
    let q_tab = tables(&mut g, "q", rows * heads);
    let k_tab = tables(&mut g, "k", rows * kvh);
    let mask =
        (t_len > 1).then(|| g.tensor("mask", e(t_len, kv_len), Init::CausalMask { q_len: t_len, kv_len }));
    let past = kv_len - t_len;
    for l in 0..c.layers {
        let p = format!("layer{l}");
        let h = rms_norm(&mut g, &format!("{p}.norm1"), x, rows, d, c.eps);
        let q = g.linear(&format!("{p}.q"), View::dense(h, d), rows, d, qw, Act::None, None).t;
        let k = g.linear(&format!("{p}.k"), View::dense(h, d), rows, d, kw, Act::None, None).t;
        let v = g.linear(&format!("{p}.v"), View::dense(h, d), rows, d, kw, Act::None, None).t;
        let kc = g.tensor(format!("{p}.k_cache"), e(batch * kvh, kv_len) * u64::from(dh), Init::State);
        let vc = g.tensor(format!("{p}.v_cache"), e(batch * kvh, kv_len) * u64::from(dh), Init::State);
        let qr = g.act(&format!("{p}.q_rope"), e(rows, qw));
        rope(&mut g, &format!("{p}.q_rope"), q, rows * heads, dh, q_tab, View::dense(qr, dh));
        // One token per sequence: its rows `(b, kv head)` go straight into
        // the caches at position `past`, `kv_len * dh` elements apart.
        let cache_row = |t: TensorId| View { t, ld: kv_len * dh, col: past * dh };
        if t_len == 1 {
            rope(&mut g, &format!("{p}.k_rope"), k, batch * kvh, dh, k_tab, cache_row(kc));
            g.ops.push(Op::Unary {
                name: format!("{p}.v_append"),
                x: View::dense(v, dh),
                y: cache_row(vc),
                rows: batch * kvh,
                cols: dh,
                act: Act::None,
            });
        } else {
            // A prompt: its K rows (token-major) copied head by head into
            // the caches (position-major per head).
            let kr = g.act(&format!("{p}.k_rope"), e(rows, kw));
            rope(&mut g, &format!("{p}.k_rope"), k, rows * kvh, dh, k_tab, View::dense(kr, dh));
            for (src, cache, what) in [(kr, kc, "k"), (v, vc, "v")] {
                for b in 0..batch {
                    for j in 0..kvh {
                        g.ops.push(Op::Unary {
                            name: format!("{p}.{what}_cache{b}.{j}"),
                            x: View { t: src, ld: kw, col: b * t_len * kw + j * dh },
                            y: View { t: cache, ld: dh, col: (b * kvh + j) * kv_len * dh },
                            rows: t_len,
                            cols: dh,
                            act: Act::None,
                        });
                    }
                }
            }
        }
        let ctx = g.act(&format!("{p}.attn"), e(rows, qw));
        g.ops.push(Op::CachedAttention {
            name: format!("{p}.attn"),
            q: qr,
            k: kc,
            v: vc,
            mask,
            y: ctx,
            batch,
            q_len: t_len,
            kv_len,
            cap: kv_len,
            heads,
            kv_heads: kvh,
            dh,
        });
        let o = g.linear(&format!("{p}.o"), View::dense(ctx, qw), rows, qw, d, Act::None, None).t;
        let x1 = g.act(&format!("{p}.residual1"), e(rows, d));
        g.ops.push(add(&format!("{p}.residual1"), x, o, x1, rows, d));
        let h2 = rms_norm(&mut g, &format!("{p}.norm2"), x1, rows, d, c.eps);
        let gate = g.linear(&format!("{p}.gate"), View::dense(h2, d), rows, d, c.ffn, c.act, None).t;
        let up = g.linear(&format!("{p}.up"), View::dense(h2, d), rows, d, c.ffn, Act::None, None).t;
        let m = g.act(&format!("{p}.gated"), e(rows, c.ffn));
        g.ops.push(Op::Mul {
            name: format!("{p}.gated"),
            a: View::dense(gate, c.ffn),
            b: View::dense(up, c.ffn),
            y: View::dense(m, c.ffn),
            rows,
            cols: c.ffn,
            act: Act::None,
        });
        let down = g.linear(&format!("{p}.down"), View::dense(m, c.ffn), rows, c.ffn, d, Act::None, None).t;
        let x2 = g.act(&format!("{p}.residual2"), e(rows, d));
        g.ops.push(add(&format!("{p}.residual2"), x1, down, x2, rows, d));
        x = x2;
    }
    let hn = rms_norm(&mut g, "norm", x, rows, d, c.eps);
    // The head over each sequence's last position.
    let last = View { t: hn, ld: t_len * d, col: (t_len - 1) * d };
    g.output = g.linear("lm_head", last, batch, d, c.vocab, Act::None, None).t;
    Some(g)
}

fn add(name: &str, a: TensorId, b: TensorId, y: TensorId, rows: u32, cols: u32) -> Op {
    Op::Add {
        name: name.into(),
        a: View::dense(a, cols),
        b: View::dense(b, cols),
        y: View::dense(y, cols),
        rows,
        cols,
        act: Act::None,
    }
}

fn rms_norm(g: &mut Graph, name: &str, x: TensorId, rows: u32, cols: u32, eps: f32) -> TensorId {
    let gamma = g.tensor(format!("{name}.gamma"), cols.into(), Init::Ones);
    let y = g.act(name, u64::from(rows) * u64::from(cols));
    g.ops.push(Op::RmsNorm { name: name.into(), x, gamma, y, rows, cols, eps });
    y
}

/// Rotary embedding of `x` (`n` rows of `dh`: a row per head) into `y`
/// (rows `dh` wide at its `col`): with `x = [x1 | x2]` halves,
/// `y = [x1 cos - x2 sin | x2 cos + x1 sin]` (`transformers`'
/// `rotate_half` form), four products and two sums on the VU.
fn rope(g: &mut Graph, name: &str, x: TensorId, n: u32, dh: u32, [cos, sin, nsin]: [TensorId; 3], y: View) {
    let half = dh / 2;
    let xv = |col| View { t: x, ld: dh, col };
    let mut term = |tag: &str, a: View, t: TensorId| {
        let out = g.act(&format!("{name}.{tag}"), u64::from(n) * u64::from(half));
        g.ops.push(Op::Mul {
            name: format!("{name}.{tag}"),
            a,
            b: View::dense(t, half),
            y: View::dense(out, half),
            rows: n,
            cols: half,
            act: Act::None,
        });
        out
    };
    let a = term("x1cos", xv(0), cos);
    let b = term("x2nsin", xv(half), nsin);
    let c = term("x2cos", xv(half), cos);
    let d = term("x1sin", xv(0), sin);
    for (tag, p, q, col) in [("y1", a, b, 0), ("y2", c, d, half)] {
        g.ops.push(Op::Add {
            name: format!("{name}.{tag}"),
            a: View::dense(p, half),
            b: View::dense(q, half),
            y: View { col: y.col + col, ..y },
            rows: n,
            cols: half,
            act: Act::None,
        });
    }
}
