//! The `vfio_user_session` fuzz target's harness: whole hostile vfio-user
//! sessions against a served instance: connections opened and dropped,
//! messages well framed or not, each maybe carrying a descriptor (sealed or
//! unsealed memory, an eventfd, a pipe). Afterwards an honest VMM must still
//! attach and read the device, and the instance must stop: nothing a client
//! does to one connection may panic the daemon, wedge the instance or leave
//! it unable to serve the next client.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use vnpu_daemon::serve::BackendFactory;
use vnpu_daemon::{InstanceServer, VnpuBackend};

/// One step of a session.
enum Step {
    /// A new connection (the current one, if any, is closed).
    Connect,
    /// Bytes as they come, with no framing.
    Raw(Vec<u8>),
    /// A well-framed message: a header for `command` and `payload`.
    Message { command: u16, payload: Vec<u8>, fd: Attached },
}

/// The descriptor a message carries.
#[derive(Clone, Copy)]
enum Attached {
    None,
    /// A memfd of that many bytes, sealed against shrinking and growing.
    Sealed(usize),
    /// The same, unsealed (the daemon must refuse it).
    Unsealed(usize),
    EventFd,
    Pipe,
}

/// Most steps, and most connections, of one session: each connection's
/// teardown stops a worker, so a run stays well inside the fuzzer's 5 s.
const MAX_STEPS: usize = 64;
const MAX_CONNECTIONS: usize = 8;

/// Decodes `data` into steps (every input is some session).
fn steps(data: &[u8]) -> Vec<Step> {
    fn take(n: usize, it: &mut dyn Iterator<Item = u8>) -> Vec<u8> {
        it.take(n).collect()
    }
    let mut it = data.iter().copied();
    let mut out = Vec::new();
    let mut connects = 0;
    while let Some(op) = it.next() {
        if out.len() == MAX_STEPS {
            break;
        }
        match op % 4 {
            0 if connects < MAX_CONNECTIONS => {
                connects += 1;
                out.push(Step::Connect);
            }
            0 => {}
            1 => {
                let n = usize::from(it.next().unwrap_or(0)) * 4;
                out.push(Step::Raw(take(n, &mut it)));
            }
            _ => {
                // 0-18: every command through migration v2's.
                let command = u16::from(it.next().unwrap_or(0) % 19);
                let n = usize::from(it.next().unwrap_or(0));
                let payload = take(n, &mut it);
                let size = usize::from(it.next().unwrap_or(1)) << 16;
                let fd = match it.next().unwrap_or(0) % 5 {
                    1 => Attached::Sealed(size),
                    2 => Attached::Unsealed(size),
                    3 => Attached::EventFd,
                    4 => Attached::Pipe,
                    _ => Attached::None,
                };
                out.push(Step::Message { command, payload, fd });
            }
        }
    }
    out
}

/// A connection with its replies drained on a thread of their own.
struct Conn {
    stream: UnixStream,
    drain: std::thread::JoinHandle<()>,
}

impl Conn {
    fn open(path: &Path) -> Option<Self> {
        let stream = UnixStream::connect(path).ok()?;
        // A step never waits long on a server that stopped reading.
        stream.set_write_timeout(Some(Duration::from_millis(200))).ok()?;
        let mut replies = stream.try_clone().ok()?;
        let drain = std::thread::spawn(move || {
            let mut sink = [0u8; 4096];
            while matches!(replies.read(&mut sink), Ok(n) if n > 0) {}
        });
        Some(Self { stream, drain })
    }

    fn close(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let _ = self.drain.join();
    }
}

/// A descriptor of `kind`, or `None` when the host cannot make one.
fn descriptor(kind: Attached) -> Option<OwnedFd> {
    let memfd = |size: usize, seal: bool| {
        // SAFETY: memfd_create with a NUL-terminated name and valid flags;
        // the result is checked before it is owned.
        let fd = unsafe { libc::memfd_create(c"vnpu-fuzz".as_ptr(), libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned here only.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = libc::off_t::try_from(size).ok()?;
        // SAFETY: ftruncate and fcntl on the descriptor owned above.
        unsafe {
            if libc::ftruncate(owned.as_raw_fd(), len) != 0 {
                return None;
            }
            if seal {
                libc::fcntl(owned.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
            }
        }
        Some(owned)
    };
    match kind {
        Attached::None => None,
        Attached::Sealed(size) => memfd(size, true),
        Attached::Unsealed(size) => memfd(size, false),
        Attached::EventFd => vmm_sys_util::eventfd::EventFd::new(0).ok().map(|e| {
            // SAFETY: dup of the eventfd's valid descriptor; the copy is owned.
            let fd = unsafe { libc::dup(e.as_raw_fd()) };
            // SAFETY: checked below: a negative result is not owned.
            (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
        })?,
        Attached::Pipe => {
            let mut fds = [0i32; 2];
            // SAFETY: pipe(2) into a two-element array.
            if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
                return None;
            }
            // SAFETY: both descriptors were just created and are owned here only.
            let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            drop(r);
            Some(w)
        }
    }
}

/// Runs the session `data` describes against a fresh instance, then checks
/// that an honest client is served and that the instance stops.
pub fn run_session(data: &[u8]) {
    static SESSIONS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("vnpu-fuzz-session-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let path = dir.join(format!("{}.sock", SESSIONS.fetch_add(1, Ordering::Relaxed)));
    let Ok(spec) = vnpu_spec::VnpuSpec::parse("sa=1,vu=1,sram=2M,hbm=256M") else { return };
    let factory: BackendFactory = Box::new(move || {
        VnpuBackend::new(&spec, &npu_model::BoardConfig::default(), "fuzz", Default::default())
    });
    let Ok(mut server) = InstanceServer::start(&path, "fuzz", None, factory) else { return };
    let mut conn: Option<Conn> = None;
    let mut id = 0u16;
    for step in steps(data) {
        if matches!(step, Step::Connect) || conn.is_none() {
            if let Some(c) = conn.take() {
                c.close();
            }
            conn = Conn::open(&path);
        }
        let Some(c) = conn.as_mut() else { break };
        let (bytes, fd) = match step {
            Step::Connect => continue,
            Step::Raw(b) => (b, None),
            Step::Message { command, payload, fd } => {
                id = id.wrapping_add(1);
                let size = u32::try_from(16 + payload.len()).unwrap_or(u32::MAX);
                let mut m = Vec::with_capacity(16 + payload.len());
                m.extend_from_slice(&id.to_le_bytes());
                m.extend_from_slice(&command.to_le_bytes());
                m.extend_from_slice(&size.to_le_bytes());
                m.extend_from_slice(&0u32.to_le_bytes());
                m.extend_from_slice(&0u32.to_le_bytes());
                m.extend_from_slice(&payload);
                (m, descriptor(fd))
            }
        };
        let fds: Vec<i32> = fd.iter().map(AsRawFd::as_raw_fd).collect();
        if c.stream.send_with_fds(&[&bytes[..]], &fds).is_err() {
            // The server hung up on this connection: the next step opens another.
            if let Some(c) = conn.take() {
                c.close();
            }
        }
    }
    if let Some(c) = conn.take() {
        c.close();
    }
    // An honest VMM is served after whatever came before.
    let mut honest = match vfio_user::Client::new_with_timeout(&path, Some(Duration::from_secs(20))) {
        Ok(c) => c,
        Err(e) => panic!("an honest client cannot attach after the session: {e}"),
    };
    let mut magic = [0u8; 4];
    if let Err(e) = honest.region_read(0, vnpu_abi::device::regs::MAGIC, &mut magic) {
        panic!("an honest client cannot read the device after the session: {e}");
    }
    assert_eq!(u32::from_le_bytes(magic), vnpu_abi::device::MAGIC, "the device answers garbage");
    drop(honest);
    server.stop();
    let _ = std::fs::remove_file(&path);
}
