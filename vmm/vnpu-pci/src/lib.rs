//! PCI for the VMM: type-0 configuration space with BARs, a capability
//! list and MSI-X; a bus reached through the 0xCF8/0xCFC mechanism and an
//! ECAM window.
//!
//! Configuration space is 4 KiB of bytes with two masks: the bits software
//! may write, and the bits cleared by writing 1 (RW1C). Every access of any
//! width is applied byte by byte through those masks, so read-only fields
//! (IDs, class, header type, BAR size bits) stay what the device set,
//! whatever a guest writes.

// Configuration space is written by the guest: no silent narrowing casts.
#![cfg_attr(
    not(test),
    warn(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)
)]

mod msix;

pub use msix::{MsiMessage, MsixCap, MsixTable, MSIX_ENTRY_SIZE};

/// Size of a function's configuration space (PCIe: 4 KiB; conf1 reaches
/// the first 256 bytes).
pub const CONFIG_SIZE: usize = 4096;
/// Number of BARs of a type-0 header.
pub const NUM_BARS: usize = 6;
/// Devices on bus 0.
pub const DEVICES_PER_BUS: usize = 32;

/// Register offsets of a type-0 header.
pub mod reg {
    pub const VENDOR_ID: usize = 0x00;
    pub const DEVICE_ID: usize = 0x02;
    pub const COMMAND: usize = 0x04;
    pub const STATUS: usize = 0x06;
    pub const REVISION: usize = 0x08;
    pub const CLASS: usize = 0x09;
    pub const HEADER_TYPE: usize = 0x0e;
    pub const BAR0: usize = 0x10;
    pub const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
    pub const SUBSYSTEM_ID: usize = 0x2e;
    pub const CAPABILITIES: usize = 0x34;
    pub const INTERRUPT_LINE: usize = 0x3c;
    pub const INTERRUPT_PIN: usize = 0x3d;
}

/// Command register bits.
pub mod command {
    pub const IO_SPACE: u16 = 1 << 0;
    pub const MEMORY_SPACE: u16 = 1 << 1;
    pub const BUS_MASTER: u16 = 1 << 2;
    pub const INTX_DISABLE: u16 = 1 << 10;
    /// The bits a guest may change.
    pub const WRITABLE: u16 = IO_SPACE | MEMORY_SPACE | BUS_MASTER | INTX_DISABLE;
}

/// Status register: capability list present.
pub const STATUS_CAP_LIST: u16 = 1 << 4;
/// Capability ID of MSI-X.
pub const CAP_ID_MSIX: u8 = 0x11;
/// First capability offset.
const CAP_START: usize = 0x40;

/// What a BAR decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    Io,
    Mem32,
    /// Occupies this BAR and the next.
    Mem64 {
        prefetchable: bool,
    },
}

/// A BAR the device exposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bar {
    pub kind: BarKind,
    /// Size in bytes: a power of two, at least 16 (memory) or 4 (I/O).
    pub size: u64,
}

/// Why a configuration-space layout was refused (device construction
/// errors: never caused by a guest).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciError {
    #[error("BAR {index}: size {size:#x} is not a power of two of at least {min}")]
    BarSize { index: usize, size: u64, min: u64 },
    #[error("BAR {index}: index out of range or already used")]
    BarSlot { index: usize },
    #[error("capability of {len} bytes does not fit configuration space")]
    CapabilitySpace { len: usize },
    #[error("device slot {0} is out of range or taken")]
    Slot(usize),
    #[error("saved function state does not fit this function: {0}")]
    State(&'static str),
}

/// What a snapshot keeps of a function (`PciFunction::save_state`): its
/// configuration space as the guest left it, and the function's own
/// words (a vNPU's MSI-X table and pending bits).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionState {
    pub config: Vec<u8>,
    pub extra: Vec<u32>,
}

/// The low 32 bits of `x` (a BAR's size mask is written 32 bits at a time).
fn low32(x: u64) -> u32 {
    // Truncation is the point: the high half is masked off first.
    u32::try_from(x & 0xffff_ffff).unwrap_or(u32::MAX)
}

/// The identity of a function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub vendor_id: u16,
    pub device_id: u16,
    /// Class code (base, sub, programming interface) as `0xBBSSPP`.
    pub class: u32,
    pub revision: u8,
    pub subsystem_vendor_id: u16,
    pub subsystem_id: u16,
}

/// Configuration space of one type-0 function.
#[derive(Clone)]
pub struct ConfigSpace {
    bytes: Box<[u8; CONFIG_SIZE]>,
    writable: Box<[u8; CONFIG_SIZE]>,
    w1c: Box<[u8; CONFIG_SIZE]>,
    bars: [Option<Bar>; NUM_BARS],
    /// BAR registers in use (a 64-bit BAR uses two).
    used: [bool; NUM_BARS],
    next_cap: usize,
    last_cap: Option<usize>,
}

impl std::fmt::Debug for ConfigSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSpace")
            .field("vendor", &format_args!("{:#06x}", self.read_u16(reg::VENDOR_ID)))
            .field("device", &format_args!("{:#06x}", self.read_u16(reg::DEVICE_ID)))
            .field("bars", &self.bars)
            .finish_non_exhaustive()
    }
}

impl ConfigSpace {
    /// The configuration space's bytes, for a snapshot.
    pub fn saved(&self) -> Vec<u8> {
        self.bytes.to_vec()
    }

    /// Takes back what [`Self::saved`] gave: only the bits a guest can
    /// write or clear (BAR addresses, command, capability controls); the
    /// identity and layout stay this function's own, so a snapshot of
    /// another kind of function cannot change them.
    pub fn restore(&mut self, saved: &[u8]) -> Result<(), PciError> {
        if saved.len() != CONFIG_SIZE {
            return Err(PciError::State("configuration space of another size"));
        }
        for (i, &b) in saved.iter().enumerate() {
            let m = self.writable[i] | self.w1c[i];
            self.bytes[i] = (self.bytes[i] & !m) | (b & m);
        }
        Ok(())
    }

    /// A type-0 header with `id`; everything else zero and read-only except
    /// the command register and the interrupt line.
    pub fn new(id: Identity) -> Self {
        let mut c = Self {
            bytes: Box::new([0; CONFIG_SIZE]),
            writable: Box::new([0; CONFIG_SIZE]),
            w1c: Box::new([0; CONFIG_SIZE]),
            bars: [None; NUM_BARS],
            used: [false; NUM_BARS],
            next_cap: CAP_START,
            last_cap: None,
        };
        c.set_u16(reg::VENDOR_ID, id.vendor_id);
        c.set_u16(reg::DEVICE_ID, id.device_id);
        c.bytes[reg::REVISION] = id.revision;
        let [pi, sub, base, _] = id.class.to_le_bytes();
        c.bytes[reg::CLASS] = pi;
        c.bytes[reg::CLASS + 1] = sub;
        c.bytes[reg::CLASS + 2] = base;
        c.set_u16(reg::SUBSYSTEM_VENDOR_ID, id.subsystem_vendor_id);
        c.set_u16(reg::SUBSYSTEM_ID, id.subsystem_id);
        c.set_mask(reg::COMMAND, &command::WRITABLE.to_le_bytes());
        c.writable[reg::INTERRUPT_LINE] = 0xff;
        c
    }

    fn set_mask(&mut self, off: usize, mask: &[u8]) {
        self.writable[off..off + mask.len()].copy_from_slice(mask);
    }

    fn set_u16(&mut self, off: usize, v: u16) {
        self.bytes[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn set_u32(&mut self, off: usize, v: u32) {
        self.bytes[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// Reads a 16-bit register.
    pub fn read_u16(&self, off: usize) -> u16 {
        let mut b = [0u8; 2];
        self.read(off, &mut b);
        u16::from_le_bytes(b)
    }

    /// Reads a 32-bit register.
    pub fn read_u32(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        self.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    /// Reads `data.len()` bytes at `off`; bytes past the end read as 0xff.
    pub fn read(&self, off: usize, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            *d = self.bytes.get(off + i).copied().unwrap_or(0xff);
        }
    }

    /// Writes `data` at `off` through the masks: writable bits take the new
    /// value, RW1C bits written as 1 are cleared, everything else stays.
    /// Bytes past the end are dropped.
    pub fn write(&mut self, off: usize, data: &[u8]) {
        for (i, d) in data.iter().enumerate() {
            let Some(at) = off.checked_add(i).filter(|a| *a < CONFIG_SIZE) else { return };
            let (w, c) = (self.writable[at], self.w1c[at]);
            let old = self.bytes[at];
            self.bytes[at] = (old & !w) | (d & w);
            self.bytes[at] &= !(d & c);
        }
    }

    /// Declares BAR `index` (a 64-bit BAR also takes `index + 1`).
    pub fn add_bar(&mut self, index: usize, bar: Bar) -> Result<(), PciError> {
        let min = if bar.kind == BarKind::Io { 4 } else { 16 };
        let wide = matches!(bar.kind, BarKind::Mem64 { .. });
        let max: u64 = if wide { 1 << 40 } else { 1 << 31 };
        if !bar.size.is_power_of_two() || bar.size < min || bar.size > max {
            return Err(PciError::BarSize { index, size: bar.size, min });
        }
        let last = index + usize::from(wide);
        if last >= NUM_BARS || self.used[index] || self.used[last] {
            return Err(PciError::BarSlot { index });
        }
        self.used[index] = true;
        self.used[last] = true;
        let off = reg::BAR0 + 4 * index;
        let (flags, low_mask): (u32, u32) = match bar.kind {
            BarKind::Io => (0x1, !low32(bar.size - 1) & !0x3),
            BarKind::Mem32 => (0x0, !low32(bar.size - 1) & !0xf),
            BarKind::Mem64 { prefetchable } => {
                let low = if bar.size >= 1 << 32 { 0 } else { !low32(bar.size - 1) & !0xf };
                (0x4 | if prefetchable { 0x8 } else { 0 }, low)
            }
        };
        self.set_u32(off, flags);
        self.set_mask(off, &low_mask.to_le_bytes());
        if wide {
            let high_mask = !low32((bar.size - 1) >> 32);
            self.set_u32(off + 4, 0);
            self.set_mask(off + 4, &high_mask.to_le_bytes());
        }
        self.bars[index] = Some(bar);
        Ok(())
    }

    /// The BAR declared at `index`, if any.
    pub fn bar(&self, index: usize) -> Option<Bar> {
        self.bars.get(index).copied().flatten()
    }

    /// The address BAR `index` is programmed to (without flag bits).
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let bar = self.bar(index)?;
        let off = reg::BAR0 + 4 * index;
        let low = self.read_u32(off);
        Some(match bar.kind {
            BarKind::Io => u64::from(low & !0x3),
            BarKind::Mem32 => u64::from(low & !0xf),
            BarKind::Mem64 { .. } => u64::from(low & !0xf) | (u64::from(self.read_u32(off + 4)) << 32),
        })
    }

    /// Whether the guest enabled memory decoding (command register).
    pub fn memory_enabled(&self) -> bool {
        self.read_u16(reg::COMMAND) & command::MEMORY_SPACE != 0
    }

    /// Whether the guest enabled bus mastering (the device may DMA).
    pub fn bus_master(&self) -> bool {
        self.read_u16(reg::COMMAND) & command::BUS_MASTER != 0
    }

    /// Appends a capability (`id`, then `body` after the 2-byte header) to
    /// the list; `writable` masks `body` (same length, or empty for none).
    /// Returns its offset.
    pub fn add_capability(&mut self, id: u8, body: &[u8], writable: &[u8]) -> Result<usize, PciError> {
        let len = 2 + body.len();
        let off = self.next_cap;
        if off + len > 0x100 {
            return Err(PciError::CapabilitySpace { len });
        }
        self.bytes[off] = id;
        self.bytes[off + 1] = 0;
        self.bytes[off + 2..off + len].copy_from_slice(body);
        if !writable.is_empty() {
            self.set_mask(off + 2, &writable[..body.len().min(writable.len())]);
        }
        // Below 0x100: checked above.
        let link = u8::try_from(off).map_err(|_| PciError::CapabilitySpace { len })?;
        match self.last_cap {
            Some(prev) => self.bytes[prev + 1] = link,
            None => self.bytes[reg::CAPABILITIES] = link,
        }
        let status = self.read_u16(reg::STATUS) | STATUS_CAP_LIST;
        self.set_u16(reg::STATUS, status);
        self.last_cap = Some(off);
        self.next_cap = (off + len).next_multiple_of(4);
        Ok(off)
    }

    /// Offsets of the capabilities with `id`, found by walking the list
    /// (bounded, so a corrupt list cannot loop).
    pub fn find_capability(&self, id: u8) -> Option<usize> {
        let mut at = usize::from(self.bytes[reg::CAPABILITIES]);
        for _ in 0..48 {
            if !(CAP_START..0x100).contains(&at) {
                return None;
            }
            if self.bytes[at] == id {
                return Some(at);
            }
            at = usize::from(self.bytes[at + 1]);
        }
        None
    }
}

/// A function on the bus.
pub trait PciFunction: Send {
    fn config(&self) -> &ConfigSpace;
    fn config_mut(&mut self) -> &mut ConfigSpace;
    /// Called after a guest wrote configuration space (BAR moves, command
    /// and MSI-X control changes are acted on here).
    fn config_written(&mut self, _offset: usize, _len: usize) {}
    /// A guest read at `offset` into memory BAR `bar`.
    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    /// A guest write at `offset` into memory BAR `bar`.
    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
    /// MSI messages the function raised since the last call, in order.
    fn take_interrupts(&mut self) -> Vec<MsiMessage> {
        Vec::new()
    }
    /// The function's state for a snapshot (configuration space only,
    /// unless the function keeps more).
    fn save_state(&self) -> FunctionState {
        FunctionState { config: self.config().saved(), extra: Vec::new() }
    }
    /// Takes a state [`Self::save_state`] gave, then acts on the
    /// configuration as after a guest's write of all of it.
    fn restore_state(&mut self, s: &FunctionState) -> Result<(), PciError> {
        self.config_mut().restore(&s.config)?;
        self.config_written(0, CONFIG_SIZE);
        Ok(())
    }
}

/// A plain function: configuration space only (the host bridge).
#[derive(Debug, Clone)]
pub struct PlainFunction(pub ConfigSpace);

impl PciFunction for PlainFunction {
    fn config(&self) -> &ConfigSpace {
        &self.0
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.0
    }
}

/// I/O port of the conf1 address register.
pub const CONF1_ADDRESS: u16 = 0xcf8;
/// First I/O port of the conf1 data window (0xCFC..=0xCFF).
pub const CONF1_DATA: u16 = 0xcfc;

/// Bus 0 with up to 32 single-function devices.
pub struct PciBus {
    slots: Vec<Option<Box<dyn PciFunction>>>,
    conf1: u32,
}

impl std::fmt::Debug for PciBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let used: Vec<usize> =
            self.slots.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| i).collect();
        f.debug_struct("PciBus").field("devices", &used).finish()
    }
}

impl Default for PciBus {
    fn default() -> Self {
        Self::new()
    }
}

impl PciBus {
    pub fn new() -> Self {
        Self { slots: (0..DEVICES_PER_BUS).map(|_| None).collect(), conf1: 0 }
    }

    /// Places `f` at device number `slot` of bus 0.
    pub fn add(&mut self, slot: usize, f: Box<dyn PciFunction>) -> Result<(), PciError> {
        match self.slots.get_mut(slot) {
            Some(s @ None) => {
                *s = Some(f);
                Ok(())
            }
            _ => Err(PciError::Slot(slot)),
        }
    }

    /// The function at `slot`.
    pub fn function(&self, slot: usize) -> Option<&dyn PciFunction> {
        self.slots.get(slot)?.as_deref()
    }

    /// The function at `slot`, mutably.
    pub fn function_mut(&mut self, slot: usize) -> Option<&mut (dyn PciFunction + 'static)> {
        self.slots.get_mut(slot)?.as_deref_mut()
    }

    fn config_read(&self, bus: u32, dev: u32, func: u32, off: usize, data: &mut [u8]) {
        let f = (bus == 0 && func == 0).then(|| self.function(dev as usize)).flatten();
        match f {
            Some(f) => f.config().read(off, data),
            None => data.fill(0xff),
        }
    }

    fn config_write(&mut self, bus: u32, dev: u32, func: u32, off: usize, data: &[u8]) {
        if bus != 0 || func != 0 {
            return;
        }
        if let Some(f) = self.function_mut(dev as usize) {
            f.config_mut().write(off, data);
            f.config_written(off, data.len());
        }
    }

    /// A port read in 0xCF8..=0xCFF.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) {
        match port {
            CONF1_ADDRESS if data.len() == 4 => data.copy_from_slice(&self.conf1.to_le_bytes()),
            CONF1_DATA..=0xcff => {
                let a = self.conf1;
                let off = (a & 0xfc) as usize + usize::from(port - CONF1_DATA);
                if a & (1 << 31) == 0 || off + data.len() > 0x100 {
                    data.fill(0xff);
                } else {
                    self.config_read((a >> 16) & 0xff, (a >> 11) & 0x1f, (a >> 8) & 0x7, off, data);
                }
            }
            _ => data.fill(0xff),
        }
    }

    /// A port write in 0xCF8..=0xCFF.
    pub fn pio_write(&mut self, port: u16, data: &[u8]) {
        match port {
            CONF1_ADDRESS if data.len() == 4 => {
                let mut b = [0u8; 4];
                b.copy_from_slice(data);
                self.conf1 = u32::from_le_bytes(b) & 0x80ff_fffc;
            }
            CONF1_DATA..=0xcff => {
                let a = self.conf1;
                let off = (a & 0xfc) as usize + usize::from(port - CONF1_DATA);
                if a & (1 << 31) != 0 && off + data.len() <= 0x100 {
                    self.config_write((a >> 16) & 0xff, (a >> 11) & 0x1f, (a >> 8) & 0x7, off, data);
                }
            }
            _ => {}
        }
    }

    fn ecam_decode(offset: u64, len: usize) -> Option<(u32, u32, u32, usize)> {
        let reg = (offset & 0xfff) as usize;
        if reg + len > CONFIG_SIZE {
            return None;
        }
        Some((
            ((offset >> 20) & 0xff) as u32,
            ((offset >> 15) & 0x1f) as u32,
            ((offset >> 12) & 0x7) as u32,
            reg,
        ))
    }

    /// The function, BAR and offset that guest-physical `addr` (an access of
    /// `len` bytes) falls in: memory BARs of functions with memory decoding
    /// enabled and a non-zero address.
    fn bar_at(&self, addr: u64, len: usize) -> Option<(usize, usize, u64)> {
        for (slot, f) in self.slots.iter().enumerate() {
            let Some(f) = f else { continue };
            let c = f.config();
            if !c.memory_enabled() {
                continue;
            }
            for bar in 0..NUM_BARS {
                let (Some(b), Some(base)) = (c.bar(bar), c.bar_address(bar)) else { continue };
                if b.kind == BarKind::Io || base == 0 {
                    continue;
                }
                if let Some(off) = addr.checked_sub(base).filter(|o| o.saturating_add(len as u64) <= b.size) {
                    return Some((slot, bar, off));
                }
            }
        }
        None
    }

    /// A guest MMIO read: returns false when no BAR decodes `addr`.
    pub fn mmio_read(&mut self, addr: u64, data: &mut [u8]) -> bool {
        let Some((slot, bar, off)) = self.bar_at(addr, data.len()) else { return false };
        if let Some(f) = self.function_mut(slot) {
            f.bar_read(bar, off, data);
        }
        true
    }

    /// A guest MMIO write: returns false when no BAR decodes `addr`.
    pub fn mmio_write(&mut self, addr: u64, data: &[u8]) -> bool {
        let Some((slot, bar, off)) = self.bar_at(addr, data.len()) else { return false };
        if let Some(f) = self.function_mut(slot) {
            f.bar_write(bar, off, data);
        }
        true
    }

    /// MSI messages every function raised since the last call, with the
    /// slot of the function that raised each.
    pub fn take_interrupts(&mut self) -> Vec<(usize, MsiMessage)> {
        let mut out = Vec::new();
        for (slot, f) in self.slots.iter_mut().enumerate() {
            if let Some(f) = f {
                out.extend(f.take_interrupts().into_iter().map(|m| (slot, m)));
            }
        }
        out
    }

    /// A read at `offset` into the ECAM window.
    pub fn ecam_read(&self, offset: u64, data: &mut [u8]) {
        match Self::ecam_decode(offset, data.len()) {
            Some((b, d, f, r)) => self.config_read(b, d, f, r, data),
            None => data.fill(0xff),
        }
    }

    /// A write at `offset` into the ECAM window.
    pub fn ecam_write(&mut self, offset: u64, data: &[u8]) {
        if let Some((b, d, f, r)) = Self::ecam_decode(offset, data.len()) {
            self.config_write(b, d, f, r, data);
        }
    }
}

#[cfg(test)]
mod tests;
