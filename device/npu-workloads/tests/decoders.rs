//! The decoder workloads: their lowered programs compute what the graph
//! reference computes, and the graphs are the models: a Llama forward
//! pass written out here in f64 from the weights alone (RMSNorm, rotary
//! embeddings from positions, grouped-query causal attention over the
//! cache, the gated MLP, the head) gives the same logits and the same
//! cache.
#![allow(clippy::unwrap_used)]

use npu_graph::{reference, Act, Graph, Init};
use npu_lower::{LowerOptions, Lowered, VnpuShape};
use npu_model::memory::{read_f32s, write_f32s};
use npu_model::{run_program, verify, BoardConfig, CoreMemory, LazyHbm, Sram, VecGuestMemory, VnpuLimits};
use npu_workloads::zoo::{decoder, parse_decoder, DecoderConfig, Phase, DECODERS};
use npu_workloads::{build, init_hbm};
use vnpu_abi::DType;

const TINY: DecoderConfig = DecoderConfig {
    name: "tiny",
    layers: 2,
    hidden: 32,
    heads: 4,
    kv_heads: 2,
    head_dim: 8,
    ffn: 48,
    vocab: 50,
    tied: true,
    act: Act::Swish,
    scale_embeddings: false,
    eps: 1e-5,
    source: "a test",
};

const THETA: f64 = 10_000.0;

fn board() -> BoardConfig {
    let mut b = BoardConfig::test_board();
    b.core.sa_rows = 16;
    b.core.sa_cols = 16;
    b
}

fn lower(g: &Graph, sa: u32, vu: u32, sram: u64, bf16: bool) -> Lowered {
    let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
    let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
    let o = LowerOptions { dtype, bf16_activations: bf16, ..Default::default() };
    npu_lower::lower_ops_with(g, 0..g.ops.len(), shape, o).unwrap()
}

fn read(hbm: &LazyHbm, p: &npu_lower::Placed) -> Vec<f32> {
    match p.dtype {
        DType::F32 => read_f32s(hbm, p.offset, p.elems as usize).unwrap(),
        DType::Bf16 => {
            let mut b = vec![0u8; p.elems as usize * 2];
            npu_model::Memory::read(hbm, p.offset, &mut b).unwrap();
            b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
    }
}

/// Seeds the HBM, writes true rotary tables (position of each row's
/// token) and a random earlier cache, runs the program; returns the
/// tensors before and after.
fn run(g: &Graph, l: &Lowered, sa: u32, vu: u32, sram: u64, past: u32) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let lim = VnpuLimits {
        sa,
        vu,
        sram_bytes: sram,
        hbm_bytes: 1 << 30,
        guest: vec![],
        borrow_sa: 0,
        borrow_vu: 0,
    };
    verify(&l.program, &lim).unwrap();
    let mut hbm = LazyHbm::new(1 << 30);
    init_hbm(l, &mut hbm, 11).unwrap();
    let t_len = if past == 0 { None } else { Some(1) };
    for (p, t) in l.tensors.iter().zip(&g.tensors) {
        let n = p.elems as usize;
        let v: Option<Vec<f32>> = if let Some(rest) = t.name.strip_prefix("rope.") {
            let (heads, which) = rest.split_once('.').unwrap();
            let per_token = if heads == "q" { TINY.heads } else { TINY.kv_heads } as usize;
            let half = (TINY.head_dim / 2) as usize;
            let tokens = n / half / per_token;
            let t_len = t_len.unwrap_or(tokens / g.batch as usize);
            Some(
                (0..n)
                    .map(|i| {
                        let (row, j) = (i / half, i % half);
                        let pos = (row / per_token) % t_len + past as usize;
                        let a = pos as f64 * THETA.powf(-2.0 * j as f64 / TINY.head_dim as f64);
                        (match which {
                            "cos" => a.cos(),
                            "sin" => a.sin(),
                            _ => -a.sin(),
                        }) as f32
                    })
                    .collect(),
            )
        } else if t.init == Init::State {
            Some((0..n).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect())
        } else {
            None
        };
        if let Some(v) = v {
            let v: Vec<f32> = if p.dtype == DType::Bf16 {
                v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect()
            } else {
                v
            };
            match p.dtype {
                DType::F32 => write_f32s(&mut hbm, p.offset, &v).unwrap(),
                DType::Bf16 => {
                    let b: Vec<u8> = v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
                    npu_model::Memory::write(&mut hbm, p.offset, &b).unwrap();
                }
            }
        }
    }
    let before: Vec<Vec<f32>> = l.tensors.iter().map(|p| read(&hbm, p)).collect();
    let mut s = Sram::new(sram);
    let mut guest = VecGuestMemory::new(0, 0);
    run_program(
        &board(),
        &l.program,
        Some(CoreMemory { sram: &mut s, hbm: &mut hbm, guest: &mut guest }),
        None,
    )
    .unwrap();
    let after = l.tensors.iter().map(|p| read(&hbm, p)).collect();
    (before, after)
}

fn find(g: &Graph, name: &str) -> usize {
    g.tensors.iter().position(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
}

/// The model written out: logits of each sequence's last token and the
/// caches after the step, from the weights in `t` (as the graph names
/// them), `past` positions already cached.
fn llama(
    g: &Graph,
    t: &[Vec<f32>],
    c: &DecoderConfig,
    batch: usize,
    t_len: usize,
    past: usize,
) -> Vec<Vec<f64>> {
    let (d, dh, hs, kvh, f) =
        (c.hidden as usize, c.head_dim as usize, c.heads as usize, c.kv_heads as usize, c.ffn as usize);
    let kv_len = past + t_len;
    let w = |name: &str| t[find(g, name)].iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let ids = &t[find(g, "ids")];
    let table = w("embed.table");
    let lin = |x: &[f64], name: &str, k: usize, n: usize| -> Vec<f64> {
        let (wt, b) = (w(&format!("{name}.w")), w(&format!("{name}.b")));
        (0..n).map(|j| b[j] + (0..k).map(|i| x[i] * wt[i * n + j]).sum::<f64>()).collect()
    };
    let norm = |x: &[f64], name: &str| -> Vec<f64> {
        let gm = w(&format!("{name}.gamma"));
        let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + f64::from(c.eps)).sqrt();
        x.iter().zip(&gm).map(|(v, g)| v * inv * g).collect()
    };
    let rot = |x: &mut [f64], pos: usize| {
        let half = dh / 2;
        for j in 0..half {
            let a = pos as f64 * THETA.powf(-2.0 * j as f64 / dh as f64);
            let (x1, x2) = (x[j], x[j + half]);
            x[j] = x1 * a.cos() - x2 * a.sin();
            x[j + half] = x2 * a.cos() + x1 * a.sin();
        }
    };
    let mut caches: Vec<[Vec<f64>; 2]> =
        (0..c.layers).map(|l| [w(&format!("layer{l}.k_cache")), w(&format!("layer{l}.v_cache"))]).collect();
    let at = |b: usize, j: usize, pos: usize| ((b * kvh + j) * kv_len + pos) * dh;
    let mut xs: Vec<Vec<f64>> = (0..batch * t_len)
        .map(|r| {
            let id = ids[r].to_bits() as usize;
            table[id * d..(id + 1) * d].to_vec()
        })
        .collect();
    for (l, cache) in caches.iter_mut().enumerate() {
        let p = format!("layer{l}");
        let mut qs = Vec::new();
        for (r, x) in xs.iter().enumerate() {
            let (b, i) = (r / t_len, r % t_len);
            let h = norm(x, &format!("{p}.norm1"));
            let mut q = lin(&h, &format!("{p}.q"), d, hs * dh);
            let mut k = lin(&h, &format!("{p}.k"), d, kvh * dh);
            let v = lin(&h, &format!("{p}.v"), d, kvh * dh);
            for hh in 0..hs {
                rot(&mut q[hh * dh..(hh + 1) * dh], past + i);
            }
            for j in 0..kvh {
                rot(&mut k[j * dh..(j + 1) * dh], past + i);
                let o = at(b, j, past + i);
                cache[0][o..o + dh].copy_from_slice(&k[j * dh..(j + 1) * dh]);
                cache[1][o..o + dh].copy_from_slice(&v[j * dh..(j + 1) * dh]);
            }
            qs.push(q);
        }
        for (r, x) in xs.iter_mut().enumerate() {
            let (b, i) = (r / t_len, r % t_len);
            let mut ctx = vec![0.0; hs * dh];
            for hh in 0..hs {
                let j = hh / (hs / kvh);
                let q = &qs[r][hh * dh..(hh + 1) * dh];
                let seen = past + i + 1;
                let s: Vec<f64> = (0..seen)
                    .map(|pos| {
                        let k = &cache[0][at(b, j, pos)..at(b, j, pos) + dh];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (dh as f64).sqrt()
                    })
                    .collect();
                let mx = s.iter().copied().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (pos, ep) in e.iter().enumerate() {
                    for dd in 0..dh {
                        ctx[hh * dh + dd] += ep / sum * cache[1][at(b, j, pos) + dd];
                    }
                }
            }
            let o = lin(&ctx, &format!("{p}.o"), hs * dh, d);
            let x1: Vec<f64> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
            let h2 = norm(&x1, &format!("{p}.norm2"));
            let gate = lin(&h2, &format!("{p}.gate"), d, f);
            let up = lin(&h2, &format!("{p}.up"), d, f);
            let m: Vec<f64> = gate.iter().zip(&up).map(|(gt, u)| gt / (1.0 + (-gt).exp()) * u).collect();
            let down = lin(&m, &format!("{p}.down"), f, d);
            *x = x1.iter().zip(&down).map(|(a, b)| a + b).collect();
        }
    }
    let mut out: Vec<Vec<f64>> = (0..batch)
        .map(|b| lin(&norm(&xs[b * t_len + t_len - 1], "norm"), "lm_head", d, c.vocab as usize))
        .collect();
    for cache in caches {
        out.extend(cache);
    }
    out
}

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let ok = f64::from(*a) == *b || (f64::from(*a) - b).abs() <= tol * (1.0 + b.abs());
        assert!(ok, "{what}: element {i}: model {a}, reference {b}");
    }
}

fn check_phase(batch: u32, phase: Phase, sa: u32, vu: u32, sram: u64, bf16: bool) {
    let g = decoder(&TINY, batch, phase).unwrap();
    let (t_len, past) = match phase {
        Phase::Prefill { prompt } => (prompt, 0),
        Phase::Decode { context } => (1, context - 1),
    };
    let l = lower(&g, sa, vu, sram, bf16);
    let (before, after) = run(&g, &l, sa, vu, sram, past);
    let what = format!("{phase:?} batch {batch} on {sa} SA {vu} VU {sram} B, bf16 {bf16}");
    // The lowering against the graph's reference, every tensor.
    let mut refd = before.clone();
    let stored: Vec<DType> = l.tensors.iter().map(|p| p.dtype).collect();
    let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
    reference::run_stored(&g, &mut refd, dtype, &stored);
    let tol = if bf16 { 3e-2 } else { 2e-4 };
    for (i, (a, b)) in after.iter().zip(&refd).enumerate() {
        let b: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
        close(&format!("{what}: tensor `{}` against the graph reference", g.tensors[i].name), a, &b, tol);
    }
    // The graph against the model written out (f32 data only: bf16
    // rounds every stored activation).
    if !bf16 {
        let want = llama(&g, &before, &TINY, batch as usize, t_len as usize, past as usize);
        close(&format!("{what}: logits"), &after[g.output], &want[..batch as usize].concat(), 1e-3);
        for l in 0..TINY.layers as usize {
            for (j, which) in ["k", "v"].into_iter().enumerate() {
                let t = find(&g, &format!("layer{l}.{which}_cache"));
                close(
                    &format!("{what}: layer {l} {which} cache"),
                    &after[t],
                    &want[batch as usize + 2 * l + j],
                    1e-3,
                );
            }
        }
    }
}

#[test]
fn a_tiny_llama_prefill_and_decode_step_match_the_model_written_out() {
    for bf16 in [false, true] {
        check_phase(2, Phase::Prefill { prompt: 5 }, 2, 2, 1 << 20, bf16);
        check_phase(3, Phase::Decode { context: 7 }, 2, 1, 1 << 20, bf16);
        // One SA, little SRAM: many tiles.
        check_phase(1, Phase::Decode { context: 40 }, 1, 1, 64 << 10, bf16);
    }
}

#[test]
fn decoder_names_parse_and_build_their_published_shapes() {
    let (c, p) = parse_decoder("llama-3.2-1b-decode-4096").unwrap();
    assert_eq!((c.name, p), ("llama-3.2-1b", Phase::Decode { context: 4096 }));
    assert_eq!(parse_decoder("gemma-2b-prefill-128").unwrap().1, Phase::Prefill { prompt: 128 });
    for bad in [
        "llama-3.2-1b",
        "llama-3.2-1b-decode-0",
        "llama-3.2-1b-prefill-x",
        "gemma-2b-decode-40000",
        "gpt-9-decode-8",
    ] {
        assert!(parse_decoder(bad).is_none(), "{bad}");
        assert!(build(bad, 1).is_none(), "{bad}");
    }
    // Published parameter counts (model cards): Llama-3.2-1B 1.24 B,
    // Qwen2.5-0.5B 0.49 B, Gemma-2B 2.51 B, Llama-2-7B 6.74 B.
    let want = [("llama-3.2-1b", 1.24), ("qwen2.5-0.5b", 0.49), ("gemma-2b", 2.51), ("llama-2-7b", 6.74)];
    for (name, b) in want {
        let c = DECODERS.iter().find(|c| c.name == name).unwrap();
        let got = c.params() as f64 / 1e9;
        assert!((got - b).abs() < 0.02 * b, "{name}: {got} B parameters");
    }
    // A decode step's products: each layer's and the head's weights once
    // per token, and attention over the context.
    let g = build("llama-3.2-1b-decode-1024", 4).unwrap();
    let c = &DECODERS[0];
    let (d, q, kv, f) = (u64::from(c.hidden), 2048u64, 512u64, u64::from(c.ffn));
    let per_token = 16 * (d * q + 2 * d * kv + q * d + 3 * d * f) + d * u64::from(c.vocab);
    assert_eq!(g.macs(), 4 * per_token + 2 * 4 * 32 * 1024 * 64 * 16);
}
