//! A plain, instruction-level CPU interpreter of the vNPU ISA, written
//! from `docs/isa.md` alone and sharing no code with the model
//! (`npu-model`): every element is read from its own address with
//! overflow-checked arithmetic, sums are taken in `f64`, and nothing is
//! fast. It is the reference the model is checked against
//! (`npu-difftest`, the `program_execute` fuzz target).
//!
//! [`Machine::effects`] gives what one instruction writes, each element
//! with the tolerance the ISA allows the model (zero for single IEEE
//! operations and data movement; a rounding-error bound for sums and
//! transcendental functions; none where `f32` overflow makes the result
//! depend on the order of operations). All inputs are read before any
//! output is written, as the ISA says.

use thiserror::Error;
use vnpu_abi::{Addr, Bcast, BinOp, ConvGeom, DType, Instr, PoolGeom, PoolOp, RedOp, Space, UnOp};

/// Unit roundoff of `f32` (2^-24).
const U: f64 = 1.0 / 16_777_216.0;
/// Smallest positive normal `f32`: an absolute slack for results that may
/// underflow into subnormals.
const TINY: f64 = f32::MIN_POSITIVE as f64;
/// The smallest positive subnormal `f32`: the absolute error of one
/// rounding in the subnormal range.
const SUB: f64 = 1.401_298_464_324_817e-45;
/// Above this magnitude an `f32` sum may overflow part-way, so its value
/// depends on the order of operations: no claim is made.
const OVERFLOW_RISK: f64 = f32::MAX as f64 / 4.0;
/// Most element operations one instruction may cost the reference.
pub const MAX_WORK: u64 = 1 << 24;

/// Why the reference could not execute an instruction.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RefError {
    #[error("{space} access [{start:#x}, +{len:#x}) is outside the segment")]
    OutOfSegment { space: &'static str, start: u64, len: u64 },
    #[error("gather index {index} at position {position} is outside the table of {rows} rows")]
    GatherIndex { position: u32, index: u32, rows: u32 },
    #[error("invalid geometry: {0}")]
    Geometry(&'static str),
    #[error("more element operations than the reference's limit (it does not run this instruction)")]
    TooMuchWork,
}

/// What one written location must hold afterwards.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Expect {
    /// Exactly this byte (data movement).
    Byte(u8),
    /// An `f32` within `tol` of `value` (`tol` 0: exactly `value`; NaN
    /// matches NaN; an infinite `tol`: any value).
    F32 { value: f64, tol: f64 },
    /// A bf16 equal to `value` (NaN matches NaN).
    Bf16 { value: f32 },
}

/// One location an instruction writes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Write {
    pub space: Space,
    pub addr: u64,
    pub expect: Expect,
}

impl Write {
    /// Bytes the location covers.
    pub fn bytes(&self) -> u64 {
        match self.expect {
            Expect::Byte(_) => 1,
            Expect::F32 { .. } => 4,
            Expect::Bf16 { .. } => 2,
        }
    }

    /// Whether `bytes` (the model's, [`Self::bytes`] of them) satisfy the
    /// expectation.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        match (self.expect, bytes) {
            (Expect::Byte(b), [m]) => *m == b,
            (Expect::F32 { value, tol }, &[a, b, c, d]) => {
                close(f32::from_le_bytes([a, b, c, d]), value, tol)
            }
            (Expect::Bf16 { value }, &[a, b]) => {
                let m = bf16_to_f32(u16::from_le_bytes([a, b]));
                m == value || (m.is_nan() && value.is_nan())
            }
            _ => false,
        }
    }
}

/// Whether the model's `m` is within `tol` of the reference's `r`
/// (`tol` infinite: no claim; a NaN `tol` claims exactness).
pub fn close(m: f32, r: f64, tol: f64) -> bool {
    if tol == f64::INFINITY {
        return true;
    }
    let m64 = f64::from(m);
    if m64 == r || (m.is_nan() && r.is_nan()) {
        return true;
    }
    if m.is_nan() || r.is_nan() {
        return false;
    }
    if m.is_infinite() {
        // Rounding to f32 overflows when the exact value is near MAX.
        return r.signum() == m64.signum() && r.abs() + tol >= f64::from(f32::MAX) * (1.0 - 2.0 * U);
    }
    // The reference value is exact (or f64); the model's is rounded once
    // more to f32.
    (m64 - r).abs() <= tol + r.abs().min(f64::from(f32::MAX)) * U
}

/// The memories of one vNPU core: SRAM, HBM and the guest ranges it may
/// DMA to, each a plain byte vector.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    pub sram: Vec<u8>,
    pub hbm: Vec<u8>,
    /// `(guest-physical base, bytes)` per range.
    pub guest: Vec<(u64, Vec<u8>)>,
    /// Most element operations one instruction may cost (default
    /// [`MAX_WORK`]; a fuzz target lowers it to keep each run short).
    pub max_work: u64,
}

fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 to bf16, rounding to nearest, ties to even (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    let rounded = bits + 0x7fff + lsb;
    (rounded >> 16) as u16
}

/// IEEE 754-2019 `maximum`/`minimum` on values: NaN propagates.
fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn min_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// Running count of element operations, refused past a limit.
struct Work(u64, u64);

impl Work {
    fn add(&mut self, n: u64) -> Result<(), RefError> {
        self.0 = self.0.saturating_add(n);
        if self.0 > self.1 {
            return Err(RefError::TooMuchWork);
        }
        Ok(())
    }
}

fn at(base: u64, index: u64, size: u64) -> Result<u64, RefError> {
    index.checked_mul(size).and_then(|o| base.checked_add(o)).ok_or(RefError::OutOfSegment {
        space: "address",
        start: base,
        len: u64::MAX,
    })
}

/// A sum and the sum of its terms' magnitudes (for the error bound).
#[derive(Clone, Copy, Default)]
struct Acc {
    sum: f64,
    mag: f64,
    terms: u64,
}

impl Acc {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.mag += v.abs();
        self.terms += 1;
    }
    /// Bound on the error of any f32 evaluation order of the sum (with
    /// fused or unfused products): (terms + 2) u sum|term|.
    fn expect(&self) -> Expect {
        if self.sum.is_nan() {
            // A NaN term, inf * 0 or inf - inf: NaN in every order.
            return Expect::F32 { value: f64::NAN, tol: 0.0 };
        }
        let tol = if self.mag > OVERFLOW_RISK {
            f64::INFINITY
        } else {
            (self.terms as f64 + 2.0) * 2.0 * U * self.mag + (self.terms as f64 + 2.0) * TINY
        };
        Expect::F32 { value: self.sum, tol }
    }
}

impl Machine {
    /// Zeroed memories of these sizes.
    pub fn new(sram_bytes: usize, hbm_bytes: usize, guest: &[(u64, usize)]) -> Self {
        Self {
            sram: vec![0; sram_bytes],
            hbm: vec![0; hbm_bytes],
            guest: guest.iter().map(|&(base, len)| (base, vec![0; len])).collect(),
            max_work: MAX_WORK,
        }
    }

    /// The `len` bytes at `addr` of `space`, inside one segment.
    pub fn bytes(&self, space: Space, addr: u64, len: u64) -> Result<&[u8], RefError> {
        let out = RefError::OutOfSegment { space: space.name(), start: addr, len };
        let (base, seg) = match space {
            Space::Sram => (0, &self.sram),
            Space::Hbm => (0, &self.hbm),
            Space::Guest => {
                let hit = self.guest.iter().find(|(b, v)| {
                    addr >= *b && addr.checked_add(len).is_some_and(|e| e - b <= v.len() as u64)
                });
                let Some((b, v)) = hit else { return Err(out) };
                (*b, v)
            }
        };
        let start = usize::try_from(addr - base).map_err(|_| out.clone())?;
        let end = usize::try_from(len).ok().and_then(|l| start.checked_add(l)).ok_or(out.clone())?;
        seg.get(start..end).ok_or(out)
    }

    fn bytes_mut(&mut self, space: Space, addr: u64, len: u64) -> Result<&mut [u8], RefError> {
        let out = RefError::OutOfSegment { space: space.name(), start: addr, len };
        let (base, seg) = match space {
            Space::Sram => (0, &mut self.sram),
            Space::Hbm => (0, &mut self.hbm),
            Space::Guest => {
                let hit = self.guest.iter_mut().find(|(b, v)| {
                    addr >= *b && addr.checked_add(len).is_some_and(|e| e - *b <= v.len() as u64)
                });
                let Some((b, v)) = hit else { return Err(out) };
                (*b, v)
            }
        };
        let start = usize::try_from(addr - base).map_err(|_| out.clone())?;
        let end = usize::try_from(len).ok().and_then(|l| start.checked_add(l)).ok_or(out.clone())?;
        seg.get_mut(start..end).ok_or(out)
    }

    fn byte(&self, a: Addr) -> Result<u8, RefError> {
        Ok(self.bytes(a.space, a.offset, 1)?[0])
    }

    fn f32_at(&self, addr: u64) -> Result<f32, RefError> {
        let b = self.bytes(Space::Sram, addr, 4)?;
        Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u32_at(&self, addr: u64) -> Result<u32, RefError> {
        let b = self.bytes(Space::Sram, addr, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Element `i` of an SRAM array of `dtype` at `base`, as f32.
    fn elem(&self, base: u64, i: u64, dtype: DType) -> Result<f32, RefError> {
        match dtype {
            DType::F32 => self.f32_at(at(base, i, 4)?),
            DType::Bf16 => {
                let b = self.bytes(Space::Sram, at(base, i, 2)?, 2)?;
                Ok(bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            }
        }
    }

    /// Writes the expected values (each rounded to its type); what a
    /// correct model leaves in memory, up to the tolerances.
    pub fn apply(&mut self, writes: &[Write]) -> Result<(), RefError> {
        for w in writes {
            let bytes: Vec<u8> = match w.expect {
                Expect::Byte(b) => vec![b],
                Expect::F32 { value, .. } => (value as f32).to_le_bytes().to_vec(),
                Expect::Bf16 { value } => f32_to_bf16(value).to_le_bytes().to_vec(),
            };
            self.bytes_mut(w.space, w.addr, w.bytes())?.copy_from_slice(&bytes);
        }
        Ok(())
    }

    /// Copies the `len` bytes at `addr` of `space` from `other` (to take
    /// on the model's rounding after a comparison).
    pub fn copy_from(&mut self, space: Space, addr: u64, bytes: &[u8]) -> Result<(), RefError> {
        self.bytes_mut(space, addr, bytes.len() as u64)?.copy_from_slice(bytes);
        Ok(())
    }

    /// What `instr` writes, computed from the current memories (nothing
    /// is changed). Signal, wait and halt write nothing.
    pub fn effects(&self, instr: &Instr) -> Result<Vec<Write>, RefError> {
        let mut w = Work(0, self.max_work);
        let mut out = Vec::new();
        let sram_f32 = |addr: u64, expect: Expect| Write { space: Space::Sram, addr, expect };
        match *instr {
            Instr::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride } => {
                for i in 0..u64::from(rows) {
                    w.add(u64::from(row_bytes) + 1)?;
                    for b in 0..u64::from(row_bytes) {
                        let s = at(src.offset, i, src_stride)?.checked_add(b);
                        let d = at(dst.offset, i, dst_stride)?.checked_add(b);
                        let (Some(s), Some(d)) = (s, d) else {
                            return Err(RefError::Geometry("copy overflow"));
                        };
                        let v = self.byte(Addr { space: src.space, offset: s })?;
                        out.push(Write { space: dst.space, addr: d, expect: Expect::Byte(v) });
                    }
                }
            }
            Instr::DmaGather { table, indices, dst, count, row_bytes, table_rows } => {
                // A gather that moves no bytes does nothing (its indices
                // are not read).
                if row_bytes == 0 {
                    return Ok(out);
                }
                for j in 0..count {
                    let idx = self.u32_at(at(indices, j.into(), 4)?)?;
                    if idx >= table_rows {
                        return Err(RefError::GatherIndex { position: j, index: idx, rows: table_rows });
                    }
                    w.add(u64::from(row_bytes) + 1)?;
                    for b in 0..u64::from(row_bytes) {
                        let s = at(table.offset, idx.into(), row_bytes.into())?.checked_add(b);
                        let d = at(dst, j.into(), row_bytes.into())?.checked_add(b);
                        let (Some(s), Some(d)) = (s, d) else {
                            return Err(RefError::Geometry("gather overflow"));
                        };
                        let v = self.byte(Addr { space: table.space, offset: s })?;
                        out.push(Write { space: Space::Sram, addr: d, expect: Expect::Byte(v) });
                    }
                }
            }
            Instr::MatMul { dtype, flags, a, b, c, m, k, n, lda, ldb, ldc } => {
                if m == 0 || k == 0 || n == 0 {
                    return Ok(out);
                }
                for i in 0..u64::from(m) {
                    for j in 0..u64::from(n) {
                        w.add(k.into())?;
                        let c_at = at(c, i * u64::from(ldc) + j, 4)?;
                        let mut acc = Acc::default();
                        if flags.accumulate {
                            acc.add(f64::from(self.f32_at(c_at)?));
                        }
                        for kk in 0..u64::from(k) {
                            let av = self.elem(a, i * u64::from(lda) + kk, dtype)?;
                            let b_index = if flags.transpose_b {
                                j * u64::from(ldb) + kk
                            } else {
                                kk * u64::from(ldb) + j
                            };
                            let bv = self.elem(b, b_index, dtype)?;
                            acc.add(f64::from(av) * f64::from(bv));
                        }
                        out.push(sram_f32(c_at, acc.expect()));
                    }
                }
            }
            Instr::Conv2d { dtype, flags, input, weights, output, geom } => {
                let (ho, wo) = geom.out_hw().ok_or(RefError::Geometry("conv kernel/stride"))?;
                let cout = u64::from(geom.cout);
                let mut o = 0u64;
                for_each_pixel(&geom, ho, wo, |pixel| {
                    w.add(1)?;
                    for co in 0..cout {
                        w.add(u64::from(geom.kh) * u64::from(geom.kw) * u64::from(geom.cin) + 1)?;
                        let o_at = at(output, o, 4)?;
                        o += 1;
                        let mut acc = Acc::default();
                        if flags.accumulate {
                            acc.add(f64::from(self.f32_at(o_at)?));
                        }
                        // No input channels: no products (and no taps to
                        // list, however large the kernel).
                        let taps = if geom.cin == 0 { Vec::new() } else { taps(&geom, pixel) };
                        for (tap, in_pixel) in taps {
                            for ci in 0..u64::from(geom.cin) {
                                // Padding is zeros that take part in the
                                // products (0 x inf is NaN).
                                let x = match in_pixel {
                                    Some(p) => self.elem(input, p * u64::from(geom.cin) + ci, dtype)?,
                                    None => 0.0,
                                };
                                let wv =
                                    self.elem(weights, (tap * u64::from(geom.cin) + ci) * cout + co, dtype)?;
                                acc.add(f64::from(x) * f64::from(wv));
                            }
                        }
                        out.push(sram_f32(o_at, acc.expect()));
                    }
                    Ok(())
                })?;
            }
            Instr::VDepthwise { src, weights, dst, geom } => {
                if geom.cin != geom.cout {
                    return Err(RefError::Geometry("depthwise cin != cout"));
                }
                let (ho, wo) = geom.out_hw().ok_or(RefError::Geometry("depthwise kernel/stride"))?;
                let c = u64::from(geom.cin);
                let mut o = 0u64;
                for_each_pixel(&geom, ho, wo, |pixel| {
                    w.add(1)?;
                    for ch in 0..c {
                        w.add(u64::from(geom.kh) * u64::from(geom.kw) + 1)?;
                        let mut acc = Acc::default();
                        for (tap, in_pixel) in taps(&geom, pixel) {
                            let x = match in_pixel {
                                Some(p) => self.elem(src, p * c + ch, DType::F32)?,
                                None => 0.0,
                            };
                            let wv = self.elem(weights, tap * c + ch, DType::F32)?;
                            acc.add(f64::from(x) * f64::from(wv));
                        }
                        out.push(sram_f32(at(dst, o, 4)?, acc.expect()));
                        o += 1;
                    }
                    Ok(())
                })?;
            }
            Instr::VBinary { op, bcast, a, b, dst, rows, cols } => {
                for r in 0..u64::from(rows) {
                    w.add(u64::from(cols) + 1)?;
                    for col in 0..u64::from(cols) {
                        let i = r * u64::from(cols) + col;
                        let x = self.elem(a, i, DType::F32)?;
                        let y = match bcast {
                            Bcast::None => self.elem(b, i, DType::F32)?,
                            Bcast::Row => self.elem(b, col, DType::F32)?,
                            Bcast::Scalar => self.elem(b, 0, DType::F32)?,
                        };
                        // One IEEE f32 operation: exact.
                        let v = match op {
                            BinOp::Add => f64::from(x + y),
                            BinOp::Sub => f64::from(x - y),
                            BinOp::Mul => f64::from(x * y),
                            BinOp::Max => max_nan(x.into(), y.into()),
                            BinOp::Min => min_nan(x.into(), y.into()),
                            // Decided in f64, which orders every f32 as f32 does.
                            BinOp::Eq => f64::from(u8::from(f64::from(x) == f64::from(y))),
                            BinOp::Ne => f64::from(u8::from(f64::from(x) != f64::from(y))),
                            BinOp::Lt => f64::from(u8::from(f64::from(x) < f64::from(y))),
                            BinOp::Le => f64::from(u8::from(f64::from(x) <= f64::from(y))),
                            BinOp::Gt => f64::from(u8::from(f64::from(x) > f64::from(y))),
                            BinOp::Ge => f64::from(u8::from(f64::from(x) >= f64::from(y))),
                            BinOp::Keep if f64::from(x) == 0.0 => 0.0,
                            BinOp::Keep => f64::from(y),
                        };
                        out.push(sram_f32(at(dst, i, 4)?, Expect::F32 { value: v, tol: 0.0 }));
                    }
                }
            }
            Instr::VUnary { op, src, dst, len } => {
                w.add(len.into())?;
                for i in 0..u64::from(len) {
                    let x = self.elem(src, i, DType::F32)?;
                    if op == UnOp::F32ToI32 {
                        // Round toward zero, saturate, NaN to 0: decided
                        // in f64, which holds every f32 and every i32.
                        let v = f64::from(x);
                        let r = if v.is_nan() {
                            0
                        } else {
                            v.trunc().clamp(f64::from(i32::MIN), f64::from(i32::MAX)) as i32
                        };
                        let d = at(dst, i, 4)?;
                        for (k, b) in r.to_le_bytes().into_iter().enumerate() {
                            out.push(Write {
                                space: Space::Sram,
                                addr: d + k as u64,
                                expect: Expect::Byte(b),
                            });
                        }
                        continue;
                    }
                    out.push(sram_f32(at(dst, i, 4)?, unary(op, x)));
                }
            }
            Instr::VAffine { src, dst, len, scale, bias } => {
                w.add(len.into())?;
                for i in 0..u64::from(len) {
                    let x = self.elem(src, i, DType::F32)?;
                    // Two IEEE f32 operations, unfused: exact.
                    let v = x * scale + bias;
                    out.push(sram_f32(at(dst, i, 4)?, Expect::F32 { value: v.into(), tol: 0.0 }));
                }
            }
            Instr::VClamp { src, dst, len, lo, hi } => {
                w.add(len.into())?;
                for i in 0..u64::from(len) {
                    let x = self.elem(src, i, DType::F32)?;
                    // Comparisons only: exact. NaN propagates.
                    let v = if x.is_nan() { x } else { x.max(lo).min(hi) };
                    out.push(sram_f32(at(dst, i, 4)?, Expect::F32 { value: v.into(), tol: 0.0 }));
                }
            }
            Instr::VReduce { op, src, dst, outer, reduce, inner } => {
                // An empty reduction is an error only when it has outputs.
                if reduce == 0 && u64::from(outer) * u64::from(inner) > 0 {
                    return Err(RefError::Geometry("empty reduction"));
                }
                for o in 0..u64::from(outer) {
                    w.add(1)?;
                    for c in 0..u64::from(inner) {
                        w.add(reduce.into())?;
                        let mut acc = Acc::default();
                        let mut mx = f64::NEG_INFINITY;
                        for r in 0..u64::from(reduce) {
                            let i = (o * u64::from(reduce) + r) * u64::from(inner) + c;
                            let x = f64::from(self.elem(src, i, DType::F32)?);
                            acc.add(x);
                            mx = max_nan(mx, x);
                        }
                        let e = match op {
                            RedOp::Sum => acc.expect(),
                            RedOp::Max => Expect::F32 { value: mx, tol: 0.0 },
                            RedOp::Mean => match acc.expect() {
                                Expect::F32 { value, tol } => {
                                    let r = f64::from(reduce);
                                    Expect::F32 {
                                        value: value / r,
                                        tol: tol / r + 2.0 * U * (value / r).abs(),
                                    }
                                }
                                e => e,
                            },
                        };
                        out.push(sram_f32(at(dst, o * u64::from(inner) + c, 4)?, e));
                    }
                }
            }
            Instr::VSoftmax { src, dst, rows, cols } => {
                for r in 0..u64::from(rows) {
                    w.add(u64::from(cols) * 3 + 1)?;
                    let row: Vec<f64> = (0..u64::from(cols))
                        .map(|c| self.elem(src, r * u64::from(cols) + c, DType::F32).map(f64::from))
                        .collect::<Result<_, _>>()?;
                    for (c, e) in softmax(&row).into_iter().enumerate() {
                        out.push(sram_f32(at(dst, r * u64::from(cols) + c as u64, 4)?, e));
                    }
                }
            }
            Instr::VLayerNorm { src, dst, gamma, beta, rows, cols, eps } => {
                for r in 0..u64::from(rows) {
                    w.add(u64::from(cols) * 4 + 1)?;
                    let row: Vec<f64> = (0..u64::from(cols))
                        .map(|c| self.elem(src, r * u64::from(cols) + c, DType::F32).map(f64::from))
                        .collect::<Result<_, _>>()?;
                    let g: Vec<f64> = (0..u64::from(cols))
                        .map(|c| self.elem(gamma, c, DType::F32).map(f64::from))
                        .collect::<Result<_, _>>()?;
                    let bt: Vec<f64> = (0..u64::from(cols))
                        .map(|c| self.elem(beta, c, DType::F32).map(f64::from))
                        .collect::<Result<_, _>>()?;
                    for (c, e) in layernorm(&row, &g, &bt, eps.into()).into_iter().enumerate() {
                        out.push(sram_f32(at(dst, r * u64::from(cols) + c as u64, 4)?, e));
                    }
                }
            }
            Instr::VRmsNorm { src, dst, gamma, rows, cols, eps } => {
                for r in 0..u64::from(rows) {
                    w.add(u64::from(cols) * 3 + 1)?;
                    let row: Vec<f64> = (0..u64::from(cols))
                        .map(|c| self.elem(src, r * u64::from(cols) + c, DType::F32).map(f64::from))
                        .collect::<Result<_, _>>()?;
                    let g: Vec<f64> = (0..u64::from(cols))
                        .map(|c| self.elem(gamma, c, DType::F32).map(f64::from))
                        .collect::<Result<_, _>>()?;
                    for (c, e) in rmsnorm(&row, &g, eps.into()).into_iter().enumerate() {
                        out.push(sram_f32(at(dst, r * u64::from(cols) + c as u64, 4)?, e));
                    }
                }
            }
            Instr::VPool { op, src, dst, geom } => {
                if u32::from(geom.pad) >= u32::from(geom.kh).min(u32::from(geom.kw)) {
                    return Err(RefError::Geometry("pool padding >= window"));
                }
                let (ho, wo) = geom.out_hw().ok_or(RefError::Geometry("pool window/stride"))?;
                let cg = pool_as_conv(&geom);
                let c = u64::from(geom.c);
                let mut o = 0u64;
                for_each_pixel(&cg, ho, wo, |pixel| {
                    w.add(1)?;
                    for ch in 0..c {
                        w.add(u64::from(geom.kh) * u64::from(geom.kw) + 1)?;
                        let mut acc = Acc::default();
                        let mut mx = f64::NEG_INFINITY;
                        // Padding takes no part in pooling.
                        for in_pixel in taps(&cg, pixel).into_iter().filter_map(|t| t.1) {
                            let x = f64::from(self.elem(src, in_pixel * c + ch, DType::F32)?);
                            acc.add(x);
                            mx = max_nan(mx, x);
                        }
                        let e = match op {
                            PoolOp::Max => Expect::F32 { value: mx, tol: 0.0 },
                            PoolOp::Avg => match acc.expect() {
                                Expect::F32 { value, tol } => {
                                    let n = acc.terms.max(1) as f64;
                                    Expect::F32 {
                                        value: value / n,
                                        tol: tol / n + 2.0 * U * (value / n).abs(),
                                    }
                                }
                                e => e,
                            },
                        };
                        out.push(sram_f32(at(dst, o, 4)?, e));
                        o += 1;
                    }
                    Ok(())
                })?;
            }
            Instr::VConvert { from, to, src, dst, len } => {
                w.add(len.into())?;
                for i in 0..u64::from(len) {
                    let x = self.elem(src, i, from)?;
                    let e = match to {
                        DType::F32 => Expect::F32 { value: x.into(), tol: 0.0 },
                        DType::Bf16 => Expect::Bf16 { value: bf16_to_f32(f32_to_bf16(x)) },
                    };
                    out.push(Write { space: Space::Sram, addr: at(dst, i, to.size())?, expect: e });
                }
            }
            Instr::Signal { .. } | Instr::Wait { .. } | Instr::Halt => {}
        }
        Ok(out)
    }
}

/// Pool geometry as a convolution window with symmetric padding.
fn pool_as_conv(g: &PoolGeom) -> ConvGeom {
    ConvGeom {
        n: g.n,
        h: g.h,
        w: g.w,
        cin: g.c,
        cout: g.c,
        kh: g.kh,
        kw: g.kw,
        stride_h: g.stride,
        stride_w: g.stride,
        pad_top: g.pad,
        pad_bottom: g.pad,
        pad_left: g.pad,
        pad_right: g.pad,
    }
}

/// An output pixel: image, row, column.
#[derive(Clone, Copy)]
struct Pixel {
    n: u64,
    y: u64,
    x: u64,
}

/// Calls `f` for every output pixel in NHWC order.
fn for_each_pixel(
    g: &ConvGeom,
    ho: u32,
    wo: u32,
    mut f: impl FnMut(Pixel) -> Result<(), RefError>,
) -> Result<(), RefError> {
    for n in 0..u64::from(g.n) {
        for y in 0..u64::from(ho) {
            for x in 0..u64::from(wo) {
                f(Pixel { n, y, x })?;
            }
        }
    }
    Ok(())
}

/// Every kernel tap of output pixel `p`: `(ky * kw + kx, input pixel
/// index over n*h*w)`, the pixel `None` where the tap falls on padding.
fn taps(g: &ConvGeom, p: Pixel) -> Vec<(u64, Option<u64>)> {
    let mut v = Vec::new();
    let (sh, sw) = (u64::from(g.stride_h), u64::from(g.stride_w));
    let inside = |padded: u64, pad: u16, size: u32| {
        padded.checked_sub(u64::from(pad)).filter(|i| *i < u64::from(size))
    };
    for ky in 0..u64::from(g.kh) {
        let iy = inside(p.y * sh + ky, g.pad_top, g.h);
        for kx in 0..u64::from(g.kw) {
            let ix = inside(p.x * sw + kx, g.pad_left, g.w);
            let pixel = iy.zip(ix).map(|(iy, ix)| (p.n * u64::from(g.h) + iy) * u64::from(g.w) + ix);
            v.push((ky * u64::from(g.kw) + kx, pixel));
        }
    }
    v
}

/// One element of `vu.unary`, in f64 with the error the model's f32
/// evaluation may have.
fn unary(op: UnOp, x: f32) -> Expect {
    let xd = f64::from(x);
    let exact = |v: f32| Expect::F32 { value: v.into(), tol: 0.0 };
    match op {
        UnOp::Copy => exact(x),
        // NaN propagates (IEEE maximum), -0 and +0 compare equal.
        UnOp::Relu => Expect::F32 { value: max_nan(xd, 0.0), tol: 0.0 },
        UnOp::Neg => exact(-x),
        // Correctly rounded in IEEE f32.
        UnOp::Recip => exact(1.0 / x),
        UnOp::Sqrt => exact(x.sqrt()),
        UnOp::Exp => {
            let v = xd.exp();
            Expect::F32 { value: v, tol: 4.0 * U * v.abs() + TINY }
        }
        UnOp::Tanh => {
            let v = xd.tanh();
            Expect::F32 { value: v, tol: 4.0 * U * v.abs() + TINY }
        }
        UnOp::Sigmoid => {
            // 1 / (1 + e^-x): the exponential's error carries through.
            let e = (-xd).exp();
            let v = 1.0 / (1.0 + e);
            Expect::F32 { value: v, tol: 8.0 * U * v.abs() + TINY }
        }
        UnOp::Gelu => {
            // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) with the
            // f32 constants of the ISA page.
            let c = f64::from(0.797_884_6f32);
            let k = f64::from(0.044_715f32);
            let inner = c * (xd + k * xd * xd * xd);
            let v = 0.5 * xd * (1.0 + inner.tanh());
            if inner.is_nan() {
                return Expect::F32 { value: v, tol: 0.0 };
            }
            // Error of tanh's argument (relative, a few roundings) times
            // its derivative, plus the rounding of 1 + tanh and of the
            // products; bounded by 8 u (|x| + |v|).
            Expect::F32 { value: v, tol: 8.0 * U * (xd.abs() + v.abs()) + TINY }
        }
        UnOp::Erf => {
            // erf is flat (|erf'| <= 1.13): a few ulps of the result.
            let v = libm::erf(xd);
            Expect::F32 { value: v, tol: 4.0 * U * v.abs() + TINY }
        }
        UnOp::GeluErf => {
            // x (1 + erf(x / sqrt 2)) / 2 in f32: the rounding of the
            // argument, of erf, of 1 + erf and of the products; bounded by
            // 8 u (|x| + |v|) like the tanh form.
            let v = 0.5 * xd * (1.0 + libm::erf(xd * std::f64::consts::FRAC_1_SQRT_2));
            Expect::F32 { value: v, tol: 8.0 * U * (xd.abs() + v.abs()) + TINY }
        }
        // Exact in IEEE f32.
        UnOp::Abs => exact(x.abs()),
        UnOp::Floor => exact(x.floor()),
        UnOp::Ceil => exact(x.ceil()),
        // A few ulps of the result (f32 libraries are within one).
        UnOp::Log => {
            let v = xd.ln();
            Expect::F32 { value: v, tol: 4.0 * U * v.abs() + TINY }
        }
        UnOp::Sin | UnOp::Cos => {
            let v = if op == UnOp::Sin { xd.sin() } else { xd.cos() };
            Expect::F32 { value: v, tol: 4.0 * U * v.abs() + TINY }
        }
        // The bits as an i32, rounded once to f32 (through f64, which holds
        // every i32 exactly).
        UnOp::I32ToF32 => exact(f64::from(x.to_bits().cast_signed()) as f32),
        // Checked byte by byte (its result is an i32, not an f32): see
        // the `VUnary` arm.
        UnOp::F32ToI32 => Expect::F32 { value: 0.0, tol: f64::INFINITY },
    }
}

/// Row softmax, max-subtracted, with the error bound of an f32 evaluation.
fn softmax(row: &[f64]) -> Vec<Expect> {
    let mx = row.iter().copied().fold(f64::NEG_INFINITY, max_nan);
    let e: Vec<f64> = row.iter().map(|x| (x - mx).exp()).collect();
    let sum: f64 = e.iter().sum();
    let n = row.len() as f64;
    row.iter()
        .zip(&e)
        .map(|(x, ei)| {
            let v = ei / sum;
            // exp's argument x - max carries one rounding (relative u of
            // |x - max|); the exponentials, the sum of n terms in [0, 1] and
            // the scaling add (n + 8) u relative.
            let tol = v * U * (2.0 * (x - mx).abs() + n + 8.0) + TINY;
            Expect::F32 { value: v, tol }
        })
        .collect()
}

/// Row layer norm `(x - mean) / sqrt(var + eps) * gamma + beta`
/// (population variance), with a bound on an f32 two-pass evaluation;
/// no claim for an ill-conditioned row (variance lost in rounding, or
/// sums that may overflow f32).
fn layernorm(row: &[f64], g: &[f64], b: &[f64], eps: f64) -> Vec<Expect> {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let d: Vec<f64> = row.iter().map(|x| x - mean).collect();
    let var = d.iter().map(|v| v * v).sum::<f64>() / n;
    let denom = var + eps;
    let inv = 1.0 / denom.sqrt();
    let abs_sum: f64 = row.iter().map(|x| x.abs()).sum();
    // Error of the f32 mean, of each deviation and of the variance.
    let d_mean = (n + 2.0) * U * abs_sum / n + 2.0 * SUB;
    let d_abs: f64 = d.iter().map(|v| v.abs()).sum();
    let d_var = (2.0 * d_mean * d_abs + (n + 4.0) * U * d.iter().map(|v| v * v).sum::<f64>()) / n
        + U * denom.abs()
        + (n + 2.0) * SUB;
    let rel_inv = 0.5 * d_var / denom.abs() + 4.0 * U;
    let conditioned = rel_inv < 0.01;
    let ill = !conditioned
        || abs_sum > OVERFLOW_RISK
        || d.iter().map(|v| v * v).sum::<f64>() > OVERFLOW_RISK
        || !inv.is_finite();
    d.iter()
        .enumerate()
        .map(|(i, di)| {
            let v = di * inv * g[i] + b[i];
            if ill {
                // NaN in the inputs gives NaN in any evaluation.
                let nan = row.iter().any(|x| x.is_nan()) || g[i].is_nan() || b[i].is_nan();
                return if nan {
                    Expect::F32 { value: f64::NAN, tol: 0.0 }
                } else {
                    Expect::F32 { value: v, tol: f64::INFINITY }
                };
            }
            let y = di * inv * g[i];
            let tol = g[i].abs() * inv * (d_mean + U * di.abs())
                + y.abs() * (rel_inv + 4.0 * U)
                + U * v.abs()
                + TINY;
            Expect::F32 { value: v, tol: 2.0 * tol }
        })
        .collect()
}

/// `x / sqrt(mean(x^2) + eps) * g` per element of one row, with the
/// error bound of its f32 evaluation: the sum of squares, the mean, the
/// square root and reciprocal, then two products.
fn rmsnorm(row: &[f64], g: &[f64], eps: f64) -> Vec<Expect> {
    let n = row.len() as f64;
    let sq: f64 = row.iter().map(|x| x * x).sum();
    let denom = sq / n + eps;
    let inv = 1.0 / denom.sqrt();
    // Error of the f32 squares, their sum and the mean; then of `+ eps`.
    let d_ms = (n + 3.0) * U * sq / n + U * denom.abs() + (n + 2.0) * SUB;
    let rel_inv = 0.5 * d_ms / denom.abs() + 4.0 * U;
    let conditioned = rel_inv < 0.01;
    let ill = !conditioned || sq > OVERFLOW_RISK || !inv.is_finite();
    row.iter()
        .zip(g)
        .map(|(x, gi)| {
            let v = x * inv * gi;
            if ill {
                let nan = row.iter().any(|x| x.is_nan()) || gi.is_nan();
                return if nan {
                    Expect::F32 { value: f64::NAN, tol: 0.0 }
                } else {
                    Expect::F32 { value: v, tol: f64::INFINITY }
                };
            }
            // `x * inv` is rounded before `* g`: in the subnormal range
            // to an absolute step, which `g` scales.
            let tol = v.abs() * (rel_inv + 4.0 * U) + gi.abs() * SUB + TINY;
            Expect::F32 { value: v, tol: 2.0 * tol }
        })
        .collect()
}

#[cfg(test)]
mod tests;
