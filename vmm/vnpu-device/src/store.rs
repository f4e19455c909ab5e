//! What a served vNPU keeps in the board daemon's state directory so that
//! a restarted daemon resumes it (`docs/vfio-user.md`, "Daemon restarts"):
//! one directory per instance holding
//!
//! - `session`: a 4 KiB record, mapped and written as the device runs
//!   (the session's id, the register file, the configuration, the ring
//!   position of the request in flight);
//! - `program.<handle>`: each registered program as it was encoded;
//! - `core<i>.sram`, `core<i>.hbm`: each vNPU core's memories, which the
//!   model maps (`npu_model::Sram::file_backed`, `LazyHbm::file_backed`).
//!
//! Everything is written in place as it changes (a mapped page survives a
//! killed process), so nothing needs saving at exit. The directory must be
//! the daemon's alone: a file another process shrank would fault when
//! touched. Files are only created, sized and written here (no rename or
//! unlink), which an instance thread's system-call filter allows.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use npu_model::{LazyHbm, Sram};
use vnpu_spec::VnpuSpec;

use crate::msi::lock;
use crate::regfile;

/// Size of the `session` record.
const RECORD: usize = 4096;
/// First bytes of a valid record ("VNPUSES1").
const MAGIC: u64 = 0x3153_4553_5550_4e56;
const AT_MAGIC: usize = 0;
const AT_ID: usize = 8;
/// u32: 1 when a configuration follows.
const AT_CONFIGURED: usize = 16;
/// u32 chips, cores per chip, SAs, VUs, then u64 SRAM and HBM bytes.
const AT_CONFIG: usize = 24;
/// u32: 1 when a request is in flight, then the u16 ring index it was taken from.
const AT_IN_FLIGHT: usize = 64;
const AT_REGS: usize = 128;

/// A vNPU instance's resumable state.
#[derive(Debug)]
pub struct SessionStore {
    dir: PathBuf,
    record: Mutex<memmap2::MmapMut>,
}

fn file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)
}

fn get_u64(m: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&m[at..at + 8]);
    u64::from_le_bytes(b)
}

fn get_u32(m: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&m[at..at + 4]);
    u32::from_le_bytes(b)
}

impl SessionStore {
    /// The store in `dir` (an existing directory), its record mapped.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let f = file(&dir.join("session"))?;
        if f.metadata()?.len() != RECORD as u64 {
            f.set_len(0)?;
            f.set_len(RECORD as u64)?;
        }
        // SAFETY: the mapping covers the file's RECORD bytes (sized
        // above); the file is the daemon's own and never shrunk while
        // mapped.
        let record = unsafe { memmap2::MmapOptions::new().len(RECORD).map_mut(&f)? };
        Ok(Self { dir: dir.to_path_buf(), record: Mutex::new(record) })
    }

    /// The id of the session the store holds, if it holds one that can be
    /// resumed.
    pub fn session(&self) -> Option<u64> {
        let m = lock(&self.record);
        (get_u64(&m, AT_MAGIC) == MAGIC).then(|| get_u64(&m, AT_ID))
    }

    /// Starts session `id` from nothing: the record emptied, programs and
    /// core memories dropped.
    pub fn begin(&self, id: u64) -> std::io::Result<()> {
        {
            let mut m = lock(&self.record);
            m.fill(0);
        }
        self.clear_programs()?;
        self.clear_cores()?;
        let mut m = lock(&self.record);
        m[AT_ID..AT_ID + 8].copy_from_slice(&id.to_le_bytes());
        m[AT_MAGIC..AT_MAGIC + 8].copy_from_slice(&MAGIC.to_le_bytes());
        Ok(())
    }

    /// Makes the session impossible to resume (something it needs could
    /// not be stored: resuming it could give wrong results).
    pub fn invalidate(&self, why: &str) {
        log::warn!("{}: the session cannot be resumed after a restart: {why}", self.dir.display());
        lock(&self.record)[AT_MAGIC..AT_MAGIC + 8].fill(0);
    }

    pub(crate) fn save_regs(&self, bytes: &[u8; regfile::LEN]) {
        lock(&self.record)[AT_REGS..AT_REGS + regfile::LEN].copy_from_slice(bytes);
    }

    pub(crate) fn regs(&self) -> [u8; regfile::LEN] {
        let mut b = [0u8; regfile::LEN];
        b.copy_from_slice(&lock(&self.record)[AT_REGS..AT_REGS + regfile::LEN]);
        b
    }

    pub(crate) fn save_config(&self, c: Option<VnpuSpec>) {
        let mut m = lock(&self.record);
        m[AT_CONFIGURED..AT_CONFIGURED + 4].copy_from_slice(&u32::from(c.is_some()).to_le_bytes());
        if let Some(c) = c {
            let words = [c.chips(), c.cores_per_chip(), c.sa_per_core(), c.vu_per_core()];
            for (i, w) in words.iter().enumerate() {
                m[AT_CONFIG + 4 * i..AT_CONFIG + 4 * i + 4].copy_from_slice(&w.to_le_bytes());
            }
            m[AT_CONFIG + 16..AT_CONFIG + 24].copy_from_slice(&c.sram_per_core().to_le_bytes());
            m[AT_CONFIG + 24..AT_CONFIG + 32].copy_from_slice(&c.hbm_per_core().to_le_bytes());
        }
    }

    /// The stored configuration: `Ok(None)` when released, an error when
    /// the stored one is not a valid shape.
    pub(crate) fn config(&self) -> Result<Option<VnpuSpec>, vnpu_spec::ShapeError> {
        let m = lock(&self.record);
        if get_u32(&m, AT_CONFIGURED) != 1 {
            return Ok(None);
        }
        let w = |i: usize| get_u32(&m, AT_CONFIG + 4 * i);
        VnpuSpec::new(w(0), w(1), w(2), w(3), get_u64(&m, AT_CONFIG + 16), get_u64(&m, AT_CONFIG + 24))
            .map(Some)
    }

    /// Records the request taken from ring index `index` as in flight
    /// (`None`: none is).
    pub(crate) fn set_in_flight(&self, index: Option<u16>) {
        let mut m = lock(&self.record);
        let v = index.map_or(0u64, |i| 1 | u64::from(i) << 32);
        m[AT_IN_FLIGHT..AT_IN_FLIGHT + 8].copy_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn in_flight(&self) -> Option<u16> {
        let v = get_u64(&lock(&self.record), AT_IN_FLIGHT);
        (v & 1 == 1).then(|| u16::try_from(v >> 32 & 0xffff).unwrap_or(0))
    }

    fn program_path(&self, handle: usize) -> PathBuf {
        self.dir.join(format!("program.{handle}"))
    }

    pub(crate) fn save_program(&self, handle: usize, bytes: &[u8]) -> std::io::Result<()> {
        let mut f = file(&self.program_path(handle))?;
        f.set_len(0)?;
        f.write_all(bytes)
    }

    pub(crate) fn forget_program(&self, handle: usize) -> std::io::Result<()> {
        match OpenOptions::new().write(true).open(self.program_path(handle)) {
            Ok(f) => f.set_len(0),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The stored programs (handle, encoded bytes); empty files are free
    /// handles.
    pub(crate) fn programs(&self) -> std::io::Result<Vec<(usize, Vec<u8>)>> {
        let mut out = Vec::new();
        for (handle, path) in self.numbered("program.")? {
            let mut bytes = Vec::new();
            let f = File::open(&path)?;
            // No more than a program may hold.
            f.take(u64::from(vnpu_abi::device::MAX_PROGRAM_BYTES)).read_to_end(&mut bytes)?;
            if !bytes.is_empty() {
                out.push((handle, bytes));
            }
        }
        Ok(out)
    }

    /// Files of the directory named `<prefix><number>[.<anything>]`.
    fn numbered(&self, prefix: &str) -> std::io::Result<Vec<(usize, PathBuf)>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            let name = e.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else { continue };
            let digits = rest.split('.').next().unwrap_or("");
            if let Ok(n) = digits.parse::<usize>() {
                out.push((n, e.path()));
            }
        }
        Ok(out)
    }

    pub(crate) fn clear_programs(&self) -> std::io::Result<()> {
        for (h, _) in self.numbered("program.")? {
            self.forget_program(h)?;
        }
        Ok(())
    }

    /// Drops every core's memory (a new configuration starts from zeros).
    pub(crate) fn clear_cores(&self) -> std::io::Result<()> {
        for (_, path) in self.numbered("core")? {
            OpenOptions::new().write(true).open(path)?.set_len(0)?;
        }
        Ok(())
    }

    /// Core `core`'s memories, held in its files (what they hold when
    /// they have these sizes; zeros otherwise).
    pub(crate) fn core(&self, core: usize, sram: u64, hbm: u64) -> std::io::Result<crate::worker::Core> {
        let s = Sram::file_backed(sram, file(&self.dir.join(format!("core{core}.sram")))?)?;
        let h = LazyHbm::file_backed(hbm, file(&self.dir.join(format!("core{core}.hbm")))?)?;
        Ok(crate::worker::Core { sram: s, hbm: h })
    }
}
