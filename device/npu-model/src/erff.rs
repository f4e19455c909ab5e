//! `erf` without branches, so that element loops over it vectorize.
//!
//! `vu.unary erf` and `gelu_erf` have always computed the `libm` crate's
//! `erff` (FreeBSD's `s_erff.c`, fdlibm's algorithm in f32). That function
//! picks one of five formulas by the argument's magnitude, and the branch
//! keeps a loop over it scalar: 15-20% of a transformer's functional
//! run went there (`docs/benchmarks.md`). [`erff`] does the same f32
//! operations in the same order for every formula, computes them all and
//! selects the one the argument's range picks, so a loop of it compiles to
//! vector code. The results are the same bits: checked against
//! `libm::erff` for every f32 by `every_f32_matches_libm` (ignored: 3.5
//! minutes in release) and for a sample around every range boundary in CI.
//! As in [`crate::tanhf`], the reduction's integer is taken from `trunc`
//! and the bits of a sum, not from a saturating `as i32`, which LLVM
//! leaves scalar.
//! The coefficients are fdlibm's, written as their bit patterns.
//! [`map_erf`], the element loops' entry, computes the expensive formula
//! (1.25 <= |x| < 6) only for the values that take it.

#[inline(always)]
fn f(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// `erff` for every f32, bit for bit `libm::erff`, without branches.
#[inline(always)]
pub fn erff(x: f32) -> f32 {
    let ix = x.to_bits() & 0x7fff_ffff;
    pick(ix, edge(x), small(x), large(ix, x))
}

/// Whether [`erff`] takes erfc's formula for 1.25 <= |x| < 6 at `x`: the
/// one with two exponentials and two rational functions, most of the
/// work of computing every formula.
#[inline(always)]
fn is_far(x: f32) -> bool {
    (0x3fa0_0000..0x40c0_0000).contains(&(x.to_bits() & 0x7fff_ffff))
}

/// [`erff`] at every `x` that is not [`is_far`], without that formula's
/// work: the same selection, with a placeholder where erfc would come
/// from it (never selected for such `x`).
#[inline(always)]
fn erff_near(x: f32) -> f32 {
    let ix = x.to_bits() & 0x7fff_ffff;
    pick(ix, edge(x), small(x), from_erfc(ix, x, erfc1(x), 0.0))
}

/// Values a block of [`map_erf`] handles at a time.
pub const BLOCK: usize = 256;

/// `out[i] = post(x, erff(pre(x)))` for every `x = xs[i]` (the two the
/// same length; extra elements of either are left alone), the bits of
/// doing it value by value. Every value first takes [`erff_near`]; the
/// values whose argument is [`is_far`] are then gathered, computed with
/// [`erff`] and put back. Both loops vectorize, and only the far values
/// (those with 1.25 <= |pre(x)| < 6) pay for the exponentials.
#[inline(always)]
pub fn map_erf(
    xs: &[f32],
    out: &mut [f32],
    pre: impl Fn(f32) -> f32 + Copy,
    post: impl Fn(f32, f32) -> f32 + Copy,
) {
    for (xs, out) in xs.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = post(x, erff_near(pre(x)));
        }
        // The far values' indices, in order: each index is written, and
        // kept by counting it only when it is far (no branch).
        let mut far = [0u16; BLOCK];
        let mut n = 0;
        for (i, &x) in xs.iter().enumerate() {
            far[n] = i as u16;
            n += usize::from(is_far(pre(x)));
        }
        let mut vals = [0.0f32; BLOCK];
        for (v, &i) in vals[..n].iter_mut().zip(&far[..n]) {
            *v = xs[usize::from(i)];
        }
        for v in vals[..n].iter_mut() {
            *v = post(*v, erff(pre(*v)));
        }
        for (&v, &i) in vals[..n].iter().zip(&far[..n]) {
            out[usize::from(i)] = v;
        }
    }
}

/// The formula of `|x|`'s range (`ix`: its bits).
#[inline(always)]
fn pick(ix: u32, edge: f32, small: f32, large: f32) -> f32 {
    if !(0x3180_0000..0x7f80_0000).contains(&ix) {
        edge
    } else if ix < 0x3f58_0000 {
        small
    } else {
        large
    }
}

/// NaN, the infinities and |x| < 2^-28.
#[inline(always)]
fn edge(x: f32) -> f32 {
    let bits = x.to_bits();
    let sign = bits >> 31;
    let special = (if sign != 0 { -1.0 } else { 1.0 }) + 1.0 / x;
    let tiny = 0.125 * (8.0 * x + f(0x3f83_75d4) * x);
    if bits & 0x7fff_ffff >= 0x7f80_0000 {
        special
    } else {
        tiny
    }
}

/// 2^-28 <= |x| < 0.84375.
#[inline(always)]
fn small(x: f32) -> f32 {
    let z = x * x;
    let r = f(0x3e03_75d4)
        + z * (f(0xbea6_6beb) + z * (f(0xbce9_528f) + z * (f(0xbbbd_1489) + z * f(0xb7c7_56b1))));
    let s = 1.0
        + z * (f(0x3ecb_bbce)
            + z * (f(0x3d85_2a63) + z * (f(0x3ba6_8116) + z * (f(0x390a_ee49) + z * f(0xb684_e21a)))));
    x + x * (r / s)
}

/// 0.84375 <= |x| < inf: 1 - erfc(|x|), erfc from three formulas.
#[inline(always)]
fn large(ix: u32, x: f32) -> f32 {
    from_erfc(ix, x, erfc1(x), erfc2(ix, x))
}

/// erf from erfc by the erfc formula of `|x|`'s range (`ix`): `c1` from
/// [`erfc1`], `c2` from [`erfc2`]; none for |x| >= 6.
#[inline(always)]
fn from_erfc(ix: u32, x: f32, c1: f32, c2: f32) -> f32 {
    let erfc = if ix < 0x3fa0_0000 { c1 } else { c2 };
    let y = if ix < 0x40c0_0000 { 1.0 - erfc } else { 1.0 - f(0x0380_0000) };
    if x.to_bits() >> 31 != 0 {
        -y
    } else {
        y
    }
}

/// erfc on 0.84375 <= |x| < 1.25.
#[inline(always)]
fn erfc1(x: f32) -> f32 {
    let s = x.abs() - 1.0;
    let p = f(0xbb1a_cdc6)
        + s * (f(0x3ed4_6805)
            + s * (f(0xbebe_9208)
                + s * (f(0x3ea2_fe54) + s * (f(0xbde3_1cc2) + s * (f(0x3d11_51b3) + s * f(0xbb0d_f9c0))))));
    let q = 1.0
        + s * (f(0x3dd9_f331)
            + s * (f(0x3f0a_5785)
                + s * (f(0x3d93_1ae7) + s * (f(0x3e01_3307) + s * (f(0x3c5f_6e13) + s * f(0x3c44_5aa3))))));
    1.0 - f(0x3f58_560b) - p / q
}

/// erfc on 1.25 <= |x| < 6, both of its formulas selected by `ix`.
#[inline(always)]
fn erfc2(ix: u32, x: f32) -> f32 {
    let x = x.abs();
    let s = 1.0 / (x * x);
    // 1.25 <= |x| < 1/0.35.
    let ra = f(0xbc21_a093)
        + s * (f(0xbf31_a0b7)
            + s * (f(0xc128_f022)
                + s * (f(0xc279_8057)
                    + s * (f(0xc322_658c)
                        + s * (f(0xc338_9ae7) + s * (f(0xc2a2_932b) + s * f(0xc11d_077e)))))));
    let sa = 1.0
        + s * (f(0x419d_35ce)
            + s * (f(0x4309_a863)
                + s * (f(0x43d9_486f)
                    + s * (f(0x4421_58c9)
                        + s * (f(0x43d6_810b)
                            + s * (f(0x42d9_451f) + s * (f(0x40d2_3f7c) + s * f(0xbd77_7f97))))))));
    // 1/0.35 <= |x| < 6.
    let rb = f(0xbc21_a092)
        + s * (f(0xbf4c_9dd4)
            + s * (f(0xc18e_104b)
                + s * (f(0xc320_a2ea) + s * (f(0xc41f_6441) + s * (f(0xc480_230b) + s * f(0xc3f1_c275))))));
    let sb = 1.0
        + s * (f(0x41f2_b459)
            + s * (f(0x43a2_e571)
                + s * (f(0x44c0_1759)
                    + s * (f(0x4547_fdbb)
                        + s * (f(0x451f_90ce) + s * (f(0x43ed_43a7) + s * f(0xc1b3_8712)))))));
    let near = ix < 0x4036_db6d;
    let r = if near { ra } else { rb };
    let big_s = if near { sa } else { sb };
    let z = f(x.to_bits() & 0xffff_e000);
    expf(-z * z - 0.5625) * expf((z - x) * (z + x) + r / big_s) / x
}

/// `libm::expf` (FreeBSD's `e_expf.c`) for |x| < 87.3, the arguments
/// [`erfc2`] gives it (at least -36.6), without branches.
#[inline(always)]
fn expf(x: f32) -> f32 {
    const LN2_HI: u32 = 0x3f31_7200;
    const LN2_LO: u32 = 0x35bf_be8e;
    const INV_LN2: u32 = 0x3fb8_aa3b;
    let bits = x.to_bits();
    let sign = bits >> 31;
    let hx = bits & 0x7fff_ffff;
    let half = if sign != 0 { -0.5 } else { 0.5 };
    // |x| > 1.5 ln 2: k rounded from x / ln 2 (the C code's conversion to
    // int truncates); |x| > 0.5 ln 2: +-1; else 0 (then hi = x and lo = 0
    // below, exactly as with no reduction). `trunc`, not `as i32`: the
    // saturating conversion is not vectorized.
    let kf = if hx > 0x3f85_1592 {
        (f(INV_LN2) * x + half).trunc()
    } else if hx > 0x3eb1_7218 {
        if sign != 0 {
            -1.0
        } else {
            1.0
        }
    } else {
        0.0
    };
    let k = crate::tanhf::whole_to_i32(kf);
    let hi = x - kf * f(LN2_HI);
    let lo = kf * f(LN2_LO);
    let r = hi - lo;
    let rr = r * r;
    let c = r - rr * (f(0x3e2a_aa8f) + rr * f(0xbb35_5215));
    let y = 1.0 + (r * c / (2.0 - c) - lo + hi);
    // scalbnf(y, k): y * 2^k, exact while 2^k and the result are normal
    // (k >= -53 here); k = 0 multiplies by 1. Lanes of other ranges wrap
    // harmlessly and are not selected.
    let scaled = y * f(127i32.wrapping_add(k).wrapping_shl(23).cast_unsigned());
    // |x| <= 2^-14: 1 + x.
    if hx > 0x3900_0000 {
        scaled
    } else {
        1.0 + x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compares bit patterns (NaN with NaN by bits too: the same
    /// operations on one NaN operand give the same NaN).
    fn check(bits: u32) {
        let x = f32::from_bits(bits);
        let (got, want) = (erff(x), libm::erff(x));
        assert_eq!(got.to_bits(), want.to_bits(), "erff({x:e} = {bits:#010x}): {got:e} != libm {want:e}");
    }

    /// The argument ranges' boundaries (and of `expf`'s, through
    /// `-z*z - 0.5625`), a few ulps either side, both signs, and a
    /// stride through every f32.
    #[test]
    fn matches_libm_around_every_boundary_and_on_a_stride() {
        let bounds = [
            0u32,
            0x0000_0001,
            0x0080_0000,
            0x3180_0000,
            0x3f58_0000,
            0x3fa0_0000,
            0x4036_db6d,
            0x40c0_0000,
            0x3f80_0000,
            0x7f7f_ffff,
            0x7f80_0000,
            0x7fc0_0000,
            0x7f80_0001,
        ];
        for b in bounds {
            for d in 0..64u32 {
                for v in [b.wrapping_add(d), b.wrapping_sub(d)] {
                    check(v & 0x7fff_ffff);
                    check((v & 0x7fff_ffff) | 0x8000_0000);
                }
            }
        }
        // Every 4099th pattern (prime: every mantissa region, both signs).
        let mut v = 0u64;
        while v <= u64::from(u32::MAX) {
            check(v as u32);
            v += 4099;
        }
        // Densely where transformers' activations are: |x| < 8.
        let mut v = 0u32;
        while v < 0x4100_0000 {
            check(v);
            check(v | 0x8000_0000);
            v += 997;
        }
    }

    /// Every f32, through [`erff`] and [`map_erf`]: `cargo test --release
    /// -p npu-model -- --ignored every_f32`.
    #[test]
    #[ignore = "all 2^32 inputs, both ways: about 5 minutes in release"]
    fn every_f32_matches_libm() {
        let mut x = vec![0f32; 1 << 16];
        let mut out = vec![0f32; 1 << 16];
        let mut blocks = vec![0f32; 1 << 16];
        for hi in 0..=u32::from(u16::MAX) {
            for (i, v) in x.iter_mut().enumerate() {
                *v = f32::from_bits(hi << 16 | i as u32);
            }
            for (o, v) in out.iter_mut().zip(&x) {
                *o = erff(*v);
            }
            map_erf(&x, &mut blocks, |x| x, |_, e| e);
            for ((v, o), b) in x.iter().zip(&out).zip(&blocks) {
                let want = libm::erff(*v);
                assert_eq!(o.to_bits(), want.to_bits(), "erff({v:e} = {:#010x})", v.to_bits());
                assert_eq!(b.to_bits(), want.to_bits(), "map_erf at {v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    /// [`map_erf`] gives `erff`'s bits value for value, with far and near
    /// values mixed in every proportion within blocks and a last block
    /// cut short, and applies `pre` and `post` around it.
    #[test]
    fn map_erf_gives_the_bits_of_erff_value_by_value() {
        let mut next = crate::test_rng::xorshift32(0x9e37_79b9);
        let mut xs = Vec::new();
        // Blocks from all near to all far: |x| in [0, 8) with a far share
        // that grows block by block; then random bit patterns.
        for block in 0..=16u32 {
            for _ in 0..BLOCK {
                let far = next() % 16 < block;
                let m = (next() % 1000) as f32 / 1000.0;
                let x = if far {
                    1.25 + 4.75 * m
                } else {
                    1.25 * m + if next().is_multiple_of(2) { 0.0 } else { 6.0 }
                };
                xs.push(if next().is_multiple_of(2) { x } else { -x });
            }
        }
        xs.extend((0..3 * BLOCK + 77).map(|_| f32::from_bits(next())));
        let mut out = vec![0f32; xs.len()];
        map_erf(&xs, &mut out, |x| x, |_, e| e);
        for (x, o) in xs.iter().zip(&out) {
            assert_eq!(o.to_bits(), libm::erff(*x).to_bits(), "map_erf at {x:e} ({:#010x})", x.to_bits());
        }
        map_erf(&xs, &mut out, |x| 0.5 * x, |x, e| x * (1.0 + e));
        for (x, o) in xs.iter().zip(&out) {
            let want = x * (1.0 + libm::erff(0.5 * x));
            assert_eq!(o.to_bits(), want.to_bits(), "pre/post at {x:e} ({:#010x})", x.to_bits());
        }
    }
}
