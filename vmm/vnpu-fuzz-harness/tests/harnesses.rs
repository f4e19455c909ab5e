//! The fuzz harnesses on fixed inputs: random bytes, and inputs the
//! fuzzers found or that reach each harness's interesting paths. Each
//! must return without a panic (the session harness also checks that an
//! honest client is served afterwards).

/// Bytes of an xorshift sequence, the same on every run.
fn bytes(len: usize, mut x: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

#[test]
fn the_ring_harness_survives_arbitrary_bytes() {
    for (i, len) in [0usize, 1, 15, 16, 300, 5000, 20000].into_iter().enumerate() {
        vnpu_fuzz_harness::drive_ring(&bytes(len, 0x9e37_79b9_7f4a_7c15 + i as u64));
    }
    // Short operations (a harness bug the fuzzer found in its first minute).
    vnpu_fuzz_harness::drive_ring(&[1, 0, 8, 0, 0, 0, 0, 0]);
    vnpu_fuzz_harness::drive_ring(&[1, 2, 1, 9]);
    // A ring enabled on zeroed memory, drained, reset, drained again.
    let mut ops = vec![4u8];
    for op in [0u8, 3, 1, 3] {
        let mut o = [0u8; 16];
        o[0] = op;
        o[1] = 8;
        o[6] = 0x10; // avail at 0x1000
        o[10] = 0x20; // used at 0x2000
        ops.extend_from_slice(&o);
    }
    vnpu_fuzz_harness::drive_ring(&ops);
}

#[test]
fn the_server_harness_survives_garbage_and_well_formed_messages() {
    vnpu_fuzz_harness::serve_stream(&[]);
    vnpu_fuzz_harness::serve_stream(&[0xff; 100]);
    // A config-space read of 4 bytes, then a truncated header.
    let mut m = vec![1, 0, 9, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(&0u64.to_le_bytes());
    m.extend_from_slice(&7u32.to_le_bytes());
    m.extend_from_slice(&4u32.to_le_bytes());
    m.extend_from_slice(&[1, 0, 9]);
    vnpu_fuzz_harness::serve_stream(&m);
}

#[test]
fn sessions_of_garbage_descriptors_and_reconnects_leave_the_instance_serving() {
    vnpu_fuzz_harness::run_session(&[]);
    vnpu_fuzz_harness::run_session(&[1, 8, 0xff, 0xff, 0xff, 0xff]);
    // DMA_MAP (2) with a sealed memfd, an unsealed one, SET_IRQS (8)
    // with a pipe, a reconnect, VERSION (1) with an eventfd, raw junk.
    vnpu_fuzz_harness::run_session(&[
        2, 2, 32, 1, 1, 2, 2, 32, 1, 2, 3, 8, 20, 0, 4, 0, 2, 1, 4, 0, 3, 1, 3, 0xaa, 0xbb, 0xcc,
    ]);
    vnpu_fuzz_harness::run_session(&[0, 0, 0, 0]);
}

#[test]
fn the_dma_harness_survives_arbitrary_operations() {
    for (i, len) in [0usize, 8, 64, 800, 8000].into_iter().enumerate() {
        vnpu_fuzz_harness::drive_dma(&bytes(len, 0x2545_f491_4f6c_dd1d + i as u64));
    }
    // Map a file, grow it, map past its first size, split-unmap, unmap all.
    vnpu_fuzz_harness::drive_dma(&[
        0, 0, 0, 0, 4, 0, 0, 0, // map file 0, pages 0-3 at 0
        3, 0, 0, 0, 0, 8, 0, 0, // grow file 0 by 8 pages
        1, 0, 8, 0, 4, 4, 0, 0, // map file 0 from page 4 (past its first size)
        2, 0, 1, 0, 1, 1, 0, 0, // unmap one page in the middle
        2, 0, 0, 0, 1, 0, 0, 0, // unmap all
    ]);
}

#[test]
fn the_resume_harness_survives_tampered_session_folders() {
    // A valid record (nothing XORed), then records with bytes flipped
    // here and there, then garbage program and core files.
    vnpu_fuzz_harness::resume_from(&7u64.to_le_bytes());
    for (i, len) in [16usize, 100, 4104, 6000].into_iter().enumerate() {
        vnpu_fuzz_harness::resume_from(&bytes(len, 0x9e37_79b9_7f4a_7c15 ^ i as u64));
    }
    let mut files = vec![0u8; 8 + 4096];
    files[0] = 3;
    for (kind, len) in [(0u8, 64u16), (63, 3), (64, 4096), (65, 100)] {
        files.push(kind);
        files.extend_from_slice(&len.to_le_bytes());
        files.extend(bytes(usize::from(len), u64::from(kind) + 1));
    }
    vnpu_fuzz_harness::resume_from(&files);
}
