//! Instructions from any bytes, run on the model: the input is decoded as a
//! plain instruction sequence (a selector byte before each `signal`/`wait`
//! picks its stream; others go to an engine of their kind), so nearly every
//! input reaches the verifier and the model. A program that passes the
//! verifier (2 SAs, 2 VUs, 64 KiB SRAM, 1 MiB HBM, 64 KiB guest memory)
//! runs functionally within a cycle budget without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npu_model::{run_program, verify, BoardConfig, CoreMemory, LazyHbm, Sram, VecGuestMemory, VnpuLimits};
use vnpu_abi::{Engine, EngineKind, Instr, Program, ProgramBuilder};

fuzz_target!(|data: &[u8]| {
    let mut b = ProgramBuilder::new();
    let mut rest = data;
    let mut n = 0u8;
    while let Some((&sel, tail)) = rest.split_first() {
        let Ok((i, used)) = Instr::decode(tail) else { break };
        rest = &tail[used..];
        n = n.wrapping_add(1);
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
    let limits = VnpuLimits { sa: 2, vu: 2, sram_bytes: 64 << 10, hbm_bytes: 1 << 20, guest: vec![0x1000..0x11000] };
    if verify(&p, &limits).is_err() {
        return;
    }
    let board = BoardConfig::default();
    let mut sram = Sram::new(limits.sram_bytes);
    let mut hbm = LazyHbm::new(limits.hbm_bytes);
    let mut guest = VecGuestMemory::new(0x1000, 0x10000);
    let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
    let _ = run_program(&board, &p, Some(mem), Some(1 << 24));
});
