//! Static bounds checking of a program against one vNPU core, before any
//! of it runs. Every address is an immediate, so the byte ranges each
//! instruction touches follow from its fields ([`vnpu_abi::footprint`]);
//! each is checked against the segment of its space.

use std::ops::Range;

use thiserror::Error;
use vnpu_abi::{AccessKind, EngineKind, FootprintError, Program, Space};

/// Most instructions a program may hold (the container's limit, which
/// the decoder already enforces; checked again here).
pub use vnpu_abi::program::MAX_INSTRUCTIONS;

/// What a program may use: the vNPU core's engines and segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VnpuLimits {
    pub sa: u32,
    pub vu: u32,
    pub sram_bytes: u64,
    pub hbm_bytes: u64,
    /// Guest-physical ranges the vNPU may DMA to and from.
    pub guest: Vec<Range<u64>>,
    /// Engines it may borrow beyond `sa` and `vu` (its borrowing cap): a
    /// spread program ([`vnpu_abi::program::FLAG_SPREAD`]) may have up to
    /// `sa + borrow_sa` SA and `vu + borrow_vu` VU streams, and never runs
    /// on more engines than that at once. A program that is not spread is
    /// bound to `sa` and `vu`, whatever the cap.
    pub borrow_sa: u32,
    pub borrow_vu: u32,
}

impl VnpuLimits {
    /// The most SA and VU streams `program` may have: the guarantee, plus
    /// the borrowing cap if the program is spread.
    pub fn engines_for(&self, program: &Program) -> (u32, u32) {
        if program.spread {
            (self.sa.saturating_add(self.borrow_sa), self.vu.saturating_add(self.borrow_vu))
        } else {
            (self.sa, self.vu)
        }
    }
}

/// Why a program was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum VerifyError {
    #[error("program has {count} instructions, limit is {MAX_INSTRUCTIONS}")]
    TooLong { count: usize },
    #[error("stream {stream}: engine {engine} does not exist on this vNPU ({sa} SAs, {vu} VUs, 1 DMA{})", if *spread { ", guarantee plus borrowing cap of a spread program" } else { "" })]
    NoSuchEngine { stream: usize, engine: vnpu_abi::Engine, sa: u32, vu: u32, spread: bool },
    #[error("stream {stream} instruction {index} ({mnemonic}): {source}")]
    Footprint { stream: usize, index: usize, mnemonic: &'static str, source: FootprintError },
    #[error("stream {stream} instruction {index} ({mnemonic}): {kind} of {space} [{start:#x}, +{len:#x}) outside the vNPU's {space} segment")]
    OutOfBounds {
        stream: usize,
        index: usize,
        mnemonic: &'static str,
        kind: &'static str,
        space: &'static str,
        start: u64,
        len: u64,
    },
}

impl VerifyError {
    /// Index of the offending instruction within its stream, when there is one.
    pub fn position(&self) -> Option<(usize, usize)> {
        match *self {
            Self::Footprint { stream, index, .. } | Self::OutOfBounds { stream, index, .. } => {
                Some((stream, index))
            }
            _ => None,
        }
    }
}

/// Checks `program` against `limits`.
pub fn verify(program: &Program, limits: &VnpuLimits) -> Result<(), VerifyError> {
    let count = program.instruction_count();
    if count > MAX_INSTRUCTIONS {
        return Err(VerifyError::TooLong { count });
    }
    let (sa, vu) = limits.engines_for(program);
    for (s, stream) in program.streams.iter().enumerate() {
        let e = stream.engine;
        let ok = match e.kind {
            EngineKind::Dma => e.index == 0,
            EngineKind::Sa => u32::from(e.index) < sa,
            EngineKind::Vu => u32::from(e.index) < vu,
        };
        if !ok {
            return Err(VerifyError::NoSuchEngine { stream: s, engine: e, sa, vu, spread: program.spread });
        }
        for (i, instr) in stream.code.iter().enumerate() {
            let fp = instr.footprint().map_err(|source| VerifyError::Footprint {
                stream: s,
                index: i,
                mnemonic: instr.mnemonic(),
                source,
            })?;
            for a in fp.iter() {
                let inside = match a.space {
                    Space::Sram => a.end() <= limits.sram_bytes,
                    Space::Hbm => a.end() <= limits.hbm_bytes,
                    Space::Guest => limits.guest.iter().any(|r| a.start >= r.start && a.end() <= r.end),
                };
                if !inside {
                    return Err(VerifyError::OutOfBounds {
                        stream: s,
                        index: i,
                        mnemonic: instr.mnemonic(),
                        kind: if a.kind == AccessKind::Read { "read" } else { "write" },
                        space: a.space.name(),
                        start: a.start,
                        len: a.len,
                    });
                }
            }
        }
    }
    Ok(())
}
