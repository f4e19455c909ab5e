//! A client's DMA table under any sequence of maps, unmaps and file
//! growth: within its limits after each, its memory readable wherever it
//! claims (`vnpu_fuzz_harness::drive_dma`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_fuzz_harness::drive_dma(data);
});
