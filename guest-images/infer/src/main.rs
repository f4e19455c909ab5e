//! The generic model runner (runs at CPL3; docs/inference-guests.md).
//!
//! `vnpu infer` hands it an inference job as the VMM's payload
//! (`vnpu_abi::model::job`): a compiled model and the inputs of `runs`
//! batches. The runner decodes and checks the model, opens the first vNPU,
//! checks that it is large enough, places the model's I/O window in DMA
//! memory, relocates both programs to it, runs the load program once,
//! registers the infer program (verified once by the hypervisor) and then,
//! per batch: copies the inputs into the window, runs the request (waiting
//! by interrupt), times it on the TSC, and copies the outputs and the
//! statistics back into the job. Exit code 0 when every batch ran; the
//! job's status and message say what failed otherwise.
#![no_std]
#![no_main]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use guest_rt::vnpu_driver::{RunOptions, Wait};
use guest_rt::{println, rdtsc, tsc_to_ns, Env};
use vnpu_abi::model::{job, relocate, Model};

/// Marks the job failed with `msg` (also printed) and returns exit code 1.
fn fail(payload: &mut [u8], msg: String) -> u32 {
    println!("infer: {msg}");
    payload[job::STATUS_AT..job::STATUS_AT + 4].copy_from_slice(&job::FAILED.to_le_bytes());
    let room = job::HEADER_BYTES - job::MESSAGE_AT;
    let m = msg.as_bytes();
    let n = m.len().min(room);
    payload[job::MESSAGE_AT..job::MESSAGE_AT + n].copy_from_slice(&m[..n]);
    1
}

fn section(p: &[u8], (off, len): (u64, u64)) -> &[u8] {
    &p[off as usize..(off + len) as usize]
}

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((at, len)) = env.payload else {
        println!("infer: no job (this guest is started by `vnpu infer`)");
        return 2;
    };
    // SAFETY: the payload is RAM at the top of the guest, identity-mapped,
    // outside the heap and the DMA region; nothing else uses it.
    let payload = unsafe { core::slice::from_raw_parts_mut(at as *mut u8, len) };
    let h = match job::Header::decode(payload) {
        Ok(h) => h,
        Err(e) => return fail(payload, format!("{e}")),
    };
    // The weights stay in the payload (they go straight to DMA memory):
    // the heap holds only the programs.
    let (mut model, weights_range) = match Model::decode_parts(section(payload, h.model)) {
        Ok((m, w)) => {
            let start = w.as_ptr() as usize - payload.as_ptr() as usize;
            (m, start..start + w.len())
        }
        Err(e) => return fail(payload, format!("the model: {e}")),
    };
    let in_bytes: u64 =
        model.inputs.iter().map(|t| t.bytes().unwrap_or(u64::MAX)).fold(0, u64::saturating_add);
    let out_bytes: u64 =
        model.outputs.iter().map(|t| t.bytes().unwrap_or(u64::MAX)).fold(0, u64::saturating_add);
    let runs = u64::from(h.runs);
    let stat_bytes = (job::STAT_WORDS * 8) as u64;
    if in_bytes.checked_mul(runs) != Some(h.inputs.1)
        || out_bytes.checked_mul(runs) != Some(h.outputs.1)
        || stat_bytes.checked_mul(runs) != Some(h.stats.1)
    {
        return fail(payload, format!("the job's sections do not match {runs} runs of this model"));
    }
    let Some((_, mut npu)) = guest_rt::vnpu::open_first(env) else {
        return fail(payload, "no vNPU to run on".into());
    };
    let hw = npu.hierarchy();
    let t = model.target;
    if hw.sa_per_core < t.sa
        || hw.vu_per_core < t.vu
        || hw.sram_per_core < t.sram_bytes
        || hw.hbm_per_core < t.hbm_bytes
    {
        return fail(
            payload,
            format!(
                "the model was compiled for {} SA, {} VU, {} KiB SRAM, {} MiB HBM; this vNPU core has {} SA, {} VU, {} KiB, {} MiB",
                t.sa,
                t.vu,
                t.sram_bytes >> 10,
                t.hbm_bytes >> 20,
                hw.sa_per_core,
                hw.vu_per_core,
                hw.sram_per_core >> 10,
                hw.hbm_per_core >> 20
            ),
        );
    }
    let window = match env.dma.alloc(model.window_bytes as usize, 4096) {
        Ok(w) => w,
        Err(e) => return fail(payload, format!("the I/O window of {} bytes: {e}", model.window_bytes)),
    };
    window.write(0, &payload[weights_range]);
    let phys = window.phys;
    if let Err(e) = relocate(&mut model.load, phys).and_then(|_| relocate(&mut model.infer, phys)) {
        return fail(payload, format!("{e}"));
    }
    let (load, infer) = (&model.load, &model.infer);
    let opts = RunOptions { wait: Wait::Interrupt, ..Default::default() };
    let loaded = npu.load(&mut env.dma, &load.encode()).and_then(|p| npu.run(&p, &opts));
    if let Err(e) = loaded {
        return fail(payload, format!("loading the weights: {e}"));
    }
    let handle = match npu.load(&mut env.dma, &infer.encode()).and_then(|p| npu.register(&p)) {
        Ok(h) => h,
        Err(e) => return fail(payload, format!("registering the infer program: {e}")),
    };
    let (mut inp, mut outp, mut statp) = (h.inputs.0 as usize, h.outputs.0 as usize, h.stats.0 as usize);
    for r in 0..h.runs {
        for d in &model.inputs {
            let n = d.bytes().unwrap_or(0) as usize;
            window.write(d.offset as usize, &payload[inp..inp + n]);
            inp += n;
        }
        let t0 = rdtsc();
        let st = match npu.run_registered(handle, &opts) {
            Ok(s) => s,
            Err(e) => return fail(payload, format!("batch {r}: {e}")),
        };
        let ns = tsc_to_ns(rdtsc().wrapping_sub(t0));
        for d in &model.outputs {
            let n = d.bytes().unwrap_or(0) as usize;
            window.read(d.offset as usize, &mut payload[outp..outp + n]);
            outp += n;
        }
        let stats = [ns, st.cycles, st.sa_active, st.vu_active, st.dma_active, st.flops, st.wall_ns, 0];
        for w in stats {
            payload[statp..statp + 8].copy_from_slice(&w.to_le_bytes());
            statp += 8;
        }
    }
    payload[job::STATUS_AT..job::STATUS_AT + 4].copy_from_slice(&job::DONE.to_le_bytes());
    println!("infer: {} batches of {} done", h.runs, t.batch);
    0
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
