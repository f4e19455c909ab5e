//! Spread programs (`vnpu_abi::program::FLAG_SPREAD`): logical streams on
//! as many physical engines as the core gives the tenant, cases whose
//! times follow by hand from one instruction's.
#![allow(clippy::unwrap_used)]

use npu_model::{run_program, BoardConfig, CoreSim, Tenant};
use vnpu_abi::{Engine, Instr, Program, ProgramBuilder, UnOp};

/// `streams` independent VU streams of `each` `exp` passes over 64 Ki
/// elements, spread or not.
fn vu_streams(streams: u8, each: usize, spread: bool) -> Program {
    vu_streams_of(streams, each, 1 << 16, spread)
}

/// As [`vu_streams`], passes over `len` elements.
fn vu_streams_of(streams: u8, each: usize, len: u32, spread: bool) -> Program {
    let mut b = ProgramBuilder::new();
    for s in 0..streams {
        for _ in 0..each {
            b.push(Engine::vu(s), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len });
        }
    }
    if spread {
        b.spread();
    }
    b.finish()
}

/// Cycles and borrowed cycles of `p` alone on a core that gives it
/// `width` engines of which `guarantee` are its own.
fn on(cfg: &BoardConfig, p: &Program, guarantee: [u32; 2], width: [u32; 2]) -> (f64, f64) {
    on_limited(cfg, p, guarantee, width, f64::INFINITY)
}

/// As [`on`], with a lend limit of `limit` cycles.
fn on_limited(
    cfg: &BoardConfig,
    p: &Program,
    guarantee: [u32; 2],
    width: [u32; 2],
    limit: f64,
) -> (f64, f64) {
    let mut sim = CoreSim::new(cfg, 1);
    sim.set_lend_limit(limit);
    let id = sim.add(Tenant { program: p, memory: None, max_cycles: None }, 0.0);
    assert_eq!(sim.set_engines(id, guarantee, width), 0.0);
    let (_, _, r) = sim.step().pop().unwrap();
    let r = r.unwrap();
    (r.cycles, r.borrowed_cycles)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn a_spread_program_runs_on_the_engines_it_is_given() {
    let cfg = BoardConfig::test_board();
    assert_eq!(cfg.core.vu_count, 4);
    let c = run_program(&cfg, &vu_streams(1, 1, false), None, None).unwrap().cycles;
    let p = vu_streams(4, 3, true);
    // Four streams of three instructions: twelve instructions on one
    // engine, six rounds on two, three on four.
    let cases = [([1, 1], 12.0 * c, 0.0), ([1, 2], 6.0 * c, 6.0 * c), ([1, 4], 3.0 * c, 9.0 * c)];
    for (width, cycles, borrowed) in cases {
        let (t, b) = on(&cfg, &p, [1, 1], width);
        assert!(
            close(t, cycles) && close(b, borrowed),
            "{width:?}: {t} and {b}, expected {cycles} and {borrowed}"
        );
    }
    // Its own two VUs are not borrowed.
    let (t, b) = on(&cfg, &p, [1, 2], [1, 2]);
    assert!(close(t, 6.0 * c) && b == 0.0, "{t} {b}");
    // A lone spread program gets every engine of the core; a program
    // that is not spread has one engine per stream, whatever it is told.
    assert!(close(run_program(&cfg, &p, None, None).unwrap().cycles, 3.0 * c));
    assert!(close(on(&cfg, &vu_streams(4, 3, false), [1, 1], [1, 1]).0, 3.0 * c));
}

/// Taking engines back waits for the instructions on them, no longer:
/// at 1.5 instructions into a run on four VUs, the second round ends half
/// an instruction later.
#[test]
fn engines_taken_back_are_free_after_the_instruction_on_them() {
    let cfg = BoardConfig::test_board();
    let c = run_program(&cfg, &vu_streams(1, 1, false), None, None).unwrap().cycles;
    let p = vu_streams(4, 3, true);
    let mut sim = CoreSim::new(&cfg, 1);
    let id = sim.add(Tenant { program: &p, memory: None, max_cycles: None }, 0.0);
    sim.set_engines(id, [1, 1], [1, 4]);
    assert!(sim.step_until(1.5 * c).is_empty());
    let drain = sim.set_engines(id, [1, 1], [1, 1]);
    assert!(close(drain, 0.5 * c), "{drain} vs {}", 0.5 * c);
    assert_eq!(sim.engines(id), Some([1, 1]));
    // Eight of twelve instructions started on four engines; the four left
    // run one at a time from 2c.
    let (_, _, r) = sim.step().pop().unwrap();
    let r = r.unwrap();
    assert!(close(r.cycles, 6.0 * c), "{} vs {}", r.cycles, 6.0 * c);
    // Giving back what is not taken costs nothing.
    let mut sim = CoreSim::new(&cfg, 1);
    let id = sim.add(Tenant { program: &p, memory: None, max_cycles: None }, 0.0);
    sim.set_engines(id, [1, 1], [1, 2]);
    assert!(sim.step_until(0.5 * c).is_empty());
    assert_eq!(sim.set_engines(id, [1, 1], [1, 4]), 0.0);
}

/// With a lend limit, an instruction longer than the limit never starts on
/// an engine beyond the tenant's guarantee (so an owner taking an engine
/// back waits at most the limit), and shorter ones still spread.
#[test]
fn a_lend_limit_keeps_long_instructions_on_the_tenants_own_engines() {
    let cfg = BoardConfig::test_board();
    let c = run_program(&cfg, &vu_streams(1, 1, false), None, None).unwrap().cycles;
    let long = vu_streams(4, 3, true);
    // Twelve passes of c: a limit below c keeps all on the one own VU.
    let (t, b) = on_limited(&cfg, &long, [1, 1], [1, 4], 0.5 * c);
    assert!(close(t, 12.0 * c) && b == 0.0, "{t} {b}");
    // A limit of c lets them spread, as with none.
    let (t, b) = on_limited(&cfg, &long, [1, 1], [1, 4], c);
    assert!(close(t, 3.0 * c) && close(b, 9.0 * c), "{t} {b}");
    // Passes under the limit spread whatever it is.
    let s = run_program(&cfg, &vu_streams_of(1, 1, 1 << 10, false), None, None).unwrap().cycles;
    assert!(s < 0.5 * c);
    let short = vu_streams_of(4, 3, 1 << 10, true);
    let (t, b) = on_limited(&cfg, &short, [1, 1], [1, 4], 0.5 * c);
    assert!(close(t, 3.0 * s) && close(b, 9.0 * s), "{t} {b} vs {s}");
    // Taken back at 1.5 short passes in, the lent VUs are free within the
    // limit (here: half a short pass).
    let mut sim = CoreSim::new(&cfg, 1);
    sim.set_lend_limit(0.5 * c);
    let id = sim.add(Tenant { program: &short, memory: None, max_cycles: None }, 0.0);
    sim.set_engines(id, [1, 1], [1, 4]);
    assert!(sim.step_until(1.5 * s).is_empty());
    let drain = sim.set_engines(id, [1, 1], [1, 1]);
    assert!(drain <= 0.5 * c && close(drain, 0.5 * s), "{drain}");
}
