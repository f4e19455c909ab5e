//! The self-check cases and the Transformer layer, run in-process on the
//! NPU model, match their CPU references.
#![allow(clippy::unwrap_used)]

use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Memory, Sram, VecGuestMemory};
use vnpu_guest_programs::{f32s, max_abs_error, selfcheck, transformer};

fn run(program: &vnpu_abi::Program, guest: &mut VecGuestMemory) {
    let (mut sram, mut hbm) = (Sram::new(4 << 20), LazyHbm::new(1 << 28));
    let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest };
    run_program(&BoardConfig::default(), program, Some(mem), None).unwrap();
}

#[test]
fn random_gemm_and_conv_cases_match_the_cpu() {
    let mut rng = selfcheck::Rng::new(7);
    let mut kinds = [0usize; 4];
    for i in 0..60 {
        let case = selfcheck::case(&mut rng, i);
        let p = selfcheck::prepare(case.clone(), &mut rng, 0x1000);
        let mut guest = VecGuestMemory::new(0, 4 << 20);
        for (a, b) in &p.inputs {
            guest.write(*a, b).unwrap();
        }
        run(&p.program, &mut guest);
        let mut out = vec![0u8; 4 * p.expected.len()];
        guest.read(p.output, &mut out).unwrap();
        selfcheck::matches(&p, &f32s(&out)).unwrap_or_else(|e| panic!("case {i} {case:?}: {e:?}"));
        kinds[match case {
            selfcheck::Case::MatMul { dtype: vnpu_abi::DType::F32, .. } => 0,
            selfcheck::Case::MatMul { .. } => 1,
            selfcheck::Case::Conv { dtype: vnpu_abi::DType::F32, .. } => 2,
            selfcheck::Case::Conv { .. } => 3,
        }] += 1;
    }
    assert!(kinds.iter().all(|&k| k > 0), "{kinds:?}");
}

#[test]
fn a_wrong_result_is_caught() {
    let mut rng = selfcheck::Rng::new(3);
    let case = selfcheck::Case::MatMul {
        dtype: vnpu_abi::DType::F32,
        m: 4,
        k: 8,
        n: 4,
        accumulate: false,
        transpose_b: false,
    };
    let p = selfcheck::prepare(case, &mut rng, 0);
    let mut got = p.expected.clone();
    got[5] += 1e-3;
    assert_eq!(selfcheck::matches(&p, &got).unwrap_err().0, 5);
}

#[test]
fn transformer_layer_matches_the_cpu() {
    let shape = transformer::Shape { seq: 16, d: 64, heads: 4, ffn: 128 };
    let w = transformer::Weights::random(shape, 1);
    let x = transformer::random_input(shape, 2);
    let (wa, xa, oa) = (0x1000u64, 0x100000u64, 0x200000u64);
    let mut guest = VecGuestMemory::new(0, 4 << 20);
    guest.write(wa, &w.bytes()).unwrap();
    guest.write(xa, &x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()).unwrap();
    assert!(transformer::sram_bytes(shape) < 4 << 20);
    run(&transformer::program(shape, wa, xa, oa), &mut guest);
    let mut out = vec![0u8; 4 * 16 * 64];
    guest.read(oa, &mut out).unwrap();
    let got = f32s(&out);
    let want = transformer::cpu(&w, &x);
    let err = max_abs_error(&got, &want);
    assert!(err < 1e-3, "max abs error {err}");
    // Layer-normed output: not all zeros, unit-ish scale.
    assert!(want.iter().map(|v| v.abs()).sum::<f32>() > 100.0);
}

#[test]
fn recsys_matches_the_cpu_and_is_vu_heavy() {
    use vnpu_guest_programs::recsys;
    let m = recsys::Model::random(5);
    let batch = 128;
    let idx = recsys::random_indices(batch, 6);
    let (table, mlp) = recsys::weight_bytes(&m);
    let (ta, ma, ia, oa) = (0x1000u64, 0x60000u64, 0x70000u64, 0x80000u64);
    let mut guest = VecGuestMemory::new(0, 1 << 20);
    guest.write(ta, &table).unwrap();
    guest.write(ma, &mlp).unwrap();
    guest.write(ia, &idx.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>()).unwrap();
    let (mut sram, mut hbm) = (Sram::new(4 << 20), LazyHbm::new(1 << 28));
    assert!(recsys::sram_bytes(batch) < 4 << 20);
    let cfg = BoardConfig::default();
    let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
    run_program(&cfg, &recsys::load(ta, ma), Some(mem), None).unwrap();
    let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
    let r = run_program(&cfg, &recsys::infer(batch, ia, oa), Some(mem), None).unwrap();
    let t = r.totals();
    assert!(t.vu_active_cycles > 3.0 * t.sa_active_cycles, "{t:?}");
    let mut out = vec![0u8; 4 * batch];
    guest.read(oa, &mut out).unwrap();
    let got = f32s(&out);
    let want = recsys::cpu(&m, &idx);
    let err = max_abs_error(&got, &want);
    assert!(err < 1e-5, "{err}");
    assert!(want.iter().any(|p| *p > 0.6) && want.iter().any(|p| *p < 0.4), "{want:?}");
}

/// The comparison these checks use fails an all-NaN output (and one NaN
/// among good values), which a fold with `f32::max` let through.
#[test]
fn a_nan_output_fails_the_checks() {
    let shape = transformer::Shape { seq: 16, d: 64, heads: 4, ffn: 128 };
    let want =
        transformer::cpu(&transformer::Weights::random(shape, 1), &transformer::random_input(shape, 2));
    let passes = |got: &[f32]| max_abs_error(got, &want) < 1e-3;
    assert!(!passes(&vec![f32::NAN; want.len()]), "all-NaN output passed");
    let mut one = want.clone();
    one[17] = f32::NAN;
    assert!(!passes(&one), "one NaN passed");
    assert!(!passes(&want[..want.len() - 1]), "a short output passed");
    assert!(passes(&want));
}
