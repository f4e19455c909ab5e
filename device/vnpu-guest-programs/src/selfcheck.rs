//! GEMM and convolution self-check: random shapes, data types and flags,
//! each a small program (DMA in, one SA instruction, DMA out) with the
//! expected result computed on the CPU.

use alloc::vec;
use alloc::vec::Vec;

use vnpu_abi::{Addr, ConvGeom, DType, Engine, Instr, MatFlags, Program};

use crate::{copy, Pipeline};

/// xorshift64* (deterministic, seedable, no_std).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % u64::from(hi - lo + 1)) as u32
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n.max(1))) as u32
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// f32 to bf16 bits, round to nearest even (as the VU's convert does).
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// bf16 bits to f32.
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// One self-check case.
#[derive(Clone, Debug, PartialEq)]
pub enum Case {
    MatMul { dtype: DType, m: u32, k: u32, n: u32, accumulate: bool, transpose_b: bool },
    Conv { dtype: DType, geom: ConvGeom },
}

/// A case made concrete: the program, the guest memory it reads, where it
/// writes, and what it must write.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub case: Case,
    pub program: Program,
    /// (guest address, bytes) to place before running.
    pub inputs: Vec<(u64, Vec<u8>)>,
    /// Guest address of the f32 result.
    pub output: u64,
    pub expected: Vec<f32>,
    /// Per element: sum of |products| (the scale of rounding error).
    pub magnitude: Vec<f32>,
}

/// The `i`-th random case (at most 2^18 multiply-adds, so a software-float
/// CPU reference stays quick).
pub fn case(rng: &mut Rng, i: usize) -> Case {
    let dtype = if rng.range(0, 3) == 0 { DType::Bf16 } else { DType::F32 };
    if i % 3 == 2 {
        let k = rng.range(1, 3) as u16;
        let geom = ConvGeom {
            n: rng.range(1, 2),
            h: rng.range(u32::from(k), 12),
            w: rng.range(u32::from(k), 12),
            cin: rng.range(1, 8),
            cout: rng.range(1, 16),
            kh: k,
            kw: rng.range(1, u32::from(k)) as u16,
            stride_h: rng.range(1, 2) as u16,
            stride_w: rng.range(1, 2) as u16,
            pad_top: rng.range(0, 1) as u16,
            pad_bottom: rng.range(0, 1) as u16,
            pad_left: rng.range(0, 1) as u16,
            pad_right: rng.range(0, 1) as u16,
        };
        return Case::Conv { dtype, geom };
    }
    loop {
        let (m, k, n) = (rng.range(1, 160), rng.range(1, 160), rng.range(1, 160));
        if u64::from(m) * u64::from(k) * u64::from(n) <= 1 << 18 {
            return Case::MatMul {
                dtype,
                m,
                k,
                n,
                accumulate: rng.range(0, 1) == 1,
                transpose_b: rng.range(0, 1) == 1,
            };
        }
    }
}

fn data(rng: &mut Rng, n: usize, dtype: DType) -> (Vec<f32>, Vec<u8>) {
    let mut vals = Vec::with_capacity(n);
    let mut bytes = Vec::with_capacity(4 * n);
    for _ in 0..n {
        let x = rng.unit();
        match dtype {
            DType::F32 => {
                vals.push(x);
                bytes.extend_from_slice(&x.to_le_bytes());
            }
            DType::Bf16 => {
                let h = to_bf16(x);
                vals.push(from_bf16(h));
                bytes.extend_from_slice(&h.to_le_bytes());
            }
        }
    }
    (vals, bytes)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

const DMA: Engine = Engine::DMA;
const SA: Engine = Engine::sa(0);

/// Builds `case` with its buffers in guest memory from `base` and in SRAM from 0.
pub fn prepare(case: Case, rng: &mut Rng, base: u64) -> Prepared {
    match case {
        Case::MatMul { dtype, m, k, n, accumulate, transpose_b } => {
            let (mu, ku, nu) = (m as usize, k as usize, n as usize);
            let (a, ab) = data(rng, mu * ku, dtype);
            let (b, bb) = data(rng, ku * nu, dtype);
            let (c0, _) = data(rng, mu * nu, DType::F32);
            let mut expected = vec![0f32; mu * nu];
            let mut magnitude = vec![0f32; mu * nu];
            for i in 0..mu {
                for j in 0..nu {
                    let (mut s, mut mag) =
                        if accumulate { (c0[i * nu + j], c0[i * nu + j].abs()) } else { (0.0, 0.0) };
                    for p in 0..ku {
                        let bv = if transpose_b { b[j * ku + p] } else { b[p * nu + j] };
                        s += a[i * ku + p] * bv;
                        mag += (a[i * ku + p] * bv).abs();
                    }
                    expected[i * nu + j] = s;
                    magnitude[i * nu + j] = mag;
                }
            }
            let (ga, gb, gc) = (base, base + ab.len().next_multiple_of(64) as u64, 0);
            let gc = gb + bb.len().next_multiple_of(64) as u64 + gc;
            let (sa_a, sa_b) = (0u64, ab.len().next_multiple_of(64) as u64);
            let sa_c = sa_b + bb.len().next_multiple_of(64) as u64;
            let mut p = Pipeline::new();
            p.p.push(DMA, copy(Addr::guest(ga), Addr::sram(sa_a), ab.len()));
            p.p.push(DMA, copy(Addr::guest(gb), Addr::sram(sa_b), bb.len()));
            if accumulate {
                p.p.push(DMA, copy(Addr::guest(gc), Addr::sram(sa_c), 4 * mu * nu));
            }
            p.hand(DMA, SA);
            let ldb = if transpose_b { k } else { n };
            p.p.push(
                SA,
                Instr::MatMul {
                    dtype,
                    flags: MatFlags { accumulate, transpose_b },
                    a: sa_a,
                    b: sa_b,
                    c: sa_c,
                    m,
                    k,
                    n,
                    lda: k,
                    ldb,
                    ldc: n,
                },
            );
            p.hand(SA, DMA);
            p.p.push(DMA, copy(Addr::sram(sa_c), Addr::guest(gc), 4 * mu * nu));
            let mut inputs = vec![(ga, ab), (gb, bb)];
            inputs.push((gc, if accumulate { f32_bytes(&c0) } else { vec![0; 4 * mu * nu] }));
            Prepared { case, program: p.p.finish(), inputs, output: gc, expected, magnitude }
        }
        Case::Conv { dtype, geom: g } => {
            let (ho, wo) = g.out_hw().unwrap_or((0, 0));
            let (n, h, w, ci, co) =
                (g.n as usize, g.h as usize, g.w as usize, g.cin as usize, g.cout as usize);
            let (kh, kw) = (usize::from(g.kh), usize::from(g.kw));
            let (sh, sw) = (usize::from(g.stride_h), usize::from(g.stride_w));
            let (ho, wo) = (ho as usize, wo as usize);
            let (x, xb) = data(rng, n * h * w * ci, dtype);
            let (wt, wb) = data(rng, kh * kw * ci * co, dtype);
            let mut expected = vec![0f32; n * ho * wo * co];
            let mut magnitude = vec![0f32; n * ho * wo * co];
            for b in 0..n {
                for oy in 0..ho {
                    for ox in 0..wo {
                        for oc in 0..co {
                            let (mut acc, mut mag) = (0f32, 0f32);
                            for dy in 0..kh {
                                for dx in 0..kw {
                                    let iy = (oy * sh + dy) as isize - g.pad_top as isize;
                                    let ix = (ox * sw + dx) as isize - g.pad_left as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    for c in 0..ci {
                                        let xv = x[((b * h + iy as usize) * w + ix as usize) * ci + c];
                                        let wv = wt[((dy * kw + dx) * ci + c) * co + oc];
                                        acc += xv * wv;
                                        mag += (xv * wv).abs();
                                    }
                                }
                            }
                            let o = ((b * ho + oy) * wo + ox) * co + oc;
                            expected[o] = acc;
                            magnitude[o] = mag;
                        }
                    }
                }
            }
            let gx = base;
            let gw = gx + xb.len().next_multiple_of(64) as u64;
            let go = gw + wb.len().next_multiple_of(64) as u64;
            let (sx, sw) = (0u64, xb.len().next_multiple_of(64) as u64);
            let so = sw + wb.len().next_multiple_of(64) as u64;
            let mut p = Pipeline::new();
            p.p.push(DMA, copy(Addr::guest(gx), Addr::sram(sx), xb.len()));
            p.p.push(DMA, copy(Addr::guest(gw), Addr::sram(sw), wb.len()));
            p.hand(DMA, SA);
            p.p.push(
                SA,
                Instr::Conv2d {
                    dtype,
                    flags: MatFlags::default(),
                    input: sx,
                    weights: sw,
                    output: so,
                    geom: g,
                },
            );
            p.hand(SA, DMA);
            p.p.push(DMA, copy(Addr::sram(so), Addr::guest(go), 4 * expected.len()));
            Prepared {
                case,
                program: p.p.finish(),
                inputs: vec![(gx, xb), (gw, wb)],
                output: go,
                expected,
                magnitude,
            }
        }
    }
}

/// Whether `got` matches the reference: within 2^-16 of the magnitude of
/// the products (f32 summation order differs between the SA's GEMM and
/// the loop above) plus a tiny absolute slack.
pub fn matches(p: &Prepared, got: &[f32]) -> Result<(), (usize, f32, f32)> {
    for (i, ((g, e), m)) in got.iter().zip(&p.expected).zip(&p.magnitude).enumerate() {
        // Written so that a NaN fails too.
        let within = (g - e).abs() <= m / 65536.0 + 1e-6;
        if !within {
            return Err((i, *g, *e));
        }
    }
    if got.len() != p.expected.len() {
        return Err((got.len().min(p.expected.len()), f32::NAN, f32::NAN));
    }
    Ok(())
}
