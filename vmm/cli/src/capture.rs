//! A guest console the CLI keeps a copy of (to parse or to print later),
//! optionally echoing it to stdout as it comes. The copy is bounded
//! ([`MAX_CAPTURE`]): a guest that prints without end cannot make the host
//! allocate without end; what comes after the bound is counted, not kept.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// Most bytes of a guest's console kept for later (16 MiB).
pub const MAX_CAPTURE: usize = 16 << 20;

/// A clonable console writer; every clone appends to the same buffer.
#[derive(Clone, Default)]
pub struct Capture {
    buf: Arc<Mutex<Kept>>,
    echo: bool,
}

#[derive(Default)]
struct Kept {
    bytes: Vec<u8>,
    dropped: u64,
}

impl Capture {
    /// A capture that also writes everything to stdout.
    pub fn echoing() -> Self {
        Self { echo: true, ..Self::default() }
    }

    /// What was written so far, as text (with a last line saying how
    /// much was not kept past [`MAX_CAPTURE`]).
    pub fn text(&self) -> String {
        let k = self.buf.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut t = String::from_utf8_lossy(&k.bytes).to_string();
        if k.dropped > 0 {
            t.push_str(&format!("\n[console: {} more bytes not kept (limit {MAX_CAPTURE})]\n", k.dropped));
        }
        t
    }
}

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        {
            let mut k = self.buf.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let room = MAX_CAPTURE.saturating_sub(k.bytes.len()).min(b.len());
            k.bytes.extend_from_slice(&b[..room]);
            k.dropped = k.dropped.saturating_add((b.len() - room) as u64);
        }
        if self.echo {
            std::io::stdout().write_all(b)?;
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if self.echo {
            std::io::stdout().flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A console driven past the bound keeps exactly `MAX_CAPTURE` bytes
    /// and says how many more it was given.
    #[test]
    fn capture_is_bounded() {
        let mut c = Capture::default();
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..(MAX_CAPTURE >> 20) + 3 {
            c.write_all(&chunk).unwrap();
        }
        let t = c.text();
        assert_eq!(t.bytes().filter(|&b| b == b'x').count(), MAX_CAPTURE);
        assert!(
            t.ends_with(&format!("[console: {} more bytes not kept (limit {MAX_CAPTURE})]\n", 3 << 20)),
            "{}",
            &t[t.len() - 80..]
        );
    }
}
