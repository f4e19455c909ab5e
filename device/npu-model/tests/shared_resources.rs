//! The physical resources co-located tenants share on a core, checked
//! against times computed by hand from the board's rates: the DMA engines
//! (`core.dma_engines`), the HBM bandwidth and the host link. Timing only
//! (no memories), so the programs' addresses need not hold data.
#![allow(clippy::unwrap_used)]

use npu_model::config::HbmPartition;
use npu_model::{run_core, run_program, BoardConfig, BoardSim, Contention, Tenant};
use vnpu_abi::*;

/// One transfer of `bytes` bytes from `src` to `dst` on the tenant's DMA
/// stream.
fn one_transfer(src: Addr, dst: Addr, bytes: u32) -> Program {
    let mut b = ProgramBuilder::new();
    b.push(Engine::DMA, Instr::DmaCopy { src, dst, rows: 1, row_bytes: bytes, src_stride: 0, dst_stride: 0 });
    b.finish()
}

/// Cycles of each tenant when `programs` run together on one core of `cfg`.
fn together(cfg: &BoardConfig, programs: &[Program]) -> Vec<f64> {
    let mut tenants: Vec<Tenant<'_, '_>> =
        programs.iter().map(|p| Tenant { program: p, memory: None, max_cycles: None }).collect();
    let report = run_core(cfg, &mut tenants);
    report.tenants.into_iter().map(|t| t.unwrap().cycles).collect()
}

fn alone(cfg: &BoardConfig, p: &Program) -> f64 {
    run_program(cfg, p, None, None).unwrap().cycles
}

/// Relative difference, NaN-propagating (a NaN fails every `<` below).
fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}

/// Every one of `cycles` is `expect` (relative 1e-9; NaN fails).
fn all_take(cycles: &[f64], expect: f64, who: &str) {
    for (i, c) in cycles.iter().enumerate() {
        assert!(rel(*c, expect) < 1e-9, "{who} {i}: {c} cycles, expected {expect} (all: {cycles:?})");
    }
}

const MIB: u32 = 1 << 20;

/// HBM -> SRAM, 4 MiB: DMA-bound (400 GB/s engine, 1.2 TB/s HBM).
fn hbm_read() -> Program {
    one_transfer(Addr::hbm(0), Addr::sram(0), 4 * MIB)
}

/// Guest -> SRAM, 1 MiB: host-link-bound (25 GB/s link).
fn guest_read() -> Program {
    one_transfer(Addr::guest(0x10_0000), Addr::sram(0), MIB)
}

/// Fixed part of a transfer (issue + first-byte latencies), in cycles.
fn fixed(cfg: &BoardConfig, hbm: bool, host: bool) -> f64 {
    let mut ns = cfg.dma.latency_ns;
    if hbm {
        ns += cfg.hbm.latency_ns;
    }
    if host {
        ns += cfg.dma.host_latency_ns;
    }
    cfg.ns_to_cycles(ns)
}

#[test]
fn one_dma_engine_serves_two_tenants_at_half_rate_each() {
    let cfg = BoardConfig::test_board();
    assert_eq!(cfg.core.dma_engines, 1, "the documented default");
    let engine = cfg.gbps_to_bytes_per_cycle(cfg.dma.gbps);
    let solo = alone(&cfg, &hbm_read());
    let expect_solo = fixed(&cfg, true, false) + f64::from(4 * MIB) / engine;
    assert!(rel(solo, expect_solo) < 1e-9, "alone: {solo} cycles, expected {expect_solo}");
    let both = together(&cfg, &[hbm_read(), hbm_read()]);
    // One engine, two transfers in flight: each gets half of it (800 GB/s
    // of HBM demand is under the 1.2 TB/s the chip has).
    let expect = fixed(&cfg, true, false) + f64::from(4 * MIB) / (engine / 2.0);
    all_take(&both, expect, "tenant");
    // About twice as long as alone (the fixed latencies are not shared).
    assert!(both[0] / solo > 1.95 && both[0] / solo < 2.0, "{} / {solo}", both[0]);
}

#[test]
fn two_dma_engines_give_two_tenants_full_rate_until_hbm_is_the_limit() {
    let mut cfg = BoardConfig::test_board();
    cfg.core.dma_engines = 2;
    let solo = alone(&cfg, &hbm_read());
    let both = together(&cfg, &[hbm_read(), hbm_read()]);
    all_take(&both, solo, "tenant");
    // Four tenants on four engines want 1.6 TB/s; HBM has 1.2 TB/s, so each
    // gets a quarter of it.
    cfg.core.dma_engines = 4;
    let hbm = cfg.hbm_bytes_per_cycle();
    let four = together(&cfg, &[hbm_read(), hbm_read(), hbm_read(), hbm_read()]);
    let expect = fixed(&cfg, true, false) + f64::from(4 * MIB) / (hbm / 4.0);
    all_take(&four, expect, "tenant");
}

#[test]
fn the_host_link_is_shared_even_with_an_engine_each() {
    let mut cfg = BoardConfig::test_board();
    cfg.core.dma_engines = 2;
    let link = cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps);
    let solo = alone(&cfg, &guest_read());
    let expect_solo = fixed(&cfg, false, true) + f64::from(MIB) / link;
    assert!(rel(solo, expect_solo) < 1e-9, "alone: {solo}, expected {expect_solo}");
    let both = together(&cfg, &[guest_read(), guest_read()]);
    let expect = fixed(&cfg, false, true) + f64::from(MIB) / (link / 2.0);
    all_take(&both, expect, "tenant");
    // A guest read and an HBM read on two engines: the HBM reader is not
    // held back by the link it does not use.
    let mixed = together(&cfg, &[guest_read(), hbm_read()]);
    assert!(rel(mixed[0], solo) < 1e-9, "guest reader {} vs alone {solo}", mixed[0]);
    let hbm_solo = alone(&cfg, &hbm_read());
    assert!(rel(mixed[1], hbm_solo) < 1e-9, "hbm reader {} vs alone {hbm_solo}", mixed[1]);
}

#[test]
fn max_min_gives_the_link_bound_transfer_its_share_and_the_rest_to_the_other() {
    // One engine, a guest read (capped at the 25 GB/s link) and an HBM
    // read: the guest read gets min(link, engine/2) = link, the HBM read the
    // rest of the engine (375 GB/s) while both flow.
    let cfg = BoardConfig::test_board();
    let (engine, link) =
        (cfg.gbps_to_bytes_per_cycle(cfg.dma.gbps), cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps));
    let small_hbm = one_transfer(Addr::hbm(0), Addr::sram(0), MIB);
    let c = together(&cfg, &[guest_read(), small_hbm.clone()]);
    // The HBM read starts after its latency and finishes long before the
    // guest read: at (engine - link) while they overlap.
    let hbm_start = fixed(&cfg, true, false);
    let guest_start = fixed(&cfg, false, true);
    assert!(guest_start > hbm_start);
    // Before the guest read starts the HBM read runs at the full engine rate.
    let head = (guest_start - hbm_start) * engine;
    let expect_hbm = guest_start + (f64::from(MIB) - head) / (engine - link);
    assert!(rel(c[1], expect_hbm) < 1e-9, "hbm reader {} expected {expect_hbm}", c[1]);
    let expect_guest = guest_start + f64::from(MIB) / link;
    assert!(rel(c[0], expect_guest) < 1e-9, "guest reader {} expected {expect_guest}", c[0]);
}

#[test]
fn equal_partition_splits_every_shared_resource() {
    let mut cfg = BoardConfig::test_board();
    cfg.hbm.partition = HbmPartition::Equal;
    let hbm = cfg.hbm_bytes_per_cycle();
    let engine = cfg.gbps_to_bytes_per_cycle(cfg.dma.gbps);
    let link = cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps);
    // One tenant reading while three others only do a tiny SRAM copy:
    // run_core gives each of the four a quarter, used or not.
    let tiny = one_transfer(Addr::sram(0), Addr::sram(64), 64);
    let quiet = [tiny.clone(), tiny.clone(), tiny];
    let with = |p: Program, cfg: &BoardConfig| {
        let mut all = vec![p];
        all.extend(quiet.iter().cloned());
        together(cfg, &all)[0]
    };
    // One engine: a quarter of it (106 GB/s), below a quarter of HBM.
    let c = with(hbm_read(), &cfg);
    let expect = fixed(&cfg, true, false) + f64::from(4 * MIB) / (engine / 4.0);
    assert!(rel(c, expect) < 1e-9, "1 engine: {c} expected {expect}");
    // Four engines: a quarter of HBM (300 GB/s) is the limit.
    cfg.core.dma_engines = 4;
    let c = with(hbm_read(), &cfg);
    let expect = fixed(&cfg, true, false) + f64::from(4 * MIB) / (hbm / 4.0);
    assert!(rel(c, expect) < 1e-9, "4 engines: {c} expected {expect}");
    // A quarter of the host link.
    let c = with(guest_read(), &cfg);
    let expect = fixed(&cfg, false, true) + f64::from(MIB) / (link / 4.0);
    assert!(rel(c, expect) < 1e-9, "host link: {c} expected {expect}");
}

/// Cycles of each program when `placed[i]` runs alone on core `i` of a
/// [`BoardSim`] of `cfg` (timing only); `shares` HBM shares per core.
fn on_cores(cfg: &BoardConfig, placed: &[(usize, Program)], shares: usize) -> Vec<f64> {
    on_cores_with(cfg, placed, shares, Contention::default())
}

/// As [`on_cores`], contending only for what `contention` says.
fn on_cores_with(
    cfg: &BoardConfig,
    placed: &[(usize, Program)],
    shares: usize,
    contention: Contention,
) -> Vec<f64> {
    let mut board: BoardSim<'_, Tenant<'_, '_>> = BoardSim::new(cfg);
    board.set_contention(contention);
    for c in 0..board.len() {
        board.core(c).unwrap().set_shares(shares);
    }
    let mut ids = Vec::new();
    for (core, p) in placed {
        let t = Tenant { program: p, memory: None, max_cycles: None };
        ids.push((*core, board.core(*core).unwrap().add(t, 0.0)));
    }
    let mut cycles = vec![f64::NAN; placed.len()];
    while !board.is_idle() {
        for (core, (id, _, r)) in board.step() {
            let k = ids.iter().position(|&x| x == (core, id)).unwrap();
            cycles[k] = r.unwrap().cycles;
        }
    }
    cycles
}

#[test]
fn the_host_link_is_shared_by_the_cores_of_the_board() {
    // Two chips of two cores: guest reads on three cores of two chips
    // share the one 25 GB/s link three ways.
    let mut cfg = BoardConfig::test_board();
    (cfg.chips, cfg.cores_per_chip) = (2, 2);
    let link = cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps);
    let solo = on_cores(&cfg, &[(3, guest_read())], 1)[0];
    let expect_solo = fixed(&cfg, false, true) + f64::from(MIB) / link;
    assert!(rel(solo, expect_solo) < 1e-9, "alone: {solo}, expected {expect_solo}");
    let three = on_cores(&cfg, &[(0, guest_read()), (1, guest_read()), (3, guest_read())], 1);
    let expect = fixed(&cfg, false, true) + f64::from(MIB) / (link / 3.0);
    all_take(&three, expect, "core");
    // A guest-DMA-heavy tenant slows by about 3x (the fixed latency is
    // its own).
    assert!(three[2] / solo > 2.9 && three[2] / solo < 3.0, "{} / {solo}", three[2]);
}

#[test]
fn hbm_is_shared_by_the_cores_of_a_chip_and_not_across_chips() {
    let mut cfg = BoardConfig::test_board();
    (cfg.chips, cfg.cores_per_chip) = (2, 4);
    let hbm = cfg.hbm_bytes_per_cycle();
    let solo = on_cores(&cfg, &[(0, hbm_read())], 1)[0];
    // Four cores of chip 0 want 4 x 400 GB/s of its 1.2 TB/s: 300 each.
    let chip0: Vec<(usize, Program)> = (0..4).map(|c| (c, hbm_read())).collect();
    let four = on_cores(&cfg, &chip0, 1);
    let expect = fixed(&cfg, true, false) + f64::from(4 * MIB) / (hbm / 4.0);
    all_take(&four, expect, "core");
    // Two cores on each chip want 800 GB/s of each chip's 1.2 TB/s: no
    // contention, every transfer at its engine's rate.
    let split = on_cores(&cfg, &[(0, hbm_read()), (1, hbm_read()), (4, hbm_read()), (5, hbm_read())], 1);
    all_take(&split, solo, "transfer");
}

#[test]
fn equal_partition_gives_each_share_of_the_board_its_part_of_the_link_used_or_not() {
    // Four cores of one chip, one vNPU each: under "equal" the lone guest
    // reader gets a quarter of the host link although nobody else uses it;
    // under "shared" it gets all of it.
    let mut cfg = BoardConfig::test_board();
    let link = cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps);
    let shared = on_cores(&cfg, &[(2, guest_read())], 1)[0];
    let expect = fixed(&cfg, false, true) + f64::from(MIB) / link;
    assert!(rel(shared, expect) < 1e-9, "shared: {shared}, expected {expect}");
    cfg.hbm.partition = HbmPartition::Equal;
    let equal = on_cores(&cfg, &[(2, guest_read())], 1)[0];
    let expect = fixed(&cfg, false, true) + f64::from(MIB) / (link / 4.0);
    assert!(rel(equal, expect) < 1e-9, "equal: {equal}, expected {expect}");
    // And a twelfth of the chip's HBM with three vNPUs per core (4 x 3
    // shares), below a third of the core's engine: 100 GB/s.
    let hbm = cfg.hbm_bytes_per_cycle();
    let c = on_cores(&cfg, &[(1, hbm_read())], 3)[0];
    let expect = fixed(&cfg, true, false) + f64::from(4 * MIB) / (hbm / 12.0);
    assert!(rel(c, expect) < 1e-9, "hbm share: {c}, expected {expect}");
}

#[test]
fn a_resource_left_out_of_contention_is_each_tenants_own() {
    let none = Contention { dma_engines: false, hbm: false, host_link: false };
    let only = |dma_engines, hbm, host_link| Contention { dma_engines, hbm, host_link };
    let mut cfg = BoardConfig::test_board();
    (cfg.chips, cfg.cores_per_chip) = (1, 4);
    let solo = on_cores(&cfg, &[(0, hbm_read())], 1)[0];
    // Two HBM readers on core 0's one engine: half rate each when they
    // contend for it, their solo time when each has an engine of its own.
    let two = [(0, hbm_read()), (0, hbm_read())];
    let contended = on_cores_with(&cfg, &two, 1, only(true, false, false));
    all_take(
        &contended,
        fixed(&cfg, true, false) + f64::from(4 * MIB) / (cfg.gbps_to_bytes_per_cycle(cfg.dma.gbps) / 2.0),
        "engine-bound",
    );
    all_take(&on_cores_with(&cfg, &two, 1, only(false, true, true)), solo, "private engines");
    // Four cores' readers: HBM is the limit (1.6 TB/s asked of 1.2) unless
    // each has HBM of its own.
    let four: Vec<(usize, Program)> = (0..4).map(|c| (c, hbm_read())).collect();
    let hbm = cfg.hbm_bytes_per_cycle();
    all_take(
        &on_cores_with(&cfg, &four, 1, only(false, true, false)),
        fixed(&cfg, true, false) + f64::from(4 * MIB) / (hbm / 4.0),
        "hbm-bound",
    );
    all_take(&on_cores_with(&cfg, &four, 1, only(true, false, true)), solo, "private hbm");
    // Three guest readers on three cores: a third of the link each, or
    // all of it when it is private.
    let guest_solo = on_cores(&cfg, &[(3, guest_read())], 1)[0];
    let three = [(0, guest_read()), (1, guest_read()), (3, guest_read())];
    let link = cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps);
    all_take(
        &on_cores_with(&cfg, &three, 1, only(false, false, true)),
        fixed(&cfg, false, true) + f64::from(MIB) / (link / 3.0),
        "link-bound",
    );
    all_take(&on_cores_with(&cfg, &three, 1, only(true, true, false)), guest_solo, "private link");
    all_take(&on_cores_with(&cfg, &three, 1, none), guest_solo, "nothing shared");
}

#[test]
fn transfers_count_their_hbm_and_guest_bytes() {
    let cfg = BoardConfig::test_board();
    let t = run_program(&cfg, &hbm_read(), None, None).unwrap().totals();
    assert_eq!((t.bytes, t.hbm_bytes, t.host_bytes), (u64::from(4 * MIB), u64::from(4 * MIB), 0));
    let t = run_program(&cfg, &guest_read(), None, None).unwrap().totals();
    assert_eq!((t.bytes, t.hbm_bytes, t.host_bytes), (u64::from(MIB), 0, u64::from(MIB)));
    let both = one_transfer(Addr::guest(0), Addr::hbm(0), MIB);
    let t = run_program(&cfg, &both, None, None).unwrap().totals();
    assert_eq!((t.bytes, t.hbm_bytes, t.host_bytes), (u64::from(MIB), u64::from(MIB), u64::from(MIB)));
    let sram = one_transfer(Addr::sram(0), Addr::sram(64), 64);
    let t = run_program(&cfg, &sram, None, None).unwrap().totals();
    assert_eq!((t.bytes, t.hbm_bytes, t.host_bytes), (64, 0, 0));
}
