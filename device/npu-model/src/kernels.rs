//! Functional execution: what each instruction computes, on real numbers.
//!
//! Every memory access goes through [`Memory`]'s checked accessors, so even a
//! program that skipped the verifier cannot touch memory outside its
//! segments; such an access fails the instruction.

use std::cell::RefCell;
use std::thread::LocalKey;

use half::bf16;
use thiserror::Error;
use vnpu_abi::{Addr, Bcast, BinOp, ConvGeom, DType, Instr, PoolGeom, PoolOp, RedOp, Space, UnOp};

use crate::memory::{read_f32s, write_f32s, LazyHbm, Memory, MemoryError, Sram};
use crate::scratch::with_scratch;

/// A failure while executing an instruction.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum KernelError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("gather index {index} at position {position} is outside the table of {rows} rows")]
    GatherIndex { position: u32, index: u32, rows: u32 },
    #[error("invalid geometry: {0}")]
    Geometry(&'static str),
    #[error("operation of {0} elements is larger than this model executes in one instruction")]
    TooLarge(u64),
}

/// Largest number of elements one functional instruction may touch
/// (keeps host memory bounded whatever a program asks for).
pub const MAX_ELEMENTS: u64 = 1 << 28;

/// The memories one vNPU core's program can name.
pub struct CoreMemory<'a> {
    pub sram: &'a mut Sram,
    pub hbm: &'a mut LazyHbm,
    pub guest: &'a mut dyn Memory,
}

impl std::fmt::Debug for CoreMemory<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreMemory").finish_non_exhaustive()
    }
}

impl CoreMemory<'_> {
    fn space(&mut self, s: Space) -> &mut dyn Memory {
        match s {
            Space::Sram => self.sram,
            Space::Hbm => self.hbm,
            Space::Guest => self.guest,
        }
    }
}

/// Most sliding-window steps (output pixels x kernel taps) one functional
/// instruction may take, whatever its operand sizes.
pub const MAX_WINDOW_STEPS: u64 = 1 << 28;

/// The product of `dims`, or `TooLarge` when it overflows or exceeds
/// [`MAX_ELEMENTS`].
fn count(dims: &[u64]) -> Result<usize, KernelError> {
    let n = dims.iter().try_fold(1u64, |a, d| a.checked_mul(*d)).ok_or(KernelError::TooLarge(u64::MAX))?;
    limit(n)
}

/// Checks that walking a window of `taps` over `pixels` outputs is bounded.
fn window_steps(pixels: usize, taps: usize) -> Result<(), KernelError> {
    let steps = (pixels as u64).saturating_mul(taps as u64);
    if steps > MAX_WINDOW_STEPS {
        return Err(KernelError::TooLarge(steps));
    }
    Ok(())
}

fn limit(n: u64) -> Result<usize, KernelError> {
    if n > MAX_ELEMENTS {
        return Err(KernelError::TooLarge(n));
    }
    Ok(n as usize)
}

/// Runs `f` compiled for AVX-512 or AVX2 when the host has it (the
/// element-wise and depthwise loops then take 16 or 8 lanes at a time
/// instead of SSE2's 4), else as the baseline build. The same values
/// every way: Rust never fuses a multiply and an add it is not told to
/// (`mul_add`), whatever the target features, and every lane does the
/// scalar operation of the plain loop.
#[inline(always)]
fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the host has AVX-512F (checked just above), the only
            // requirement of calling a function compiled for it.
            return unsafe { avx512(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the host has AVX2 (checked just above), the only
            // requirement of calling a function compiled for it.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Reads `n` elements of `dtype` as f32.
fn read_elems(m: &dyn Memory, addr: u64, n: usize, dtype: DType) -> Result<Vec<f32>, KernelError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    crate::memory::check_span(m, addr, n as u64 * dtype.size())?;
    Ok(match dtype {
        DType::F32 => read_f32s(m, addr, n)?,
        DType::Bf16 => {
            let mut b = vec![0u8; n * 2];
            m.read(addr, &mut b)?;
            b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
    })
}

fn write_elems(m: &mut dyn Memory, addr: u64, v: &[f32], dtype: DType) -> Result<(), KernelError> {
    if v.is_empty() {
        return Ok(());
    }
    match dtype {
        DType::F32 => write_f32s(m, addr, v)?,
        DType::Bf16 => {
            let mut b = Vec::with_capacity(v.len() * 2);
            for x in v {
                b.extend_from_slice(&bf16::from_f32(*x).to_le_bytes());
            }
            m.write(addr, &b)?;
        }
    }
    Ok(())
}

/// Reads a `rows x cols` matrix with leading dimension `ld` into a dense
/// row-major vector.
fn read_matrix(
    m: &dyn Memory,
    addr: u64,
    rows: usize,
    cols: usize,
    ld: usize,
    dtype: DType,
) -> Result<Vec<f32>, KernelError> {
    if ld == cols || rows <= 1 {
        return read_elems(m, addr, rows * cols, dtype);
    }
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        out.extend(read_elems(m, addr + (r * ld) as u64 * dtype.size(), cols, dtype)?);
    }
    Ok(out)
}

fn write_matrix(
    m: &mut dyn Memory,
    addr: u64,
    v: &[f32],
    rows: usize,
    cols: usize,
    ld: usize,
) -> Result<(), KernelError> {
    if ld == cols || rows <= 1 {
        return write_elems(m, addr, v, DType::F32);
    }
    for r in 0..rows {
        write_elems(m, addr + (r * ld * 4) as u64, &v[r * cols..(r + 1) * cols], DType::F32)?;
    }
    Ok(())
}

/// Shape of a dense GEMM: `c[m x n] (+)= a[m x k] * b[k x n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// `b` is stored `n x k`.
    pub b_transposed: bool,
    /// Add to `c` instead of overwriting it.
    pub accumulate: bool,
}

/// `c (+)= a * b` on dense row-major f32 matrices with the `gemm` crate.
pub fn gemm_f32(a: &[f32], b: &[f32], c: &mut [f32], shape: GemmShape) {
    let GemmShape { m, k, n, b_transposed: b_t, accumulate } = shape;
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let (b_cs, b_rs) = if b_t { (k as isize, 1) } else { (1, n as isize) };
    // SAFETY: the three slices are live and disjoint for the call; `a`
    // holds m*k, `b` k*n and `c` m*n elements (asserted above), and the
    // strides describe exactly those row-major (or, for `b_t`, transposed)
    // layouts, so every element gemm touches lies inside its slice.
    unsafe { gemm_raw(c.as_mut_ptr(), n as isize, a.as_ptr(), k as isize, b.as_ptr(), b_cs, b_rs, shape) }
}

/// `c (+)= a * b` through the `gemm` crate on raw row-major operands with
/// leading dimensions `ldc`, `lda` and B's column/row strides, using every
/// core above 2^18 multiply-adds.
///
/// # Safety
/// Every element the shape and strides address must lie in a live
/// allocation; `c`'s elements must not overlap `a`'s or `b`'s; nothing
/// else may access them during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw(
    c: *mut f32,
    ldc: isize,
    a: *const f32,
    lda: isize,
    b: *const f32,
    b_cs: isize,
    b_rs: isize,
    shape: GemmShape,
) {
    let GemmShape { m, k, n, accumulate, .. } = shape;
    let par = if m * n * k >= (1 << 18) { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    // SAFETY: forwarded from this function's contract.
    unsafe {
        gemm::gemm(
            m, n, k, c, 1, ldc, accumulate, a, 1, lda, b, b_cs, b_rs, 1.0f32, 1.0f32, false, false, false,
            par,
        );
    }
}

// The element functions below are always inlined, as `unary` is: a
// function of its own is compiled for the baseline target, not for the
// AVX2 loop that calls it, and its `trunc`s become library calls.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    // The tanh approximation used by BERT and most NPU runtimes.
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + crate::tanhf::tanh(C * (x + 0.044_715 * x * x * x)))
}

/// The exact GELU: `x (1 + erf(x / sqrt 2)) / 2`.
#[inline(always)]
fn gelu_erf(x: f32) -> f32 {
    gelu_erf_of(x, crate::erff::erff(gelu_erf_arg(x)))
}

/// The argument of [`gelu_erf`]'s `erf`.
#[inline(always)]
fn gelu_erf_arg(x: f32) -> f32 {
    x * std::f32::consts::FRAC_1_SQRT_2
}

/// [`gelu_erf`] of `x` from `e`, the `erf` of its argument.
#[inline(always)]
fn gelu_erf_of(x: f32, e: f32) -> f32 {
    0.5 * x * (1.0 + e)
}

/// The maximum with NaN propagated (as in XLA and PyTorch), so a NaN is
/// never hidden by `relu`, `max`, a max-reduction or max-pooling. Unlike
/// IEEE 754-2019 `maximum`, of two zeros of opposite sign it may give
/// either (`f32::max`): which one depends on how the compiler lowered
/// the call (`docs/isa.md`).
pub fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// The minimum with NaN propagated; of two zeros of opposite sign,
/// either (as [`max_nan`]).
pub fn min_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.min(b)
    }
}

/// `min(max(x, lo), hi)` with NaN propagated (`vu.clamp`): the bits of
/// `min_nan(max_nan(x, lo), hi)`, signed zeros included (unit test), with
/// one NaN test instead of four and plain selects (a ReLU6 over a
/// MobileNet's activations: about 30% less time a value).
#[inline(always)]
pub fn clamp_nan(x: f32, lo: f32, hi: f32) -> f32 {
    let above = if x >= lo { x } else { lo };
    let clamped = if above <= hi { above } else { hi };
    if x.is_nan() || lo.is_nan() || hi.is_nan() {
        f32::NAN
    } else {
        clamped
    }
}

/// Applies a unary operation to one value. Always inlined: the element
/// loops call it with a constant `op` (one loop per operation), and only
/// inlined does the `match` fold away and the loop vectorize.
#[inline(always)]
pub fn unary(op: UnOp, x: f32) -> f32 {
    match op {
        UnOp::Copy => x,
        UnOp::Relu => max_nan(x, 0.0),
        UnOp::Gelu => gelu(x),
        UnOp::Exp => x.exp(),
        UnOp::Tanh => crate::tanhf::tanh(x),
        UnOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnOp::Neg => -x,
        UnOp::Recip => 1.0 / x,
        UnOp::Sqrt => x.sqrt(),
        UnOp::Erf => crate::erff::erff(x),
        UnOp::GeluErf => gelu_erf(x),
        UnOp::Abs => x.abs(),
        UnOp::Log => libm::logf(x),
        UnOp::Floor => libm::floorf(x),
        UnOp::Ceil => libm::ceilf(x),
        UnOp::Sin => libm::sinf(x),
        UnOp::Cos => libm::cosf(x),
        // The element's bits are an i32 (`as` rounds to nearest even).
        UnOp::I32ToF32 => x.to_bits().cast_signed() as f32,
        // `as` rounds toward zero, saturates, and takes NaN to 0.
        UnOp::F32ToI32 => f32::from_bits((x as i32).cast_unsigned()),
    }
}

/// Applies a binary operation to one pair.
#[inline]
pub fn binary(op: BinOp, a: f32, b: f32) -> f32 {
    match op {
        BinOp::Add => a + b,
        BinOp::Sub => a - b,
        BinOp::Mul => a * b,
        BinOp::Max => max_nan(a, b),
        BinOp::Min => min_nan(a, b),
        BinOp::Eq => f32::from(u8::from(a == b)),
        BinOp::Ne => f32::from(u8::from(a != b)),
        BinOp::Lt => f32::from(u8::from(a < b)),
        BinOp::Le => f32::from(u8::from(a <= b)),
        BinOp::Gt => f32::from(u8::from(a > b)),
        BinOp::Ge => f32::from(u8::from(a >= b)),
        BinOp::Keep => {
            if a != 0.0 {
                b
            } else {
                0.0
            }
        }
    }
}

/// `vu.reduce` of `v`, an `[o, r, i]` array, over its middle axis: `o * i`
/// values. Each output is folded over `r` in order, from the value
/// `Iterator::sum` starts from (sum, mean) or `-inf` (max), as a fold per
/// output would be; the loops run along `i` inside, so the input is read
/// in order instead of with a stride of `i`.
fn reduce_axis(v: &[f32], op: RedOp, o: usize, r: usize, i: usize) -> Vec<f32> {
    let start = match op {
        RedOp::Sum | RedOp::Mean => std::iter::empty::<f32>().sum::<f32>(),
        RedOp::Max => f32::NEG_INFINITY,
    };
    let mut out = vec![start; o * i];
    if i == 0 {
        return out;
    }
    for (a, row) in out.chunks_exact_mut(i).enumerate() {
        for b in 0..r {
            let at = (a * r + b) * i;
            let x = &v[at..at + i];
            match op {
                RedOp::Sum | RedOp::Mean => row.iter_mut().zip(x).for_each(|(acc, x)| *acc += *x),
                RedOp::Max => row.iter_mut().zip(x).for_each(|(acc, x)| *acc = max_nan(*acc, *x)),
            }
        }
    }
    if op == RedOp::Mean {
        out.iter_mut().for_each(|acc| *acc /= r as f32);
    }
    out
}

/// Row-wise softmax in place (max-subtracted, as hardware does).
pub fn softmax_rows(v: &mut [f32], cols: usize) {
    if cols == 0 {
        return;
    }
    for row in v.chunks_exact_mut(cols) {
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, max_nan);
        let mut sum = 0.0f32;
        for x in row.iter_mut() {
            *x = (*x - mx).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        for x in row.iter_mut() {
            *x *= inv;
        }
    }
}

/// Row-wise layer norm in place.
pub fn layernorm_rows(v: &mut [f32], cols: usize, gamma: &[f32], beta: &[f32], eps: f32) {
    if cols == 0 {
        return;
    }
    for row in v.chunks_exact_mut(cols) {
        let mean = row.iter().sum::<f32>() / cols as f32;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / cols as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for (i, x) in row.iter_mut().enumerate() {
            *x = (*x - mean) * inv * gamma[i] + beta[i];
        }
    }
}

/// Row-wise RMS norm in place: `x / sqrt(mean(x^2) + eps) * gamma`.
pub fn rmsnorm_rows(v: &mut [f32], cols: usize, gamma: &[f32], eps: f32) {
    if cols == 0 {
        return;
    }
    for row in v.chunks_exact_mut(cols) {
        let ms = row.iter().map(|x| x * x).sum::<f32>() / cols as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (x, g) in row.iter_mut().zip(gamma) {
            *x = *x * inv * g;
        }
    }
}

/// A sliding window over an NHWC tensor of `n` images `h x w` with `c`
/// channels: kernel `kh x kw`, strides `sh`/`sw`, padding `top`/`left`, output
/// `ho x wo`.
struct Window {
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    top: usize,
    left: usize,
    ho: usize,
    wo: usize,
}

impl Window {
    /// Calls `f(out_pixel, tap, in_pixel)` for every output pixel (index
    /// over `n * ho * wo`) and every kernel tap (`ky * kw + kx`) whose input
    /// pixel (index over `n * h * w`) lies inside the image.
    #[inline(always)]
    fn for_each_tap(&self, f: impl FnMut(usize, usize, usize)) {
        self.for_each_tap_in(0..self.n * self.ho * self.wo, f);
    }

    /// [`Self::for_each_tap`] over output pixels `pixels` only.
    #[inline(always)]
    fn for_each_tap_in(&self, pixels: std::ops::Range<usize>, mut f: impl FnMut(usize, usize, usize)) {
        let per_image = self.ho * self.wo;
        for o in pixels {
            let (b, oy, ox) = (o / per_image, (o % per_image) / self.wo, o % self.wo);
            for ky in 0..self.kh {
                let Some(iy) = (oy * self.sh + ky).checked_sub(self.top).filter(|y| *y < self.h) else {
                    continue;
                };
                for kx in 0..self.kw {
                    let Some(ix) = (ox * self.sw + kx).checked_sub(self.left).filter(|x| *x < self.w) else {
                        continue;
                    };
                    f(o, ky * self.kw + kx, (b * self.h + iy) * self.w + ix);
                }
            }
        }
    }

    fn conv(g: &ConvGeom, c: u32, ho: usize, wo: usize) -> Self {
        Self {
            n: g.n as usize,
            h: g.h as usize,
            w: g.w as usize,
            c: c as usize,
            kh: g.kh as usize,
            kw: g.kw as usize,
            sh: g.stride_h as usize,
            sw: g.stride_w as usize,
            top: g.pad_top as usize,
            left: g.pad_left as usize,
            ho,
            wo,
        }
    }
}

/// im2col of output pixels `pixels` of an NHWC input: one row per output
/// pixel, `kh*kw*cin` columns in (ky, kx, c) order, zeros where the window
/// leaves the input.
pub fn im2col(input: &[f32], g: &ConvGeom, ho: usize, wo: usize, pixels: std::ops::Range<usize>) -> Vec<f32> {
    let mut out = Vec::new();
    im2col_into(input, g, ho, wo, pixels, &mut out);
    out
}

/// [`im2col`] into `out` (resized to the rows; its old contents are
/// overwritten, so one buffer serves every chunk of a convolution).
fn im2col_into(
    input: &[f32],
    g: &ConvGeom,
    ho: usize,
    wo: usize,
    pixels: std::ops::Range<usize>,
    out: &mut Vec<f32>,
) {
    let win = Window::conv(g, g.cin, ho, wo);
    let (cin, kw) = (win.c, win.kw);
    let kcols = win.kh * kw * cin;
    // Every element is written below (input values or the padding's
    // zeros), so the buffer's old contents need no clearing.
    out.resize(pixels.len() * kcols, 0.0);
    if pixels.is_empty() {
        return;
    }
    // The first pixel's image, row and column by division, the others'
    // by counting on: three divisions a pixel were most of this loop's
    // time for small images.
    let per_image = win.ho * win.wo;
    let o = pixels.start;
    let (mut b, mut oy, mut ox) = (o / per_image, (o % per_image) / win.wo, o % win.wo);
    for row in out.chunks_exact_mut(kcols.max(1)) {
        let (b, oy, ox) = {
            let here = (b, oy, ox);
            ox += 1;
            if ox == win.wo {
                ox = 0;
                oy += 1;
                if oy == win.ho {
                    oy = 0;
                    b += 1;
                }
            }
            here
        };
        // The taps kx in [kx0, kx1) of a row ky read input pixels ix0.. in
        // a row: one contiguous run of (kx1 - kx0) * cin values.
        let x_first = ox * win.sw;
        let kx0 = win.left.saturating_sub(x_first).min(kw);
        let kx1 = (win.w + win.left).saturating_sub(x_first).clamp(kx0, kw);
        for (ky, taps) in row.chunks_exact_mut((kw * cin).max(1)).enumerate() {
            match (oy * win.sh + ky).checked_sub(win.top).filter(|y| *y < win.h) {
                Some(iy) if kx1 > kx0 => {
                    let ix0 = x_first + kx0 - win.left;
                    let at = ((b * win.h + iy) * win.w + ix0) * cin;
                    let (left, rest) = taps.split_at_mut(kx0 * cin);
                    let (mid, right) = rest.split_at_mut((kx1 - kx0) * cin);
                    if !left.is_empty() {
                        left.fill(0.0);
                    }
                    mid.copy_from_slice(&input[at..at + mid.len()]);
                    if !right.is_empty() {
                        right.fill(0.0);
                    }
                }
                _ => taps.fill(0.0),
            }
        }
    }
}

/// Elements of im2col built at once, at most (bounds host memory per
/// instruction).
const IM2COL_CHUNK: usize = 1 << 22;

/// Elements of im2col buffer a thread keeps between convolutions.
const IM2COL_KEPT: usize = 1 << 21;

/// Elements of im2col a chunk aims at: a quarter of this host's L2 share
/// for typical cores (1 MiB), so the GEMM packs A from cache.
const IM2COL_CACHED: usize = 1 << 18;

/// Rows of an im2col chunk: about [`IM2COL_CACHED`] elements, but at
/// least 512 rows so that the GEMM's packing of the weights (once a
/// chunk) stays small beside its products, and at most [`IM2COL_CHUNK`]
/// elements. Never fewer than 65 rows unless the whole product has fewer:
/// the `gemm` crate picks its depth blocking (and so the order of the
/// sums) differently for products of at most 64 x 64, and a chunk must
/// give the bits the whole product gives.
fn im2col_rows(rows: usize, kk: usize) -> usize {
    let kk = kk.max(1);
    (IM2COL_CACHED / kk).max(512).min((IM2COL_CHUNK / kk).max(65)).min(rows).max(1)
}

/// Depthwise convolution of an NHWC tensor with `kh x kw x c` weights.
pub fn depthwise(input: &[f32], weights: &[f32], g: &ConvGeom, ho: usize, wo: usize) -> Vec<f32> {
    let win = Window::conv(g, g.cin, ho, wo);
    let mut out = vec![0.0f32; win.n * ho * wo * win.c];
    depthwise_into(&mut out, input, weights, g, ho, wo);
    out
}

/// [`depthwise`] into `out`, which holds exactly its `n x ho x wo x c`
/// values (what it held before does not matter): into SRAM in place,
/// without a buffer of its own.
fn depthwise_into(out: &mut [f32], input: &[f32], weights: &[f32], g: &ConvGeom, ho: usize, wo: usize) {
    simd(
        #[inline(always)]
        || depthwise_body(out, input, weights, g, ho, wo),
    )
}

#[inline(always)]
fn depthwise_body(out: &mut [f32], input: &[f32], weights: &[f32], g: &ConvGeom, ho: usize, wo: usize) {
    let win = Window::conv(g, g.cin, ho, wo);
    let c = win.c;
    out.fill(0.0);
    let taps = win.kh * win.kw;
    // Padding is zeros that take part in the products, as in `sa.conv2d`
    // (im2col): only a non-finite weight makes that visible (0 x inf is
    // NaN), so padded taps are walked only for such weights.
    let odd: Vec<usize> = (0..taps * c).filter(|&j| !weights[j].is_finite()).collect();
    let mut inside = if odd.is_empty() { Vec::new() } else { vec![false; win.n * ho * wo * taps] };
    win.for_each_tap(|o, tap, i| {
        // Whole rows of channels (bounds checked once a row, so the loop
        // vectorizes); the same products in the same order.
        let (out, x, w) =
            (&mut out[o * c..(o + 1) * c], &input[i * c..(i + 1) * c], &weights[tap * c..(tap + 1) * c]);
        for ((o, x), w) in out.iter_mut().zip(x).zip(w) {
            *o += x * w;
        }
        if let Some(seen) = inside.get_mut(o * taps + tap) {
            *seen = true;
        }
    });
    for o in 0..inside.len() / taps.max(1) {
        for &j in &odd {
            if !inside[o * taps + j / c] {
                out[o * c + j % c] += 0.0 * weights[j];
            }
        }
    }
}

/// Pooling over an NHWC tensor (average over the in-bounds elements).
pub fn pool(input: &[f32], op: PoolOp, g: &PoolGeom, ho: usize, wo: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; g.n as usize * ho * wo * g.c as usize];
    pool_into(&mut out, input, op, g, ho, wo);
    out
}

/// [`pool`] into `out`, which holds exactly its `n x ho x wo x c` values
/// (what it held before does not matter): into SRAM in place.
fn pool_into(out: &mut [f32], input: &[f32], op: PoolOp, g: &PoolGeom, ho: usize, wo: usize) {
    simd(
        #[inline(always)]
        || pool_body(out, input, op, g, ho, wo),
    )
}

#[inline(always)]
fn pool_body(out: &mut [f32], input: &[f32], op: PoolOp, g: &PoolGeom, ho: usize, wo: usize) {
    let win = Window {
        n: g.n as usize,
        h: g.h as usize,
        w: g.w as usize,
        c: g.c as usize,
        kh: g.kh as usize,
        kw: g.kw as usize,
        sh: g.stride as usize,
        sw: g.stride as usize,
        top: g.pad as usize,
        left: g.pad as usize,
        ho,
        wo,
    };
    let c = win.c;
    let pixels = win.n * ho * wo;
    let max = op == PoolOp::Max;
    out.fill(if max { f32::NEG_INFINITY } else { 0.0 });
    let mut count = vec![0u32; pixels];
    win.for_each_tap(|o, _, i| {
        count[o] += 1;
        // Whole rows of channels (bounds checked once a row) and the
        // operation chosen once a row, so each loop vectorizes; the same
        // operations in the same order.
        let (acc, x) = (&mut out[o * c..(o + 1) * c], &input[i * c..(i + 1) * c]);
        if max {
            for (a, v) in acc.iter_mut().zip(x) {
                *a = max_nan(*a, *v);
            }
        } else {
            for (a, v) in acc.iter_mut().zip(x) {
                *a += *v;
            }
        }
    });
    if !max {
        for (o, n) in count.iter().enumerate() {
            out[o * c..(o + 1) * c].iter_mut().for_each(|v| *v /= (*n).max(1) as f32);
        }
    }
}

/// Copies `len` bytes from `s` in one memory to `d` in another: in one
/// pass when either side is one flat buffer; through `buf` only between
/// two memories that are not, a piece of at most `BOUNCE_BYTES` at a
/// time (a row may be a whole weight tensor, a load program's one copy
/// from guest memory into HBM, and a buffer that large would be fresh
/// memory, a page fault per 4 KiB, on every such copy).
fn copy_piece(
    s_mem: &dyn Memory,
    d_mem: &mut dyn Memory,
    s: u64,
    d: u64,
    len: usize,
    buf: &mut Vec<u8>,
) -> Result<(), KernelError> {
    if len == 0 {
        return Ok(());
    }
    if let Some(out) = d_mem.slice_mut(d, len as u64) {
        s_mem.read(s, out)?;
    } else if let Some(from) = s_mem.slice(s, len as u64) {
        d_mem.write(d, from)?;
    } else {
        buf.resize(len.min(BOUNCE_BYTES), 0);
        let mut done = 0;
        while done < len {
            let n = buf.len().min(len - done);
            let at = done as u64;
            let sp = s.checked_add(at).ok_or(KernelError::Geometry("src overflow"))?;
            let dp = d.checked_add(at).ok_or(KernelError::Geometry("dst overflow"))?;
            s_mem.read(sp, &mut buf[..n])?;
            d_mem.write(dp, &buf[..n])?;
            done += n;
        }
    }
    Ok(())
}

fn copy_rows(
    mem: &mut CoreMemory<'_>,
    src: Addr,
    dst: Addr,
    rows: u64,
    row: usize,
    src_stride: u64,
    dst_stride: u64,
) -> Result<(), KernelError> {
    let total = limit(rows.saturating_mul(row as u64))?;
    if rows == 0 || row == 0 {
        return Ok(());
    }
    if src.space != dst.space {
        // Different memories: read straight into the destination when it
        // is one flat buffer.
        let (s_mem, d_mem): (&dyn Memory, &mut dyn Memory) = match (src.space, dst.space) {
            (Space::Sram, Space::Hbm) => (&*mem.sram, &mut *mem.hbm),
            (Space::Sram, Space::Guest) => (&*mem.sram, &mut *mem.guest),
            (Space::Hbm, Space::Sram) => (&*mem.hbm, &mut *mem.sram),
            (Space::Hbm, Space::Guest) => (&*mem.hbm, &mut *mem.guest),
            (Space::Guest, Space::Sram) => (&*mem.guest, &mut *mem.sram),
            (Space::Guest, Space::Hbm) => (&*mem.guest, &mut *mem.hbm),
            _ => return Err(KernelError::Geometry("copy between equal spaces")),
        };
        if rows > 1 && src.space != Space::Guest && dst.space != Space::Guest {
            // Between SRAM and HBM: the flat side's rows straight from or
            // into the other memory's rows (a strided store of a product
            // into a concatenation's columns, a strided load).
            if let Some(r) =
                rows_to_or_from_flat(s_mem, d_mem, (src, src_stride), (dst, dst_stride), rows, row)
            {
                return r;
            }
        }
        if row < SMALL_ROW {
            if let Some(r) = copy_small_rows(s_mem, d_mem, (src, src_stride), (dst, dst_stride), rows, row) {
                return r;
            }
            return with_bytes(&ROWS_BUF, total, |buf| {
                gather_rows(s_mem, src.offset, rows, row, src_stride, src.space != Space::Guest, buf)?;
                scatter_rows(d_mem, dst.offset, rows, row, dst_stride, dst.space != Space::Guest, buf)
            });
        }
        let mut buf = Vec::new();
        let granule = d_mem.map_granule();
        for r in 0..rows {
            let s = row_at(src.offset, r, src_stride, "src overflow")?;
            let d = row_at(dst.offset, r, dst_stride, "dst overflow")?;
            if granule == 0 || (row as u64) < granule / 2 {
                copy_piece(s_mem, d_mem, s, d, row, &mut buf)?;
                continue;
            }
            // The row a granule of the destination at a time: a piece whose
            // bytes come from a file's unchanged pages (a model's weights
            // in guest RAM, on their way to HBM) maps those pages if the
            // destination takes it; the rest is copied.
            let end = d.checked_add(row as u64).ok_or(KernelError::Geometry("dst overflow"))?;
            let mut at = d;
            while at < end {
                let n = (granule - at % granule).min(end - at);
                let from = s.checked_add(at - d).ok_or(KernelError::Geometry("src overflow"))?;
                // (The destination decides which pieces pay: at least
                // half a granule, or one into a granule never written.)
                let mapped = s_mem
                    .file_pages(from, n)
                    .is_some_and(|(file, offset)| d_mem.map_file(at, n, file, offset));
                if !mapped {
                    copy_piece(s_mem, d_mem, from, at, n as usize, &mut buf)?;
                }
                at += n;
            }
        }
        return Ok(());
    }
    if src.space == dst.space && row >= SMALL_ROW {
        let span = |base: u64, stride: u64| Some(base..base.checked_add(rows_span(rows, row, stride)?)?);
        if let (Some(s), Some(d)) = (span(src.offset, src_stride), span(dst.offset, dst_stride)) {
            if s.end <= d.start || d.end <= s.start {
                // No row written is read: row by row in place.
                let (at, strides) = ((src.offset, dst.offset), (src_stride, dst_stride));
                mem.space(src.space).copy_rows_within(at, rows, row as u64, strides)?;
                return Ok(());
            }
        }
    }
    // One memory (or small rows): every row is read before any is written
    // (the ISA's rule for all instructions), so overlapping rows copy the
    // old bytes.
    let spans = |space| space != Space::Guest;
    with_bytes(&ROWS_BUF, total, |buf| {
        gather_rows(mem.space(src.space), src.offset, rows, row, src_stride, spans(src.space), buf)?;
        scatter_rows(mem.space(dst.space), dst.offset, rows, row, dst_stride, spans(dst.space), buf)
    })
}

thread_local! {
    /// Byte buffers of [`with_bytes`], one per use (`ROWS_BUF`: the rows
    /// of a copy; `SPAN_BUF`: the span of small rows), kept per thread:
    /// small DMA copies are many, and each allocated and zeroed its
    /// buffers.
    static ROWS_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static SPAN_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// The largest bounce buffer of a copy between two memories that are not
/// flat buffers ([`copy_rows`]): an HBM chunk.
const BOUNCE_BYTES: usize = crate::memory::HBM_CHUNK as usize;

/// Buffers larger than this are not kept between calls.
const KEEP_BYTES: usize = 16 << 20;

/// Runs `f` on a buffer of `n` bytes, contents unspecified (`f` must
/// write what it reads): this thread's buffer `key`
/// ([`crate::scratch::with_scratch`]), kept afterwards unless larger than
/// [`KEEP_BYTES`].
fn with_bytes<R>(key: &'static LocalKey<RefCell<Vec<u8>>>, n: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    with_scratch(
        key,
        |buf| buf.len() <= KEEP_BYTES,
        |buf| {
            if buf.len() < n {
                buf.resize(n, 0);
            }
            f(&mut buf[..n])
        },
    )
}

/// The address of row `r` of rows `stride` apart from `base`.
fn row_at(base: u64, r: u64, stride: u64, what: &'static str) -> Result<u64, KernelError> {
    base.checked_add(r.saturating_mul(stride)).ok_or(KernelError::Geometry(what))
}

/// Bytes from the first byte of row 0 to the last of row `rows - 1`
/// (`rows` at least 1), rows of `row` bytes `stride` apart.
fn rows_span(rows: u64, row: usize, stride: u64) -> Option<u64> {
    (rows - 1).checked_mul(stride)?.checked_add(row as u64)
}

/// Rows shorter than this are moved through one access to their whole
/// span (a call per row costs more than the bytes between them).
const SMALL_ROW: usize = 256;

/// Copies rows between two different memories, one of them a flat
/// buffer over its rows' span, with [`Memory::write_rows`] or
/// [`Memory::read_rows`] on the other: no buffer between them, and the
/// other memory's lookups made once per run of rows (LazyHbm: per chunk).
/// `None` when neither side is flat there.
fn rows_to_or_from_flat(
    s_mem: &dyn Memory,
    d_mem: &mut dyn Memory,
    (src, ss): (Addr, u64),
    (dst, ds): (Addr, u64),
    rows: u64,
    row: usize,
) -> Option<Result<(), KernelError>> {
    let s_span = rows_span(rows, row, ss)?;
    let d_span = rows_span(rows, row, ds)?;
    // A flat side's span is in memory, so its stride fits a `usize`.
    let shape = (rows, row as u64);
    if let Some(from) = s_mem.slice(src.offset, s_span) {
        let r = d_mem.write_rows(dst.offset, (shape.0, shape.1, ds), from, usize::try_from(ss).ok()?);
        return Some(r.map_err(KernelError::from));
    }
    let to = d_mem.slice_mut(dst.offset, d_span)?;
    let r = s_mem.read_rows(src.offset, (shape.0, shape.1, ss), to, usize::try_from(ds).ok()?);
    Some(r.map_err(KernelError::from))
}

/// Copies short rows between two different memories without a dense
/// buffer between them when one side is a flat buffer: rows go from
/// slice to slice, or between a slice and the other memory's span read
/// (and, for a destination, written back) whole. Row by row in order, so
/// overlapping destination rows end as the later row (as
/// [`scatter_rows`]). `None` when neither side is flat (or a span is out
/// of range): the caller's dense path then runs and reports errors.
fn copy_small_rows(
    s_mem: &dyn Memory,
    d_mem: &mut dyn Memory,
    (src, ss): (Addr, u64),
    (dst, ds): (Addr, u64),
    rows: u64,
    row: usize,
) -> Option<Result<(), KernelError>> {
    let s_span = rows_span(rows, row, ss)?;
    let d_span = rows_span(rows, row, ds)?;
    // Both spans fit in memory, so both strides fit a `usize`.
    let (su, du) = (ss as usize, ds as usize);
    if let Some(to) = d_mem.slice_mut(dst.offset, d_span) {
        if let Some(from) = s_mem.slice(src.offset, s_span) {
            copy_strided(from, su, to, du, rows, row);
            return Some(Ok(()));
        }
        let span = small_rows_span(rows, row, ss, src.space != Space::Guest)?;
        return Some(with_bytes(&SPAN_BUF, span, |whole| {
            s_mem.read(src.offset, whole)?;
            copy_strided(whole, su, to, du, rows, row);
            Ok(())
        }));
    }
    let from = s_mem.slice(src.offset, s_span)?;
    // The destination's bytes between the rows are written back as they
    // were.
    let span = small_rows_span(rows, row, ds, dst.space != Space::Guest)?;
    Some(with_bytes(&SPAN_BUF, span, |whole| {
        d_mem.read(dst.offset, whole)?;
        copy_strided(from, su, whole, du, rows, row);
        d_mem.write(dst.offset, whole)?;
        Ok(())
    }))
}

/// Copies `rows` rows of `row` bytes, `ss` apart in `from`, to rows
/// `ds` apart in `to`, in order (overlapping destination rows end as the
/// later row). The caller passes spans that hold every row
/// ([`rows_span`]), so no index overflows or falls outside.
///
/// Rows of one, two or four f32 elements (a layout change of a tensor
/// with few channels, such as an image's NCHW-to-NHWC copy) are copied
/// as fixed-size moves; other lengths through `memcpy`, one call a row.
fn copy_strided(from: &[u8], ss: usize, to: &mut [u8], ds: usize, rows: u64, row: usize) {
    match row {
        4 => copy_strided_n::<4>(from, ss, to, ds, rows),
        8 => copy_strided_n::<8>(from, ss, to, ds, rows),
        16 => copy_strided_n::<16>(from, ss, to, ds, rows),
        _ => {
            for r in 0..rows as usize {
                let (a, b) = (r * ss, r * ds);
                to[b..b + row].copy_from_slice(&from[a..a + row]);
            }
        }
    }
}

/// [`copy_strided`] for rows of `N` bytes.
#[inline(always)]
fn copy_strided_n<const N: usize>(from: &[u8], ss: usize, to: &mut [u8], ds: usize, rows: u64) {
    for r in 0..rows as usize {
        let (a, b) = (r * ss, r * ds);
        // A constant length: a move, not a `memcpy` call.
        to[b..b + N].copy_from_slice(&from[a..a + N]);
    }
}

/// The span of `rows` rows of `row` bytes, `stride` apart, to read or
/// write at once instead of row by row: `Some(bytes)` when the rows are
/// short and the span is at most four times their bytes. Never in guest
/// memory (`spans` false): the bytes between the rows may be the guest's
/// to write meanwhile, or not memory at all.
fn small_rows_span(rows: u64, row: usize, stride: u64, spans: bool) -> Option<usize> {
    if !spans || row >= SMALL_ROW {
        return None;
    }
    let span = rows_span(rows, row, stride)?;
    (span <= rows.saturating_mul(row as u64).saturating_mul(4)).then_some(span as usize)
}

/// Reads `rows` rows of `out.len() / rows` bytes, `stride` apart from
/// `base`, into `out` (densely). `rows` is at least 1.
fn gather_rows(
    m: &dyn Memory,
    base: u64,
    rows: u64,
    row: usize,
    stride: u64,
    spans: bool,
    out: &mut [u8],
) -> Result<(), KernelError> {
    if stride == row as u64 || rows == 1 {
        m.read(base, out)?;
    } else if let Some(span) = small_rows_span(rows, row, stride, spans) {
        with_bytes(&SPAN_BUF, span, |whole| -> Result<(), KernelError> {
            m.read(base, whole)?;
            // `r * stride + row <= span`, so neither overflows.
            copy_strided(whole, stride as usize, out, row, rows, row);
            Ok(())
        })?;
    } else {
        for (r, chunk) in (0..rows).zip(out.chunks_exact_mut(row)) {
            m.read(row_at(base, r, stride, "src overflow")?, chunk)?;
        }
    }
    Ok(())
}

/// Writes the dense rows of `data` to `rows` rows `stride` apart from
/// `base` (later rows over earlier ones where they overlap). `rows` is at
/// least 1.
fn scatter_rows(
    m: &mut dyn Memory,
    base: u64,
    rows: u64,
    row: usize,
    stride: u64,
    spans: bool,
    data: &[u8],
) -> Result<(), KernelError> {
    if stride == row as u64 || rows == 1 {
        m.write(base, data)?;
    } else if let Some(span) = small_rows_span(rows, row, stride, spans) {
        // The bytes between the rows are written back as they were.
        with_bytes(&SPAN_BUF, span, |whole| -> Result<(), KernelError> {
            m.read(base, whole)?;
            copy_strided(data, row, whole, stride as usize, rows, row);
            m.write(base, whole)?;
            Ok(())
        })?;
    } else {
        for (r, chunk) in (0..rows).zip(data.chunks_exact(row)) {
            m.write(row_at(base, r, stride, "dst overflow")?, chunk)?;
        }
    }
    Ok(())
}

/// Byte spans of A, B and C of an in-place GEMM of shape `s` with
/// leading dimensions `lda`, `ldb`, `ldc` (elements), from the first byte
/// of the first row to the last byte of the last row; `None` when any
/// span overflows 64 bits, a leading dimension is smaller than its row
/// (rows would overlap, and C's rows would alias each other), or a stride
/// does not fit the pointer arithmetic of the GEMM (`isize`).
fn in_place_spans(s: GemmShape, lda: usize, ldb: usize, ldc: usize) -> Option<(u64, u64, u64)> {
    let span = |rows: usize, cols: usize, ld: usize| -> Option<u64> {
        if rows == 0 || cols == 0 || (rows > 1 && ld < cols) || isize::try_from(ld).is_err() {
            return None;
        }
        let elems = (rows - 1).checked_mul(ld)?.checked_add(cols)?;
        u64::try_from(elems).ok()?.checked_mul(4)
    };
    let GemmShape { m, k, n, b_transposed, .. } = s;
    let b = if b_transposed { span(n, k, ldb)? } else { span(k, n, ldb)? };
    Some((span(m, k, lda)?, b, span(m, n, ldc)?))
}

/// `sa.matmul` on f32 operands in place in SRAM, when every operand is
/// 4-byte aligned and C overlaps neither A nor B (the verifier has checked
/// the ranges; they are checked again here). Returns false when the fast
/// path does not apply.
#[allow(clippy::too_many_arguments)]
fn matmul_in_place(
    sram: &mut Sram,
    a: u64,
    b: u64,
    c: u64,
    s: GemmShape,
    lda: usize,
    ldb: usize,
    ldc: usize,
) -> bool {
    let Some((a_len, b_len, c_len)) = in_place_spans(s, lda, ldb, ldc) else {
        return false;
    };
    let bytes = sram.bytes_mut();
    let Ok(size) = u64::try_from(bytes.len()) else { return false };
    // Every sum below is overflow-checked: in release builds plain `+` and
    // `*` wrap, and a wrapped span would pass the range checks.
    let inside = |o: u64, l: u64| o.is_multiple_of(4) && o.checked_add(l).is_some_and(|e| e <= size);
    let disjoint = |o1: u64, l1: u64, o2: u64, l2: u64| {
        o1.checked_add(l1).is_some_and(|e| e <= o2) || o2.checked_add(l2).is_some_and(|e| e <= o1)
    };
    let usable = inside(a, a_len)
        && inside(b, b_len)
        && inside(c, c_len)
        && disjoint(a, a_len, c, c_len)
        && disjoint(b, b_len, c, c_len);
    if !usable {
        return false;
    }
    let base = bytes.as_mut_ptr();
    if !(base as usize).is_multiple_of(4) {
        return false;
    }
    // The leading dimensions fit `isize` (checked by `in_place_spans`).
    let (b_cs, b_rs) = if s.b_transposed { (ldb as isize, 1) } else { (1, ldb as isize) };
    // SAFETY: `base` points to the live SRAM buffer of `size` bytes, which
    // `sram` (borrowed mutably through `bytes`) keeps alive and unaliased
    // for the call. A, B and C lie inside it (`inside`, on spans computed
    // with overflow-checked arithmetic), are 4-byte aligned (offsets and
    // base checked), C's byte range is disjoint from A's and B's, and C's
    // rows do not overlap (ldc >= n), so the only writes (to C) never
    // alias a read or each other. The strides describe the row-major
    // layouts whose extents `in_place_spans` computed, so gemm touches no
    // byte outside those ranges.
    unsafe {
        gemm_raw(
            base.add(c as usize).cast::<f32>(),
            ldc as isize,
            base.add(a as usize).cast::<f32>().cast_const(),
            lda as isize,
            base.add(b as usize).cast::<f32>().cast_const(),
            b_cs,
            b_rs,
            s,
        );
    }
    true
}

/// SRAM as f32 values, for the kernels that work on it in place: on a
/// little-endian host (where SRAM's bytes are the values' own
/// representation) and a 4-byte aligned buffer (SRAM's is 8-byte aligned,
/// or page aligned when file-backed). A trailing partial word is left out.
fn sram_f32s(sram: &mut Sram) -> Option<&mut [f32]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    let b = sram.bytes_mut();
    let n = b.len() / 4 * 4;
    bytemuck::try_cast_slice_mut(b.get_mut(..n)?).ok()
}

/// The values `[addr, addr + 4 n)` of SRAM as indices into
/// [`sram_f32s`]'s `len` values, when `addr` is 4-byte aligned and the
/// span lies inside (overflow-checked).
fn f32_span(addr: u64, n: usize, len: usize) -> Option<std::ops::Range<usize>> {
    if !addr.is_multiple_of(4) {
        return None;
    }
    let start = usize::try_from(addr / 4).ok()?;
    let end = start.checked_add(n)?;
    (end <= len).then_some(start..end)
}

/// `out` of `v` mutably and each of `ins` shared, when no input overlaps
/// `out` (inputs may overlap each other): the operands of an instruction
/// that reads every input before it writes its output, in place.
fn split_views<const N: usize>(
    v: &mut [f32],
    out: std::ops::Range<usize>,
    ins: [std::ops::Range<usize>; N],
) -> Option<(&mut [f32], [&[f32]; N])> {
    if out.end > v.len() || ins.iter().any(|r| r.start < out.end && out.start < r.end || r.end > v.len()) {
        return None;
    }
    let (left, rest) = v.split_at_mut(out.start);
    let (o, right) = rest.split_at_mut(out.len());
    let (left, right) = (&*left, &*right);
    let view = |r: std::ops::Range<usize>| {
        if r.end <= out.start {
            left.get(r)
        } else {
            right.get(r.start - out.end..r.end - out.end)
        }
    };
    let mut views: [&[f32]; N] = [&[]; N];
    for (slot, r) in views.iter_mut().zip(ins) {
        *slot = view(r)?;
    }
    Some((o, views))
}

/// The spans of `ins` (address, number of values) among SRAM's `len`
/// f32 values ([`f32_span`]); `None` when any is unaligned or outside.
fn f32_spans<const N: usize>(ins: [(u64, usize); N], len: usize) -> Option<[std::ops::Range<usize>; N]> {
    let mut spans: [std::ops::Range<usize>; N] = std::array::from_fn(|_| 0..0);
    for (slot, (addr, n)) in spans.iter_mut().zip(ins) {
        *slot = f32_span(addr, n, len)?;
    }
    Some(spans)
}

/// The output `out` (address, number of values) of SRAM as f32 values
/// mutably and each of `ins` shared, for an instruction that reads its
/// inputs and writes its output in place: `None` (nothing touched) unless
/// SRAM holds f32 values, every span is aligned and inside, and no input
/// overlaps the output ([`split_views`]).
fn sram_views<const N: usize>(
    sram: &mut Sram,
    out: (u64, usize),
    ins: [(u64, usize); N],
) -> Option<(&mut [f32], [&[f32]; N])> {
    let v = sram_f32s(sram)?;
    let len = v.len();
    let o = f32_span(out.0, out.1, len)?;
    let spans = f32_spans(ins, len)?;
    split_views(v, o, spans)
}

/// An instruction that works on `n` f32 values in place (softmax, layer
/// normalization), run on SRAM itself: `src`'s values copied to `dst`
/// (unless they are the same span), then `f(dst, inputs)` with the
/// read-only `inputs` (address, length) as views. False, with nothing
/// touched, unless every span is aligned and inside, `src` and `dst` are
/// the same or disjoint, and no input overlaps `dst` (all checked before
/// the copy): then the caller reads, computes and writes as before, with
/// the same values.
fn rows_in_sram<const N: usize>(
    sram: &mut Sram,
    (src, dst, n): (u64, u64, usize),
    inputs: [(u64, usize); N],
    f: impl FnOnce(&mut [f32], [&[f32]; N]),
) -> bool {
    if n == 0 {
        return false;
    }
    let Some(v) = sram_f32s(sram) else { return false };
    let len = v.len();
    let (Some(s), Some(d)) = (f32_span(src, n, len), f32_span(dst, n, len)) else {
        return false;
    };
    let Some(ins) = f32_spans(inputs, len) else { return false };
    let overlaps = |r: &std::ops::Range<usize>| r.start < d.end && d.start < r.end;
    if (s != d && overlaps(&s)) || ins.iter().any(overlaps) {
        return false;
    }
    if s != d {
        v.copy_within(s, d.start);
    }
    let Some((out, views)) = split_views(v, d, ins) else { return false };
    f(out, views);
    true
}

/// SRAM as f32 values and the spans of the `n` values at `src` and
/// `dst` in it, for the element loops that work in place (`None`: no
/// values, or a span unaligned or outside).
fn map_spans(
    sram: &mut Sram,
    src: u64,
    dst: u64,
    n: usize,
) -> Option<(&mut [f32], std::ops::Range<usize>, std::ops::Range<usize>)> {
    if n == 0 {
        return None;
    }
    let v = sram_f32s(sram)?;
    let s = f32_span(src, n, v.len())?;
    let d = f32_span(dst, n, v.len())?;
    Some((v, s, d))
}

/// `dst[i] = f(src[i])` for `n` f32 values in SRAM, in place: `src` and
/// `dst` the same values, or not overlapping. False when the fast path
/// does not apply (then nothing was touched).
fn map_in_sram(sram: &mut Sram, src: u64, dst: u64, n: usize, f: impl Fn(f32) -> f32) -> bool {
    let Some((v, s, d)) = map_spans(sram, src, dst, n) else { return false };
    if s == d {
        let v = &mut v[d];
        // `for` loops, not `for_each`: `for_each` is a function of its
        // own that the inliner may leave out of the AVX2 one when `f` is
        // large (tanh), and then it is compiled for the baseline. The
        // closures take `f` by value (`move`): borrowed, the values it
        // captures (a clamp's bounds) might alias `v` as far as the
        // optimizer knows, are reloaded every element, and the loop stays
        // scalar.
        simd(
            #[inline(always)]
            move || {
                for x in v.iter_mut() {
                    *x = f(*x);
                }
            },
        );
        return true;
    }
    let Some((out, [x])) = split_views(v, d, [s]) else { return false };
    simd(
        #[inline(always)]
        move || {
            for (o, x) in out.iter_mut().zip(x) {
                *o = f(*x);
            }
        },
    );
    true
}

/// `vu.binary` on `n` f32 values in SRAM, in place: the output the same
/// values as `a` (an accumulation) or overlapping no input, and `b`
/// overlapping no output. False when the fast path does not apply (then
/// nothing was touched).
fn binary_in_sram(
    sram: &mut Sram,
    (op, bcast): (BinOp, Bcast),
    (a, b, dst): (u64, u64, u64),
    n: usize,
    cols: usize,
) -> bool {
    if n == 0 || cols == 0 {
        return false;
    }
    let Some(v) = sram_f32s(sram) else { return false };
    let len = v.len();
    let (Some(ra), Some(rb), Some(rd)) =
        (f32_span(a, n, len), f32_span(b, broadcast_len(bcast, n, cols), len), f32_span(dst, n, len))
    else {
        return false;
    };
    if ra == rd {
        let Some((out, [bv])) = split_views(v, rd, [rb]) else { return false };
        binary_into(op, bcast, cols, out, None, bv);
        return true;
    }
    let Some((out, [av, bv])) = split_views(v, rd, [ra, rb]) else { return false };
    binary_into(op, bcast, cols, out, Some(av), bv);
    true
}

/// Elements of `vu.binary`'s `b` for `n` elements of `a` in rows of
/// `cols` (none when `n` is 0: zero-sized operands touch nothing).
fn broadcast_len(bcast: Bcast, n: usize, cols: usize) -> usize {
    match (n, bcast) {
        (0, _) => 0,
        (_, Bcast::None) => n,
        (_, Bcast::Row) => cols,
        (_, Bcast::Scalar) => 1,
    }
}

/// `out = op(a, b)` (`a`: `out` itself when `None`) with `b` broadcast
/// as `bcast` over rows of `cols`, one loop per operation and broadcast,
/// so each is compiled for its operation (and vectorized where it can
/// be); the same values as [`binary`] element by element.
fn binary_into(op: BinOp, bcast: Bcast, cols: usize, out: &mut [f32], a: Option<&[f32]>, b: &[f32]) {
    macro_rules! each {
        ($($v:ident),*) => {
            match op {
                $(BinOp::$v => binary_loop(bcast, cols, out, a, b, |x, y| binary(BinOp::$v, x, y)),)*
            }
        };
    }
    simd(
        #[inline(always)]
        || each!(Add, Sub, Mul, Max, Min, Eq, Ne, Lt, Le, Gt, Ge, Keep),
    )
}

#[inline(always)]
fn binary_loop(
    bcast: Bcast,
    cols: usize,
    out: &mut [f32],
    a: Option<&[f32]>,
    b: &[f32],
    f: impl Fn(f32, f32) -> f32,
) {
    let row = |o: &mut [f32], a: Option<&[f32]>, b: &[f32]| match a {
        Some(a) => o.iter_mut().zip(a).zip(b).for_each(|((o, x), y)| *o = f(*x, *y)),
        None => o.iter_mut().zip(b).for_each(|(o, y)| *o = f(*o, *y)),
    };
    match bcast {
        Bcast::None => row(out, a, b),
        Bcast::Row => {
            for (r, o) in out.chunks_mut(cols.max(1)).enumerate() {
                row(o, a.and_then(|a| a.get(r * cols..(r + 1) * cols)), b);
            }
        }
        Bcast::Scalar => {
            let Some(&y) = b.first() else { return };
            match a {
                Some(a) => out.iter_mut().zip(a).for_each(|(o, x)| *o = f(*x, y)),
                None => out.iter_mut().for_each(|o| *o = f(*o, y)),
            }
        }
    }
}

/// As [`map_in_sram`], with a function of a block of values (`xs` in,
/// `out` of the same length) instead of one value: `src` and `dst` the
/// same values (each block of [`crate::erff::BLOCK`] copied out first, so
/// `f` reads the old values) or not overlapping.
fn blocks_in_sram(sram: &mut Sram, src: u64, dst: u64, n: usize, f: impl Fn(&[f32], &mut [f32])) -> bool {
    const B: usize = crate::erff::BLOCK;
    let Some((v, s, d)) = map_spans(sram, src, dst, n) else { return false };
    if s == d {
        let v = &mut v[d];
        simd(
            #[inline(always)]
            move || {
                let mut old = [0.0f32; B];
                for block in v.chunks_mut(B) {
                    let old = &mut old[..block.len()];
                    old.copy_from_slice(block);
                    f(old, block);
                }
            },
        );
        return true;
    }
    let Some((out, [x])) = split_views(v, d, [s]) else { return false };
    simd(
        #[inline(always)]
        move || f(x, out),
    );
    true
}

/// [`map_in_sram`] of `op`, one loop per operation (see [`binary_into`]);
/// `erf` and the exact GELU through [`crate::erff::map_erf`].
fn unary_in_sram(sram: &mut Sram, op: UnOp, src: u64, dst: u64, n: usize) -> bool {
    macro_rules! each {
        ($($v:ident),*) => {
            match op {
                UnOp::Erf => blocks_in_sram(sram, src, dst, n, #[inline(always)] |x, out| {
                    crate::erff::map_erf(x, out, #[inline(always)] |x| x, #[inline(always)] |_, e| e)
                }),
                UnOp::GeluErf => blocks_in_sram(sram, src, dst, n, #[inline(always)] |x, out| {
                    crate::erff::map_erf(x, out, gelu_erf_arg, gelu_erf_of)
                }),
                $(UnOp::$v => map_in_sram(sram, src, dst, n, #[inline(always)] |x| unary(UnOp::$v, x)),)*
            }
        };
    }
    each!(
        Copy, Relu, Gelu, Exp, Tanh, Sigmoid, Neg, Recip, Sqrt, Abs, Log, Floor, Ceil, Sin, Cos, I32ToF32,
        F32ToI32
    )
}

/// `sa.conv2d`'s products: `out += im2col(x) * w`, a chunk of output
/// pixels at a time.
#[allow(clippy::too_many_arguments)]
fn conv_products(
    x: &[f32],
    wv: &[f32],
    out: &mut [f32],
    g: &ConvGeom,
    ho: usize,
    wo: usize,
    rows: usize,
    kk: usize,
) {
    let cout = g.cout as usize;
    // A 1x1 window at stride 1 without padding: each output pixel's
    // im2col row is its input pixel's channels, so the input is the
    // im2col matrix itself (the same values, no copy).
    let pointwise = (g.kh, g.kw, g.stride_h, g.stride_w) == (1, 1, 1, 1)
        && (g.pad_top, g.pad_bottom, g.pad_left, g.pad_right) == (0, 0, 0, 0)
        && x.len() == rows * kk;
    if pointwise {
        let shape = GemmShape { m: rows, k: kk, n: cout, b_transposed: false, accumulate: true };
        gemm_f32(&x[..rows * kk], wv, &mut out[..rows * cout], shape);
        return;
    }
    // Re-entered (a rayon worker waiting in the GEMM took another
    // convolution): a buffer of its own.
    with_scratch(&IM2COL_BUF, |_| true, |cols| conv_chunks(x, wv, out, g, ho, wo, rows, kk, cols));
}

thread_local! {
    /// The im2col buffer of this thread's convolutions, kept between
    /// instructions (no fresh pages to zero and fault in every time).
    static IM2COL_BUF: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The chunks of [`conv_products`] through the im2col buffer `cols`.
#[allow(clippy::too_many_arguments)]
fn conv_chunks(
    x: &[f32],
    wv: &[f32],
    out: &mut [f32],
    g: &ConvGeom,
    ho: usize,
    wo: usize,
    rows: usize,
    kk: usize,
    cols: &mut Vec<f32>,
) {
    let cout = g.cout as usize;
    let chunk = im2col_rows(rows, kk);
    let mut p0 = 0;
    while p0 < rows {
        let mut p1 = (p0 + chunk).min(rows);
        if rows - p1 < 65 {
            // No short last chunk (see `im2col_rows`).
            p1 = rows;
        }
        let shape = GemmShape { m: p1 - p0, k: kk, n: cout, b_transposed: false, accumulate: true };
        im2col_into(x, g, ho, wo, p0..p1, cols);
        gemm_f32(cols, wv, &mut out[p0 * cout..p1 * cout], shape);
        p0 = p1;
    }
    if cols.capacity() > IM2COL_KEPT {
        // A rare huge chunk is not held for the thread's lifetime.
        *cols = Vec::new();
    }
}

/// Executes one instruction on real data. Signal, wait and halt are the
/// scheduler's business and do nothing here.
pub fn execute(instr: &Instr, mem: &mut CoreMemory<'_>) -> Result<(), KernelError> {
    match *instr {
        Instr::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride } => {
            if rows > 0 && row_bytes > 0 {
                if rows > 1 && src_stride == u64::from(row_bytes) && dst_stride == src_stride {
                    let total = u64::from(rows) * u64::from(row_bytes);
                    copy_rows(mem, src, dst, 1, limit(total)?, 0, 0)?;
                } else {
                    copy_rows(mem, src, dst, rows.into(), row_bytes as usize, src_stride, dst_stride)?;
                }
            }
        }
        Instr::DmaGather { table, indices, dst, count, row_bytes, table_rows } => {
            if count == 0 || row_bytes == 0 {
                return Ok(());
            }
            limit(u64::from(count) * u64::from(row_bytes))?;
            let mut idx = vec![0u8; count as usize * 4];
            mem.sram.read(indices, &mut idx)?;
            // Every row is read (and every index checked) before any is
            // written: a table in SRAM may overlap the destination.
            let row = row_bytes as usize;
            let mut buf = vec![0u8; count as usize * row];
            for (j, (c, out)) in idx.chunks_exact(4).zip(buf.chunks_exact_mut(row)).enumerate() {
                let i = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                if i >= table_rows {
                    return Err(KernelError::GatherIndex { position: j as u32, index: i, rows: table_rows });
                }
                let s = table
                    .offset
                    .checked_add(u64::from(i) * u64::from(row_bytes))
                    .ok_or(KernelError::Geometry("gather table overflow"))?;
                mem.space(table.space).read(s, out)?;
            }
            mem.sram.write(dst, &buf)?;
        }
        Instr::MatMul { dtype, flags, a, b, c, m, k, n, lda, ldb, ldc } => {
            let (m, k, n) = (m as usize, k as usize, n as usize);
            if m == 0 || k == 0 || n == 0 {
                // A zero dimension makes the instruction a no-op (its
                // footprint is empty, so it may not touch C either).
                return Ok(());
            }
            let shape = GemmShape { m, k, n, b_transposed: flags.transpose_b, accumulate: flags.accumulate };
            if dtype == DType::F32
                && matmul_in_place(mem.sram, a, b, c, shape, lda as usize, ldb as usize, ldc as usize)
            {
                return Ok(());
            }
            limit((m * k + k * n + m * n) as u64)?;
            let av = read_matrix(mem.sram, a, m, k, lda as usize, dtype)?;
            let bv = if flags.transpose_b {
                read_matrix(mem.sram, b, n, k, ldb as usize, dtype)?
            } else {
                read_matrix(mem.sram, b, k, n, ldb as usize, dtype)?
            };
            let mut cv = if flags.accumulate {
                read_matrix(mem.sram, c, m, n, ldc as usize, DType::F32)?
            } else {
                vec![0.0; m * n]
            };
            gemm_f32(
                &av,
                &bv,
                &mut cv,
                GemmShape { m, k, n, b_transposed: flags.transpose_b, accumulate: flags.accumulate },
            );
            write_matrix(mem.sram, c, &cv, m, n, ldc as usize)?;
        }
        Instr::Conv2d { dtype, flags, input, weights, output, geom: g } => {
            let (ho, wo) = g.out_hw().ok_or(KernelError::Geometry("conv kernel/stride"))?;
            let rows = count(&[g.n.into(), ho.into(), wo.into()])?;
            let kk = count(&[g.kh.into(), g.kw.into(), g.cin.into()])?;
            let cout = g.cout as usize;
            let in_len = count(&[g.n.into(), g.h.into(), g.w.into(), g.cin.into()])?;
            limit((in_len + kk * cout + rows * cout) as u64)?;
            if rows == 0 || cout == 0 {
                return Ok(());
            }
            let products = kk > 0 && in_len > 0;
            if products {
                window_steps(rows, usize::from(g.kh) * usize::from(g.kw))?;
            }
            // f32 operands in place in SRAM when aligned and the output
            // overlaps neither input (the same values, no copies).
            if dtype == DType::F32 && products {
                let ins = [(input, in_len), (weights, kk * cout)];
                if let Some((out, [x, wv])) = sram_views(mem.sram, (output, rows * cout), ins) {
                    if !flags.accumulate {
                        out.fill(0.0);
                    }
                    conv_products(x, wv, out, &g, ho as usize, wo as usize, rows, kk);
                    return Ok(());
                }
            }
            let mut out = if flags.accumulate {
                read_f32s(mem.sram, output, rows * cout)?
            } else {
                vec![0.0; rows * cout]
            };
            if products {
                let x = read_elems(mem.sram, input, in_len, dtype)?;
                let wv = read_elems(mem.sram, weights, kk * cout, dtype)?;
                conv_products(&x, &wv, &mut out, &g, ho as usize, wo as usize, rows, kk);
            }
            write_f32s(mem.sram, output, &out)?;
        }
        Instr::VBinary { op, bcast, a, b, dst, rows, cols } => {
            let n = limit(u64::from(rows) * u64::from(cols))?;
            if binary_in_sram(mem.sram, (op, bcast), (a, b, dst), n, cols as usize) {
                return Ok(());
            }
            let mut out = read_f32s(mem.sram, a, n)?;
            let bv = read_f32s(mem.sram, b, broadcast_len(bcast, n, cols as usize))?;
            binary_into(op, bcast, cols as usize, &mut out, None, &bv);
            write_f32s(mem.sram, dst, &out)?;
        }
        Instr::VUnary { op, src, dst, len } => {
            let n = limit(len.into())?;
            if unary_in_sram(mem.sram, op, src, dst, n) {
                return Ok(());
            }
            let mut v = read_f32s(mem.sram, src, n)?;
            v.iter_mut().for_each(|x| *x = unary(op, *x));
            write_f32s(mem.sram, dst, &v)?;
        }
        Instr::VAffine { src, dst, len, scale, bias } => {
            let n = limit(len.into())?;
            if map_in_sram(mem.sram, src, dst, n, |x| x * scale + bias) {
                return Ok(());
            }
            let mut v = read_f32s(mem.sram, src, n)?;
            v.iter_mut().for_each(|x| *x = *x * scale + bias);
            write_f32s(mem.sram, dst, &v)?;
        }
        Instr::VClamp { src, dst, len, lo, hi } => {
            let n = limit(len.into())?;
            if map_in_sram(mem.sram, src, dst, n, |x| clamp_nan(x, lo, hi)) {
                return Ok(());
            }
            let mut v = read_f32s(mem.sram, src, n)?;
            v.iter_mut().for_each(|x| *x = clamp_nan(*x, lo, hi));
            write_f32s(mem.sram, dst, &v)?;
        }
        Instr::VReduce { op, src, dst, outer, reduce, inner } => {
            let (o, r, i) = (outer as usize, reduce as usize, inner as usize);
            let n = count(&[o as u64, r as u64, i as u64])?;
            // The operand straight from SRAM when aligned and inside.
            let views = sram_f32s(mem.sram)
                .and_then(|v| Some(reduce_axis(&v[f32_span(src, n, v.len())?], op, o, r, i)));
            let out = match views {
                Some(out) => out,
                None => reduce_axis(&read_f32s(mem.sram, src, n)?, op, o, r, i),
            };
            write_f32s(mem.sram, dst, &out)?;
        }
        Instr::VSoftmax { src, dst, rows, cols } => {
            let n = limit(u64::from(rows) * u64::from(cols))?;
            let cols = cols as usize;
            if rows_in_sram(mem.sram, (src, dst, n), [], |out, []| softmax_rows(out, cols)) {
                return Ok(());
            }
            let mut v = read_f32s(mem.sram, src, n)?;
            softmax_rows(&mut v, cols);
            write_f32s(mem.sram, dst, &v)?;
        }
        Instr::VLayerNorm { src, dst, gamma, beta, rows, cols, eps } => {
            let n = limit(u64::from(rows) * u64::from(cols))?;
            if n == 0 {
                return Ok(());
            }
            let c = cols as usize;
            let rows_of = |out: &mut [f32], [g, b]: [&[f32]; 2]| layernorm_rows(out, c, g, b, eps);
            if rows_in_sram(mem.sram, (src, dst, n), [(gamma, c), (beta, c)], rows_of) {
                return Ok(());
            }
            let mut v = read_f32s(mem.sram, src, n)?;
            let g = read_f32s(mem.sram, gamma, cols as usize)?;
            let b = read_f32s(mem.sram, beta, cols as usize)?;
            layernorm_rows(&mut v, cols as usize, &g, &b, eps);
            write_f32s(mem.sram, dst, &v)?;
        }
        Instr::VRmsNorm { src, dst, gamma, rows, cols, eps } => {
            let n = limit(u64::from(rows) * u64::from(cols))?;
            if n == 0 {
                return Ok(());
            }
            let c = cols as usize;
            let rows_of = |out: &mut [f32], [g]: [&[f32]; 1]| rmsnorm_rows(out, c, g, eps);
            if rows_in_sram(mem.sram, (src, dst, n), [(gamma, c)], rows_of) {
                return Ok(());
            }
            let mut v = read_f32s(mem.sram, src, n)?;
            let g = read_f32s(mem.sram, gamma, c)?;
            rmsnorm_rows(&mut v, c, &g, eps);
            write_f32s(mem.sram, dst, &v)?;
        }
        Instr::VPool { op, src, dst, geom } => {
            let (ho, wo) = geom.out_hw().ok_or(KernelError::Geometry("pool window/stride"))?;
            let n = count(&[geom.n.into(), geom.h.into(), geom.w.into(), geom.c.into()])?;
            let pixels = count(&[geom.n.into(), ho.into(), wo.into()])?;
            if n == 0 || pixels == 0 || geom.c == 0 {
                return Ok(());
            }
            window_steps(pixels, usize::from(geom.kh) * usize::from(geom.kw))?;
            let (ho, wo) = (ho as usize, wo as usize);
            // The input straight from SRAM when aligned and inside, and the
            // result straight into it when the two do not overlap.
            if let Some((out, [x])) = sram_views(mem.sram, (dst, pixels * geom.c as usize), [(src, n)]) {
                pool_into(out, x, op, &geom, ho, wo);
                return Ok(());
            }
            let views = sram_f32s(mem.sram)
                .and_then(|v| Some(pool(&v[f32_span(src, n, v.len())?], op, &geom, ho, wo)));
            let out = match views {
                Some(out) => out,
                None => pool(&read_f32s(mem.sram, src, n)?, op, &geom, ho, wo),
            };
            write_f32s(mem.sram, dst, &out)?;
        }
        Instr::VDepthwise { src, weights, dst, geom } => {
            let (ho, wo) = geom.out_hw().ok_or(KernelError::Geometry("depthwise kernel/stride"))?;
            let c = geom.cin as usize;
            let in_len = count(&[geom.n.into(), geom.h.into(), geom.w.into(), geom.cin.into()])?;
            let taps = usize::from(geom.kh) * usize::from(geom.kw);
            let pixels = count(&[geom.n.into(), ho.into(), wo.into()])?;
            let out_len = count(&[pixels as u64, c as u64])?;
            limit((in_len + taps * c + out_len) as u64)?;
            if out_len == 0 {
                return Ok(());
            }
            let out = if in_len == 0 {
                vec![0.0; out_len]
            } else {
                window_steps(pixels, taps)?;
                let (ho, wo) = (ho as usize, wo as usize);
                // The operands straight from SRAM when aligned and inside,
                // and the result straight into it when it overlaps neither.
                let ins = [(src, in_len), (weights, taps * c)];
                if let Some((out, [x, w])) = sram_views(mem.sram, (dst, out_len), ins) {
                    depthwise_into(out, x, w, &geom, ho, wo);
                    return Ok(());
                }
                let views = sram_f32s(mem.sram).and_then(|v| {
                    let [x, w] = f32_spans(ins, v.len())?;
                    Some(depthwise(&v[x], &v[w], &geom, ho, wo))
                });
                match views {
                    Some(out) => out,
                    None => {
                        let x = read_f32s(mem.sram, src, in_len)?;
                        let wv = read_f32s(mem.sram, weights, taps * c)?;
                        depthwise(&x, &wv, &geom, ho, wo)
                    }
                }
            };
            write_f32s(mem.sram, dst, &out)?;
        }
        Instr::VConvert { from, to, src, dst, len } => {
            let v = read_elems(mem.sram, src, limit(len.into())?, from)?;
            write_elems(mem.sram, dst, &v, to)?;
        }
        Instr::Signal { .. } | Instr::Wait { .. } | Instr::Halt => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Strided row copies, the fixed-size moves for rows of 4, 8 and 16
    /// bytes and `memcpy` for the rest, against a byte-by-byte copy in
    /// row order: sparse and dense strides on both sides, and
    /// destination rows that overlap (the later row wins).
    #[test]
    fn strided_copies_match_byte_by_byte() {
        for row in 1..=20usize {
            for (ss, ds) in
                [(row, 3 * row), (3 * row + 1, row), (row + 5, row + 1), (row, row / 2 + 1), (row, 0)]
            {
                for rows in [1u64, 2, 7, 33] {
                    let n = rows as usize;
                    let from: Vec<u8> = (0..(n - 1) * ss + row).map(|i| (i * 7 + 3) as u8).collect();
                    let mut want: Vec<u8> = (0..(n - 1) * ds + row).map(|i| (i * 13 + 1) as u8).collect();
                    let mut got = want.clone();
                    for r in 0..n {
                        for k in 0..row {
                            want[r * ds + k] = from[r * ss + k];
                        }
                    }
                    copy_strided(&from, ss, &mut got, ds, rows, row);
                    assert_eq!(got, want, "row {row}, strides {ss}/{ds}, {rows} rows");
                }
            }
        }
    }

    /// The depthwise kernel against the ISA's definition written out
    /// plainly: each output element is `0.0`, plus each in-bounds tap's
    /// product in tap order, plus `0.0 * w` for each padded tap whose
    /// weight is not finite; bit for bit (NaN for NaN), with 1 to 100
    /// channels (the loop's vector widths and their remainders), several
    /// images, strides, uneven padding, windows wholly in the padding and
    /// non-finite weights.
    #[test]
    fn depthwise_is_the_plain_sum_bit_for_bit() {
        let mut rnd = crate::test_rng::xorshift64(0x9e37_79b9_7f4a_7c15);
        for case in 0..300 {
            let c = [1, 7, 31, 32, 33, 64, 70, 100][case % 8];
            let (k, s) = (1 + (rnd() % 4) as u16, 1 + (rnd() % 3) as u16);
            let pads = [0, 1, 2, 3].map(|_| (rnd() % u64::from(k + 1)) as u16);
            let g = ConvGeom {
                n: 1 + (rnd() % 3) as u32,
                h: 1 + (rnd() % 6) as u32,
                w: 1 + (rnd() % 6) as u32,
                cin: c as u32,
                cout: c as u32,
                kh: k,
                kw: k,
                stride_h: s,
                stride_w: 1 + (rnd() % 2) as u16,
                pad_top: pads[0],
                pad_bottom: pads[1],
                pad_left: pads[2],
                pad_right: pads[3],
            };
            let Some((ho, wo)) = g.out_hw() else { continue };
            let (ho, wo) = (ho as usize, wo as usize);
            let val = |r: u64| ((r % 2001) as f32 - 1000.0) / 337.0;
            let x: Vec<f32> = (0..(g.n * g.h * g.w) as usize * c).map(|_| val(rnd())).collect();
            let mut w: Vec<f32> = (0..usize::from(k * k) * c).map(|_| val(rnd())).collect();
            if case % 5 == 0 {
                let j = (rnd() as usize) % w.len();
                w[j] = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][case % 3];
            }
            let got = depthwise(&x, &w, &g, ho, wo);
            let (h, wd) = (g.h as i64, g.w as i64);
            for img in 0..g.n as usize {
                for oy in 0..ho {
                    for ox in 0..wo {
                        for ch in 0..c {
                            let mut want = 0.0f32;
                            let mut padded = Vec::new();
                            for ky in 0..usize::from(k) {
                                for kx in 0..usize::from(k) {
                                    let iy = (oy * usize::from(s) + ky) as i64 - i64::from(g.pad_top);
                                    let ix =
                                        (ox * usize::from(g.stride_w) + kx) as i64 - i64::from(g.pad_left);
                                    let wv = w[(ky * usize::from(k) + kx) * c + ch];
                                    if iy < 0 || ix < 0 || iy >= h || ix >= wd {
                                        padded.push(wv);
                                        continue;
                                    }
                                    want += x[((img * g.h as usize + iy as usize) * g.w as usize
                                        + ix as usize)
                                        * c
                                        + ch]
                                        * wv;
                                }
                            }
                            for wv in padded.into_iter().filter(|v| !v.is_finite()) {
                                want += 0.0 * wv;
                            }
                            let o = ((img * ho + oy) * wo + ox) * c + ch;
                            let same =
                                got[o].to_bits() == want.to_bits() || (got[o].is_nan() && want.is_nan());
                            assert!(same, "case {case} {g:?}: element {o}: {} against {want}", got[o]);
                        }
                    }
                }
            }
        }
    }

    /// A DMA from a file's unchanged pages into HBM (guest memory a
    /// private mapping of the file from byte `OFF` on, as the in-process
    /// runner's weight image) maps the chunks it covers at least half of
    /// and any piece of a chunk never written (when the file offset and
    /// HBM address have the same page phase), and copies the rest, a
    /// written page's chunk included: HBM then reads what guest memory
    /// held, byte for byte, HBM bytes outside the copy keep what they
    /// held (zeros if nothing), and writes on either side after the copy
    /// do not reach the other or the file.
    #[test]
    fn dma_into_hbm_maps_unchanged_file_pages() {
        use crate::memory::{FileMemory, HBM_CHUNK};
        const OFF: u64 = 2 * 4096 + 100;
        let mib = HBM_CHUNK as usize;
        let bytes: Vec<u8> = (0..OFF as usize + 4 * mib + 5000).map(|i| (i * 7 + i / 4096) as u8).collect();
        let path = std::env::temp_dir().join(format!("npu-model-dma-map-{}", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        // (4096, 100): the file offset of guest byte 4096 has phase 100;
        // chunk 0 from byte 100 (more than half of it), chunk 1 and chunk
        // 3's 100 bytes (chunks never written) are mapped, chunk 2 copied
        // (a written page). (4096, 200): phases differ, all copied.
        // (3996, 0).
        for (src, dst, expect_mapped) in [(4096u64, 100u64, 3), (4096, 200, 0), (3996, 0, 2)] {
            let len = 3 * HBM_CHUNK;
            let mut guest = FileMemory::map(file.try_clone().unwrap(), OFF, 4 * mib).unwrap();
            // A written page in the source of HBM's chunk 2: that chunk
            // must be copied, with the new byte.
            let dirty = src + 2 * HBM_CHUNK - dst + 10;
            guest.write(dirty, &[!bytes[(OFF + dirty) as usize]]).unwrap();
            let (mut sram, mut hbm) = (Sram::new(4096), LazyHbm::new(8 * HBM_CHUNK));
            // What HBM holds before the copy's first byte stays: bytes
            // written before (dst 100), else zeros.
            let before = if dst == 100 { 0x77u8 } else { 0 };
            if before != 0 {
                hbm.write(0, &vec![before; dst as usize]).unwrap();
            }
            let mut mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
            copy_rows(&mut mem, Addr::guest(src), Addr::hbm(dst), 1, len as usize, 0, 0).unwrap();
            assert_eq!(hbm.mapped_chunks(), expect_mapped, "src {src} dst {dst}");
            let (mut back, mut want) = (vec![0u8; len as usize], vec![0u8; len as usize]);
            hbm.read(dst, &mut back).unwrap();
            guest.read(src, &mut want).unwrap();
            assert!(back == want, "src {src} dst {dst}: HBM holds the guest's bytes");
            assert_eq!(back[(dirty - src) as usize], !bytes[(OFF + dirty) as usize], "the written byte");
            let mut head = vec![1u8; dst as usize];
            hbm.read(0, &mut head).unwrap();
            assert!(head.iter().all(|b| *b == before), "HBM before the copy is unchanged");
            let mut tail = vec![1u8; (4 * HBM_CHUNK - dst - len) as usize];
            hbm.read(dst + len, &mut tail).unwrap();
            assert!(tail.iter().all(|b| *b == 0), "src {src} dst {dst}: HBM after the copy reads zero");
            // Copy-on-write both ways.
            let at = src + HBM_CHUNK - dst;
            hbm.write(HBM_CHUNK + 5, &[1, 2, 3]).unwrap();
            guest.write(at + 64, &[!bytes[(OFF + at + 64) as usize]]).unwrap();
            let mut b = [0u8; 1];
            hbm.read(HBM_CHUNK + 64, &mut b).unwrap();
            assert_eq!(b[0], bytes[(OFF + at + 64) as usize], "a later guest write stays out of HBM");
            let mut f = [0u8; 3];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut f, OFF + at + 5).unwrap();
            let k = (OFF + at + 5) as usize;
            assert_eq!(f, bytes[k..k + 3], "an HBM write stays out of the file");
        }
    }
    use proptest::prelude::*;

    /// Guest memory that is not one flat buffer (no `slice`): as the VMM's
    /// guest RAM looks to a copy.
    struct Pieces(Vec<u8>);

    impl Memory for Pieces {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }
        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
            let a = addr as usize;
            buf.copy_from_slice(&self.0[a..a + buf.len()]);
            Ok(())
        }
        fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
            let a = addr as usize;
            self.0[a..a + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    /// `clamp_nan` gives the bits of `min_nan(max_nan(x, lo), hi)`, in
    /// an element loop and value by value, for bit patterns of every
    /// magnitude and the special values, under bounds that are signed
    /// zeros, NaN, infinite, equal or crossed.
    #[test]
    fn clamp_gives_the_bits_of_max_then_min() {
        let mut xs: Vec<f32> =
            (0..200_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))).collect();
        xs.extend([0.0, -0.0, 6.0, -6.0, 1.0, -1.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN]);
        let bounds = [
            (0.0f32, 6.0f32),
            (-0.0, 6.0),
            (0.0, -0.0),
            (-0.0, 0.0),
            (0.0, 0.0),
            (-0.0, -0.0),
            (-1.0, 1.0),
            (6.0, 0.0),
            (f32::NAN, 6.0),
            (0.0, f32::NAN),
            (f32::NEG_INFINITY, f32::INFINITY),
            (-0.0, f32::INFINITY),
            (f32::NEG_INFINITY, -0.0),
        ];
        for (lo, hi) in bounds {
            let want: Vec<u32> =
                xs.iter().map(|&x| min_nan(max_nan(std::hint::black_box(x), lo), hi).to_bits()).collect();
            let n = xs.len();
            let mut sram = Sram::new(n as u64 * 4);
            write_f32s(&mut sram, 0, &xs).unwrap();
            assert!(map_in_sram(&mut sram, 0, 0, n, move |x| clamp_nan(x, lo, hi)));
            let looped = read_f32s(&sram, 0, n).unwrap();
            for (i, &x) in xs.iter().enumerate() {
                let one = clamp_nan(std::hint::black_box(x), lo, hi);
                assert_eq!(one.to_bits(), want[i], "clamp({x:e}, {lo:e}, {hi:e}) value by value");
                assert_eq!(looped[i].to_bits(), want[i], "clamp({x:e}, {lo:e}, {hi:e}) in the loop");
            }
        }
    }

    /// The in-SRAM loop of every unary operation (vectorized under AVX2)
    /// gives, value for value, the bits of the scalar [`unary`]: in place
    /// and into another span, on values of every magnitude, ±0, ±inf,
    /// NaN and subnormals. (The scalar `tanh` is checked against the
    /// host's `tanhf` in `tanhf`'s tests.)
    #[test]
    fn every_unary_loop_gives_the_scalar_bits() {
        // Bit patterns spread over all exponents and both signs, plus the
        // special values.
        let mut xs: Vec<f32> = (0..4000u32).map(|i| f32::from_bits(i.wrapping_mul(1_073_741_789))).collect();
        xs.extend((0..2000).map(|i| (i as f32 - 1000.0) / 97.0));
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE / 3.0,
            1.0,
            -1.0,
            22.0,
        ]);
        let n = xs.len();
        let bytes = n as u64 * 4;
        for &op in UnOp::ALL {
            let want: Vec<u32> = xs.iter().map(|&x| unary(op, std::hint::black_box(x)).to_bits()).collect();
            for dst in [0, bytes] {
                let mut sram = Sram::new(2 * bytes);
                write_f32s(&mut sram, 0, &xs).unwrap();
                assert!(unary_in_sram(&mut sram, op, 0, dst, n), "{op:?}");
                let got: Vec<u32> = read_f32s(&sram, dst, n).unwrap().iter().map(|v| v.to_bits()).collect();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g, w, "{op:?} of {:e} ({:#010x}), into {dst}", xs[i], xs[i].to_bits());
                }
            }
        }
    }

    /// `reduce_axis` gives, bit for bit, each output's fold over the
    /// reduced axis in order (its definition), NaN and signed zeros
    /// included.
    #[test]
    fn reduction_gives_each_outputs_fold_in_order() {
        let mut next = crate::test_rng::xorshift32(7);
        for (o, r, i) in
            [(1, 1, 1), (2, 3, 5), (3, 49, 16), (1, 64, 1), (4, 1, 7), (0, 3, 2), (2, 0, 3), (2, 3, 0)]
        {
            let v: Vec<f32> = (0..o * r * i)
                .map(|_| match next() % 16 {
                    0 => f32::NAN,
                    1 => -0.0,
                    2 => 0.0,
                    _ => (next() % 2001) as f32 / 7.0 - 140.0,
                })
                .collect();
            for &op in RedOp::ALL {
                let got = reduce_axis(&v, op, o, r, i);
                assert_eq!(got.len(), o * i);
                for a in 0..o {
                    for c in 0..i {
                        let it = (0..r).map(|b| v[(a * r + b) * i + c]);
                        let want = match op {
                            RedOp::Sum => it.sum(),
                            RedOp::Mean => it.sum::<f32>() / r as f32,
                            RedOp::Max => it.fold(f32::NEG_INFINITY, max_nan),
                        };
                        assert_eq!(got[a * i + c].to_bits(), want.to_bits(), "{op:?} {o}x{r}x{i} at {a},{c}");
                    }
                }
            }
        }
    }

    /// Softmax and layer normalization on SRAM in place give the bytes of
    /// reading the operands, computing and writing the result (their
    /// definition), for every placement: in place, disjoint, `dst`
    /// overlapping `src` in part, `gamma` inside `dst`, unaligned.
    #[test]
    fn in_place_rows_give_the_bytes_of_read_compute_write() {
        let (rows, cols) = (3u32, 24u32);
        let n = (rows * cols) as usize;
        let cases: [(u64, u64, u64); 6] =
            [(0, 0, 2048), (0, 1024, 2048), (1024, 0, 2048), (0, 40, 2048), (0, 1024, 1040), (2, 1026, 2048)];
        let init: Vec<u8> = (0..4096u32).flat_map(|i| ((i % 97) as f32 / 13.0 - 3.5).to_le_bytes()).collect();
        for (src, dst, gamma) in cases {
            let beta = gamma + 4 * u64::from(cols);
            for softmax in [true, false] {
                let instr = if softmax {
                    Instr::VSoftmax { src, dst, rows, cols }
                } else {
                    Instr::VLayerNorm { src, dst, gamma, beta, rows, cols, eps: 1e-5 }
                };
                // The definition, on a copy of the same SRAM.
                let mut want = Sram::new(16384);
                want.write(0, &init).unwrap();
                let mut v = Vec::new();
                for k in 0..n as u64 {
                    let mut b = [0u8; 4];
                    want.read(src + 4 * k, &mut b).unwrap();
                    v.push(f32::from_le_bytes(b));
                }
                if softmax {
                    softmax_rows(&mut v, cols as usize);
                } else {
                    let read = |at: u64| -> Vec<f32> {
                        (0..u64::from(cols))
                            .map(|k| {
                                let mut b = [0u8; 4];
                                want.read(at + 4 * k, &mut b).unwrap();
                                f32::from_le_bytes(b)
                            })
                            .collect()
                    };
                    let (g, b) = (read(gamma), read(beta));
                    layernorm_rows(&mut v, cols as usize, &g, &b, 1e-5);
                }
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                want.write(dst, &bytes).unwrap();

                let mut sram = Sram::new(16384);
                sram.write(0, &init).unwrap();
                let mut hbm = LazyHbm::new(1 << 20);
                let mut guest = Pieces(vec![0; 64]);
                let mut mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
                execute(&instr, &mut mem).unwrap();
                assert!(sram.bytes_mut() == want.bytes_mut(), "{instr:?}");
            }
        }
    }

    /// A row longer than the bounce buffer between two memories that are
    /// not flat (guest memory and HBM) goes piece by piece and arrives
    /// whole, both ways, across HBM chunks.
    #[test]
    fn a_row_longer_than_the_bounce_buffer_copies_whole_both_ways() {
        let len = 2 * BOUNCE_BYTES + 4096 + 13;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        let mut guest = Pieces([bytes.clone(), vec![0; len + 64]].concat());
        let mut sram = Sram::new(4096);
        let mut hbm = LazyHbm::new(16 << 20);
        let mut mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
        let at = crate::memory::HBM_CHUNK - 100;
        execute(&Instr::copy(Addr::guest(0), Addr::hbm(at), len as u32), &mut mem).expect("guest to HBM");
        let back = (len + 64) as u64;
        execute(&Instr::copy(Addr::hbm(at), Addr::guest(back), len as u32), &mut mem).expect("HBM to guest");
        let mut in_hbm = vec![0u8; len];
        hbm.read(at, &mut in_hbm).expect("read HBM");
        assert!(in_hbm == bytes, "HBM holds the row");
        assert!(guest.0[len + 64..] == bytes[..], "the row came back");
    }

    /// im2col by its definition: element (pixel, (ky, kx, c)) is the
    /// input at the window's position, or zero outside the image.
    fn im2col_by_definition(input: &[f32], g: &ConvGeom, ho: usize, wo: usize) -> Vec<f32> {
        let (n, h, w, c) = (g.n as usize, g.h as usize, g.w as usize, g.cin as usize);
        let (kh, kw) = (g.kh as usize, g.kw as usize);
        let mut out = Vec::new();
        for b in 0..n {
            for oy in 0..ho {
                for ox in 0..wo {
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (oy * g.stride_h as usize + ky) as i64 - i64::from(g.pad_top);
                            let ix = (ox * g.stride_w as usize + kx) as i64 - i64::from(g.pad_left);
                            for ch in 0..c {
                                let inside = (0..h as i64).contains(&iy) && (0..w as i64).contains(&ix);
                                out.push(if inside {
                                    input[((b * h + iy as usize) * w + ix as usize) * c + ch]
                                } else {
                                    0.0
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// The order of the SA's sums that `docs/npu-model.md` states: a
    /// product of depth 3 to 512 with at least two output rows and
    /// columns and `b` stored `k x n` is one fused multiply-add chain per
    /// output, in depth order from zero, added to the old output when
    /// accumulating, with the `gemm` crate's AVX2 and AVX-512 kernels
    /// alike. Deeper products are summed in blocks whose size depends on
    /// the host; a transposed `b` and matrix-vector products can take
    /// kernels that sum across SIMD lanes. Skipped without FMA.
    #[test]
    fn shallow_products_are_one_fma_chain_per_output() {
        if !std::arch::is_x86_feature_detected!("fma") {
            eprintln!("skipped: this CPU has no FMA, the gemm crate uses another kernel");
            return;
        }
        let mut bits = crate::test_rng::xorshift64(0x2545_f491_4f6c_dd1d);
        let mut next = move || (bits() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        for (m, n, k) in [
            (2, 64, 300),
            (7, 5, 300),
            (64, 64, 512),
            (100, 70, 3),
            (130, 90, 257),
            (3, 200, 511),
            (200, 300, 512),
        ] {
            for accumulate in [false, true] {
                let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
                let b: Vec<f32> = (0..k * n).map(|_| next()).collect();
                let old: Vec<f32> = (0..m * n).map(|_| next()).collect();
                let mut c = old.clone();
                gemm_f32(&a, &b, &mut c, GemmShape { m, k, n, b_transposed: false, accumulate });
                for i in 0..m {
                    for j in 0..n {
                        let chain = (0..k).fold(0.0f32, |s, kk| a[i * k + kk].mul_add(b[kk * n + j], s));
                        let want = if accumulate { old[i * n + j] + chain } else { chain };
                        assert_eq!(
                            c[i * n + j].to_bits(),
                            want.to_bits(),
                            "{m}x{n}x{k} acc {accumulate} at ({i}, {j})"
                        );
                    }
                }
            }
        }
    }

    /// A convolution whose im2col is built in several chunks gives the
    /// bits of one product over the whole im2col (the GEMM's sums in the
    /// same order), for outputs narrower and wider than 64 channels.
    #[test]
    fn chunked_convolution_gives_the_bits_of_one_product() {
        for cout in [16u32, 70] {
            let g = ConvGeom {
                n: 1,
                h: 64,
                w: 64,
                cin: 64,
                cout,
                kh: 3,
                kw: 3,
                stride_h: 1,
                stride_w: 1,
                pad_top: 1,
                pad_bottom: 1,
                pad_left: 1,
                pad_right: 1,
            };
            let (ho, wo) = g.out_hw().unwrap();
            let (ho, wo) = (ho as usize, wo as usize);
            let (rows, kk, n) = (ho * wo, 9 * 64, cout as usize);
            assert!(im2col_rows(rows, kk) < rows, "the test must cut the product");
            let wave = |i: usize| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5;
            let x: Vec<f32> = (0..64 * 64 * 64).map(wave).collect();
            let w: Vec<f32> = (0..kk * n).map(|i| wave(i + 17)).collect();
            let mut chunked = vec![0.0f32; rows * n];
            conv_products(&x, &w, &mut chunked, &g, ho, wo, rows, kk);
            let mut whole = vec![0.0f32; rows * n];
            let cols = im2col(&x, &g, ho, wo, 0..rows);
            gemm_f32(
                &cols,
                &w,
                &mut whole,
                GemmShape { m: rows, k: kk, n, b_transposed: false, accumulate: true },
            );
            let differ = chunked.iter().zip(&whole).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "{differ} of {} outputs differ (cout {cout})", rows * n);
        }
    }

    proptest! {
        /// im2col built in chunks into one reused buffer (stale values of
        /// the chunk before in it) equals the definition, with and
        /// without padding.
        #[test]
        fn im2col_in_chunks_matches_its_definition(
            n in 1u32..3, h in 1u32..7, w in 1u32..7, cin in 1u32..4, kh in 1u16..4, kw in 1u16..4,
            sh in 1u16..3, sw in 1u16..3, pads in prop::array::uniform4(0u16..3), cut in 0usize..50,
        ) {
            let g = ConvGeom {
                n, h, w, cin, cout: 1, kh, kw, stride_h: sh, stride_w: sw,
                pad_top: pads[0], pad_bottom: pads[1], pad_left: pads[2], pad_right: pads[3],
            };
            let Some((ho, wo)) = g.out_hw() else { return Ok(()) };
            let (ho, wo) = (ho as usize, wo as usize);
            let input: Vec<f32> = (0..(n * h * w * cin)).map(|v| v as f32 + 1.0).collect();
            let rows = n as usize * ho * wo;
            let cut = cut % (rows + 1);
            let mut buf = vec![f32::NAN; 4096];
            let mut parts = Vec::new();
            for range in [0..cut, cut..rows] {
                im2col_into(&input, &g, ho, wo, range, &mut buf);
                parts.extend_from_slice(&buf);
            }
            let want = im2col_by_definition(&input, &g, ho, wo);
            prop_assert_eq!(parts.len(), want.len());
            for (i, (a, b)) in parts.iter().zip(&want).enumerate() {
                prop_assert!(a.to_bits() == b.to_bits(), "element {}: {} != {}", i, a, b);
            }
        }
    }

    #[test]
    fn im2col_chunks_concatenate_to_the_whole() {
        let g = ConvGeom {
            n: 2,
            h: 5,
            w: 4,
            cin: 3,
            cout: 1,
            kh: 3,
            kw: 2,
            stride_h: 2,
            stride_w: 1,
            pad_top: 1,
            pad_bottom: 1,
            pad_left: 1,
            pad_right: 0,
        };
        let (ho, wo) = g.out_hw().unwrap();
        let (ho, wo) = (ho as usize, wo as usize);
        let input: Vec<f32> = (0..2 * 5 * 4 * 3).map(|v| v as f32).collect();
        let all = im2col(&input, &g, ho, wo, 0..2 * ho * wo);
        let mut parts = im2col(&input, &g, ho, wo, 0..7);
        parts.extend(im2col(&input, &g, ho, wo, 7..2 * ho * wo));
        assert_eq!(all, parts);
        assert!(all.iter().any(|v| *v > 0.0));
    }

    /// Shapes whose spans wrap around 2^64 (or whose rows overlap) are
    /// refused by the second bounds check before the unsafe GEMM, not
    /// wrapped into small spans that pass it.
    #[test]
    fn in_place_gemm_refuses_wrapping_and_overlapping_shapes() {
        let shape = |m, k, n| GemmShape { m, k, n, b_transposed: false, accumulate: false };
        let mut sram = Sram::new(1 << 12);
        // (rows - 1) * ld * 4 = 2^64 + 4: wraps to 4 bytes without checks.
        let wrap = 1usize << 62;
        assert!(!matmul_in_place(&mut sram, 0, 64, 128, shape(2, 1, 1), wrap, 1, 1), "A wraps");
        assert!(!matmul_in_place(&mut sram, 0, 64, 128, shape(1, 2, 1), 2, wrap, 1), "B wraps");
        assert!(!matmul_in_place(&mut sram, 0, 64, 128, shape(2, 1, 1), 1, 1, wrap), "C wraps");
        assert!(!matmul_in_place(&mut sram, 0, 64, 128, shape(usize::MAX, 1, 1), 1, 1, 1), "rows wrap");
        assert_eq!(in_place_spans(shape(2, 1, 1), wrap, 1, 1), None);
        // Overlapping rows of C (ldc < n) would alias the GEMM's writes.
        assert!(!matmul_in_place(&mut sram, 0, 64, 128, shape(2, 1, 4), 1, 4, 2), "ldc < n");
        // A leading dimension past isize cannot be a GEMM stride.
        assert!(!matmul_in_place(&mut sram, 0, 64, 128, shape(1, 1, 1), usize::MAX, 1, 1));
        // The fast path still applies to a good shape, with the right result.
        sram.write(0, &[0, 0, 0x80, 0x3f, 0, 0, 0, 0x40]).unwrap(); // a = [1, 2]
        sram.write(64, &[0, 0, 0x40, 0x40, 0, 0, 0x80, 0x40]).unwrap(); // b = [3; 4]
        assert!(matmul_in_place(&mut sram, 0, 64, 128, shape(1, 2, 1), 2, 1, 1));
        let mut c = [0u8; 4];
        sram.read(128, &mut c).unwrap();
        assert_eq!(f32::from_le_bytes(c), 11.0);
    }
}
