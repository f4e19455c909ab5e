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

use vnpu_abi::{Engine, ProgramBuilder};

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

/// Little-endian f32s from bytes (a trailing partial value is ignored).
pub fn f32s(bytes: &[u8]) -> alloc::vec::Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
