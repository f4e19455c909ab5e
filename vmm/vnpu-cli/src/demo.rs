//! `vnpu demo`: boots the digits guest with a vNPU, shows what it prints
//! (accuracy on the vNPU and on the CPU, latency per image, counters), and
//! benchmarks the whole VM path (guest -> ring -> verifier -> model ->
//! interrupt) against the very same batch programs run in-process on the
//! NPU model (docs/benchmarks.md, "Inference through the VM"): round by
//! round, interleaved, both sides on the TSC, one request in flight on
//! each (`vnpu_guest_programs::digits::bench`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Memory, Sram, VecGuestMemory};
use vnpu_abi::Program;
use vnpu_guest_programs::digits::{self, bench, layout};

/// Where `scripts/build-guests.sh` puts the digits guest.
pub const DEFAULT_GUEST: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../guest-images/target/x86_64-unknown-none/release/digits");

static TEST_X: &[u8] = include_bytes!("../../../guest-images/digits/fixtures/test_x.bin");
static MLP: &[u8] = include_bytes!("../../../guest-images/digits/fixtures/mlp.bin");
static CNN: &[u8] = include_bytes!("../../../guest-images/digits/fixtures/cnn.bin");

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

/// The TSC, the clock the guest times its side with (a vCPU reads the
/// host's TSC plus a constant offset).
fn rdtsc() -> u64 {
    // SAFETY: `rdtsc` reads a counter; no memory is touched.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// One model's batch program, run in-process on a private copy of the
/// guest's tensors at the guest's addresses.
struct Baseline {
    sram: Sram,
    hbm: LazyHbm,
    guest: VecGuestMemory,
    program: Program,
}

impl Baseline {
    /// Loads `model`'s weights into a fresh core (untimed).
    fn new(model: u32, board: &BoardConfig) -> Result<Self, DemoError> {
        let n = TEST_X.len() / (4 * digits::PIXELS);
        let (weights, at, plan, infer): (_, _, _, fn(_, _, _, _) -> _) = if model == bench::MLP {
            (MLP, layout::MLP_WEIGHTS, layout::MLP_SRAM, digits::mlp_infer)
        } else {
            (CNN, layout::CNN_WEIGHTS, layout::CNN_SRAM, digits::cnn_infer)
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
        Ok(Self { sram, hbm, guest, program })
    }

    /// Runs the batch program once; its TSC ticks.
    fn run(&mut self, board: &BoardConfig) -> Result<u64, DemoError> {
        let t0 = rdtsc();
        let mem = CoreMemory { sram: &mut self.sram, hbm: &mut self.hbm, guest: &mut self.guest };
        run_program(board, &self.program, Some(mem), None).map_err(|e| DemoError::Baseline(e.to_string()))?;
        Ok(rdtsc().wrapping_sub(t0))
    }
}

/// The host side of the interleaved benchmark (the VM's benchmark hook).
struct HostSide {
    board: BoardConfig,
    baselines: [Option<Baseline>; 2],
    /// Per model: the timed rounds, (VM path ticks, in-process ticks).
    rounds: [Vec<(u64, u64)>; 2],
    error: Option<DemoError>,
}

impl HostSide {
    /// After the guest's round of benchmark `id` that took `vm_ticks`: the
    /// same program in-process, once.
    fn round(&mut self, id: u32, vm_ticks: u64) {
        let Some((model, warm)) = bench::parse(id) else { return };
        if self.error.is_some() {
            return;
        }
        let slot = model as usize;
        let host = match &mut self.baselines[slot] {
            Some(b) => b.run(&self.board),
            None => Baseline::new(model, &self.board).and_then(|mut b| {
                let t = b.run(&self.board);
                self.baselines[slot] = Some(b);
                t
            }),
        };
        match host {
            Ok(t) if !warm => self.rounds[slot].push((vm_ticks, t)),
            Ok(_) => {}
            Err(e) => self.error = Some(e),
        }
    }
}

/// Minimum, median and maximum of `v` (sorted in place; zeros if empty).
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    match v {
        [] => (0.0, 0.0, 0.0),
        _ => (v[0], v[v.len() / 2], v[v.len() - 1]),
    }
}

/// Runs the demo; returns the guest's exit code (0 = vNPU and CPU agree).
pub fn run(guest: Option<PathBuf>, vnpu: vnpu_spec::VnpuSpec, board: BoardConfig) -> Result<u8, DemoError> {
    let guest = guest.unwrap_or_else(|| PathBuf::from(DEFAULT_GUEST));
    if !guest.exists() {
        return Err(DemoError::NoGuest(guest.display().to_string()));
    }
    println!("booting {} with a vNPU on /dev/kvm", guest.display());
    let mut cfg = vnpu_vm::VmConfig::new(64 << 20, guest).vnpus(&[vnpu]);
    cfg.board = board.clone();
    let host = Arc::new(Mutex::new(HostSide {
        board,
        baselines: [None, None],
        rounds: [Vec::new(), Vec::new()],
        error: None,
    }));
    let mut vm = vnpu_vm::Vm::new(&cfg, std::io::stdout())?;
    let side = Arc::clone(&host);
    vm.set_benchmark_hook(Box::new(move |id, ticks| {
        side.lock().unwrap_or_else(PoisonError::into_inner).round(id, ticks)
    }));
    let vcpu_khz = vm.tsc_khz();
    let (t0, tsc0) = (Instant::now(), rdtsc());
    let code = vm.run()?;
    let (wall, ticks) = (t0.elapsed().as_secs_f64(), rdtsc().wrapping_sub(tsc0));
    println!("VM wall time: {wall:.3} s");
    if code != 0 {
        return Err(DemoError::Guest(code));
    }
    drop(vm);
    let mut host = host.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(e) = host.error.take() {
        return Err(e);
    }
    // The TSC rate: the vCPU's (what the guest was told), checked against
    // the host's TSC over the run measured with CLOCK_MONOTONIC.
    let host_khz = ticks as f64 / wall / 1e3;
    let khz = if vcpu_khz > 0 { f64::from(vcpu_khz) } else { host_khz };
    println!(
        "benchmark clock: TSC at {khz:.0} kHz (vCPU rate {vcpu_khz} kHz; host TSC against CLOCK_MONOTONIC over the run {host_khz:.0} kHz)"
    );
    let n = TEST_X.len() / (4 * digits::PIXELS);
    for (model, name) in [(bench::MLP, "mlp"), (bench::CNN, "cnn")] {
        let rounds = &host.rounds[model as usize];
        if rounds.is_empty() {
            continue;
        }
        let us = |t: u64| t as f64 / khz * 1e3;
        let (vl, vm, vh) = spread(&mut rounds.iter().map(|r| us(r.0)).collect::<Vec<_>>());
        let (hl, hm, hh) = spread(&mut rounds.iter().map(|r| us(r.1)).collect::<Vec<_>>());
        // Throughput ratio VM path / in-process = in-process time / VM time.
        let (rl, rm, rh) =
            spread(&mut rounds.iter().map(|r| r.1 as f64 / r.0.max(1) as f64).collect::<Vec<_>>());
        println!(
            "benchmark {name}: batch {n}, {} interleaved runs, one request in flight; \
             VM path min/median/max {vl:.0}/{vm:.0}/{vh:.0} us ({:.0} images/s at the median), \
             in-process min/median/max {hl:.0}/{hm:.0}/{hh:.0} us ({:.0} images/s); \
             throughput ratio VM/in-process per run min/median/max {rl:.3}/{rm:.3}/{rh:.3}",
            rounds.len(),
            n as f64 * 1e6 / vm.max(f64::MIN_POSITIVE),
            n as f64 * 1e6 / hm.max(f64::MIN_POSITIVE),
        );
    }
    Ok(0)
}
