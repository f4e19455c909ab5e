//! The `vnpu_ring` fuzz target's harness.

use super::*;
use npu_model::config::{HBM_SLICE, SRAM_SLICE};

/// Drives a worker synchronously from fuzzer bytes (no thread): an
/// operation count, that many 16-byte operations (ring set-up with any
/// size and addresses, reset, mailbox commands, ring drains), then guest
/// memory contents. Used by the `vnpu_ring` fuzz target and a unit
/// test; not part of the device's API: built only for them (cargo-fuzz
/// builds with `--cfg fuzzing`).
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub fn fuzz_drive(data: &[u8]) {
    const MEM: usize = 16 << 10;
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]) else { return };
    // The first byte says how many 16-byte operations follow; the bytes
    // after them seed guest memory (repeated to fill it).
    let Some((&n, rest)) = data.split_first() else { return };
    let (ops, init) = rest.split_at(rest.len().min(16 * usize::from(n)));
    if !init.is_empty() {
        let fill: Vec<u8> = init.iter().copied().cycle().take(MEM).collect();
        let _ = mem.write_slice(&fill, GuestAddress(0));
    }
    let Ok(shared) = Shared::new(RegFile::new(), 8, Arc::new(crate::RecordingSink::default()), None) else {
        return;
    };
    // Completions raise vectors through the sink.
    lock(&shared.irq.state).enabled = true;
    let shared = Arc::new(shared);
    // The smallest segments a vNPU can have keep each run fast (HBM is
    // allocated lazily); a guest's CONFIGURE within them succeeds.
    let Ok(grant) = VnpuSpec::new(1, 2, 2, 2, SRAM_SLICE, HBM_SLICE) else {
        return;
    };
    let mut w = Worker::new(
        shared,
        mem,
        BoardConfig::default(),
        grant,
        DeviceOptions { poll: std::time::Duration::ZERO, ..Default::default() },
        "fuzz",
    );
    let u64_at = |b: &[u8], o: usize| {
        let mut x = [0u8; 8];
        for (i, v) in b.iter().skip(o).take(8).enumerate() {
            x[i] = *v;
        }
        u64::from_le_bytes(x)
    };
    for op in ops.chunks(16) {
        match op[0] % 4 {
            0 => w.enable(
                u32::from(op.get(1).copied().unwrap_or(8)),
                u64_at(op, 2) % (MEM as u64 + 64),
                u64_at(op, 6) % (MEM as u64),
                u64_at(op, 10) % (MEM as u64),
            ),
            1 => w.reset(),
            2 => {
                let args = [u64_at(op, 2) % 4, u64_at(op, 4) % 4, u64_at(op, 6), u64_at(op, 8), 1, 1];
                let _ = w.mailbox(u32::from(op.get(1).copied().unwrap_or(0) % 7), args);
            }
            _ => w.drain_ring(),
        }
    }
}

#[cfg(test)]
mod fuzz_tests {
    /// The fuzz harness runs on arbitrary bytes (smoke test of the target).
    #[test]
    fn fuzz_harness_survives_arbitrary_bytes() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [0usize, 1, 15, 16, 300, 5000, 20000] {
            let data: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            super::fuzz_drive(&data);
        }
        // Short operations (a harness bug the fuzzer found in its first minute).
        super::fuzz_drive(&[1, 0, 8, 0, 0, 0, 0, 0]);
        super::fuzz_drive(&[1, 2, 1, 9]);
    }
}
