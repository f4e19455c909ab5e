//! The guest pages a vNPU writes while logging is on: what a live
//! migration re-sends after KVM's dirty log, which sees the vCPU's writes
//! only (`docs/migration.md`, "Live migration"). The device notes every
//! write it makes to guest RAM (DMA results, status blocks, messages,
//! counters, the used ring) after the write succeeded, so a noted page is
//! always inside guest RAM.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// The page size of the log (the guest's and KVM's dirty log's).
pub const LOG_PAGE: u64 = 4096;

/// Most pages the log holds: 256 GiB of guest RAM, above any guest this
/// VMM builds, so a noted page past it (impossible for a write that
/// succeeded) is dropped instead of growing the bitmap.
const MAX_PAGES: u64 = 1 << 26;

/// A bitmap of guest pages written while logging is on.
#[derive(Debug, Default)]
pub struct WriteLog {
    on: AtomicBool,
    /// Bit `p % 64` of word `p / 64` is page `p`.
    bits: Mutex<Vec<u64>>,
}

impl WriteLog {
    fn bits(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.bits.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Logs from now on, from an empty log.
    pub fn start(&self) {
        let mut b = self.bits();
        b.clear();
        self.on.store(true, Ordering::Release);
    }

    /// Stops logging and forgets what was logged.
    pub fn stop(&self) {
        let mut b = self.bits();
        self.on.store(false, Ordering::Release);
        *b = Vec::new();
    }

    /// Whether the log is on.
    pub fn logging(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    /// Notes that `len` bytes at guest address `addr` were written.
    pub fn note(&self, addr: u64, len: u64) {
        if len == 0 || !self.logging() {
            return;
        }
        let first = addr / LOG_PAGE;
        let last = (addr.saturating_add(len - 1) / LOG_PAGE).min(MAX_PAGES - 1);
        let mut b = self.bits();
        // Checked again under the lock: `stop` may have run meanwhile.
        if !self.logging() {
            return;
        }
        for p in first..=last {
            // `p` < MAX_PAGES, so the word index fits any usize here.
            let w = usize::try_from(p / 64).unwrap_or(usize::MAX);
            if w >= b.len() {
                b.resize(w + 1, 0);
            }
            b[w] |= 1 << (p % 64);
        }
    }

    /// The pages logged since the last take (as bitmap words: bit `p % 64`
    /// of word `p / 64` is page `p`), cleared; logging goes on.
    pub fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.bits())
    }

    /// The pages logged in `[first, first + pages)`, as a bitmap of bytes
    /// (bit `i % 8` of byte `i / 8` is page `first + i`, as a VFIO dirty
    /// bitmap), cleared there; the rest of the log stays.
    pub fn take_range(&self, first: u64, pages: u64) -> Vec<u8> {
        let n = usize::try_from(pages.div_ceil(8)).unwrap_or(0);
        let mut out = vec![0u8; n];
        let mut b = self.bits();
        for i in 0..pages {
            let Some(p) = first.checked_add(i) else { break };
            let Ok(w) = usize::try_from(p / 64) else { break };
            let Some(word) = b.get_mut(w) else { break };
            let bit = 1u64 << (p % 64);
            if *word & bit != 0 {
                *word &= !bit;
                if let Ok(j) = usize::try_from(i / 8) {
                    out[j] |= 1 << (i % 8);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_written_while_on_are_logged_once_taken() {
        let l = WriteLog::default();
        l.note(0, 4096);
        assert!(l.take().is_empty(), "nothing logged while off");
        l.start();
        // 8 bytes straddling pages 1 and 2, one byte in page 70.
        l.note(2 * 4096 - 4, 8);
        l.note(70 * 4096 + 5, 1);
        l.note(5 * 4096, 0);
        let w = l.take();
        assert_eq!(w, vec![0b110, 1 << 6]);
        assert!(l.take().is_empty(), "a take clears the log");
        l.note(3 * 4096, 1);
        l.stop();
        l.note(4 * 4096, 1);
        assert!(l.take().is_empty(), "stop forgets and stops");
    }

    #[test]
    fn a_range_is_reported_as_a_vfio_bitmap_and_cleared_there_only() {
        let l = WriteLog::default();
        l.start();
        for p in [3u64, 9, 64, 100] {
            l.note(p * 4096, 1);
        }
        // Pages 8..72: 9 is bit 1, 64 is bit 56.
        let b = l.take_range(8, 64);
        assert_eq!(b.len(), 8);
        assert_eq!(b[0], 0b10);
        assert_eq!(b[7], 1);
        assert_eq!(b.iter().map(|x| x.count_ones()).sum::<u32>(), 2);
        let rest = l.take();
        assert_eq!(rest[0], 1 << 3);
        assert_eq!(rest[1], 1 << (100 - 64));
        // A write at the top of the address space does not wrap or grow
        // the log without bound.
        l.note(u64::MAX - 1, 16);
        assert!(l.take().len() <= (MAX_PAGES / 64) as usize);
    }
}
