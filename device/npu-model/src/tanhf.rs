//! `tanh` of an f32 with the bits glibc 2.36's `tanhf` gives, computed
//! without a branch so that an element loop over it compiles to SIMD code.
//!
//! The model's `vu.unary tanh` (and the tanh form of GELU) used to call
//! `f32::tanh`, that is the host C library's `tanhf`. On the Debian 12
//! hosts this project runs on that is glibc 2.36's, which is fdlibm's
//! algorithm (Sun Microsystems, 1993, "freely granted" notice): `tanh`
//! from one `expm1f` and one division, `expm1f` from a range reduction by
//! `ln 2`, a degree-5 polynomial in `x^2/2`, one division and a
//! reconstruction picked by the reduction's `k`. The C function picks its
//! formula with branches, one call per value.
//!
//! [`tanh`] does the same IEEE single-precision operations in the same
//! order for every input, but evaluates the polynomial once for every
//! lane and selects among the reconstructions with comparisons instead
//! of branches, so a loop over a slice runs 8 values at a time under
//! AVX2. The test `every_f32_matches_the_host_tanhf` (ignored by default:
//! three and a half minutes in release) checks all 2^32 inputs bit for
//! bit against the host's `tanhf`; a sampled version of it runs with the
//! unit tests.
//!
//! A side effect: the model's `tanh` no longer depends on the host's C
//! library. glibc 2.41 and later compute a correctly rounded `tanhf`
//! (CORE-MATH), which differs from 2.36's in the last bit for some
//! inputs; the model now gives 2.36's bits on every host.
//!
//! Only the arguments `tanh` passes to `expm1` are handled: `2|x|` for
//! `1 <= |x| < 22` and `-2|x|` for `|x| < 1`.

/// `ln 2`'s leading bits (its product with a small integer is exact).
const LN2_HI: f32 = f32::from_bits(0x3f31_7180);
/// `ln 2 - LN2_HI`.
const LN2_LO: f32 = f32::from_bits(0x3717_f7d1);
/// `1 / ln 2`.
const INV_LN2: f32 = f32::from_bits(0x3fb8_aa3b);
/// fdlibm's scaled coefficients of `expm1f`'s rational approximation.
const Q1: f32 = f32::from_bits(0xbd08_8889);
const Q2: f32 = f32::from_bits(0x3ad0_0d01);
const Q3: f32 = f32::from_bits(0xb8a6_70cd);
const Q4: f32 = f32::from_bits(0x3686_7e54);
const Q5: f32 = f32::from_bits(0xb457_edbb);

/// `|y|` bits at and below which `expm1` takes no reduction (`0.5 ln 2`).
const HALF_LN2_BITS: u32 = 0x3eb1_7218;
/// `|y|` bits below which a negative `y` is reduced by exactly one `ln 2`
/// (`1.5 ln 2`).
const THREE_HALVES_LN2_BITS: u32 = 0x3f85_1592;
/// `|y|` bits below which `expm1(y)` is `y` itself (`2^-25`).
const TINY_EXPM1_BITS: u32 = 0x3300_0000;

/// `|x|` bits from which `tanh` is `±1` (22).
const SATURATED_BITS: u32 = 0x41b0_0000;
/// `|x|` bits below which `tanh(x)` is `x (1 + x)` (`2^-55`).
const TINY_TANH_BITS: u32 = 0x2400_0000;
/// `|x|` bits of 1: from here `tanh` goes through `expm1(2|x|)`.
const ONE_BITS: u32 = 0x3f80_0000;

/// Picks `a` where `c` holds, else `b` (a select, not a branch, once the
/// loop around it is vectorized).
#[inline(always)]
fn pick(c: bool, a: f32, b: f32) -> f32 {
    if c {
        a
    } else {
        b
    }
}

/// Adds `k` to the exponent field of `y`'s bits (fdlibm's `SET_FLOAT_WORD(y,
/// i + (k << 23))`).
#[inline(always)]
fn scale_exponent(y: f32, k: i32) -> f32 {
    f32::from_bits(y.to_bits().wrapping_add(k.wrapping_shl(23).cast_unsigned()))
}

/// The integer of a whole `k` with `|k| < 2^22`, read from the bits of
/// `k + 1.5 * 2^23` (exact there): fdlibm's truncating conversion of its
/// reduction's multiple, done after `trunc`, in a form LLVM vectorizes (a
/// saturating `as i32` stays scalar). For any other `k` (a lane whose
/// argument is infinite or NaN) the result is meaningless, and callers do
/// not select it. Also used by [`crate::erff`]'s `expf`.
#[inline(always)]
pub(crate) fn whole_to_i32(k: f32) -> i32 {
    (k + 12_582_912.0).to_bits().wrapping_sub(0x4b40_0000).cast_signed()
}

/// fdlibm's `expm1f(y)`, for `y` in `(-2, 0]` or `[2, 44)` only.
#[inline(always)]
fn expm1_for_tanh(y: f32) -> f32 {
    let hy = y.to_bits() & 0x7fff_ffff;
    let negative = y.is_sign_negative();
    let reduced = hy > HALF_LN2_BITS;
    // The reduction's multiple of ln 2: -1 just past half of it (only a
    // negative `y` lands there for tanh), else rounded from `y / ln 2`
    // (the C code's conversion to int truncates, after adding ±0.5: here
    // `trunc`, then [`whole_to_i32`]).
    let half = pick(negative, -0.5, 0.5);
    let k_rounded = (INV_LN2 * y + half).trunc();
    // `t * LN2_HI` is exact, and for k = -1 these are the C code's
    // `y + ln2_hi` and `-ln2_lo` (negating a product is exact).
    let t = pick(negative && hy < THREE_HALVES_LN2_BITS, -1.0, k_rounded);
    let k_reduced = whole_to_i32(t);
    let k = if reduced { k_reduced } else { 0 };
    let hi = y - t * LN2_HI;
    let lo = t * LN2_LO;
    let xr = hi - lo;
    let c = (hi - xr) - lo;
    let x = pick(reduced, xr, y);

    // The primary range, |x| <= 0.5 ln 2.
    let hfx = 0.5 * x;
    let hxs = x * hfx;
    let r1 = 1.0 + hxs * (Q1 + hxs * (Q2 + hxs * (Q3 + hxs * (Q4 + hxs * Q5))));
    let t = 3.0 - r1 * hfx;
    let e = hxs * ((r1 - t) / (6.0 - x * t));

    let unreduced = x - (x * e - hxs);
    let e = (x * (e - c) - c) - hxs;
    let minus_one = 0.5 * (x - e) - 0.5;
    // k <= -2 or k > 56: exp(x) 2^k - 1 directly.
    let far = scale_exponent(1.0 - (e - x), k) - 1.0;
    // 2 <= k < 23: (1 - 2^-k) - (e - x), then times 2^k.
    let one_less =
        f32::from_bits(0x3f80_0000u32.wrapping_sub(0x0100_0000u32.wrapping_shr(k.cast_unsigned())));
    let mid = scale_exponent(one_less - (e - x), k);
    // 23 <= k <= 56: x - (e + 2^-k) + 1, then times 2^k.
    let two_to_minus_k = f32::from_bits(0x7fi32.wrapping_sub(k).wrapping_shl(23).cast_unsigned());
    let high = scale_exponent((x - (e + two_to_minus_k)) + 1.0, k);

    let r = pick(k == 0, unreduced, minus_one);
    let r = pick(k <= -2 || k > 56, far, r);
    let r = pick((2..23).contains(&k), mid, r);
    let r = pick((23..=56).contains(&k), high, r);
    pick(hy < TINY_EXPM1_BITS, y, r)
}

/// `tanh(x)` with glibc 2.36's `tanhf` bits (see the module's text).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let ix = x.to_bits() & 0x7fff_ffff;
    let a = f32::from_bits(ix);
    let big = ix >= ONE_BITS;
    // One expm1 per lane: of 2|x| from 1 on, else of -2|x| (both exact).
    let t = expm1_for_tanh(pick(big, 2.0 * a, -2.0 * a));
    // 1 - 2 / (t + 2) from 1 on, else -t / (t + 2): one division.
    let q = pick(big, 2.0, -t) / (t + 2.0);
    let z = pick(big, 1.0 - q, q);
    let z = pick(ix >= SATURATED_BITS, 1.0, z);
    let r = pick(x.is_sign_negative(), -z, z);
    let r = pick(ix < TINY_TANH_BITS, x * (1.0 + x), r);
    // ±0 is returned as is; NaN propagates (`x + x` quiets it, as the C
    // code's `1/x ± 1` does); ±inf fell into the saturated case above.
    let r = pick(ix == 0, x, r);
    pick(ix > 0x7f80_0000, x + x, r)
}

#[cfg(test)]
mod tests {
    use super::tanh;

    fn same(x: f32) -> Result<(), String> {
        let x = std::hint::black_box(x);
        let (got, want) = (tanh(x), x.tanh());
        if got.to_bits() == want.to_bits() {
            Ok(())
        } else {
            Err(format!(
                "tanh({x:e} = {:#010x}): {got:e} ({:#010x}), host {want:e} ({:#010x})",
                x.to_bits(),
                got.to_bits(),
                want.to_bits()
            ))
        }
    }

    /// Whether the host's `tanhf` is meant to give fdlibm's bits, as
    /// glibc 2.36's does. Where it is correctly rounded (glibc 2.41 and
    /// later) the bits differ by design and there is nothing to compare.
    /// The probe is `black_box`ed: the compiler folds `tanhf` of a
    /// constant itself, correctly rounded, without calling the host's.
    fn host_is_fdlibm() -> bool {
        // fdlibm's tanhf is one ulp below the correctly rounded value here.
        let probe = std::hint::black_box(f32::from_bits(0x3c00_0000));
        let correctly_rounded = f64::from(probe).tanh() as f32;
        let fdlibm = probe.tanh().to_bits() != correctly_rounded.to_bits();
        if !fdlibm {
            eprintln!(
                "the host's tanhf is correctly rounded, not glibc 2.36's; bit-for-bit comparison skipped"
            );
        }
        fdlibm
    }

    #[test]
    fn special_values() {
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(30.0), 1.0);
        assert_eq!(tanh(-30.0), -1.0);
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!(tanh(f32::MIN_POSITIVE), f32::MIN_POSITIVE);
        // Odd and within one ulp of a double-precision tanh.
        for x in [1e-3f32, 0.1, 0.34, 0.5, 0.9, 1.0, 1.2, 2.5, 8.0, 9.1, 15.0] {
            assert_eq!(tanh(-x).to_bits(), (-tanh(x)).to_bits());
            let want = f64::from(x).tanh();
            assert!((f64::from(tanh(x)) - want).abs() <= f64::from(f32::EPSILON) * want, "{x}");
        }
    }

    /// Every 4099th f32 (all exponents, signs, NaNs and infinities),
    /// plus every input of the ranges where the formula changes.
    #[test]
    fn sampled_f32s_match_the_host_tanhf() {
        if !host_is_fdlibm() {
            return;
        }
        let mut bad = Vec::new();
        let mut check = |b: u32| {
            if let Err(e) = same(f32::from_bits(b)) {
                if bad.len() < 10 {
                    bad.push(e);
                }
            }
        };
        (0..=u32::MAX).step_by(4099).for_each(&mut check);
        let edges = [
            super::ONE_BITS,
            super::SATURATED_BITS,
            super::TINY_TANH_BITS,
            // |x| where 2|x| crosses expm1's own thresholds.
            super::HALF_LN2_BITS - (1 << 23),
            super::THREE_HALVES_LN2_BITS - (1 << 23),
            super::TINY_EXPM1_BITS - (1 << 23),
        ];
        for edge in edges {
            for sign in [0, 0x8000_0000] {
                (edge - 2000..edge + 2000).for_each(|b| check(b | sign));
            }
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }

    /// All 2^32 inputs. `cargo test --release -p npu-model tanhf -- --ignored`.
    #[test]
    #[ignore = "all 2^32 inputs: 3.5 minutes in release"]
    fn every_f32_matches_the_host_tanhf() {
        if !host_is_fdlibm() {
            return;
        }
        let bad: Vec<String> =
            (0..=u32::MAX).filter_map(|b| same(f32::from_bits(b)).err()).take(20).collect();
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }
}
