//! The device core's whole state as one byte stream (`docs/migration.md`,
//! "The device stream"): what a vfio-user client reads in the migration
//! protocol's stop-and-copy state and writes back into another server.
//! The same parts as a session folder (the record, the registered
//! programs, each core's SRAM and written HBM chunks), framed:
//!
//! ```text
//! magic "VNPUSTRM" (8 bytes), version u32
//! sections: tag u32, length u64, bytes
//!   1 record       the 4 KiB DeviceState record (persist.rs)
//!   2 program      handle u32, then the encoded program
//!   3 sram         core u32, then the whole SRAM
//!   4 hbm chunk    core u32, chunk index u64, then up to 1 MiB
//!   0 end          CRC-32 (u32) of every byte before this section
//! ```
//!
//! All little-endian. A stream comes from a client: every length is
//! checked against the configuration the record names before anything
//! is taken.

use npu_model::memory::{Memory, HBM_CHUNK};

use super::{Core, DeviceCore, SnapshotError};
use crate::persist::{DeviceState, RECORD_BYTES};

/// The longest device stream a vNPU granted `spec` can have: its memories
/// and every program handle full, and the record (a bound a receiver
/// checks a stream's length against before it holds it).
pub fn stream_limit(spec: &vnpu_spec::VnpuSpec) -> u64 {
    let memories =
        u64::from(spec.cores()).saturating_mul(spec.sram_per_core().saturating_add(spec.hbm_per_core()));
    let programs = (vnpu_abi::device::MAX_REGISTERED as u64)
        .saturating_mul(u64::from(vnpu_abi::device::MAX_PROGRAM_BYTES));
    memories.saturating_add(programs).saturating_add(1 << 20)
}

const MAGIC: &[u8; 8] = b"VNPUSTRM";
/// The stream format version.
pub const STREAM_VERSION: u32 = 1;
pub(super) const END: u32 = 0;
pub(super) const RECORD: u32 = 1;
const PROGRAM: u32 = 2;
const SRAM: u32 = 3;
pub(super) const HBM: u32 = 4;
/// The HBM chunks the stream lacks are those pre-copy pieces carried
/// (`precopy.rs`): the receiver builds the cores on them.
const INCREMENTAL: u32 = 5;

pub(super) fn section(out: &mut Vec<u8>, tag: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend_from_slice(&(len as u64).to_le_bytes());
    for p in parts {
        out.extend_from_slice(p);
    }
}

fn bad(why: impl Into<String>) -> SnapshotError {
    SnapshotError::Stream(why.into())
}

/// A cursor over a stream that fails, never panics, past its end.
pub(super) struct Reader<'a> {
    pub b: &'a [u8],
    pub at: usize,
}

impl<'a> Reader<'a> {
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| bad("it ends inside a section"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub fn u32(&mut self) -> Result<u32, SnapshotError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    /// The next section: where it starts, its tag and its body.
    pub fn section(&mut self) -> Result<(usize, u32, &'a [u8]), SnapshotError> {
        let start = self.at;
        let tag = self.u32()?;
        let len = usize::try_from(self.u64()?).map_err(|_| bad("a section longer than memory"))?;
        Ok((start, tag, self.take(len)?))
    }
    pub fn u64(&mut self) -> Result<u64, SnapshotError> {
        let s = self.take(8)?;
        Ok(u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]))
    }
}

/// One core's memories in a stream: its SRAM (if the stream had it) and
/// its HBM chunks by index.
pub(super) type CoreParts = (Option<Vec<u8>>, Vec<(u64, Vec<u8>)>);

/// What a decoded stream holds, checked, before the core takes it.
pub(super) struct Decoded {
    pub state: DeviceState,
    pub programs: Vec<(usize, Vec<u8>)>,
    pub cores: Vec<CoreParts>,
    /// The HBM chunks missing are the pre-copy pieces'.
    pub incremental: bool,
}

impl DeviceCore {
    /// The whole state as a stream (between requests: nothing in flight);
    /// with `rest` (a pre-copy's end, [`DeviceCore::precopy_rest`]) only
    /// those HBM chunks of each core, marked incremental.
    pub(super) fn encode_stream(&self, rest: Option<&[Vec<u64>]>) -> Result<Vec<u8>, SnapshotError> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&STREAM_VERSION.to_le_bytes());
        let mut rec = [0u8; RECORD_BYTES];
        self.save_state().encode(&mut rec);
        section(&mut out, RECORD, &[&rec]);
        for (h, p) in self.programs.iter().enumerate() {
            if let Some(p) = p {
                let h = u32::try_from(h).map_err(|_| bad("a program handle past u32"))?;
                section(&mut out, PROGRAM, &[&h.to_le_bytes(), &p.encode()]);
            }
        }
        let err = |e: npu_model::memory::MemoryError| bad(e.to_string());
        for (c, core) in self.cores.iter().enumerate() {
            let Some(core) = core else { continue };
            let c = u32::try_from(c).map_err(|_| bad("a core index past u32"))?;
            section(&mut out, SRAM, &[&c.to_le_bytes(), core.sram.bytes()]);
            let mut put = |chunk: u64, bytes: &[u8]| {
                section(&mut out, HBM, &[&c.to_le_bytes(), &chunk.to_le_bytes(), bytes]);
                Ok(())
            };
            match rest {
                Some(rest) => {
                    let chunks = rest.get(c as usize).map_or(&[][..], Vec::as_slice);
                    super::each_chunk_of(&core.hbm, chunks, err, put)?;
                }
                None => super::each_written_chunk(&core.hbm, err, &mut put)?,
            }
        }
        if rest.is_some() {
            section(&mut out, INCREMENTAL, &[]);
        }
        let crc = crc32fast::hash(&out);
        section(&mut out, END, &[&crc.to_le_bytes()]);
        Ok(out)
    }

    /// Takes a stream [`Self::encode_stream`] wrote (on this server or
    /// another): registers and configuration as a resumed session takes
    /// them, the memories into the core's own (in its session files when
    /// it keeps a store), the programs and ring parked for
    /// `Control::Resume`. A stream that does not check out changes
    /// nothing.
    pub(super) fn restore_stream(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        let d = decode(bytes)?;
        let spec = d.state.config;
        if let Some(c) = spec {
            if !c.fits_within(&self.grant) {
                return Err(bad(format!(
                    "its configuration {c:?} does not fit this vNPU's grant {:?}",
                    self.grant
                )));
            }
        }
        let mut base = match (d.incremental, spec) {
            (true, Some(c)) => Some(self.take_incoming(&c).ok_or_else(|| {
                bad("an incremental stream with no pre-copy pieces of its configuration before it")
            })?),
            _ => None,
        };
        self.incoming = None;
        self.session_id = d.state.session;
        self.restore_parts(d.state, d.programs);
        let Some(spec) = self.config else { return Ok(()) };
        let err = |e: npu_model::memory::MemoryError| bad(e.to_string());
        let mut cores = d.cores;
        if base.is_some() {
            cores.resize_with(spec.cores() as usize, || (None, Vec::new()));
        }
        for (slot, (sram, chunks)) in cores.into_iter().enumerate() {
            if slot >= self.cores.len() {
                break;
            }
            let pre = base.as_mut().and_then(|b| b.get_mut(slot)).and_then(Option::take);
            let mut core: Core = match pre {
                Some(c) => c,
                None => self.core_memory(slot, &spec),
            };
            if let Some(s) = sram {
                core.sram.write(0, &s).map_err(err)?;
            }
            for (chunk, data) in chunks {
                core.hbm.write(chunk.saturating_mul(HBM_CHUNK), &data).map_err(err)?;
            }
            self.cores[slot] = Some(core);
        }
        Ok(())
    }
}

/// Reads and checks a whole stream.
pub(super) fn decode(bytes: &[u8]) -> Result<Decoded, SnapshotError> {
    let mut r = Reader { b: bytes, at: 0 };
    if r.take(8)? != MAGIC {
        return Err(bad("it is not a vNPU device stream"));
    }
    let v = r.u32()?;
    if v != STREAM_VERSION {
        return Err(bad(format!("stream version {v}; this build reads {STREAM_VERSION}")));
    }
    let mut state = None;
    let mut programs = Vec::new();
    let mut cores: Vec<CoreParts> = Vec::new();
    let mut incremental = false;
    loop {
        let (start, tag, body) = r.section()?;
        let mut s = Reader { b: body, at: 0 };
        match tag {
            END => {
                let crc = s.u32()?;
                if crc != crc32fast::hash(&bytes[..start]) {
                    return Err(bad("its checksum does not match"));
                }
                if r.at != bytes.len() {
                    return Err(bad("bytes after its end"));
                }
                break;
            }
            RECORD => {
                let st = DeviceState::decode(body)?.ok_or_else(|| bad("its record holds no state"))?;
                if state.replace(st).is_some() {
                    return Err(bad("two records"));
                }
            }
            PROGRAM => {
                let h = usize::try_from(s.u32()?).unwrap_or(usize::MAX);
                if h >= vnpu_abi::device::MAX_REGISTERED || programs.iter().any(|(p, _)| *p == h) {
                    return Err(bad(format!("program handle {h} out of range or twice")));
                }
                if body.len() - 4 > vnpu_abi::device::MAX_PROGRAM_BYTES as usize {
                    return Err(bad(format!("program {h} is larger than a program may be")));
                }
                programs.push((h, body[4..].to_vec()));
            }
            SRAM | HBM => {
                let st = state.as_ref().ok_or_else(|| bad("memories before the record"))?;
                let spec = st.config.ok_or_else(|| bad("memories of an unconfigured vNPU"))?;
                let c = usize::try_from(s.u32()?).unwrap_or(usize::MAX);
                if c >= spec.cores() as usize {
                    return Err(bad(format!("core {c} of a {}-core configuration", spec.cores())));
                }
                if cores.len() <= c {
                    cores.resize_with(c + 1, || (None, Vec::new()));
                }
                if tag == SRAM {
                    let data = &body[4..];
                    if data.len() as u64 != spec.sram_per_core() || cores[c].0.is_some() {
                        return Err(bad(format!("core {c}'s SRAM of {} bytes, or twice", data.len())));
                    }
                    cores[c].0 = Some(data.to_vec());
                } else {
                    let chunk = s.u64()?;
                    let data = &body[12..];
                    let at = chunk.checked_mul(HBM_CHUNK);
                    let fits = at
                        .and_then(|a| a.checked_add(data.len() as u64))
                        .is_some_and(|e| e <= spec.hbm_per_core());
                    if !fits || data.len() as u64 > HBM_CHUNK || cores[c].1.iter().any(|(k, _)| *k == chunk) {
                        return Err(bad(format!("core {c}'s HBM chunk {chunk} out of range or twice")));
                    }
                    cores[c].1.push((chunk, data.to_vec()));
                }
            }
            INCREMENTAL if body.is_empty() && !incremental => incremental = true,
            t => return Err(bad(format!("unknown section {t}, or one out of place"))),
        }
    }
    let state = state.ok_or_else(|| bad("no record"))?;
    Ok(Decoded { state, programs, cores, incremental })
}
