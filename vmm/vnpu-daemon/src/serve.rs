//! The vfio-user socket of one vNPU instance: a thread that accepts one
//! VMM at a time and serves it until it disconnects (or dies: the kernel
//! closes its end), then frees the vNPU's engines and waits for the next.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use thiserror::Error;
use vfio_user::Server;

use crate::backend::{irqs, regions, BackendError, VnpuBackend};

/// Why an instance's socket could not be served.
#[derive(Debug, Error)]
pub enum ServeError {
    #[error("socket {path}: {source}")]
    Socket { path: PathBuf, source: vfio_user::Error },
    #[error("thread: {0}")]
    Thread(std::io::Error),
}

/// Builds the backend for each new connection.
pub type BackendFactory = Box<dyn Fn() -> Result<VnpuBackend, BackendError> + Send>;

/// A vNPU instance being served on its socket.
pub struct InstanceServer {
    path: PathBuf,
    listener_fd: i32,
    /// Set before the listener is shut down: the accept loop's end.
    stopping: Arc<AtomicBool>,
    client: Arc<Mutex<Option<UnixStream>>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for InstanceServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstanceServer").field("path", &self.path).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl InstanceServer {
    /// Serves the instance at `path` (which must not exist), one client at
    /// a time, each with a fresh backend from `factory`.
    pub fn start(path: &Path, name: &str, factory: BackendFactory) -> Result<Self, ServeError> {
        let server = Server::new(path, true, irqs(), regions())
            .map_err(|source| ServeError::Socket { path: path.to_path_buf(), source })?
            .with_max_dma_maps(u32::try_from(crate::backend::MAX_DMA_REGIONS).unwrap_or(u32::MAX));
        let listener_fd = server.listener().as_raw_fd();
        let client: Arc<Mutex<Option<UnixStream>>> = Arc::default();
        let current = Arc::clone(&client);
        let label = name.to_string();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&stopping);
        let thread = std::thread::Builder::new()
            .name(format!("vfio-user {name}"))
            .spawn(move || {
                while let Some((stream, _)) =
                    crate::accept::accept_retrying(&label, &stop, || server.listener().accept())
                {
                    let mut backend = match factory() {
                        Ok(b) => b,
                        Err(e) => {
                            log::error!("{label}: cannot serve a client: {e}");
                            continue;
                        }
                    };
                    *lock(&current) = stream.try_clone().ok();
                    log::info!("{label}: client attached");
                    match server.serve(stream, &mut backend) {
                        Ok(()) => log::info!("{label}: client detached"),
                        Err(e) => log::warn!("{label}: client dropped: {e}"),
                    }
                    *lock(&current) = None;
                    // Dropping the backend stops the vNPU's worker and frees
                    // its engines for the next client.
                    drop(backend);
                }
            })
            .map_err(ServeError::Thread)?;
        Ok(Self { path: path.to_path_buf(), listener_fd, stopping, client, thread: Some(thread) })
    }

    /// Whether a VMM is attached now.
    pub fn attached(&self) -> bool {
        lock(&self.client).is_some()
    }

    /// Disconnects the client, if any, stops serving and removes the socket.
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        if let Some(c) = lock(&self.client).as_ref() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        // SAFETY: shutdown(2) on the listening socket, which the server
        // thread owns and keeps open until it returns: it only makes the
        // blocked accept() fail, so the thread ends.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for InstanceServer {
    fn drop(&mut self) {
        self.stop();
    }
}
