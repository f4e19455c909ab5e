//! The memory each instruction reads and writes.
//!
//! Because every address is an immediate, the byte ranges an instruction
//! touches follow from its fields alone. [`Instr::footprint`] computes them
//! with overflow-checked arithmetic; a verifier compares them with the
//! segments a vNPU owns. A strided access is covered by its bounding range
//! (first byte of the first row to last byte of the last row).

use core::fmt;

use crate::isa::{Bcast, Instr, Space};

/// Whether an access reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessKind {
    Read,
    Write,
}

/// A byte range `[start, start + len)` in `space`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub space: Space,
    pub start: u64,
    pub len: u64,
    pub kind: AccessKind,
}

impl Access {
    /// One past the last byte (cannot overflow: checked on construction).
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Why an instruction's footprint is not well defined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FootprintError {
    /// Address arithmetic overflows 64 bits.
    Overflow { operand: &'static str },
    /// A leading dimension or stride is smaller than the row it strides over.
    BadStride { operand: &'static str },
    /// A geometry field makes the operation meaningless (zero stride,
    /// kernel larger than the padded input, empty reduction).
    BadGeometry { what: &'static str },
    /// The instruction touches more ranges than a [`Footprint`] holds
    /// ([`MAX_ACCESSES`]): refused rather than checked in part.
    TooManyAccesses,
}

impl fmt::Display for FootprintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Overflow { operand } => write!(f, "address arithmetic of `{operand}` overflows"),
            Self::BadStride { operand } => {
                write!(f, "stride of `{operand}` is smaller than its row")
            }
            Self::BadGeometry { what } => write!(f, "invalid geometry: {what}"),
            Self::TooManyAccesses => {
                write!(f, "instruction touches more than {MAX_ACCESSES} memory ranges")
            }
        }
    }
}

impl core::error::Error for FootprintError {}

/// Most memory ranges one instruction's footprint holds.
pub const MAX_ACCESSES: usize = 5;

/// Up to [`MAX_ACCESSES`] accesses, without allocation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Footprint {
    items: [Option<Access>; MAX_ACCESSES],
    len: usize,
}

impl Footprint {
    /// Records `a` (an empty access touches nothing and is left out). An
    /// access beyond the capacity is an error, never dropped: a verifier
    /// that checked only some of an instruction's ranges would pass it.
    fn add(&mut self, a: Access) -> Result<(), FootprintError> {
        if a.len == 0 {
            return Ok(());
        }
        let slot = self.items.get_mut(self.len).ok_or(FootprintError::TooManyAccesses)?;
        *slot = Some(a);
        self.len += 1;
        Ok(())
    }

    /// The accesses, empty ones left out.
    pub fn iter(&self) -> impl Iterator<Item = &Access> {
        self.items.iter().flatten()
    }
}

fn mul(a: u64, b: u64, operand: &'static str) -> Result<u64, FootprintError> {
    a.checked_mul(b).ok_or(FootprintError::Overflow { operand })
}

fn add(a: u64, b: u64, operand: &'static str) -> Result<u64, FootprintError> {
    a.checked_add(b).ok_or(FootprintError::Overflow { operand })
}

/// Bounding range of `rows` rows of `row` bytes, `stride` bytes apart.
fn strided(
    space: Space,
    start: u64,
    rows: u64,
    row: u64,
    stride: u64,
    kind: AccessKind,
    operand: &'static str,
) -> Result<Access, FootprintError> {
    if rows == 0 || row == 0 {
        return Ok(Access { space, start, len: 0, kind });
    }
    if rows > 1 && stride < row {
        // Overlapping source rows are harmless to read, but a stride below
        // the row is almost always a bug and makes ranges ambiguous.
        return Err(FootprintError::BadStride { operand });
    }
    let len = add(mul(rows - 1, stride, operand)?, row, operand)?;
    add(start, len, operand)?;
    Ok(Access { space, start, len, kind })
}

fn dense(
    space: Space,
    start: u64,
    elems: u64,
    size: u64,
    kind: AccessKind,
    operand: &'static str,
) -> Result<Access, FootprintError> {
    let len = mul(elems, size, operand)?;
    add(start, len, operand)?;
    Ok(Access { space, start, len, kind })
}

/// A matrix of `rows x cols` elements with leading dimension `ld` (elements).
fn matrix(
    start: u64,
    rows: u32,
    cols: u32,
    ld: u32,
    size: u64,
    kind: AccessKind,
    operand: &'static str,
) -> Result<Access, FootprintError> {
    if rows > 1 && ld < cols {
        return Err(FootprintError::BadStride { operand });
    }
    strided(
        Space::Sram,
        start,
        rows.into(),
        mul(cols.into(), size, operand)?,
        mul(ld.into(), size, operand)?,
        kind,
        operand,
    )
}

impl Instr {
    /// The byte ranges this instruction reads and writes.
    pub fn footprint(&self) -> Result<Footprint, FootprintError> {
        use AccessKind::{Read, Write};
        let mut f = Footprint::default();
        const F32: u64 = 4;
        match *self {
            Instr::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride } => {
                let (r, b) = (u64::from(rows), u64::from(row_bytes));
                // A source stride of 0 reads one row again and again (a
                // broadcast, e.g. a fill): its footprint is that row.
                let src_rows = if src_stride == 0 { r.min(1) } else { r };
                f.add(strided(src.space, src.offset, src_rows, b, src_stride, Read, "src")?)?;
                f.add(strided(dst.space, dst.offset, r, b, dst_stride, Write, "dst")?)?;
            }
            Instr::DmaGather { table, indices, dst, count, row_bytes, table_rows } => {
                let rb = u64::from(row_bytes);
                f.add(dense(table.space, table.offset, table_rows.into(), rb, Read, "table")?)?;
                f.add(dense(Space::Sram, indices, count.into(), 4, Read, "indices")?)?;
                f.add(dense(Space::Sram, dst, count.into(), rb, Write, "dst")?)?;
            }
            Instr::MatMul { dtype, flags, a, b, c, m, k, n, lda, ldb, ldc } => {
                if m == 0 || k == 0 || n == 0 {
                    return Ok(f);
                }
                let s = dtype.size();
                f.add(matrix(a, m, k, lda, s, Read, "a")?)?;
                if flags.transpose_b {
                    f.add(matrix(b, n, k, ldb, s, Read, "b")?)?;
                } else {
                    f.add(matrix(b, k, n, ldb, s, Read, "b")?)?;
                }
                if flags.accumulate {
                    f.add(matrix(c, m, n, ldc, F32, Read, "c")?)?;
                }
                f.add(matrix(c, m, n, ldc, F32, Write, "c")?)?;
            }
            Instr::Conv2d { dtype, flags, input, weights, output, geom: g } => {
                let (ho, wo) =
                    g.out_hw().ok_or(FootprintError::BadGeometry { what: "conv kernel/stride" })?;
                let s = dtype.size();
                let inp = mul(
                    mul(mul(g.n.into(), g.h.into(), "input")?, g.w.into(), "input")?,
                    g.cin.into(),
                    "input",
                )?;
                let kk = mul(u64::from(g.kh), u64::from(g.kw), "weights")?;
                let wts = mul(mul(kk, g.cin.into(), "weights")?, g.cout.into(), "weights")?;
                let out = mul(
                    mul(mul(g.n.into(), ho.into(), "output")?, wo.into(), "output")?,
                    g.cout.into(),
                    "output",
                )?;
                f.add(dense(Space::Sram, input, inp, s, Read, "input")?)?;
                f.add(dense(Space::Sram, weights, wts, s, Read, "weights")?)?;
                if flags.accumulate {
                    f.add(dense(Space::Sram, output, out, F32, Read, "output")?)?;
                }
                f.add(dense(Space::Sram, output, out, F32, Write, "output")?)?;
            }
            Instr::VBinary { bcast, a, b, dst, rows, cols, .. } => {
                let n = mul(rows.into(), cols.into(), "a")?;
                let nb = match bcast {
                    Bcast::None => n,
                    Bcast::Row => u64::from(cols).min(n),
                    Bcast::Scalar => u64::from(n > 0),
                };
                f.add(dense(Space::Sram, a, n, F32, Read, "a")?)?;
                f.add(dense(Space::Sram, b, nb, F32, Read, "b")?)?;
                f.add(dense(Space::Sram, dst, n, F32, Write, "dst")?)?;
            }
            Instr::VUnary { src, dst, len, .. }
            | Instr::VAffine { src, dst, len, .. }
            | Instr::VClamp { src, dst, len, .. } => {
                f.add(dense(Space::Sram, src, len.into(), F32, Read, "src")?)?;
                f.add(dense(Space::Sram, dst, len.into(), F32, Write, "dst")?)?;
            }
            Instr::VReduce { src, dst, outer, reduce, inner, .. } => {
                let oi = mul(outer.into(), inner.into(), "dst")?;
                if reduce == 0 && oi > 0 {
                    return Err(FootprintError::BadGeometry { what: "empty reduction" });
                }
                f.add(dense(Space::Sram, src, mul(oi, reduce.into(), "src")?, F32, Read, "src")?)?;
                f.add(dense(Space::Sram, dst, oi, F32, Write, "dst")?)?;
            }
            Instr::VDepthwise { src, weights, dst, geom: g } => {
                if g.cin != g.cout {
                    return Err(FootprintError::BadGeometry { what: "depthwise cin != cout" });
                }
                let (ho, wo) =
                    g.out_hw().ok_or(FootprintError::BadGeometry { what: "depthwise kernel/stride" })?;
                let nc = mul(g.n.into(), g.cin.into(), "src")?;
                let inp = mul(mul(nc, g.h.into(), "src")?, g.w.into(), "src")?;
                let wts = mul(mul(g.kh.into(), g.kw.into(), "weights")?, g.cin.into(), "weights")?;
                let out = mul(mul(nc, ho.into(), "dst")?, wo.into(), "dst")?;
                f.add(dense(Space::Sram, src, inp, F32, Read, "src")?)?;
                f.add(dense(Space::Sram, weights, wts, F32, Read, "weights")?)?;
                f.add(dense(Space::Sram, dst, out, F32, Write, "dst")?)?;
            }
            Instr::VSoftmax { src, dst, rows, cols } => {
                let n = mul(rows.into(), cols.into(), "src")?;
                f.add(dense(Space::Sram, src, n, F32, Read, "src")?)?;
                f.add(dense(Space::Sram, dst, n, F32, Write, "dst")?)?;
            }
            Instr::VLayerNorm { src, dst, gamma, beta, rows, cols, .. } => {
                let n = mul(rows.into(), cols.into(), "src")?;
                let c = if n == 0 { 0 } else { cols.into() };
                f.add(dense(Space::Sram, src, n, F32, Read, "src")?)?;
                f.add(dense(Space::Sram, gamma, c, F32, Read, "gamma")?)?;
                f.add(dense(Space::Sram, beta, c, F32, Read, "beta")?)?;
                f.add(dense(Space::Sram, dst, n, F32, Write, "dst")?)?;
            }
            Instr::VRmsNorm { src, dst, gamma, rows, cols, .. } => {
                let n = mul(rows.into(), cols.into(), "src")?;
                let c = if n == 0 { 0 } else { cols.into() };
                f.add(dense(Space::Sram, src, n, F32, Read, "src")?)?;
                f.add(dense(Space::Sram, gamma, c, F32, Read, "gamma")?)?;
                f.add(dense(Space::Sram, dst, n, F32, Write, "dst")?)?;
            }
            Instr::VPool { src, dst, geom: g, .. } => {
                let (ho, wo) =
                    g.out_hw().ok_or(FootprintError::BadGeometry { what: "pool window/stride" })?;
                if u32::from(g.pad) >= u32::from(g.kh).min(u32::from(g.kw)) {
                    return Err(FootprintError::BadGeometry { what: "pool padding >= window" });
                }
                let nc = mul(g.n.into(), g.c.into(), "src")?;
                let inp = mul(mul(nc, g.h.into(), "src")?, g.w.into(), "src")?;
                let out = mul(mul(nc, ho.into(), "dst")?, wo.into(), "dst")?;
                f.add(dense(Space::Sram, src, inp, F32, Read, "src")?)?;
                f.add(dense(Space::Sram, dst, out, F32, Write, "dst")?)?;
            }
            Instr::VConvert { from, to, src, dst, len } => {
                f.add(dense(Space::Sram, src, len.into(), from.size(), Read, "src")?)?;
                f.add(dense(Space::Sram, dst, len.into(), to.size(), Write, "dst")?)?;
            }
            Instr::Signal { .. } | Instr::Wait { .. } | Instr::Halt => {}
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An access beyond the capacity is refused, never silently dropped
    /// (a verifier would then check only part of the instruction).
    #[test]
    fn an_access_beyond_the_capacity_is_an_error() {
        let mut f = Footprint::default();
        let at = |i: u64| Access { space: Space::Sram, start: 64 * i, len: 8, kind: AccessKind::Read };
        for i in 0..MAX_ACCESSES as u64 {
            assert_eq!(f.add(at(i)), Ok(()));
        }
        assert_eq!(f.add(at(99)), Err(FootprintError::TooManyAccesses));
        assert_eq!(f.iter().count(), MAX_ACCESSES);
        // Empty accesses take no slot and are never an error.
        assert_eq!(f.add(Access { len: 0, ..at(7) }), Ok(()));
    }
}
