//! The hostile-guest suite (runs at CPL3, needs two vNPUs: the first is
//! attacked, the second is the honest tenant; the integration test places
//! both, and a second VM's digits demo, on one physical core). Each attack
//! must end in an error status or error state of the attacked vNPU only.
//! The honest vNPU classifies the 450 held-out digits with the MLP
//! *while* each attack runs (its request is in flight across the attack)
//! and every result is checked against the guest's CPU reference and the
//! labels, and must be bit-identical to its first run; its simulated time
//! must stay within its guaranteed share: the core's DMA engine is
//! shared by fair queuing among the `TENANTS` tenants on the core, so its
//! DMA time may grow up to `TENANTS` times and nothing else may grow
//! (its SAs and VUs are its own), within `SHARE_SLACK`. Prints one line
//! per attack and exits 0 when all are contained.
#![no_std]
#![no_main]

extern crate alloc;

use alloc::vec::Vec;

use guest_rt::vnpu_driver::{pci, Bar, DmaBuf, Error, MmioBar, RunOptions, Vnpu};
use guest_rt::{phys, println, Env};
use vnpu_abi::device::{self as abi, regs};
use vnpu_abi::{Addr, Engine, Instr, MatFlags, ProgramBuilder, UnOp};
use vnpu_guest_programs::digits::{self, layout};

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

static TEST_Y: &[u8] = include_bytes!("../../digits/fixtures/test_y.bin");

/// Tenants the integration test places on the core (attacked vNPU, honest
/// vNPU, the neighbour VM's vNPU): fair queuing gives each at least this
/// fraction of the core's DMA engine.
const TENANTS: f64 = 3.0;
/// Slack on the guaranteed-share bound (latencies that are not shared).
const SHARE_SLACK: f64 = 1.05;

struct Honest {
    npu: Vnpu<MmioBar>,
    /// Weight loading and inference programs.
    load: DmaBuf,
    prog: DmaBuf,
    /// Logits of the CPU reference, and the labels' count of correct answers.
    cpu: Vec<f32>,
    correct: usize,
    /// The first vNPU run's logits and simulated cycles (alone on the core).
    reference: Vec<u8>,
    cycles: u64,
    /// Most its time may grow beside the others: 1 + (TENANTS - 1) x the
    /// DMA engine's share of its time alone, times SHARE_SLACK.
    share_slowdown: f64,
    runs: usize,
    worst_slowdown: f64,
    in_flight: Option<guest_rt::vnpu_driver::Ticket>,
}

impl Honest {
    fn out() -> DmaBuf {
        phys(layout::BATCH_OUT, 4 * 450 * digits::CLASSES)
    }

    /// Submits the classification of the whole split; it runs while the
    /// next attack does.
    fn start(&mut self) {
        let out = Self::out();
        out.write(0, &alloc::vec![0xffu8; out.len]);
        self.in_flight = self.npu.submit(Some(&self.prog), &RunOptions::default()).ok();
    }

    /// Waits for the request in flight; its logits, simulated cycles and
    /// the cycles its DMA engine was active.
    fn finish(&mut self) -> Option<(Vec<u8>, u64, u64)> {
        let st = self.npu.wait(self.in_flight.take()?).ok()?;
        let out = Self::out();
        let mut b = alloc::vec![0u8; out.len];
        out.read(0, &mut b);
        self.runs += 1;
        Some((b, st.cycles, st.dma_active))
    }

    /// The CPU reference and the labels agree with `logits`: every logit
    /// within 1e-4 (relative), every prediction equal to the CPU's, and
    /// as many correct answers as the CPU has.
    fn correct(&self, logits: &[u8]) -> bool {
        let got = vnpu_guest_programs::f32s(logits);
        // Written so that NaN fails (`NaN > tol` would be false).
        let within = vnpu_guest_programs::max_rel_error(&got, &self.cpu) <= 1e-4;
        if !within {
            return false;
        }
        let c = digits::CLASSES;
        let mut right = 0;
        for (i, label) in TEST_Y.iter().enumerate() {
            let p = vnpu_guest_programs::argmax(&got[c * i..c * (i + 1)]);
            if p != vnpu_guest_programs::argmax(&self.cpu[c * i..c * (i + 1)]) {
                return false;
            }
            right += usize::from(p == usize::from(*label));
        }
        right == self.correct
    }

    /// Finishes the request that ran during the attack and checks it.
    fn undisturbed(&mut self) -> bool {
        let Some((b, c, _)) = self.finish() else { return false };
        let slowdown = c as f64 / self.cycles.max(1) as f64;
        if slowdown > self.worst_slowdown {
            self.worst_slowdown = slowdown;
        }
        let (correct, same, share) = (self.correct(&b), b == self.reference, slowdown <= self.share_slowdown);
        if !(correct && same && share) {
            println!(
                "honest tenant: correct {correct}, bit-identical {same}, {c} cycles = {slowdown:.3}x alone (bound {:.3})",
                self.share_slowdown
            );
        }
        correct && same && share
    }
}

struct Suite {
    n: usize,
    ok: usize,
}

impl Suite {
    /// Records attack `name`, which ran while the honest tenant's request
    /// was in flight, checks that request, and starts the next one (which
    /// the next attack then runs beside).
    fn check(&mut self, name: &str, contained: bool, honest: &mut Honest) {
        self.check_beside(name, contained, true, honest);
    }

    /// As `check`, when the honest tenant also ran requests during the
    /// attack (`during`: all of them undisturbed).
    fn check_beside(&mut self, name: &str, contained: bool, during: bool, honest: &mut Honest) {
        self.n += 1;
        let same = honest.undisturbed() && during;
        honest.start();
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
        phys(self.used + 2, 2).read_u16(0)
    }

    /// Posts `head`; returns true when the device completed it. The status
    /// block is poisoned first, so a check never reads the status an
    /// earlier request left.
    fn post(&mut self, head: u16) -> bool {
        phys(RAW + 0x3000, 64).write(0, &[0xee; 64]);
        phys(self.avail + 4 + 2 * u64::from(self.idx % 8), 2).write_u16(0, head);
        self.idx = self.idx.wrapping_add(1);
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        // Whole: the device must never read a half-written index.
        phys(self.avail + 2, 2).write_u16(0, self.idx);
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

    /// Used length of the last completed request.
    fn last_used_len(&self) -> u32 {
        phys(self.used + 4 + 8 * u64::from(self.idx.wrapping_sub(1) % 8) + 4, 4).read_u32(0)
    }

    /// Completed `head` with no status block: used length 0 and `ERROR`
    /// says so (on a ring whose `ERROR` was 0 before).
    fn no_status_block(&mut self, head: u16) -> bool {
        let fresh = self.bar.read32(regs::ERROR) == 0;
        fresh
            && self.post(head)
            && self.last_used_len() == 0
            && self.bar.read32(regs::ERROR) == abi::ERR_NO_STATUS_BLOCK
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
    let mut npu = match guest_rt::vnpu::open(env, victim_slot, 64) {
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
        // The CPU reference over the same images and weights.
        let (w, x) = (vnpu_guest_programs::f32s(MLP), vnpu_guest_programs::f32s(TEST_X));
        let mut cpu = Vec::with_capacity(450 * digits::CLASSES);
        let mut correct = 0;
        for (i, label) in TEST_Y.iter().enumerate() {
            let l = digits::mlp_cpu(&w, &x[digits::PIXELS * i..digits::PIXELS * (i + 1)]);
            correct += usize::from(vnpu_guest_programs::argmax(&l) == usize::from(*label));
            cpu.extend_from_slice(&l);
        }
        let mut h = Honest {
            npu: n,
            load,
            prog,
            cpu,
            correct,
            reference: Vec::new(),
            cycles: 0,
            share_slowdown: 1.0,
            runs: 0,
            worst_slowdown: 0.0,
            in_flight: None,
        };
        h.start();
        // Its DMA engine's active cycles alone come with its status block.
        let Some((r, c, dma_active)) = h.finish() else {
            println!("honest tenant failed");
            return 1;
        };
        h.share_slowdown = (1.0 + (TENANTS - 1.0) * dma_active as f64 / c.max(1) as f64) * SHARE_SLACK;
        if !h.correct(&r) {
            println!("honest tenant disagrees with its CPU reference before any attack");
            return 1;
        }
        println!(
            "honest tenant: vNPU = CPU on all 450 images, {}/450 correct by the labels, {c} simulated cycles alone ({dma_active} on its DMA engine; guaranteed-share bound {:.3}x)",
            h.correct,
            h.share_slowdown
        );
        h.reference = r;
        h.cycles = c;
        // In flight during the first attack.
        h.start();
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
    // Each check of ERROR below runs on a fresh ring (a reset clears it).
    let (mut r, _) = RawRing::enable(bar, 8, RAW);
    r.put(0, hdr, 32, 1, 1);
    r.put(1, hdr, 32, 1, 0);
    s.check("chain without a status block", r.no_status_block(0), &mut honest);
    let (mut r, _) = RawRing::enable(bar, 8, RAW);
    r.put(0, hdr, 32, 1, 1);
    r.put(1, hdr, 32, 1, 2);
    r.put(2, hdr, 32, 1, 1);
    s.check("descriptor loop", r.no_status_block(0), &mut honest);
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
    let (mut r, _) = RawRing::enable(bar, 8, RAW);
    r.put(0, table, 200 * 16, 4, 0);
    s.check("indirect chain longer than the ring", r.no_status_block(0), &mut honest);
    let (mut r, _) = RawRing::enable(bar, 8, RAW);
    r.put(0, hdr, 32, 1, 1);
    r.put(1, MEM_END + 64, 64, 2, 0);
    s.check("status block outside guest RAM", r.no_status_block(0), &mut honest);
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

    // Attacks that only make sense on a shared physical core: the honest
    // tenant's request is in flight on the same core throughout.
    let heavy = {
        let mut p = ProgramBuilder::new();
        for _ in 0..8 {
            p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 1 << 20, len: 1 << 18 });
        }
        p.finish().encode()
    };
    // A flood: a full ring of the attacker's requests. The honest tenant's
    // request from the previous attack is finished first; then, while the
    // flood is queued and running on the core, the honest tenant runs two
    // more requests, each checked (correct, bit-identical, within its
    // guaranteed share of the shared DMA engine); the check after the flood
    // covers a third, started as the flood drains.
    let flood = |npu: &mut Vnpu<MmioBar>,
                 env: &mut Env,
                 bytes: &[u8],
                 opts: RunOptions,
                 want: u32,
                 honest: &mut Honest|
     -> (bool, bool) {
        let before = honest.undisturbed();
        let Ok(p) = npu.load(&mut env.dma, bytes) else { return (false, before) };
        let mut tickets = Vec::new();
        while let Ok(t) = npu.submit(Some(&p), &opts) {
            tickets.push(t);
        }
        let mut during = before;
        for _ in 0..2 {
            honest.start();
            during &= honest.undisturbed();
        }
        honest.start();
        let n = tickets.len();
        let all = tickets.into_iter().all(|t| status(npu.wait(t)) == want);
        (n >= 8 && all, during)
    };
    let (ok, during) = flood(&mut npu, env, &heavy, d, abi::ST_OK, &mut honest);
    s.check_beside("a flood of maximal requests (a full ring, each 2M exps)", ok, during, &mut honest);
    let budget = RunOptions { max_cycles: 3000, ..d };
    let (ok, during) = flood(&mut npu, env, &heavy, budget, abi::ST_BUDGET_EXHAUSTED, &mut honest);
    s.check_beside("a flood of requests that each hit the cycle budget", ok, during, &mut honest);
    let hold = {
        let mut p = ProgramBuilder::new();
        for i in 0..48u64 {
            p.push(Engine::DMA, copy(Addr::guest(0x100_0000 + (i % 8) * 0x10_0000), Addr::sram(0), 1 << 20));
            p.push(Engine::DMA, copy(Addr::sram(0), Addr::hbm(i << 20), 1 << 20));
        }
        p.finish().encode()
    };
    let (ok, during) = flood(&mut npu, env, &hold, d, abi::ST_OK, &mut honest);
    s.check_beside("requests that hold the DMA engine (96 MiB each, a full ring)", ok, during, &mut honest);

    // The neighbour's memory after it releases its configuration: the
    // honest tenant writes a secret to its SRAM and HBM and releases; the
    // attacker reads the same offsets of its own; the honest tenant,
    // configured again, finds its old memory zeroed (a later tenant of
    // those bytes could not see them either) and reloads its weights.
    let undisturbed = honest.undisturbed();
    let secret = phys(0x3a3_0000, 4096);
    secret.write(0, &[0x5a; 4096]);
    let seen = phys(0x3a4_0000, 8192);
    let mut w = ProgramBuilder::new();
    w.push(Engine::DMA, copy(Addr::guest(secret.phys), Addr::sram(3 << 20), 4096));
    w.push(Engine::DMA, copy(Addr::guest(secret.phys), Addr::hbm(0), 4096));
    let mut r = ProgramBuilder::new();
    r.push(Engine::DMA, copy(Addr::sram(3 << 20), Addr::guest(seen.phys), 4096));
    r.push(Engine::DMA, copy(Addr::hbm(0), Addr::guest(seen.phys + 4096), 4096));
    let (w, r) = (w.finish().encode(), r.finish().encode());
    let read_back = |npu: &mut Vnpu<MmioBar>, env: &mut Env| -> Option<Vec<u8>> {
        seen.write(0, &[0xaa; 8192]);
        let p = npu.load(&mut env.dma, &r).ok()?;
        npu.run(&p, &d).ok()?;
        let mut b = alloc::vec![0u8; 8192];
        seen.read(0, &mut b);
        Some(b)
    };
    let shape = honest.npu.hierarchy();
    let wrote = honest.npu.load(&mut env.dma, &w).is_ok_and(|p| honest.npu.run(&p, &d).is_ok())
        && read_back(&mut honest.npu, env).is_some_and(|b| b.iter().all(|&x| x == 0x5a));
    let released = honest.npu.mailbox(abi::MBOX_RELEASE, &[]).is_ok();
    let attacker_sees = read_back(&mut npu, env);
    let reconfigured = honest.npu.configure(&shape).is_ok();
    let honest_sees = read_back(&mut honest.npu, env);
    let reloaded = honest.npu.run(&honest.load, &d).is_ok();
    let ok = undisturbed
        && wrote
        && released
        && reconfigured
        && reloaded
        && attacker_sees.is_some_and(|b| b.iter().all(|&x| x == 0))
        && honest_sees.is_some_and(|b| b.iter().all(|&x| x == 0));
    honest.start();
    s.check("read the neighbour's SRAM and HBM after it released them", ok, &mut honest);

    // The request that ran beside the last attack.
    if !honest.undisturbed() {
        println!("honest tenant DISTURBED after the last attack");
        return 1;
    }
    println!(
        "hostile: {}/{} attacks contained; honest tenant correct and bit-identical in all {} runs, at most {:.3}x its time alone (guaranteed-share bound {:.3}x)",
        s.ok, s.n, honest.runs, honest.worst_slowdown, honest.share_slowdown
    );
    u32::from(s.ok != s.n)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
