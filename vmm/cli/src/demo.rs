//! `vnpu demo`: boots the digits guest with a vNPU, shows what it prints
//! (accuracy on the vNPU and on the CPU, latency per image, counters), then
//! runs the very same batch programs in-process on the NPU model and
//! prints the wall-clock throughput ratio of the whole VM path
//! (guest -> ring -> verifier -> model -> interrupt) to the in-process
//! model (the issue 4 benchmark).

use std::path::PathBuf;
use std::time::Instant;

use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Memory, Sram, VecGuestMemory};
use vnpu_models::digits::{self, layout};

/// Where `scripts/build-guests.sh` puts the digits guest.
pub const DEFAULT_GUEST: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../guest-images/target/x86_64-unknown-none/release/digits");

static TEST_X: &[u8] = include_bytes!("../../../guest-images/digits/fixtures/test_x.bin");
static MLP: &[u8] = include_bytes!("../../../guest-images/digits/fixtures/mlp.bin");
static CNN: &[u8] = include_bytes!("../../../guest-images/digits/fixtures/cnn.bin");
/// Must match the guest's `BATCH_RUNS`.
const BATCH_RUNS: u32 = 10;
/// Untimed runs of the in-process baseline before timing.
const WARMUP_RUNS: u32 = 5;

/// Why the demo failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("the digits guest is not built ({0}); run `bash scripts/build-guests.sh` first")]
    NoGuest(String),
    #[error(transparent)]
    Vm(#[from] vnpu_vm::VmError),
    #[error("the guest exited with {0}")]
    Guest(u32),
    #[error("in-process baseline: {0}")]
    Baseline(String),
}

/// Images per second of the batch program of `model`, run in-process.
fn in_process(model: &str, board: &BoardConfig) -> Result<(f64, usize), DemoError> {
    let n = TEST_X.len() / (4 * digits::PIXELS);
    let (weights, at, plan, infer): (_, _, _, fn(_, _, _, _) -> _) = match model {
        "mlp" => (MLP, layout::MLP_WEIGHTS, layout::MLP_SRAM, digits::mlp_infer),
        _ => (CNN, layout::CNN_WEIGHTS, layout::CNN_SRAM, digits::cnn_infer),
    };
    let base = layout::MLP_WEIGHTS;
    let mut guest = VecGuestMemory::new(base, (layout::END - base) as usize);
    let err = |e: &dyn std::fmt::Display| DemoError::Baseline(e.to_string());
    guest.write(at, weights).map_err(|e| err(&e))?;
    guest.write(layout::TEST_X, TEST_X).map_err(|e| err(&e))?;
    let (mut sram, mut hbm) = (Sram::new(4 << 20), LazyHbm::new(1 << 30));
    let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
    run_program(board, &digits::load_weights(plan, at, weights.len()), Some(mem), None)
        .map_err(|e| err(&e))?;
    let program = infer(plan, n, layout::TEST_X, layout::BATCH_OUT);
    // Warm-up: the VM path's worker has served hundreds of requests by the
    // time the guest times its batches; give this thread a few too.
    for _ in 0..WARMUP_RUNS {
        let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
        run_program(board, &program, Some(mem), None).map_err(|e| err(&e))?;
    }
    let t0 = Instant::now();
    for _ in 0..BATCH_RUNS {
        let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
        run_program(board, &program, Some(mem), None).map_err(|e| err(&e))?;
    }
    let per_run = t0.elapsed().as_secs_f64() / f64::from(BATCH_RUNS);
    Ok((n as f64 / per_run, n))
}

/// Runs the demo; returns the guest's exit code (0 = vNPU and CPU agree).
pub fn run(guest: Option<PathBuf>, vnpu: vnpu_device::VnpuSpec, board: BoardConfig) -> Result<u8, DemoError> {
    let guest = guest.unwrap_or_else(|| PathBuf::from(DEFAULT_GUEST));
    if !guest.exists() {
        return Err(DemoError::NoGuest(guest.display().to_string()));
    }
    println!("booting {} with a vNPU on /dev/kvm", guest.display());
    let tee = crate::capture::Capture::echoing();
    let mut cfg = vnpu_vm::VmConfig::new(64 << 20, guest).vnpus(&[vnpu]);
    cfg.board = board.clone();
    let t0 = Instant::now();
    let code = vnpu_vm::Vm::new(&cfg, tee.clone())?.run()?;
    println!("VM wall time: {:.3} s", t0.elapsed().as_secs_f64());
    if code != 0 {
        return Err(DemoError::Guest(code));
    }
    let out = tee.text();
    for model in ["mlp", "cnn"] {
        let prefix = format!("throughput {model} batch_wall_ns=");
        let Some(ns) = out
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        // On a thread of its own, like the vNPU's worker.
        let b = board.clone();
        let (local, n) = std::thread::spawn(move || in_process(model, &b))
            .join()
            .map_err(|_| DemoError::Baseline("the baseline thread panicked".into()))??;
        let vm = n as f64 * 1e9 / ns;
        println!(
            "benchmark {model}: batch {n}, VM path {vm:.0} images/s, in-process model {local:.0} images/s, ratio {:.3}",
            vm / local
        );
    }
    Ok(0)
}
