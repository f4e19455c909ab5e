//! vfio-user migration v2 for a served vNPU (`docs/migration.md`, "Over
//! vfio-user"): the device states of `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE`
//! and the device stream (`vnpu_device::StateHandle::save_stream`) read
//! with `MIG_DATA_READ` and written with `MIG_DATA_WRITE`. Stop-and-copy
//! only (no pre-copy yet): the device is saved as it stops.
//!
//! Every request comes from the client: a transition the protocol does
//! not allow, data read or written in the wrong state, or a stream longer
//! than the vNPU's grant can hold is refused with an errno, and a stream
//! that does not check out leaves the device as it was (state `ERROR`
//! until a reset).

use vfio_user::{
    VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
    VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, VFIO_DEVICE_FEATURE_GET, VFIO_DEVICE_FEATURE_MASK,
    VFIO_DEVICE_FEATURE_MIGRATION, VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, VFIO_DEVICE_FEATURE_PROBE,
    VFIO_DEVICE_FEATURE_SET, VFIO_DEVICE_STATE_ERROR, VFIO_DEVICE_STATE_PRE_COPY, VFIO_DEVICE_STATE_RESUMING,
    VFIO_DEVICE_STATE_RUNNING, VFIO_DEVICE_STATE_STOP, VFIO_DEVICE_STATE_STOP_COPY, VFIO_MIGRATION_PRE_COPY,
    VFIO_MIGRATION_STOP_COPY,
};
use vnpu_device::{Parked, StateHandle};

fn errno(e: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(e)
}

/// One connection's migration state.
#[derive(Debug)]
pub struct Migration {
    handle: StateHandle,
    state: u32,
    /// The parked device, while stopped.
    parked: Option<Parked>,
    /// The stream saved when the device stopped, and how much was read.
    out: Vec<u8>,
    read: usize,
    /// The stream written while resuming.
    incoming: Vec<u8>,
    /// Most bytes a stream for this vNPU can hold.
    limit: usize,
    /// A stream was restored: the ring is taken up when the device runs.
    restored: bool,
    /// In `PRE_COPY`: the piece being read, and how much of it was.
    piece: Vec<u8>,
    piece_read: usize,
}

/// Bytes of HBM in one pre-copy piece the daemon hands out.
const PIECE_BYTES: usize = 8 << 20;

impl Migration {
    /// The migration state of a device `handle` saves and restores, whose
    /// streams hold at most `limit` bytes; it starts running.
    pub fn new(handle: StateHandle, limit: usize) -> Self {
        Self {
            handle,
            state: VFIO_DEVICE_STATE_RUNNING,
            parked: None,
            out: Vec::new(),
            read: 0,
            incoming: Vec::new(),
            limit,
            restored: false,
            piece: Vec::new(),
            piece_read: 0,
        }
    }

    /// `VFIO_USER_DEVICE_FEATURE`.
    pub fn feature(&mut self, flags: u32, data: &[u8]) -> Result<Vec<u8>, std::io::Error> {
        let feature = flags & VFIO_DEVICE_FEATURE_MASK;
        let (get, set, probe) = (
            flags & VFIO_DEVICE_FEATURE_GET != 0,
            flags & VFIO_DEVICE_FEATURE_SET != 0,
            flags & VFIO_DEVICE_FEATURE_PROBE != 0,
        );
        if probe {
            return match feature {
                VFIO_DEVICE_FEATURE_MIGRATION if !set => Ok(Vec::new()),
                VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE => Ok(Vec::new()),
                VFIO_DEVICE_FEATURE_DMA_LOGGING_START | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP if !get => {
                    Ok(Vec::new())
                }
                VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT if !set => Ok(Vec::new()),
                _ => Err(errno(libc::ENOTSUP)),
            };
        }
        match (feature, get, set) {
            (VFIO_DEVICE_FEATURE_DMA_LOGGING_START, false, true) => {
                logging_ranges(data)?;
                self.handle.write_log().start();
                Ok(Vec::new())
            }
            (VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, false, true) => {
                self.handle.write_log().stop();
                Ok(Vec::new())
            }
            (VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, true, false) => self.report(data),
            (VFIO_DEVICE_FEATURE_MIGRATION, true, false) => {
                Ok((VFIO_MIGRATION_STOP_COPY | VFIO_MIGRATION_PRE_COPY).to_le_bytes().to_vec())
            }
            (VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, true, false) => {
                let mut out = self.state.to_le_bytes().to_vec();
                out.extend_from_slice(&u32::MAX.to_le_bytes());
                Ok(out)
            }
            (VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, false, true) => {
                let to = data
                    .get(..4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .ok_or(errno(libc::EINVAL))?;
                self.go(to)?;
                Ok(Vec::new())
            }
            (
                VFIO_DEVICE_FEATURE_MIGRATION
                | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE
                | VFIO_DEVICE_FEATURE_DMA_LOGGING_START
                | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP
                | VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT,
                _,
                _,
            ) => Err(errno(libc::EINVAL)),
            _ => Err(errno(libc::ENOTSUP)),
        }
    }

    /// `DMA_LOGGING_REPORT`: the pages of `[iova, iova + length)` the
    /// device wrote since logging started or they were last reported,
    /// cleared as they are read. Pages of the log's size only, aligned,
    /// and at most [`MAX_REPORT_BYTES`] of bitmap in one reply.
    fn report(&mut self, data: &[u8]) -> Result<Vec<u8>, std::io::Error> {
        let [iova, length, page] = words::<3>(data).ok_or(errno(libc::EINVAL))?;
        let log = self.handle.write_log();
        if page != vnpu_device::LOG_PAGE || iova % page != 0 || length % page != 0 || !log.logging() {
            return Err(errno(libc::EINVAL));
        }
        let pages = length / page;
        if pages.div_ceil(8) > MAX_REPORT_BYTES || iova.checked_add(length).is_none() {
            return Err(errno(libc::E2BIG));
        }
        let mut out = data[..24].to_vec();
        out.extend_from_slice(&log.take_range(iova / page, pages));
        Ok(out)
    }

    /// Moves to `to`, through `STOP` where no direct arc leads there (the
    /// protocol's shortest path).
    fn go(&mut self, to: u32) -> Result<(), std::io::Error> {
        use VFIO_DEVICE_STATE_PRE_COPY as PRE;
        let known = [
            VFIO_DEVICE_STATE_STOP,
            VFIO_DEVICE_STATE_RUNNING,
            VFIO_DEVICE_STATE_STOP_COPY,
            VFIO_DEVICE_STATE_RESUMING,
            PRE,
        ];
        if !known.contains(&to) || self.state == VFIO_DEVICE_STATE_ERROR {
            return Err(errno(libc::EINVAL));
        }
        match (self.state, to) {
            (a, b) if a == b => Ok(()),
            (VFIO_DEVICE_STATE_RUNNING, PRE)
            | (PRE, VFIO_DEVICE_STATE_RUNNING | VFIO_DEVICE_STATE_STOP_COPY) => self.arc(to),
            // Out of pre-copy the protocol's way: through STOP_COPY to
            // STOP, through RUNNING elsewhere.
            (PRE, VFIO_DEVICE_STATE_STOP) => {
                self.arc(VFIO_DEVICE_STATE_STOP_COPY)?;
                self.arc(VFIO_DEVICE_STATE_STOP)
            }
            (PRE, _) => {
                self.arc(VFIO_DEVICE_STATE_RUNNING)?;
                self.go(to)
            }
            (_, PRE) => {
                self.go(VFIO_DEVICE_STATE_RUNNING)?;
                self.arc(PRE)
            }
            _ => {
                if self.state != VFIO_DEVICE_STATE_STOP && to != VFIO_DEVICE_STATE_STOP {
                    self.arc(VFIO_DEVICE_STATE_STOP)?;
                }
                if self.state != to {
                    self.arc(to)?;
                }
                Ok(())
            }
        }
    }

    /// Saves the device as it stops (parked until let go).
    fn stop_and_save(&mut self) -> Result<(), std::io::Error> {
        let (parked, bytes) = self.handle.save_stream().map_err(|e| {
            log::warn!("migration: saving the device: {e}");
            errno(libc::EIO)
        })?;
        self.parked = Some(parked);
        self.out = bytes;
        self.read = 0;
        self.piece = Vec::new();
        Ok(())
    }

    /// One arc from `STOP` or to it.
    fn arc(&mut self, to: u32) -> Result<(), std::io::Error> {
        use VFIO_DEVICE_STATE_STOP as STOP;
        match (self.state, to) {
            (VFIO_DEVICE_STATE_RUNNING, STOP) => self.stop_and_save()?,
            (VFIO_DEVICE_STATE_RUNNING, VFIO_DEVICE_STATE_PRE_COPY) => {
                self.piece = Vec::new();
                self.piece_read = 0;
            }
            (VFIO_DEVICE_STATE_PRE_COPY, VFIO_DEVICE_STATE_RUNNING) => {
                self.handle.precopy_abort();
                self.piece = Vec::new();
            }
            (VFIO_DEVICE_STATE_PRE_COPY, VFIO_DEVICE_STATE_STOP_COPY) => self.stop_and_save()?,
            (STOP, VFIO_DEVICE_STATE_STOP_COPY) => self.read = 0,
            (VFIO_DEVICE_STATE_STOP_COPY, STOP) => {}
            (STOP, VFIO_DEVICE_STATE_RUNNING) => {
                self.parked = None;
                self.out = Vec::new();
                if std::mem::take(&mut self.restored) {
                    self.handle.resume();
                }
            }
            (STOP, VFIO_DEVICE_STATE_RESUMING) => {
                // The worker takes the stream, so it is let go; the
                // client's vCPUs are not running.
                self.parked = None;
                self.incoming.clear();
            }
            (VFIO_DEVICE_STATE_RESUMING, STOP) => {
                let bytes = std::mem::take(&mut self.incoming);
                if let Err(e) = self.handle.restore_stream(bytes) {
                    log::warn!("migration: the client's device stream: {e}");
                    self.state = VFIO_DEVICE_STATE_ERROR;
                    return Err(errno(libc::EINVAL));
                }
                self.restored = true;
            }
            _ => return Err(errno(libc::EINVAL)),
        }
        self.state = to;
        Ok(())
    }

    /// `VFIO_USER_MIG_DATA_READ`: while saving, the stream; in pre-copy,
    /// the pieces one after another (a read never crosses from one into
    /// the next, and an empty one means none is due now).
    pub fn read(&mut self, size: u32) -> Result<Vec<u8>, std::io::Error> {
        if self.state == VFIO_DEVICE_STATE_PRE_COPY {
            if self.piece_read >= self.piece.len() {
                self.piece = self.handle.precopy(PIECE_BYTES).map_err(|e| {
                    log::warn!("migration: a pre-copy piece: {e}");
                    errno(libc::EIO)
                })?;
                self.piece_read = 0;
            }
            let end = self.piece_read.saturating_add(size as usize).min(self.piece.len());
            let chunk = self.piece[self.piece_read..end].to_vec();
            self.piece_read = end;
            return Ok(chunk);
        }
        if self.state != VFIO_DEVICE_STATE_STOP_COPY {
            return Err(errno(libc::EINVAL));
        }
        let end = self.read.saturating_add(size as usize).min(self.out.len());
        let chunk = self.out[self.read..end].to_vec();
        self.read = end;
        Ok(chunk)
    }

    /// `VFIO_USER_MIG_DATA_WRITE`: only while resuming, and no more than
    /// a stream for this vNPU can hold.
    pub fn write(&mut self, data: &[u8]) -> Result<(), std::io::Error> {
        if self.state != VFIO_DEVICE_STATE_RESUMING {
            return Err(errno(libc::EINVAL));
        }
        if self.incoming.len().saturating_add(data.len()) > self.limit {
            return Err(errno(libc::EFBIG));
        }
        self.incoming.extend_from_slice(data);
        // Whole pre-copy pieces at the front are taken at once (the
        // stream after them waits for RESUMING -> STOP).
        while let Some(n) = vnpu_device::device_core::piece_len(&self.incoming) {
            let Ok(n) = usize::try_from(n) else { return Err(errno(libc::EFBIG)) };
            if n > self.limit {
                return Err(errno(libc::EFBIG));
            }
            if self.incoming.len() < n {
                break;
            }
            let rest = self.incoming.split_off(n);
            let piece = std::mem::replace(&mut self.incoming, rest);
            if let Err(e) = self.handle.apply_piece(piece) {
                log::warn!("migration: the client's pre-copy piece: {e}");
                self.state = VFIO_DEVICE_STATE_ERROR;
                return Err(errno(libc::EINVAL));
            }
        }
        Ok(())
    }

    /// A device reset: back to running, whatever the state (the way out
    /// of `ERROR`).
    pub fn reset(&mut self) {
        self.parked = None;
        self.out = Vec::new();
        self.incoming = Vec::new();
        self.restored = false;
        self.piece = Vec::new();
        self.handle.precopy_abort();
        self.state = VFIO_DEVICE_STATE_RUNNING;
    }
}

/// Most bitmap bytes one `DMA_LOGGING_REPORT` returns (32 GiB of 4 KiB
/// pages); a client asks for larger ranges in pieces.
pub const MAX_REPORT_BYTES: u64 = 1 << 20;

/// Most ranges a `DMA_LOGGING_START` names.
const MAX_LOG_RANGES: u64 = 1024;

/// The first `N` little-endian u64 words of `data`.
fn words<const N: usize>(data: &[u8]) -> Option<[u64; N]> {
    let mut out = [0u64; N];
    for (i, w) in out.iter_mut().enumerate() {
        let b = data.get(i * 8..i * 8 + 8)?;
        *w = u64::from_le_bytes(b.try_into().ok()?);
    }
    Some(out)
}

/// Checks `DMA_LOGGING_START`'s data: the log's page size, then as many
/// ranges as it says (each page-aligned, not wrapping). The device logs
/// every page it writes, inside the ranges or not; the ranges bound
/// nothing here but are checked as the protocol defines them.
fn logging_ranges(data: &[u8]) -> Result<(), std::io::Error> {
    let [page, count] = words::<2>(data).ok_or(errno(libc::EINVAL))?;
    let n = count & 0xffff_ffff;
    if page != vnpu_device::LOG_PAGE || n > MAX_LOG_RANGES {
        return Err(errno(libc::EINVAL));
    }
    let body = data.get(16..).ok_or(errno(libc::EINVAL))?;
    if body.len() as u64 != n * 16 {
        return Err(errno(libc::EINVAL));
    }
    for r in body.chunks_exact(16) {
        let [iova, len] = words::<2>(r).ok_or(errno(libc::EINVAL))?;
        if iova % page != 0 || len % page != 0 || iova.checked_add(len).is_none() {
            return Err(errno(libc::EINVAL));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    struct Nowhere;
    impl vnpu_device::VectorSink for Nowhere {
        fn signal(&self, _: u16) {}
    }

    fn function() -> vnpu_device::VnpuFunction {
        let spec = vnpu_spec::VnpuSpec::named("small").unwrap();
        let board = npu_model::BoardConfig::default();
        vnpu_device::VnpuFunction::served(
            &spec,
            &board,
            Arc::new(Nowhere),
            "t",
            vnpu_device::DeviceOptions::default(),
        )
        .unwrap()
    }

    fn set(m: &mut Migration, state: u32) -> Result<Vec<u8>, std::io::Error> {
        let mut d = state.to_le_bytes().to_vec();
        d.extend_from_slice(&u32::MAX.to_le_bytes());
        m.feature(VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, &d)
    }

    fn state(m: &mut Migration) -> u32 {
        let b = m.feature(VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, &[]).unwrap();
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    fn errno_of(r: Result<impl Sized, std::io::Error>) -> Option<i32> {
        r.err().and_then(|e| e.raw_os_error())
    }

    /// The protocol's states and arcs, a stream out of one device into
    /// another, and what a hostile client may send refused with an errno.
    #[test]
    fn the_migration_states_move_a_stream_and_refuse_what_is_out_of_place() {
        let (a, b) = (function(), function());
        let mut m = Migration::new(a.state_handle(), 64 << 20);
        let flags = m.feature(VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_MIGRATION, &[]).unwrap();
        assert_eq!(flags, (VFIO_MIGRATION_STOP_COPY | VFIO_MIGRATION_PRE_COPY).to_le_bytes());
        assert!(m.feature(VFIO_DEVICE_FEATURE_PROBE | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, &[]).is_ok());
        assert_eq!(errno_of(m.feature(VFIO_DEVICE_FEATURE_GET | 9, &[])), Some(libc::ENOTSUP));
        assert_eq!(state(&mut m), VFIO_DEVICE_STATE_RUNNING);
        // Data in the wrong state, unknown states, a short SET.
        assert_eq!(errno_of(m.read(16)), Some(libc::EINVAL));
        assert_eq!(errno_of(m.write(&[1])), Some(libc::EINVAL));
        for bad in [VFIO_DEVICE_STATE_ERROR, 5, 7, 99] {
            assert_eq!(errno_of(set(&mut m, bad)), Some(libc::EINVAL), "state {bad}");
        }
        assert_eq!(
            errno_of(m.feature(VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, &[1])),
            Some(libc::EINVAL)
        );
        // RUNNING -> STOP_COPY goes through STOP; the stream reads out in
        // pieces and ends short.
        set(&mut m, VFIO_DEVICE_STATE_STOP_COPY).unwrap();
        let mut stream = Vec::new();
        loop {
            let c = m.read(1 << 16).unwrap();
            let done = c.len() < 1 << 16;
            stream.extend_from_slice(&c);
            if done {
                break;
            }
        }
        assert!(stream.starts_with(b"VNPUSTRM"));
        set(&mut m, VFIO_DEVICE_STATE_RUNNING).unwrap();

        let mut n = Migration::new(b.state_handle(), stream.len() + 10);
        set(&mut n, VFIO_DEVICE_STATE_RESUMING).unwrap();
        assert_eq!(
            errno_of(n.write(&vec![0; stream.len() + 11])),
            Some(libc::EFBIG),
            "past the vNPU's bound"
        );
        n.write(&stream).unwrap();
        set(&mut n, VFIO_DEVICE_STATE_RUNNING).unwrap();
        assert_eq!(state(&mut n), VFIO_DEVICE_STATE_RUNNING);

        // A stream that does not check out: ERROR, and only a reset leaves it.
        set(&mut n, VFIO_DEVICE_STATE_RESUMING).unwrap();
        n.write(&stream[..stream.len() / 2]).unwrap();
        assert_eq!(errno_of(set(&mut n, VFIO_DEVICE_STATE_STOP)), Some(libc::EINVAL));
        assert_eq!(state(&mut n), VFIO_DEVICE_STATE_ERROR);
        assert_eq!(errno_of(set(&mut n, VFIO_DEVICE_STATE_RUNNING)), Some(libc::EINVAL));
        n.reset();
        assert_eq!(state(&mut n), VFIO_DEVICE_STATE_RUNNING);
        // DMA logging: a report before a start, a start with a bad page
        // size or a range count its data does not hold, a report that is
        // not aligned or too large: refused.
        let get = VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT;
        let start = VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_START;
        let le = |w: &[u64]| w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(errno_of(m.feature(get, &le(&[0, 4096, 4096]))), Some(libc::EINVAL));
        assert_eq!(errno_of(m.feature(start, &le(&[512, 0]))), Some(libc::EINVAL));
        assert_eq!(errno_of(m.feature(start, &le(&[4096, 2, 0, 4096]))), Some(libc::EINVAL));
        m.feature(start, &le(&[4096, 1, 0, 1 << 20])).unwrap();
        assert_eq!(errno_of(m.feature(get, &le(&[100, 4096, 4096]))), Some(libc::EINVAL));
        assert_eq!(errno_of(m.feature(get, &le(&[0, 1 << 40, 4096]))), Some(libc::E2BIG));
        // A write the device made is reported once, in its bit.
        a.state_handle().write_log().note(3 * 4096 + 7, 2);
        let r = m.feature(get, &le(&[0, 64 * 4096, 4096])).unwrap();
        assert_eq!(r.len(), 24 + 8);
        assert_eq!(r[24], 1 << 3);
        assert!(r[25..].iter().all(|&b| b == 0));
        let r = m.feature(get, &le(&[0, 64 * 4096, 4096])).unwrap();
        assert!(r[24..].iter().all(|&b| b == 0), "cleared as read");
        m.feature(VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, &[]).unwrap();
        assert_eq!(errno_of(m.feature(get, &le(&[0, 4096, 4096]))), Some(libc::EINVAL));
        // Dropped while stopped: the parked device is let go first (no hang).
        set(&mut m, VFIO_DEVICE_STATE_STOP).unwrap();
        drop(m);
        drop(a);
    }

    /// Pre-copy over the protocol: `RUNNING -> PRE_COPY`, pieces read
    /// while the device runs (an empty read when none is due), then
    /// `PRE_COPY -> STOP_COPY` gives the incremental rest; the resuming
    /// device takes the pieces as they are written and the stream last.
    /// A spoiled piece puts the resuming device in `ERROR`.
    #[test]
    fn pre_copy_pieces_then_the_rest_reach_a_resuming_device() {
        let (a, b) = (function(), function());
        let mut m = Migration::new(a.state_handle(), 64 << 20);
        // The first piece goes even with no HBM written (it carries the
        // configuration), read in two parts; then none is due.
        set(&mut m, VFIO_DEVICE_STATE_PRE_COPY).unwrap();
        assert_eq!(state(&mut m), VFIO_DEVICE_STATE_PRE_COPY);
        let mut piece = m.read(100).unwrap();
        piece.extend_from_slice(&m.read(1 << 20).unwrap());
        assert_eq!(vnpu_device::device_core::piece_len(&piece), Some(piece.len() as u64));
        assert!(m.read(1 << 20).unwrap().is_empty());
        assert_eq!(errno_of(m.write(&[1])), Some(libc::EINVAL), "no writes while pre-copying");
        set(&mut m, VFIO_DEVICE_STATE_STOP_COPY).unwrap();
        let mut rest = Vec::new();
        loop {
            let c = m.read(1 << 16).unwrap();
            let done = c.len() < 1 << 16;
            rest.extend_from_slice(&c);
            if done {
                break;
            }
        }
        assert!(rest.starts_with(b"VNPUSTRM"));
        set(&mut m, VFIO_DEVICE_STATE_RUNNING).unwrap();
        // A piece-shaped write that does not check out: ERROR.
        let mut n = Migration::new(b.state_handle(), 64 << 20);
        set(&mut n, VFIO_DEVICE_STATE_RESUMING).unwrap();
        let mut fake = b"VNPUDLTA".to_vec();
        fake.extend_from_slice(&40u64.to_le_bytes());
        fake.extend_from_slice(&[0u8; 24]);
        assert_eq!(errno_of(n.write(&fake)), Some(libc::EINVAL));
        assert_eq!(state(&mut n), VFIO_DEVICE_STATE_ERROR);
        n.reset();
        set(&mut n, VFIO_DEVICE_STATE_RESUMING).unwrap();
        // The piece and the rest in one write, cut mid-piece.
        let all = [piece.clone(), rest.clone()].concat();
        n.write(&all[..30]).unwrap();
        n.write(&all[30..]).unwrap();
        set(&mut n, VFIO_DEVICE_STATE_RUNNING).unwrap();
        // PRE_COPY -> RUNNING ends the pre-copy.
        set(&mut m, VFIO_DEVICE_STATE_PRE_COPY).unwrap();
        set(&mut m, VFIO_DEVICE_STATE_RUNNING).unwrap();
        drop(m);
        drop(a);
    }
}
