//! Reading a characterization matrix (`npu-interference characterize
//! --json`) from a file named by an operator or a management client: a
//! regular file of bounded size, opened without blocking.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use thiserror::Error;

use crate::characterize::Matrix;

/// Largest characterization matrix read (the fifteen-workload one is
/// about 2 MB).
pub const MAX_MATRIX_BYTES: u64 = 64 << 20;

/// Why a matrix file cannot be used.
#[derive(Debug, Error)]
pub enum MatrixFileError {
    #[error("cannot read matrix {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("matrix {path} is not a characterization matrix: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

impl Matrix {
    /// Reads and parses the matrix at `path`, which must be a regular file
    /// of at most [`MAX_MATRIX_BYTES`].
    pub fn load(path: &Path) -> Result<Matrix, MatrixFileError> {
        let path_text = || path.display().to_string();
        let bytes = read_regular_file(path, MAX_MATRIX_BYTES)
            .map_err(|source| MatrixFileError::Read { path: path_text(), source })?;
        serde_json::from_slice(&bytes).map_err(|source| MatrixFileError::Parse { path: path_text(), source })
    }
}

/// The contents of `path`, which must be a regular file of at most `max`
/// bytes. Opened without blocking (`O_NONBLOCK`), so a FIFO or a device
/// fails at once instead of holding the caller (the daemon reads a matrix
/// while it serves a management request).
pub fn read_regular_file(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    if meta.len() > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} bytes, more than the {max} a matrix may have", meta.len()),
        ));
    }
    let mut bytes = Vec::new();
    f.take(max + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO (which would block an open for reading until a writer
    /// comes), a directory and a file past the limit are refused at once.
    #[test]
    fn only_regular_files_of_bounded_size_are_read() {
        let dir = std::env::temp_dir().join(format!("vnpu-matrix-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_default();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap_or_default();
        // SAFETY: mkfifo(3) reads a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || {
            let _ = tx.send(read_regular_file(&path, 1024).is_err());
        });
        let refused = rx.recv_timeout(std::time::Duration::from_secs(2));
        assert_eq!(refused, Ok(true), "opening the FIFO blocked, or it was read");
        assert!(read_regular_file(&dir, 1024).is_err());
        let big = dir.join("big");
        std::fs::write(&big, vec![b' '; 2048]).unwrap_or_default();
        assert!(read_regular_file(&big, 1024).is_err());
        assert_eq!(read_regular_file(&big, 4096).map(|b| b.len()).ok(), Some(2048));
        assert!(matches!(Matrix::load(&big), Err(MatrixFileError::Parse { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
