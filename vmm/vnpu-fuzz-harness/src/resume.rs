//! The `session_resume` fuzz target's harness: a device core resuming a
//! session from a state folder whose files hold anything (a record that
//! is a valid one with fuzzer bytes XORed in, program files, core
//! memories of any size), as a tampered or half-written state directory
//! would have them. The core must resume or refuse, never panic, and
//! still answer its registers and drain its ring afterwards.

use std::path::PathBuf;
use std::sync::Arc;

use npu_model::config::{HBM_SLICE, SRAM_SLICE};
use npu_model::BoardConfig;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vnpu_abi::device::regs;
use vnpu_device::device_core::DeviceCore;
use vnpu_device::persist::RECORD_BYTES;
use vnpu_device::{DeviceOptions, DeviceState, MsiSink, SessionStore};
use vnpu_pci::MsiMessage;
use vnpu_spec::VnpuSpec;

struct Discard;

impl MsiSink for Discard {
    fn deliver(&self, _: MsiMessage) {}
}

/// The folder this process's runs use (made anew for each).
fn folder() -> PathBuf {
    std::env::temp_dir().join(format!("vnpu-fuzz-resume-{}", std::process::id()))
}

/// Lays `data` out as a session folder, then resumes a device core from
/// it: bytes 0-7 the session id of the base record, then up to
/// [`RECORD_BYTES`] XORed into a valid record of that id, then entries of
/// (kind, length u16, bytes): kind 0-63 a program file of that handle,
/// 64-65 core 0's SRAM or HBM file.
pub fn resume_from(data: &[u8]) {
    let dir = folder();
    let _ = std::fs::remove_dir_all(&dir);
    if std::fs::create_dir_all(&dir).is_err() || vnpu_device::prepare_files(&dir, 1).is_err() {
        return;
    }
    let id = data.get(..8).map_or(1, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    let mut record = [0u8; RECORD_BYTES];
    DeviceState::new(id).encode(&mut record);
    for (r, b) in record.iter_mut().zip(data.iter().skip(8)) {
        *r ^= b;
    }
    let _ = std::fs::write(dir.join("session"), record);
    let mut rest = data.get(8 + RECORD_BYTES..).unwrap_or(&[]);
    while let [kind, lo, hi, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*lo, *hi])).min(tail.len());
        let (bytes, next) = tail.split_at(len);
        let name = match kind % 66 {
            k @ 0..=63 => format!("program.{k}"),
            64 => "core0.sram".to_string(),
            _ => "core0.hbm".to_string(),
        };
        let _ = std::fs::write(dir.join(name), bytes);
        rest = next;
    }
    run(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

fn run(dir: &std::path::Path) {
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 16 << 10)]) else { return };
    let Ok(grant) = VnpuSpec::new(1, 2, 2, 2, SRAM_SLICE, HBM_SLICE) else { return };
    let opts = DeviceOptions { poll: std::time::Duration::ZERO, ..Default::default() };
    let Ok(mut core) = DeviceCore::detached(mem, &BoardConfig::default(), grant, opts, Arc::new(Discard))
    else {
        return;
    };
    let Ok(store) = SessionStore::open(dir) else { return };
    core.keep_in(Arc::new(store), true);
    core.handle_controls();
    still_a_device(&mut core);
}

/// Takes the ring of a core that resumed (or refused to) up, and checks
/// it is still a device: its registers answer and its ring drains.
pub(crate) fn still_a_device(core: &mut DeviceCore) {
    core.resume_session();
    core.handle_controls();
    let mut status = [0u8; 4];
    core.register_read(regs::STATUS, &mut status);
    core.drain_ring();
    core.handle_controls();
}
