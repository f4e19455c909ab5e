//! Per-thread scratch buffers kept from one instruction or simulator step
//! to the next, so hot paths neither allocate nor zero fresh pages each
//! time (the im2col buffer of convolutions, the rows of DMA copies, the
//! vectors of the rate assignment).

use std::cell::RefCell;
use std::thread::LocalKey;

/// Runs `f` on this thread's value of `key`, borrowed in place (never
/// moved: a scratch value is a few hundred bytes of vector headers, and
/// moving it out and back on every simulator step was measurable). A
/// nested use of the same key (a rayon worker waiting in a GEMM may pick
/// up another convolution) gets a fresh default value instead of
/// panicking, as does a use while the thread's locals are being
/// destroyed. Afterwards the value is reset to its default unless `keep`
/// says so (a caller bounds what a thread holds on to).
pub(crate) fn with_scratch<T: Default, R>(
    key: &'static LocalKey<RefCell<T>>,
    keep: impl FnOnce(&T) -> bool,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut f = Some(f);
    let mut keep = Some(keep);
    let borrowed = key.try_with(|cell| {
        let mut value = cell.try_borrow_mut().ok()?;
        let r = f.take().map(|f| f(&mut value))?;
        if !keep.take().is_some_and(|keep| keep(&value)) {
            *value = T::default();
        }
        Some(r)
    });
    match (borrowed, f) {
        (Ok(Some(r)), _) => r,
        // Re-entered or being destroyed: a value of its own, dropped after.
        (_, Some(f)) => f(&mut T::default()),
        // `f` ran inside but gave nothing back: impossible, `map` on
        // `Some(f)` always yields `Some`.
        (_, None) => unreachable!("with_scratch: f ran without a result"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static KEY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }

    #[test]
    fn kept_values_persist_and_nested_uses_get_their_own() {
        with_scratch(&KEY, |_| true, |v| v.extend_from_slice(b"abc"));
        let inner = with_scratch(
            &KEY,
            |_| true,
            |outer| {
                assert_eq!(outer, b"abc");
                // Nested: a fresh default, not the outer value.
                with_scratch(&KEY, |_| true, |v: &mut Vec<u8>| std::mem::take(v))
            },
        );
        assert!(inner.is_empty());
        // Not kept: reset to the default.
        with_scratch(&KEY, |_| false, |v| v.push(1));
        assert!(with_scratch(&KEY, |_| true, |v| v.is_empty()));
    }
}
