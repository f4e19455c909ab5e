//! Surviving a SIGBUS in a client's guest memory.
//!
//! The daemon maps each file a client hands over with `DMA_MAP` (its guest
//! RAM) and the vNPU reads and writes it. A client can make such an access
//! fault after the map: a hugetlbfs file whose pages it punches out
//! (`fallocate(PUNCH_HOLE)`, which `F_SEAL_SHRINK` allows) refaults from
//! the host's huge page pool, and a pool that is empty by then raises
//! SIGBUS in the daemon, which would kill every tenant.
//!
//! Every file mapping is registered here ([`register`]); a SIGBUS handler
//! ([`install`]) that finds the faulting address inside one replaces that
//! whole mapping with private anonymous memory (one `mmap(MAP_FIXED)`, so
//! a client punching many holes costs one mapping, not one per hole) and
//! marks it lost. The access then completes on that memory; the request
//! fails (`MemoryWatch`, `ST_EXEC_FAULT`), and so does every later one of
//! that client, whose memory the daemon no longer sees. A SIGBUS anywhere
//! else goes to the handler that was there before (Rust's, for stack
//! overflows) or kills the process as before.
//!
//! The handler only loads and stores atomics of a static table and makes
//! two system calls (`mmap`, and `rt_sigaction` when it passes a fault
//! on), all async-signal-safe.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Most file mappings registered at once (64 files for each of 64 clients).
pub const SLOTS: usize = 4096;

const FREE: u8 = 0;
const BUSY: u8 = 1;
const ACTIVE: u8 = 2;

struct Slot {
    state: AtomicU8,
    start: AtomicUsize,
    len: AtomicUsize,
    /// Bumped at each registration, so a watch of an earlier one reads
    /// nothing of a later one.
    generation: AtomicU64,
    /// The generation whose mapping was lost (0: none).
    lost: AtomicU64,
}

impl Slot {
    const fn new() -> Self {
        Self {
            state: AtomicU8::new(FREE),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            lost: AtomicU64::new(0),
        }
    }
}

static TABLE: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
/// Mappings lost since the daemon started.
static LOST: AtomicU64 = AtomicU64::new(0);
/// The SIGBUS action before ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A registered mapping; unregistered when dropped (before it is unmapped).
#[derive(Debug)]
pub struct Guard {
    index: usize,
    generation: u64,
}

/// What says whether a registered mapping was lost, after its [`Guard`]
/// is gone too (then: never).
#[derive(Debug, Clone, Copy)]
pub struct Watch {
    index: usize,
    generation: u64,
}

impl Watch {
    /// Whether the mapping was lost.
    pub fn lost(&self) -> bool {
        TABLE.get(self.index).is_some_and(|s| s.lost.load(Ordering::Acquire) == self.generation)
    }
}

impl Guard {
    pub fn watch(&self) -> Watch {
        Watch { index: self.index, generation: self.generation }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(s) = TABLE.get(self.index) {
            // Out of the handler's sight first, then free.
            s.state.store(BUSY, Ordering::Release);
            s.len.store(0, Ordering::Release);
            s.state.store(FREE, Ordering::Release);
        }
    }
}

/// Registers the mapping of `len` bytes at `start` (a whole file
/// mapping, as `mmap` returned it); `None` when [`SLOTS`] are in use.
pub fn register(start: usize, len: usize) -> Option<Guard> {
    for (index, s) in TABLE.iter().enumerate() {
        if s.state.compare_exchange(FREE, BUSY, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            let generation = s.generation.fetch_add(1, Ordering::AcqRel).wrapping_add(1).max(1);
            s.start.store(start, Ordering::Release);
            s.len.store(len, Ordering::Release);
            s.state.store(ACTIVE, Ordering::Release);
            return Some(Guard { index, generation });
        }
    }
    None
}

/// How many mappings were lost (replaced after a SIGBUS) since the start.
pub fn lost_mappings() -> u64 {
    LOST.load(Ordering::Relaxed)
}

/// Installs the SIGBUS handler (once; later calls do nothing).
pub fn install() -> std::io::Result<()> {
    static DONE: OnceLock<Result<(), i32>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        // SAFETY: a zeroed sigaction is a valid "no action" value that
        // sigaction(2) fills in; the new one points at `on_sigbus`, an
        // `extern "C"` function of the signature SA_SIGINFO expects.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigbus as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut new.sa_mask);
            if libc::sigaction(libc::SIGBUS, &new, &mut old) != 0 {
                return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL));
            }
            let _ = PREVIOUS.set(old);
        }
        Ok(())
    });
    r.map_err(std::io::Error::from_raw_os_error)
}

/// The slot whose active mapping holds `addr`, and its generation.
fn owner(addr: usize) -> Option<(&'static Slot, u64)> {
    TABLE.iter().find_map(|s| {
        if s.state.load(Ordering::Acquire) != ACTIVE {
            return None;
        }
        let (start, len) = (s.start.load(Ordering::Acquire), s.len.load(Ordering::Acquire));
        (addr >= start && addr - start < len).then(|| (s, s.generation.load(Ordering::Acquire)))
    })
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    if let Some((slot, generation)) = owner(addr) {
        let (start, len) = (slot.start.load(Ordering::Acquire), slot.len.load(Ordering::Acquire));
        // SAFETY: replaces exactly the registered mapping (its start and
        // length as mmap returned them, so huge-page aligned for hugetlbfs)
        // with fresh private memory; the daemon reaches it only through
        // vm-memory's volatile accessors, which now see zeros.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            slot.lost.store(generation, Ordering::Release);
            LOST.fetch_add(1, Ordering::Relaxed);
            // Returning retries the access, now on the new memory.
            return;
        }
    }
    pass_on(sig, info, ctx);
}

/// A SIGBUS that is not ours: to the handler before ours, or (none) the
/// default action, which the retried access then takes.
fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let prev = PREVIOUS.get();
    let handler = prev.map_or(libc::SIG_DFL, |p| p.sa_sigaction);
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: restores the default action, with a zeroed (empty) mask.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
        }
        return;
    }
    let siginfo = prev.is_some_and(|p| p.sa_flags & libc::SA_SIGINFO != 0);
    // SAFETY: the previous action's handler, called as it was installed
    // (with SA_SIGINFO, the three-argument form).
    unsafe {
        if siginfo {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(handler);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
            f(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registered slot is found by the addresses inside it only, and is
    /// no one's once its guard is gone; a watch of an old registration
    /// reads nothing of a new one in the same slot.
    #[test]
    fn slots_own_their_ranges_and_generations() {
        let g = register(0x7000_0000_0000, 0x20_0000).expect("a slot");
        assert!(owner(0x7000_0000_0000).is_some());
        assert!(owner(0x7000_001f_ffff).is_some());
        assert!(owner(0x7000_0020_0000).is_none());
        assert!(owner(0x6fff_ffff_ffff).is_none());
        let w = g.watch();
        let (slot, generation) = owner(0x7000_0000_0000).unwrap();
        slot.lost.store(generation, Ordering::Release);
        assert!(w.lost());
        drop(g);
        assert!(owner(0x7000_0000_0000).is_none());
        let again: Vec<_> = (0..4).filter_map(|_| register(0x7100_0000_0000, 4096)).collect();
        assert!(again.iter().all(|n| !n.watch().lost()));
        assert!(again.iter().all(|n| n.index != w.index || n.generation != w.generation));
    }

    /// A registered mapping whose file is cut under it (the SIGBUS a
    /// hugetlbfs hole makes when the pool is empty, made here with an
    /// unsealed memfd): the access that faults completes on zeros, the
    /// mapping is marked lost, and the process lives. Unregistered, the
    /// same fault would kill it.
    #[test]
    fn a_fault_in_a_registered_mapping_is_survived_and_marked_lost() {
        install().expect("handler");
        // SAFETY: memfd_create(2) returns a fresh descriptor we own.
        let fd = unsafe { libc::memfd_create(c"vnpu-fault-test".as_ptr(), 0) };
        assert!(fd >= 0);
        let len = 2 * 4096;
        // SAFETY: sizing, mapping and cutting a file we alone hold; the
        // mapping is read only through volatile reads below, and is
        // unmapped at the end.
        unsafe {
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let p = p.cast::<u8>();
            p.write_volatile(7);
            p.add(4096).write_volatile(9);
            let guard = register(p as usize, len).expect("a slot");
            let watch = guard.watch();
            assert!(!watch.lost());
            // The file no longer has the mapped pages: touching them is a
            // SIGBUS.
            assert_eq!(libc::ftruncate(fd, 0), 0);
            let read = p.add(4096).read_volatile();
            assert_eq!(read, 0, "the faulting read completes on fresh memory");
            assert!(watch.lost(), "the mapping is marked lost");
            assert!(lost_mappings() >= 1);
            // Still usable memory (private now), whole.
            p.write_volatile(1);
            assert_eq!(p.read_volatile(), 1);
            drop(guard);
            libc::munmap(p.cast(), len);
            libc::close(fd);
        }
    }
}
