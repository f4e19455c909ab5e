//! The hostile-guest suite (runs at CPL3, needs two vNPUs: the first is
//! attacked, the second is the honest tenant). Each attack must end in an
//! error status or error state of the attacked vNPU only; after every
//! attack the honest vNPU recomputes the digits MLP batch and must produce
//! bit-identical logits in the same number of simulated cycles. Prints one
//! line per attack and exits 0 when all are contained.
#![no_std]
#![no_main]

extern crate alloc;

use alloc::vec::Vec;

use guest_rt::vnpu_driver::{pci, Bar, DmaBuf, Error, MmioBar, RunOptions, Vnpu};
use guest_rt::{phys, println, Env};
use vnpu_abi::device::{self as abi, regs};
use vnpu_abi::{Addr, Engine, Instr, MatFlags, ProgramBuilder, UnOp};
use vnpu_models::digits::{self, layout};

static TEST_X: &[u8] = include_bytes!("../../digits/fixtures/test_x.bin");
static MLP: &[u8] = include_bytes!("../../digits/fixtures/mlp.bin");

const MEM_END: u64 = 64 << 20;

fn copy(src: Addr, dst: Addr, bytes: u32) -> Instr {
    Instr::DmaCopy { src, dst, rows: 1, row_bytes: bytes, src_stride: 0, dst_stride: 0 }
}

fn one(engine: Engine, i: Instr) -> Vec<u8> {
    let mut p = ProgramBuilder::new();
    p.push(engine, i);
    p.finish().encode()
}

struct Honest {
    npu: Vnpu<MmioBar>,
    prog: DmaBuf,
    reference: Vec<u8>,
    cycles: u64,
    runs: usize,
}

impl Honest {
    fn run(&mut self) -> Option<(Vec<u8>, u64)> {
        let out = phys(layout::BATCH_OUT, 4 * 450 * digits::CLASSES);
        out.write(0, &alloc::vec![0u8; out.len]);
        let st = self.npu.run(&self.prog, &RunOptions::default()).ok()?;
        let mut b = alloc::vec![0u8; out.len];
        out.read(0, &mut b);
        self.runs += 1;
        Some((b, st.cycles))
    }

    fn unchanged(&mut self) -> bool {
        matches!(self.run(), Some((b, c)) if b == self.reference && c == self.cycles)
    }
}

struct Suite {
    n: usize,
    ok: usize,
}

impl Suite {
    fn check(&mut self, name: &str, contained: bool, honest: &mut Honest) {
        self.n += 1;
        let same = honest.unchanged();
        let good = contained && same;
        self.ok += usize::from(good);
        println!(
            "attack {:02} {name}: {}{}",
            self.n,
            if contained { "contained" } else { "NOT CONTAINED" },
            if same { "" } else { "; honest tenant DISTURBED" }
        );
    }
}

fn status(r: Result<impl Sized, Error>) -> u32 {
    match r {
        Ok(_) => abi::ST_OK,
        Err(Error::Request { status, .. }) => status,
        Err(Error::Mailbox { status, .. }) => status,
        Err(_) => u32::MAX,
    }
}

/// A ring driven by hand on the attacked vNPU (for ring-level attacks).
struct RawRing {
    bar: MmioBar,
    desc: u64,
    avail: u64,
    used: u64,
    idx: u16,
}

const RAW: u64 = 0x380_0000;

impl RawRing {
    fn reset(bar: &MmioBar) {
        bar.write32(regs::DEVICE_RESET, 1);
        while bar.read32(regs::STATUS) & abi::STATUS_RESETTING != 0 {}
    }

    fn enable(bar: MmioBar, size: u32, desc: u64) -> (Self, u32) {
        Self::reset(&bar);
        phys(RAW, 0x4000).write(0, &[0u8; 0x4000]);
        let r = Self { bar, desc, avail: RAW + 0x1000, used: RAW + 0x2000, idx: 0 };
        bar.write32(regs::QUEUE_SIZE, size);
        bar.write64(regs::QUEUE_DESC, desc);
        bar.write64(regs::QUEUE_AVAIL, r.avail);
        bar.write64(regs::QUEUE_USED, r.used);
        bar.write32(regs::QUEUE_ENABLE, 1);
        loop {
            let (s, e) = (bar.read32(regs::STATUS), bar.read32(regs::ERROR));
            if s & abi::STATUS_QUEUE_READY != 0 || e != 0 {
                return (r, e);
            }
        }
    }

    fn put(&self, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        phys(self.desc + 16 * i, 16).write(0, &d);
    }

    fn used_idx(&self) -> u16 {
        let mut b = [0u8; 2];
        phys(self.used + 2, 2).read(0, &mut b);
        u16::from_le_bytes(b)
    }

    /// Posts `head`; returns true when the device completed it.
    fn post(&mut self, head: u16) -> bool {
        phys(self.avail + 4 + 2 * u64::from(self.idx % 8), 2).write(0, &head.to_le_bytes());
        self.idx = self.idx.wrapping_add(1);
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        phys(self.avail + 2, 2).write(0, &self.idx.to_le_bytes());
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        self.bar.write32(regs::DOORBELL, 1);
        for _ in 0..200_000_000u64 {
            if self.used_idx() == self.idx {
                return true;
            }
            if self.bar.read32(regs::STATUS) & abi::STATUS_FAILED != 0 {
                return false;
            }
        }
        false
    }

    fn status(&self) -> u32 {
        let mut b = [0u8; 4];
        phys(RAW + 0x3000, 4).read(0, &mut b);
        u32::from_le_bytes(b)
    }
}

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let slots = guest_rt::vnpu::slots();
    if slots.len() < 2 {
        println!("hostile needs two vNPUs (attacked, honest)");
        return 1;
    }
    let (victim_slot, honest_slot) = (slots[0], slots[1]);
    let mut npu = match guest_rt::vnpu::open(env, victim_slot, 16) {
        Ok(n) => n,
        Err(e) => {
            println!("open: {e}");
            return 1;
        }
    };
    let hnpu = match guest_rt::vnpu::open(env, honest_slot, 16) {
        Ok(n) => n,
        Err(e) => {
            println!("open: {e}");
            return 1;
        }
    };
    // The honest tenant: the digits MLP over the whole test split.
    phys(layout::MLP_WEIGHTS, MLP.len()).write(0, MLP);
    phys(layout::TEST_X, TEST_X.len()).write(0, TEST_X);
    let mut honest = {
        let mut n = hnpu;
        let load = digits::load_weights(layout::MLP_SRAM, layout::MLP_WEIGHTS, MLP.len()).encode();
        let Ok(load) = n.load(&mut env.dma, &load) else { return 1 };
        if n.run(&load, &RunOptions::default()).is_err() {
            println!("honest tenant could not load its weights");
            return 1;
        }
        let p = digits::mlp_infer(layout::MLP_SRAM, 450, layout::TEST_X, layout::BATCH_OUT).encode();
        let Ok(prog) = n.load(&mut env.dma, &p) else { return 1 };
        let mut h = Honest { npu: n, prog, reference: Vec::new(), cycles: 0, runs: 0 };
        let Some((r, c)) = h.run() else {
            println!("honest tenant failed");
            return 1;
        };
        h.reference = r;
        h.cycles = c;
        h
    };
    let hier = npu.hierarchy();
    let (sram, hbm) = (hier.sram_per_core, hier.hbm_per_core);
    let mut s = Suite { n: 0, ok: 0 };
    let run = |npu: &mut Vnpu<MmioBar>, env: &mut Env, bytes: &[u8], opts: RunOptions| -> u32 {
        match npu.load(&mut env.dma, bytes) {
            Ok(p) => status(npu.run(&p, &opts)),
            Err(_) => u32::MAX,
        }
    };
    let d = RunOptions::default();
    let vf = abi::ST_VERIFY_FAILED;

    // Another tenant's SRAM: the honest vNPU holds the MLP weights at SRAM
    // 0; the same offsets of the attacker's SRAM hold only its own zeros.
    let peek = phys(0x3a0_0000, MLP.len());
    peek.write(0, &alloc::vec![0xaa; MLP.len()]);
    let st = run(
        &mut npu,
        env,
        &one(Engine::DMA, copy(Addr::sram(0), Addr::guest(peek.phys), MLP.len() as u32)),
        d,
    );
    let mut got = alloc::vec![0u8; MLP.len()];
    peek.read(0, &mut got);
    s.check(
        "read another tenant's SRAM at the same offsets",
        st == 0 && got.iter().all(|&b| b == 0),
        &mut honest,
    );
    let st = run(&mut npu, env, &one(Engine::DMA, copy(Addr::sram(sram), Addr::guest(peek.phys), 64)), d);
    s.check("read SRAM past the own segment", st == vf, &mut honest);
    let st = run(&mut npu, env, &one(Engine::DMA, copy(Addr::guest(0x1000), Addr::sram(sram - 8), 16)), d);
    s.check("write SRAM straddling the segment end", st == vf, &mut honest);
    let st = run(&mut npu, env, &one(Engine::DMA, copy(Addr::hbm(hbm), Addr::sram(0), 64)), d);
    s.check("read HBM past the own segment", st == vf, &mut honest);
    let st = run(&mut npu, env, &one(Engine::DMA, copy(Addr::sram(0), Addr::hbm(hbm - 32), 64)), d);
    s.check("write HBM straddling the segment end", st == vf, &mut honest);
    let st = run(&mut npu, env, &one(Engine::DMA, copy(Addr::guest(MEM_END - 16), Addr::sram(0), 64)), d);
    s.check("DMA from beyond guest RAM", st == vf, &mut honest);
    let st = run(&mut npu, env, &one(Engine::DMA, copy(Addr::sram(0), Addr::guest(0xfee0_0000), 4)), d);
    s.check("DMA into the local APIC's MMIO page", st == vf, &mut honest);
    let st = run(&mut npu, env, &one(Engine::DMA, copy(Addr::sram(0), Addr::guest(0xe000_0000), 64)), d);
    s.check("DMA into the ECAM window", st == vf, &mut honest);
    let wrap = Instr::DmaCopy {
        src: Addr::guest(0x1000),
        dst: Addr::sram(0),
        rows: 3,
        row_bytes: 8,
        src_stride: u64::MAX / 2,
        dst_stride: 8,
    };
    let st = run(&mut npu, env, &one(Engine::DMA, wrap), d);
    s.check("address arithmetic that wraps around 2^64", st == vf, &mut honest);
    let mm = Instr::MatMul {
        dtype: vnpu_abi::DType::F32,
        flags: MatFlags::default(),
        a: 0,
        b: 0,
        c: 0,
        m: 65536,
        k: 65536,
        n: 65536,
        lda: u32::MAX,
        ldb: u32::MAX,
        ldc: u32::MAX,
    };
    let st = run(&mut npu, env, &one(Engine::sa(0), mm), d);
    s.check("matmul whose operands span far past SRAM", st == vf, &mut honest);
    let st = run(&mut npu, env, &one(Engine::sa(hier.sa_per_core as u8), Instr::Halt), d);
    s.check("an SA the vNPU does not have", st == vf, &mut honest);
    let st = run(
        &mut npu,
        env,
        &one(
            Engine::vu(hier.vu_per_core as u8 + 3),
            Instr::VUnary { op: UnOp::Relu, src: 0, dst: 0, len: 4 },
        ),
        d,
    );
    s.check("a VU the vNPU does not have", st == vf, &mut honest);

    // Malformed encodings.
    let good = one(Engine::DMA, copy(Addr::guest(0x1000), Addr::sram(0), 16));
    let mut bad = good.clone();
    bad[0] = b'X';
    s.check("bad container magic", run(&mut npu, env, &bad, d) == abi::ST_BAD_PROGRAM, &mut honest);
    let mut bad = good.clone();
    // The container header is 16 bytes plus 8 per stream: code starts at 24.
    bad[24] = 0xee;
    s.check("unknown instruction opcode", run(&mut npu, env, &bad, d) == abi::ST_BAD_PROGRAM, &mut honest);
    let mut sem = ProgramBuilder::new();
    sem.push(Engine::DMA, Instr::Signal { sem: 5 });
    let mut bad = sem.finish().encode();
    if let Some(p) = bad.iter().rposition(|&b| b == 5) {
        bad[p] = 200;
    }
    s.check("semaphore id 200 (of 64)", run(&mut npu, env, &bad, d) == abi::ST_BAD_PROGRAM, &mut honest);
    s.check(
        "truncated program",
        run(&mut npu, env, &good[..good.len() - 3], d) == abi::ST_BAD_PROGRAM,
        &mut honest,
    );
    let mut bad = good.clone();
    bad.extend_from_slice(&[0u8; 7]);
    s.check("trailing bytes after the code", run(&mut npu, env, &bad, d) == abi::ST_BAD_PROGRAM, &mut honest);

    // Liveness.
    let mut dl = ProgramBuilder::new();
    dl.push(Engine::DMA, Instr::Wait { sem: 9 });
    s.check(
        "a semaphore wait that never completes",
        run(&mut npu, env, &dl.finish().encode(), d) == abi::ST_EXEC_FAULT,
        &mut honest,
    );
    let mut long = ProgramBuilder::new();
    for _ in 0..2000 {
        long.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len: 1 << 18 });
    }
    let st = run(&mut npu, env, &long.finish().encode(), RunOptions { max_cycles: 100_000, ..d });
    s.check("a program that runs past its cycle budget", st == abi::ST_BUDGET_EXHAUSTED, &mut honest);
    let st = run(&mut npu, env, &good, RunOptions { core: 7, ..d });
    s.check("a core the vNPU does not have", st == abi::ST_BAD_CORE, &mut honest);

    // Registered programs.
    let st = status(npu.run_registered(guest_rt::vnpu_driver::ProgramHandle(41), &d));
    s.check("run a program handle never registered", st == abi::ST_BAD_HANDLE, &mut honest);
    let src = phys(0x3a1_0000, 16);
    src.write(0, b"verified program");
    let dst = phys(0x3a2_0000, 16);
    dst.write(0, &[0u8; 16]);
    let mut cp = ProgramBuilder::new();
    cp.push(Engine::DMA, copy(Addr::guest(src.phys), Addr::sram(0), 16));
    cp.push(Engine::DMA, copy(Addr::sram(0), Addr::guest(dst.phys), 16));
    let cp = cp.finish().encode();
    let contained = match npu.load(&mut env.dma, &cp) {
        Ok(buf) => match npu.register(&buf) {
            Ok(h) => {
                // Swap in a program the verifier would refuse, same length.
                let mut evil = ProgramBuilder::new();
                evil.push(Engine::DMA, copy(Addr::guest(src.phys), Addr::sram(0), 16));
                evil.push(Engine::DMA, copy(Addr::sram(0), Addr::guest(0xfee0_0000), 16));
                buf.write(0, &evil.finish().encode());
                let ran = npu.run_registered(h, &d).is_ok();
                let mut out = [0u8; 16];
                dst.read(0, &mut out);
                let _ = npu.unregister(h);
                ran && &out == b"verified program"
            }
            Err(_) => false,
        },
        Err(_) => false,
    };
    s.check("change a program after it was verified", contained, &mut honest);

    // Mailbox and registers.
    let st = status(npu.mailbox(abi::MBOX_CONFIGURE, &[64, 64, 1 << 30, 1 << 40, 64, 64]));
    s.check(
        "configure beyond the host's grant",
        st == abi::ST_EXCEEDS_GRANT && npu.hierarchy().sram_per_core == sram,
        &mut honest,
    );
    let st = status(npu.mailbox(abi::MBOX_READ_COUNTERS, &[0xfee0_0000, 4096]));
    s.check("counters written into MMIO space", st == abi::ST_BAD_ADDRESS, &mut honest);
    let st = status(npu.mailbox(0xdead, &[]));
    s.check("unknown mailbox command", st == abi::ST_UNKNOWN_OPCODE, &mut honest);
    let bar = *npu.bar();
    bar.write32(regs::SA_PER_CORE, 60);
    bar.write64(regs::SRAM_PER_CORE, 1 << 40);
    bar.write32(regs::INT_TEST, 5000);
    s.check(
        "writes to read-only registers, nonexistent vector",
        bar.read32(regs::SA_PER_CORE) == hier.sa_per_core && bar.read64(regs::SRAM_PER_CORE) == sram,
        &mut honest,
    );
    for _ in 0..20_000 {
        bar.write32(regs::DOORBELL, 1);
    }
    s.check("a flood of 20000 doorbells", npu.nop(guest_rt::vnpu_driver::Wait::Poll).is_ok(), &mut honest);
    // MSI-X vector 0 pointed at a bogus address: completions still land.
    let e = guest_rt::vnpu::ecam();
    // SAFETY: BAR 2 of the attacked vNPU, placed there by `open`.
    let table = unsafe {
        MmioBar::new((0xc000_0000u64 + u64::from(victim_slot) * 0x1_0000 + 0x8000) as *mut u8, abi::BAR2_SIZE)
    };
    pci::enable_msix(&e, victim_slot, &table, 0, 0x1234_5678, 0x30);
    let ok = run(&mut npu, env, &good, RunOptions { wait: guest_rt::vnpu_driver::Wait::Poll, ..d }) == 0;
    let t = npu.submit(None, &RunOptions { wait: guest_rt::vnpu_driver::Wait::Poll, ..d });
    let ok = ok && t.is_ok_and(|t| npu.wait(t).is_ok());
    pci::enable_msix(&e, victim_slot, &table, 0, 0xfee0_0000, 0x30);
    s.check("MSI-X entry with a bogus address", ok, &mut honest);

    // BAR 0 moved over guest RAM: RAM wins, the device is not reachable
    // there and nothing else changes; moved back, it works again.
    let bar0 = 0xc000_0000u64 + u64::from(victim_slot) * 0x1_0000;
    let over = 0x3c0_0000u64;
    phys(over, 8).write(0, b"RAM!RAM!");
    pci::set_bar(&e, victim_slot, 0, over);
    let mut m = [0u8; 4];
    phys(over, 4).read(0, &mut m);
    let shadowed = &m == b"RAM!";
    phys(over + regs::DOORBELL, 4).write(0, &[1, 0, 0, 0]);
    pci::set_bar(&e, victim_slot, 0, bar0);
    s.check(
        "BAR 0 relocated over guest RAM",
        shadowed && npu.nop(guest_rt::vnpu_driver::Wait::Poll).is_ok(),
        &mut honest,
    );

    // Ring-level attacks through a ring driven by hand.
    let (_, e1) = RawRing::enable(bar, 8, MEM_END + 0x1000);
    s.check("ring placed outside guest RAM", e1 == abi::ERR_QUEUE_INVALID, &mut honest);
    let (_, e2) = RawRing::enable(bar, 12, RAW);
    s.check("ring size not a power of two", e2 == abi::ERR_QUEUE_INVALID, &mut honest);
    let (mut r, _) = RawRing::enable(bar, 8, RAW);
    let hdr = RAW + 0x3800;
    phys(hdr, 32).write(0, &abi::RequestHeader { opcode: 99, ..Default::default() }.to_bytes());
    r.put(0, hdr, 32, 1, 1);
    r.put(1, RAW + 0x3000, 64, 2, 0);
    s.check("unknown request opcode", r.post(0) && r.status() == abi::ST_UNKNOWN_OPCODE, &mut honest);
    r.put(0, MEM_END + 4096, 32, 1, 1);
    s.check(
        "header descriptor outside guest RAM",
        r.post(0) && r.status() == abi::ST_BAD_REQUEST,
        &mut honest,
    );
    phys(hdr, 32).write(0, &abi::RequestHeader { opcode: abi::OP_RUN, ..Default::default() }.to_bytes());
    r.put(0, hdr, 32, 1, 1);
    r.put(1, MEM_END - 8, 4096, 1, 2);
    r.put(2, RAW + 0x3000, 64, 2, 0);
    s.check(
        "program descriptor outside guest RAM",
        r.post(0) && r.status() == abi::ST_BAD_REQUEST,
        &mut honest,
    );
    r.put(1, RAW, 1 << 30, 1, 2);
    s.check("program of 1 GiB", r.post(0) && r.status() == abi::ST_TOO_LARGE, &mut honest);
    r.put(0, hdr, 32, 1, 1);
    r.put(1, hdr, 32, 1, 0);
    let loops = r.post(0) && bar.read32(regs::ERROR) == abi::ERR_NO_STATUS_BLOCK;
    s.check("chain without a status block", loops, &mut honest);
    r.put(1, hdr, 32, 1, 2);
    r.put(2, hdr, 32, 1, 1);
    s.check("descriptor loop", r.post(0), &mut honest);
    // An indirect table of 200 chained descriptors in a ring of 8.
    let table = RAW + 0x2800;
    for i in 0..200u64 {
        let mut dsc = [0u8; 16];
        dsc[0..8].copy_from_slice(&hdr.to_le_bytes());
        dsc[8..12].copy_from_slice(&32u32.to_le_bytes());
        dsc[12..14].copy_from_slice(&1u16.to_le_bytes());
        dsc[14..16].copy_from_slice(&((i + 1) as u16).to_le_bytes());
        phys(table + 16 * i, 16).write(0, &dsc);
    }
    r.put(0, table, 200 * 16, 4, 0);
    s.check("indirect chain longer than the ring", r.post(0), &mut honest);
    r.put(0, hdr, 32, 1, 1);
    r.put(1, MEM_END + 64, 64, 2, 0);
    s.check(
        "status block outside guest RAM",
        r.post(0) && bar.read32(regs::ERROR) == abi::ERR_NO_STATUS_BLOCK,
        &mut honest,
    );
    let failed = !r.post(200) && bar.read32(regs::ERROR) == abi::ERR_QUEUE_BROKEN;
    s.check("head index beyond the ring", failed, &mut honest);
    let (mut r, _) = RawRing::enable(bar, 8, RAW);
    r.idx = 40;
    let failed = !r.post(0) && bar.read32(regs::STATUS) & abi::STATUS_FAILED != 0;
    s.check("available index far ahead of the device", failed, &mut honest);

    // The attacked vNPU recovers with a reset.
    RawRing::reset(&bar);
    let back = npu.recover().is_ok() && run(&mut npu, env, &good, d) == 0;
    s.check("recovery of the attacked vNPU by reset", back, &mut honest);

    println!(
        "hostile: {}/{} attacks contained; honest tenant bit-identical in all {} runs",
        s.ok, s.n, honest.runs
    );
    u32::from(s.ok != s.n)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
