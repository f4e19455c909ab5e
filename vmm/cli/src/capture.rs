//! A guest console the CLI keeps a copy of (to parse or to print later),
//! optionally echoing it to stdout as it comes.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// A clonable console writer; every clone appends to the same buffer.
#[derive(Clone, Default)]
pub struct Capture {
    buf: Arc<Mutex<Vec<u8>>>,
    echo: bool,
}

impl Capture {
    /// A capture that also writes everything to stdout.
    pub fn echoing() -> Self {
        Self { echo: true, ..Self::default() }
    }

    /// What was written so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.buf.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
            .to_string()
    }
}

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(b);
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
