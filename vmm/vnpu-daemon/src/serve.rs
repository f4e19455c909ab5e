//! The vfio-user socket of one vNPU instance: a thread that serves one VMM
//! at a time until it disconnects (or dies: the kernel closes its end),
//! then frees the vNPU's engines and waits for the next; and a thread that
//! accepts connections, handing one to the first thread when it is free
//! and answering any other with an `EBUSY` error reply at once.

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

/// Who holds an instance: nobody, or one client from its handover to the
/// serving thread until its teardown is over (with a duplicate of its
/// socket, to watch it hang up and shut it down, when one could be made).
enum Holder {
    Free,
    Held(Option<UnixStream>),
}

/// A vNPU instance being served on its socket.
pub struct InstanceServer {
    path: PathBuf,
    /// Set before the listener is shut down: the accept loop's end.
    stopping: Arc<AtomicBool>,
    client: Arc<Mutex<Holder>>,
    /// The accepting thread, then the serving thread.
    threads: Vec<JoinHandle<()>>,
    /// Shared with the threads; its listener is shut down to stop them.
    server: Arc<Server>,
}

/// How long a refused client has to send its first message before the
/// daemon hangs up on it without an answer.
const REFUSE_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// How long a new client waits for the teardown of one that has just
/// hung up (its worker stops within a request's host work) before it is
/// refused as if that one were still there.
const TEARDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether the peer of `s` has closed its end (or the socket failed).
fn hung_up(s: &UnixStream) -> bool {
    let mut fd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: poll(2) on one valid pollfd (the stream is borrowed for the
    // call) with a zero timeout; it only writes `revents`.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
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
    /// a time, each with a fresh backend from `factory`. Its serving
    /// threads may open files in `files` only (the session folder the
    /// backends keep their state in), when the daemon's system-call
    /// filter is installed (`seccomp::confine_instance_thread`).
    pub fn start(
        path: &Path,
        name: &str,
        files: Option<&Path>,
        factory: BackendFactory,
    ) -> Result<Self, ServeError> {
        let files = files.map(Path::to_path_buf);
        let server = Server::new(path, true, irqs(), regions())
            .map_err(|source| ServeError::Socket { path: path.to_path_buf(), source })?
            .with_max_dma_maps(u32::try_from(crate::backend::MAX_DMA_MAPS).unwrap_or(u32::MAX));
        let server = Arc::new(server);
        // Held from the accepting thread's handover until the serving
        // thread's teardown is over.
        let client = Arc::new(Mutex::new(Holder::Free));
        let current = Arc::clone(&client);
        let label = name.to_string();
        let stopping = Arc::new(AtomicBool::new(false));
        let (handover, clients) = std::sync::mpsc::sync_channel::<UnixStream>(1);
        let kept = Arc::clone(&server);
        let serving = {
            let (server, label) = (Arc::clone(&server), label.clone());
            let stop = Arc::clone(&stopping);
            std::thread::Builder::new().name(format!("vfio-user {name}")).spawn(move || {
                if let Err(e) = crate::seccomp::confine_instance_thread(files.as_deref()) {
                    log::error!("{label}: {e}; serving without the instance filter");
                }
                while let Ok(stream) = clients.recv() {
                    // `current` (set by the accepting thread at the handover)
                    // is what `stop` shuts down after setting `stopping`.
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    // Who the client is, for its session (a resume is
                    // taken only from the process that started it).
                    let who = crate::peer::peer(&stream)
                        .map(|p| vnpu_device::Client { pid: p.pid, uid: p.uid })
                        .map_err(|e| log::warn!("{label}: the client's credentials: {e}"))
                        .ok();
                    match factory().map(|b| match who {
                        Some(c) => b.for_client(c),
                        None => b,
                    }) {
                        Ok(mut backend) => {
                            log::info!("{label}: client attached");
                            match server.serve(stream, &mut backend) {
                                Ok(()) => log::info!("{label}: client detached"),
                                Err(e) => log::warn!("{label}: client dropped: {e}"),
                            }
                            // Dropping the backend stops the vNPU's worker
                            // and frees its engines for the next client. A
                            // client that left while the daemon serves on
                            // left for good: its session is forgotten. One
                            // cut off by a stop may resume after a restart.
                            if stop.load(Ordering::SeqCst) {
                                drop(backend);
                            } else {
                                backend.close_for_good();
                            }
                        }
                        Err(e) => log::error!("{label}: cannot serve a client: {e}"),
                    }
                    // Held until the teardown is over: a client arriving
                    // meanwhile sees this one hung up and waits for it.
                    *lock(&current) = Holder::Free;
                }
            })
        }
        .map_err(ServeError::Thread)?;
        let stop = Arc::clone(&stopping);
        let watched = Arc::clone(&client);
        let accepting =
            std::thread::Builder::new().name(format!("vfio-user accept {name}")).spawn(move || {
                while let Some((stream, _)) =
                    crate::accept::accept_retrying(&label, &stop, || server.listener().accept())
                {
                    // Free: this client is handed over, and watched from
                    // then on (so a successor that arrives before the
                    // serving thread takes it sees it hang up, and `stop`
                    // can shut it down). Busy with a client that has hung
                    // up: its teardown is waited for. Busy otherwise: EBUSY.
                    let t = std::time::Instant::now();
                    let free = loop {
                        let mut c = lock(&watched);
                        if matches!(*c, Holder::Free) {
                            *c = Holder::Held(stream.try_clone().ok());
                            break true;
                        }
                        let leaving = matches!(&*c, Holder::Held(Some(s)) if hung_up(s));
                        drop(c);
                        if !leaving || t.elapsed() > TEARDOWN_WAIT {
                            break false;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    };
                    if !free {
                        log::warn!("{label}: another client refused (EBUSY): one VMM at a time");
                        vfio_user::refuse_client(stream, libc::EBUSY.unsigned_abs(), REFUSE_WAIT);
                        continue;
                    }
                    if handover.send(stream).is_err() {
                        break;
                    }
                }
                // Dropping `handover` ends the serving thread.
            });
        let accepting = match accepting {
            Ok(t) => t,
            Err(e) => {
                // The serving thread ends with the channel's sender.
                let _ = serving.join();
                return Err(ServeError::Thread(e));
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            stopping,
            client,
            threads: vec![accepting, serving],
            server: kept,
        })
    }

    /// Whether a VMM is attached now (or its teardown is not over).
    pub fn attached(&self) -> bool {
        matches!(*lock(&self.client), Holder::Held(_))
    }

    /// Disconnects the client, if any, stops serving and removes the socket.
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        if let Holder::Held(Some(c)) = &*lock(&self.client) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        // SAFETY: shutdown(2) on the listening socket of the `Server` this
        // value keeps, so the descriptor is open. It only makes the
        // blocked accept() fail, so the threads end.
        unsafe { libc::shutdown(self.server.listener().as_raw_fd(), libc::SHUT_RDWR) };
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // The socket goes with the instance (the `Server`, which would
        // remove it when dropped, lives as long as this value).
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for InstanceServer {
    fn drop(&mut self) {
        self.stop();
    }
}
