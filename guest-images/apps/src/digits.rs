//! The digits classifier: loads the trained MLP and CNN (fixtures from
//! `scripts/train_digits.py`), classifies every held-out image on the vNPU
//! one at a time (latency) and as one batch (throughput), classifies them
//! again on the CPU with the same weights, and prints the accuracies, the
//! agreement, the latency per image and the vNPU's counters.

use alloc::vec::Vec;

use vnpu_abi::device as abi;
use vnpu_driver::{Bar, DmaBuf, DmaRegion, RunOptions, Vnpu};
use vnpu_guest_programs::digits::{self, bench, layout, SramPlan, CLASSES, PIXELS};
use vnpu_guest_programs::{argmax, f32s};

use crate::{out, sub, Platform};

static TEST_X: &[u8] = include_bytes!("../../digits/fixtures/test_x.bin");
static TEST_Y: &[u8] = include_bytes!("../../digits/fixtures/test_y.bin");
static MLP: &[u8] = include_bytes!("../../digits/fixtures/mlp.bin");
static CNN: &[u8] = include_bytes!("../../digits/fixtures/cnn.bin");

/// Bytes of the tensor area ([`Platform::data`]): `layout` relative to its
/// first address.
pub const DATA_BYTES: usize = (layout::END - layout::MLP_WEIGHTS) as usize;

/// The tensor area, with `layout`'s addresses moved to where it is.
struct Data(DmaBuf);

impl Data {
    /// The device address of `layout` address `at`.
    fn addr(&self, at: u64) -> u64 {
        self.0.phys + (at - layout::MLP_WEIGHTS)
    }
    /// `len` bytes at `layout` address `at`.
    fn buf(&self, at: u64, len: usize) -> DmaBuf {
        // Every `layout` range lies within DATA_BYTES, which `run` checked.
        sub(&self.0, at - layout::MLP_WEIGHTS, len).unwrap_or(DmaBuf { len: 0, ..self.0 })
    }
}

struct Model {
    name: &'static str,
    weights: &'static [u8],
    weights_at: u64,
    plan: SramPlan,
    infer: fn(SramPlan, usize, u64, u64) -> vnpu_abi::Program,
    cpu: fn(&[f32], &[f32]) -> [f32; CLASSES],
    /// Its index in the benchmark protocol (`bench::MLP`, `bench::CNN`).
    bench: u32,
}

fn counters<B: Bar>(npu: &mut Vnpu<B>, buf: &DmaBuf) -> Option<(u64, u64, u64)> {
    let n = npu.read_counters(buf).ok()?;
    let mut b = alloc::vec![0u8; n];
    buf.read(0, &mut b);
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    let (mut sa, mut vu) = (0, 0);
    let records = (n - abi::COUNTERS_HEADER_BYTES) / abi::COUNTERS_ENGINE_BYTES;
    for r in 0..records {
        let at = abi::COUNTERS_HEADER_BYTES + r * abi::COUNTERS_ENGINE_BYTES;
        match b[at] {
            1 => sa += u64_at(at + 8),
            2 => vu += u64_at(at + 8),
            _ => {}
        }
    }
    Some((u64_at(24), sa, vu))
}

fn run_model<B: Bar, P: Platform>(
    npu: &mut Vnpu<B>,
    dma: &mut DmaRegion,
    p: &P,
    data: &Data,
    m: &Model,
    counters_buf: &DmaBuf,
) -> Result<bool, ()> {
    let n = TEST_Y.len();
    let h = npu.hierarchy();
    let fail = |what: &str, e: &dyn core::fmt::Display| {
        out!(p, "{}: {what}: {e}", m.name);
    };
    let opts = RunOptions { wait: p.wait(), ..Default::default() };
    data.buf(m.weights_at, m.weights.len()).write(0, m.weights);
    let load = digits::load_weights(m.plan, data.addr(m.weights_at), m.weights.len()).encode();
    let load = npu.load(dma, &load).map_err(|e| fail("load", &e))?;
    npu.run(&load, &opts).map_err(|e| fail("weights", &e))?;
    let _ = npu.mailbox(abi::MBOX_RESET_COUNTERS, &[]);

    // One image at a time: the latency a client would see. Registered
    // once: the device decodes and verifies it once, and each run below
    // only names it.
    let one = (m.infer)(m.plan, 1, data.addr(layout::ONE_X), data.addr(layout::ONE_OUT)).encode();
    let one = npu.load(dma, &one).map_err(|e| fail("load", &e))?;
    let one = npu.register(&one).map_err(|e| fail("register", &e))?;
    let (x1, out1) = (data.buf(layout::ONE_X, 4 * PIXELS), data.buf(layout::ONE_OUT, 4 * CLASSES));
    let mut preds = Vec::with_capacity(n);
    let (mut wall, mut sim) = (0u64, 0u64);
    for i in 0..n {
        x1.write(0, &TEST_X[i * 4 * PIXELS..(i + 1) * 4 * PIXELS]);
        let t0 = p.now_ns();
        let st = npu.run_registered(one, &opts).map_err(|e| fail("run", &e))?;
        wall += p.now_ns() - t0;
        sim += st.cycles;
        let mut logits = [0f32; CLASSES];
        out1.read_f32s(0, &mut logits);
        preds.push(argmax(&logits));
    }
    let counted = counters(npu, counters_buf);

    // The whole split as one batch: throughput.
    data.buf(layout::TEST_X, TEST_X.len()).write(0, TEST_X);
    let batch = (m.infer)(m.plan, n, data.addr(layout::TEST_X), data.addr(layout::BATCH_OUT)).encode();
    let batch = npu.load(dma, &batch).map_err(|e| fail("load", &e))?;
    let batch = npu.register(&batch).map_err(|e| fail("register", &e))?;
    // Throughput: one request in flight, round by round interleaved with
    // the host's in-process run of the same program (`digits::bench`), so
    // both sides are timed on the same clock under the same conditions.
    let mut walls = Vec::with_capacity(bench::ROUNDS);
    let (mut batch_sim, mut batch_host) = (0, 0);
    for r in 0..bench::WARMUP + bench::ROUNDS {
        let warm = r < bench::WARMUP;
        let (t0, ns0) = (p.ticks(), p.now_ns());
        let st = npu.run_registered(batch, &opts).map_err(|e| fail("batch", &e))?;
        let (ticks, ns) = (p.ticks().wrapping_sub(t0), p.now_ns().wrapping_sub(ns0));
        p.host_round(bench::id(m.bench, warm), ticks);
        if !warm {
            walls.push(ns);
            batch_sim = st.cycles;
            batch_host += st.wall_ns;
        }
    }
    walls.sort_unstable();
    let batch_wall = walls[walls.len() / 2];
    let mut logits = alloc::vec![0u8; 4 * n * CLASSES];
    data.buf(layout::BATCH_OUT, logits.len()).read(0, &mut logits);
    let logits = f32s(&logits);

    // The CPU with the same weights.
    let (w, x) = (f32s(m.weights), f32s(TEST_X));
    let (mut ok_npu, mut ok_cpu, mut agree, mut batch_agree) = (0, 0, 0, 0);
    for i in 0..n {
        let cpu = argmax(&(m.cpu)(&w, &x[i * PIXELS..(i + 1) * PIXELS]));
        let label = usize::from(TEST_Y[i]);
        ok_npu += usize::from(preds[i] == label);
        ok_cpu += usize::from(cpu == label);
        agree += usize::from(preds[i] == cpu);
        batch_agree += usize::from(argmax(&logits[i * CLASSES..(i + 1) * CLASSES]) == preds[i]);
    }
    let mhz = u64::from(h.clock_mhz.max(1));
    out!(p, "model {} ({n} test images)", m.name);
    out!(
        p,
        "accuracy vnpu={:.4} cpu={:.4} model={} agree={agree}/{n} batch_agree={batch_agree}/{n}",
        ok_npu as f64 / n as f64,
        ok_cpu as f64 / n as f64,
        m.name
    );
    out!(
        p,
        "latency per image (batch 1): {:.1} us guest wall, {:.2} us simulated NPU time",
        (wall / n as u64) as f64 / 1000.0,
        (sim as f64 / n as f64) / mhz as f64
    );
    let batch_ns = batch_wall.max(1);
    out!(
        p,
        "batch of {n}: {:.0} images/s guest wall (median of {} runs, one in flight), {:.1} us simulated NPU time",
        n as f64 * 1e9 / batch_ns as f64,
        bench::ROUNDS,
        batch_sim as f64 / mhz as f64
    );
    out!(
        p,
        "throughput {} batch_wall_ns={batch_ns} min_ns={} max_ns={} runs={} images={n} device_host_ns={}",
        m.name,
        walls[0],
        walls[walls.len() - 1],
        bench::ROUNDS,
        batch_host / bench::ROUNDS as u64
    );
    if let Some((cycles, sa, vu)) = counted {
        let util = |a: u64, units: u32| 100.0 * a as f64 / (cycles.max(1) as f64 * f64::from(units.max(1)));
        out!(
            p,
            "counters (batch-1 runs): {cycles} cycles; SA active {sa} cycles ({:.1}% of {} SA), VU active {vu} cycles ({:.1}% of {} VU)",
            util(sa, h.sa_per_core),
            h.sa_per_core,
            util(vu, h.vu_per_core),
            h.vu_per_core
        );
    }
    let _ = npu.unregister(one);
    let _ = npu.unregister(batch);
    Ok(agree == n && batch_agree == n && ok_npu == ok_cpu)
}

/// Runs both models on `npu`; true when the vNPU and the CPU agree on
/// every image. `dma` holds programs and the counters buffer; the tensors
/// go in `p.data(DATA_BYTES)`.
pub fn run<B: Bar, P: Platform>(npu: &mut Vnpu<B>, dma: &mut DmaRegion, p: &P) -> bool {
    let h = npu.hierarchy();
    out!(
        p,
        "vnpu: {} chip x {} core, {} SA ({}x{}) + {} VU ({} lanes) per core, SRAM {} MiB, HBM {} MiB, {} MHz",
        h.chips,
        h.cores_per_chip,
        h.sa_per_core,
        h.sa_rows,
        h.sa_cols,
        h.vu_per_core,
        h.vu_lanes,
        h.sram_per_core >> 20,
        h.hbm_per_core >> 20,
        h.clock_mhz
    );
    let need = digits::cnn_sram_bytes(TEST_Y.len()) + layout::CNN_SRAM.base;
    if h.sram_per_core < need {
        out!(
            p,
            "this guest needs {} KiB of SRAM per core, the vNPU has {} KiB",
            need >> 10,
            h.sram_per_core >> 10
        );
        return false;
    }
    let Some(data) = p.data(DATA_BYTES).filter(|d| d.len >= DATA_BYTES).map(Data) else {
        out!(p, "this guest needs {DATA_BYTES} bytes of DMA memory for its tensors");
        return false;
    };
    let counters_buf = match dma.alloc(64 * 1024, 64) {
        Ok(b) => b,
        Err(e) => {
            out!(p, "{e}");
            return false;
        }
    };
    let models = [
        Model {
            name: "mlp",
            weights: MLP,
            weights_at: layout::MLP_WEIGHTS,
            plan: layout::MLP_SRAM,
            infer: digits::mlp_infer,
            cpu: digits::mlp_cpu,
            bench: bench::MLP,
        },
        Model {
            name: "cnn",
            weights: CNN,
            weights_at: layout::CNN_WEIGHTS,
            plan: layout::CNN_SRAM,
            infer: digits::cnn_infer,
            cpu: digits::cnn_cpu,
            bench: bench::CNN,
        },
    ];
    let mut ok = true;
    for m in &models {
        ok &= run_model(npu, dma, p, &data, m, &counters_buf).unwrap_or(false);
    }
    if ok {
        out!(p, "digits: vNPU and CPU agree on every image");
    } else {
        out!(p, "digits: MISMATCH between vNPU and CPU");
    }
    ok
}

/// Classifies every held-out image with the MLP, `rounds` times over, one
/// image per request, each against the CPU's answer with the same
/// weights, with the weights kept in the vNPU's SRAM and the program
/// registered once for the whole run: a device that lost either (a board
/// daemon that restarted without resuming the session) gives wrong
/// answers or errors. Prints each round and, at the end, how many
/// requests the driver submitted again after `ST_RETRY`; true when every
/// answer matched.
pub fn classify_rounds<B: Bar, P: Platform>(npu: &mut Vnpu<B>, dma: &mut DmaRegion, p: &P, rounds: u32) -> bool {
    classify_rounds_with(npu, dma, p, rounds, &mut |_, _, _| true)
}

/// [`classify_rounds`] with `each_round` called after every round (before
/// its line is printed) with the round's number; a round it fails ends
/// the run, false.
pub fn classify_rounds_with<B: Bar, P: Platform>(
    npu: &mut Vnpu<B>,
    dma: &mut DmaRegion,
    p: &P,
    rounds: u32,
    each_round: &mut dyn FnMut(&mut Vnpu<B>, &mut DmaRegion, u32) -> bool,
) -> bool {
    let Some(data) = p.data(DATA_BYTES).filter(|d| d.len >= DATA_BYTES).map(Data) else {
        out!(p, "this guest needs {DATA_BYTES} bytes of DMA memory for its tensors");
        return false;
    };
    let opts = RunOptions { wait: p.wait(), ..Default::default() };
    let plan = layout::MLP_SRAM;
    data.buf(layout::MLP_WEIGHTS, MLP.len()).write(0, MLP);
    let load = digits::load_weights(plan, data.addr(layout::MLP_WEIGHTS), MLP.len()).encode();
    let one = digits::mlp_infer(plan, 1, data.addr(layout::ONE_X), data.addr(layout::ONE_OUT)).encode();
    let (load, one) = match (npu.load(dma, &load), npu.load(dma, &one)) {
        (Ok(l), Ok(o)) => (l, o),
        _ => {
            out!(p, "no DMA memory for the programs");
            return false;
        }
    };
    if let Err(e) = npu.run(&load, &opts) {
        out!(p, "loading the weights: {e}");
        return false;
    }
    let one = match npu.register(&one) {
        Ok(h) => h,
        Err(e) => {
            out!(p, "register: {e}");
            return false;
        }
    };
    let n = TEST_Y.len();
    let (w, x) = (f32s(MLP), f32s(TEST_X));
    let cpu: Vec<usize> = (0..n).map(|i| argmax(&digits::mlp_cpu(&w, &x[i * PIXELS..(i + 1) * PIXELS]))).collect();
    let (x1, out1) = (data.buf(layout::ONE_X, 4 * PIXELS), data.buf(layout::ONE_OUT, 4 * CLASSES));
    let mut all = true;
    for r in 0..rounds {
        let mut agree = 0;
        for (i, want) in cpu.iter().enumerate() {
            x1.write(0, &TEST_X[i * 4 * PIXELS..(i + 1) * 4 * PIXELS]);
            // Last round's answer must not pass for this one's.
            out1.write(0, &[0xff; 4 * CLASSES]);
            if let Err(e) = npu.run_registered(one, &opts) {
                out!(p, "round {r} image {i}: {e}");
                return false;
            }
            let mut logits = [0f32; CLASSES];
            out1.read_f32s(0, &mut logits);
            agree += usize::from(logits.iter().all(|v| v.is_finite()) && argmax(&logits) == *want);
        }
        all &= agree == n;
        if !each_round(npu, dma, r) {
            return false;
        }
        out!(p, "round {r}: agree={agree}/{n} retried={}", npu.retried());
    }
    out!(p, "rounds={rounds} images={} all_agree={all} retried={}", rounds as usize * n, npu.retried());
    all
}
