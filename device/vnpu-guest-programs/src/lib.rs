//! Inference programs for the vNPU, shared by the guests that run them and
//! the host benchmarks that run the very same programs in-process.
//! `no_std` + `alloc`.
//!
//! Each model has a weight-loading program (weights stay in the vNPU's
//! SRAM across requests) and an inference program for a batch of images at
//! given guest addresses, plus a plain CPU reference in f32.
//! `docs/inference-guests.md` describes the models and the fixtures.
#![no_std]

extern crate alloc;

pub mod digits;
pub mod recsys;
pub mod selfcheck;
pub mod transformer;

use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder};

/// `dma.copy` of `bytes` contiguous bytes (sizes of these small models fit
/// in 32 bits).
fn copy(src: Addr, dst: Addr, bytes: usize) -> Instr {
    Instr::copy(src, dst, bytes as u32)
}

/// A program builder that hands work between engines through semaphores.
#[derive(Debug, Default)]
pub struct Pipeline {
    pub p: ProgramBuilder,
    sem: u8,
}

impl Pipeline {
    pub fn new() -> Self {
        Self::default()
    }

    /// `from` signals, `to` waits: everything `from` issued so far happens
    /// before what `to` issues next.
    pub fn hand(&mut self, from: Engine, to: Engine) {
        self.p.sync(from, to, self.sem);
        self.sem = (self.sem + 1) % vnpu_abi::isa::NUM_SEMAPHORES;
    }
}

/// Index of the largest element (the first of equals).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// Largest `|got[i] - want[i]|`, NaN-propagating: NaN when any
/// difference is NaN (so `err <= tol` fails on a NaN output, which a fold
/// with `f32::max` would skip), infinity when the lengths differ.
pub fn max_abs_error(got: &[f32], want: &[f32]) -> f32 {
    max_error(got, want, |_| 1.0)
}

/// Largest `|got[i] - want[i]| / (1 + |want[i]|)`, NaN-propagating like
/// [`max_abs_error`].
pub fn max_rel_error(got: &[f32], want: &[f32]) -> f32 {
    max_error(got, want, |w| 1.0 + w.abs())
}

fn max_error(got: &[f32], want: &[f32], scale: impl Fn(f32) -> f32) -> f32 {
    if got.len() != want.len() {
        return f32::INFINITY;
    }
    got.iter().zip(want).map(|(g, w)| (g - w).abs() / scale(*w)).fold(0.0, worst)
}

/// The larger of two errors, NaN if either is NaN (unlike `f32::max`,
/// which returns the other operand).
pub fn worst(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// Little-endian f32s from bytes (a trailing partial value is ignored).
pub fn f32s(bytes: &[u8]) -> alloc::vec::Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_propagate_nan_and_length_mismatches() {
        let want = [1.0, 2.0, 3.0];
        assert_eq!(max_abs_error(&[1.0, 2.5, 3.0], &want), 0.5);
        assert!(max_abs_error(&[f32::NAN; 3], &want).is_nan());
        assert!(max_abs_error(&[1.0, f32::NAN, 3.0], &want).is_nan());
        assert!(max_abs_error(&[1.0, 2.0, 3.0], &[1.0, 2.0, f32::NAN]).is_nan());
        assert!(max_rel_error(&[f32::INFINITY, 2.0, 3.0], &[f32::INFINITY, 2.0, 3.0]).is_nan());
        assert_eq!(max_abs_error(&[1.0, 2.0], &want), f32::INFINITY);
        assert_eq!(max_rel_error(&[1.0, 2.0, 6.0], &want), 0.75);
        // The check every caller writes fails for NaN.
        let passes = |e: f32| e <= 1e-3;
        assert!(!passes(max_abs_error(&[f32::NAN; 3], &want)));
        assert!(worst(0.5, f32::NAN).is_nan() && worst(f32::NAN, 0.5).is_nan());
        assert_eq!(worst(0.5, 0.25), 0.5);
    }
}
