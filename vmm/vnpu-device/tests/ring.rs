//! The command ring end to end on the host: the guest driver crate
//! (`vnpu-driver`) talks to a `VnpuFunction` through a fake BAR over real
//! guest memory, while the device's worker thread serves the ring. Also
//! hostile rings written by hand.

#![allow(clippy::unwrap_used)] // test helpers

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use npu_model::BoardConfig;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vnpu_abi::device::{self as abi, regs};
use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder, UnOp};
use vnpu_device::{DeviceOptions, MsiSink, VnpuFunction};
use vnpu_driver::{DmaRegion, Error, Hierarchy, RunOptions, Vnpu, Wait};
use vnpu_pci::{MsiMessage, PciFunction};
use vnpu_spec::VnpuSpec;

const MEM: u64 = 4 << 20;
const DMA_BASE: u64 = 1 << 20;

/// Counts delivered MSIs in a counter a "guest handler" would bump.
struct CountingSink(&'static AtomicU32);

impl MsiSink for CountingSink {
    fn deliver(&self, _m: MsiMessage) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// BAR 0 of a function, as the driver sees it.
struct FnBar<'a>(&'a RefCell<VnpuFunction>);

impl vnpu_driver::Bar for FnBar<'_> {
    fn read32(&self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.0.borrow_mut().bar_read(0, offset, &mut b);
        u32::from_le_bytes(b)
    }
    fn write32(&self, offset: u64, value: u32) {
        self.0.borrow_mut().bar_write(0, offset, &value.to_le_bytes());
    }
}

struct Setup {
    mem: GuestMemoryMmap<()>,
    f: RefCell<VnpuFunction>,
    irqs: &'static AtomicU32,
}

/// One core of 1 SA + 1 VU, 2 MiB SRAM, 256 MiB HBM: a configuration
/// inside every grant these tests use.
fn one_core_hierarchy() -> Hierarchy {
    Hierarchy {
        sa_per_core: 1,
        vu_per_core: 1,
        sram_per_core: 2 << 20,
        hbm_per_core: 256 << 20,
        cores_per_chip: 1,
        chips: 1,
        ..Default::default()
    }
}

fn setup(spec: &str) -> Setup {
    setup_with(spec, DeviceOptions::default())
}

fn setup_with(spec: &str, opts: DeviceOptions) -> Setup {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    let irqs: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
    let f = VnpuFunction::new(
        &VnpuSpec::parse(spec).unwrap(),
        &BoardConfig::default(),
        mem.clone(),
        Arc::new(CountingSink(irqs)),
        "ring-test",
        opts,
    )
    .unwrap();
    Setup { mem, f: RefCell::new(f), irqs }
}

impl Setup {
    fn dma(&self) -> DmaRegion {
        let host = self.mem.get_host_address(GuestAddress(DMA_BASE)).unwrap();
        // SAFETY: guest RAM from DMA_BASE to the end is this test's, and the
        // device sees it at DMA_BASE.
        unsafe { DmaRegion::new(host, DMA_BASE, (MEM - DMA_BASE) as usize) }
    }

    /// Enables MSI-X with vector 0 unmasked.
    fn enable_msix(&self) {
        let mut f = self.f.borrow_mut();
        f.bar_write(2, 0, &0xfee0_0000u32.to_le_bytes());
        f.bar_write(2, 8, &0x30u32.to_le_bytes());
        f.bar_write(2, 12, &0u32.to_le_bytes());
        let cap = f.msix().offset;
        f.config_mut().write(cap + 2, &0x8000u16.to_le_bytes());
        f.config_written(cap + 2, 2);
    }
}

/// Program: 4 floats guest 0x1000 -> SRAM 0, ReLU on VU 0 to SRAM 64, -> guest 0x2000.
fn relu_program() -> Vec<u8> {
    let mut p = ProgramBuilder::new();
    let dma = |src, dst| Instr::DmaCopy { src, dst, rows: 1, row_bytes: 16, src_stride: 0, dst_stride: 0 };
    p.push(Engine::DMA, dma(Addr::guest(0x1000), Addr::sram(0)));
    p.sync(Engine::DMA, Engine::vu(0), 0);
    p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Relu, src: 0, dst: 64, len: 4 });
    p.sync(Engine::vu(0), Engine::DMA, 1);
    p.push(Engine::DMA, dma(Addr::sram(64), Addr::guest(0x2000)));
    p.finish().encode()
}

#[test]
fn driver_runs_programs_by_polling_and_by_interrupt() {
    for poll in [0, 200] {
        driver_round_trips(DeviceOptions {
            poll: std::time::Duration::from_micros(poll),
            ..Default::default()
        });
    }
}

/// On a shared physical core a request's budget is capped, so one
/// tenant's long request cannot hold its neighbours' batch: the same
/// program that runs on a core of its own fails there with the budget
/// status when the cap is below its cycles.
#[test]
fn shared_cores_cap_the_request_budget() {
    let board = BoardConfig::default();
    let run = |cap: Option<u64>| {
        let core = vnpu_device::SharedCore::new(&board, "cap-test").unwrap();
        let opts = DeviceOptions {
            cores: vec![core.clone()],
            shared_max_cycles: cap.unwrap_or(vnpu_device::SHARED_MAX_BUDGET),
            ..Default::default()
        };
        let s = setup_with("sa=1,vu=1,sram=4M,hbm=256M", opts);
        let mut dma = s.dma();
        let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 64).unwrap();
        let ok = npu.load(&mut dma, &relu_program()).unwrap();
        let r = npu.run(&ok, &RunOptions::default());
        core.stop();
        r
    };
    assert!(run(None).is_ok());
    let e = run(Some(3)).unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_BUDGET_EXHAUSTED, .. }), "{e}");
}

/// On a shared core a request also has a host-work budget: a verified
/// request whose functional work passes it fails with the budget status
/// and says why, before the host does that work; within it, it runs; and
/// the default budget admits the guests' real requests (the hostile and
/// digits guests run on shared cores in `tests/tests/boot.rs`).
#[test]
fn shared_cores_bound_the_host_work_of_a_request() {
    let board = BoardConfig::default();
    // Four exp passes over 2^18 elements: 4 x 2^18 x 8 units.
    let mut p = vnpu_abi::ProgramBuilder::new();
    for _ in 0..4 {
        p.push(
            vnpu_abi::Engine::vu(0),
            vnpu_abi::Instr::VUnary { op: vnpu_abi::UnOp::Exp, src: 0, dst: 1 << 20, len: 1 << 18 },
        );
    }
    let heavy = p.finish().encode();
    let units = 4 * (1u64 << 18) * npu_model::timing::TRANSCENDENTAL_UNITS;
    let run = |cap: u64| {
        let core = vnpu_device::SharedCore::new(&board, "host-work-test").unwrap();
        let opts =
            DeviceOptions { cores: vec![core.clone()], shared_max_host_work: cap, ..Default::default() };
        let s = setup_with("sa=1,vu=1,sram=4M,hbm=256M", opts);
        let mut dma = s.dma();
        let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 64).unwrap();
        let prog = npu.load(&mut dma, &heavy).unwrap();
        let t = npu.submit(Some(&prog), &RunOptions::default()).unwrap();
        let r = npu.wait(t);
        let mut msg = [0u8; 256];
        let n = npu.message(t, &mut msg);
        core.stop();
        (r, String::from_utf8_lossy(&msg[..n]).to_string())
    };
    assert!(run(units).0.is_ok());
    assert!(run(vnpu_device::SHARED_MAX_HOST_WORK).0.is_ok());
    let (r, msg) = run(units - 1);
    let e = r.unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_BUDGET_EXHAUSTED, .. }), "{e}");
    assert!(msg.contains(&format!("host-work budget of {} units", units - 1)), "{msg}");
}

fn driver_round_trips(opts: DeviceOptions) {
    let s = setup_with("sa=1,vu=1,sram=4M,hbm=256M", opts);
    s.enable_msix();
    let mut dma = s.dma();
    let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 64).unwrap();
    let h = npu.hierarchy();
    assert_eq!((h.sa_per_core, h.vu_per_core, h.sram_per_core), (1, 1, 4 << 20));

    // Empty requests, polled: no interrupt.
    for _ in 0..300 {
        npu.nop(Wait::Poll).unwrap();
    }
    assert_eq!(s.irqs.load(Ordering::Acquire), 0);

    let input: Vec<u8> = [-1.0f32, 2.0, -3.5, 4.25].iter().flat_map(|x| x.to_le_bytes()).collect();
    s.mem.write_slice(&input, GuestAddress(0x1000)).unwrap();
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    let st = npu.run(&prog, &RunOptions::default()).unwrap();
    assert!(st.cycles > 0 && st.vu_active > 0 && st.dma_active > 0, "{st:?}");
    let mut out = [0u8; 16];
    s.mem.read_slice(&mut out, GuestAddress(0x2000)).unwrap();
    let out: Vec<f32> = out.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(out, [0.0, 2.0, 0.0, 4.25]);

    // By interrupt: the completion raises vector 0 once per request.
    npu.use_interrupts(0, s.irqs);
    for _ in 0..20 {
        npu.run(&prog, &RunOptions { wait: Wait::Interrupt, ..Default::default() }).unwrap();
    }
    // The device publishes a completion and then raises its interrupt, and
    // the driver returns as soon as it sees the completion: the last
    // request's interrupt may still be on its way (CI saw 19 of 20 on a
    // loaded machine). Wait for it, boundedly, then check that no more come.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while s.irqs.load(Ordering::Acquire) < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(s.irqs.load(Ordering::Acquire), 20);
    let mut isr = [0u8; 4];
    s.f.borrow_mut().bar_read(0, regs::INT_STATUS, &mut isr);
    assert_eq!(u32::from_le_bytes(isr) & abi::INT_QUEUE, abi::INT_QUEUE);

    // Several requests in flight at once complete in any order the driver asks.
    let tickets: Vec<_> = (0..8).map(|_| npu.submit(Some(&prog), &RunOptions::default()).unwrap()).collect();
    for t in tickets.into_iter().rev() {
        npu.wait(t).unwrap();
    }
}

/// Guest memory the host says was lost while a request ran (the board
/// daemon replaced a client's mapping after a SIGBUS: a hole punched in
/// its own RAM) fails that request with `ST_EXEC_FAULT`; requests run
/// again once the memory is set anew and whole.
#[test]
fn a_request_over_lost_guest_memory_fails() {
    let s = setup("sa=1,vu=1,sram=2M,hbm=256M");
    let mut dma = s.dma();
    let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 16).unwrap();
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    npu.run(&prog, &RunOptions::default()).unwrap();
    let lost: &'static std::sync::atomic::AtomicBool =
        Box::leak(Box::new(std::sync::atomic::AtomicBool::new(true)));
    s.f.borrow()
        .set_memory_watched(s.mem.clone(), vnpu_device::MemoryWatch::new(|| lost.load(Ordering::Acquire)));
    let e = npu.run(&prog, &RunOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_EXEC_FAULT, .. }), "{e}");
    lost.store(false, Ordering::Release);
    npu.run(&prog, &RunOptions::default()).unwrap();
}

#[test]
fn bad_programs_fail_their_request_and_the_ring_carries_on() {
    let s = setup("sa=1,vu=1,sram=2M,hbm=256M");
    let mut dma = s.dma();
    let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 16).unwrap();

    // Undecodable bytes.
    let junk = npu.load(&mut dma, b"not a program").unwrap();
    let e = npu.run(&junk, &RunOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_BAD_PROGRAM, .. }), "{e}");

    // SRAM access past the vNPU's 2 MiB: refused by the verifier, naming
    // stream 0 (DMA) instruction 0, with a message.
    let mut p = ProgramBuilder::new();
    let i = Instr::DmaCopy {
        src: Addr::guest(0x1000),
        dst: Addr::sram((2 << 20) - 8),
        rows: 1,
        row_bytes: 16,
        src_stride: 0,
        dst_stride: 0,
    };
    p.push(Engine::DMA, i);
    let oob = npu.load(&mut dma, &p.finish().encode()).unwrap();
    let t = npu.submit(Some(&oob), &RunOptions::default()).unwrap();
    let e = npu.wait(t).unwrap_err();
    assert_eq!(e, Error::Request { status: abi::ST_VERIFY_FAILED, detail: 0 });
    let mut msg = [0u8; 256];
    let n = npu.message(t, &mut msg);
    let msg = std::str::from_utf8(&msg[..n]).unwrap();
    assert!(msg.contains("outside the vNPU's sram segment"), "{msg}");

    // DMA from guest memory that does not exist: refused too.
    let mut p = ProgramBuilder::new();
    let i = Instr::DmaCopy {
        src: Addr::guest(MEM - 8),
        dst: Addr::sram(0),
        rows: 1,
        row_bytes: 16,
        src_stride: 0,
        dst_stride: 0,
    };
    p.push(Engine::DMA, i);
    let g = npu.load(&mut dma, &p.finish().encode()).unwrap();
    assert!(matches!(
        npu.run(&g, &RunOptions::default()),
        Err(Error::Request { status: abi::ST_VERIFY_FAILED, .. })
    ));

    // A VU the vNPU does not have, a core it does not have, a budget too small.
    let mut p = ProgramBuilder::new();
    p.push(Engine::vu(1), Instr::VUnary { op: UnOp::Relu, src: 0, dst: 64, len: 4 });
    let vu1 = npu.load(&mut dma, &p.finish().encode()).unwrap();
    assert!(matches!(
        npu.run(&vu1, &RunOptions::default()),
        Err(Error::Request { status: abi::ST_VERIFY_FAILED, .. })
    ));
    let ok = npu.load(&mut dma, &relu_program()).unwrap();
    let e = npu.run(&ok, &RunOptions { core: 1, ..Default::default() }).unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_BAD_CORE, .. }));
    let e = npu.run(&ok, &RunOptions { max_cycles: 3, ..Default::default() }).unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_BUDGET_EXHAUSTED, .. }));

    // And the ring still works.
    npu.run(&ok, &RunOptions::default()).unwrap();
}

#[test]
fn mailbox_configures_within_the_grant_and_reads_counters() {
    let s = setup("sa=2,vu=2,sram=8M,hbm=1G,cores=2");
    let mut dma = s.dma();
    let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 16).unwrap();
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    npu.run(&prog, &RunOptions { core: 1, ..Default::default() }).unwrap();

    let counters = dma.alloc(4096, 8).unwrap();
    let n = npu.read_counters(&counters).unwrap();
    // 2 cores x (2 SA + 2 VU + 1 DMA) records.
    assert_eq!(n, abi::COUNTERS_HEADER_BYTES + 10 * abi::COUNTERS_ENGINE_BYTES);
    let mut b = vec![0u8; n];
    counters.read(0, &mut b);
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 10);
    assert_eq!(u64_at(8), 1, "requests");
    assert!(u64_at(24) > 0, "cycles");
    // Core 1's VU 0 (record 5 + 2) was active; core 0's was not.
    let rec = |i: usize| abi::COUNTERS_HEADER_BYTES + i * abi::COUNTERS_ENGINE_BYTES;
    assert_eq!((b[rec(7)], u32::from_le_bytes(b[rec(7) + 4..rec(7) + 8].try_into().unwrap())), (2, 1));
    assert!(u64_at(rec(7) + 8) > 0);
    assert_eq!(u64_at(rec(2) + 8), 0);

    // Shrink: fine. Grow past the grant: refused, configuration unchanged.
    let small = one_core_hierarchy();
    npu.configure(&small).unwrap();
    assert_eq!(npu.hierarchy().sram_per_core, 2 << 20);
    let big = Hierarchy { sa_per_core: 3, ..small };
    assert_eq!(
        npu.configure(&big),
        Err(Error::Mailbox { cmd: abi::MBOX_CONFIGURE, status: abi::ST_EXCEEDS_GRANT })
    );
    let odd = Hierarchy { sram_per_core: 3 << 20, ..small };
    assert_eq!(
        npu.configure(&odd),
        Err(Error::Mailbox { cmd: abi::MBOX_CONFIGURE, status: abi::ST_BAD_ARGUMENT })
    );
    assert_eq!(npu.hierarchy().sa_per_core, 1);
    let e = npu.run(&prog, &RunOptions { core: 1, ..Default::default() }).unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_BAD_CORE, .. }));

    // Release: requests fail until configured again.
    npu.mailbox(abi::MBOX_RELEASE, &[]).unwrap();
    assert_eq!(npu.hierarchy().sa_per_core, 0);
    let e = npu.run(&prog, &RunOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Request { status: abi::ST_NOT_CONFIGURED, .. }));
    npu.configure(&small).unwrap();
    npu.run(&prog, &RunOptions::default()).unwrap();
    assert_eq!(npu.mailbox(abi::MBOX_QUERY_GRANT, &[]).unwrap(), 2 | 2 << 16 | 2 << 32 | 1 << 48);
    assert!(matches!(npu.mailbox(99, &[]), Err(Error::Mailbox { cmd: 99, status: abi::ST_UNKNOWN_OPCODE })));
    // A counter buffer outside guest memory.
    let e = npu.mailbox(abi::MBOX_READ_COUNTERS, &[MEM - 8, 4096]).unwrap_err();
    assert!(matches!(e, Error::Mailbox { status: abi::ST_BAD_ADDRESS, .. }));
}

/// A live remap: the host grows the grant (the configuration stays, the
/// guest may grow into it), then shrinks it below the configuration (the
/// vNPU is reconfigured to the new grant); the guest is told each time.
#[test]
fn the_host_changes_the_grant_of_a_running_vnpu() {
    let s = setup("sa=2,vu=2,sram=8M,hbm=1G");
    let mut dma = s.dma();
    let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 16).unwrap();
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    npu.run(&prog, &RunOptions::default()).unwrap();
    assert!(!npu.grant_changed());
    let handle = s.f.borrow().grant_handle();
    handle.regrant(VnpuSpec::parse("sa=4,vu=2,sram=8M,hbm=1G").unwrap());
    wait_for(|| reg(&s, regs::INT_STATUS) & abi::INT_GRANT != 0);
    assert!(npu.grant_changed() && !npu.grant_changed());
    assert_eq!(npu.grant().unwrap(), (4, 2, 1, 1));
    // Still configured as before: the same program runs.
    assert_eq!(npu.hierarchy().sa_per_core, 2);
    npu.run(&prog, &RunOptions::default()).unwrap();
    let grown = Hierarchy { sa_per_core: 4, ..npu.hierarchy() };
    npu.configure(&grown).unwrap();
    assert_eq!(npu.hierarchy().sa_per_core, 4);
    // Shrink below the configuration: the vNPU now has the new grant.
    handle.regrant(VnpuSpec::parse("sa=1,vu=1,sram=4M,hbm=1G").unwrap());
    wait_for(|| reg(&s, regs::INT_STATUS) & abi::INT_GRANT != 0);
    assert!(npu.grant_changed());
    let h = npu.hierarchy();
    assert_eq!((h.sa_per_core, h.vu_per_core, h.sram_per_core), (1, 1, 4 << 20));
    assert_eq!(
        npu.configure(&grown),
        Err(Error::Mailbox { cmd: abi::MBOX_CONFIGURE, status: abi::ST_EXCEEDS_GRANT })
    );
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    npu.run(&prog, &RunOptions::default()).unwrap();
}

/// BAR 0 of a function whose server may go away: from then on reads are
/// all ones and writes are dropped, as a VMM makes them when its
/// vfio-user server hangs up.
struct GoneBar<'a>(FnBar<'a>, &'a std::cell::Cell<bool>);

impl vnpu_driver::Bar for GoneBar<'_> {
    fn read32(&self, offset: u64) -> u32 {
        if self.1.get() {
            return u32::MAX;
        }
        self.0.read32(offset)
    }
    fn write32(&self, offset: u64, value: u32) {
        if !self.1.get() {
            self.0.write32(offset, value);
        }
    }
}

/// A device that is gone reads MBOX_STATUS as all ones, which is also
/// "busy": the mailbox reports the device failed instead of spinning
/// until its timeout (2^36 polls: for ever, to a guest).
#[test]
fn a_mailbox_command_to_a_device_that_went_away_fails_at_once() {
    let s = setup("sa=2,vu=2,sram=8M,hbm=1G");
    let gone = std::cell::Cell::new(false);
    let mut dma = s.dma();
    let mut npu = Vnpu::new(GoneBar(FnBar(&s.f), &gone), &mut dma, 16).unwrap();
    assert_eq!(npu.mailbox(abi::MBOX_RESET_COUNTERS, &[]), Ok(0));
    gone.set(true);
    let t = std::time::Instant::now();
    assert_eq!(npu.mailbox(abi::MBOX_RESET_COUNTERS, &[]), Err(Error::DeviceFailed(u32::MAX)));
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "{:?}", t.elapsed());
    // And so does every request from now on.
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    assert_eq!(npu.run(&prog, &RunOptions::default()).map(|_| ()), Err(Error::DeviceFailed(u32::MAX)));
}

fn reg(s: &Setup, off: u64) -> u32 {
    let mut b = [0u8; 4];
    s.f.borrow_mut().bar_read(0, off, &mut b);
    u32::from_le_bytes(b)
}

fn write_reg(s: &Setup, off: u64, v: u64) {
    s.f.borrow_mut().bar_write(0, off, &v.to_le_bytes());
}

fn wait_for(mut cond: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(t0.elapsed().as_secs() < 10, "device did not answer");
        std::thread::yield_now();
    }
}

/// A ring set up by hand at 0x10000 (desc), 0x11000 (avail), 0x12000 (used).
fn raw_ring(s: &Setup, size: u32, desc: u64) {
    write_reg(s, regs::QUEUE_SIZE, u64::from(size));
    write_reg(s, regs::QUEUE_DESC, desc);
    write_reg(s, regs::QUEUE_AVAIL, 0x11000);
    write_reg(s, regs::QUEUE_USED, 0x12000);
    write_reg(s, regs::QUEUE_ENABLE, 1);
    wait_for(|| reg(s, regs::STATUS) & abi::STATUS_QUEUE_READY != 0 || reg(s, regs::ERROR) != 0);
}

fn put_desc(s: &Setup, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
    let mut d = [0u8; 16];
    d[0..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&flags.to_le_bytes());
    d[14..16].copy_from_slice(&next.to_le_bytes());
    s.mem.write_slice(&d, GuestAddress(0x10000 + 16 * i)).unwrap();
}

fn post(s: &Setup, idx: u16, head: u16) {
    s.mem.write_obj(head, GuestAddress(0x11004 + 2 * u64::from(idx % 8))).unwrap();
    s.mem.write_obj(idx.wrapping_add(1), GuestAddress(0x11002)).unwrap();
    write_reg(s, regs::DOORBELL, 1);
}

fn used_idx(s: &Setup) -> u16 {
    s.mem.read_obj(GuestAddress(0x12002)).unwrap()
}

/// `chains` request chains (header at 0x30000, program at 0x40000, status
/// block r at 0x20000 + 64 r) of one program, an `n` x `n` x `n` f32
/// product in SRAM, at descriptors 3 r, 3 r + 1, 3 r + 2 (not posted).
fn product_chains(s: &Setup, n: u32, chains: u16) {
    use vnpu_abi::{DType, MatFlags};
    let bytes = u64::from(n * n * 4);
    let mut p = ProgramBuilder::new();
    let mm = Instr::MatMul {
        dtype: DType::F32,
        flags: MatFlags::default(),
        a: 0,
        b: bytes,
        c: 2 * bytes,
        m: n,
        k: n,
        n,
        lda: n,
        ldb: n,
        ldc: n,
    };
    p.push(Engine::sa(0), mm);
    let program = p.finish().encode();
    s.mem.write_slice(&program, GuestAddress(0x40000)).unwrap();
    let header = abi::RequestHeader { opcode: abi::OP_RUN, ..Default::default() };
    s.mem.write_slice(&header.to_bytes(), GuestAddress(0x30000)).unwrap();
    for r in 0..chains {
        let d = u64::from(r) * 3;
        put_desc(s, d, 0x30000, 32, 1, (d + 1) as u16);
        put_desc(s, d + 1, 0x40000, program.len() as u32, 1, (d + 2) as u16);
        put_desc(s, d + 2, 0x20000 + 64 * u64::from(r), 64, 2, 0);
    }
}

#[test]
fn hostile_rings_get_error_statuses_never_a_hang() {
    let s = setup("sa=1,vu=1,sram=2M,hbm=256M");
    // A ring outside guest memory, and a size that is not a power of two.
    raw_ring(&s, 8, MEM + 0x1000);
    assert_eq!(reg(&s, regs::ERROR), abi::ERR_QUEUE_INVALID);
    write_reg(&s, regs::DEVICE_RESET, 1);
    wait_for(|| reg(&s, regs::STATUS) & abi::STATUS_RESETTING == 0);
    raw_ring(&s, 6, 0x10000);
    assert_eq!(reg(&s, regs::ERROR), abi::ERR_QUEUE_INVALID);
    write_reg(&s, regs::DEVICE_RESET, 1);
    wait_for(|| reg(&s, regs::STATUS) & abi::STATUS_RESETTING == 0);
    raw_ring(&s, 8, 0x10000);
    assert_eq!(reg(&s, regs::ERROR), 0);

    let status = |s: &Setup| {
        let mut b = [0u8; 64];
        s.mem.read_slice(&mut b, GuestAddress(0x20000)).unwrap();
        abi::StatusBlock::from_bytes(&b)
    };
    let idx = std::cell::Cell::new(0u16);
    // Each request's status block is poisoned first, so a check never
    // reads a status the previous request left.
    let submit = |s: &Setup, head: u16| {
        s.mem.write_slice(&[0xee; 64], GuestAddress(0x20000)).unwrap();
        post(s, idx.get(), head);
        idx.set(idx.get().wrapping_add(1));
        let want = idx.get();
        wait_for(|| used_idx(s) == want);
    };
    // Used length of the last completed request.
    let last_used_len = |s: &Setup| -> u32 {
        let slot = u64::from(idx.get().wrapping_sub(1) % 8);
        s.mem.read_obj(GuestAddress(0x12004 + 8 * slot + 4)).unwrap()
    };
    // A reset and a new ring: ERROR is 0 again, so a check of ERROR after
    // the next request sees what that request did.
    let fresh_ring = |s: &Setup| {
        write_reg(s, regs::DEVICE_RESET, 1);
        wait_for(|| reg(s, regs::STATUS) & (abi::STATUS_RESETTING | abi::STATUS_FAILED) == 0);
        assert_eq!(reg(s, regs::ERROR), 0);
        s.mem.write_obj(0u16, GuestAddress(0x11002)).unwrap();
        s.mem.write_obj(0u16, GuestAddress(0x12002)).unwrap();
        raw_ring(s, 8, 0x10000);
        idx.set(0);
        assert_eq!(reg(s, regs::ERROR), 0);
    };
    // Unknown opcode.
    s.mem
        .write_slice(
            &abi::RequestHeader { opcode: 77, tag: 5, ..Default::default() }.to_bytes(),
            GuestAddress(0x30000),
        )
        .unwrap();
    put_desc(&s, 0, 0x30000, 32, 1, 1);
    put_desc(&s, 1, 0x20000, 64, 2, 0);
    submit(&s, 0);
    assert_eq!((status(&s).status, status(&s).tag), (abi::ST_UNKNOWN_OPCODE, 5));
    // Header descriptor pointing outside guest memory.
    put_desc(&s, 0, MEM + 64, 32, 1, 1);
    submit(&s, 0);
    assert_eq!(status(&s).status, abi::ST_BAD_REQUEST);
    // Header too short.
    put_desc(&s, 0, 0x30000, 8, 1, 1);
    submit(&s, 0);
    assert_eq!(status(&s).status, abi::ST_BAD_REQUEST);
    // Readable after writable.
    put_desc(&s, 0, 0x20000, 64, 3, 1);
    put_desc(&s, 1, 0x30000, 32, 0, 0);
    submit(&s, 0);
    assert_eq!(status(&s).status, abi::ST_BAD_REQUEST);
    // No writable descriptor for a status block: reported in ERROR, used length 0.
    put_desc(&s, 0, 0x30000, 32, 0, 0);
    assert_eq!(reg(&s, regs::ERROR), 0);
    submit(&s, 0);
    assert_eq!(reg(&s, regs::ERROR), abi::ERR_NO_STATUS_BLOCK);
    assert_eq!(last_used_len(&s), 0);
    // A descriptor loop (1 -> 2 -> 1 ...): the chain walk stops at the ring
    // size; no status block, so ERROR (cleared by a fresh ring) says so.
    fresh_ring(&s);
    s.mem
        .write_slice(
            &abi::RequestHeader { opcode: 1, ..Default::default() }.to_bytes(),
            GuestAddress(0x30000),
        )
        .unwrap();
    put_desc(&s, 0, 0x30000, 32, 1, 1);
    put_desc(&s, 1, 0x31000, 16, 1, 2);
    put_desc(&s, 2, 0x31000, 16, 1, 1);
    write_reg(&s, regs::DEVICE_RESET, 0); // not a reset (bit 0 clear)
    assert_eq!(reg(&s, regs::STATUS) & abi::STATUS_QUEUE_READY, abi::STATUS_QUEUE_READY);
    submit(&s, 0);
    assert_eq!(reg(&s, regs::ERROR), abi::ERR_NO_STATUS_BLOCK);
    assert_eq!(last_used_len(&s), 0);
    // The same loop with a status block reachable before it repeats: the
    // request is walked to its end and answered (ST_OK for a NOP).
    s.mem
        .write_slice(
            &abi::RequestHeader { opcode: abi::OP_NOP, ..Default::default() }.to_bytes(),
            GuestAddress(0x30000),
        )
        .unwrap();
    put_desc(&s, 0, 0x30000, 32, 1, 1);
    put_desc(&s, 1, 0x20000, 64, 3, 2);
    put_desc(&s, 2, 0x20000, 64, 3, 1);
    fresh_ring(&s);
    submit(&s, 0);
    assert_eq!(reg(&s, regs::ERROR), 0);
    assert_eq!(status(&s).status, abi::ST_OK);
    // A huge program length: refused before any allocation.
    s.mem
        .write_slice(
            &abi::RequestHeader { opcode: abi::OP_RUN, ..Default::default() }.to_bytes(),
            GuestAddress(0x30000),
        )
        .unwrap();
    put_desc(&s, 1, 0x31000, 1 << 31, 1, 2);
    put_desc(&s, 2, 0x20000, 64, 2, 0);
    submit(&s, 0);
    assert_eq!(status(&s).status, abi::ST_TOO_LARGE);
    // Head index beyond the ring: the device stops the ring (it cannot
    // complete a request it cannot name) and says so.
    post(&s, idx.get(), 200);
    wait_for(|| reg(&s, regs::STATUS) & abi::STATUS_FAILED != 0);
    assert_eq!(reg(&s, regs::ERROR), abi::ERR_QUEUE_BROKEN);
    // Reset recovers (ERROR and FAILED cleared, the ring usable again).
    fresh_ring(&s);
    s.mem
        .write_slice(
            &abi::RequestHeader { opcode: 0, tag: 9, ..Default::default() }.to_bytes(),
            GuestAddress(0x30000),
        )
        .unwrap();
    put_desc(&s, 0, 0x30000, 32, 1, 1);
    put_desc(&s, 1, 0x20000, 64, 2, 0);
    post(&s, 0, 0);
    wait_for(|| used_idx(&s) == 1);
    assert_eq!((status(&s).status, status(&s).tag), (abi::ST_OK, 9));
    // An available index far ahead of the device: ring stopped, not a spin.
    s.mem.write_obj(100u16, GuestAddress(0x11002)).unwrap();
    write_reg(&s, regs::DOORBELL, 1);
    wait_for(|| reg(&s, regs::STATUS) & abi::STATUS_FAILED != 0);
    // Ring registers are frozen while the ring is enabled... and after the
    // failure, until reset.
    write_reg(&s, regs::QUEUE_ENABLE, 1);
    assert_eq!(reg(&s, regs::STATUS) & abi::STATUS_QUEUE_READY, 0);
}

#[test]
fn registered_programs_are_verified_once_and_kept_by_value() {
    let s = setup("sa=1,vu=1,sram=4M,hbm=256M");
    let mut dma = s.dma();
    let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 64).unwrap();
    let input: Vec<u8> = [-1.0f32, 2.0, -3.5, 4.25].iter().flat_map(|x| x.to_le_bytes()).collect();
    s.mem.write_slice(&input, GuestAddress(0x1000)).unwrap();
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    let h = npu.register(&prog).unwrap();
    // The guest overwrites its copy: the device runs what it verified.
    prog.write(0, &[0xff; 64]);
    for _ in 0..10 {
        s.mem.write_slice(&[0u8; 16], GuestAddress(0x2000)).unwrap();
        let st = npu.run_registered(h, &RunOptions::default()).unwrap();
        assert!(st.cycles > 0);
        let mut out = [0u8; 16];
        s.mem.read_slice(&mut out, GuestAddress(0x2000)).unwrap();
        assert_eq!(&out[4..8], &2.0f32.to_le_bytes());
    }
    // Registration refuses what RUN refuses.
    let junk = npu.load(&mut dma, b"junk").unwrap();
    assert!(matches!(npu.register(&junk), Err(Error::Request { status: abi::ST_BAD_PROGRAM, .. })));
    // Unknown handles, unregistered handles.
    let bad = vnpu_driver::ProgramHandle(63);
    assert!(matches!(
        npu.run_registered(bad, &RunOptions::default()),
        Err(Error::Request { status: abi::ST_BAD_HANDLE, .. })
    ));
    let ok = npu.load(&mut dma, &relu_program()).unwrap();
    let h2 = npu.register(&ok).unwrap();
    npu.unregister(h2).unwrap();
    assert!(matches!(
        npu.run_registered(h2, &RunOptions::default()),
        Err(Error::Request { status: abi::ST_BAD_HANDLE, .. })
    ));
    // The table holds MAX_REGISTERED programs.
    let mut n = 1; // `h` is still registered
    while npu.register(&ok).is_ok() {
        n += 1;
        assert!(n <= abi::MAX_REGISTERED);
    }
    assert_eq!(n, abi::MAX_REGISTERED);
    assert!(matches!(npu.register(&ok), Err(Error::Request { status: abi::ST_NO_SPACE, .. })));
    // A new configuration drops them all (they were checked against the old one).
    let cfg = one_core_hierarchy();
    npu.configure(&cfg).unwrap();
    assert!(matches!(
        npu.run_registered(h, &RunOptions::default()),
        Err(Error::Request { status: abi::ST_BAD_HANDLE, .. })
    ));
}

/// A reset takes effect between requests, not after everything the ring
/// holds: with twelve long requests posted at once, a reset written once
/// the first has completed stops the ring after the request running then
/// (the worker used to serve all eight first, so a guest that kept its
/// ring full held `vnpu stop` off for as long as it liked).
#[test]
fn a_reset_takes_effect_between_requests() {
    let s = setup("sa=1,vu=1,sram=16M,hbm=256M");
    {
        // Configure through the driver (a reset keeps the configuration).
        let mut dma = s.dma();
        let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 64).unwrap();
        npu.configure(&Hierarchy { sram_per_core: 16 << 20, ..one_core_hierarchy() }).unwrap();
    }
    write_reg(&s, regs::DEVICE_RESET, 1);
    wait_for(|| reg(&s, regs::STATUS) & abi::STATUS_RESETTING == 0);
    s.mem.write_obj(0u16, GuestAddress(0x11002)).unwrap();
    s.mem.write_obj(0u16, GuestAddress(0x12002)).unwrap();
    // 64 descriptors: twelve chains of three.
    raw_ring(&s, 64, 0x10000);
    assert_eq!(reg(&s, regs::ERROR), 0);
    // A request of real host work (tens of milliseconds): a 1024 x 1024 x
    // 1024 product in SRAM; eleven of them are the margin the reset has.
    // Twelve chains, all posted at once.
    product_chains(&s, 1024, 12);
    for r in 0..12u16 {
        s.mem.write_obj(r * 3, GuestAddress(0x11004 + 2 * u64::from(r))).unwrap();
    }
    s.mem.write_obj(12u16, GuestAddress(0x11002)).unwrap();
    write_reg(&s, regs::DOORBELL, 1);
    wait_for(|| used_idx(&s) >= 1);
    write_reg(&s, regs::DEVICE_RESET, 1);
    wait_for(|| reg(&s, regs::STATUS) & abi::STATUS_RESETTING == 0);
    let served = used_idx(&s);
    assert!(served < 12, "all {served} requests ran before the reset took effect");
    assert_eq!(reg(&s, regs::ERROR), 0, "the ring itself was fine");
    // The requests that ran, ran the program (not an error status).
    let mut b = [0u8; 64];
    s.mem.read_slice(&mut b, GuestAddress(0x20000)).unwrap();
    assert_eq!(abi::StatusBlock::from_bytes(&b).status, abi::ST_OK, "the first request");
}

/// A guest that keeps its ring full cannot hold a stop off, in polling
/// mode (the worker spins on the ring with doorbells suppressed) and in
/// interrupt mode alike: dropping the function (what `vnpu stop` does to a
/// served vNPU) returns within 1 s, and no request starts after it (of
/// those after the count taken just before the stop, only the one
/// running may complete).
#[test]
fn a_stop_ends_a_continuously_refilled_ring_in_both_modes() {
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};
    for poll in [Duration::from_secs(2), Duration::ZERO] {
        let s = setup_with("sa=1,vu=1,sram=16M,hbm=256M", DeviceOptions { poll, ..Default::default() });
        {
            let mut dma = s.dma();
            let mut npu = Vnpu::new(FnBar(&s.f), &mut dma, 64).unwrap();
            npu.configure(&Hierarchy { sram_per_core: 16 << 20, ..one_core_hierarchy() }).unwrap();
        }
        write_reg(&s, regs::DEVICE_RESET, 1);
        wait_for(|| reg(&s, regs::STATUS) & abi::STATUS_RESETTING == 0);
        s.mem.write_obj(0u16, GuestAddress(0x11002)).unwrap();
        s.mem.write_obj(0u16, GuestAddress(0x12002)).unwrap();
        raw_ring(&s, 32, 0x10000);
        assert_eq!(reg(&s, regs::ERROR), 0);
        // Requests of real host work (a 1024^3 product in SRAM, tens of
        // ms: the stop's bound is one of them): eight chains, reposted
        // forever.
        product_chains(&s, 1024, 8);
        // The guest: keeps eight requests posted, never rings the doorbell
        // again after the first (the ring never runs dry).
        let stop = Arc::new(AtomicBool::new(false));
        let refill = {
            let (mem, stop) = (s.mem.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut avail = 0u16;
                while !stop.load(Ordering::Relaxed) {
                    let used: u16 = mem.read_obj(GuestAddress(0x12002)).unwrap();
                    if avail.wrapping_sub(used) < 8 {
                        let head = (avail % 8) * 3;
                        mem.write_obj(head, GuestAddress(0x11004 + 2 * u64::from(avail % 32))).unwrap();
                        avail = avail.wrapping_add(1);
                        mem.write_obj(avail, GuestAddress(0x11002)).unwrap();
                    } else {
                        std::thread::yield_now();
                    }
                }
            })
        };
        wait_for(|| s.mem.read_obj::<u16>(GuestAddress(0x11002)).unwrap() > 0);
        write_reg(&s, regs::DOORBELL, 1);
        // Let it run a while at full ring.
        wait_for(|| used_idx(&s) >= 4);
        let mem = s.mem.clone();
        // The stop runs on a thread of its own, so that a stop the ring
        // holds off fails the test instead of hanging it. It reads how
        // many requests had completed right before it posts the stop.
        let f = s.f.into_inner();
        let (done, stopped) = std::sync::mpsc::channel();
        let stopper = {
            let mem = mem.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let before: u16 = mem.read_obj(GuestAddress(0x12002)).unwrap();
                drop(f);
                let _ = done.send((before, t.elapsed()));
            })
        };
        let answer = stopped.recv_timeout(Duration::from_secs(5));
        let after: u16 = mem.read_obj(GuestAddress(0x12002)).unwrap();
        stop.store(true, Ordering::Relaxed);
        refill.join().unwrap();
        stopper.join().unwrap();
        let Ok((before, took)) = answer else {
            panic!("poll {poll:?}: the stop did not return within 5 s of a full ring");
        };
        assert!(took < Duration::from_secs(1), "poll {poll:?}: the stop took {took:?}");
        // The request running at the stop may finish; none starts after.
        assert!(
            after.wrapping_sub(before) <= 1,
            "poll {poll:?}: {} requests completed after the stop",
            after.wrapping_sub(before)
        );
    }
}
