//! The inference programs the guests run, written once over the driver
//! crate and a small [`Platform`]: the bare-metal runtime (`guest-rt`)
//! and Linux user space (`linux-guest`) each provide one.
#![no_std]

extern crate alloc;

pub mod digits;
pub mod infer;

use vnpu_driver::{DmaBuf, Wait};

/// What an inference program needs from the environment it runs in.
pub trait Platform {
    /// Prints to the console.
    fn print(&self, args: core::fmt::Arguments);
    /// A monotonic clock in nanoseconds (0 if there is none).
    fn now_ns(&self) -> u64;
    /// A DMA buffer of at least `len` bytes the program may lay its tensors
    /// out in (device-visible, physically contiguous).
    fn data(&self, len: usize) -> Option<DmaBuf>;
    /// How to wait for completions.
    fn wait(&self) -> Wait;
    /// Raw ticks of the clock the host's benchmark side also reads (the
    /// TSC on the bare-metal platform); `now_ns` where there is none.
    fn ticks(&self) -> u64 {
        self.now_ns()
    }
    /// After a timed round of benchmark `id` that took `ticks`: lets the
    /// host run its side of the round before the next (bare metal: the
    /// VMM's benchmark hook). Does nothing where there is no host side.
    fn host_round(&self, id: u32, ticks: u64) {
        let _ = (id, ticks);
    }
}

/// `println!` to a [`Platform`].
#[macro_export]
macro_rules! out {
    ($p:expr, $($arg:tt)*) => {
        $p.print(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `len` bytes at `offset` into `buf`, or `None` if they do not fit.
pub fn sub(buf: &DmaBuf, offset: u64, len: usize) -> Option<DmaBuf> {
    let end = offset.checked_add(len as u64)?;
    (end <= buf.len as u64).then(|| DmaBuf {
        // SAFETY: `offset + len <= buf.len`: inside the buffer.
        virt: unsafe { buf.virt.add(offset as usize) },
        phys: buf.phys + offset,
        len,
    })
}
