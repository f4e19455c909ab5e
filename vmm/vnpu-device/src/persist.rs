//! The vNPU's state as it leaves the device core and comes back: one
//! versioned record, the only format in which a vNPU's registers,
//! configuration and ring position are saved (a served vNPU's session
//! record, `SessionStore`; `docs/vfio-user.md`, "Daemon restarts"). The
//! core saves it at its boundary (after control work, around each request)
//! and a restarted daemon restores from it; registered programs and the
//! cores' SRAM and HBM live in files of their own beside it.
//!
//! Layout of the record (little-endian), version 2:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..8 | magic `VNPUSTAT` |
//! | 8..12 | version (2) |
//! | 12..16 | flags: bit 0 configured, bit 1 a request in flight |
//! | 16..24 | session id |
//! | 24..56 | configuration: u32 chips, cores per chip, SAs, VUs; u64 SRAM, HBM bytes per core |
//! | 56..58 | ring index of the request in flight |
//! | 64..256 | the BAR 0 register bytes (`regs::END` of them) |
//! | 256..264 | FNV-1a of bytes 0..256 |
//!
//! A record of another version, with a wrong checksum or a configuration
//! that is not a valid shape is refused with the reason ([`StateError`]).

use thiserror::Error;
use vnpu_abi::device::regs;
use vnpu_spec::VnpuSpec;

/// Bytes of BAR 0 that hold registers.
// 0xc0: the cast cannot truncate.
#[allow(clippy::cast_possible_truncation)]
pub const REG_BYTES: usize = regs::END as usize;
/// Size of the record.
pub const RECORD_BYTES: usize = 4096;
/// The format this build writes and reads.
pub const VERSION: u32 = 2;
/// `VNPUSTAT`.
const MAGIC: u64 = u64::from_le_bytes(*b"VNPUSTAT");

const AT_MAGIC: usize = 0;
const AT_VERSION: usize = 8;
const AT_FLAGS: usize = 12;
const AT_SESSION: usize = 16;
const AT_CONFIG: usize = 24;
const AT_IN_FLIGHT: usize = 56;
const AT_REGS: usize = 64;
const AT_CHECKSUM: usize = AT_REGS + REG_BYTES;

const CONFIGURED: u32 = 1;
const IN_FLIGHT: u32 = 2;

/// A record that cannot be restored.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum StateError {
    #[error("device state record is {0} bytes, expected {RECORD_BYTES}")]
    Size(usize),
    #[error("device state version {found}; this build reads version {VERSION}")]
    Version { found: u32 },
    #[error("device state checksum mismatch: the record is corrupt")]
    Checksum,
    #[error("device state holds an invalid configuration: {0}")]
    Config(#[source] vnpu_spec::ShapeError),
}

/// What a vNPU's device core saves and restores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceState {
    /// The session the state belongs to (its client names it to resume).
    pub session: u64,
    /// The vNPU's configuration (`None`: released).
    pub config: Option<VnpuSpec>,
    /// Ring index of the request that was running, if one was.
    pub in_flight: Option<u16>,
    /// The BAR 0 register bytes.
    pub regs: [u8; REG_BYTES],
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

fn put(rec: &mut [u8], at: usize, v: &[u8]) {
    rec[at..at + v.len()].copy_from_slice(v);
}

fn u32_at(rec: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&rec[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(rec: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&rec[at..at + 8]);
    u64::from_le_bytes(b)
}

impl DeviceState {
    /// A fresh session's state: no configuration, nothing in flight, the
    /// registers zero.
    pub fn new(session: u64) -> Self {
        Self { session, config: None, in_flight: None, regs: [0; REG_BYTES] }
    }

    /// Writes the record into `rec` (bytes past the fields are zeroed).
    pub fn encode(&self, rec: &mut [u8; RECORD_BYTES]) {
        rec.fill(0);
        put(rec, AT_MAGIC, &MAGIC.to_le_bytes());
        put(rec, AT_VERSION, &VERSION.to_le_bytes());
        let flags = if self.config.is_some() { CONFIGURED } else { 0 }
            | if self.in_flight.is_some() { IN_FLIGHT } else { 0 };
        put(rec, AT_FLAGS, &flags.to_le_bytes());
        put(rec, AT_SESSION, &self.session.to_le_bytes());
        if let Some(c) = self.config {
            for (i, w) in [c.chips(), c.cores_per_chip(), c.sa_per_core(), c.vu_per_core()].iter().enumerate()
            {
                put(rec, AT_CONFIG + 4 * i, &w.to_le_bytes());
            }
            put(rec, AT_CONFIG + 16, &c.sram_per_core().to_le_bytes());
            put(rec, AT_CONFIG + 24, &c.hbm_per_core().to_le_bytes());
        }
        put(rec, AT_IN_FLIGHT, &self.in_flight.unwrap_or(0).to_le_bytes());
        put(rec, AT_REGS, &self.regs);
        let sum = fnv1a(&rec[..AT_CHECKSUM]);
        put(rec, AT_CHECKSUM, &sum.to_le_bytes());
    }

    /// Reads a record: `Ok(None)` when it holds no state (never written,
    /// or invalidated: no magic), the state when it is whole, else why not.
    pub fn decode(rec: &[u8]) -> Result<Option<Self>, StateError> {
        if rec.len() != RECORD_BYTES {
            return Err(StateError::Size(rec.len()));
        }
        if u64_at(rec, AT_MAGIC) != MAGIC {
            return Ok(None);
        }
        let found = u32_at(rec, AT_VERSION);
        if found != VERSION {
            return Err(StateError::Version { found });
        }
        if u64_at(rec, AT_CHECKSUM) != fnv1a(&rec[..AT_CHECKSUM]) {
            return Err(StateError::Checksum);
        }
        let flags = u32_at(rec, AT_FLAGS);
        let config = if flags & CONFIGURED != 0 {
            let w = |i: usize| u32_at(rec, AT_CONFIG + 4 * i);
            let c = VnpuSpec::new(
                w(0),
                w(1),
                w(2),
                w(3),
                u64_at(rec, AT_CONFIG + 16),
                u64_at(rec, AT_CONFIG + 24),
            )
            .map_err(StateError::Config)?;
            Some(c)
        } else {
            None
        };
        let in_flight =
            (flags & IN_FLIGHT != 0).then(|| u16::from_le_bytes([rec[AT_IN_FLIGHT], rec[AT_IN_FLIGHT + 1]]));
        let mut regs = [0u8; REG_BYTES];
        regs.copy_from_slice(&rec[AT_REGS..AT_CHECKSUM]);
        Ok(Some(Self { session: u64_at(rec, AT_SESSION), config, in_flight, regs }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DeviceState {
        let mut s = DeviceState::new(42);
        s.config = VnpuSpec::parse("sa=2,vu=1,sram=4M,hbm=1G,cores=2").ok();
        s.in_flight = Some(7);
        s.regs[8] = 3;
        s.regs[REG_BYTES - 1] = 0xab;
        s
    }

    #[test]
    fn a_state_round_trips_through_its_record() {
        let mut rec = [0u8; RECORD_BYTES];
        for s in [sample(), DeviceState::new(0)] {
            s.encode(&mut rec);
            assert_eq!(DeviceState::decode(&rec), Ok(Some(s)));
        }
        // No magic: no state.
        assert_eq!(DeviceState::decode(&[0u8; RECORD_BYTES]), Ok(None));
    }

    /// Another version, a flipped bit anywhere in the fields, a wrong size
    /// and an invalid shape are refused with the reason.
    #[test]
    fn another_version_or_a_corrupt_record_is_refused() {
        let mut rec = [0u8; RECORD_BYTES];
        sample().encode(&mut rec);
        let mut other = rec;
        other[AT_VERSION] = 1;
        assert_eq!(DeviceState::decode(&other), Err(StateError::Version { found: 1 }));
        for at in [AT_FLAGS, AT_SESSION + 3, AT_CONFIG + 5, AT_IN_FLIGHT, AT_REGS + 100, AT_CHECKSUM] {
            let mut bad = rec;
            bad[at] ^= 0x10;
            assert_eq!(DeviceState::decode(&bad), Err(StateError::Checksum), "byte {at}");
        }
        assert_eq!(DeviceState::decode(&rec[..100]), Err(StateError::Size(100)));
        // A shape VnpuSpec refuses (no SA), checksummed as if valid.
        let mut bad = rec;
        put(&mut bad, AT_CONFIG + 8, &0u32.to_le_bytes());
        let sum = fnv1a(&bad[..AT_CHECKSUM]);
        put(&mut bad, AT_CHECKSUM, &sum.to_le_bytes());
        assert!(matches!(DeviceState::decode(&bad), Err(StateError::Config(_))));
    }
}
