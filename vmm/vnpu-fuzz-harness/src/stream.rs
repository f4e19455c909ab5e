//! The `device_stream` fuzz target's harness: a device core taking a
//! device stream (`docs/migration.md`, "The device stream") that a
//! vfio-user client wrote: a valid stream with the fuzzer's bytes XORed
//! in and cut where they say, or (first byte odd) the fuzzer's bytes as
//! they are. The core must take it or refuse it, never panic, and still
//! answer its registers and drain its ring afterwards.

use std::sync::{Arc, OnceLock};

use npu_model::config::{HBM_SLICE, SRAM_SLICE};
use npu_model::BoardConfig;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vnpu_device::device_core::DeviceCore;
use vnpu_device::{DeviceOptions, MsiSink};
use vnpu_pci::MsiMessage;
use vnpu_spec::VnpuSpec;

struct Discard;

impl MsiSink for Discard {
    fn deliver(&self, _: MsiMessage) {}
}

fn core() -> Option<DeviceCore> {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 16 << 10)]).ok()?;
    let grant = VnpuSpec::new(1, 2, 2, 2, SRAM_SLICE, HBM_SLICE).ok()?;
    let opts = DeviceOptions { poll: std::time::Duration::ZERO, ..Default::default() };
    DeviceCore::detached(mem, &BoardConfig::default(), grant, opts, Arc::new(Discard)).ok()
}

/// A valid stream of the grant's two-core configuration with memories:
/// the core's own stream (its record), then core 0's SRAM, HBM chunks
/// 0 and 3 of core 1, and the end with its CRC (the format of
/// `docs/migration.md`).
fn base() -> &'static [u8] {
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    BASE.get_or_init(|| {
        let Some(c) = core() else { return Vec::new() };
        let Ok(mut b) = c.stream() else { return Vec::new() };
        // Drop the end section (tag, length, CRC).
        b.truncate(b.len().saturating_sub(16));
        let section = |b: &mut Vec<u8>, tag: u32, body: &[u8]| {
            b.extend_from_slice(&tag.to_le_bytes());
            b.extend_from_slice(&(body.len() as u64).to_le_bytes());
            b.extend_from_slice(body);
        };
        let mut sram = 0u32.to_le_bytes().to_vec();
        sram.extend((0..SRAM_SLICE).map(|i| (i % 251) as u8));
        section(&mut b, 3, &sram);
        for chunk in [0u64, 3] {
            let mut h = 1u32.to_le_bytes().to_vec();
            h.extend_from_slice(&chunk.to_le_bytes());
            h.extend_from_slice(&[7u8; 4096]);
            section(&mut b, 4, &h);
        }
        let crc = crc32fast::hash(&b);
        section(&mut b, 0, &crc.to_le_bytes());
        b
    })
}

/// Gives a fresh core the stream `data` describes.
pub fn take_stream(data: &[u8]) {
    let Some(mut core) = core() else { return };
    let bytes = match data.split_first() {
        Some((first, rest)) if first & 1 == 1 => rest.to_vec(),
        Some((_, rest)) => {
            let mut b = base().to_vec();
            let (cut, xor) = rest.split_at(rest.len().min(4));
            let mut c = [0u8; 4];
            c[..cut.len()].copy_from_slice(cut);
            let keep = usize::try_from(u32::from_le_bytes(c)).unwrap_or(usize::MAX);
            if cut.len() == 4 {
                b.truncate(keep % (b.len() + 1));
            }
            // XORed in at the fuzzer's places: (offset u32, byte) pairs.
            for p in xor.chunks_exact(5) {
                let at = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
                let n = b.len().max(1);
                if let Some(x) = b.get_mut(at % n) {
                    *x ^= p[4];
                }
            }
            b
        }
        None => Vec::new(),
    };
    let _ = core.take_stream(&bytes);
    crate::resume::still_a_device(&mut core);
}

#[cfg(test)]
mod tests {
    #[test]
    fn valid_cut_spoiled_and_raw_streams_leave_a_device() {
        assert!(super::base().starts_with(b"VNPUSTRM"));
        // The base stream is one a core takes whole.
        let mut c = super::core().unwrap();
        c.take_stream(super::base()).unwrap();
        super::take_stream(&[]);
        super::take_stream(&[0]);
        super::take_stream(&[0, 0xff, 0xff, 0xff, 0xff]);
        super::take_stream(&[0, 10, 0, 0, 0, 100, 0, 0, 0, 0x55]);
        super::take_stream(b"\x01VNPUSTRM\x01\x00\x00\x00");
    }
}
