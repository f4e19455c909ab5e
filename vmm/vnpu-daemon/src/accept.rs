//! Accept loops that outlive resource exhaustion: a failed `accept(2)`
//! (no descriptors left, `EMFILE`/`ENFILE`, no memory, a connection
//! aborted before it was taken) is waited out and retried, and only a
//! stop ends the loop. A loop that ended on its first error would leave
//! the daemon unmanageable, or an instance unattachable, for good, even
//! after whoever exhausted the descriptors has gone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How long a loop waits after a failed accept before it tries again.
pub const RETRY: Duration = Duration::from_millis(50);

/// Calls `accept` until it gives a connection (`Some`) or `stop` is set
/// (`None`, checked after every failure: a stop makes the blocked accept
/// fail). Each run of failures is logged once, as `what`.
pub fn accept_retrying<T>(
    what: &str,
    stop: &AtomicBool,
    mut accept: impl FnMut() -> std::io::Result<T>,
) -> Option<T> {
    let mut logged = false;
    loop {
        match accept() {
            Ok(c) => return Some(c),
            Err(_) if stop.load(Ordering::SeqCst) => return None,
            Err(e) => {
                if !logged {
                    log::warn!("{what}: accept failed ({e}); retrying every {} ms", RETRY.as_millis());
                    logged = true;
                }
                std::thread::sleep(RETRY);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Descriptors exhausted for a while: the loop waits and then takes
    /// the connection; a stop ends it.
    #[test]
    fn emfile_is_waited_out_and_a_stop_ends_the_loop() {
        let stop = AtomicBool::new(false);
        let mut failures = 3;
        let got = accept_retrying("test", &stop, || {
            if failures > 0 {
                failures -= 1;
                Err(std::io::Error::from_raw_os_error(libc::EMFILE))
            } else {
                Ok(7)
            }
        });
        assert_eq!(got, Some(7));
        stop.store(true, Ordering::SeqCst);
        let got: Option<u8> =
            accept_retrying("test", &stop, || Err(std::io::Error::from_raw_os_error(libc::EINVAL)));
        assert_eq!(got, None);
    }
}
