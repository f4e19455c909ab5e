//! Per-thread scratch buffers kept from one instruction or simulator step
//! to the next, so hot paths neither allocate nor zero fresh pages each
//! time (the im2col buffer of convolutions, the rows of DMA copies, the
//! vectors of the rate assignment).

use std::cell::Cell;
use std::thread::LocalKey;

/// Runs `f` on this thread's value of `key`, taken out of its cell while
/// `f` runs: a nested use of the same key (a rayon worker waiting in a
/// GEMM may pick up another convolution) gets a fresh default value
/// instead of panicking. The value goes back afterwards when `keep` says
/// so (a caller bounds what a thread holds on to).
pub(crate) fn with_scratch<T: Default, R>(
    key: &'static LocalKey<Cell<T>>,
    keep: impl FnOnce(&T) -> bool,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut value = key.try_with(Cell::take).unwrap_or_default();
    let r = f(&mut value);
    if keep(&value) {
        // Fails only while the thread's locals are being destroyed: the
        // value is then dropped.
        let _ = key.try_with(|c| c.set(value));
    }
    r
}
