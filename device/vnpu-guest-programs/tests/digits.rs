//! The digit classifiers' vNPU programs, run on the NPU model in-process,
//! agree image for image with the CPU reference on the committed test split.
#![allow(clippy::unwrap_used)]

use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Memory, Sram, VecGuestMemory};
use vnpu_guest_programs::digits::{self, SramPlan, CLASSES, PIXELS};
use vnpu_guest_programs::{argmax, f32s};

const FIX: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../guest-images/digits/fixtures/");

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIX}{name}")).unwrap()
}

fn check(
    weights_file: &str,
    bytes: usize,
    cpu: fn(&[f32], &[f32]) -> [f32; CLASSES],
    build: fn(SramPlan, usize, u64, u64) -> vnpu_abi::Program,
) -> f64 {
    let w = fixture(weights_file);
    assert_eq!(w.len(), bytes);
    let x = fixture("test_x.bin");
    let y = fixture("test_y.bin");
    let n = y.len();
    let (wa, xa, oa) = (0x1000u64, 0x10000u64, 0x80000u64);
    let mut guest = VecGuestMemory::new(0, 1 << 20);
    guest.write(wa, &w).unwrap();
    guest.write(xa, &x).unwrap();
    let (mut sram, mut hbm) = (Sram::new(4 << 20), LazyHbm::new(1 << 28));
    let plan = SramPlan { base: 0x1000 };
    let cfg = BoardConfig::default();
    let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
    run_program(&cfg, &digits::load_weights(plan, wa, bytes), Some(mem), None).unwrap();
    let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
    let r = run_program(&cfg, &build(plan, n, xa, oa), Some(mem), None).unwrap();
    assert!(r.cycles > 0.0);
    let mut out = vec![0u8; 4 * n * CLASSES];
    guest.read(oa, &mut out).unwrap();
    let logits = f32s(&out);
    let (wf, xf) = (f32s(&w), f32s(&x));
    let mut correct = 0;
    for i in 0..n {
        let npu = argmax(&logits[i * CLASSES..(i + 1) * CLASSES]);
        let c = cpu(&wf, &xf[i * PIXELS..(i + 1) * PIXELS]);
        assert_eq!(npu, argmax(&c), "image {i}");
        for (a, b) in logits[i * CLASSES..(i + 1) * CLASSES].iter().zip(c) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "image {i}: {a} vs {b}");
        }
        correct += usize::from(npu == usize::from(y[i]));
    }
    correct as f64 / n as f64
}

#[test]
fn mlp_matches_the_cpu_and_the_training_script() {
    let acc = check("mlp.bin", digits::MLP_BYTES, digits::mlp_cpu, digits::mlp_infer);
    assert!((acc - 0.97333).abs() < 1e-4, "{acc}");
}

#[test]
fn cnn_matches_the_cpu_and_the_training_script() {
    let acc = check("cnn.bin", digits::CNN_BYTES, digits::cnn_cpu, digits::cnn_infer);
    assert!((acc - 0.99111).abs() < 1e-4, "{acc}");
}
