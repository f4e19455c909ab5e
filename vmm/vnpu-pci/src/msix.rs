//! MSI-X: the capability, the vector table and the pending-bit array.
//!
//! A vector fires only while MSI-X is enabled, the function is not masked
//! and the vector's own mask bit is clear. A vector that fires while masked
//! sets its pending bit instead; when the mask is lifted, pending vectors
//! are delivered and their bits cleared (PCI Local Bus spec, 6.8.2).

use crate::{ConfigSpace, PciError, CAP_ID_MSIX};

/// Bytes per table entry: address low, address high, data, vector control.
pub const MSIX_ENTRY_SIZE: u64 = 16;
const CTRL_ENABLE: u16 = 1 << 15;
const CTRL_FUNCTION_MASK: u16 = 1 << 14;

/// An MSI write the interrupt controller should see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsiMessage {
    /// The MSI-X vector (table entry) it came from.
    pub vector: u16,
    pub address: u64,
    pub data: u32,
}

/// Where the MSI-X capability sits in configuration space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixCap {
    pub offset: usize,
    pub vectors: u16,
}

impl MsixCap {
    /// Adds an MSI-X capability with `vectors` vectors (1..=2048) whose
    /// table is at `table_offset` in BAR `table_bar` and PBA at
    /// `pba_offset` in BAR `pba_bar` (offsets 8-byte aligned).
    pub fn add(
        config: &mut ConfigSpace,
        vectors: u16,
        table_bar: u8,
        table_offset: u32,
        pba_bar: u8,
        pba_offset: u32,
    ) -> Result<Self, PciError> {
        let ctrl = vectors.clamp(1, 2048) - 1;
        let mut body = Vec::with_capacity(10);
        body.extend_from_slice(&ctrl.to_le_bytes());
        body.extend_from_slice(&((table_offset & !7) | u32::from(table_bar & 7)).to_le_bytes());
        body.extend_from_slice(&((pba_offset & !7) | u32::from(pba_bar & 7)).to_le_bytes());
        // Only the enable and function-mask bits are writable.
        let writable = [0x00, 0xc0, 0, 0, 0, 0, 0, 0, 0, 0];
        let offset = config.add_capability(CAP_ID_MSIX, &body, &writable)?;
        Ok(Self { offset, vectors: ctrl + 1 })
    }

    fn control(&self, c: &ConfigSpace) -> u16 {
        c.read_u16(self.offset + 2)
    }

    /// MSI-X enable bit.
    pub fn enabled(&self, c: &ConfigSpace) -> bool {
        self.control(c) & CTRL_ENABLE != 0
    }

    /// Function mask bit.
    pub fn function_masked(&self, c: &ConfigSpace) -> bool {
        self.control(c) & CTRL_FUNCTION_MASK != 0
    }
}

/// The vector table and pending bits of a function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MsixTable {
    entries: Vec<[u32; 4]>,
    pending: Vec<bool>,
}

impl MsixTable {
    /// `vectors` entries, each masked as after reset.
    pub fn new(vectors: u16) -> Self {
        let n = usize::from(vectors.clamp(1, 2048));
        Self { entries: vec![[0, 0, 0, 1]; n], pending: vec![false; n] }
    }

    /// The table as words, for a snapshot: each entry's four words, then
    /// one word (0 or 1) per pending bit.
    pub fn saved(&self) -> Vec<u32> {
        let mut w: Vec<u32> = self.entries.iter().flatten().copied().collect();
        w.extend(self.pending.iter().map(|&p| u32::from(p)));
        w
    }

    /// Takes back what [`Self::saved`] gave (as many vectors as this
    /// table has, or an error and nothing changed).
    pub fn restore(&mut self, words: &[u32]) -> Result<(), crate::PciError> {
        let n = self.entries.len();
        if words.len() != 5 * n {
            return Err(crate::PciError::State("an MSI-X table of another size"));
        }
        for (e, w) in self.entries.iter_mut().zip(words.chunks_exact(4)) {
            e.copy_from_slice(w);
            // Of the control word only the mask bit is the guest's.
            e[3] &= 1;
        }
        for (p, w) in self.pending.iter_mut().zip(&words[4 * n..]) {
            *p = *w != 0;
        }
        Ok(())
    }

    /// Bytes the table occupies in its BAR.
    pub fn table_bytes(&self) -> u64 {
        self.entries.len() as u64 * MSIX_ENTRY_SIZE
    }

    /// Bytes the PBA occupies in its BAR (whole qwords).
    pub fn pba_bytes(&self) -> u64 {
        (self.entries.len() as u64).div_ceil(64) * 8
    }

    fn byte(&self, off: u64) -> u8 {
        let (Ok(e), w, b) = (usize::try_from(off / 16), ((off % 16) / 4) as usize, (off % 4) as usize) else {
            return 0;
        };
        self.entries.get(e).map_or(0, |en| en[w].to_le_bytes()[b])
    }

    /// A guest read of the table at `offset` (any width; outside reads 0).
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            *d = self.byte(offset.saturating_add(i as u64));
        }
    }

    /// A guest write to the table. Address and data are writable; of the
    /// vector control word only the mask bit is.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        for (i, d) in data.iter().enumerate() {
            let off = offset.saturating_add(i as u64);
            let (e, w, b) = ((off / 16) as usize, ((off % 16) / 4) as usize, (off % 4) * 8);
            let Some(en) = self.entries.get_mut(e) else { continue };
            let mask = if w == 3 {
                if b == 0 {
                    1u32
                } else {
                    0
                }
            } else {
                0xff
            } << b;
            en[w] = (en[w] & !mask) | ((u32::from(*d) << b) & mask);
        }
    }

    /// A guest read of the PBA at `offset` (writes to the PBA are ignored).
    pub fn pba_read(&self, offset: u64, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            let bit0 = offset.saturating_add(i as u64).saturating_mul(8);
            *d = (0..8u64)
                .filter(|k| {
                    usize::try_from(bit0.saturating_add(*k))
                        .ok()
                        .and_then(|i| self.pending.get(i))
                        .copied()
                        .unwrap_or(false)
                })
                .fold(0u8, |acc, k| acc | (1 << k));
        }
    }

    fn message(&self, v: usize) -> MsiMessage {
        let e = self.entries[v];
        // At most 2048 vectors (the MSI-X table size field).
        let vector = u16::try_from(v).unwrap_or(u16::MAX);
        MsiMessage { vector, address: u64::from(e[0]) | (u64::from(e[1]) << 32), data: e[2] }
    }

    fn masked(&self, v: usize) -> bool {
        self.entries[v][3] & 1 != 0
    }

    /// Whether `vector`'s own mask bit is set (a vector that does not
    /// exist counts as masked).
    pub fn is_masked(&self, vector: u16) -> bool {
        let v = usize::from(vector);
        v >= self.entries.len() || self.masked(v)
    }

    /// The message `vector` is programmed with, if it exists.
    pub fn entry_message(&self, vector: u16) -> Option<MsiMessage> {
        let v = usize::from(vector);
        (v < self.entries.len()).then(|| self.message(v))
    }

    /// The device raises `vector`. Returns the message to deliver now, or
    /// `None` when MSI-X is disabled (dropped), the vector does not exist
    /// (dropped), or it is masked (its pending bit is set).
    pub fn trigger(&mut self, vector: u16, enabled: bool, function_masked: bool) -> Option<MsiMessage> {
        let v = usize::from(vector);
        if !enabled || v >= self.entries.len() {
            return None;
        }
        if function_masked || self.masked(v) {
            self.pending[v] = true;
            return None;
        }
        Some(self.message(v))
    }

    /// After any change to masks or the enable bit: the pending vectors
    /// that may now be delivered, their pending bits cleared.
    pub fn take_deliverable(&mut self, enabled: bool, function_masked: bool) -> Vec<MsiMessage> {
        if !enabled || function_masked {
            return Vec::new();
        }
        let ready: Vec<usize> =
            (0..self.entries.len()).filter(|&v| self.pending[v] && !self.masked(v)).collect();
        ready
            .into_iter()
            .map(|v| {
                self.pending[v] = false;
                self.message(v)
            })
            .collect()
    }
}
