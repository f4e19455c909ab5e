//! Live migration of a VM with its vNPUs to another VMM process
//! (`docs/migration.md`, "Live migration"): the destination admits the
//! VM's shape first, guest RAM is pre-copied while the guest runs (KVM's
//! dirty log for the vCPU's writes, each vNPU's write log for the
//! device's: `vnpu_device::WriteLog` in-process, vfio-user DMA logging
//! for a daemon's), then the vCPU stops, every vNPU parks between
//! requests, and the last dirty pages, each vNPU's device stream and the
//! vCPU and device state go across. The source ends only once the
//! destination says the VM runs there; any failure before that leaves the
//! VM running on the source, as it was.
//!
//! The stream is a sequence of messages, each a tag byte, a u64
//! little-endian length and that many bytes ([`Tag`]).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_clock_data, kvm_irqchip, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vnpu_spec::VnpuSpec;

use crate::snapshot::{self, Function, Serial, Shape, SnapshotError, Vcpu};

/// The `format` of a migration's first message.
pub const MIGRATION_FORMAT: &str = "vnpu-vm-migration";
/// The migration stream version this build sends and takes.
pub const MIGRATION_VERSION: u32 = 1;
/// Pre-copy rounds after the first full pass, at most: a guest that
/// dirties pages faster than they go across stops after them anyway.
pub const MAX_ROUNDS: u32 = 30;
/// Pre-copy ends once a round leaves at most this many dirty pages
/// (1 MiB), sent while the VM is stopped...
pub const CONVERGED_PAGES: u64 = 256;
/// ... and its pass over the vNPUs' HBM sent at most this many bytes.
pub const CONVERGED_DEVICE_BYTES: u64 = 16 << 20;
/// Bytes of HBM in one pre-copy piece.
const PIECE_BYTES: usize = 8 << 20;
/// How long either side waits for the other's next message.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(60);

const PAGE: u64 = 4096;
const PAGE_BYTES: usize = 4096;
/// Pages per `Pages` message.
const BATCH: usize = 256;
/// Largest JSON message (hello, admission, machine state).
const MAX_JSON: u64 = 16 << 20;

/// The messages of a migration stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Tag {
    /// Source: [`Hello`] (JSON).
    Hello = 1,
    /// Destination: [`Reply`] (JSON): the VM's shape admitted, or why not.
    Admit = 2,
    /// Source: a u64 count, then per page its u64 number and 4096 bytes.
    Pages = 3,
    /// Source: a u32 PCI slot, then that vNPU's device stream.
    Device = 4,
    /// Source: [`Machine`] (JSON).
    Machine = 5,
    /// Source: everything is sent; the body is empty, or (verified) the
    /// CRC-32 of all of guest RAM at the stop, a u32.
    Done = 6,
    /// Destination: [`Reply`] (JSON): the VM runs here, or why not.
    Resumed = 7,
    /// Source: a u32 PCI slot, then a pre-copy piece of that vNPU's HBM
    /// (`vnpu_device`'s `precopy.rs`), sent while the VM runs.
    Piece = 8,
}

impl Tag {
    fn from_u8(b: u8) -> Option<Self> {
        [Tag::Hello, Tag::Admit, Tag::Pages, Tag::Device, Tag::Machine, Tag::Done, Tag::Resumed, Tag::Piece]
            .into_iter()
            .find(|t| *t as u8 == b)
    }
}

/// A daemon-served vNPU as the source knows it: what the destination
/// needs to admit one like it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteShape {
    /// Its instance's UUID, if it is a managed one.
    pub uuid: Option<String>,
    /// Its shape, if known.
    pub spec: Option<VnpuSpec>,
}

/// The first message: what the VM is.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Hello {
    pub format: String,
    pub version: u32,
    pub shape: Shape,
}

/// What the destination offers to admit (from [`Hello`]).
#[derive(Clone, Debug)]
pub struct Offer {
    /// Guest RAM in bytes.
    pub memory: u64,
    /// The in-process vNPUs' shapes.
    pub vnpus: Vec<VnpuSpec>,
    /// The daemon-served vNPUs, in slot order after the in-process ones.
    pub remote: Vec<RemoteShape>,
}

/// The destination's answer to [`Tag::Admit`] and [`Tag::Resumed`].
#[derive(Debug, Default, Serialize, Deserialize)]
struct Reply {
    ok: bool,
    #[serde(default)]
    error: Option<String>,
    /// With `Resumed`: milliseconds from `Done` to the VM ready.
    #[serde(default)]
    restore_ms: f64,
}

/// The vCPU, interrupt controllers, clock and VMM-modelled devices.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Machine {
    pub vcpu: Vcpu,
    pub irqchips: Vec<kvm_irqchip>,
    pub clock: kvm_clock_data,
    pub serial: Serial,
    pub cmos_index: u8,
    pub functions: Vec<Function>,
}

/// How a live migration goes (`vnpu migrate`'s options).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigrateOptions {
    /// The destination checks guest RAM's CRC-32 before the VM runs.
    pub verify: bool,
    /// Pre-copy rounds after the first pass, at most.
    pub max_rounds: u32,
    /// Pre-copy ends once a round leaves at most this many dirty pages.
    pub converged_pages: u64,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        Self { verify: false, max_rounds: MAX_ROUNDS, converged_pages: CONVERGED_PAGES }
    }
}

/// Most pre-copy rounds a migration may be asked for.
pub const MOST_ROUNDS: u32 = 1000;

impl MigrateOptions {
    /// Options with `max_rounds` at most [`MOST_ROUNDS`].
    pub fn new(verify: bool, max_rounds: u32, converged_pages: u64) -> Result<Self, String> {
        if max_rounds > MOST_ROUNDS {
            return Err(format!("at most {MOST_ROUNDS} pre-copy rounds, not {max_rounds}"));
        }
        Ok(Self { verify, max_rounds, converged_pages })
    }
}

/// What a live migration did, seen from the source.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MigrationInfo {
    /// Pre-copy rounds after the first full pass of guest RAM.
    pub rounds: u32,
    /// Whether the last round left at most [`CONVERGED_PAGES`] (else it
    /// stopped after [`MAX_ROUNDS`]).
    pub converged: bool,
    /// Guest pages sent, in all.
    pub pages: u64,
    /// Pages sent while the VM was stopped.
    pub stop_pages: u64,
    /// Device stream bytes sent while stopped.
    pub device_bytes: u64,
    /// Pre-copy piece bytes of the vNPUs' HBM sent while the VM ran.
    pub precopy_device_bytes: u64,
    /// Bytes of the whole stream.
    pub bytes: u64,
    /// From the request to the vCPU's stop.
    pub precopy: Duration,
    /// From the vCPU's stop to the destination's word that it runs.
    pub downtime: Duration,
    /// Of `downtime`, the wait for the vNPUs to finish their running
    /// requests and give their state.
    pub drain: Duration,
    /// Of `downtime`, the destination's restore.
    pub restore: Duration,
    /// From the request to the end.
    pub total: Duration,
}

/// Why a migration failed; the VM runs on where it was.
pub(crate) fn peer(what: &str, e: std::io::Error) -> SnapshotError {
    SnapshotError::Io { path: format!("the migration stream ({what})"), source: e }
}

fn bad(reason: impl Into<String>) -> SnapshotError {
    SnapshotError::Stream(reason.into())
}

/// A stream that counts what it writes.
pub(crate) struct Conn {
    s: Box<dyn Peer>,
    pub sent: u64,
}

/// What a migration stream runs over.
trait Peer: Read + Write + Send {}
impl<T: Read + Write + Send> Peer for T {}

/// A stream read from bytes, its writes dropped (the fuzz target's).
struct Replay(std::io::Cursor<Vec<u8>>);

impl Read for Replay {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Replay {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Conn {
    pub fn new(s: UnixStream) -> Result<Self, SnapshotError> {
        s.set_read_timeout(Some(PEER_TIMEOUT)).map_err(|e| peer("set-up", e))?;
        s.set_write_timeout(Some(PEER_TIMEOUT)).map_err(|e| peer("set-up", e))?;
        Ok(Self { s: Box::new(s), sent: 0 })
    }

    fn send(&mut self, tag: Tag, body: &[u8]) -> Result<(), SnapshotError> {
        let mut head = [0u8; 9];
        head[0] = tag as u8;
        head[1..].copy_from_slice(&(body.len() as u64).to_le_bytes());
        self.s.write_all(&head).map_err(|e| peer("send", e))?;
        self.s.write_all(body).map_err(|e| peer("send", e))?;
        self.sent += 9 + body.len() as u64;
        Ok(())
    }

    fn send_json(&mut self, tag: Tag, v: &impl Serialize) -> Result<(), SnapshotError> {
        let b = serde_json::to_vec(v).map_err(|e| bad(e.to_string()))?;
        self.send(tag, &b)
    }

    /// The next message, whose body may be at most `max` bytes.
    fn recv(&mut self, max: u64) -> Result<(Tag, Vec<u8>), SnapshotError> {
        let mut head = [0u8; 9];
        self.s.read_exact(&mut head).map_err(|e| peer("receive", e))?;
        let tag = Tag::from_u8(head[0]).ok_or_else(|| bad(format!("unknown message tag {}", head[0])))?;
        let mut len = [0u8; 8];
        len.copy_from_slice(&head[1..]);
        let len = u64::from_le_bytes(len);
        if len > max {
            return Err(bad(format!("a {tag:?} message of {len} bytes (at most {max} here)")));
        }
        let n = usize::try_from(len).map_err(|_| bad("a message larger than memory"))?;
        let mut body = vec![0u8; n];
        self.s.read_exact(&mut body).map_err(|e| peer("receive", e))?;
        Ok((tag, body))
    }

    fn expect_reply(&mut self, tag: Tag) -> Result<Reply, SnapshotError> {
        let (t, b) = self.recv(MAX_JSON)?;
        if t != tag {
            return Err(bad(format!("expected {tag:?}, got {t:?}")));
        }
        serde_json::from_slice(&b).map_err(|e| bad(format!("the destination's {tag:?}: {e}")))
    }
}

/// What the source needs to migrate the VM while it runs (from the API
/// thread), set by the VM when it is built.
pub(crate) struct Source {
    pub vm: Arc<VmFd>,
    pub memory: GuestMemoryMmap<()>,
    pub region: kvm_userspace_memory_region,
    /// The in-process vNPUs' write logs.
    pub logs: Vec<Arc<vnpu_device::WriteLog>>,
    /// The in-process vNPUs, by PCI slot.
    pub vnpus: Vec<(usize, vnpu_device::StateHandle)>,
    /// The daemon-served vNPUs, by PCI slot.
    pub remote: Vec<(usize, crate::remote::MigrationHandle)>,
    pub shape: Shape,
    /// The pages dirty at the end of pre-copy, for the stop round.
    pub carried: std::sync::Mutex<Vec<u64>>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source").field("memory", &self.region.memory_size).finish_non_exhaustive()
    }
}

/// A migration past its pre-copy, handed to the vCPU thread to finish.
pub(crate) struct Outgoing {
    pub conn: Conn,
    pub opts: MigrateOptions,
    pub source: Arc<Source>,
    pub info: MigrationInfo,
    pub started: Instant,
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing").field("info", &self.info).finish_non_exhaustive()
    }
}

impl Source {
    fn pages(&self) -> u64 {
        self.region.memory_size.div_ceil(PAGE)
    }

    /// Turns KVM's dirty log of guest RAM on or off.
    fn dirty_log(&self, on: bool) -> Result<(), SnapshotError> {
        let region = kvm_userspace_memory_region {
            flags: if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
            ..self.region
        };
        // SAFETY: the same slot, guest range and host mapping the VM was
        // built with (`memory`, which this holds, keeps it mapped); only
        // the dirty-log flag changes.
        unsafe { self.vm.set_user_memory_region(region) }.map_err(snapshot::kvm("set dirty logging"))
    }

    /// Starts every log: KVM's and each vNPU's.
    fn start_logs(&self) -> Result<(), SnapshotError> {
        self.dirty_log(true)?;
        for l in &self.logs {
            l.start();
        }
        for (slot, h) in &self.remote {
            h.log_start(self.region.memory_size)
                .map_err(|source| SnapshotError::Remote { slot: *slot, source })?;
        }
        // Pages dirtied before now go in the full pass.
        self.dirty()?;
        Ok(())
    }

    /// Stops every log (the migration failed: the VM runs on here).
    pub fn stop_logs(&self) {
        if let Err(e) = self.dirty_log(false) {
            log::warn!("migration: turning KVM's dirty log off: {e}");
        }
        for l in &self.logs {
            l.stop();
        }
        for (_, h) in &self.remote {
            if let Err(e) = h.log_stop() {
                log::warn!("migration: stopping a served vNPU's DMA log: {e}");
            }
        }
    }

    /// Ends the vNPUs' pre-copy (the migration failed before the stop).
    pub fn abort_precopy(&self) {
        for (_, h) in &self.vnpus {
            h.precopy_abort();
        }
        for (slot, h) in &self.remote {
            if let Err(e) = h.precopy_abort() {
                log::warn!("migration: ending the pre-copy of the vNPU in slot {slot}: {e}");
            }
        }
    }

    /// One pass over every vNPU's HBM: its pre-copy pieces until the last
    /// of the pass; returns the bytes sent.
    fn device_pass(&self, conn: &mut Conn) -> Result<u64, SnapshotError> {
        let mut sent = 0u64;
        let send = |conn: &mut Conn, slot: usize, p: &[u8]| -> Result<(), SnapshotError> {
            let mut body = u32::try_from(slot).unwrap_or(u32::MAX).to_le_bytes().to_vec();
            body.extend_from_slice(p);
            conn.send(Tag::Piece, &body)
        };
        for (slot, h) in &self.vnpus {
            loop {
                let p =
                    h.precopy(PIECE_BYTES).map_err(|source| SnapshotError::Device { slot: *slot, source })?;
                if p.is_empty() {
                    break;
                }
                send(conn, *slot, &p)?;
                sent += p.len() as u64;
                if vnpu_device::device_core::piece_flags(&p).unwrap_or(0)
                    & vnpu_device::device_core::LAST_OF_PASS
                    != 0
                {
                    break;
                }
            }
        }
        for (slot, h) in &self.remote {
            for p in h.precopy_pass().map_err(|source| SnapshotError::Remote { slot: *slot, source })? {
                send(conn, *slot, &p)?;
                sent += p.len() as u64;
            }
        }
        Ok(sent)
    }

    /// The pages dirtied since the last call, by the vCPU or a vNPU
    /// (bitmap words), each log cleared.
    fn dirty(&self) -> Result<Vec<u64>, SnapshotError> {
        let len = usize::try_from(self.region.memory_size).map_err(|_| bad("RAM larger than memory"))?;
        let mut bits = self.vm.get_dirty_log(0, len).map_err(snapshot::kvm("get the dirty log"))?;
        let mut or = |w: &[u64]| {
            for (d, s) in bits.iter_mut().zip(w) {
                *d |= s;
            }
        };
        for l in &self.logs {
            or(&l.take());
        }
        for (slot, h) in &self.remote {
            let w = h
                .log_take(self.region.memory_size)
                .map_err(|source| SnapshotError::Remote { slot: *slot, source })?;
            or(&w);
        }
        Ok(bits)
    }

    /// Sends the pages set in `bits` (or, `None`, every page that is not
    /// all zeros: the destination's RAM starts zeroed); returns how many.
    fn send_pages(&self, conn: &mut Conn, bits: Option<&[u64]>) -> Result<u64, SnapshotError> {
        let mut body = Vec::with_capacity(8 + BATCH * (8 + PAGE_BYTES));
        let mut n = 0usize;
        let mut sent = 0u64;
        let mut page = [0u8; PAGE_BYTES];
        let flush = |conn: &mut Conn, body: &mut Vec<u8>, n: &mut usize| -> Result<(), SnapshotError> {
            if *n > 0 {
                body[..8].copy_from_slice(&(*n as u64).to_le_bytes());
                conn.send(Tag::Pages, body)?;
            }
            body.clear();
            *n = 0;
            Ok(())
        };
        for p in 0..self.pages() {
            let (w, b) = (usize::try_from(p / 64).unwrap_or(usize::MAX), p % 64);
            if let Some(bits) = bits {
                if bits.get(w).is_none_or(|x| x & (1 << b) == 0) {
                    continue;
                }
            }
            let at = p * PAGE;
            let len = usize::try_from((self.region.memory_size - at).min(PAGE)).unwrap_or(0);
            page[len..].fill(0);
            self.memory.read_slice(&mut page[..len], GuestAddress(at)).map_err(|e| bad(e.to_string()))?;
            if bits.is_none() && snapshot::page_is_zero(&page) {
                continue;
            }
            if n == 0 {
                body.extend_from_slice(&[0u8; 8]);
            }
            body.extend_from_slice(&p.to_le_bytes());
            body.extend_from_slice(&page);
            n += 1;
            sent += 1;
            if n == BATCH {
                flush(conn, &mut body, &mut n)?;
            }
        }
        flush(conn, &mut body, &mut n)?;
        Ok(sent)
    }
}

fn count(bits: &[u64]) -> u64 {
    bits.iter().map(|w| u64::from(w.count_ones())).sum()
}

/// Connects to the destination at `to`, has the VM admitted, and
/// pre-copies guest RAM while the VM runs. On failure the logs are off
/// again and the VM runs on untouched.
pub(crate) fn precopy(
    source: Arc<Source>,
    to: &Path,
    opts: MigrateOptions,
) -> Result<Outgoing, SnapshotError> {
    let started = Instant::now();
    let s = UnixStream::connect(to).map_err(|e| peer(&format!("connecting to {}", to.display()), e))?;
    let mut conn = Conn::new(s)?;
    let hello =
        Hello { format: MIGRATION_FORMAT.into(), version: MIGRATION_VERSION, shape: source.shape.clone() };
    conn.send_json(Tag::Hello, &hello)?;
    let admit = conn.expect_reply(Tag::Admit)?;
    if !admit.ok {
        return Err(SnapshotError::Refused(admit.error.unwrap_or_else(|| "no reason given".into())));
    }
    let mut info = MigrationInfo::default();
    let r = (|| {
        source.start_logs()?;
        info.pages = source.send_pages(&mut conn, None)?;
        let mut device = source.device_pass(&mut conn)?;
        info.precopy_device_bytes = device;
        loop {
            let bits = source.dirty()?;
            let settled = count(&bits) <= opts.converged_pages && device <= CONVERGED_DEVICE_BYTES;
            if settled || info.rounds >= opts.max_rounds {
                info.converged = settled;
                // These go again with the last round, while stopped.
                return Ok(bits);
            }
            info.rounds += 1;
            info.pages += source.send_pages(&mut conn, Some(&bits))?;
            device = source.device_pass(&mut conn)?;
            info.precopy_device_bytes += device;
        }
    })();
    match r {
        Ok(left) => {
            // The pages dirty at the end of pre-copy join the stop round.
            source.carry(left);
            info.precopy = started.elapsed();
            Ok(Outgoing { conn, opts, source, info, started })
        }
        Err(e) => {
            source.stop_logs();
            source.abort_precopy();
            Err(e)
        }
    }
}

impl Source {
    /// Keeps `bits` for the stop round (they were taken off the logs).
    fn carry(&self, bits: Vec<u64>) {
        *self.carried.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = bits;
    }
}

/// Finishes a migration on the vCPU thread, with the vCPU stopped and
/// every vNPU parked or stopped: the last dirty pages, the device
/// streams, the machine state; then waits for the destination's word.
pub(crate) fn stop_and_copy(
    out: &mut Outgoing,
    streams: Vec<(usize, Vec<u8>)>,
    machine: &Machine,
    stopped: Instant,
    drain: Duration,
) -> Result<(), SnapshotError> {
    let mut bits = out.source.dirty()?;
    let carried =
        std::mem::take(&mut *out.source.carried.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    for (d, s) in bits.iter_mut().zip(&carried) {
        *d |= s;
    }
    let n = out.source.send_pages(&mut out.conn, Some(&bits))?;
    out.info.stop_pages = n;
    out.info.pages += n;
    for (slot, s) in &streams {
        let mut body = u32::try_from(*slot).unwrap_or(u32::MAX).to_le_bytes().to_vec();
        body.extend_from_slice(s);
        out.info.device_bytes += s.len() as u64;
        out.conn.send(Tag::Device, &body)?;
    }
    out.conn.send_json(Tag::Machine, machine)?;
    let done = if out.opts.verify {
        snapshot::ram_crc(&out.source.memory, out.source.region.memory_size)?.to_le_bytes().to_vec()
    } else {
        Vec::new()
    };
    out.conn.send(Tag::Done, &done)?;
    let r = out.conn.expect_reply(Tag::Resumed)?;
    if !r.ok {
        return Err(SnapshotError::Refused(r.error.unwrap_or_else(|| "no reason given".into())));
    }
    out.info.restore = Duration::from_secs_f64(r.restore_ms.max(0.0) / 1e3);
    out.info.drain = drain;
    out.info.downtime = stopped.elapsed();
    out.info.total = out.started.elapsed();
    out.info.bytes = out.conn.sent;
    Ok(())
}

/// What a destination received: the VM's shape, its RAM (written into
/// `memory` as it came), the device streams and the machine state.
pub(crate) struct Received {
    pub machine: Machine,
    pub streams: std::collections::BTreeMap<usize, Vec<u8>>,
    pub done_at: Instant,
}

/// The destination's side of the handshake: reads the hello, checks it.
pub(crate) fn hello(conn: &mut Conn) -> Result<Hello, SnapshotError> {
    let (t, b) = conn.recv(MAX_JSON)?;
    if t != Tag::Hello {
        return Err(bad(format!("expected Hello, got {t:?}")));
    }
    let head: serde_json::Value = serde_json::from_slice(&b).map_err(|e| bad(e.to_string()))?;
    if head.get("format").and_then(serde_json::Value::as_str) != Some(MIGRATION_FORMAT) {
        return Err(bad(format!("its format is not \"{MIGRATION_FORMAT}\"")));
    }
    let v = head.get("version").and_then(serde_json::Value::as_u64).unwrap_or(0);
    if v != u64::from(MIGRATION_VERSION) {
        return Err(bad(format!(
            "migration stream version {v}; this build takes version {MIGRATION_VERSION} only"
        )));
    }
    serde_json::from_value(head).map_err(|e| bad(e.to_string()))
}

/// Answers the hello: admitted, or refused with `error`.
pub(crate) fn admit(conn: &mut Conn, error: Option<String>) -> Result<(), SnapshotError> {
    conn.send_json(Tag::Admit, &Reply { ok: error.is_none(), error, restore_ms: 0.0 })
}

/// Answers `Done`: the VM runs here, or it does not (`error`).
pub(crate) fn resumed(
    conn: &mut Conn,
    error: Option<String>,
    restore: Duration,
) -> Result<(), SnapshotError> {
    conn.send_json(
        Tag::Resumed,
        &Reply { ok: error.is_none(), error, restore_ms: restore.as_secs_f64() * 1e3 },
    )
}

/// Receives pages into `memory` of `len` bytes, then the device streams
/// (each at most `stream_limit(slot)` bytes) and the machine state, up to
/// `Done`.
pub(crate) fn receive(
    conn: &mut Conn,
    memory: &GuestMemoryMmap<()>,
    len: u64,
    stream_limit: impl Fn(usize) -> Option<u64>,
    mut piece: impl FnMut(usize, Vec<u8>) -> Result<(), SnapshotError>,
) -> Result<Received, SnapshotError> {
    let pages = len.div_ceil(PAGE);
    let mut streams = std::collections::BTreeMap::new();
    let mut machine = None;
    let max_pages_body = 8 + BATCH as u64 * (8 + PAGE);
    let most = stream_limit_max(&stream_limit).max(max_pages_body).max(MAX_JSON);
    loop {
        let (t, b) = conn.recv(most)?;
        match t {
            Tag::Pages => {
                if b.len() as u64 > max_pages_body {
                    return Err(bad("a Pages message larger than a batch"));
                }
                let n = b.get(..8).map(|x| u64::from_le_bytes(x.try_into().unwrap_or([0; 8])));
                let n = n.ok_or_else(|| bad("a short Pages message"))?;
                let each = 8 + PAGE_BYTES;
                if (b.len() - 8) as u64 != n.saturating_mul(each as u64) {
                    return Err(bad(format!("a Pages message of {} bytes for {n} pages", b.len())));
                }
                for e in b[8..].chunks_exact(each) {
                    let p = u64::from_le_bytes(e[..8].try_into().unwrap_or([0xff; 8]));
                    if p >= pages {
                        return Err(bad(format!("page {p} past guest RAM's {pages} pages")));
                    }
                    let at = p * PAGE;
                    let keep = usize::try_from((len - at).min(PAGE)).unwrap_or(0);
                    memory.write_slice(&e[8..8 + keep], GuestAddress(at)).map_err(|e| bad(e.to_string()))?;
                }
            }
            Tag::Device => {
                let slot = b.get(..4).map(|x| u32::from_le_bytes(x.try_into().unwrap_or([0xff; 4])));
                let slot = usize::try_from(slot.ok_or_else(|| bad("a short Device message"))?)
                    .map_err(|_| bad("a slot past memory"))?;
                let limit = stream_limit(slot)
                    .ok_or_else(|| bad(format!("a device stream for slot {slot}, which holds no vNPU")))?;
                if b.len() as u64 - 4 > limit {
                    return Err(bad(format!("slot {slot}'s device stream is larger than its vNPU can hold")));
                }
                if streams.insert(slot, b[4..].to_vec()).is_some() {
                    return Err(bad(format!("two device streams for slot {slot}")));
                }
            }
            Tag::Piece => {
                let slot = b.get(..4).map(|x| u32::from_le_bytes(x.try_into().unwrap_or([0xff; 4])));
                let slot = usize::try_from(slot.ok_or_else(|| bad("a short Piece message"))?)
                    .map_err(|_| bad("a slot past memory"))?;
                if stream_limit(slot).is_none() {
                    return Err(bad(format!("a pre-copy piece for slot {slot}, which holds no vNPU")));
                }
                if streams.contains_key(&slot) {
                    return Err(bad(format!("a pre-copy piece for slot {slot} after its device stream")));
                }
                piece(slot, b[4..].to_vec())?;
            }
            Tag::Machine => {
                if b.len() as u64 > MAX_JSON {
                    return Err(bad("a machine state larger than allowed"));
                }
                machine =
                    Some(serde_json::from_slice(&b).map_err(|e| bad(format!("the machine state: {e}")))?);
            }
            Tag::Done => {
                let done_at = Instant::now();
                let machine = machine.ok_or_else(|| bad("Done before the machine state"))?;
                match b.len() {
                    0 => {}
                    4 => {
                        let want = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        let found = snapshot::ram_crc(memory, len)?;
                        if found != want {
                            return Err(bad(format!(
                                "guest RAM here differs from the source's (CRC-32 {found:#010x}, the source's {want:#010x})"
                            )));
                        }
                    }
                    n => return Err(bad(format!("a Done message of {n} bytes"))),
                }
                return Ok(Received { machine, streams, done_at });
            }
            other => return Err(bad(format!("an unexpected {other:?} message"))),
        }
    }
}

fn stream_limit_max(f: &impl Fn(usize) -> Option<u64>) -> u64 {
    (1..=crate::MAX_VNPUS).filter_map(f).max().unwrap_or(0).saturating_add(4)
}

/// The offer a hello makes.
pub(crate) fn offer(h: &Hello) -> Offer {
    let mut remote = h.shape.remote_shapes.clone();
    remote.resize(h.shape.remote.len(), RemoteShape::default());
    Offer { memory: h.shape.memory, vnpus: h.shape.vnpus.clone(), remote }
}

/// Takes `bytes` as a destination takes a migration stream from a
/// source, into 1 MiB of guest RAM with one vNPU slot (1) whose device
/// streams may hold 1 MiB (pieces are read, not applied): the
/// `migration_stream` fuzz target's entry. Never panics; a stream that
/// does not check out is an error.
pub fn take_stream(bytes: &[u8]) -> Result<(), SnapshotError> {
    let mut conn = Conn { s: Box::new(Replay(std::io::Cursor::new(bytes.to_vec()))), sent: 0 };
    hello(&mut conn)?;
    let len = 1u64 << 20;
    let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)])
        .map_err(|e| bad(format!("guest RAM: {e}")))?;
    receive(&mut conn, &memory, len, |slot| (slot == 1).then_some(1 << 20), |_, _| Ok(())).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(tag: Tag, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag as u8];
        m.extend_from_slice(&(body.len() as u64).to_le_bytes());
        m.extend_from_slice(body);
        m
    }

    /// A hand-made stream is taken whole; each message spoiled in turn
    /// (a page past RAM, a count its body does not hold, a stream for a
    /// slot with no vNPU, Done before the machine state, another version,
    /// a cut) is refused, never a panic.
    #[test]
    fn a_stream_is_taken_or_refused_with_the_reason() {
        let shape = Shape {
            memory: 1 << 20,
            board: npu_model::BoardConfig::default(),
            vnpus: Vec::new(),
            name: "t".into(),
            poll_us: 0,
            payload: None,
            remote: Vec::new(),
            remote_shapes: Vec::new(),
        };
        let h = Hello { format: MIGRATION_FORMAT.into(), version: MIGRATION_VERSION, shape };
        let hello = msg(Tag::Hello, &serde_json::to_vec(&h).unwrap());
        let page = |p: u64| {
            let mut b = 1u64.to_le_bytes().to_vec();
            b.extend_from_slice(&p.to_le_bytes());
            b.extend_from_slice(&[7; 4096]);
            msg(Tag::Pages, &b)
        };
        // A machine state missing its fields is refused as such.
        let machine = msg(Tag::Machine, b"{}");
        let ok = [hello.clone(), page(3), msg(Tag::Device, &[1, 0, 0, 0, 9])].concat();
        let e = take_stream(&[ok.clone(), machine.clone(), msg(Tag::Done, &[])].concat()).unwrap_err();
        assert!(e.to_string().contains("machine state"), "{e}");
        for (bad, why) in [
            ([hello.clone(), page(256)].concat(), "past guest RAM"),
            ([hello.clone(), msg(Tag::Pages, &5u64.to_le_bytes())].concat(), "for 5 pages"),
            ([hello.clone(), msg(Tag::Device, &[2, 0, 0, 0])].concat(), "holds no vNPU"),
            ([ok.clone(), msg(Tag::Done, &[])].concat(), "before the machine state"),
            ([ok.clone(), msg(Tag::Device, &[1, 0, 0, 0])].concat(), "two device streams"),
            (ok[..ok.len() - 3].to_vec(), "receive"),
            (msg(Tag::Hello, br#"{"format":"vnpu-vm-migration","version":2}"#), "version 2"),
            (vec![99, 0, 0, 0, 0, 0, 0, 0, 0], "unknown message tag"),
        ] {
            let e = take_stream(&bad).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
    }
}
