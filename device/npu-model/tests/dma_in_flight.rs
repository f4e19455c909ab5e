//! Several DMA transfers in flight per stream (`dma.in_flight`), checked
//! against times computed by hand from the board's rates: issue overheads
//! overlap the data of earlier transfers, data moves in issue order, a
//! transfer that touches bytes of one in flight waits for it, and a
//! `signal` waits for every transfer in flight. Timing only.
#![allow(clippy::unwrap_used)]

use npu_model::{run_program, BoardConfig};
use vnpu_abi::*;

fn board(in_flight: u32) -> BoardConfig {
    let mut b = BoardConfig::test_board();
    b.dma.in_flight = in_flight;
    b
}

/// `|a / b - 1| < 1e-9`, NaN failing.
fn same(a: f64, b: f64, what: &str) {
    assert!(((a - b) / b).abs() < 1e-9, "{what}: {a} cycles, expected {b}");
}

fn copy(src: Addr, dst: Addr, bytes: u32) -> Instr {
    Instr::DmaCopy { src, dst, rows: 1, row_bytes: bytes, src_stride: 0, dst_stride: 0 }
}

/// Issue overhead `L`, HBM first-byte latency `F` and the bytes that
/// take `2 L` at one engine's rate, in cycles.
fn rates(b: &BoardConfig) -> (f64, f64, u32) {
    let l = b.ns_to_cycles(b.dma.latency_ns);
    let f = b.ns_to_cycles(b.hbm.latency_ns);
    let bytes = (2.0 * l * b.gbps_to_bytes_per_cycle(b.dma.gbps)).round() as u32;
    (l, f, bytes)
}

/// `n` loads of `2 L` of data each into distinct SRAM: one at a time each
/// pays its issue overhead after the last one's data (`F + n (L + 2L)`);
/// in flight, issues overlap the data before them and the data moves
/// back to back (`L + F + n 2L`), whatever the depth from 2 up.
#[test]
fn issue_overheads_overlap_earlier_data() {
    let n = 10u32;
    let (l, f, bytes) = rates(&board(1));
    let d = f64::from(bytes) / board(1).gbps_to_bytes_per_cycle(board(1).dma.gbps);
    let mut p = ProgramBuilder::new();
    for i in 0..n {
        p.push(Engine::DMA, copy(Addr::hbm(u64::from(i * bytes)), Addr::sram(u64::from(i * bytes)), bytes));
    }
    let p = p.finish();
    let one = run_program(&board(1), &p, None, None).unwrap().cycles;
    same(one, f + f64::from(n) * (l + d), "one in flight");
    for k in [2, 4, 8] {
        let many = run_program(&board(k), &p, None, None).unwrap().cycles;
        same(many, l + f + f64::from(n) * d, &format!("{k} in flight"));
    }
}

/// A load that reads what the load before it writes waits for it to land:
/// the same time as one at a time.
#[test]
fn a_transfer_waits_for_the_one_whose_bytes_it_touches() {
    let (_, _, bytes) = rates(&board(1));
    let mut p = ProgramBuilder::new();
    p.push(Engine::DMA, copy(Addr::hbm(0), Addr::sram(0), bytes));
    p.push(Engine::DMA, copy(Addr::sram(0), Addr::hbm(1 << 20), bytes));
    let p = p.finish();
    let one = run_program(&board(1), &p, None, None).unwrap().cycles;
    let many = run_program(&board(4), &p, None, None).unwrap().cycles;
    same(many, one, "dependent transfers");
}

/// A `signal` after two loads reaches the SA only once both have landed:
/// the SA's product starts after the second load's data.
#[test]
fn a_signal_waits_for_every_transfer_in_flight() {
    let b = board(4);
    let (l, f, bytes) = rates(&b);
    let d = f64::from(bytes) / b.gbps_to_bytes_per_cycle(b.dma.gbps);
    let mut p = ProgramBuilder::new();
    p.push(Engine::DMA, copy(Addr::hbm(0), Addr::sram(0), bytes));
    p.push(Engine::DMA, copy(Addr::hbm(1 << 20), Addr::sram(1 << 20), bytes));
    p.push(Engine::DMA, Instr::Signal { sem: 0 });
    p.push(Engine::sa(0), Instr::Wait { sem: 0 });
    let p = p.finish();
    let r = run_program(&b, &p, None, None).unwrap();
    let sa = r.engines.iter().find(|e| e.engine == Engine::sa(0)).unwrap();
    same(sa.stall_cycles, l + f + 2.0 * d, "the SA's wait");
}
