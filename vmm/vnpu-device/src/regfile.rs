//! The BAR 0 register file (page 0), shared between the vCPU thread and the
//! NPU worker. Offsets and bits: `vnpu_abi::device`.

use vnpu_abi::device::{self as abi, regs};

use vnpu_spec::VnpuSpec;

use crate::persist::REG_BYTES as LEN;

/// Register bytes plus which of them the guest may write directly.
#[derive(Clone, Debug)]
pub(crate) struct RegFile {
    bytes: [u8; LEN],
    /// Some byte changed since [`RegFile::take_changed`] last looked (the
    /// device core saves its state at its save points only if so).
    changed: bool,
}

/// Byte ranges the guest writes as plain storage (side-effect registers are
/// handled by the function before storage).
const GUEST_WRITABLE: [(u64, u64); 3] = [
    (regs::QUEUE_SIZE, regs::QUEUE_ENABLE),
    (regs::QUEUE_VECTOR, regs::COMPLETED),
    (regs::MBOX_ARG0, regs::MBOX_RESULT),
];

impl RegFile {
    pub fn new() -> Self {
        Self { bytes: [0; LEN], changed: true }
    }

    /// Whether a byte changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The register bytes as they are (what the device core saves).
    pub fn snapshot(&self) -> [u8; LEN] {
        self.bytes
    }

    /// Takes the registers a guest's driver and the device change from
    /// `stored` (a restored state's), keeping this file's identity and
    /// board registers (`MAGIC` to `CLOCK_MHZ`, `QUEUE_SIZE_MAX`: the
    /// restarted daemon's own). `STATUS` keeps only the bits the device
    /// defines (a tampered record cannot show the guest others).
    pub fn resume(&mut self, stored: &[u8; LEN]) {
        let kept = |o: u64| {
            (regs::NUM_CHIPS..regs::INT_TEST).contains(&o)
                || o < regs::STATUS
                || (regs::QUEUE_SIZE_MAX..regs::QUEUE_SIZE).contains(&o)
        };
        for (o, b) in stored.iter().enumerate() {
            if !kept(o as u64) {
                self.bytes[o] = *b;
            }
        }
        let known = abi::STATUS_READY | abi::STATUS_QUEUE_READY | abi::STATUS_FAILED | abi::STATUS_RESETTING;
        let status = self.u32(regs::STATUS) & known;
        self.set_u32(regs::STATUS, status);
        self.changed = true;
    }

    pub fn u32(&self, off: u64) -> u32 {
        let Ok(o) = usize::try_from(off) else { return 0 };
        self.bytes.get(o..o.saturating_add(4)).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u64(&self, off: u64) -> u64 {
        u64::from(self.u32(off)) | u64::from(self.u32(off + 4)) << 32
    }

    pub fn set_u32(&mut self, off: u64, v: u32) {
        let Ok(o) = usize::try_from(off) else { return };
        if let Some(b) = self.bytes.get_mut(o..o.saturating_add(4)) {
            b.copy_from_slice(&v.to_le_bytes());
            self.changed = true;
        }
    }

    pub fn set_u64(&mut self, off: u64, v: u64) {
        self.set_u32(off, crate::low32(v));
        self.set_u32(off + 4, crate::low32(v >> 32));
    }

    pub fn update_u32(&mut self, off: u64, f: impl FnOnce(u32) -> u32) {
        let v = f(self.u32(off));
        self.set_u32(off, v);
    }

    /// Guest read of `data.len()` bytes at `off` (bytes past the file read 0).
    pub fn read(&self, off: u64, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            *d = off
                .checked_add(i as u64)
                .and_then(|o| usize::try_from(o).ok())
                .and_then(|o| self.bytes.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    /// Guest write: stores the bytes that fall in plain writable registers,
    /// ignores the rest.
    pub fn store(&mut self, off: u64, data: &[u8]) {
        for (i, d) in data.iter().enumerate() {
            let Some(o) = off.checked_add(i as u64) else { return };
            if GUEST_WRITABLE.iter().any(|&(a, b)| (a..b).contains(&o)) {
                if let Some(slot) = usize::try_from(o).ok().and_then(|o| self.bytes.get_mut(o)) {
                    *slot = *d;
                    self.changed = true;
                }
            }
        }
    }

    /// Shows `spec` in the hierarchy registers (all zero for `None`).
    pub fn set_hierarchy(&mut self, spec: Option<&VnpuSpec>) {
        let counts =
            spec.map_or([0; 4], |s| [s.chips(), s.cores_per_chip(), s.sa_per_core(), s.vu_per_core()]);
        let sizes = spec.map_or([0; 2], |s| [s.sram_per_core(), s.hbm_per_core()]);
        let count_regs = [regs::NUM_CHIPS, regs::CORES_PER_CHIP, regs::SA_PER_CORE, regs::VU_PER_CORE];
        for (reg, v) in count_regs.into_iter().zip(counts) {
            self.set_u32(reg, v);
        }
        self.set_u64(regs::SRAM_PER_CORE, sizes[0]);
        self.set_u64(regs::HBM_PER_CORE, sizes[1]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_registers_take_guest_writes() {
        let mut r = RegFile::new();
        r.set_u32(regs::STATUS, 1);
        r.store(regs::STATUS, &[0xff; 4]);
        assert_eq!(r.u32(regs::STATUS), 1);
        r.store(regs::QUEUE_DESC, &0x1234_5678_9abc_def0u64.to_le_bytes());
        assert_eq!(r.u64(regs::QUEUE_DESC), 0x1234_5678_9abc_def0);
        // A write straddling a writable and a read-only register.
        r.store(regs::MBOX_RESULT - 2, &[1, 2, 3, 4]);
        assert_eq!(r.u64(regs::MBOX_RESULT), 0);
        assert_eq!(r.u64(regs::MBOX_ARG0 + 40) >> 48, 0x0201);
        let mut b = [9u8; 8];
        r.read(u64::MAX - 3, &mut b);
        assert_eq!(b, [0; 8]);
    }

    /// A restored `STATUS` shows the guest only the bits the device
    /// defines: a tampered record's 0xfffffff1 reads 0x1.
    #[test]
    fn a_restored_status_keeps_only_defined_bits() {
        let mut stored = [0u8; LEN];
        stored[regs::STATUS as usize..regs::STATUS as usize + 4]
            .copy_from_slice(&0xffff_fff1u32.to_le_bytes());
        let mut r = RegFile::new();
        r.resume(&stored);
        assert_eq!(r.u32(regs::STATUS), 0x1);
        assert!(r.take_changed() && !r.take_changed());
    }
}
