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

/// A valid pre-copy of [`base`]'s vNPU (its HBM chunks written): the
/// pieces a sending core hands out, then its incremental stream at the
/// stop.
fn base_pieces() -> &'static [Vec<u8>] {
    static PIECES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    PIECES.get_or_init(|| {
        let Some(mut c) = core() else { return Vec::new() };
        if c.take_stream(base()).is_err() {
            return Vec::new();
        }
        let mut out = Vec::new();
        // Small pieces: one chunk each.
        while let Ok(p) = c.precopy(1) {
            if p.is_empty() || out.len() > 8 {
                break;
            }
            out.push(p);
        }
        if let Ok(s) = c.stop_stream() {
            out.push(s);
        }
        out
    })
}

/// Gives a fresh core a pre-copy (`docs/migration.md`, "Pre-copy of the
/// vNPU's HBM"): [`base_pieces`] with one part (the first byte says
/// which, the pieces and then the stream) spoiled by the rest of `data`,
/// XORed in as (offset u32, byte) pairs; or (first byte's top bit) the
/// rest of `data` as one piece before the valid parts. The core must
/// take each part or refuse it, never panic, and still be a device.
pub fn take_pieces(data: &[u8]) {
    let Some(mut core) = core() else { return };
    let mut parts: Vec<Vec<u8>> = base_pieces().to_vec();
    let Some((&first, rest)) = data.split_first() else { return };
    if first & 0x80 != 0 {
        let _ = core.take_piece(rest);
    } else if !parts.is_empty() {
        let i = usize::from(first) % parts.len();
        let b = &mut parts[i];
        for p in rest.chunks_exact(5) {
            let at = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
            let n = b.len().max(1);
            if let Some(x) = b.get_mut(at % n) {
                *x ^= p[4];
            }
        }
    }
    if let Some((stream, pieces)) = parts.split_last() {
        for p in pieces {
            let _ = core.take_piece(p);
        }
        let _ = core.take_stream(stream);
    }
    crate::resume::still_a_device(&mut core);
}

#[cfg(test)]
mod tests {
    #[test]
    fn valid_spoiled_and_raw_pre_copies_leave_a_device() {
        let parts = super::base_pieces();
        assert!(parts.len() >= 3, "pieces of one chunk each, then the stream: {}", parts.len());
        let mut c = super::core().unwrap();
        for p in &parts[..parts.len() - 1] {
            c.take_piece(p).unwrap();
        }
        c.take_stream(&parts[parts.len() - 1]).unwrap();
        super::take_pieces(&[]);
        super::take_pieces(&[0]);
        super::take_pieces(&[1, 30, 0, 0, 0, 0x55]);
        super::take_pieces(&[0x80]);
        super::take_pieces(b"\x80VNPUDLTA\x10\x00\x00\x00\x00\x00\x00\x00");
    }

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
