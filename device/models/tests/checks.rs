//! The self-check cases and the Transformer layer, run in-process on the
//! NPU model, match their CPU references.
#![allow(clippy::unwrap_used)]

use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Memory, Sram, VecGuestMemory};
use vnpu_models::{f32s, selfcheck, transformer};

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
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-3, "max abs error {err}");
    // Layer-normed output: not all zeros, unit-ish scale.
    assert!(want.iter().map(|v| v.abs()).sum::<f32>() > 100.0);
}
