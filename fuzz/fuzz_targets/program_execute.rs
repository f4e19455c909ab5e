//! Instructions from any bytes, run differentially: the model's core
//! against the plain reference interpreter (`npu-difftest`). The first 8
//! bytes seed the memories (numbers in [-4, 4] with some NaNs, infinities
//! and zeros); the rest is decoded as a plain instruction sequence (a
//! selector byte before each `signal`/`wait` picks its stream; others go
//! to an engine of their kind), so nearly every input reaches the
//! verifier and the model. A program that passes the verifier (2 SAs, 2
//! VUs, 64 KiB SRAM, 64 KiB HBM, 16 KiB guest memory) either fails
//! cleanly where the reference says it may, or matches the reference
//! instruction by instruction; any mismatch is a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npu_model::{BoardConfig, VnpuLimits};
use npu_reference::Machine;
use vnpu_abi::{Engine, EngineKind, Instr, Program, ProgramBuilder};

const GUEST_BASE: u64 = 0x1000;

/// Memories filled from `seed` (xorshift64).
fn memories(seed: u64, limits: &VnpuLimits) -> Machine {
    let mut m = Machine::new(limits.sram_bytes as usize, limits.hbm_bytes as usize, &[(GUEST_BASE, 0x4000)]);
    let mut x = seed | 1;
    let mut fill = |v: &mut [u8]| {
        for c in v.chunks_exact_mut(4) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let f = match x % 64 {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => 0.0,
                // Small integers make gather indices.
                4..=7 => f32::from_bits((x >> 8) as u32 % 8),
                _ => ((x >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32,
            };
            c.copy_from_slice(&f.to_le_bytes());
        }
    };
    fill(&mut m.sram);
    fill(&mut m.hbm);
    fill(&mut m.guest[0].1);
    m
}

fuzz_target!(|data: &[u8]| {
    let Some((seed, mut rest)) = data.split_first_chunk::<8>() else { return };
    let mut b = ProgramBuilder::new();
    while let Some((&sel, tail)) = rest.split_first() {
        let Ok((i, used)) = Instr::decode(tail) else { break };
        rest = &tail[used..];
        let engine = match i.engine_kind() {
            Some(EngineKind::Dma) => Engine::DMA,
            Some(EngineKind::Sa) => Engine::sa(sel % 3),
            Some(EngineKind::Vu) => Engine::vu(sel % 3),
            None => match sel % 5 {
                0 => Engine::DMA,
                1 | 2 => Engine::sa(sel % 2),
                _ => Engine::vu(sel % 2),
            },
        };
        if !matches!(i, Instr::Halt) {
            b.push(engine, i);
        }
    }
    if b.is_empty() {
        return;
    }
    let p = b.finish();
    assert_eq!(Program::decode(&p.encode()).as_ref(), Ok(&p));
    let limits = VnpuLimits {
        sa: 2,
        vu: 2,
        sram_bytes: 64 << 10,
        hbm_bytes: 64 << 10,
        guest: vec![GUEST_BASE..GUEST_BASE + 0x4000],
        borrow_sa: 0,
        borrow_vu: 0,
    };
    let mut initial = memories(u64::from_le_bytes(*seed), &limits);
    // Larger instructions are skipped (with what ran before compared):
    // the element-by-element reference is slow under coverage tracing.
    initial.max_work = 1 << 16;
    if let Err(m) = npu_difftest::check(&BoardConfig::default(), &p, &limits, &initial, Some(1 << 24)) {
        panic!("model and reference disagree: {m}\n{p:#?}");
    }
});
