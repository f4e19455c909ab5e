//! What a served vNPU keeps in the board daemon's state directory so that
//! a restarted daemon resumes it (`docs/vfio-user.md`, "Daemon restarts"):
//! one directory per instance holding
//!
//! - `session`: the device core's saved state (`persist::DeviceState`: the
//!   session's id, the register file, the configuration, the ring position
//!   of the request in flight), a 4 KiB versioned record, mapped and
//!   written at the core's save points;
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

use crate::msi::lock;
use crate::persist::{DeviceState, StateError, RECORD_BYTES};

/// A vNPU instance's resumable state.
#[derive(Debug)]
pub struct SessionStore {
    dir: PathBuf,
    record: Mutex<memmap2::MmapMut>,
    /// Made impossible to resume ([`SessionStore::invalidate`]): nothing
    /// is saved into the record again until a new session begins.
    invalid: std::sync::atomic::AtomicBool,
}

fn file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)
}

impl SessionStore {
    /// The store in `dir` (an existing directory), its record mapped.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let f = file(&dir.join("session"))?;
        if f.metadata()?.len() != RECORD_BYTES as u64 {
            f.set_len(0)?;
            f.set_len(RECORD_BYTES as u64)?;
        }
        // SAFETY: the mapping covers the file's RECORD_BYTES bytes (sized
        // above); the file is the daemon's own and never shrunk while
        // mapped.
        let record = unsafe { memmap2::MmapOptions::new().len(RECORD_BYTES).map_mut(&f)? };
        Ok(Self {
            dir: dir.to_path_buf(),
            record: Mutex::new(record),
            invalid: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The state the record holds: `Ok(None)` when it holds none (a new
    /// file, or a session made impossible to resume), else the state or
    /// why it cannot be read.
    pub fn load(&self) -> Result<Option<DeviceState>, StateError> {
        DeviceState::decode(&lock(&self.record)[..])
    }

    /// Saves `state` into the record (in place: a mapped page survives a
    /// killed process).
    pub fn save(&self, state: &DeviceState) {
        if self.invalid.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let mut rec = [0u8; RECORD_BYTES];
        state.encode(&mut rec);
        lock(&self.record).copy_from_slice(&rec);
    }

    /// The id of the session the store holds, if it holds one that can be
    /// resumed.
    pub fn session(&self) -> Option<u64> {
        match self.load() {
            Ok(s) => s.map(|s| s.session),
            Err(e) => {
                log::warn!("{}: {e}; the session cannot be resumed", self.dir.display());
                None
            }
        }
    }

    /// Starts session `id` from nothing: a fresh state, programs and core
    /// memories dropped.
    pub fn begin(&self, id: u64) -> std::io::Result<()> {
        lock(&self.record).fill(0);
        self.invalid.store(false, std::sync::atomic::Ordering::Release);
        self.clear_programs()?;
        self.clear_cores()?;
        self.save(&DeviceState::new(id));
        Ok(())
    }

    /// Makes the session impossible to resume (something it needs could
    /// not be stored: resuming it could give wrong results).
    pub fn invalidate(&self, why: &str) {
        log::warn!("{}: the session cannot be resumed after a restart: {why}", self.dir.display());
        self.invalid.store(true, std::sync::atomic::Ordering::Release);
        lock(&self.record).fill(0);
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
    pub(crate) fn core(&self, core: usize, sram: u64, hbm: u64) -> std::io::Result<crate::device_core::Core> {
        let s = Sram::file_backed(sram, file(&self.dir.join(format!("core{core}.sram")))?)?;
        let h = LazyHbm::file_backed(hbm, file(&self.dir.join(format!("core{core}.hbm")))?)?;
        Ok(crate::device_core::Core { sram: s, hbm: h })
    }
}
