//! The generic model runner (runs at CPL3; docs/inference-guests.md).
//!
//! `vnpu infer` hands it an inference job as the VMM's payload
//! (`vnpu_abi::compiled_model::job`): a compiled model and the inputs of `runs`
//! batches. The runner decodes and checks the model, opens the first vNPU,
//! checks that it is large enough, places the model's I/O window in DMA
//! memory, relocates both programs to it, runs the load program once,
//! registers the infer program (verified once by the hypervisor) and then,
//! per batch: copies the inputs into the window, runs the request (waiting
//! by interrupt, or by polling once a request took less than 0.5 ms), times it on the TSC, and copies the outputs and the
//! statistics back into the job. Exit code 0 when every batch ran; the
//! job's status and message say what failed otherwise.
#![no_std]
#![no_main]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use guest_apps::infer::{self, Weights};
use guest_rt::vnpu_driver::Wait;
use guest_rt::{println, rdtsc, tsc_to_ns, Env};
use vnpu_abi::compiled_model::{job, Model};

/// Requests that took less than this (ns) are followed by polled ones.
const POLL_BELOW_NS: u64 = 500_000;

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
    // The weights stay in the payload (the device reads them there): the
    // heap holds only the programs.
    let (mut model, weights_range) = match Model::decode_parts(section(payload, h.model)) {
        Ok((m, w)) => {
            let start = w.as_ptr() as usize - payload.as_ptr() as usize;
            (m, start..start + w.len())
        }
        Err(e) => return fail(payload, format!("the model: {e}")),
    };
    let Some((in_bytes, out_bytes)) = infer::batch_bytes(&model) else {
        return fail(payload, "the model's tensor sizes overflow".into());
    };
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
    // The payload is identity-mapped guest RAM the device may read: the
    // load program reads the weights where the VMM put them.
    let weights = Weights::InPlace { phys: at + weights_range.start as u64, bytes: &payload[weights_range] };
    let mut loaded =
        match infer::load(&mut npu, &mut env.dma, &mut model, weights, Wait::Interrupt) {
            Ok(l) => l,
            Err(e) => return fail(payload, e),
        };
    let (ib, ob) = (in_bytes as usize, out_bytes as usize);
    let (inp, outp, statp) = (h.inputs.0 as usize, h.outputs.0 as usize, h.stats.0 as usize);
    let mut out = alloc::vec![0u8; ob];
    for r in 0..h.runs as usize {
        let input = &payload[inp + r * ib..inp + (r + 1) * ib];
        let (ticks, st) = match loaded.run(&mut npu, &model, input, &mut out, &rdtsc) {
            Ok(x) => x,
            Err(e) => return fail(payload, format!("batch {r}: {e}")),
        };
        payload[outp + r * ob..outp + (r + 1) * ob].copy_from_slice(&out);
        // A short request polls the used ring: its completion interrupt
        // would cost more than the request (an MSI reaches the handler in
        // about 21 us on this nested machine kind, and the handler runs at
        // CPL0, emulated), and spinning for less than POLL_BELOW_NS takes
        // little from anyone. A long one sleeps on its interrupt.
        loaded.set_wait(if tsc_to_ns(ticks) < POLL_BELOW_NS { Wait::Poll } else { Wait::Interrupt });
        let stats =
            [tsc_to_ns(ticks), st.cycles, st.sa_active, st.vu_active, st.dma_active, st.flops, st.wall_ns, 0];
        for (i, w) in stats.iter().enumerate() {
            let at = statp + (r * job::STAT_WORDS + i) * 8;
            payload[at..at + 8].copy_from_slice(&w.to_le_bytes());
        }
    }
    payload[job::STATUS_AT..job::STATUS_AT + 4].copy_from_slice(&job::DONE.to_le_bytes());
    println!("infer: {} batches of {} done", h.runs, model.target.batch);
    0
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
