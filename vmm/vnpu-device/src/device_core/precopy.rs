//! Pre-copy of a vNPU's HBM for a live migration (`docs/migration.md`,
//! "Pre-copy of the vNPU's HBM"): while the vNPU runs, its written HBM
//! chunks go out in pieces between requests, then in passes the chunks
//! written since; at the stop the device stream carries only what is
//! still dirty, marked incremental. The receiving core takes the pieces
//! into memories of their own and builds the cores on them when the
//! incremental stream comes.
//!
//! A piece (all integers little-endian):
//!
//! ```text
//! magic "VNPUDLTA" (8 bytes), total length u64, flags u32 (bit 0: the
//!   last piece of its pass)
//! sections as in the device stream: tag u32, length u64, bytes
//!   1 record     the 4 KiB device record (its configuration)
//!   4 hbm chunk  core u32, chunk index u64, then up to 1 MiB
//!   0 end        CRC-32 of every byte before this section
//! ```

use std::collections::VecDeque;

use npu_model::memory::{Memory, HBM_CHUNK};
use vnpu_spec::VnpuSpec;

use super::stream::{section, Reader, END, HBM, RECORD};
use super::{Core, DeviceCore, SnapshotError};
use crate::persist::{DeviceState, RECORD_BYTES};

const MAGIC: &[u8; 8] = b"VNPUDLTA";
/// A piece's flag: the last of its pass (every chunk dirty when the pass
/// began is sent).
pub const LAST_OF_PASS: u32 = 1;
/// Bytes of a piece's header (magic, length, flags).
const HEAD: usize = 20;

fn bad(why: impl Into<String>) -> SnapshotError {
    SnapshotError::Stream(why.into())
}

/// A pre-copy under way on the sending core.
#[derive(Debug)]
pub(crate) struct PreCopy {
    /// The configuration it started under: another one at the stop (a
    /// release or a reconfiguration meanwhile) makes the stop's stream
    /// whole again.
    config: VnpuSpec,
    /// (core, chunk) still to send in this pass.
    pending: VecDeque<(usize, u64)>,
    /// No piece went yet: the first goes even with no chunk, so that the
    /// receiver knows the configuration its incremental stream builds on.
    first: bool,
}

/// Memories the receiving core built from pieces, for the incremental
/// stream to come.
#[derive(Debug)]
pub(crate) struct Incoming {
    config: VnpuSpec,
    cores: Vec<Option<Core>>,
}

impl DeviceCore {
    /// Whether the pre-copy under way still describes the cores: the same
    /// configuration, and every core's HBM the one it tracks.
    fn precopy_holds(&self) -> bool {
        self.precopy.as_ref().is_some_and(|p| {
            self.config == Some(p.config) && self.cores.iter().flatten().all(|c| c.hbm.tracking_writes())
        })
    }

    /// The next pre-copy piece, with chunks up to about `max` bytes (at
    /// least one when any is due), or nothing when there is nothing to
    /// send (no configuration, or a pre-copy that no longer holds: the
    /// stop's stream is then whole). The first call starts the pre-copy
    /// (its first pass: every chunk written so far); a call after the
    /// last piece of a pass starts the next (the chunks written since).
    pub(super) fn precopy_piece(&mut self, max: usize) -> Result<Vec<u8>, SnapshotError> {
        if self.precopy.is_none() {
            let Some(config) = self.config else { return Ok(Vec::new()) };
            let mut pending = VecDeque::new();
            for (c, core) in self.cores.iter_mut().enumerate() {
                if let Some(core) = core {
                    core.hbm.track_writes();
                    pending.extend(core.hbm.written_chunks().into_iter().map(|k| (c, k)));
                }
            }
            self.precopy = Some(PreCopy { config, pending, first: true });
        } else if !self.precopy_holds() {
            return Ok(Vec::new());
        }
        let cores = &mut self.cores;
        let Some(p) = self.precopy.as_mut() else { return Ok(Vec::new()) };
        if p.pending.is_empty() {
            for (c, core) in cores.iter_mut().enumerate() {
                if let Some(core) = core {
                    p.pending.extend(core.hbm.take_written().into_iter().map(|k| (c, k)));
                }
            }
        }
        if p.pending.is_empty() && !std::mem::take(&mut p.first) {
            return Ok(Vec::new());
        }
        p.first = false;
        let mut out = Vec::with_capacity(max.min(64 << 20) + (2 << 20));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[0u8; 12]);
        let mut rec = [0u8; RECORD_BYTES];
        self.save_state().encode(&mut rec);
        section(&mut out, RECORD, &[&rec]);
        let Some(p) = self.precopy.as_mut() else { return Ok(Vec::new()) };
        let mut buf = vec![0u8; usize::try_from(HBM_CHUNK).unwrap_or(1 << 20)];
        let mut sent = 0usize;
        while let Some(&(c, k)) = p.pending.front() {
            if sent > 0 && sent.saturating_add(buf.len()) > max {
                break;
            }
            p.pending.pop_front();
            let Some(core) = self.cores.get(c).and_then(Option::as_ref) else { continue };
            let size = core.hbm.size();
            let at = k.saturating_mul(HBM_CHUNK);
            let n = usize::try_from(HBM_CHUNK.min(size.saturating_sub(at))).unwrap_or(0);
            core.hbm.read(at, &mut buf[..n]).map_err(|e| bad(e.to_string()))?;
            let c32 = u32::try_from(c).map_err(|_| bad("a core index past u32"))?;
            section(&mut out, HBM, &[&c32.to_le_bytes(), &k.to_le_bytes(), &buf[..n]]);
            sent += n;
        }
        let flags = if p.pending.is_empty() { LAST_OF_PASS } else { 0 };
        let crc = crc32fast::hash(&out[HEAD..]);
        section(&mut out, END, &[&crc.to_le_bytes()]);
        let total = out.len() as u64;
        out[8..16].copy_from_slice(&total.to_le_bytes());
        out[16..20].copy_from_slice(&flags.to_le_bytes());
        Ok(out)
    }

    /// Ends a pre-copy without a stop (the migration failed): writes are
    /// no longer tracked.
    pub(super) fn precopy_abort(&mut self) {
        self.precopy = None;
        for core in self.cores.iter_mut().flatten() {
            core.hbm.untrack_writes();
        }
    }

    /// At the stop: the chunks still to send (this pass's and those
    /// written since), or `None` when the stream must be whole (no
    /// pre-copy, or one that no longer holds). The pre-copy ends.
    pub(super) fn precopy_rest(&mut self) -> Option<Vec<Vec<u64>>> {
        let holds = self.precopy_holds();
        let p = self.precopy.take();
        let mut rest: Vec<Vec<u64>> = vec![Vec::new(); self.cores.len()];
        for (c, core) in self.cores.iter_mut().enumerate() {
            if let Some(core) = core {
                rest[c] = core.hbm.take_written();
                core.hbm.untrack_writes();
            }
        }
        let p = p.filter(|_| holds)?;
        for (c, k) in p.pending {
            if let Some(r) = rest.get_mut(c) {
                r.push(k);
            }
        }
        for r in &mut rest {
            r.sort_unstable();
            r.dedup();
        }
        Some(rest)
    }

    /// Takes a pre-copy piece into memories of its own, checked as a
    /// stream is: a piece that does not check out changes nothing.
    pub(super) fn apply_piece(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        let (config, chunks) = decode_piece(bytes)?;
        if !config.fits_within(&self.grant) {
            return Err(bad(format!(
                "its configuration {config:?} does not fit this vNPU's grant {:?}",
                self.grant
            )));
        }
        if self.incoming.as_ref().is_some_and(|i| i.config != config) {
            return Err(bad("a pre-copy piece of another configuration than the ones before it"));
        }
        if self.incoming.is_none() {
            let cores = (0..config.cores() as usize).map(|_| None).collect();
            self.incoming = Some(Incoming { config, cores });
        }
        let mut made = Vec::new();
        if let Some(inc) = self.incoming.as_ref() {
            for &(c, _, _) in &chunks {
                if inc.cores.get(c).is_some_and(Option::is_none) && !made.contains(&c) {
                    made.push(c);
                }
            }
        }
        let fresh: Vec<(usize, Core)> = made.into_iter().map(|c| (c, self.core_memory(c, &config))).collect();
        let Some(inc) = self.incoming.as_mut() else { return Ok(()) };
        for (c, core) in fresh {
            inc.cores[c] = Some(core);
        }
        for (c, k, data) in chunks {
            let Some(core) = inc.cores.get_mut(c).and_then(Option::as_mut) else { continue };
            core.hbm.write(k.saturating_mul(HBM_CHUNK), data).map_err(|e| bad(e.to_string()))?;
        }
        Ok(())
    }

    /// The memories pre-copy pieces built for `config`, taken (for an
    /// incremental stream's restore).
    pub(super) fn take_incoming(&mut self, config: &VnpuSpec) -> Option<Vec<Option<Core>>> {
        match self.incoming.take() {
            Some(i) if i.config == *config => Some(i.cores),
            _ => None,
        }
    }
}

/// Reads and checks a piece: its configuration and its chunks (core,
/// index, bytes), each inside that configuration's HBM and at most once.
/// A piece's chunks: core, chunk index, bytes.
type Chunks<'a> = Vec<(usize, u64, &'a [u8])>;

fn decode_piece(bytes: &[u8]) -> Result<(VnpuSpec, Chunks<'_>), SnapshotError> {
    let mut r = Reader { b: bytes, at: 0 };
    if r.take(8)? != MAGIC {
        return Err(bad("it is not a vNPU pre-copy piece"));
    }
    let total = r.u64()?;
    if total != bytes.len() as u64 {
        return Err(bad(format!("a piece of {} bytes that says it has {total}", bytes.len())));
    }
    let _flags = r.u32()?;
    let mut config = None;
    let mut chunks: Chunks<'_> = Vec::new();
    loop {
        let (start, tag, body) = r.section()?;
        let mut s = Reader { b: body, at: 0 };
        match tag {
            END => {
                if s.u32()? != crc32fast::hash(&bytes[HEAD..start]) {
                    return Err(bad("its checksum does not match"));
                }
                if r.at != bytes.len() {
                    return Err(bad("bytes after its end"));
                }
                break;
            }
            RECORD if config.is_none() => {
                let st = DeviceState::decode(body)?.ok_or_else(|| bad("its record holds no state"))?;
                config = Some(st.config.ok_or_else(|| bad("a piece of an unconfigured vNPU"))?);
            }
            HBM => {
                let spec = config.ok_or_else(|| bad("memories before the record"))?;
                let c = usize::try_from(s.u32()?).unwrap_or(usize::MAX);
                let k = s.u64()?;
                let data = &body[12..];
                let fits = k
                    .checked_mul(HBM_CHUNK)
                    .and_then(|a| a.checked_add(data.len() as u64))
                    .is_some_and(|e| e <= spec.hbm_per_core());
                if c >= spec.cores() as usize
                    || !fits
                    || data.len() as u64 > HBM_CHUNK
                    || chunks.iter().any(|&(cc, kk, _)| cc == c && kk == k)
                {
                    return Err(bad(format!("core {c}'s HBM chunk {k} out of range or twice")));
                }
                chunks.push((c, k, data));
            }
            t => return Err(bad(format!("a section {t} out of place in a pre-copy piece"))),
        }
    }
    let config = config.ok_or_else(|| bad("no record"))?;
    Ok((config, chunks))
}

/// The length a pre-copy piece at the front of `bytes` says it has, once
/// its header is there (none when `bytes` does not begin with a piece:
/// a receiver splitting a byte stream into pieces and a stream).
pub fn piece_len(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < 16 || &bytes[..8] != MAGIC {
        return None;
    }
    let mut l = [0u8; 8];
    l.copy_from_slice(&bytes[8..16]);
    Some(u64::from_le_bytes(l))
}

/// The flags of a piece (its [`LAST_OF_PASS`] bit), if `bytes` is one.
pub fn piece_flags(bytes: &[u8]) -> Option<u32> {
    if bytes.len() < HEAD || &bytes[..8] != MAGIC {
        return None;
    }
    Some(u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]))
}
