//! What a served vNPU keeps in the board daemon's state directory so that
//! a restarted daemon resumes it (`docs/vfio-user.md`, "Daemon restarts"):
//! one directory per instance holding
//!
//! - `client`: the process and user the session belongs to
//!   ([`Client`]): a resume from any other is refused;
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
//! unlink), which an instance thread's system-call filter allows; the
//! daemon creates them beforehand ([`prepare_files`]), so those threads
//! create no file at all.
//!
//! Tenant state is private and contained: the directory is made 0700 and
//! every file 0600 whatever the umask; no open follows a symlink
//! (`O_NOFOLLOW`) and anything that is not a regular file is refused, so
//! a link planted in the folder can neither redirect a write outside it
//! nor alias another tenant's memory. The record's blocks are allocated
//! before it is mapped, so a full disk fails the open instead of faulting
//! the daemon at the first save.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use npu_model::{LazyHbm, Sram};

use crate::msi::lock;
use crate::persist::{DeviceState, StateError, RECORD_BYTES};

/// The client a session belongs to: the process (and its user) that
/// started it, as the kernel names a socket's peer (`SO_PEERCRED`). A VMM
/// that outlives a daemon restart reconnects from the same process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Client {
    pub pid: i32,
    pub uid: u32,
}

/// `client` file contents: magic, pid, uid.
const CLIENT_MAGIC: u32 = 0x764e_5043;

impl Client {
    fn encode(self) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[..4].copy_from_slice(&CLIENT_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.pid.to_le_bytes());
        b[8..].copy_from_slice(&self.uid.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let b: &[u8; 12] = b.try_into().ok()?;
        let word = |i: usize| [b[i], b[i + 1], b[i + 2], b[i + 3]];
        (u32::from_le_bytes(word(0)) == CLIENT_MAGIC)
            .then(|| Client { pid: i32::from_le_bytes(word(4)), uid: u32::from_le_bytes(word(8)) })
    }
}

/// A vNPU instance's resumable state.
#[derive(Debug)]
pub struct SessionStore {
    /// The folder's path, for messages and listing names.
    dir: PathBuf,
    /// The folder, opened once: every file is opened through it.
    fd: File,
    record: Mutex<memmap2::MmapMut>,
    /// Made impossible to resume ([`SessionStore::invalidate`]): nothing
    /// is saved into the record again until a new session begins.
    invalid: std::sync::atomic::AtomicBool,
}

/// Mode of every file of a session (owner read and write only).
const FILE_MODE: u32 = 0o600;
/// Mode of a session's directory.
const DIR_MODE: u32 = 0o700;

/// Checks that `f` (just opened without following links) is a regular
/// file and leaves it private (0600 whatever mode it had).
fn regular(f: File, path: &Path) -> std::io::Result<File> {
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{}: not a regular file; refused", path.display()),
        ));
    }
    // A file this store creates is 0600 under any umask; one left readable
    // by others (an older daemon's) is made private, or refused where the
    // calling thread may not change modes (an instance thread: the daemon
    // fixes its sessions' modes before it serves them, `private_files`).
    if meta.permissions().mode() & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    }
    Ok(f)
}

/// The session directory `dir`, opened as a descriptor every file of it
/// is opened through: not through a symlink (`O_NOFOLLOW`), a directory
/// only (`O_DIRECTORY`). A folder renamed or replaced by a link after it
/// was opened changes nothing: the store keeps using the one it opened.
fn open_dir(dir: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("{}: not a directory of its own ({e}); refused", dir.display()),
            )
        })
}

/// `name` opened below the directory `dir` with `flags` (and `mode` when
/// it is created): by `openat(2)` on the directory's descriptor, never
/// through a symlink. `name` is one component (the store's own names).
fn at(dir: &File, name: &str, flags: libc::c_int, mode: libc::mode_t) -> std::io::Result<File> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("`{name}`: not a file name"),
        ));
    }
    let c =
        std::ffi::CString::new(name).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: openat(2) with a descriptor we hold open, a NUL-terminated
    // name that lives for the call, and plain flags; the descriptor it
    // returns is checked and then owned by the `File`.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor openat just returned, owned by no one else.
    Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Opens (creating if need be) the session file `name` of `dir` for
/// reading and writing: never through a symlink, a regular file only,
/// mode 0600.
fn file(dir: &File, name: &str) -> std::io::Result<File> {
    let f = at(dir, name, libc::O_RDWR | libc::O_CREAT, FILE_MODE)?;
    regular(f, Path::new(name))
}

/// Opens the existing session file `name` of `dir` (for writing if
/// `write`), with the same checks as [`file`].
fn existing(dir: &File, name: &str, write: bool) -> std::io::Result<File> {
    let f = at(dir, name, if write { libc::O_WRONLY } else { libc::O_RDONLY }, 0)?;
    regular(f, Path::new(name))
}

/// Allocates the first `len` bytes of `f` on disk (so that a write to a
/// mapping of them cannot fault for want of space).
fn allocate(f: &File, len: usize) -> std::io::Result<()> {
    let len =
        libc::off_t::try_from(len).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: posix_fallocate on a descriptor `f` owns; it touches no memory.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len) };
    match r {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// Makes every regular file of `dir` private (0600) where it is readable
/// or writable by others; links and folders are left alone (the store
/// never opens them).
pub fn private_files(dir: &Path) -> std::io::Result<()> {
    let d = open_dir(dir)?;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if !e.file_type()?.is_file() {
            continue;
        }
        let Some(name) = e.file_name().to_str().map(str::to_string) else { continue };
        // Through the folder's descriptor, without following a link (one
        // swapped in since the listing fails to open): `regular` makes
        // the file private.
        match at(&d, &name, libc::O_RDONLY, 0).and_then(|f| regular(f, Path::new(&name))) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) || e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Makes `dir` a private directory of the daemon's (0700), refusing a
/// symlink or anything else that is not a directory.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    private_dir_fd(dir).map(drop)
}

/// [`private_dir`], returning the folder's descriptor.
fn private_dir_fd(dir: &Path) -> std::io::Result<File> {
    let d = open_dir(dir)?;
    if d.metadata()?.permissions().mode() & 0o7777 != DIR_MODE {
        d.set_permissions(std::fs::Permissions::from_mode(DIR_MODE))?;
    }
    Ok(d)
}

/// Creates, where missing, every file a store in `dir` keeps for a vNPU
/// of `cores` cores (the record, a file per program handle, each core's
/// memories), empty and private: the instance threads that use the
/// store may then write, size and truncate them, but create none
/// (`vnpu-daemon`'s Landlock domain for them allows no file creation).
pub fn prepare_files(dir: &Path, cores: u32) -> std::io::Result<()> {
    let d = private_dir_fd(dir)?;
    let mut names = vec!["session".to_string(), "client".to_string()];
    names.extend((0..vnpu_abi::device::MAX_REGISTERED).map(|h| format!("program.{h}")));
    for c in 0..cores {
        names.push(format!("core{c}.sram"));
        names.push(format!("core{c}.hbm"));
    }
    for n in names {
        file(&d, &n)?;
    }
    Ok(())
}

impl SessionStore {
    /// The store in `dir` (an existing directory), its record mapped.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let fd = private_dir_fd(dir)?;
        let f = file(&fd, "session")?;
        if f.metadata()?.len() != RECORD_BYTES as u64 {
            f.set_len(0)?;
            f.set_len(RECORD_BYTES as u64)?;
        }
        allocate(&f, RECORD_BYTES)?;
        // SAFETY: the mapping covers the file's RECORD_BYTES bytes (sized
        // above); the file is the daemon's own and never shrunk while
        // mapped.
        let record = unsafe { memmap2::MmapOptions::new().len(RECORD_BYTES).map_mut(&f)? };
        Ok(Self {
            dir: dir.to_path_buf(),
            fd,
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

    /// Starts session `id` as [`Self::begin`] does, for `client`: only
    /// that client may resume it ([`Self::client`]). The client is written
    /// first, so a session never names someone else's client.
    pub fn begin_for(&self, id: u64, client: Client) -> std::io::Result<()> {
        lock(&self.record).fill(0);
        let mut f = file(&self.fd, "client")?;
        f.set_len(0)?;
        f.write_all(&client.encode())?;
        self.begin(id)
    }

    /// The client the session was started for, if it names one.
    pub fn client(&self) -> Option<Client> {
        let mut b = Vec::new();
        existing(&self.fd, "client", false).ok()?.take(64).read_to_end(&mut b).ok()?;
        Client::decode(&b)
    }

    /// Forgets the session for good (its VM left): the record, every
    /// program and every core memory zeroed (the files stay, empty, for
    /// the next session). Call it only once nothing maps the memories
    /// (the device's worker has stopped).
    pub fn forget(&self) -> std::io::Result<()> {
        self.invalid.store(true, std::sync::atomic::Ordering::Release);
        lock(&self.record).fill(0);
        if let Ok(f) = existing(&self.fd, "client", true) {
            f.set_len(0)?;
        }
        self.clear_programs()?;
        self.clear_cores()
    }

    /// Makes the session impossible to resume (something it needs could
    /// not be stored: resuming it could give wrong results).
    pub fn invalidate(&self, why: &str) {
        log::warn!("{}: the session cannot be resumed after a restart: {why}", self.dir.display());
        self.invalid.store(true, std::sync::atomic::Ordering::Release);
        lock(&self.record).fill(0);
    }

    fn program_name(handle: usize) -> String {
        format!("program.{handle}")
    }

    pub(crate) fn save_program(&self, handle: usize, bytes: &[u8]) -> std::io::Result<()> {
        let mut f = file(&self.fd, &Self::program_name(handle))?;
        f.set_len(0)?;
        f.write_all(bytes)
    }

    pub(crate) fn forget_program(&self, handle: usize) -> std::io::Result<()> {
        match existing(&self.fd, &Self::program_name(handle), true) {
            Ok(f) => f.set_len(0),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The stored programs (handle, encoded bytes); empty files are free
    /// handles.
    pub(crate) fn programs(&self) -> std::io::Result<Vec<(usize, Vec<u8>)>> {
        let mut out = Vec::new();
        for (handle, name) in self.numbered("program.")? {
            let mut bytes = Vec::new();
            let f = existing(&self.fd, &name, false)?;
            // No more than a program may hold.
            f.take(u64::from(vnpu_abi::device::MAX_PROGRAM_BYTES)).read_to_end(&mut bytes)?;
            if !bytes.is_empty() {
                out.push((handle, bytes));
            }
        }
        Ok(out)
    }

    /// Files of the directory named `<prefix><number>[.<anything>]`.
    fn numbered(&self, prefix: &str) -> std::io::Result<Vec<(usize, String)>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            // Only regular files are the store's (a link or a folder
            // someone put here is not).
            if !e.file_type()?.is_file() {
                continue;
            }
            let Some(name) = e.file_name().to_str().map(str::to_string) else { continue };
            let Some(rest) = name.strip_prefix(prefix) else { continue };
            let digits = rest.split('.').next().unwrap_or("");
            if let Ok(n) = digits.parse::<usize>() {
                out.push((n, name));
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
        for (_, name) in self.numbered("core")? {
            existing(&self.fd, &name, true)?.set_len(0)?;
        }
        Ok(())
    }

    /// Core `core`'s memories, held in its files (what they hold when
    /// they have these sizes; zeros otherwise).
    pub(crate) fn core(&self, core: usize, sram: u64, hbm: u64) -> std::io::Result<crate::device_core::Core> {
        let s = Sram::file_backed(sram, file(&self.fd, &format!("core{core}.sram"))?)?;
        let h = LazyHbm::file_backed(hbm, file(&self.fd, &format!("core{core}.hbm"))?)?;
        Ok(crate::device_core::Core { sram: s, hbm: h })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vnpu-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        // As a default umask leaves a new folder: readable by everyone.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        d
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// The folder is 0700 and every file 0600, whatever the umask left
    /// (a file that existed with 0644 is made private too); the record's
    /// blocks are on disk before it is mapped.
    #[test]
    fn session_files_are_private_and_the_record_is_allocated() {
        let d = scratch("private");
        // A record left readable by an older daemon.
        std::fs::write(d.join("session"), [0u8; 16]).unwrap();
        std::fs::set_permissions(d.join("session"), std::fs::Permissions::from_mode(0o644)).unwrap();
        let st = SessionStore::open(&d).unwrap();
        st.begin(7).unwrap();
        st.save_program(0, b"program").unwrap();
        let _core = st.core(0, 1 << 16, 1 << 20).unwrap();
        assert_eq!(mode(&d), 0o700);
        for f in ["session", "program.0", "core0.sram", "core0.hbm"] {
            assert_eq!(mode(&d.join(f)), 0o600, "{f}");
        }
        let rec = std::fs::metadata(d.join("session")).unwrap();
        assert!(rec.blocks() * 512 >= RECORD_BYTES as u64, "the record is sparse: {} blocks", rec.blocks());
        assert_eq!(st.session(), Some(7));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Every file is opened through the folder's descriptor: a folder
    /// swapped for a link to another after the store opened it redirects
    /// nothing (programs, the client, the core memories all land in the
    /// folder the store opened), and a store never opens a folder that is
    /// a link.
    #[test]
    fn a_folder_swapped_after_open_redirects_nothing() {
        let d = scratch("swap");
        let elsewhere = scratch("swap-elsewhere");
        let moved = d.with_extension("moved");
        let _ = std::fs::remove_dir_all(&moved);
        let st = SessionStore::open(&d).unwrap();
        std::fs::rename(&d, &moved).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &d).unwrap();
        st.save_program(2, b"mine").unwrap();
        st.begin_for(9, Client { pid: 1, uid: 2 }).unwrap();
        let _core = st.core(0, 1 << 16, 1 << 20).unwrap();
        assert_eq!(std::fs::read(moved.join("program.2")).unwrap(), b"mine");
        assert!(moved.join("client").is_file() && moved.join("core0.sram").is_file());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "a file was written through the link");
        assert!(SessionStore::open(&d).is_err(), "a store opened a folder that is a link");
        assert!(prepare_files(&d, 1).is_err());
        let _ = std::fs::remove_file(&d);
        let _ = std::fs::remove_dir_all(&moved);
        let _ = std::fs::remove_dir_all(&elsewhere);
    }

    /// A symlink planted in the folder redirects nothing: saving a program
    /// through it, opening a core's memory through it and opening the
    /// record through it all fail, and the files they point at are left
    /// as they were.
    #[test]
    fn symlinks_in_a_session_folder_are_refused() {
        let d = scratch("links");
        let outside = scratch("links-outside");
        let victim = outside.join("victim");
        std::fs::write(&victim, b"someone else's bytes").unwrap();
        let st = SessionStore::open(&d).unwrap();
        std::os::unix::fs::symlink(&victim, d.join("program.3")).unwrap();
        std::os::unix::fs::symlink(&victim, d.join("core1.sram")).unwrap();
        assert!(st.save_program(3, b"x").is_err());
        assert!(st.forget_program(3).is_err());
        assert!(st.core(1, 1 << 16, 1 << 20).is_err());
        // Listing skips the links (they are not the store's files).
        assert!(st.programs().unwrap().is_empty());
        st.clear_cores().unwrap();
        st.clear_programs().unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"someone else's bytes");
        // The record itself, and the folder.
        drop(st);
        std::fs::remove_file(d.join("session")).unwrap();
        std::os::unix::fs::symlink(&victim, d.join("session")).unwrap();
        assert!(SessionStore::open(&d).is_err());
        let linked = outside.join("linked-folder");
        std::os::unix::fs::symlink(&d, &linked).unwrap();
        assert!(SessionStore::open(&linked).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"someone else's bytes");
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&outside);
    }
}
