//! Snapshot and restore of a whole VM with its in-process vNPUs
//! (`docs/migration.md`): the vCPU's registers and the in-kernel
//! interrupt controllers and clock, guest RAM as a sparse file, the
//! devices the VMM models (UART, CMOS index, PCI functions with their
//! MSI-X tables), and each vNPU's device state as its device core saves
//! it (`vnpu_device::StateHandle`: registers, configuration, registered
//! programs, SRAM and HBM).
//!
//! A snapshot is taken on the vCPU thread between two runs of the vCPU
//! that KVM ended with `EINTR` (so no port or MMIO access is half done),
//! with every vNPU parked between requests: guest RAM, the vCPU and the
//! devices are saved at one instant.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use npu_model::BoardConfig;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vnpu_spec::VnpuSpec;

/// The `format` field of a snapshot's `vm.json`.
pub const SNAPSHOT_FORMAT: &str = "vnpu-vm-snapshot";
/// The snapshot format version this build writes and reads.
pub const SNAPSHOT_VERSION: u32 = 1;
/// The VM's state, a JSON file in the snapshot's folder.
pub const STATE_FILE: &str = "vm.json";
/// Guest RAM, a sparse file (pages of zeros are holes).
pub const RAM_FILE: &str = "ram";
const PAGE: usize = 4096;

/// Why a snapshot could not be taken or restored.
#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a VM snapshot this build can read: {reason}")]
    Format { path: String, reason: String },
    #[error("{path}: snapshot format version {found}; this build reads version {SNAPSHOT_VERSION} only")]
    Version { path: String, found: u32 },
    #[error("{path} is corrupt (its checksum is {found:#010x}, the snapshot says {saved:#010x})")]
    Corrupt { path: String, found: u32, saved: u32 },
    #[error("{path} is not empty: a snapshot goes into a new or empty folder")]
    NotEmpty { path: String },
    #[error("this VM cannot be snapshotted yet: {0}")]
    Unsupported(&'static str),
    #[error("KVM: {what}: {source}")]
    Kvm {
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("the vNPU in slot {slot}: {source}")]
    Device {
        slot: usize,
        #[source]
        source: vnpu_device::SnapshotError,
    },
    #[error("the PCI function in slot {slot}: {source}")]
    Pci {
        slot: usize,
        #[source]
        source: vnpu_pci::PciError,
    },
    #[error("the vNPU in slot {slot}, served by a board daemon: {source}")]
    Remote {
        slot: usize,
        #[source]
        source: crate::remote::RemoteError,
    },
    #[error("the UART's saved state: {0}")]
    Serial(String),
    #[error("the VM is not running, or stopped before it took the snapshot")]
    NotRunning,
    #[error("the destination refused the migration: {0}")]
    Refused(String),
    #[error("the migration stream: {0}")]
    Stream(String),
}

pub(crate) fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io { path: path.display().to_string(), source }
}

pub(crate) fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> SnapshotError {
    move |source| SnapshotError::Kvm { what, source }
}

/// What a VM is, as far as its snapshot needs to rebuild it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Shape {
    pub memory: u64,
    pub board: BoardConfig,
    pub vnpus: Vec<VnpuSpec>,
    pub name: String,
    pub poll_us: u64,
    /// Guest address and length of the payload, if it had one.
    pub payload: Option<(u64, u64)>,
    /// The vfio-user sockets of the vNPUs a board daemon serves (PCI
    /// slots after the in-process ones).
    #[serde(default)]
    pub remote: Vec<PathBuf>,
    /// What is known of each of those vNPUs (for a migration's admission).
    #[serde(default)]
    pub remote_shapes: Vec<crate::migrate::RemoteShape>,
}

/// The x87/SSE state as KVM_GET_FPU gives it (kvm-bindings has no serde
/// for it; saved for hosts without XSAVE).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Fpu {
    fpr: Vec<[u8; 16]>,
    fcw: u16,
    fsw: u16,
    ftwx: u8,
    last_opcode: u16,
    last_ip: u64,
    last_dp: u64,
    xmm: Vec<[u8; 16]>,
    mxcsr: u32,
}

impl Fpu {
    fn from_kvm(f: &kvm_bindings::kvm_fpu) -> Self {
        Self {
            fpr: f.fpr.to_vec(),
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm.to_vec(),
            mxcsr: f.mxcsr,
        }
    }

    fn to_kvm(&self) -> kvm_bindings::kvm_fpu {
        let mut f = kvm_bindings::kvm_fpu {
            fcw: self.fcw,
            fsw: self.fsw,
            ftwx: self.ftwx,
            last_opcode: self.last_opcode,
            last_ip: self.last_ip,
            last_dp: self.last_dp,
            mxcsr: self.mxcsr,
            ..Default::default()
        };
        for (d, s) in f.fpr.iter_mut().zip(&self.fpr) {
            *d = *s;
        }
        for (d, s) in f.xmm.iter_mut().zip(&self.xmm) {
            *d = *s;
        }
        f
    }
}

/// One vCPU's state.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Vcpu {
    regs: kvm_regs,
    sregs: kvm_sregs,
    fpu: Fpu,
    xsave: Option<kvm_xsave>,
    xcrs: Option<kvm_xcrs>,
    lapic: kvm_lapic_state,
    mp_state: kvm_mp_state,
    events: kvm_vcpu_events,
    debugregs: kvm_debugregs,
    /// Every MSR KVM lists that it would read, as (index, value).
    msrs: Vec<(u32, u64)>,
}

/// The UART's registers and receive FIFO (vm-superio's `SerialState`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Serial {
    baud_divisor_low: u8,
    baud_divisor_high: u8,
    interrupt_enable: u8,
    interrupt_identification: u8,
    line_control: u8,
    line_status: u8,
    modem_control: u8,
    modem_status: u8,
    scratch: u8,
    in_buffer: Vec<u8>,
}

impl Serial {
    pub fn from_superio(s: &vm_superio::serial::SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }

    pub fn to_superio(&self) -> vm_superio::serial::SerialState {
        vm_superio::serial::SerialState {
            baud_divisor_low: self.baud_divisor_low,
            baud_divisor_high: self.baud_divisor_high,
            interrupt_enable: self.interrupt_enable,
            interrupt_identification: self.interrupt_identification,
            line_control: self.line_control,
            line_status: self.line_status,
            modem_control: self.modem_control,
            modem_status: self.modem_status,
            scratch: self.scratch,
            in_buffer: self.in_buffer.clone(),
        }
    }
}

/// A PCI function's saved state.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Function {
    pub slot: usize,
    pub config: Vec<u8>,
    pub extra: Vec<u32>,
}

/// What `vm.json` holds.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Saved {
    pub format: String,
    pub version: u32,
    pub shape: Shape,
    /// Every other file of the snapshot (guest RAM, each vNPU's record,
    /// programs and memories) by path in the folder: its length and the
    /// CRC-32 of its pages that are not all zero ([`digest`]).
    pub files: std::collections::BTreeMap<String, (u64, u32)>,
    pub vcpu: Vcpu,
    /// The PIC master, the PIC slave and the IOAPIC.
    pub irqchips: Vec<kvm_irqchip>,
    pub clock: kvm_clock_data,
    pub serial: Serial,
    pub cmos_index: u8,
    pub functions: Vec<Function>,
}

/// What a snapshot took: its size on disk and how long it took.
#[derive(Clone, Debug)]
pub struct SnapshotInfo {
    pub dir: PathBuf,
    /// Bytes the snapshot's files hold (allocated, not apparent: holes
    /// are free).
    pub bytes: u64,
    /// Guest RAM pages that were not all zero.
    pub ram_pages: u64,
    /// From the vCPU's stop to the files written.
    pub took: std::time::Duration,
    /// Of `took`, the wait for every vNPU to finish the request it was
    /// running and park.
    pub drain: std::time::Duration,
}

/// Reads the vCPU's state.
pub(crate) fn save_vcpu(kvm_fd: &Kvm, vcpu: &VcpuFd) -> Result<Vcpu, SnapshotError> {
    let regs = vcpu.get_regs().map_err(kvm("get regs"))?;
    let sregs = vcpu.get_sregs().map_err(kvm("get sregs"))?;
    let fpu = Fpu::from_kvm(&vcpu.get_fpu().map_err(kvm("get FPU"))?);
    let xsave = vcpu.get_xsave().ok();
    let xcrs = vcpu.get_xcrs().ok();
    let lapic = vcpu.get_lapic().map_err(kvm("get local APIC"))?;
    let mp_state = vcpu.get_mp_state().map_err(kvm("get MP state"))?;
    let events = vcpu.get_vcpu_events().map_err(kvm("get vCPU events"))?;
    let debugregs = vcpu.get_debug_regs().map_err(kvm("get debug registers"))?;
    let index = kvm_fd.get_msr_index_list().map_err(kvm("list MSRs"))?;
    let mut msrs = Vec::new();
    // KVM reads MSRs in order and stops at the first it cannot read: that
    // one is left out and the rest read again.
    let mut rest: Vec<u32> = index.as_slice().to_vec();
    while !rest.is_empty() {
        let entries: Vec<kvm_bindings::kvm_msr_entry> =
            rest.iter().map(|&i| kvm_bindings::kvm_msr_entry { index: i, ..Default::default() }).collect();
        let mut m = Msrs::from_entries(&entries).map_err(|_| SnapshotError::Unsupported("too many MSRs"))?;
        let n = vcpu.get_msrs(&mut m).map_err(kvm("get MSRs"))?;
        msrs.extend(m.as_slice()[..n.min(entries.len())].iter().map(|e| (e.index, e.data)));
        rest.drain(..(n + 1).min(rest.len()));
    }
    Ok(Vcpu { regs, sregs, fpu, xsave, xcrs, lapic, mp_state, events, debugregs, msrs })
}

/// Sets a new vCPU to a saved state (in the order KVM needs: MSRs and
/// special registers before the local APIC, events last).
pub(crate) fn restore_vcpu(vcpu: &VcpuFd, s: &Vcpu) -> Result<(), SnapshotError> {
    // MSRs one by one: one KVM does not take here (a feature this host
    // lacks) is left at its reset value rather than failing the restore.
    for &(index, data) in &s.msrs {
        let m = Msrs::from_entries(&[kvm_bindings::kvm_msr_entry { index, data, ..Default::default() }])
            .map_err(|_| SnapshotError::Unsupported("an MSR list"))?;
        if vcpu.set_msrs(&m).map_err(kvm("set MSRs"))? != 1 {
            log::debug!("snapshot restore: MSR {index:#x} not taken by this host");
        }
    }
    vcpu.set_sregs(&s.sregs).map_err(kvm("set sregs"))?;
    vcpu.set_regs(&s.regs).map_err(kvm("set regs"))?;
    vcpu.set_fpu(&s.fpu.to_kvm()).map_err(kvm("set FPU"))?;
    if let Some(x) = &s.xsave {
        // SAFETY: `x` is a whole kvm_xsave that KVM_GET_XSAVE filled on a
        // vCPU of the same kind; KVM checks its contents.
        unsafe { vcpu.set_xsave(x) }.map_err(kvm("set XSAVE"))?;
    }
    if let Some(x) = &s.xcrs {
        vcpu.set_xcrs(x).map_err(kvm("set XCRs"))?;
    }
    vcpu.set_debug_regs(&s.debugregs).map_err(kvm("set debug registers"))?;
    vcpu.set_lapic(&s.lapic).map_err(kvm("set local APIC"))?;
    vcpu.set_mp_state(s.mp_state).map_err(kvm("set MP state"))?;
    vcpu.set_vcpu_events(&s.events).map_err(kvm("set vCPU events"))?;
    Ok(())
}

/// The three in-kernel interrupt controllers' states.
pub(crate) fn save_irqchips(vm: &VmFd) -> Result<Vec<kvm_irqchip>, SnapshotError> {
    (0..3)
        .map(|chip_id| {
            let mut c = kvm_irqchip { chip_id, ..Default::default() };
            vm.get_irqchip(&mut c).map_err(kvm("get irqchip"))?;
            Ok(c)
        })
        .collect()
}

/// Whether every byte of `p` is zero (OR-folded 64 bytes at a time, which
/// the compiler vectorizes; a byte-by-byte `all` scanned 512 MiB of RAM
/// at about 2 GB/s).
pub(crate) fn page_is_zero(p: &[u8]) -> bool {
    let mut blocks = p.chunks_exact(64);
    let folded = blocks.by_ref().fold(0u64, |acc, b| {
        b.chunks_exact(8)
            .fold(acc, |a, w| a | u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
    });
    folded == 0 && blocks.remainder().iter().all(|&b| b == 0)
}

/// Guest RAM's first `n` bytes as one slice, to read while nothing runs
/// that writes it (the vCPU stopped and every vNPU parked, or not started).
fn ram_bytes(memory: &GuestMemoryMmap<()>, n: usize) -> Result<&[u8], SnapshotError> {
    let slice = memory
        .get_slice(GuestAddress(0), n)
        .map_err(|e| SnapshotError::Format { path: "guest RAM".into(), reason: e.to_string() })?;
    // SAFETY: `slice` covers guest RAM's one mapping of `n` bytes, which
    // `memory` keeps mapped as long as the borrow of it this returns;
    // callers have stopped the vCPU and parked every vNPU, so nothing
    // writes it meanwhile (a racing write would only make a copy or a
    // checksum of that page stale, never unsound for a byte read).
    Ok(unsafe { std::slice::from_raw_parts(slice.ptr_guard().as_ptr(), n) })
}

/// The CRC-32 of guest RAM's first `len` bytes (see [`ram_bytes`] for
/// when it may be read).
pub(crate) fn ram_crc(memory: &GuestMemoryMmap<()>, len: u64) -> Result<u32, SnapshotError> {
    let n =
        usize::try_from(len).map_err(|_| SnapshotError::Unsupported("RAM larger than the address space"))?;
    Ok(crc32fast::hash(ram_bytes(memory, n)?))
}

/// Writes guest RAM into `path` as a sparse file of RAM's length;
/// returns its digest ([`digest`]) and the pages written.
pub(crate) fn save_ram(
    memory: &GuestMemoryMmap<()>,
    len: u64,
    path: &Path,
) -> Result<(u32, u64), SnapshotError> {
    let f = private_file(path)?;
    f.set_len(len).map_err(io_at(path))?;
    let n =
        usize::try_from(len).map_err(|_| SnapshotError::Unsupported("RAM larger than the address space"))?;
    let ram = ram_bytes(memory, n)?;
    let mut crc = crc32fast::Hasher::new();
    let mut pages = 0u64;
    let mut last = [0u8; PAGE];
    for (i, p) in ram.chunks(PAGE).enumerate() {
        if page_is_zero(p) {
            continue;
        }
        let at = (i as u64) * PAGE as u64;
        f.write_all_at(p, at).map_err(io_at(path))?;
        // A last page that is not whole counts as padded with zeros, as
        // `digest` reads it.
        let whole = if p.len() == PAGE {
            p
        } else {
            last[..p.len()].copy_from_slice(p);
            &last[..]
        };
        crc.update(&(i as u64).to_le_bytes());
        crc.update(whole);
        pages += 1;
    }
    f.sync_all().map_err(io_at(path))?;
    Ok((crc.finalize(), pages))
}

/// The length of the file at `path` and the checksum of its pages that
/// are not all zero, each after its page number (little-endian u64), in
/// page order: what [`save_ram`] computes as it writes, read back from
/// the file's data only (holes are zeros).
pub(crate) fn digest(path: &Path) -> std::io::Result<(u64, u32)> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let mut crc = crc32fast::Hasher::new();
    let mut page = vec![0u8; PAGE];
    let mut at = 0u64;
    while at < len {
        let Some((start, end)) = data_extent(&f, at, len)? else { break };
        let mut p = start - start % PAGE as u64;
        f.seek(SeekFrom::Start(p))?;
        while p < end {
            let n = usize::try_from((len - p).min(PAGE as u64)).unwrap_or(PAGE);
            page[n..].fill(0);
            f.read_exact(&mut page[..n])?;
            if !page_is_zero(&page) {
                crc.update(&(p / PAGE as u64).to_le_bytes());
                crc.update(&page);
            }
            p += PAGE as u64;
        }
        at = p;
    }
    Ok((len, crc.finalize()))
}

/// The digests of every file under `dir` but the state file and `skip`
/// (whose digest the caller has), by path relative to `dir`.
pub(crate) fn manifest_except(
    dir: &Path,
    skip: &str,
) -> Result<std::collections::BTreeMap<String, (u64, u32)>, SnapshotError> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).map_err(io_at(&d))? {
            let e = e.map_err(io_at(&d))?;
            let p = e.path();
            let t = e.file_type().map_err(io_at(&p))?;
            if t.is_dir() {
                todo.push(p);
            } else if t.is_file() && p.file_name().is_some_and(|n| n != STATE_FILE) {
                let rel = p.strip_prefix(dir).unwrap_or(&p).display().to_string();
                if rel != skip {
                    out.insert(rel, digest(&p).map_err(io_at(&p))?);
                }
            }
        }
    }
    Ok(out)
}

/// Checks every file the manifest of `saved` names against its digest;
/// returns the RAM file, which must be `len` bytes.
pub(crate) fn check_files(dir: &Path, saved: &Saved, len: u64) -> Result<File, SnapshotError> {
    for (rel, &(size, crc)) in &saved.files {
        let p = dir.join(rel);
        if Path::new(rel).components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
            return Err(SnapshotError::Format {
                path: p.display().to_string(),
                reason: "a file outside the snapshot".into(),
            });
        }
        let (found_len, found) = digest(&p).map_err(io_at(&p))?;
        if found_len != size {
            return Err(SnapshotError::Format {
                path: p.display().to_string(),
                reason: format!("the file is {found_len} bytes, the snapshot says {size}"),
            });
        }
        if found != crc {
            return Err(SnapshotError::Corrupt { path: p.display().to_string(), found, saved: crc });
        }
    }
    let path = dir.join(RAM_FILE);
    match saved.files.get(RAM_FILE) {
        Some(&(l, _)) if l == len => File::open(&path).map_err(io_at(&path)),
        _ => Err(SnapshotError::Format {
            path: path.display().to_string(),
            reason: format!("the snapshot lists no guest RAM of {len} bytes"),
        }),
    }
}

/// The next run of data at or after `from` (SEEK_DATA, then SEEK_HOLE).
fn data_extent(f: &File, from: u64, len: u64) -> std::io::Result<Option<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let off =
        libc::off_t::try_from(from).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek(2) on a descriptor `f` owns moves only its offset.
    let data = unsafe { libc::lseek(f.as_raw_fd(), off, libc::SEEK_DATA) };
    if data < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            // No SEEK_DATA on this file system: all of it is data.
            Some(libc::EINVAL) => Ok(Some((from, len))),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    let hole = unsafe { libc::lseek(f.as_raw_fd(), data, libc::SEEK_HOLE) };
    let (Ok(d), Ok(h)) = (u64::try_from(data), u64::try_from(hole)) else {
        return Err(std::io::Error::last_os_error());
    };
    Ok(Some((d, h.min(len))))
}

/// Reads and checks `vm.json` of the snapshot in `dir`.
pub(crate) fn load(dir: &Path) -> Result<Saved, SnapshotError> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read(&path).map_err(io_at(&path))?;
    let p = path.display().to_string();
    // The format and version first, so that another version says so
    // rather than failing on a field it lacks.
    let head: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| SnapshotError::Format { path: p.clone(), reason: e.to_string() })?;
    if head.get("format").and_then(serde_json::Value::as_str) != Some(SNAPSHOT_FORMAT) {
        return Err(SnapshotError::Format {
            path: p,
            reason: format!("its format is not \"{SNAPSHOT_FORMAT}\""),
        });
    }
    let found = head.get("version").and_then(serde_json::Value::as_u64).unwrap_or(0);
    if found != u64::from(SNAPSHOT_VERSION) {
        return Err(SnapshotError::Version { path: p, found: u32::try_from(found).unwrap_or(u32::MAX) });
    }
    serde_json::from_value(head).map_err(|e| SnapshotError::Format { path: p, reason: e.to_string() })
}

/// Writes `vm.json` into `dir` (through a temporary file, renamed once
/// whole: a snapshot whose state file exists is complete).
pub(crate) fn store(dir: &Path, saved: &Saved) -> Result<(), SnapshotError> {
    let path = dir.join(STATE_FILE);
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    let text = serde_json::to_vec(saved)
        .map_err(|e| SnapshotError::Format { path: path.display().to_string(), reason: e.to_string() })?;
    let mut f = private_file(&tmp)?;
    f.write_all(&text).map_err(io_at(&tmp))?;
    f.sync_all().map_err(io_at(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_at(&path))?;
    Ok(())
}

/// Makes `dir` a new or empty folder for a snapshot, private to this
/// user (0700): a snapshot holds a tenant's guest RAM and vNPU memories.
pub(crate) fn fresh_dir(dir: &Path) -> Result<(), SnapshotError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_at(parent))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_at(dir)(e)),
    }
    let m = std::fs::symlink_metadata(dir).map_err(io_at(dir))?;
    if !m.is_dir() {
        return Err(SnapshotError::Format { path: dir.display().to_string(), reason: "not a folder".into() });
    }
    if std::fs::read_dir(dir).map_err(io_at(dir))?.next().is_some() {
        return Err(SnapshotError::NotEmpty { path: dir.display().to_string() });
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io_at(dir))?;
    Ok(())
}

/// A new file at `path` that only this user can read or write (0600).
fn private_file(path: &Path) -> Result<File, SnapshotError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(io_at(path))
}

/// Bytes allocated to the files under `dir`.
pub(crate) fn allocated(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => allocated(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// The device stream of the daemon-served vNPU in `slot` inside a
/// snapshot (`vnpu_device`'s stream format).
pub(crate) fn stream_file(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("vnpu-{slot}.stream"))
}

/// Writes `bytes` into a new private file at `path`, synced.
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    let mut f = private_file(path)?;
    f.write_all(bytes).map_err(io_at(path))?;
    f.sync_all().map_err(io_at(path))
}

/// Copies the RAM file's data (its holes are zeros already) into guest
/// RAM of `len` bytes.
pub(crate) fn copy_ram(ram: &File, memory: &GuestMemoryMmap<()>, len: u64) -> Result<(), SnapshotError> {
    use vm_memory::Bytes;
    let path = Path::new("the snapshot's RAM file");
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < len {
        let Some((start, end)) = data_extent(ram, at, len).map_err(io_at(path))? else { break };
        let mut p = start;
        while p < end {
            let n = usize::try_from((end - p).min(buf.len() as u64)).unwrap_or(buf.len());
            ram.read_exact_at(&mut buf[..n], p).map_err(io_at(path))?;
            memory.write_slice(&buf[..n], GuestAddress(p)).map_err(|e| SnapshotError::Format {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
            p += n as u64;
        }
        at = end;
    }
    Ok(())
}

/// The folder of the vNPU in `slot` inside a snapshot.
pub(crate) fn vnpu_dir(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("vnpu-{slot}"))
}

/// What the API thread asks of the vCPU thread.
#[derive(Debug)]
pub(crate) enum Ask {
    /// A snapshot into `dir`, then run on or (`stop`) end.
    Snapshot { dir: PathBuf, stop: bool },
    /// The stop-and-copy of a live migration past its pre-copy.
    Finish(Box<crate::migrate::Outgoing>),
}

/// What the vCPU thread answers.
#[derive(Debug)]
pub(crate) enum Done {
    Snapshot(SnapshotInfo),
    Migrated(crate::migrate::MigrationInfo),
}

/// A request of a running VM ([`crate::Vm::pause_handle`]): the ask
/// until the vCPU thread takes it, then its answer.
#[derive(Debug)]
struct Request {
    ask: Option<Ask>,
    answer: Option<Result<Done, SnapshotError>>,
}

#[derive(Debug, Default)]
struct PauseState {
    /// The vCPU thread, while the VM runs.
    thread: Option<libc::pthread_t>,
    request: Option<Request>,
    /// The asker has passed the last answer on (`reply_sent`).
    sent: bool,
    /// What a live migration reads while the VM runs.
    source: Option<Arc<crate::migrate::Source>>,
}

/// Asks a running VM for a snapshot from another thread (an API socket's):
/// the vCPU is kicked out of KVM with a signal and takes the snapshot on
/// its own thread.
#[derive(Clone, Debug, Default)]
pub struct PauseHandle {
    inner: Arc<(Mutex<PauseState>, Condvar)>,
}

/// The signal that kicks the vCPU out of KVM_RUN (a no-op handler: the
/// run returns EINTR).
fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN() + 2
}

extern "C" fn kicked(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PauseHandle {
    /// Takes a snapshot of the running VM into `dir` (new or empty), then
    /// lets it run on, or (`stop`) ends it. Waits for the vCPU's thread.
    pub fn snapshot(&self, dir: &Path, stop: bool) -> Result<SnapshotInfo, SnapshotError> {
        match self.ask(Ask::Snapshot { dir: dir.to_path_buf(), stop })? {
            Done::Snapshot(i) => Ok(i),
            Done::Migrated(_) => Err(SnapshotError::NotRunning),
        }
    }

    /// Migrates the running VM live to the VMM waiting at `to` (`vnpu
    /// receive`): pre-copy on this thread while the VM runs, then the
    /// stop-and-copy on the vCPU's. On success the VM runs there and ends
    /// here; on any failure it runs on here as it was.
    /// `opts` say how (a check of guest RAM's CRC-32 at the destination,
    /// the bounds of pre-copy).
    pub fn migrate(
        &self,
        to: &Path,
        opts: crate::migrate::MigrateOptions,
    ) -> Result<crate::migrate::MigrationInfo, SnapshotError> {
        let source = lock(&self.inner.0)
            .source
            .clone()
            .ok_or(SnapshotError::Unsupported("this VM cannot be migrated (see `vnpu snapshot`)"))?;
        if lock(&self.inner.0).thread.is_none() {
            return Err(SnapshotError::NotRunning);
        }
        let out = crate::migrate::precopy(Arc::clone(&source), to, opts)?;
        match self.ask(Ask::Finish(Box::new(out))) {
            Ok(Done::Migrated(i)) => Ok(i),
            Ok(Done::Snapshot(_)) => Err(SnapshotError::NotRunning),
            Err(e) => {
                // The vCPU thread turns the logs off itself when it ran the
                // stop round; a VM that ended first never did.
                if matches!(e, SnapshotError::NotRunning) {
                    source.stop_logs();
                }
                Err(e)
            }
        }
    }

    /// Hands `ask` to the vCPU thread and waits for its answer.
    fn ask(&self, ask: Ask) -> Result<Done, SnapshotError> {
        let (m, cv) = &*self.inner;
        let mut g = lock(m);
        if g.request.is_some() {
            return Err(SnapshotError::Unsupported("another snapshot or migration is under way"));
        }
        g.request = Some(Request { ask: Some(ask), answer: None });
        g.sent = false;
        loop {
            if let Some(a) = g.request.as_mut().and_then(|r| r.answer.take()) {
                g.request = None;
                return a;
            }
            let Some(t) = g.thread else {
                g.request = None;
                return Err(SnapshotError::NotRunning);
            };
            // Kicked again until it answers: a signal that lands while the
            // vCPU is outside KVM_RUN is seen at its next entry, but one
            // sent just before it blocks signals is not.
            // SAFETY: pthread_kill of a live thread of this process (the
            // vCPU thread clears `thread` before it ends) with a signal
            // whose handler does nothing.
            unsafe { libc::pthread_kill(t, kick_signal()) };
            g = cv
                .wait_timeout(g, std::time::Duration::from_millis(5))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// What a live migration of this VM reads while it runs.
    pub(crate) fn set_source(&self, source: Option<Arc<crate::migrate::Source>>) {
        lock(&self.inner.0).source = source;
    }

    /// The asker passed the answer of [`Self::snapshot`] on (an API
    /// socket's reply written): a VM that stops after its snapshot waits
    /// for this, so that its process does not end before the reply.
    pub fn reply_sent(&self) {
        let (m, cv) = &*self.inner;
        lock(m).sent = true;
        cv.notify_all();
    }

    /// Waits up to `limit` for [`Self::reply_sent`].
    pub(crate) fn wait_reply_sent(&self, limit: std::time::Duration) {
        let (m, cv) = &*self.inner;
        let deadline = std::time::Instant::now() + limit;
        let mut g = lock(m);
        while !g.sent {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return;
            }
            g = cv.wait_timeout(g, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
    }

    /// Called by the vCPU thread as it starts running the VM.
    pub(crate) fn running(&self) -> Result<(), SnapshotError> {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), kicked)
            .map_err(|e| SnapshotError::Io { path: "the vCPU's kick signal".into(), source: e.into() })?;
        // SAFETY: pthread_self has no preconditions.
        lock(&self.inner.0).thread = Some(unsafe { libc::pthread_self() });
        Ok(())
    }

    /// Called by the vCPU thread as it stops running the VM: a request
    /// still waiting is answered.
    pub(crate) fn stopped(&self) {
        let (m, cv) = &*self.inner;
        let mut g = lock(m);
        g.thread = None;
        if let Some(r) = g.request.as_mut() {
            if r.answer.is_none() {
                r.answer = Some(Err(SnapshotError::NotRunning));
            }
        }
        cv.notify_all();
    }

    /// What is asked, if anything is (taken: the vCPU thread serves it).
    pub(crate) fn asked(&self) -> Option<Ask> {
        lock(&self.inner.0).request.as_mut().filter(|r| r.answer.is_none()).and_then(|r| r.ask.take())
    }

    /// Answers the request.
    pub(crate) fn answer(&self, a: Result<Done, SnapshotError>) {
        let (m, cv) = &*self.inner;
        if let Some(r) = lock(m).request.as_mut() {
            r.answer = Some(a);
        }
        cv.notify_all();
    }
}
